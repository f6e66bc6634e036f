"""Checksums of every record a checkpoint holds, taken while it is written and checked while it is read.
:class:`ChecksumWriter` takes a CRC-32 of every record on its way to the file; ``checksums.json`` binds each record's
place, CRC, entry and chunk, the step and name, the SHA-256 of ``.metadata`` (written last) and a CRC of all of it.
:func:`open_checked`, :class:`VerifyingReader` and :func:`verify_checkpoint_dir` check them (failures:
:class:`CheckpointCorruptError` naming directory, data file, entry). CRC-32 guards against accidents, not an adversary.

Imports: direct, errors, files, metadata.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import itertools
import json
import os
import pickle
import zlib
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, FileSystem
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .direct import DirectFile
from .errors import CheckpointCorruptError, corrupt, shown
from .files import Files
from .metadata import (
    CHECKSUMS_FILE,
    FZERO_KEY,
    MAX_DIMS,
    METADATA_FILE,
    _first_line,
    _is_int,
    _is_name,
    _is_plain_file,
    check_metadata,
    fzero_marks,
    read_bytes,
    unpickle_metadata,
)

__all__ = ["ALGORITHM", "CHECKSUMS_FILE", "ChecksumWriter", "VerifyingReader", "verify_checkpoint_dir",
           "open_checked", "CheckedDir"]

ALGORITHM = "crc32"
VERSION = 2  # of the checksum file: 2 binds the metadata's digest, the step, the name, chunk sizes
_OVERLAP_BYTES = 1 << 20  # writes this large are checksummed in a second thread, overlapping the write
STEP_KEY = "fzero/step"


class _CountingStream(io.RawIOBase):
    """A file opened for writing that keeps one ``[length, crc]`` per record: a record starts at each
    ``tell()`` (DCP calls it before and after writing each record)."""

    def __init__(self, raw: Any, records: dict[int, list[int]], pool: ThreadPoolExecutor | None):
        super().__init__()
        self.raw, self.records, self.pool = raw, records, pool
        self.pos = raw.tell()
        self.current = self.records.setdefault(self.pos, [0, 0])

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        if self.pool is not None and len(view) >= _OVERLAP_BYTES:
            # the CRC runs in a second thread during the write (both release the GIL), done before returning
            crc = self.pool.submit(zlib.crc32, view, self.current[1])
            try:
                n = self._write_all(view)
            finally:
                value = crc.result()
            self.current[1] = value
        else:
            n = self._write_all(view)
            self.current[1] = zlib.crc32(view, self.current[1])
        self.current[0] += n
        self.pos += n
        return n

    def _write_all(self, view: memoryview) -> int:
        done = 0
        while done < len(view):
            n = self.raw.write(view[done:])
            done += len(view) - done if n is None else n
        return done

    def tell(self) -> int:
        if self.current[0]:
            self.current = self.records.setdefault(self.pos, [0, 0])
        return self.pos

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        self.flush()  # DCP fsyncs the descriptor before it closes the stream: the fsync covers every byte written
        return self.raw.fileno()

    def flush(self) -> None:
        if not self.raw.closed:
            self.raw.flush()

    def close(self) -> None:
        if not self.closed:
            super().close()  # flushes
            self.raw.close()


class _ChecksumFileSystem(FileSystem):
    """DCP's file system, its data files written through :class:`_CountingStream`; ``direct``: around the page
    cache (:class:`~.direct.DirectFile`)."""

    def __init__(self, direct: bool = False) -> None:
        super().__init__()
        self.records: dict[str, dict[int, list[int]]] = {}
        self.pool: ThreadPoolExecutor | None = None
        self.direct = direct

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as raw:
                yield raw
            return
        opened = DirectFile(path) if self.direct else super().create_stream(path, mode)
        with opened as raw:
            stream = _CountingStream(raw, self.records.setdefault(Path(path).name, {}), self.pool)
            yield stream
            stream.close()


class ChecksumWriter(dcp.FileSystemWriter):
    """DCP's file writer that records a CRC of every record it writes, and binds them, the metadata and
    ``bind`` (the step and the name) in ``checksums.json`` (see the module doc). ``direct``: the data files written
    around the page cache (:class:`~.direct.DirectFile`, the background save's writer), the same bytes."""

    def __init__(self, path: Any, *, bind: Mapping[str, Any] | None = None, direct: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.fs = _ChecksumFileSystem(direct)
        self.bind = dict(bind or {})

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        with ThreadPoolExecutor(1, thread_name_prefix="fzero-crc") as self.fs.pool:
            results = super().write_data(plan, planner).wait()
        self.fs.pool = None
        checked = []
        for wr in results:
            info = wr.storage_data
            length, crc = self.fs.records[info.relative_path].get(info.offset, (None, 0))
            if length != info.length:
                raise RuntimeError(f"checksum of {wr.index.fqn} in {info.relative_path}: record at {info.offset} has "
                                   f"{length} bytes, DCP wrote {info.length}")
            checked.append(dataclasses.replace(wr, storage_data=(info, crc)))  # unwrapped in finish
        self.fs.records.clear()
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(checked)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Write ``checksums.json``, then ``.metadata`` (last: its presence means complete), pickled here so
        that the checksum file can bind its digest."""
        chunks = {(k, tuple(c.offsets)): list(c.sizes) for k, e in metadata.state_dict_metadata.items()
                  if isinstance(e, TensorStorageMetadata) for c in e.chunks}
        entries, storage = [], {}
        for wrs in results:
            for wr in wrs:
                (info, crc), key = wr.storage_data, wr.index.fqn
                storage[wr.index] = info
                offset = None if wr.index.offset is None else list(wr.index.offset)
                sizes = None if offset is None else chunks[(key, tuple(offset))]
                entries.append([info.relative_path, info.offset, info.length, crc, key, offset, sizes])
        entries.sort(key=lambda e: (e[0], e[1]))
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = storage
        metadata.storage_meta = self.storage_meta()
        # the mark that this checkpoint was saved with checksums: without the file it is damaged
        metadata.planner_data = {FZERO_KEY: {"checksums": CHECKSUMS_FILE, "checksums_version": VERSION}}
        blob = pickle.dumps(metadata)
        doc = {"algorithm": ALGORITHM, "version": VERSION, **self.bind, "records": entries,
               "metadata": {"file": METADATA_FILE, "length": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}}
        doc["self"] = _doc_crc(doc)
        d = Path(self.path)
        _write_synced(d / CHECKSUMS_FILE, json.dumps(doc, separators=(",", ":")).encode())
        _write_synced(d / f"{METADATA_FILE}.tmp", blob)
        os.replace(d / f"{METADATA_FILE}.tmp", d / METADATA_FILE)


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _doc_crc(doc: Mapping[str, Any]) -> int:
    body = {k: v for k, v in doc.items() if k != "self"}
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


@dataclasses.dataclass(frozen=True)
class Record:
    """One checksummed record: where it lies, what it holds (entry, chunk offset and sizes)."""

    file: str
    offset: int
    length: int
    crc: int
    key: str
    chunk: tuple[int, ...] | None
    sizes: tuple[int, ...] | None = None

    def describe(self) -> str:
        piece = "" if not self.chunk or not any(self.chunk) else f" (chunk at {list(self.chunk)})"
        return f"entry {shown(self.key)}{piece}"


@dataclasses.dataclass(frozen=True)
class Checksums:
    """A checkpoint's ``checksums.json``: its records by (file, byte offset) and what they are bound to.
    ``version`` 1 (before the binding existed) has no metadata digest, step or name."""

    records: dict[tuple[str, int], Record]
    version: int
    step: int | None = None
    name: str | None = None
    metadata_sha256: str | None = None


@dataclasses.dataclass(frozen=True)
class CheckedDir:
    """A checkpoint directory whose metadata was read safely, checked and bound to its checksums (None: none)."""

    dir: Path
    metadata: Metadata
    checksums: Checksums | None
    files: Files  # how its files are opened
    chunk_sizes: dict[tuple[str, tuple[int, ...]], tuple[int, ...]]  # (entry, chunk offsets) -> chunk sizes


def chunk_sizes(metadata: Metadata) -> dict[tuple[str, tuple[int, ...]], tuple[int, ...]]:
    """``{(entry, chunk offsets): chunk sizes}`` of every tensor chunk of checked metadata: a record's chunk found
    in O(1) (an entry may have thousands)."""
    return {(k, tuple(c.offsets)): tuple(c.sizes) for k, e in metadata.state_dict_metadata.items()
            if isinstance(e, TensorStorageMetadata) for c in e.chunks}

def read_checksums(d: Path, files: Files | None = None, limit: int | None = None) -> Checksums | None:
    """``d/checksums.json`` (read as ``files`` allows, at most ``limit`` bytes), or None; damaged (its own CRC covers
    every field): a corrupt checkpoint."""
    if not (d / CHECKSUMS_FILE).exists() and not (d / CHECKSUMS_FILE).is_symlink():
        return None
    blob = read_bytes(d, CHECKSUMS_FILE, files, limit)
    try:
        doc = json.loads(blob.decode("utf-8"))
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
        if doc.get("algorithm") != ALGORITHM:
            raise ValueError(f"unknown algorithm {shown(doc.get('algorithm'))}")
        version = doc.get("version", 1)
        if version == 1:  # saved before the binding: its CRC covers the records only
            own = zlib.crc32(json.dumps(doc["records"], separators=(",", ":")).encode())
        elif version == VERSION:
            own = _doc_crc(doc)
        else:
            raise ValueError(f"unknown version {shown(version)}")
        if own != doc["self"]:
            raise ValueError("its own checksum differs")
        if not isinstance(doc["records"], list):
            raise ValueError("it has no record list")
        records = {}
        for i, entry in enumerate(doc["records"]):
            record = _record(entry, version)
            if record is None:
                raise ValueError(f"record #{i} is not [file, offset, length, crc, entry, chunk, sizes]: {shown(entry)}")
            if (record.file, record.offset) in records:
                raise ValueError(f"two records at byte {record.offset} of {record.file}")
            records[(record.file, record.offset)] = record
        if version == 1:
            return Checksums(records, 1)
        step, name, digest = doc["step"], doc["name"], doc["metadata"]["sha256"]
        if not (_is_int(step) and _is_name(name) and isinstance(digest, str) and len(digest) == 64):
            raise ValueError(f"its step {shown(step)}, name {shown(name)} or metadata digest {shown(digest)} is "
                             "malformed")
        return Checksums(records, version, step, name, digest)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, RecursionError) as e:
        raise corrupt(d, f"file {CHECKSUMS_FILE} is damaged ({_first_line(e)})") from e


def _record(row: Any, version: int) -> Record | None:
    """A row of the checksum file as a :class:`Record`, or None when a field has the wrong type or size."""
    if not (isinstance(row, list) and len(row) == (6 if version == 1 else 7)):
        return None
    f, off, n, crc, key, chunk = row[:6]
    sizes = row[6] if version > 1 else None
    if not (_is_plain_file(f) and _is_int(off) and _is_int(n) and _is_int(crc) and crc < 1 << 32 and _is_name(key)
            and _is_dims(chunk) and _is_dims(sizes)):
        return None
    return Record(f, off, n, crc, key, None if chunk is None else tuple(chunk), None if sizes is None else tuple(sizes))


def _is_dims(x: Any) -> bool:
    """None or a list of at most :data:`~.metadata.MAX_DIMS` non-negative ints (a chunk's offsets or sizes)."""
    return x is None or (isinstance(x, list) and len(x) <= MAX_DIMS and all(_is_int(v) for v in x))


def open_checked(d: Path, files: Files | None = None) -> CheckedDir:
    """Read ``d``'s metadata without running code, check it and bind it to the checksum file: the digest of
    ``.metadata`` (before unpickling), :mod:`.metadata`'s checks, the checksum file it was saved with, one
    checksum record per listed record and no other. Files read as ``files`` allows (:class:`~.files.Files`). Raises
    :class:`CheckpointCorruptError`."""
    blob = read_bytes(d, METADATA_FILE, files)
    # a checksum record per entry .metadata lists, no longer in JSON than in the pickle, and a header
    sums = read_checksums(d, files, 4 * len(blob) + (64 << 10))
    if sums is not None and sums.metadata_sha256 is not None:
        if hashlib.sha256(blob).hexdigest() != sums.metadata_sha256:
            raise corrupt(d, f"file {METADATA_FILE} is not the one {CHECKSUMS_FILE} was written for (its digest "
                             "differs): one of them is damaged or comes from another checkpoint")
    metadata = unpickle_metadata(d, blob)
    check_metadata(d, metadata)
    marks = fzero_marks(metadata)
    if marks.get("checksums") is not None:
        if sums is None:
            raise corrupt(d, f"it was saved with checksums and file {CHECKSUMS_FILE} is missing")
        if sums.version != marks.get("checksums_version"):
            raise corrupt(d, f"file {CHECKSUMS_FILE} is version {sums.version}, the checkpoint was saved with "
                             f"version {shown(marks.get('checksums_version'))}")
    sizes = chunk_sizes(metadata)
    if sums is not None:
        _bind_records(d, metadata, sums, sizes)
    return CheckedDir(d, metadata, sums, Files.of(d) if files is None else files, sizes)


def _bind_records(d: Path, metadata: Metadata, sums: Checksums,
                  sizes_of: Mapping[tuple[str, tuple[int, ...]], tuple[int, ...]]) -> None:
    """Every record the metadata lists has a checksum record written for that very entry, chunk (offsets
    and sizes) and length; and every checksum record is listed."""
    listed = set()
    for idx, info in metadata.storage_data.items():
        where = (info.relative_path, info.offset)
        listed.add(where)
        record = sums.records.get(where)
        chunk = None if idx.offset is None else tuple(idx.offset)
        if record is None or record.length != info.length or record.key != idx.fqn or record.chunk != chunk:
            raise corrupt(d, f"entry {shown(idx.fqn)} in data file {info.relative_path} (bytes {info.offset}-"
                             f"{info.offset + info.length}) has no checksum record of its own: {METADATA_FILE} "
                             f"or {CHECKSUMS_FILE} is damaged")
        if record.sizes is not None:
            sizes = None if chunk is None else sizes_of.get((idx.fqn, chunk))
            if sizes != record.sizes:
                raise corrupt(d, f"{record.describe()} in data file {record.file}: its chunk is {sizes} in "
                                 f"{METADATA_FILE} but was written as {list(record.sizes)}")
    extra = sorted(set(sums.records) - listed)
    if extra:
        r = sums.records[extra[0]]
        raise corrupt(d, f"{CHECKSUMS_FILE} lists {r.describe()} in data file {r.file} at byte {r.offset}, "
                         f"which {METADATA_FILE} does not: one of them is damaged")


def _read_checked(stream: Any, checked: CheckedDir, record: Record) -> bytes:
    """The bytes of ``record`` read from ``stream``, once they match its CRC (and its step, :func:`check_step`)."""
    stream.seek(record.offset)
    data = stream.read(record.length)
    if len(data) != record.length or zlib.crc32(data) != record.crc:
        raise corrupt(checked.dir, f"{record.describe()} in data file {record.file} (bytes {record.offset}-"
                                   f"{record.offset + record.length}) fails its {ALGORITHM} checksum")
    check_step(checked, record, data)
    return data


def check_step(checked: CheckedDir, record: Record, data: bytes) -> None:
    """The step stored in the data is the step the checksum file was written for: the data files and
    checksums of another step copied in are refused even where they agree."""
    sums = checked.checksums
    if record.key != STEP_KEY or sums is None or sums.step is None:
        return
    try:
        step = int(torch.load(io.BytesIO(data), weights_only=True))
    except Exception as e:  # noqa: BLE001 - a record that passed its CRC: damage written at save
        raise corrupt(checked.dir, f"entry {STEP_KEY!r} in data file {record.file} cannot be decoded "
                                   f"({_first_line(e)})") from e
    if step != sums.step:
        raise corrupt(checked.dir, f"its data hold step {step}, its {CHECKSUMS_FILE} was written for step "
                                   f"{sums.step}: files of two checkpoints are mixed")


class VerifyingReader(dcp.FileSystemReader):
    """DCP's file reader over a checked directory: it gives DCP the metadata read without running code, checks
    each record's CRC (once per reader) before DCP decodes it, and remembers the entry and file it reads."""

    def __init__(self, checked: CheckedDir) -> None:
        super().__init__(checked.dir)
        self.checked_dir = checked
        self.records = None if checked.checksums is None else checked.checksums.records
        self.checked: set[tuple[str, int]] = set()
        self.current: tuple[str, str] | None = None  # (entry, file) being read

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.checked_dir.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self.keys = {(info.relative_path, info.offset): idx.fqn for idx, info in metadata.storage_data.items()}

    def _slice_file(self, file: Any, sinfo: Any) -> Any:
        where = (sinfo.relative_path, sinfo.offset)
        self.current = (self.keys.get(where, "?"), sinfo.relative_path)
        if self.records is None or where in self.checked:
            return super()._slice_file(file, sinfo)
        data = _read_checked(file, self.checked_dir, self.records[where])  # open_checked bound every record
        self.checked.add(where)
        return io.BytesIO(data)


def verify_checkpoint_dir(checked: CheckedDir) -> int:
    """Check every record of a checked directory against its checksum, the step, and that it decodes
    (:func:`check_decodes`); returns the bytes checked. One record in memory at a time; no process group."""
    d = checked.dir
    if checked.checksums is None:
        raise CheckpointCorruptError(f"checkpoint {d} has no {CHECKSUMS_FILE}: it was saved without checksums "
                                     "and cannot be verified")
    total = 0
    records = sorted(checked.checksums.records.values(), key=lambda r: (r.file, r.offset))
    for f, group in itertools.groupby(records, key=lambda r: r.file):
        try:
            with checked.files.open(d / f) as stream:
                for record in group:
                    check_decodes(checked, record, _read_checked(stream, checked, record))
                    total += record.length
        except OSError as e:
            raise CheckpointCorruptError(f"checkpoint {d}: data file {f} cannot be read ({e})") from e
    return total


def check_decodes(checked: CheckedDir, record: Record, data: bytes) -> None:
    """The record decodes as loading decodes it (``torch.load(weights_only=True)``), a tensor entry to its chunk's size
    and dtype: what loading would refuse, verifying refuses though the checksum matches."""
    entry = checked.metadata.state_dict_metadata[record.key]
    try:
        value = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - anything but the allowed types and a damaged record alike
        raise corrupt(checked.dir, f"{record.describe()} in data file {record.file} cannot be decoded "
                                   f"({type(e).__name__}: {_first_line(e)})") from e
    if isinstance(entry, TensorStorageMetadata):
        sizes = checked.chunk_sizes[(record.key, record.chunk)]  # open_checked bound the record to its chunk
        if not (isinstance(value, torch.Tensor) and tuple(value.size()) == sizes
                and value.dtype == entry.properties.dtype):
            got = f"{value.dtype}{list(value.size())}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise corrupt(checked.dir, f"{record.describe()} in data file {record.file} holds {got}, its "
                                       f"metadata says {entry.properties.dtype}{list(sizes)}")
