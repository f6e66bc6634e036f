"""DCP's ``.metadata`` read without running code (DCP's own ``pickle.load`` would run a downloaded checkpoint's), and
checked before anything trusts it. :func:`read_metadata` unpickles with an allow-list of exactly the types DCP's
metadata is made of; :func:`check_metadata` checks every value fzero and DCP read (chunks tile their tensor, one record
per chunk in a plain data file, records do not overlap, no transforms). Failures: :class:`CheckpointCorruptError`.

The file is untrusted even where its checksums match (a forger recomputes them), so reading it is bounded by its bytes,
not by what it claims: the unpickler refuses a dict key or a call argument it cannot hash or compare in bounded time
(a structure of shared references, 12 kB on disk, is 2**60 items when walked), every field is checked for its type and
size before it is used (shapes: at most :data:`MAX_DIMS` non-negative ints below :data:`MAX_EXTENT`; names: strings of
at most :data:`NAME_LIMIT` characters), chunk overlap is found by sorting (O(n log n) for chunks that form a grid;
other layouts within :data:`OVERLAP_TESTS` comparisons), and a message shows a value cut short (:func:`~.errors.shown`). The claimed extents are checked against the data files on disk by :mod:`.manifest`.

Imports: errors, files.
"""

from __future__ import annotations

import enum
import heapq
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

from .errors import CheckpointCorruptError, corrupt, shown
from .files import NAME_MAX, Files

__all__ = ["METADATA_FILE", "FZERO_KEY", "read_metadata", "unpickle_metadata", "check_metadata", "DTYPES", "MAX_DIMS",
           "MAX_EXTENT", "NAME_LIMIT", "OVERLAP_TESTS"]

METADATA_FILE = ".metadata"
CHECKSUMS_FILE = "checksums.json"  # written by .checksums; named here, the one file a record may not be
# Metadata.planner_data holds {FZERO_KEY: {...}} in checkpoints fzero writes (see .checksums)
FZERO_KEY = "fzero"

# The bounds of a field's value. A shape has at most MAX_DIMS dimensions (torch's own limit for a tensor)
# and no tensor holds MAX_EXTENT elements or bytes or more (torch counts them in int64); an entry or data file name is
# a parameter path or file name, far shorter than NAME_LIMIT characters.
MAX_DIMS = 64
MAX_EXTENT = 1 << 63
NAME_LIMIT = 4096
# items a container of the pickle may be built from at once (the pickler writes lists and dicts in batches of 1,000):
# a tuple of ten million ints is refused as it is read, not once it is built
ITEMS_LIMIT = 1 << 16
# comparisons the overlap check may make for one entry whose chunks are not a grid (a grid is checked in O(n log n))
OVERLAP_TESTS = 1 << 20

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
        raise pickle.UnpicklingError(f"unknown tensor layout {shown(name)}")
    return getattr(torch, name.removeprefix("torch."))


def _is_name(x: Any) -> bool:
    """A string of at most :data:`NAME_LIMIT` characters."""
    return isinstance(x, str) and len(x) <= NAME_LIMIT


def _is_int(x: Any, least: int = 0) -> bool:
    """An ``int`` (not a ``bool``) of at least ``least`` and below :data:`MAX_EXTENT`."""
    return isinstance(x, int) and not isinstance(x, bool) and least <= x < MAX_EXTENT


def _is_flat(x: Any) -> bool:
    """A value hashed or compared in time bounded by its own size: a scalar, a bounded string, or a tuple or list of
    such scalars (a shape's dimensions, a path's parts)."""
    if isinstance(x, (tuple, list)):
        return all(_is_scalar(v) for v in x)
    return _is_scalar(x)


def _is_scalar(x: Any) -> bool:
    if isinstance(x, int) and not isinstance(x, enum.Enum):
        return isinstance(x, bool) or -MAX_EXTENT <= x < MAX_EXTENT
    return x is None or isinstance(x, (float, bytes, torch.dtype, torch.layout, enum.Enum)) or _is_name(x)


def _index_problem(fields: Any) -> str | None:
    """What is wrong with a ``MetadataIndex``'s fields (a mapping of them), or None: ``fqn`` a name, ``offset`` None
    or a shape, ``index`` None or an int. Checked before the index is hashed (a dict key) or compared."""
    if not isinstance(fields, dict):
        return f"a record index has fields {shown(fields)}"
    unknown = set(fields) - {"fqn", "offset", "index"} if all(isinstance(k, str) for k in fields) else {"?"}
    if unknown:
        return f"a record index has unknown fields {shown(sorted(map(str, unknown)))}"
    fqn, offset, index = fields.get("fqn"), fields.get("offset"), fields.get("index")
    if not _is_name(fqn):
        return f"a record index names entry {shown(fqn)}, not a name"
    if not (offset is None or _is_shape(offset)):
        return f"the record index of entry {shown(fqn)} has offset {shown(offset)}, not a shape"
    if not (index is None or _is_int(index)):
        return f"the record index of entry {shown(fqn)} has index {shown(index)}"
    return None


class _MetadataUnpickler(pickle._Unpickler):
    """An unpickler that can build DCP's metadata and nothing else, in time and memory bounded by the file: the
    allow-list of globals, and checks on what the pickle machine would otherwise hash or call blindly (dict keys, call
    arguments, a record index's fields, a state a class sets itself). Python's unpickler, whose steps can be checked
    (C's cannot): about 3x slower than C's, on a file of at most :data:`~.files.METADATA_LIMIT` bytes."""

    ALLOWED = _allowed()
    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self.ALLOWED[(module, name)]
        except (KeyError, TypeError):
            where = f"{module}.{name}"  # two strings (the pickle machine checks), cut: they come from the file
            where = where if len(where) <= 200 else where[:197] + "..."
            raise pickle.UnpicklingError(f"it refers to {where}, which is not part of checkpoint metadata (loading it "
                                         "could run code)") from None

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it holds a persistent reference, which checkpoint metadata never does")

    def _bound_stack(self) -> None:
        """Pushes onto the items being collected refused beyond :data:`ITEMS_LIMIT` (the machine appends through
        ``self.append``, set anew at each mark)."""
        stack, push = self.stack, self.stack.append

        def append(x: Any) -> None:
            if len(stack) >= ITEMS_LIMIT:
                raise pickle.UnpicklingError(f"it builds a container of more than {ITEMS_LIMIT} items at once, which "
                                             "checkpoint metadata never does")
            push(x)

        self.append = append

    def load_proto(self) -> None:
        pickle._Unpickler.load_proto(self)
        self._bound_stack()

    def load_mark(self) -> None:
        pickle._Unpickler.load_mark(self)
        self._bound_stack()

    def pop_mark(self) -> list[Any]:
        items = pickle._Unpickler.pop_mark(self)
        self._bound_stack()
        return items

    def _check_key(self, key: Any) -> None:
        """A dict key is a name, a bounded int or a checked record index: anything else could take unbounded
        time to hash."""
        if isinstance(key, MetadataIndex):
            problem = _index_problem(dict(vars(key)))
            if problem is not None:
                raise pickle.UnpicklingError(problem)
        elif not (_is_name(key) or _is_int(key, -MAX_EXTENT)):
            raise pickle.UnpicklingError(f"a dict key is {shown(key)}, which checkpoint metadata never has")

    def load_setitem(self) -> None:
        self._check_key(self.stack[-2])
        pickle._Unpickler.load_setitem(self)

    def load_setitems(self) -> None:
        for key in self.stack[::2]:  # the stack holds the items pushed since the mark: key, value, key, value...
            self._check_key(key)
        pickle._Unpickler.load_setitems(self)

    def load_dict(self) -> None:
        for key in self.stack[::2]:
            self._check_key(key)
        pickle._Unpickler.load_dict(self)

    def _check_args(self, f: Any, args: Any) -> None:
        """A call's arguments are flat (:func:`_is_flat`): a class called with a structure of shared references
        could hash it (an enum looks its value up)."""
        if not (isinstance(args, tuple) and all(_is_flat(a) for a in args)):
            raise pickle.UnpicklingError(f"it calls {_name_of(f)} with arguments {shown(args)}, which checkpoint "
                                         "metadata never has")

    def load_reduce(self) -> None:
        self._check_args(self.stack[-2], self.stack[-1])
        pickle._Unpickler.load_reduce(self)

    def load_newobj(self) -> None:
        self._check_args(self.stack[-2], self.stack[-1])
        pickle._Unpickler.load_newobj(self)

    def load_build(self) -> None:
        """A record index's fields are checked before it can be hashed; a state handed to a class's own
        ``__setstate__`` (``TensorProperties``: a tuple of five values, which it prints when one is wrong) is flat."""
        state, inst = self.stack[-1], self.stack[-2]
        if isinstance(inst, MetadataIndex):
            fields = state[0] if isinstance(state, tuple) and len(state) == 2 and state[1] is None else state
            problem = _index_problem(fields)
            if problem is not None:
                raise pickle.UnpicklingError(problem)
        elif getattr(inst, "__setstate__", None) is not None and not (isinstance(state, tuple) and _is_flat(state)):
            raise pickle.UnpicklingError(f"it sets the state of a {type(inst).__name__} to {shown(state)}, which "
                                         "checkpoint metadata never does")
        pickle._Unpickler.load_build(self)

    def _refused(self) -> None:
        raise pickle.UnpicklingError("it builds a set or calls a class with keywords or the old way, which "
                                     "checkpoint metadata never does")

    dispatch[pickle.PROTO[0]] = load_proto
    dispatch[pickle.MARK[0]] = load_mark
    dispatch[pickle.SETITEM[0]] = load_setitem
    dispatch[pickle.SETITEMS[0]] = load_setitems
    dispatch[pickle.DICT[0]] = load_dict
    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.BUILD[0]] = load_build
    for _op in (pickle.EMPTY_SET, pickle.ADDITEMS, pickle.FROZENSET, pickle.INST, pickle.OBJ, pickle.NEWOBJ_EX):
        dispatch[_op[0]] = _refused
    del _op


def _name_of(f: Any) -> str:
    return shown(getattr(f, "__qualname__", None) or type(f).__name__)


def unpickle_metadata(d: Path, blob: bytes) -> Metadata:
    """The :class:`Metadata` pickled in ``blob`` (the bytes of ``d/.metadata``), built with the allow-list
    only; :class:`CheckpointCorruptError` naming the file for anything else."""
    try:
        if blob[:1] != pickle.PROTO:  # DCP pickles with protocol 2 or later; the stack is bounded from PROTO on
            raise pickle.UnpicklingError("it does not start as a pickle of protocol 2 or later")
        md = _MetadataUnpickler(io.BytesIO(blob)).load()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - any failure to decode means the same thing
        raise corrupt(d, f"file {METADATA_FILE} cannot be read as checkpoint metadata ({type(e).__name__}: "
                         f"{_first_line(e)}); nothing in it was run") from e
    if not isinstance(md, Metadata):
        raise corrupt(d, f"file {METADATA_FILE} holds a {type(md).__name__}, not checkpoint metadata")
    return md


def _first_line(e: BaseException, limit: int = 300) -> str:
    """The first line of ``e``'s message, cut to ``limit`` characters (a message may quote untrusted input)."""
    text = str(e)[: 4 * limit]
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


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
    """A ``torch.Size`` of at most :data:`MAX_DIMS` (or exactly ``ndim``) dimensions, each a non-negative int, holding
    fewer than :data:`MAX_EXTENT` elements."""
    if not (isinstance(x, torch.Size) and len(x) <= MAX_DIMS and (ndim is None or len(x) == ndim)):
        return False
    return all(_is_int(n) for n in x) and math.prod(x) < MAX_EXTENT


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
        if not _is_name(key):
            raise _fail(d, f"entry name {shown(key)} is not a name (a string of at most {NAME_LIMIT} characters)")
        if isinstance(entry, BytesStorageMetadata):
            wanted[MetadataIndex(key)] = 0
        elif isinstance(entry, TensorStorageMetadata):
            wanted.update(_tensor_chunks(d, key, entry))
        else:
            raise _fail(d, f"entry {shown(key)} is a {type(entry).__name__}, neither a tensor nor bytes")
    spans: dict[str, list[tuple[int, int, str]]] = {}
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, dcp_fs._StorageInfo):
            raise _fail(d, f"record {shown(index)} is not a record of a DCP checkpoint")
        key = index.fqn
        if index not in wanted:
            raise _fail(d, f"it lists a record of entry {shown(key)} at {_at(index)} that no entry has")
        if not _is_plain_file(info.relative_path):
            raise _fail(d, f"entry {shown(key)}: data file {shown(info.relative_path)} is not a file name of the "
                           "checkpoint")
        if not (_is_int(info.offset) and _is_int(info.length) and info.offset + info.length < MAX_EXTENT):
            raise _fail(d, f"entry {shown(key)}: record position {shown(info.offset)}+{shown(info.length)} is not a "
                           "byte range")
        if getattr(info, "transform_descriptors", None):
            raise _fail(d, f"entry {shown(key)}: its record asks for transforms {shown(info.transform_descriptors)}, "
                           "which fzero never writes")
        if info.length < wanted[index]:
            raise _fail(d, f"entry {shown(key)}: its record at {_at(index)} has {info.length} bytes, fewer than "
                           f"the {wanted[index]} its values need")
        spans.setdefault(info.relative_path, []).append((info.offset, info.offset + info.length, key))
    missing = next((i for i in wanted if i not in storage), None)
    if missing is not None:
        raise _fail(d, f"entry {shown(missing.fqn)} has no record for its chunk at {_at(missing)}")
    for file, ranges in spans.items():
        ranges.sort()
        for (_, end, a), (start, _, b) in zip(ranges, ranges[1:]):
            if start < end:
                raise _fail(d, f"the records of entries {shown(a)} and {shown(b)} overlap in data file {file}")


def _at(index: MetadataIndex) -> str:
    return "the start" if index.offset is None else f"offset {shown(list(index.offset))}"


def _is_plain_file(name: Any) -> bool:
    """A file of the checkpoint directory itself: no directory part, not hidden, not ours, a name a file system
    can hold."""
    return (isinstance(name, str) and bool(name) and len(name.encode("utf-8", "replace")) <= NAME_MAX
            and "/" not in name and "\\" not in name and "\0" not in name and not name.startswith(".")
            and name != CHECKSUMS_FILE)


def _tensor_chunks(d: Path, key: str, entry: TensorStorageMetadata) -> list[tuple[MetadataIndex, int]]:
    """``[(record index, least bytes it needs)]`` for the chunks of a tensor entry, once they lie inside the
    tensor, do not overlap and cover every element."""
    props, size, chunks = entry.properties, entry.size, entry.chunks
    if not isinstance(props, TensorProperties) or not isinstance(props.dtype, torch.dtype):
        raise _fail(d, f"entry {shown(key)} has no dtype")
    if not _is_shape(size):
        raise _fail(d, f"entry {shown(key)}: size {shown(size)} is not a shape (at most {MAX_DIMS} non-negative "
                       f"ints, fewer than 2**63 elements)")
    if not isinstance(chunks, list) or not all(isinstance(c, ChunkStorageMetadata) for c in chunks):
        raise _fail(d, f"entry {shown(key)}: its chunk list is damaged")
    itemsize = torch.empty((), dtype=props.dtype).element_size()
    if math.prod(size) * itemsize >= MAX_EXTENT:
        raise _fail(d, f"entry {shown(key)}: size {list(size)} of {props.dtype} is 2**63 bytes or more")
    for c in chunks:
        if not (_is_shape(c.offsets, len(size)) and _is_shape(c.sizes, len(size))):
            raise _fail(d, f"entry {shown(key)}: chunk {shown(c.offsets)} {shown(c.sizes)} does not fit its "
                           f"{len(size)} dimensions")
        if any(o + n > s for o, n, s in zip(c.offsets, c.sizes, size)):
            raise _fail(d, f"entry {shown(key)}: chunk at {list(c.offsets)} of {list(c.sizes)} lies outside "
                           f"its size {list(size)}")
    _check_disjoint(d, key, [(c.offsets, c.sizes) for c in chunks])
    covered, numel = sum(math.prod(c.sizes) for c in chunks), math.prod(size)
    if covered != numel:
        raise _fail(d, f"entry {shown(key)}: its chunks hold {covered} of its {numel} elements")
    return [(MetadataIndex(key, c.offsets), math.prod(c.sizes) * itemsize) for c in chunks]


Box = tuple[torch.Size, torch.Size]  # a chunk's offsets and sizes


def _check_disjoint(d: Path, key: str, boxes: list[Box]) -> None:
    """No two chunks share an element (with the volume check: the chunks tile the tensor). Chunks that form a grid
    (each spans one cell between the boundaries all chunks cut: fzero's 1-D shards, DTensor's shardings) are disjoint
    when no two share a cell, found by sorting; other layouts by a sweep (:func:`_sweep`)."""
    boxes = [(o, n) for o, n in boxes if math.prod(n)]  # an empty chunk shares no element
    if len(boxes) < 2:
        return
    ndim = len(boxes[0][0])
    cuts = [sorted({o[a] for o, _ in boxes} | {o[a] + n[a] for o, n in boxes}) for a in range(ndim)]
    place = [{c: i for i, c in enumerate(cut)} for cut in cuts]
    cells: dict[tuple[int, ...], Box] = {}
    for o, n in boxes:
        cell = tuple(place[a][o[a]] for a in range(ndim))
        if any(place[a][o[a] + n[a]] != cell[a] + 1 for a in range(ndim)):
            return _sweep(d, key, boxes)  # spans several cells: not a grid
        if cell in cells:
            raise _overlap(d, key, cells[cell], (o, n))
        cells[cell] = (o, n)
    return None


def _sweep(d: Path, key: str, boxes: list[Box]) -> None:
    """Chunks sorted by their start along the dimension where they start at the most places, each compared with the
    chunks still open there; refused when that takes more than :data:`OVERLAP_TESTS` comparisons (a layout no
    sharding writes)."""
    ndim = len(boxes[0][0])
    axis = max(range(ndim), key=lambda a: len({o[a] for o, _ in boxes}))
    boxes = sorted(boxes, key=lambda b: b[0][axis])
    open_: list[tuple[int, int]] = []  # (end along axis, position in boxes) of the chunks still open
    tests = 0
    for i, (o, n) in enumerate(boxes):
        while open_ and open_[0][0] <= o[axis]:
            heapq.heappop(open_)
        tests += len(open_)
        if tests > OVERLAP_TESTS:
            raise _fail(d, f"entry {shown(key)}: its {len(boxes)} chunks are not a grid and too many to check "
                           f"for overlap ({OVERLAP_TESTS} comparisons)")
        for _, j in open_:
            p, m = boxes[j]
            if all(max(a, b) < min(a + x, b + y) for a, x, b, y in zip(o, n, p, m)):
                raise _overlap(d, key, boxes[j], (o, n))
        heapq.heappush(open_, (o[axis] + n[axis], i))


def _overlap(d: Path, key: str, a: Box, b: Box) -> CheckpointCorruptError:
    return _fail(d, f"entry {shown(key)}: chunks at {shown(list(a[0]))} and {shown(list(b[0]))} overlap")


def fzero_marks(md: Metadata) -> dict[str, Any]:
    """What fzero recorded in the metadata when it saved (``{}`` for checkpoints of other writers)."""
    data = md.planner_data
    marks = data.get(FZERO_KEY) if isinstance(data, dict) else None
    return marks if isinstance(marks, dict) else {}
