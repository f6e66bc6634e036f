"""Muon at W=2 on gloo: step time, Newton-Schulz work per rank, optimizer state per rank.

How to run (each system in its own ``torchrun`` launch of 2 ranks, one intra-op thread per
rank; the model flags are ``bench_memory.py``'s)::

    python benchmarks/bench_muon.py                          # GPT-2-small-size TinyGPT, every system
    python benchmarks/bench_muon.py --systems ddp,fzero-s2d --layers 4 --vocab 8000

Every system runs Muon (lr 1e-3, weight decay 0.1, momentum 0.95, nesterov, 5
Newton-Schulz steps) on the blocks' 2-D matrices and AdamW on the rest (embeddings, the
output head, norms, biases), from the same init and data (``bench_gloo_step``):

* ``ddp``: ``DistributedDataParallel`` + ``torch.optim.Muon`` + ``torch.optim.AdamW``: every
  rank orthogonalizes every matrix;
* ``ds-z1``, ``ds-z2``: DeepSpeed's own Muon (``MuonWithAuxAdam``, torch's AdamW for the
  rest) at ZeRO 1 and 2, the same matrices tagged (DeepSpeed 0.19.8, ``DS_ACCELERATOR=cpu``);
  its Newton-Schulz is its own (a Gram-matrix iteration by default), not torch's;
* ``fzero-s1d``, ``fzero-s2d``, ``fzero-s3d``: ``fzero.muon`` (donating steps; stage 3 with
  one unit per block): each matrix orthogonalized by one owner rank.

Columns (MiB per rank, max over the two ranks, unless said): ``ms/step``: median of the
timed steps on rank 0; ``NS calls``: Newton-Schulz calls per step on rank 0 / rank 1;
``NS ms``: time inside them per step, rank 0 / rank 1 (counted by wrapping the
orthogonalization function each system calls); ``opt state``: bytes of the optimizer's
state tensors on the rank (fzero: the flat moments each group uses: ``fzero.muon`` also
keeps zero moments of the other group's kind, never written, and on the CPU a moment of
1 MiB or more is then never committed); ``step peak``/``held``: RSS as in
``bench_memory.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import bench_memory as bm  # noqa: E402

KEYS = ("ddp", "ds-z1", "ds-z2", "fzero-s1d", "fzero-s2d", "fzero-s3d")
RESULT = "BENCH_MUON_RESULT "


class NewtonSchulzClock:
    """Wraps the orthogonalization functions the systems call: calls and seconds inside."""

    def __init__(self) -> None:
        self.calls, self.seconds = 0, 0.0

    def wrap(self, module: object, name: str) -> None:
        inner = getattr(module, name, None)
        if inner is None:
            return

        def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t
                self.calls += 1

        setattr(module, name, timed)

    def install(self, key: str) -> None:
        from torch.optim import _muon

        self.wrap(_muon, "_zeropower_via_newtonschulz")  # torch.optim.Muon and fzero.muon
        if key.startswith("ds-"):
            os.environ["DS_ACCELERATOR"] = "cpu"
            from deepspeed.runtime.zero.muon import original_muon

            for name in ("zeropower_via_newtonschulz5", "zeropower_via_gram_newtonschulz"):
                self.wrap(original_muon, name)


def measure(key: str, args: argparse.Namespace, rank: int) -> dict:
    import torch.distributed as dist

    cfg = bm.config_of(args)
    ctx = bm.make_ctx(cfg, args, args.warmup + args.steps, rank)
    ctx["optimizer"] = "muon"
    bm.preimport(key, ctx["model"])
    clock = NewtonSchulzClock()
    clock.install(key)
    dist.barrier()
    base = bm.rss_bytes()
    runner = bm.build_system(key, ctx)
    for i in range(args.warmup):
        runner.step(i)
    bm.reset_peak_rss()
    dist.barrier()
    clock.calls, clock.seconds = 0, 0.0
    times = []
    for i in range(args.warmup, args.warmup + args.steps):
        t = time.perf_counter()
        runner.step(i)
        times.append(time.perf_counter() - t)
    state = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in runner.optimizer_tensors()}
    return {"ms": statistics.median(times) * 1e3, "ns_calls": clock.calls / args.steps,
            "ns_ms": clock.seconds * 1e3 / args.steps, "state": sum(state.values()),
            "step_peak": bm.peak_rss_bytes() - base, "held": bm.rss_bytes() - base, "note": runner.note}


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=max(120, args.timeout)))
    rank = dist.get_rank()
    try:
        res = measure(args.system, args, rank)
    except Exception as e:  # noqa: BLE001 - reported as the system's row
        res = {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, res)
    if rank == 0:
        print(RESULT + json.dumps(everyone), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def launch(key: str, args: argparse.Namespace) -> list:
    from fzero.testing import run_torchrun

    os.environ["DS_ACCELERATOR"] = "cpu"
    rc, out = run_torchrun(bm.WORLD, os.path.abspath(__file__), ["--system", key, *bm.model_args(args),
                                                                  "--timeout", str(args.timeout)],
                           timeout=args.timeout, pythonpath=[HERE, os.path.dirname(HERE)])
    for line in out.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    tail = [ln for ln in out.strip().splitlines() if ln.strip() and not ln.startswith("USDT:")][-2:]
    why = f"timed out after {args.timeout:.0f}s (killed)" if rc is None else f"exit code {rc}"
    return [{"error": why + (": " + " | ".join(tail) if tail else "")[:300]}]


def row(key: str, ranks: list) -> str:
    err = next((r["error"] for r in ranks if r and "error" in r), None)
    if err:
        return f"{key:<10} FAILED: {err}"
    mib = 2**20
    r0, r1 = ranks
    return (f"{key:<10} {r0['ms']:9.0f} {r0['ns_calls']:5.0f} /{r1['ns_calls']:4.0f} "
            f"{r0['ns_ms']:7.0f} /{r1['ns_ms']:6.0f} {max(r['state'] for r in ranks) / mib:10.1f} "
            f"{max(r['step_peak'] for r in ranks) / mib:10.0f} {max(r['held'] for r in ranks) / mib:8.0f}  "
            f"{r0['note']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default=",".join(KEYS))
    p.add_argument("--system", help=argparse.SUPPRESS)
    argv = sys.argv[1:]
    own, rest = p.parse_known_args(argv)
    args = bm.parse_args(["--systems", "ddp", *rest])  # the model and timing flags
    if own.system:
        args.system = own.system
        worker(args)
        return
    keys = [k.strip() for k in own.systems.split(",") if k.strip()]
    bad = [k for k in keys if k not in KEYS]
    if bad:
        p.error(f"unknown systems {bad}; choose from {', '.join(KEYS)}")
    cfg = bm.config_of(args)
    n_params = sum(q.numel() for q in bm.build(args.model, cfg, args.seed).parameters())
    print(f"model: {args.model} vocab={cfg.vocab} d_model={cfg.d_model} layers={cfg.n_layers} seq={cfg.seq_len} "
          f"global batch {cfg.global_batch}; {n_params:,} parameters; gloo W={bm.WORLD}, 1 thread/rank; "
          f"{args.steps} timed steps after {args.warmup} warm-up; torch {torch.__version__}", flush=True)
    head = (f"{'system':<10} {'ms/step':>9} {'NS calls r0/r1':>14} {'NS ms r0/r1':>14} {'opt state':>10} "
            f"{'step peak':>10} {'held':>8}  note")
    lines = [head, "-" * len(head)]
    for key in keys:
        lines.append(row(key, launch(key, args)))
        print(lines[-1], file=sys.stderr, flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
