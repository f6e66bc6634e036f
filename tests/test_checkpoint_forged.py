"""Forged checkpoint metadata is refused quickly, in bounded memory, with a short message, though every checksum
matches: ``.metadata`` re-pickled and ``checksums.json`` recomputed for it (:mod:`forge`; CRC-32 and SHA-256 bind
integrity, not authorship), so only the checks of the values themselves can refuse it.

Each forgery of :data:`CASES` is read by every public reader (``verify_checkpoint``, ``checkpoint_info``,
``load_checkpoint``, the command line's ``verify`` and ``info``) in a process of its own (``forged_worker.py``, run
with a timeout and killed on it, a reader still running after :data:`HANG_S` seconds ends it: a hang fails, never
stalls the suite), and compared with the same readers on the genuine checkpoint: each reader refuses with a
:class:`CheckpointError` (the command line: exit status 1, one line on stderr) within :data:`BOUND` seconds of CPU, a
message under :data:`MESSAGE` characters, and the process's peak RSS at most :data:`MEMORY` times the genuine read's;
or, where the case says so, it reads the checkpoint correctly within the same bounds. Then a hypothesis fuzz of the metadata's
fields, run in this process (each read under an alarm): every read is refused likewise, or succeeds only where the
forgery changes nothing the reader reads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata

import forge
import fzero
import fzero.checkpoint as ckpt
from ckpt_worker import fresh, train
from fzero.checkpoint import CheckpointError, save_checkpoint
from fzero.checkpoint.checksums import CHECKSUMS_FILE, _doc_crc
from helpers import examples

TESTS = Path(__file__).resolve().parent
# seconds of CPU a reader may spend on a forgery (CPU, not wall clock: the suite runs beside other tests on two cores,
# and a valid checkpoint of 20,000 records takes seconds to decode)
BOUND = 10.0
# seconds of wall clock after which a reader still running is a hang (its process ends: forged_worker.py). Far above
# BOUND: in CI a valid 20,000-record read (5-6 s of CPU) shares two cores with another test file, this module's second
# worker and a compiler, and ran past 15 s
HANG_S = 40.0
PROCESS_TIMEOUT = 300  # seconds a worker process may run in all (five readers, the imports): then it is killed
MESSAGE = 1000  # characters of an error message
MEMORY = 2.0  # a forged read's peak RSS, at most this many times the genuine read's
EXTRA = {"table": torch.arange(10), "tag": "x"}  # extra/table: the entry many_chunks replaces
# what a reader refusing says when the forger, not the reader, failed: the forgery's checksum file does not bind it
FORGER_FAILED = ("digest differs", "own checksum differs")
READERS = ("verify_checkpoint", "checkpoint_info", "load_checkpoint", "cli verify", "cli info")
GENUINE = "genuine"

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@dataclasses.dataclass(frozen=True)
class Case:
    """A forgery (``forge(checkpoint_dir)``) and what is correct of it: every reader refuses it, except those in
    ``accepts``, which read it (``load_checkpoint``: its ``extra["table"]`` is ``arange`` in shape ``table``)."""

    forge: Callable[[Path], None]
    accepts: frozenset[str] = frozenset()
    table: tuple[int, ...] | None = None


ALL = frozenset(READERS)
INFO = frozenset({"checkpoint_info", "cli info"})
CASES: dict[str, Case] = {
    # 1, 2: an entry claiming 10**12 or 4 GiB, its record, chunk and a sparse data file all agreeing (the record's CRC
    # cannot match: the forger cannot read the hole it claims). The manifest (a bytes entry) and the step (a tensor
    # entry) are read by every reader, so every reader must refuse without reading or allocating what they claim.
    "1e12 bytes: manifest": Case(lambda d: forge.huge_entry(d, "fzero/manifest", 10**12)),
    "1e12 bytes: step": Case(lambda d: forge.huge_entry(d, "fzero/step", 10**12)),
    "4 GiB: manifest": Case(lambda d: forge.huge_entry(d, "fzero/manifest", 4 << 30)),
    "4 GiB: step": Case(lambda d: forge.huge_entry(d, "fzero/step", 4 << 30)),
    # 3: a structure of shared references, 60 levels (2**60 leaves in 60 objects), where a shape belongs: an entry's
    # size (lists; tuples), a record index's chunk offset (inside a MetadataIndex, a dict key) and an entry name (a
    # dict key): the last two written as raw opcodes, the unpickler hashes them as it inserts them.
    "shared size: lists": Case(lambda d: forge.laughs(d, 60, kind=list)),
    "shared size: tuples": Case(lambda d: forge.laughs(d, 60, kind=tuple)),
    "shared index offset": Case(lambda d: forge.laughs_offset(d, 60)),
    "shared entry name": Case(lambda d: forge.laughs_key(d, 60)),
    # 4: an entry name that is a tuple of 10**7 ints (a 50 MB pickle, under the 64 MiB metadata limit)
    "long name": Case(lambda d: forge.long_name(d, 10**7)),
    # 5: one entry in 20,000 chunks of one element, each with its own record. Decodable, it is a valid checkpoint
    # (extra/table = arange(20000)): every reader reads it (load returns the table), the checks linear in the chunks.
    "20000 chunks": Case(lambda d: forge.many_chunks(d, 20_000, decodable=True), accepts=ALL, table=(20_000,)),
    # undecodable (eight raw bytes a record, valid CRCs): verify and load decode the records and refuse; info reads
    # only the metadata, the manifest and the scalars (its documented contract), so it reads this one as it is
    "20000 undecodable chunks": Case(lambda d: forge.many_chunks(d, 20_000, decodable=False), accepts=INFO),
    # the same, 2-D ([100, 200] in 1x1 chunks, undecodable): every reader checks that no two chunks overlap before it
    # reads a record, and that check of N-D chunks must not compare every pair (2 * 10**8 pairs)
    "20000 chunks, 2-D": Case(lambda d: forge.many_chunks(d, 20_000, decodable=False, shape=(100, 200)),
                              accepts=INFO),
    # 2,000 decodable chunks as the step (int64[2000] where the state has a scalar): load refuses it (not the
    # template's entry), info (its manifest says one element) and verify (the step's first chunk holds 0, not 2) too
    "2000 chunks as the step": Case(lambda d: forge.many_chunks(d, 2_000, key="fzero/step", decodable=True)),
}


@dataclasses.dataclass
class Run:
    """One worker process's results: ``rows`` by reader, the reader it started last, ``peak`` RSS (None: it did not
    finish), its return code, stderr, whether it was killed, what the forger failed at (None: nothing), and the
    seconds spent forging and in the process."""

    rows: dict[str, dict[str, Any]]
    last_started: str | None
    peak: int | None
    returncode: int | None
    stderr: str
    killed: bool
    forger: str | None = None
    forge_s: float = 0.0
    process_s: float = 0.0


@pytest.fixture(scope="module")
def genuine(tmp_path_factory) -> Path:
    """A checkpoint root as a user saves it (stage 2, two simulated ranks, two steps, an extra table)."""
    root = tmp_path_factory.mktemp("forged") / "genuine"
    comm = fzero.SimulatedWorld(2)
    save_checkpoint(train(fresh(comm), comm, range(2)), root, comm, extra=EXTRA)
    return root


def _checkpoint(root: Path) -> Path:
    return root / (root / "LATEST").read_text().strip()


def _bound_checksums(d: Path) -> str | None:
    """What keeps the checksum file from binding the forged metadata (None: it binds it, as an attacker's would)."""
    doc = json.loads((d / CHECKSUMS_FILE).read_text())
    if doc["metadata"]["sha256"] != hashlib.sha256((d / ".metadata").read_bytes()).hexdigest():
        return "the checksum file's digest of .metadata differs"
    if doc["self"] != _doc_crc(doc):
        return "the checksum file's own CRC differs"
    return None


def _launch(root: Path, out: Path) -> Run:
    """forged_worker.py on ``root``, killed after PROCESS_TIMEOUT s."""
    here = str(Path(fzero.__file__).resolve().parent.parent)  # the fzero this process tests
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    killed, code = False, None
    try:
        done = subprocess.run([sys.executable, str(TESTS / "forged_worker.py"), str(root), str(out), str(HANG_S)],
                              cwd=TESTS, env=env, capture_output=True, text=True, timeout=PROCESS_TIMEOUT)
        stderr, code = done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:  # run() killed it
        killed = True
        stderr = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
    lines = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    rows = {r["reader"]: r for r in lines if "reader" in r}
    started = [r["start"] for r in lines if "start" in r]
    peak = next((r["peak_rss"] for r in lines if "peak_rss" in r), None)
    return Run(rows, started[-1] if started else None, peak, code, stderr, killed)


def _case_run(genuine: Path, where: Path, name: str) -> Run:
    """A copy of the genuine root, forged as case ``name`` (unless genuine), read by the worker."""
    root = where / "root"
    shutil.copytree(genuine, root)
    t0 = time.perf_counter()
    if name != GENUINE:
        d = _checkpoint(root)
        CASES[name].forge(d)
        failed = _bound_checksums(d)
        if failed is not None:
            return Run({}, None, None, None, "", False, forger=failed)
    t1 = time.perf_counter()
    run = _launch(root, where / "rows.jsonl")
    return dataclasses.replace(run, forge_s=t1 - t0, process_s=time.perf_counter() - t1)


@pytest.fixture(scope="module")
def runs(request, genuine, tmp_path_factory) -> dict[str, Run]:
    """The genuine run and every selected case's, two processes at a time (forging overlaps another's reads)."""
    module = request.module
    wanted = [GENUINE] + [n for n in CASES if any(
        item.module is module and getattr(item, "callspec", None) is not None
        and item.callspec.params.get("case") == n for item in request.session.items)]
    base = tmp_path_factory.mktemp("cases")
    with ThreadPoolExecutor(2) as pool:
        futures = {n: pool.submit(_case_run, genuine, base / f"case{i}", n) for i, n in enumerate(wanted)}
        return {n: f.result() for n, f in futures.items()}


def _problems(run: Run, case: Case, genuine: Run | None) -> list[str]:
    """Everything ``run`` did that ``case`` says a reader must not (empty: it passed)."""
    if run.forger is not None:
        return [f"the forger failed ({run.forger}): the test proves nothing"]
    problems, skipped = [], []
    for reader in READERS:
        row = run.rows.get(reader)
        if row is None:
            if run.last_started == reader:
                how = f"killed after {PROCESS_TIMEOUT} s" if run.killed else f"no return within {HANG_S} s"
                problems.append(f"{reader}: {how} (a hang, in {_where(run.stderr)})")
            else:
                skipped.append(reader)
            continue
        if row["cpu"] > BOUND:
            problems.append(f"{reader}: took {row['cpu']:.1f} s of CPU ({row['seconds']:.1f} s), more than {BOUND} s")
        if row.get("length", 0) >= MESSAGE:
            problems.append(f"{reader}: a message of {row['length']} characters: {row['message'][:120]!r}...")
        if reader in case.accepts:
            problems += _accepted_problems(reader, row, case, genuine)
        else:
            problems += _refused_problems(reader, row)
    if skipped:
        problems.append(f"not run, the process having ended: {', '.join(skipped)}")
    if genuine is not None and genuine.peak is None:
        problems.append("the genuine read did not finish: no peak RSS to compare with")
    elif run.peak is not None and genuine is not None and run.peak > MEMORY * genuine.peak:
        problems.append(f"peak RSS {run.peak / 2**20:.0f} MiB, more than {MEMORY} x the genuine read's "
                        f"{genuine.peak / 2**20:.0f} MiB")
    return problems


def _where(stderr: str) -> str:
    """The innermost frames of the main thread in a ``faulthandler`` dump (the block of frames that reaches the
    worker's ``<module>``): where the reader was stuck."""
    blocks: list[list[str]] = []
    for line in stderr.splitlines():
        if "most recent call first" in line:
            blocks.append([])
        elif blocks and line.strip().startswith("File"):
            blocks[-1].append(line.strip().removeprefix("File "))
    main = next((b for b in blocks if b and b[-1].endswith("in <module>")), None)
    return " <- ".join(main[:3]) if main else "?"


def _refused_problems(reader: str, row: dict[str, Any]) -> list[str]:
    text = row.get("message", "")
    if any(s in text for s in FORGER_FAILED):
        return [f"{reader}: refused the forgery for its checksum file, which the forger recomputed: {text[:200]!r}"]
    if reader.startswith("cli"):
        if "type" in row:
            return [f"{reader}: {row['type']} escaped the command line: {text[:200]!r}"]
        if row["rc"] != 1 or row["stderr_lines"] != 1 or row["stdout_lines"]:
            return [f"{reader}: exit status {row['rc']}, {row['stderr_lines']} stderr lines, {row['stdout_lines']} "
                    f"stdout lines (wanted 1, one line, none): {text[:200]!r}"]
        return []
    if row["ok"]:
        return [f"{reader}: read the forgery: {row.get('value')!r}"]
    if not row["checkpoint_error"]:
        return [f"{reader}: raised {row['type']}, not a CheckpointError: {text[:200]!r}"]
    return []


def _accepted_problems(reader: str, row: dict[str, Any], case: Case, genuine: Run | None) -> list[str]:
    if not row["ok"]:
        return [f"{reader}: refused a checkpoint it reads ({row.get('type', 'exit status 1')}): "
                f"{row.get('message', '')[:200]!r}"]
    value = row.get("value")
    if reader == "load_checkpoint" and case.table is not None and (
            value["table_shape"] != list(case.table) or not value["table_is_arange"]):
        return [f"{reader}: extra['table'] is not arange in shape {list(case.table)}: {value}"]
    if reader == "checkpoint_info" and genuine is not None:
        want = genuine.rows["checkpoint_info"]["value"]
        if value != want:
            return [f"{reader}: says {value}, the genuine checkpoint {want}"]
    return []


def test_the_genuine_checkpoint_reads_within_the_bounds(runs):
    """The baseline: every reader reads the genuine checkpoint (load: its table, step 2) within BOUND seconds, in
    the peak RSS the forgeries are compared with."""
    run = runs[GENUINE]
    problems = _problems(run, Case(lambda d: None, accepts=ALL, table=(10,)), None)
    assert not problems, "\n".join(problems)
    assert run.rows["load_checkpoint"]["value"]["step"] == 2
    assert run.rows["checkpoint_info"]["value"] == {"step": 2, "extra": ["table", "tag"], "num_params": 8}
    assert run.rows["verify_checkpoint"]["value"] > 0 and run.peak is not None


@pytest.mark.parametrize("case", list(CASES))
def test_a_forged_checkpoint_is_refused_quickly_in_bounded_memory(runs, case):
    """Every reader of the forgery ``case`` refuses it with a CheckpointError (the command line: status 1, one line)
    of under MESSAGE characters, or reads it correctly where the case says it is valid, within BOUND seconds each,
    the process's peak RSS at most MEMORY x the genuine read's; never for its checksums, which the forger bound."""
    problems = _problems(runs[case], CASES[case], runs[GENUINE])
    assert not problems, f"{case}:\n  " + "\n  ".join(problems)


# -- the forgers themselves -----------------------------------------------------------------------------------------
def test_a_forgery_that_changes_nothing_passes_every_check(genuine, tmp_path):
    """The forgers bind what they write: metadata re-pickled unchanged (``write_forged``), and spliced back to its own
    value through raw opcodes (``spliced``, ``write_forged_blob``), verify and load as the genuine checkpoint does;
    and a spliced structure lands inside the hashed object it was put in (depth 3, read back with plain pickle)."""
    comm = fzero.SimulatedWorld(2)
    template = fresh(comm, seed=3)
    want = ckpt.verify_checkpoint(genuine)
    for way in ("pickled", "spliced"):
        root = tmp_path / way
        shutil.copytree(genuine, root)
        d = _checkpoint(root)
        md = forge.read_metadata(d)
        if way == "pickled":
            forge.write_forged(d, md)
        else:
            key = "fzero/master/0.weight"
            md.state_dict_metadata = {forge.SENTINEL if k == key else k: v for k, v in md.state_dict_metadata.items()}
            forge.write_forged_blob(d, forge.spliced(md, forge.short_str_ops(key)))
        assert ckpt.verify_checkpoint(root) == want
        _, extra = ckpt.load_checkpoint(root, template, comm)
        assert torch.equal(extra["table"], EXTRA["table"])
    md = forge.read_metadata(_checkpoint(genuine))
    md.storage_data = {forge.replace_field(i, offset=forge.SENTINEL) if i.fqn == "fzero/master/0.weight" else i: v
                       for i, v in md.storage_data.items()}
    back = pickle.loads(forge.spliced(md, forge.shared_ops(3)))
    offsets = [i.offset for i in back.storage_data if i.fqn == "fzero/master/0.weight"]
    assert offsets == [forge.shared(3)]


# -- the fuzz -------------------------------------------------------------------------------------------------------
TARGETS = ("fzero/manifest", "fzero/step", "fzero/master/0.weight", "fzero/master/3.weight", "fzero/hyper/0/lr",
           "extra/table", "extra/tag")
TENSORS = tuple(t for t in TARGETS if t not in ("fzero/manifest", "extra/tag"))
INFO_READS = ("fzero/manifest", "fzero/step", "fzero/hyper/")  # the entries checkpoint_info reads (its doc)

_INTS = st.sampled_from([0, 1, 2, 3, 9, 54, -1, -(2**63), 2**31, 2**40, 2**63, 2**64, 10**30]) | st.integers(-3, 80)
_LEAVES = st.one_of(
    _INTS, st.booleans(), st.floats(), st.none(), st.text(max_size=6), st.just("x" * 100_000), st.binary(max_size=6),
    st.sampled_from([torch.float32, torch.float64, torch.int64, torch.uint8, torch.bool, torch.complex64]))


def _size_of(xs: list[Any]) -> Any:
    try:
        return torch.Size(xs)
    except (TypeError, RuntimeError, OverflowError, ValueError):
        return tuple(xs)


def _nest(depth: int, kind: type) -> Any:
    x: Any = 1
    for _ in range(depth):
        x = kind([x])
    return x


VALUES = st.one_of(
    st.lists(_INTS, max_size=3).map(_size_of),  # shapes of forged ints
    st.recursive(_LEAVES, lambda c: st.lists(c, max_size=3) | st.tuples(c, c) | st.tuples(c), max_leaves=10),
    st.builds(_nest, st.integers(1, 400), st.sampled_from([list, tuple])),  # deep nesting
    st.builds(forge.shared, st.integers(1, 10), st.just(1), st.sampled_from([list, tuple])),  # shared, small
)
PATHS = st.sampled_from(["../__0_0.distcp", "/etc/passwd", ".metadata", CHECKSUMS_FILE, "", "a/b", "__0_0.distcp\0",
                         "__1_0.distcp", "LATEST", "__0_0.distcp ", "x" * 300, "..", "."])
MUTATIONS = st.one_of(
    st.tuples(st.just("entry"), st.sampled_from(TARGETS), st.sampled_from(["size", "dtype", "chunks", "properties"]),
              VALUES),
    st.tuples(st.just("chunk"), st.sampled_from(TENSORS), st.sampled_from(["offsets", "sizes"]), VALUES),
    st.tuples(st.just("record"), st.sampled_from(TARGETS), st.sampled_from(["offset", "length", "relative_path"]),
              VALUES | PATHS),
    st.tuples(st.just("shift"), st.sampled_from(TARGETS), st.sampled_from(["offset", "length"]),
              st.integers(-64, 64).filter(bool)),
    st.tuples(st.just("index"), st.sampled_from(TARGETS), st.sampled_from(["fqn", "offset"]), VALUES | st.text()),
    st.tuples(st.just("key"), st.sampled_from(TARGETS), VALUES | st.text(max_size=300)),
    st.tuples(st.just("chunk_count"), st.sampled_from(TENSORS), st.integers(0, 3000),
              st.sampled_from(["repeat", "empty", "split"])),
    st.tuples(st.just("table"), st.sampled_from(["state_dict_metadata", "storage_data", "planner_data",
                                                 "storage_meta", "version"]), VALUES),
    st.just(("noop",)),
)


def _mutate(md: Metadata, m: tuple[Any, ...]) -> bool:
    """Apply mutation ``m`` to ``md`` in place; False where it does not apply (as to what an earlier one forged)."""
    try:
        return _mutated(md, m) is not None
    except (AttributeError, TypeError, IndexError, ValueError, RuntimeError, OverflowError):
        return False


def _mutated(md: Metadata, m: tuple[Any, ...]) -> str | None:
    kind, entries, storage = m[0], md.state_dict_metadata, md.storage_data
    if kind == "noop":
        return None
    if kind == "table":
        setattr(md, m[1], m[2])
        return ""
    key = m[1]
    if not isinstance(entries, dict) or not isinstance(storage, dict) or key not in entries:
        return None
    entry = entries[key]
    indices = [i for i in storage if getattr(i, "fqn", None) == key]
    if kind == "entry":
        if m[2] == "dtype":
            if not hasattr(entry, "properties"):
                return None
            entries[key] = forge.replace_field(entry, properties=forge.replace_field(entry.properties, dtype=m[3]))
        elif hasattr(entry, m[2]):
            entries[key] = forge.replace_field(entry, **{m[2]: m[3]})
        else:
            return None
    elif kind == "chunk":
        entries[key] = forge.replace_field(entry, chunks=[forge.replace_field(entry.chunks[0], **{m[2]: m[3]}),
                                                          *entry.chunks[1:]])
    elif kind in ("record", "shift"):
        if not indices:
            return None
        info = storage[indices[0]]
        value = m[3] if kind == "record" else getattr(info, m[2]) + m[3]
        storage[indices[0]] = forge.replace_field(info, **{m[2]: value})
    elif kind == "index":
        if not indices:
            return None
        new = forge.replace_field(indices[0], **{m[2]: m[3]})
        try:
            md.storage_data = {new if i is indices[0] else i: v for i, v in storage.items()}
        except TypeError:  # unhashable: no pickle of objects can hold it (a dict key)
            return None
    elif kind == "key":
        try:
            md.state_dict_metadata = {m[2] if k == key else k: v for k, v in entries.items()}
        except TypeError:
            return None
    elif kind == "chunk_count":
        n, how, first = m[2], m[3], entry.chunks[0]
        if how == "repeat":  # the first chunk n more times: overlapping, records unchanged
            chunks = list(entry.chunks) + [first] * n
        elif how == "empty":  # n chunks of no element at the first one's offset
            chunks = list(entry.chunks) + [ChunkStorageMetadata(first.offsets, torch.Size([0] * len(first.sizes)))] * n
        else:  # the entry's first chunk cut in up to n pieces, without records of their own
            size = first.sizes[0] if len(first.sizes) == 1 else 0
            cuts = sorted({0, size, *range(0, size, max(1, size // max(n, 1)))})
            chunks = [ChunkStorageMetadata(torch.Size([first.offsets[0] + a]), torch.Size([b - a]))
                      for a, b in zip(cuts, cuts[1:])] + list(entry.chunks[1:]) if size else list(entry.chunks)
        entries[key] = forge.replace_field(entry, chunks=chunks)
    return key


def _canon(x: Any) -> Any:
    """``x`` as what it means to a reader: sequences alike (a ``torch.Size``, tuple or list of the same ints), other
    values by type and value (``True`` is not ``1``)."""
    if isinstance(x, (list, tuple)):
        return ("seq", tuple(_canon(v) for v in x))
    if type(x) is str:
        return ("str", x)
    return (type(x).__name__, repr(x)[:200])


def _changed(forged: Any, genuine: Any) -> set[str]:
    """The names of the entries whose meaning (:func:`_meaning`: the entry or one of its records) the forgery changed;
    "" for what is not an entry of a string name (a whole table, a forged name)."""
    if forged is None or genuine is None:
        return {""}
    names = set()
    for k in forged.keys() | genuine.keys():
        if forged.get(k) != genuine.get(k):
            name = k[1] if k[0] == "record" else k
            names.add(name[1] if name[0] == "str" else "")
    return names


def _meaning(md: Metadata) -> Any:
    """What the values read from ``md`` depend on: each entry's kind, dtype, size and non-empty chunks (a chunk of no
    element holds nothing), each record's place; not what is information only (planner data, storage meta, version)."""
    entries, storage = md.state_dict_metadata, md.storage_data
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        return None
    out = {}
    for k, e in entries.items():
        chunks = getattr(e, "chunks", None)
        props = getattr(e, "properties", None)
        kept = sorted(_canon((c.offsets, c.sizes)) for c in chunks if not (
            isinstance(c.sizes, tuple) and all(isinstance(n, int) for n in c.sizes) and math.prod(c.sizes) == 0)) \
            if isinstance(chunks, list) and all(isinstance(c, ChunkStorageMetadata) for c in chunks) else _canon(chunks)
        out[_canon(k)] = (type(e).__name__, _canon(getattr(props, "dtype", None)), _canon(getattr(e, "size", None)),
                          repr(kept))
    for i, v in storage.items():
        out[("record", _canon(getattr(i, "fqn", None)), _canon(getattr(i, "offset", None)))] = tuple(
            _canon(getattr(v, f, None)) for f in ("relative_path", "offset", "length"))
    return out


class _Hung(BaseException):
    """An alarm: a read did not return within HANG_S seconds."""


def _timed(fn: Callable[[], Any]) -> tuple[bool, Any, float]:
    """``(returned, value or exception, CPU seconds)``; an alarm after HANG_S seconds interrupts a read still running
    in Python (one a reader catches and converts has still run HANG_S seconds: its test fails on them)."""
    def alarm(signum: int, frame: Any) -> None:
        raise _Hung(f"no return within {HANG_S} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, HANG_S)
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        value, returned = fn(), True
    except BaseException as e:  # noqa: BLE001 - judged by the caller
        value, returned = e, False
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    if time.perf_counter() - t0 >= HANG_S:
        value, returned = _Hung(f"no return within {HANG_S} s (then: {value!r:.200})"), False
    return returned, value, time.process_time() - c0


def _info_view(info: dict[str, Any]) -> dict[str, Any]:
    """What checkpoint_info says of the state: not where it is, nor the sizes of its files and records as claimed."""
    return {k: v for k, v in info.items() if k not in ("directory", "files", "bytes_by_kind")}


class _FuzzBase(dict):
    """What every fuzzed example shares (a short ``repr``: hypothesis prints its arguments)."""

    def __repr__(self) -> str:
        return "fuzz_base"


@pytest.fixture(scope="module")
def fuzz_base(genuine, tmp_path_factory) -> dict[str, Any]:
    """Where examples are written, the world and template to load into, what the genuine metadata means and what
    checkpoint_info says of the genuine checkpoint."""
    comm = fzero.SimulatedWorld(2)
    d = _checkpoint(genuine)
    return _FuzzBase(dir=tmp_path_factory.mktemp("fuzz"), comm=comm, template=fresh(comm, seed=3),
                     meaning=_meaning(forge.read_metadata(d)), info=_info_view(ckpt.checkpoint_info(genuine)))


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutations=st.lists(MUTATIONS, min_size=1, max_size=3))
def test_fuzzed_metadata_is_refused_or_changes_nothing_read(genuine, fuzz_base, mutations):
    """Metadata forged field by field (types, huge/negative/bool/float ints, nesting, shared references, long strings,
    chunk counts, offsets and sizes, record places and files, dtypes, entry names, whole tables), re-pickled with its
    checksums recomputed: ``verify_checkpoint``, ``checkpoint_info`` and ``load_checkpoint`` each raise a
    CheckpointError of under MESSAGE characters within BOUND seconds, never another exception, or succeed only where
    the forgery changes nothing they read: verify and load read every entry, so only a forgery whose entries and
    records mean what the genuine ones do (:func:`_meaning`); info reads the metadata, the manifest and a few scalars,
    so also one of other entries' values, if it then says what it says of the genuine checkpoint."""
    with tempfile.TemporaryDirectory(dir=fuzz_base["dir"]) as where:
        root = Path(where) / "root"
        shutil.copytree(genuine, root)
        d = _checkpoint(root)
        md = forge.read_metadata(d)
        for m in mutations:
            event(f"mutation {m[0]}: {'applied' if _mutate(md, m) else 'not applicable'}")
        forge.write_forged(d, md)
        assert _bound_checksums(d) is None
        changed = _changed(_meaning(md), fuzz_base["meaning"])
        same = not changed
        comm = fuzz_base["comm"]
        readers = {"verify_checkpoint": lambda: ckpt.verify_checkpoint(root),
                   "checkpoint_info": lambda: ckpt.checkpoint_info(root),
                   "load_checkpoint": lambda: ckpt.load_checkpoint(root, fuzz_base["template"], comm)}
        for name, fn in readers.items():
            returned, value, seconds = _timed(fn)
            event(f"{name}: {'read' if returned else type(value).__name__}")
            assert seconds < BOUND, f"{name} took {seconds:.1f} s of CPU ({value!r:.300})"
            if not returned:
                assert isinstance(value, CheckpointError), f"{name}: {type(value).__name__}: {value!s:.500}"
                assert len(str(value)) < MESSAGE, f"{name}: a message of {len(str(value))} characters"
                assert not any(s in str(value) for s in FORGER_FAILED), f"{name}: {value}"
            elif name == "checkpoint_info" and not same:
                assert not any(t == "" or t.startswith(INFO_READS) for t in changed), \
                    f"{name} read a forgery of what it reads ({changed})"
                assert _info_view(value) == fuzz_base["info"], f"{name} says {_info_view(value)}"
            else:
                assert same, f"{name} read a forgery that changes what it reads ({mutations!r:.500})"
