"""Checksums of every record a checkpoint holds, taken while it is written and checked
while it is read.

A DCP data file is a sequence of records, one per saved tensor chunk or object entry;
``.metadata`` maps each entry ``(key, chunk offset)`` to ``(file, byte offset, length)``.
Saving: :class:`ChecksumWriter` passes every byte a rank writes through ``zlib.crc32``
on its way to the file (no second read; for large writes in a second thread, at the same
time as the write itself), one CRC per record (DCP starts each record
with ``tell()``, and ``torch.save`` writes sequentially). The CRCs travel with DCP's
write results to the coordinator, which writes them to ``checksums.json`` before DCP
writes ``.metadata``, last. Loading: :class:`VerifyingReader` reads each record whole,
checks its CRC, then hands the bytes to DCP, so what is checked is what is decoded.
A damaged record raises :class:`CheckpointCorruptError` naming the directory, the
data file and the entry; :func:`verify_checkpoint` checks every record, in one
process, without a process group.

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

Imports: :mod:`fzero.checkpoint.errors`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .errors import CheckpointCorruptError

__all__ = ["ALGORITHM", "CHECKSUMS_FILE", "ChecksumWriter", "VerifyingReader", "verify_checkpoint_dir"]

ALGORITHM = "crc32"
CHECKSUMS_FILE = "checksums.json"


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
    """DCP's file writer that records a CRC of every record it writes (see the module doc)."""

    def __init__(self, path: Any, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.fs = _ChecksumFileSystem()

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
        entries = []
        plain = []
        for wrs in results:
            plain.append([dataclasses.replace(wr, storage_data=wr.storage_data.info) for wr in wrs])
            for wr in wrs:
                info = wr.storage_data.info
                offset = None if wr.index.offset is None else list(wr.index.offset)
                entries.append([info.relative_path, info.offset, info.length, wr.storage_data.crc,
                                wr.index.fqn, offset])
        entries.sort()
        body = json.dumps(entries, separators=(",", ":"))
        doc = {"algorithm": ALGORITHM, "records": entries, "self": _crc(body.encode())}
        path = Path(self.path) / CHECKSUMS_FILE
        with open(path, "w") as f:
            json.dump(doc, f, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
        super().finish(metadata, plain)  # writes .metadata, last


@dataclasses.dataclass(frozen=True)
class Record:
    """One checksummed record: where it lies and what it holds."""

    file: str
    offset: int
    length: int
    crc: int
    key: str
    chunk: Optional[tuple[int, ...]]

    def describe(self) -> str:
        piece = "" if not self.chunk or not any(self.chunk) else f" (chunk at {list(self.chunk)})"
        return f"entry {self.key!r}{piece}"


def read_checksums(d: Path) -> Optional[dict[tuple[str, int], Record]]:
    """The records of ``d/checksums.json`` by (file, byte offset); None for a checkpoint saved
    without checksums (before they existed). A damaged checksum file is a corrupt checkpoint."""
    path = d / CHECKSUMS_FILE
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
        records = doc["records"]
        if doc.get("algorithm") != ALGORITHM:
            raise ValueError(f"unknown algorithm {doc.get('algorithm')!r}")
        if _crc(json.dumps(records, separators=(",", ":")).encode()) != doc["self"]:
            raise ValueError("its own checksum differs")
        out = {}
        for f, off, n, crc, key, chunk in records:
            out[(f, off)] = Record(f, off, n, crc, key, None if chunk is None else tuple(chunk))
        return out
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointCorruptError(f"checkpoint {d}: file {CHECKSUMS_FILE} is damaged ({e})") from e


def check_record(d: Path, record: Record, data: Any) -> None:
    if len(data) != record.length or _crc(data) != record.crc:
        raise CheckpointCorruptError(
            f"corrupt checkpoint {d}: {record.describe()} in data file {record.file} "
            f"(bytes {record.offset}-{record.offset + record.length}) fails its {ALGORITHM} checksum"
        )


class VerifyingReader(dcp.FileSystemReader):
    """DCP's file reader that checks each record's CRC before DCP decodes it, and remembers
    which entry and file it reads (named when DCP itself fails). Each record is checked once
    per reader, even when resharding reads it for several destinations."""

    def __init__(self, path: Any) -> None:
        super().__init__(path)
        self.dir = Path(path)
        self.records = read_checksums(self.dir)
        self.checked: set[tuple[str, int]] = set()
        self.current: Optional[tuple[str, str]] = None  # (entry, file) being read

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self.keys = {(info.relative_path, info.offset): idx.fqn for idx, info in metadata.storage_data.items()}

    def _slice_file(self, file: Any, sinfo: Any) -> Any:
        where = (sinfo.relative_path, sinfo.offset)
        self.current = (self.keys.get(where, "?"), sinfo.relative_path)
        if self.records is None or where in self.checked:
            return super()._slice_file(file, sinfo)
        record = self.records.get(where)
        if record is None or record.length != sinfo.length:
            raise CheckpointCorruptError(
                f"corrupt checkpoint {self.dir}: entry {self.current[0]!r} in data file {sinfo.relative_path} "
                f"(bytes {sinfo.offset}-{sinfo.offset + sinfo.length}) has no checksum: .metadata or "
                f"{CHECKSUMS_FILE} is damaged"
            )
        file.seek(sinfo.offset)
        data = file.read(sinfo.length)
        check_record(self.dir, record, data)
        self.checked.add(where)
        return io.BytesIO(data)


def verify_checkpoint_dir(d: Path, metadata: Metadata) -> int:
    """Check every record of the checkpoint directory ``d`` against its checksum; returns the
    number of bytes checked. One record in memory at a time; no process group."""
    records = read_checksums(d)
    if records is None:
        raise CheckpointCorruptError(
            f"checkpoint {d} has no {CHECKSUMS_FILE}: it was saved without checksums and cannot be verified"
        )
    listed = {(info.relative_path, info.offset): (idx, info) for idx, info in metadata.storage_data.items()}
    missing = sorted(set(listed) - set(records))
    if missing:
        f, off = missing[0]
        raise CheckpointCorruptError(
            f"corrupt checkpoint {d}: entry {listed[missing[0]][0].fqn!r} in data file {f} has no checksum"
        )
    total = 0
    for f, group in _by_file(records.values()):
        with open(d / f, "rb") as stream:
            for record in group:
                stream.seek(record.offset)
                check_record(d, record, stream.read(record.length))
                total += record.length
    return total


def _by_file(records: Sequence[Record]) -> list[tuple[str, list[Record]]]:
    out: dict[str, list[Record]] = {}
    for r in sorted(records, key=lambda r: (r.file, r.offset)):
        out.setdefault(r.file, []).append(r)
    return list(out.items())
