"""DCP's ``.metadata`` read without running code (DCP's own ``pickle.load`` would run a downloaded checkpoint's), and
checked before anything trusts it. :func:`read_metadata` unpickles with an allow-list of exactly the types DCP's
metadata is made of; :func:`check_metadata` checks every value fzero and DCP read (chunks tile their tensor, one record
per chunk in a plain data file, records do not overlap, no transforms). Failures: :class:`CheckpointCorruptError`.

Imports: errors, files.
"""

from __future__ import annotations

import io
import math
import pathlib
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint.filesystem as dcp_fs
import torch.distributed.checkpoint.metadata as dcp_md
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from .errors import CheckpointCorruptError, corrupt
from .files import Files

__all__ = ["METADATA_FILE", "FZERO_KEY", "read_metadata", "unpickle_metadata", "check_metadata", "DTYPES"]

METADATA_FILE = ".metadata"
CHECKSUMS_FILE = "checksums.json"  # written by .checksums; named here, the one file a record may not be
# Metadata.planner_data holds {FZERO_KEY: {...}} in checkpoints fzero writes (see .checksums)
FZERO_KEY = "fzero"

DTYPES = {str(v): v for v in vars(torch).values() if isinstance(v, torch.dtype)}
_LAYOUTS = {str(v) for v in vars(torch).values() if isinstance(v, torch.layout)}

_METADATA_TYPES = ("Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
                   "ChunkStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")


def _allowed() -> dict[tuple[str, str], Any]:
    """Every global DCP's metadata pickle refers to: nothing else can be loaded."""
    allowed: dict[tuple[str, str], Any] = {(dcp_md.__name__, n): getattr(dcp_md, n) for n in _METADATA_TYPES}
    allowed[(dcp_fs.__name__, "_StorageInfo")] = dcp_fs._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed.update({("torch", str(d).removeprefix("torch.")): d for d in DTYPES.values()})
    allowed[("torch.serialization", "_get_layout")] = _layout  # how torch pickles a layout
    # StorageMeta.checkpoint_id: the path DCP saved to (information only)
    for name in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"):
        allowed[("pathlib", name)] = pathlib.PurePosixPath if "Windows" not in name else pathlib.PureWindowsPath
    return allowed


def _layout(name: Any) -> torch.layout:
    if not isinstance(name, str) or name not in _LAYOUTS:
        raise pickle.UnpicklingError(f"unknown tensor layout {name!r}")
    return getattr(torch, name.removeprefix("torch."))


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that can build DCP's metadata and nothing else."""

    ALLOWED = _allowed()

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self.ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"it refers to {module}.{name}, which is not part of checkpoint "
                                         "metadata (loading it could run code)") from None

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it holds a persistent reference, which checkpoint metadata never does")


def unpickle_metadata(d: Path, blob: bytes) -> Metadata:
    """The :class:`Metadata` pickled in ``blob`` (the bytes of ``d/.metadata``), built with the allow-list
    only; :class:`CheckpointCorruptError` naming the file for anything else."""
    try:
        md = _MetadataUnpickler(io.BytesIO(blob)).load()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - any failure to decode means the same thing
        raise corrupt(d, f"file {METADATA_FILE} cannot be read as checkpoint metadata ({type(e).__name__}: "
                         f"{_first_line(e)}); nothing in it was run") from e
    if not isinstance(md, Metadata):
        raise corrupt(d, f"file {METADATA_FILE} holds a {type(md).__name__}, not checkpoint metadata")
    return md


def _first_line(e: BaseException) -> str:
    text = str(e)
    return text.splitlines()[0] if text else ""


def read_metadata(d: Path, files: Files | None = None) -> tuple[Metadata, bytes]:
    """``d/.metadata`` unpickled with the allow-list and checked (:func:`check_metadata`), and its bytes."""
    blob = read_bytes(d, METADATA_FILE, files)
    md = unpickle_metadata(d, blob)
    check_metadata(d, md)
    return md, blob


def read_bytes(d: Path, name: str, files: Files | None = None, limit: int | None = None) -> bytes:
    """``d/name`` read as ``files`` allows (default: inside ``d``), at most ``limit`` bytes (default
    :data:`~.files.METADATA_LIMIT`)."""
    files = Files.of(d) if files is None else files
    try:
        return files.read(d / name, limit)
    except OSError as e:
        raise CheckpointCorruptError(f"checkpoint {d}: file {name} cannot be read ({e})") from e


def _fail(d: Path, what: str) -> CheckpointCorruptError:
    return corrupt(d, f"file {METADATA_FILE} is damaged: {what}")


def _is_shape(x: Any, ndim: int | None = None) -> bool:
    return (isinstance(x, torch.Size) and all(isinstance(n, int) and n >= 0 for n in x)
            and (ndim is None or len(x) == ndim))


def _is_int(x: Any, least: int = 0) -> bool:
    """An ``int`` (not a ``bool``) of at least ``least``."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= least


def check_metadata(d: Path, md: Metadata) -> None:
    """Everything fzero and DCP read from ``md`` has the type and value it must have (see the module doc);
    :class:`CheckpointCorruptError` naming the entry otherwise."""
    try:
        _check_metadata(d, md)
    except CheckpointCorruptError:
        raise
    except Exception as e:  # noqa: BLE001 - a field unpickled under another name, of another type
        raise _fail(d, f"a field is missing or malformed ({type(e).__name__}: {_first_line(e)})") from e


def _check_metadata(d: Path, md: Metadata) -> None:
    entries, storage = md.state_dict_metadata, md.storage_data
    if not isinstance(entries, dict):
        raise _fail(d, "it has no entry table")
    if not isinstance(storage, dict):
        raise _fail(d, "it has no record table")
    wanted: dict[MetadataIndex, int] = {}  # every record the entries need -> its minimum length
    for key, entry in entries.items():
        if not isinstance(key, str):
            raise _fail(d, f"entry name {key!r} is not a string")
        if isinstance(entry, BytesStorageMetadata):
            wanted[MetadataIndex(key)] = 0
        elif isinstance(entry, TensorStorageMetadata):
            wanted.update(_tensor_chunks(d, key, entry))
        else:
            raise _fail(d, f"entry {key!r} is a {type(entry).__name__}, neither a tensor nor bytes")
    spans: dict[str, list[tuple[int, int, str]]] = {}
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, dcp_fs._StorageInfo):
            raise _fail(d, f"record {index!r} is not a record of a DCP checkpoint")
        key = index.fqn
        if index not in wanted:
            raise _fail(d, f"it lists a record of entry {key!r} at {_at(index)} that no entry has")
        if not _is_plain_file(info.relative_path):
            raise _fail(d, f"entry {key!r}: data file {info.relative_path!r} is not a file name of the checkpoint")
        if not (_is_int(info.offset) and _is_int(info.length)):
            raise _fail(d, f"entry {key!r}: record position {info.offset!r}+{info.length!r} is not a byte range")
        if getattr(info, "transform_descriptors", None):
            raise _fail(d, f"entry {key!r}: its record asks for transforms {info.transform_descriptors!r}, "
                           "which fzero never writes")
        if info.length < wanted[index]:
            raise _fail(d, f"entry {key!r}: its record at {_at(index)} has {info.length} bytes, fewer than "
                           f"the {wanted[index]} its values need")
        spans.setdefault(info.relative_path, []).append((info.offset, info.offset + info.length, key))
    missing = [i for i in wanted if i not in storage]
    if missing:
        raise _fail(d, f"entry {missing[0].fqn!r} has no record for its chunk at {_at(missing[0])}")
    for file, ranges in spans.items():
        ranges.sort()
        for (_, end, a), (start, _, b) in zip(ranges, ranges[1:]):
            if start < end:
                raise _fail(d, f"the records of entries {a!r} and {b!r} overlap in data file {file}")


def _at(index: MetadataIndex) -> str:
    return "the start" if index.offset is None else f"offset {list(index.offset)}"


def _is_plain_file(name: Any) -> bool:
    """A file of the checkpoint directory itself: no directory part, not hidden, not ours."""
    return (isinstance(name, str) and bool(name) and "/" not in name and "\\" not in name and "\0" not in name
            and not name.startswith(".") and name != CHECKSUMS_FILE)


def _tensor_chunks(d: Path, key: str, entry: TensorStorageMetadata) -> list[tuple[MetadataIndex, int]]:
    """``[(record index, least bytes it needs)]`` for the chunks of a tensor entry, once they lie inside the
    tensor, do not overlap and cover every element."""
    props, size, chunks = entry.properties, entry.size, entry.chunks
    if not isinstance(props, TensorProperties) or not isinstance(props.dtype, torch.dtype):
        raise _fail(d, f"entry {key!r} has no dtype")
    if not _is_shape(size):
        raise _fail(d, f"entry {key!r}: size {size!r} is not a shape")
    if not isinstance(chunks, list) or not all(isinstance(c, ChunkStorageMetadata) for c in chunks):
        raise _fail(d, f"entry {key!r}: its chunk list is damaged")
    itemsize = torch.empty((), dtype=props.dtype).element_size()
    for c in chunks:
        if not (_is_shape(c.offsets, len(size)) and _is_shape(c.sizes, len(size))):
            raise _fail(d, f"entry {key!r}: chunk {c.offsets!r} {c.sizes!r} does not fit its {len(size)} dimensions")
        if any(o + n > s for o, n, s in zip(c.offsets, c.sizes, size)):
            raise _fail(d, f"entry {key!r}: chunk at {list(c.offsets)} of {list(c.sizes)} lies outside "
                           f"its size {list(size)}")
    _check_disjoint(d, key, [(c.offsets, c.sizes) for c in chunks])
    covered, numel = sum(math.prod(c.sizes) for c in chunks), math.prod(size)
    if covered != numel:
        raise _fail(d, f"entry {key!r}: its chunks hold {covered} of its {numel} elements")
    return [(MetadataIndex(key, c.offsets), math.prod(c.sizes) * itemsize) for c in chunks]


def _check_disjoint(d: Path, key: str, boxes: list[tuple[torch.Size, torch.Size]]) -> None:
    """No two chunks share an element (with the volume check: the chunks tile the tensor)."""
    boxes = sorted(boxes)
    if all(len(o) == 1 for o, _ in boxes):  # fzero's sharded entries: neighbours suffice
        pairs = list(zip(boxes, boxes[1:]))
    else:
        pairs = [(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:]]
    for (o, n), (p, m) in pairs:
        if all(max(a, b) < min(a + x, b + y) for a, x, b, y in zip(o, n, p, m)) and math.prod(n) and math.prod(m):
            raise _fail(d, f"entry {key!r}: chunks at {list(o)} and {list(p)} overlap")


def fzero_marks(md: Metadata) -> dict[str, Any]:
    """What fzero recorded in the metadata when it saved (``{}`` for checkpoints of other writers)."""
    data = md.planner_data
    marks = data.get(FZERO_KEY) if isinstance(data, dict) else None
    return marks if isinstance(marks, dict) else {}
