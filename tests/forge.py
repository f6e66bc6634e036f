"""Forging a checkpoint as an attacker can: ``.metadata`` unpickled with plain ``pickle``, changed, pickled again,
and ``checksums.json`` recomputed completely (every record's CRC over the bytes it now names, the metadata's length
and SHA-256, the document's own CRC). CRC-32 and SHA-256 bind integrity, not authorship: what this module writes
passes every checksum, so only the checks of the values themselves can refuse it.

The forgeries of ``tests/test_checkpoint_forged.py``: :func:`huge_entry` (an entry claiming far more bytes than the
file holds, the file extended sparsely so that every extent agrees), :func:`laughs` (a field that is a structure of
shared references, exponentially large when walked), :func:`laughs_key` and :func:`laughs_offset` (the same structure
inside a hashed object: written as raw pickle opcodes, :func:`spliced`), :func:`long_name` (an entry name that is a
tuple of millions of ints) and :func:`many_chunks` (one entry, of any number of dimensions, cut into thousands of
chunks, each with a record of its own).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
import os
import pickle
import pickletools
import zlib
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from fzero.checkpoint.checksums import CHECKSUMS_FILE, _doc_crc

METADATA = ".metadata"
DATA = "__0_0.distcp"
CRC_READ_LIMIT = 64 << 20  # records longer than this are not read for their CRC (a sparse hole: it cannot match)


def read_metadata(d: Path) -> Metadata:
    """``d/.metadata`` as plain ``pickle`` reads it (the forger trusts nothing and fears nothing)."""
    return pickle.loads((d / METADATA).read_bytes())


def write_forged(d: Path, md: Metadata, rows: list[list[Any]] | None = None) -> None:
    """``md`` pickled into ``d/.metadata`` and ``checksums.json`` recomputed for it: ``rows`` (default: one per
    record of ``md``, its CRC taken over the bytes it names), the metadata's digest and the document's own CRC."""
    write_forged_blob(d, pickle.dumps(md, protocol=4), _rows(d, md) if rows is None else rows)


def write_forged_blob(d: Path, blob: bytes, rows: list[list[Any]] | None = None) -> None:
    """``blob`` (a pickle, e.g. :func:`spliced`) written as ``d/.metadata`` and ``checksums.json`` recomputed for it:
    ``rows`` (default: the genuine ones, left as they are), the metadata's length and digest, the document's CRC."""
    doc = json.loads((d / CHECKSUMS_FILE).read_text())
    if rows is not None:
        doc["records"] = rows
    doc["metadata"] = {"file": METADATA, "length": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
    doc["self"] = _doc_crc(doc)
    (d / CHECKSUMS_FILE).write_text(json.dumps(doc, separators=(",", ":")))
    (d / METADATA).write_bytes(blob)


def _rows(d: Path, md: Metadata) -> list[list[Any]]:
    """The checksum rows of ``md``'s records, as fzero writes them: file, offset, length, CRC, key, chunk, sizes.
    Fields of a forged type are written as JSON holds them (:func:`_json`): a row agrees with its record wherever
    JSON can say so (an attacker's best), whatever ``md`` holds."""
    sizes: dict[Any, Any] = {}
    for k, e in _items(getattr(md, "state_dict_metadata", None)):
        chunks = getattr(e, "chunks", None)
        for c in chunks if isinstance(chunks, list) else []:
            try:
                sizes[(k, tuple(c.offsets))] = list(c.sizes)
            except Exception:  # noqa: BLE001 - a forged chunk: no sizes to bind
                pass
    rows = []
    for idx, info in _items(getattr(md, "storage_data", None)):
        offset, path = getattr(idx, "offset", None), getattr(info, "relative_path", None)
        chunk = None if offset is None else _json(offset)
        try:
            chunk_sizes = None if chunk is None else sizes.get((idx.fqn, tuple(chunk)))
        except Exception:  # noqa: BLE001 - unhashable or not a sequence: no sizes to bind
            chunk_sizes = None
        at, length = getattr(info, "offset", None), getattr(info, "length", None)
        crc = crc_of(d / path, at, length) if isinstance(path, str) and "\0" not in path else 0
        rows.append([_json(path), _json(at), _json(length), crc, _json(getattr(idx, "fqn", None)), chunk,
                     _json(chunk_sizes)])
    try:
        return sorted(rows, key=lambda r: (r[0], r[1]))
    except TypeError:  # forged fields of mixed types: any order (the reader keys rows by file and offset)
        return rows


def _items(table: Any) -> list[tuple[Any, Any]]:
    return list(table.items()) if isinstance(table, dict) else []


def _json(x: Any) -> Any:
    """``x`` as a JSON document holds it: itself (tuples as lists), else its ``repr`` (at most 200 characters)."""
    try:
        return json.loads(json.dumps(x))
    except (TypeError, ValueError, RecursionError):
        return repr(x)[:200]


def crc_of(path: Path, offset: Any, length: Any) -> int:
    """The CRC-32 of ``length`` bytes of ``path`` at ``offset`` (0 for a record too long to read here, or one that is
    not a byte range of an existing file)."""
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in (offset, length)):
        return 0
    if length > CRC_READ_LIMIT or offset > 1 << 62:
        return 0
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return zlib.crc32(f.read(length))
    except OSError:  # a forged file name: nothing there to checksum
        return 0


def append_record(d: Path, data: bytes, file: str = DATA) -> tuple[int, int]:
    """``data`` appended to the data file: ``(offset, length)`` of the new record."""
    path = d / file
    offset = path.stat().st_size
    with open(path, "ab") as f:
        f.write(data)
    return offset, len(data)


def huge_entry(d: Path, key: str, nbytes: int) -> None:
    """Entry ``key`` claims ``nbytes`` (a 1-D uint8 tensor entry for a tensor, or a bytes entry): its chunk, its
    record (moved past the end of the data file) and the file (extended sparsely past the record) all agree."""
    md = read_metadata(d)
    path = d / DATA
    offset = path.stat().st_size
    entry = md.state_dict_metadata[key]
    index = next(i for i in md.storage_data if i.fqn == key)
    del md.storage_data[index]
    if isinstance(entry, TensorStorageMetadata):
        md.state_dict_metadata[key] = TensorStorageMetadata(
            TensorProperties(dtype=torch.uint8), torch.Size([nbytes]),
            [ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([nbytes]))])
        index = MetadataIndex(key, torch.Size([0]))
    md.storage_data[index] = _StorageInfo(DATA, offset, nbytes + 4096)
    os.truncate(path, offset + nbytes + 4096)  # a hole: no byte of it is on disk
    write_forged(d, md)


def shared(depth: int, leaf: Any = 1, kind: type = tuple) -> Any:
    """A structure of ``depth`` levels, each two references to the one below (2**depth leaves, ``depth`` objects)."""
    x = leaf
    for _ in range(depth):
        x = kind((x, x))
    return x


def laughs(d: Path, depth: int = 60, kind: type = list) -> None:
    """A "billion laughs" value (:func:`shared`, of lists or tuples) as an entry's ``size``. (The same value as a dict
    key, an entry name or a chunk offset in a ``MetadataIndex`` cannot be built as an object: inserting it hashes it,
    2**depth steps, as the unpickler would: :func:`laughs_key`, :func:`laughs_offset` write its opcodes.)"""
    md = read_metadata(d)
    md.state_dict_metadata["fzero/master/0.weight"].size = shared(depth, kind=kind)
    write_forged(d, md, rows=_genuine_rows(d))


SENTINEL = "forge:sentinel:5f0c1e"  # a string no genuine metadata holds: where :func:`spliced` puts its opcodes


def shared_ops(depth: int) -> bytes:
    """Pickle opcodes pushing :func:`shared` ``(depth)`` (tuples of the int 1) without building it here: ``depth``
    times DUP, TUPLE2 (a few bytes a level, no memo)."""
    return pickle.BININT1 + b"\x01" + (pickle.DUP + pickle.TUPLE2) * depth


def short_str_ops(text: str) -> bytes:
    """Pickle opcodes pushing the string ``text`` (under 256 bytes of UTF-8)."""
    raw = text.encode()
    return pickle.SHORT_BINUNICODE + bytes([len(raw)]) + raw


def spliced(md: Metadata, ops: bytes, sentinel: str = SENTINEL) -> bytes:
    """``md`` pickled as fzero pickles it (protocol 4) with the one occurrence of the string ``sentinel`` replaced by
    the raw opcodes ``ops`` (which push one object), then re-framed (``pickletools.optimize``: the frames are rebuilt
    and the memo renumbered around the new opcodes). The unpickler builds what ``ops`` say, wherever the sentinel was:
    inside a dict key or a frozen dataclass too, where no object holding it could be inserted here."""
    blob = pickle.dumps(md, protocol=4)
    ops_at = list(pickletools.genops(blob))
    hits = [i for i, (op, arg, _) in enumerate(ops_at) if isinstance(arg, str) and arg == sentinel]
    if len(hits) != 1:
        raise ValueError(f"the sentinel occurs {len(hits)} times in the pickle, not once")
    start, end = ops_at[hits[0]][2], ops_at[hits[0] + 1][2]
    return pickletools.optimize(blob[:start] + ops + blob[end:])


def laughs_key(d: Path, depth: int = 60, key: str = "fzero/master/0.weight") -> None:
    """Entry ``key``'s name in ``state_dict_metadata`` replaced by :func:`shared` ``(depth)``: a dict key, hashed
    (2**depth steps) when the unpickler inserts it. The genuine checksum rows are kept."""
    md = read_metadata(d)
    md.state_dict_metadata = {SENTINEL if k == key else k: v for k, v in md.state_dict_metadata.items()}
    write_forged_blob(d, spliced(md, shared_ops(depth)))


def laughs_offset(d: Path, depth: int = 60, key: str = "fzero/master/0.weight") -> None:
    """The ``offset`` of entry ``key``'s record index (a ``MetadataIndex``, a key of ``storage_data``) replaced by
    :func:`shared` ``(depth)``: hashed with its index when the unpickler inserts it. The genuine rows are kept."""
    md = read_metadata(d)
    md.storage_data = {replace_field(i, offset=SENTINEL) if i.fqn == key else i: v for i, v in md.storage_data.items()}
    write_forged_blob(d, spliced(md, shared_ops(depth)))


def long_name(d: Path, n: int = 10**7) -> None:
    """An entry whose name is a tuple of ``n`` ints (the pickle: about 5 bytes an int)."""
    md = read_metadata(d)
    md.state_dict_metadata[tuple(range(n))] = md.state_dict_metadata.pop("fzero/master/0.weight")
    write_forged(d, md, rows=_genuine_rows(d))


def _genuine_rows(d: Path) -> list[list[Any]]:
    return json.loads((d / CHECKSUMS_FILE).read_text())["records"]


def many_chunks(d: Path, n: int, key: str = "extra/table", decodable: bool = False,
                shape: tuple[int, ...] | None = None) -> None:
    """Entry ``key`` replaced by an int64 tensor of ``n`` elements (1-D, or ``shape``, whose elements number ``n``) in
    ``n`` chunks of one element, each with its own record appended to the data file and checksummed. ``decodable``:
    each record a ``torch.save`` of its element (a valid checkpoint, read back as ``arange(n).reshape(shape)``), else
    eight raw bytes (valid CRCs, but no record decodes)."""
    shape = (n,) if shape is None else tuple(shape)
    if math.prod(shape) != n:
        raise ValueError(f"shape {shape} does not hold {n} elements")
    md = read_metadata(d)
    for index in [i for i in md.storage_data if i.fqn == key]:
        del md.storage_data[index]
    one = torch.Size([1] * len(shape))
    places = [torch.Size(p) for p in _row_major(shape)]
    chunks = [ChunkStorageMetadata(offsets=p, sizes=one) for p in places]
    md.state_dict_metadata[key] = TensorStorageMetadata(TensorProperties(dtype=torch.int64), torch.Size(shape), chunks)
    blobs = [_saved(torch.tensor(i).reshape(one)) if decodable else i.to_bytes(8, "little") for i in range(n)]
    offset = (d / DATA).stat().st_size
    with open(d / DATA, "ab") as f:
        f.write(b"".join(blobs))
    for p, blob in zip(places, blobs):
        md.storage_data[MetadataIndex(key, p)] = _StorageInfo(DATA, offset, len(blob))
        offset += len(blob)
    write_forged(d, md)


def _row_major(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every index of a tensor of ``shape``, in row-major order."""
    places: list[tuple[int, ...]] = [()]
    for n in shape:
        places = [p + (i,) for p in places for i in range(n)]
    return places


def _saved(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def replace_field(obj: Any, **changes: Any) -> Any:
    """``obj`` (a DCP dataclass) with ``changes``, built without its constructor's conversions (as unpickling
    builds it)."""
    new = object.__new__(type(obj))
    fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    fields.update(changes)
    for name, value in fields.items():
        object.__setattr__(new, name, value)
    return new
