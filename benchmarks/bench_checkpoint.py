"""Checkpoint costs: checksum algorithms against the save time, and the peak memory of loading.

    python benchmarks/bench_checkpoint.py [--mb 100] [--repeats 3]

1. Each candidate checksum over the bytes of a tensor of ``--mb`` MB, against
   ``save_checkpoint`` of a state holding that many MB of master weights (plus two
   Adam moments) on a simulated world of 2 ranks, with and without fzero's CRC-32
   records (the difference is what the checksums cost inside a save).
2. The peak resident memory and wall time of ``load_checkpoint`` of that state, pure (the
   template kept) and ``donate=True`` (loaded into the template's buffers), each in a fresh
   process: the peak RSS during the load (``VmHWM``, reset just before it through
   ``/proc/self/clear_refs``) minus the RSS just before it; then, in the same process, the
   best of ``--repeats`` further loads and of as many ``verify_checkpoint`` calls. Linux only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

import fzero
import fzero.checkpoint.planners as planners


def _state(mb: int, comm: fzero.Communicator) -> fzero.TrainState:
    n = mb * 2**20 // 4
    params = {"w": torch.randn(n // 2), "v": torch.randn(n - n // 2 - 1000), "b": torch.randn(1000)}
    return fzero.init_train_state(params, fzero.adamw(), comm)


def _best(fn, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _plain_writer(path, *, bind=None, **kwargs):  # noqa: ANN001, ANN202 - ChecksumWriter's signature
    return dcp.FileSystemWriter(path, **kwargs)


def checksums(mb: int) -> None:
    comm = fzero.SimulatedWorld(2)
    state = _state(mb, comm)
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as root:
        times: dict[bool, list[float]] = {True: [], False: []}
        crc_writer = planners.ChecksumWriter
        for i in range(10):  # interleaved, so that a busy moment of the machine hits both alike
            checked = i % 2 == 0
            # DCP's own writer: no records (nor the binding its checksum file holds)
            planners.ChecksumWriter = crc_writer if checked else _plain_writer
            try:
                t0 = time.perf_counter()
                fzero.save_checkpoint(state, root, comm, name=f"{'c' if checked else 'p'}{i}")
                times[checked].append(time.perf_counter() - t0)
            finally:
                planners.ChecksumWriter = crc_writer
        with_crc, without = min(times[True]), min(times[False])
        total = sum(f.stat().st_size for f in (Path(root) / "c0").glob("*.distcp"))
        print(f"save_checkpoint, {total / 2**20:.0f} MiB written (master + 2 moments), best of 5:")
        print(f"  DCP writer {without * 1e3:7.0f} ms; with CRC-32 records {with_crc * 1e3:7.0f} ms "
              f"({(with_crc - without) / without * 100:+.1f} %)")
    data = torch.randn(mb * 2**20 // 4).numpy().tobytes()
    per_mb = without / (total / 2**20)
    print(f"checksum of {mb} MB in memory, against the save time of {mb} MB of checkpoint "
          f"({per_mb * mb * 1e3:.0f} ms):")
    candidates = {
        "zlib.crc32": lambda: zlib.crc32(data),
        "zlib.adler32": lambda: zlib.adler32(data),
        "hashlib.blake2b": lambda: hashlib.blake2b(data).digest(),
        "hashlib.sha256": lambda: hashlib.sha256(data).digest(),
        "hashlib.md5": lambda: hashlib.md5(data).digest(),
        "torch int32 sum": lambda: torch.frombuffer(bytearray(data), dtype=torch.int32).sum(dtype=torch.int64),
    }
    for name, fn in candidates.items():
        t = _best(fn)
        print(f"  {name:<16} {t * 1e3:6.0f} ms  {t / (per_mb * mb) * 100:5.1f} % of save")


_CHILD = r"""
import json, sys, time, torch, fzero
sys.path.insert(0, sys.argv[3])
from bench_checkpoint import _state
torch.set_num_threads(1)
comm = fzero.SimulatedWorld(2)
template = _state(int(sys.argv[2]), comm)
state_bytes = sum(t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(template))
def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets the peak (VmHWM) to the current RSS: the peak of the load alone
before = status("VmRSS")
donate = sys.argv[4] == "donate"
t0 = time.perf_counter()
state, _ = fzero.load_checkpoint(sys.argv[1], template, comm, donate=donate)
first = time.perf_counter() - t0
peak = status("VmHWM")
loads, verifies = [], []
for _ in range(int(sys.argv[5])):
    template = _state(int(sys.argv[2]), comm) if donate else template
    t0 = time.perf_counter()
    fzero.load_checkpoint(sys.argv[1], template, comm, donate=donate)
    loads.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    fzero.checkpoint.verify_checkpoint(sys.argv[1])
    verifies.append(time.perf_counter() - t0)
print(json.dumps({"state": state_bytes, "before": before, "peak": peak, "first": first, "load": min(loads),
                  "verify": min(verifies)}))
"""


def load_peak(mb: int, repeats: int) -> None:
    comm = fzero.SimulatedWorld(2)
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as root:
        fzero.save_checkpoint(_state(mb, comm), root, comm, name="s")
        here = str(Path(__file__).resolve().parent)
        print(f"load_checkpoint peak memory and time (fresh process; state = template's tensors; best of {repeats}):")
        for mode in ("pure", "donate"):
            out = subprocess.run([sys.executable, "-c", _CHILD, root, str(mb), here, mode, str(repeats)],
                                 capture_output=True, text=True, check=True, timeout=600)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            extra = r["peak"] - r["before"]
            print(f"  {mode:<7} state {r['state'] / 2**20:7.0f} MiB; RSS before load {r['before'] / 2**20:7.0f} MiB, "
                  f"peak {r['peak'] / 2**20:7.0f} MiB: +{extra / 2**20:.0f} MiB "
                  f"({extra / r['state']:.2f} x the state); first load {r['first'] * 1e3:.0f} ms, "
                  f"then {r['load'] * 1e3:.0f} ms; verify_checkpoint {r['verify'] * 1e3:.0f} ms")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=100, help="MB of master weights")
    p.add_argument("--repeats", type=int, default=3, help="timed loads and verifies after the measured first load")
    args = p.parse_args()
    torch.set_num_threads(1)
    checksums(args.mb)
    load_peak(args.mb, args.repeats)
