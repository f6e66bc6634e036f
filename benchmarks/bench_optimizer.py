"""Optimizer-step and full-step speed and memory: fzero's shard_step vs torch.optim.AdamW.

    python benchmarks/bench_optimizer.py [--numel 50000000] [--steps 10]

Part 1: one AdamW update of a flat fp32 shard of ``--numel`` elements:
fzero ``shard_step`` eager (pure), eager donating, compiled (pure), compiled
donating, against ``torch.optim.AdamW(fused=True)`` and ``(foreach=True)`` on a
tensor of the same size. Reports the median time per step, effective
bandwidth (28 bytes per element: read param, grad, exp_avg, exp_avg_sq; write
param, exp_avg, exp_avg_sq) and the growth of peak RSS during the timed steps
(each variant runs in a fresh process, after one warm-up step, so allocator
caches are warm and compilation is excluded).

Part 2: a full training step (forward, backward, reduction, AdamW) of a ~1.6M
parameter MLP on a one-rank world: eager, compiled, compiled+donating, with a
plain torch loop (fused AdamW) for reference.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

BYTES_PER_ELEMENT = 28


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _time(fn, steps: int) -> tuple[list[float], float]:
    fn()  # warm-up (compiles)
    base = _peak_rss_mib()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times, _peak_rss_mib() - base


def optimizer_variant(name: str, numel: int, steps: int) -> dict:
    import fzero

    torch.manual_seed(0)
    if name.startswith("torch"):
        p = torch.nn.Parameter(torch.randn(numel))
        p.grad = torch.randn(numel) * 1e-3
        opt = torch.optim.AdamW([p], lr=1e-3, fused=name == "torch-fused", foreach=name == "torch-foreach")
        times, rss = _time(opt.step, steps)
        return {"times": times, "rss": rss}

    comm = fzero.SimulatedWorld(1)
    shard = fzero.init_shard({"w": torch.randn(numel)}, comm, alignment=1)
    opt_state = fzero.init_opt_state(fzero.adamw(lr=1e-3), shard.master)
    grads = (torch.randn(1, numel) * 1e-3,)
    found = torch.zeros(())
    donate = "donating" in name
    fn = lambda s, o, g, f: fzero.shard_step(s, o, g, f, donate=donate)  # noqa: E731
    if "compiled" in name:
        fn = torch.compile(fn, fullgraph=True)
    box = [shard, opt_state]

    def run() -> None:
        box[0], box[1] = fn(box[0], box[1], grads, found)

    times, rss = _time(run, steps)
    return {"times": times, "rss": rss}


def full_step_variant(name: str, steps: int) -> dict:
    import fzero

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024), torch.nn.GELU(),
        torch.nn.Linear(1024, 10),
    )
    x, y = torch.randn(64, 512), torch.randint(0, 10, (64,))
    if name == "torch-fused":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

        def run() -> None:
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

        times, rss = _time(run, steps)
        return {"times": times, "rss": rss, "params": sum(p.numel() for p in model.parameters())}
    comm = fzero.SimulatedWorld(1)
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-3), comm)
    step = fzero.make_train_step(
        fzero.module_loss(model, torch.nn.functional.cross_entropy), comm,
        donate=name == "compiled+donating", compile=name != "eager",
    )
    batch = comm.split_batch((x, y))
    box = [state]

    def run() -> None:
        box[0], _ = step(box[0], batch)

    times, rss = _time(run, steps)
    return {"times": times, "rss": rss, "params": state.layout.num_params}


def _child(kind: str, name: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, name, "--numel", str(args.numel), "--steps", str(args.steps)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr else f"exit {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=50_000_000)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, name = args.child
        torch.set_num_threads(args.threads)
        res = optimizer_variant(name, args.numel, args.steps) if kind == "opt" else full_step_variant(name, args.steps)
        print(json.dumps(res))
        return

    print(f"torch {torch.__version__}, {args.threads} threads, {args.steps} timed steps after 1 warm-up\n")
    print(f"AdamW update of one fp32 shard of {args.numel:,} elements")
    print(f"{'variant':<28} {'ms/step':>9} {'GB/s':>7} {'vs fused':>9} {'peak RSS +MiB':>14}")
    rows = ["torch-fused", "torch-foreach", "fzero-eager", "fzero-eager-donating", "fzero-compiled", "fzero-compiled-donating"]
    fused_ms = None
    for name in rows:
        res = _child("opt", name, args)
        if "error" in res:
            print(f"{name:<28} error: {res['error']}")
            continue
        ms = statistics.median(res["times"]) * 1e3
        fused_ms = fused_ms or ms
        gbs = BYTES_PER_ELEMENT * args.numel / (ms / 1e3) / 1e9
        print(f"{name:<28} {ms:9.1f} {gbs:7.1f} {ms / fused_ms:8.2f}x {res['rss']:14.0f}")

    print("\nFull step (forward, backward, reduce, AdamW), one rank, MLP 512-1024-1024-10, batch 64")
    print(f"{'variant':<28} {'ms/step':>9} {'vs eager':>9} {'peak RSS +MiB':>14}")
    eager_ms = None
    for name in ["torch-fused", "eager", "compiled", "compiled+donating"]:
        res = _child("full", name, argparse.Namespace(**{**vars(args), "steps": max(args.steps, 30)}))
        if "error" in res:
            print(f"{name:<28} error: {res['error']}")
            continue
        ms = statistics.median(res["times"]) * 1e3
        if name == "eager":
            eager_ms = ms
        ratio = f"{eager_ms / ms:8.2f}x" if eager_ms else "        -"
        print(f"{name:<28} {ms:9.2f} {ratio:>9} {res['rss']:14.0f}   ({res['params']:,} params)")


if __name__ == "__main__":
    main()
