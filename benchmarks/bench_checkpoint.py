"""Checkpoint costs: checksum algorithms against the save time, the peak memory of loading, and the training
step's stall for a save, blocking against non-blocking.

    python benchmarks/bench_checkpoint.py [--mb 100] [--repeats 3]
    python benchmarks/bench_checkpoint.py --stall [--size 162M|small] [--rounds 2] [--steps 4] [--timeout 1500]

1. Each candidate checksum over the bytes of a tensor of ``--mb`` MB, against
   ``save_checkpoint`` of a state holding that many MB of master weights (plus two
   Adam moments) on a simulated world of 2 ranks, with and without fzero's CRC-32
   records (the difference is what the checksums cost inside a save).
2. The peak resident memory and wall time of ``load_checkpoint`` of that state, pure (the
   template kept) and ``donate=True`` (loaded into the template's buffers), each in a fresh
   process: the peak RSS during the load (``VmHWM``, reset just before it through
   ``/proc/self/clear_refs``) minus the RSS just before it; then, in the same process, the
   best of ``--repeats`` further loads and of as many ``verify_checkpoint`` calls. Linux only.
3. ``--stall`` (only this table): on 2 gloo ranks (one ``torchrun`` launch, one intra-op thread per rank), the
   TinyGPT of ``benchmarks/models.py`` at GPT-2 small's size (``--size 162M``: 162.4 M parameters, the
   configuration of ``bench_memory.py``) or a small one (``--size small``: about 7 M), AdamW fp32, stage 2, a
   donating step. Each of ``--rounds`` rounds, after a barrier: ``--steps`` steps without a save; a blocking
   ``save_checkpoint`` (the step is held for all of it); a ``save_checkpoint(blocking=False)`` (the step is held
   for the snapshot only) followed by ``--steps`` steps, each noted as running while the write was in flight if the
   write had not finished when it started; then ``wait()``. Rank 0's times; medians over the rounds, and the median
   over the rounds of each round's steps during the write against that round's steps without a save (the machine's
   speed drifts between rounds on a shared host). The steps run while each rank's background writer (DCP's writer
   process, at idle priority, its files written around the page cache) writes that rank's shards (its master and
   two moments): on a machine with fewer free cores than ranks plus writers they share the CPU with it. The first
   non-blocking save allocates its host buffer (the copy faults its pages in); the later ones reuse it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
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


STALL_RESULT = "BENCH_STALL_RESULT "  # the line rank 0 prints for the launcher
STALL_WARMUP = 2  # untimed steps first: the allocator's and gloo's first-use costs are not a save's


def _stall_sizes() -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_memory import GPT2_SMALL, SIZES

    return {"small": SIZES["7M"], "162M": GPT2_SMALL}


def _timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def stall_worker(args: argparse.Namespace) -> None:
    """One rank of the stall table (module doc, 3.): rank 0 prints its times as one JSON line."""
    import torch.distributed as dist

    from fzero.dist import TorchCommunicator
    from models import build_model, make_criterion, random_batch

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    comm = TorchCommunicator()
    cfg = _stall_sizes()[args.size]
    model = build_model(cfg, seed=0)
    state = fzero.init_train_state(model, fzero.adamw(), comm, stage=2)
    step = fzero.make_train_step(fzero.module_loss(model, make_criterion(cfg.vocab)), comm, donate=True)
    batches = [comm.split_batch(random_batch(cfg, seed=i)) for i in range(8)]
    calls = 0

    def one_step() -> None:
        nonlocal state, calls
        state, _ = step(state, batches[calls % len(batches)])
        calls += 1

    for _ in range(STALL_WARMUP):
        one_step()
    root = Path(args.stall_worker)
    times: dict[str, list[float]] = {"plain": [], "blocking": [], "stall": [], "during": [], "after": [],
                                     "wait": [], "ratio": []}
    for r in range(args.rounds):
        dist.barrier()
        plain = [_timed(one_step)[0] for _ in range(args.steps)]
        times["plain"] += plain
        dist.barrier()
        t0 = time.perf_counter()
        fzero.save_checkpoint(state, root, comm, name=f"blocking-{r}")
        times["blocking"].append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        handle = fzero.save_checkpoint(state, root, comm, name=f"background-{r}", blocking=False)
        times["stall"].append(time.perf_counter() - t0)
        during = []
        for _ in range(args.steps):
            writing = not handle.done()
            (during if writing else times["after"]).append(_timed(one_step)[0])
        times["during"] += during
        if during:  # against this round's own steps without a save: the machine's speed drifts between rounds
            times["ratio"].append(_median(during) / _median(plain))
        times["wait"].append(_timed(handle.wait)[0])
        dist.barrier()
        if comm.rank == 0:  # two checkpoints of the state on disk at most
            shutil.rmtree(root / f"blocking-{r}")
            if r:
                shutil.rmtree(root / f"background-{r - 1}")
    if comm.rank == 0:
        state_bytes = sum(t.numel() * t.element_size() for t in (*state.shard.master, *(
            m for ms in state.opt.moments for m in ms)))
        print(STALL_RESULT + json.dumps({"params": state.layout.num_params, "rank_bytes": state_bytes, **times}),
              flush=True)
    dist.destroy_process_group()


def _median(xs: list[float]) -> float:
    return float(torch.tensor(xs).median()) if xs else float("nan")


def format_stall(args: argparse.Namespace, r: dict) -> str:
    plain, blocking, stall = _median(r["plain"]), _median(r["blocking"]), _median(r["stall"])
    during = _median(r["during"])
    lines = [
        f"save stall, TinyGPT {args.size} ({r['params'] / 1e6:.1f} M parameters), gloo W=2, 1 thread/rank, AdamW "
        f"fp32, stage 2, donating step; rank 0, {r['rank_bytes'] / 2**20:.0f} MiB of master + moments per rank; "
        f"medians of {args.rounds} rounds of {args.steps} steps (shared CPU: timings are noisy):",
        f"  {'step without a save':<44} {plain * 1e3:9.0f} ms  ({len(r['plain'])} steps)",
        f"  {'blocking save: the step held':<44} {blocking * 1e3:9.0f} ms  (the whole write)",
        f"  {'non-blocking save: the step held':<44} {stall * 1e3:9.0f} ms  "
        f"({stall / blocking:.3f} x the blocking save)",
        f"  {'  the first (its host buffer allocated)':<44} {r['stall'][0] * 1e3:9.0f} ms",
        f"  {'  the later ones (the buffer reused)':<44} {_median(r['stall'][1:]) * 1e3:9.0f} ms  "
        f"({_median(r['stall'][1:]) / blocking:.3f} x the blocking save)",
        f"  {'steps while the write runs':<44} {during * 1e3:9.0f} ms  "
        f"({during / plain:.2f} x a step without a save; {len(r['during'])} steps)",
        f"  {'  each round against its own steps':<44} {_median(r['ratio']):9.2f} x  (median; rounds: "
        f"{', '.join(f'{x:.2f}' for x in r['ratio'])})",
        f"  {'steps after it finished':<44} {_median(r['after']) * 1e3:9.0f} ms  ({len(r['after'])} steps)",
        f"  {'wait() after the steps':<44} {_median(r['wait']) * 1e3:9.0f} ms",
    ]
    return "\n".join(lines)


def stall(args: argparse.Namespace) -> None:
    """The stall table: one torchrun launch of 2 ranks running :func:`stall_worker`."""
    from fzero.testing import run_torchrun

    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as root:
        flags = ["--size", args.size, "--rounds", str(args.rounds), "--steps", str(args.steps)]
        rc, out = run_torchrun(2, os.path.abspath(__file__), ["--stall-worker", root, *flags], timeout=args.timeout)
    line = next((x for x in out.splitlines() if x.startswith(STALL_RESULT)), None)
    if rc != 0 or line is None:
        raise SystemExit(f"the stall launch failed (exit {rc}; None: past --timeout):\n{out[-4000:]}")
    print(format_stall(args, json.loads(line[len(STALL_RESULT):])))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=100, help="MB of master weights")
    p.add_argument("--repeats", type=int, default=3, help="timed loads and verifies after the measured first load")
    p.add_argument("--stall", action="store_true", help="only the table of the step's stall for a save (3.)")
    p.add_argument("--size", choices=["162M", "small"], default="162M", help="--stall: the model's size")
    p.add_argument("--rounds", type=int, default=2, help="--stall: rounds (a blocking and a non-blocking save each)")
    p.add_argument("--steps", type=int, default=4, help="--stall: steps per round without a save, and after one")
    p.add_argument("--timeout", type=float, default=1500, help="--stall: seconds, then torchrun and its ranks killed")
    p.add_argument("--stall-worker", metavar="ROOT", help=argparse.SUPPRESS)  # a rank of the --stall launch
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.stall_worker:
        stall_worker(args)
    elif args.stall:
        stall(args)
    else:
        checksums(args.mb)
        load_peak(args.mb, args.repeats)
