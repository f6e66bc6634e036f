"""Optimizer-step and full-step speed and memory: fzero's shard_step vs torch.optim.AdamW.

    python benchmarks/bench_optimizer.py [--numel 50000000] [--steps 10] [--repeats 5]
        [--threads 2] [--unscale] [--part {1,2,both}] [--variants torch-fused,fzero-compiled-donating]

Part 1: one AdamW update of a flat fp32 shard of ``--numel`` elements:
fzero ``shard_step`` eager (pure), eager donating, compiled (pure), compiled
donating, against ``torch.optim.AdamW(fused=True)`` and ``(foreach=True)`` on a
tensor of the same size, all at ``--threads`` intra-op threads. Eager donating
runs torch's fused kernel; compiled donating is inductor's loop over the
written-out rule (one read-modify-write pass, ``torch.where`` copy-back). Two
references: ``fused-op-compiled-donating`` calls torch's fused kernel inside
the compiled step as an opaque operator, in place (what the compiled step would
run instead of inductor's loop); ``inductor-floor`` is an inductor loop with the
same memory traffic and one addition per array (the bandwidth floor).
``--unscale``: every variant first multiplies the gradient by a 0-d factor, as
a training step unscales and clips (torch: in place on ``.grad``, as
``GradScaler.unscale_``; fzero: inside the step function, as ``fzero.unscale_and_check(..., in_place=True)``),
which inductor fuses into its loop and an opaque kernel cannot.

Each variant runs ``--repeats`` times in a fresh process, the variants
interleaved, after one warm-up step (allocator caches warm, compilation
excluded): the time of one process varies by up to 2x on a shared machine
(memory placement, other jobs). Reports the median over processes of each
process's median time per step, the range of those medians, effective bandwidth
(28 bytes per element: read param, grad, exp_avg, exp_avg_sq; write param,
exp_avg, exp_avg_sq) and the growth of peak RSS during the timed steps; the
load average before and after says whether other jobs shared the machine.

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


def _time(fn, steps: int) -> dict:
    fn()  # warm-up (compiles)
    base = _peak_rss_mib()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"times": times, "rss": _peak_rss_mib() - base}


def optimizer_variant(name: str, numel: int, steps: int, unscale: bool) -> dict:
    import fzero
    from fzero.pytree import replace

    torch.manual_seed(0)
    factor = torch.tensor(1.0, dtype=torch.float64)  # a runtime value: the multiply is not elided
    if name.startswith("torch"):
        p = torch.nn.Parameter(torch.randn(numel))
        p.grad = torch.randn(numel) * 1e-3
        opt = torch.optim.AdamW([p], lr=1e-3, fused=name == "torch-fused", foreach=name == "torch-foreach")

        def torch_step() -> None:
            if unscale:
                p.grad.mul_(factor.float())
            opt.step()

        return _time(torch_step, steps)

    comm = fzero.SimulatedWorld(1)
    shard = fzero.init_shard({"w": torch.randn(numel)}, comm, alignment=1)
    opt_state = fzero.optim.init_opt_state(fzero.adamw(lr=1e-3), shard.master)
    traced = comm.tracing()
    grads = (torch.randn(1, numel) * 1e-3,)
    found = torch.zeros(())
    donate = "donating" in name

    def step(s, o, g, f, factor):
        if unscale:
            g = tuple(x * factor.to(x.dtype) for x in g)
        if name == "inductor-floor":
            p, (m, v) = s.master[0], o.moments[0]
            for t in (p, m, v):
                t.add_(g[0])
            return s, replace(o, step=o.step + 1)
        if name == "fused-op-compiled-donating":
            h = o.hyper[0]
            torch.ops.bench_optimizer.adamw_(
                s.master[0], g[0], *o.moments[0], o.step, h["lr"], h["beta1"], h["beta2"], h["weight_decay"],
                h["eps"], f,
            )
            return s, replace(o, step=o.step + (f == 0).to(o.step.dtype))
        # a compiled step is traced with its communicator's tracing() copy (fzero.bind_step does the same)
        return fzero.shard_step(s, o, g, f, donate=donate, comm=traced if "compiled" in name else None)

    if name == "fused-op-compiled-donating":
        _define_fused_op()
    if "compiled" in name or name.startswith("inductor"):
        step = torch.compile(step, fullgraph=True)
    box = [shard, opt_state]

    def run() -> None:
        box[0], box[1] = step(box[0], box[1], grads, found, factor)

    return _time(run, steps)


_LIBS: list = []


def _define_fused_op() -> None:
    """torch's fused AdamW kernel as an opaque operator: a compiled graph calls it in place on
    its inputs, hyperparameters as tensors (aten's ``_fused_adamw_`` cannot be traced: its
    hyperparameters are floats, and functionalising it fails without amsgrad in torch 2.13)."""
    lib = torch.library.Library("bench_optimizer", "DEF")
    lib.define(
        "adamw_(Tensor(a!) p, Tensor g, Tensor(b!) m, Tensor(c!) v, Tensor step, Tensor lr, Tensor beta1, "
        "Tensor beta2, Tensor weight_decay, Tensor eps, Tensor found_inf) -> ()"
    )

    def adamw_(p, g, m, v, step, lr, beta1, beta2, weight_decay, eps, found_inf) -> None:
        torch._fused_adamw_(
            [p[0]], [g[0]], [m[0]], [v[0]], [], [(step + 1).to(torch.float32)],
            lr=lr.item(), beta1=beta1.item(), beta2=beta2.item(), weight_decay=weight_decay.item(),
            eps=eps.item(), amsgrad=False, maximize=False, found_inf=found_inf,
        )

    lib.impl("adamw_", adamw_, "CompositeExplicitAutograd")
    torch.library.register_fake("bench_optimizer::adamw_", lambda *args: None, lib=lib)
    _LIBS.append(lib)  # a Library unregisters its operators when collected


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

        return {**_time(run, steps), "params": sum(p.numel() for p in model.parameters())}
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

    return {**_time(run, steps), "params": state.layout.num_params}


def _child(kind: str, name: str, args: argparse.Namespace) -> dict:
    cmd = [
        sys.executable, __file__, "--child", kind, name, "--numel", str(args.numel), "--steps", str(args.steps),
        "--threads", str(args.threads), *(["--unscale"] if args.unscale else []),
    ]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr else f"exit {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


OPT_VARIANTS = [
    "torch-fused", "torch-foreach", "fzero-eager", "fzero-eager-donating", "fzero-compiled",
    "fzero-compiled-donating", "fused-op-compiled-donating", "inductor-floor",
]


def _load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" ({os.cpu_count()} CPUs)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=50_000_000)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5, help="fresh processes per part-1 variant, interleaved")
    ap.add_argument("--unscale", action="store_true", help="part 1: multiply the gradient by a factor first")
    ap.add_argument("--part", choices=["1", "2", "both"], default="both")
    ap.add_argument("--variants", default=",".join(OPT_VARIANTS), help="part-1 variants, comma-separated")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, name = args.child
        torch.set_num_threads(args.threads)
        if kind == "opt":
            res = optimizer_variant(name, args.numel, args.steps, args.unscale)
        else:
            res = full_step_variant(name, args.steps)
        print(json.dumps(res))
        return

    print(f"torch {torch.__version__}, {args.threads} threads, {args.steps} timed steps after 1 warm-up")
    if args.part in ("1", "both"):
        names = args.variants.split(",")
        unknown = sorted(set(names) - set(OPT_VARIANTS))
        if unknown:
            ap.error(f"unknown variants {unknown}; expected some of {OPT_VARIANTS}")
        what = ", gradient unscaled first" if args.unscale else ""
        print(f"\nAdamW update of one fp32 shard of {args.numel:,} elements{what}, {args.repeats} processes per variant")
        print(f"before: {_load()}")
        medians: dict[str, list[float]] = {n: [] for n in names}
        rss: dict[str, list[float]] = {n: [] for n in names}
        errors: dict[str, str] = {}
        for _ in range(args.repeats):
            for name in names:
                res = _child("opt", name, args)
                if "error" in res:
                    errors[name] = res["error"]
                    continue
                medians[name].append(statistics.median(res["times"]) * 1e3)
                rss[name].append(res["rss"])
        print(f"after:  {_load()}")
        print(f"{'variant':<26} {'ms/step':>8} {'range':>13} {'GB/s':>6} {'vs fused':>9} {'peak RSS +MiB':>14}")
        fused_ms = statistics.median(medians["torch-fused"]) if medians.get("torch-fused") else None
        for name in names:
            if not medians[name]:
                print(f"{name:<26} error: {errors.get(name)}")
                continue
            ms = statistics.median(medians[name])
            spread = f"{min(medians[name]):.1f}-{max(medians[name]):.1f}"
            gbs = BYTES_PER_ELEMENT * args.numel / (ms / 1e3) / 1e9
            ratio = f"{ms / fused_ms:8.2f}x" if fused_ms else "        -"
            print(f"{name:<26} {ms:8.1f} {spread:>13} {gbs:6.1f} {ratio:>9} {statistics.median(rss[name]):14.0f}")

    if args.part in ("2", "both"):
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
