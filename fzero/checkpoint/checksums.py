"""Checksums of every record a checkpoint holds, taken while it is written and checked
while it is read.

A DCP data file is a sequence of records, one per saved tensor chunk or object entry;
``.metadata`` maps each entry ``(key, chunk offset)`` to ``(file, byte offset, length)``.
Saving: :class:`ChecksumWriter` passes every byte a rank writes through ``zlib.crc32``
on its way to the file (no second read; for large writes in a second thread, at the same
time as the write itself), one CRC per record (DCP starts each record
with ``tell()``, and ``torch.save`` writes sequentially). The CRCs travel with DCP's
write results to the coordinator, which writes them to ``checksums.json`` and then
``.metadata``, last (pickled here, not by DCP, so that its digest is known first).

``checksums.json`` (version 2) binds everything a reader trusts: per record its file,
byte offset, length, CRC, entry and chunk (offsets and sizes); the step and the name the
checkpoint was saved under; the SHA-256 of ``.metadata``; and a CRC of all of it. The
metadata carries a mark that it was saved with checksums, so a missing checksum file is
damage. :func:`open_checked` checks the digest before ``.metadata`` is unpickled (with
the allow-list of :mod:`.metadata`), then that every record is bound to its checksum.
Loading: :class:`VerifyingReader` reads each record whole, checks its CRC (and the step
against the checksum file's), then hands the bytes to DCP, so what is checked is what is
decoded. A damaged record raises :class:`CheckpointCorruptError` naming the directory,
the data file and the entry; :func:`verify_checkpoint_dir` checks every record, and that
each decodes as loading would, in one process, without a process group.

Algorithm, chosen by measurement (``benchmarks/bench_checkpoint.py``; this project's
machine, 2 cores shared with other jobs, so every number varies by 1.5x): saving a 300 MB
state takes 0.7-1.9 s (0.24-0.63 s per 100 MB). Per 100 MB in memory: CRC-32 43-69 ms,
Adler-32 57-85 ms, SHA-256 84-149 ms, BLAKE2b 98-160 ms, MD5 130-223 ms, a torch sum of
int32 words 94-283 ms; ``torch.hash_tensor``'s XOR of 64-bit words 14 ms, but it misses two
flips of one bit position and needs torch >= 2.9. CRC-32, the cheapest real checksum, is
10 % of a save on a quiet machine when computed in line; computed in a second thread
while the same bytes are written, it adds nothing measurable when a core is free, and up
to its full cost (10-27 %) when none is. CRC-32 detects every burst error up to 32 bits (a
flipped byte, a torn sector) and any other damage with probability 1 - 2**-32. It guards
against accidents, not against an adversary.

Imports: :mod:`fzero.checkpoint.errors`, :mod:`fzero.checkpoint.metadata`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import pickle
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, FileSystem
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .errors import CheckpointCorruptError
from .metadata import (
    CHECKSUMS_FILE,
    FZERO_KEY,
    METADATA_FILE,
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


def _crc(data: Any, value: int = 0) -> int:
    return zlib.crc32(data, value)


class _CountingStream(io.RawIOBase):
    """A file opened for writing that keeps one CRC per record: a record starts at each
    ``tell()`` (DCP calls it before and after writing each record)."""

    def __init__(self, raw: Any, records: dict[int, list[int]], pool: Optional[ThreadPoolExecutor]):
        super().__init__()
        self.raw, self.records, self.pool = raw, records, pool
        self.pos = raw.tell()
        self.current = self.records.setdefault(self.pos, [0, 0])  # [length, crc]

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        if self.pool is not None and len(view) >= _OVERLAP_BYTES:
            # The CRC runs in another thread while this one writes the same bytes (both release
            # the GIL); it is awaited before returning, while the caller's buffer is still valid.
            crc = self.pool.submit(_crc, view, self.current[1])
            try:
                n = self._write_all(view)
            finally:
                value = crc.result()
            self.current[1] = value
        else:
            n = self._write_all(view)
            self.current[1] = _crc(view, self.current[1])
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
        return self.raw.fileno()

    def flush(self) -> None:
        if not self.raw.closed:
            self.raw.flush()

    def close(self) -> None:
        if not self.closed:
            super().close()  # flushes
            self.raw.close()


class _ChecksumFileSystem(FileSystem):
    def __init__(self) -> None:
        super().__init__()
        self.records: dict[str, dict[int, list[int]]] = {}
        self.pool: Optional[ThreadPoolExecutor] = None

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            stream = _CountingStream(raw, self.records.setdefault(Path(path).name, {}), self.pool)
            yield stream
            stream.close()


@dataclasses.dataclass(frozen=True)
class _Checked:
    """A write result's storage data with the CRC of its record (unwrapped in ``finish``)."""

    info: Any
    crc: int


class ChecksumWriter(dcp.FileSystemWriter):
    """DCP's file writer that records a CRC of every record it writes, and binds them, the
    metadata and ``bind`` (the step and the name) in ``checksums.json`` (see the module doc)."""

    def __init__(self, path: Any, *, bind: Optional[Mapping[str, Any]] = None, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.fs = _ChecksumFileSystem()
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
                raise RuntimeError(
                    f"checksum of {wr.index.fqn} in {info.relative_path}: record at {info.offset} has "
                    f"{length} bytes, DCP wrote {info.length}"
                )
            checked.append(dataclasses.replace(wr, storage_data=_Checked(info, crc)))
        self.fs.records.clear()
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(checked)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Write ``checksums.json``, then ``.metadata`` (last: its presence means complete).

        The metadata is pickled here rather than by DCP, so that its digest is known before
        it is written: the checksum file binds it."""
        chunks = {(k, tuple(c.offsets)): list(c.sizes) for k, e in metadata.state_dict_metadata.items()
                  if isinstance(e, TensorStorageMetadata) for c in e.chunks}
        entries, storage = [], {}
        for wrs in results:
            for wr in wrs:
                info, key = wr.storage_data.info, wr.index.fqn
                storage[wr.index] = info
                offset = None if wr.index.offset is None else list(wr.index.offset)
                sizes = None if offset is None else chunks[(key, tuple(offset))]
                entries.append([info.relative_path, info.offset, info.length, wr.storage_data.crc,
                                key, offset, sizes])
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
        tmp = d / f"{METADATA_FILE}.tmp"
        _write_synced(tmp, blob)
        os.replace(tmp, d / METADATA_FILE)


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _doc_crc(doc: Mapping[str, Any]) -> int:
    body = {k: v for k, v in doc.items() if k != "self"}
    return _crc(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


@dataclasses.dataclass(frozen=True)
class Record:
    """One checksummed record: where it lies, what it holds (entry, chunk offset and sizes)."""

    file: str
    offset: int
    length: int
    crc: int
    key: str
    chunk: Optional[tuple[int, ...]]
    sizes: Optional[tuple[int, ...]] = None

    def describe(self) -> str:
        piece = "" if not self.chunk or not any(self.chunk) else f" (chunk at {list(self.chunk)})"
        return f"entry {self.key!r}{piece}"


@dataclasses.dataclass(frozen=True)
class Checksums:
    """A checkpoint's ``checksums.json``: its records by (file, byte offset) and what they are
    bound to. ``version`` 1 (before the binding existed) has no metadata digest, step or name."""

    records: dict[tuple[str, int], Record]
    version: int
    step: Optional[int] = None
    name: Optional[str] = None
    metadata_sha256: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class CheckedDir:
    """A checkpoint directory whose metadata was read safely and checked, and bound to its
    checksums (None: saved before checksums existed)."""

    dir: Path
    metadata: Metadata
    checksums: Optional[Checksums]


def read_checksums(d: Path) -> Optional[Checksums]:
    """``d/checksums.json``; None when there is none. A damaged checksum file is a corrupt
    checkpoint (its own CRC covers every field)."""
    path = d / CHECKSUMS_FILE
    if not path.exists():
        return None
    blob = read_bytes(d, CHECKSUMS_FILE)
    try:
        doc = json.loads(blob.decode("utf-8"))
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
        if doc.get("algorithm") != ALGORITHM:
            raise ValueError(f"unknown algorithm {doc.get('algorithm')!r}")
        version = doc.get("version", 1)
        if version == 1:  # saved before the binding: its CRC covers the records only
            own = _crc(json.dumps(doc["records"], separators=(",", ":")).encode())
        elif version == VERSION:
            own = _doc_crc(doc)
        else:
            raise ValueError(f"unknown version {version!r}")
        if own != doc["self"]:
            raise ValueError("its own checksum differs")
        records = {}
        for entry in doc["records"]:
            f, off, n, crc, key, chunk = entry[:6]
            sizes = entry[6] if version > 1 else None
            r = Record(f, off, n, crc, key, None if chunk is None else tuple(chunk),
                       None if sizes is None else tuple(sizes))
            if (f, off) in records:
                raise ValueError(f"two records at byte {off} of {f}")
            records[(f, off)] = r
        if version == 1:
            return Checksums(records, 1)
        md = doc["metadata"]
        return Checksums(records, version, int(doc["step"]), str(doc["name"]), str(md["sha256"]))
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise CheckpointCorruptError(f"corrupt checkpoint {d}: file {CHECKSUMS_FILE} is damaged ({e})") from e


def open_checked(d: Path) -> CheckedDir:
    """Read ``d``'s metadata without running code, check it, and bind it to the checksum file.

    Order: the checksum file; the digest of ``.metadata``'s bytes against it (before they are
    unpickled at all); the restricted unpickling and the checks of :mod:`.metadata`; a
    checkpoint marked as saved with checksums must have them; every record the metadata lists
    has its checksum record, for the same entry, chunk and length, and no other record exists.
    """
    sums = read_checksums(d)
    blob = read_bytes(d, METADATA_FILE)
    if sums is not None and sums.metadata_sha256 is not None:
        if hashlib.sha256(blob).hexdigest() != sums.metadata_sha256:
            raise CheckpointCorruptError(
                f"corrupt checkpoint {d}: file {METADATA_FILE} is not the one {CHECKSUMS_FILE} was written "
                "for (its digest differs): one of them is damaged or comes from another checkpoint"
            )
    metadata = unpickle_metadata(d, blob)
    check_metadata(d, metadata)
    marks = fzero_marks(metadata)
    if marks.get("checksums") is not None:
        if sums is None:
            raise CheckpointCorruptError(
                f"corrupt checkpoint {d}: it was saved with checksums and file {CHECKSUMS_FILE} is missing"
            )
        if sums.version != marks.get("checksums_version"):
            raise CheckpointCorruptError(
                f"corrupt checkpoint {d}: file {CHECKSUMS_FILE} is version {sums.version}, the checkpoint "
                f"was saved with version {marks.get('checksums_version')!r}"
            )
    if sums is not None:
        _bind_records(d, metadata, sums)
    return CheckedDir(d, metadata, sums)


def _bind_records(d: Path, metadata: Metadata, sums: Checksums) -> None:
    """Every record the metadata lists has a checksum record written for that very entry,
    chunk (offsets and sizes) and length; and every checksum record is listed."""
    entries = metadata.state_dict_metadata
    listed = set()
    for idx, info in metadata.storage_data.items():
        where = (info.relative_path, info.offset)
        listed.add(where)
        record = sums.records.get(where)
        chunk = None if idx.offset is None else tuple(idx.offset)
        if record is None or record.length != info.length or record.key != idx.fqn or record.chunk != chunk:
            raise CheckpointCorruptError(
                f"corrupt checkpoint {d}: entry {idx.fqn!r} in data file {info.relative_path} (bytes "
                f"{info.offset}-{info.offset + info.length}) has no checksum record of its own: {METADATA_FILE} "
                f"or {CHECKSUMS_FILE} is damaged"
            )
        if record.sizes is not None:
            entry = entries[idx.fqn]
            sizes = next((tuple(c.sizes) for c in entry.chunks if tuple(c.offsets) == chunk), None)
            if sizes != record.sizes:
                raise CheckpointCorruptError(
                    f"corrupt checkpoint {d}: {record.describe()} in data file {record.file}: its chunk is "
                    f"{sizes} in {METADATA_FILE} but was written as {list(record.sizes)}"
                )
    extra = sorted(set(sums.records) - listed)
    if extra:
        r = sums.records[extra[0]]
        raise CheckpointCorruptError(
            f"corrupt checkpoint {d}: {CHECKSUMS_FILE} lists {r.describe()} in data file {r.file} at byte "
            f"{r.offset}, which {METADATA_FILE} does not: one of them is damaged"
        )


def check_record(d: Path, record: Record, data: Any) -> None:
    if len(data) != record.length or _crc(data) != record.crc:
        raise CheckpointCorruptError(
            f"corrupt checkpoint {d}: {record.describe()} in data file {record.file} "
            f"(bytes {record.offset}-{record.offset + record.length}) fails its {ALGORITHM} checksum"
        )


STEP_KEY = "fzero/step"


def check_step(checked: CheckedDir, record: Record, data: bytes) -> None:
    """The step stored in the data is the step the checksum file was written for: the data
    files and checksums of another step copied in are refused even where they agree."""
    sums = checked.checksums
    if record.key != STEP_KEY or sums is None or sums.step is None:
        return
    try:
        value = torch.load(io.BytesIO(data), weights_only=True)
        step = int(value)
    except Exception as e:  # noqa: BLE001 - a record that passed its CRC: damage written at save
        raise CheckpointCorruptError(
            f"corrupt checkpoint {checked.dir}: entry {STEP_KEY!r} in data file {record.file} cannot be decoded ({e})"
        ) from e
    if step != sums.step:
        raise CheckpointCorruptError(
            f"corrupt checkpoint {checked.dir}: its data hold step {step}, its {CHECKSUMS_FILE} was written for "
            f"step {sums.step}: files of two checkpoints are mixed"
        )


class VerifyingReader(dcp.FileSystemReader):
    """DCP's file reader over a checked directory: the metadata it gives DCP is the one fzero
    read without running code (DCP's own ``read_metadata`` would ``pickle.load`` it); each
    record's CRC is checked before DCP decodes it; it remembers which entry and file it reads
    (named when DCP itself fails). Each record is checked once per reader, even when
    resharding reads it for several destinations."""

    def __init__(self, checked: CheckedDir) -> None:
        super().__init__(checked.dir)
        self.dir = checked.dir
        self.checked_dir = checked
        self.records = None if checked.checksums is None else checked.checksums.records
        self.checked: set[tuple[str, int]] = set()
        self.current: Optional[tuple[str, str]] = None  # (entry, file) being read

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
        record = self.records[where]  # open_checked bound every listed record to its checksum
        file.seek(sinfo.offset)
        data = file.read(sinfo.length)
        check_record(self.dir, record, data)
        check_step(self.checked_dir, record, data)
        self.checked.add(where)
        return io.BytesIO(data)


def verify_checkpoint_dir(checked: CheckedDir) -> int:
    """Check every record of a checked checkpoint directory against its checksum (and the step
    against the checksum file's); returns the number of bytes checked. One record in memory
    at a time; no process group."""
    d = checked.dir
    if checked.checksums is None:
        raise CheckpointCorruptError(
            f"checkpoint {d} has no {CHECKSUMS_FILE}: it was saved without checksums and cannot be verified"
        )
    total = 0
    for f, group in _by_file(checked.checksums.records.values()):
        try:
            with open(d / f, "rb") as stream:
                for record in group:
                    stream.seek(record.offset)
                    data = stream.read(record.length)
                    check_record(d, record, data)
                    check_step(checked, record, data)
                    check_decodes(checked, record, data)
                    total += record.length
        except OSError as e:
            raise CheckpointCorruptError(f"checkpoint {d}: data file {f} cannot be read ({e})") from e
    return total


def check_decodes(checked: CheckedDir, record: Record, data: bytes) -> None:
    """The record decodes as loading decodes it (``torch.load(weights_only=True)``), to a
    tensor of its chunk's size and dtype for a tensor entry: what loading would refuse,
    verifying refuses too, though its checksum matches (a checkpoint written to harm)."""
    entry = checked.metadata.state_dict_metadata[record.key]
    try:
        value = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - anything but the allowed types and a damaged record alike
        raise CheckpointCorruptError(
            f"corrupt checkpoint {checked.dir}: {record.describe()} in data file {record.file} cannot be "
            f"decoded ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from e
    if isinstance(entry, TensorStorageMetadata):
        chunk = next(c for c in entry.chunks if tuple(c.offsets) == record.chunk)
        if not (isinstance(value, torch.Tensor) and value.size() == chunk.sizes
                and value.dtype == entry.properties.dtype):
            got = f"{value.dtype}{list(value.size())}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise CheckpointCorruptError(
                f"corrupt checkpoint {checked.dir}: {record.describe()} in data file {record.file} holds {got}, "
                f"its metadata says {entry.properties.dtype}{list(chunk.sizes)}"
            )


def _by_file(records: Iterable[Record]) -> list[tuple[str, list[Record]]]:
    out: dict[str, list[Record]] = {}
    for r in sorted(records, key=lambda r: (r.file, r.offset)):
        out.setdefault(r.file, []).append(r)
    return list(out.items())
