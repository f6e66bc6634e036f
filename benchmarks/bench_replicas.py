"""Cost of the replica agreement check relative to a training step (goal: under 2 %).

What it measures, on the TinyGPT of ``benchmarks/models.py`` (~0.87 M
parameters, AdamW, fp32, one intra-op thread):

* ``step``: wall time of one eager ``fzero.make_train_step`` call;
* ``check_replicas``: one eager ``fzero.replicas.check_replicas(state, comm)`` (digest of
  every replicated item, one ``all_gather`` of ``[R, 2k]`` float64, host read);
* ``replicas_differ``: one ``fzero.replicas.replicas_differ`` (digest, one
  ``all_reduce(max)``, result left on the device as a step would keep it);
* ``step + check``: a step followed by ``check_replicas``, as a training loop
  that checks every step would run;
* ``in-step``: a step made with ``make_train_step(check_replicas_every=1)``, whose
  digest rides on the step's own scalar all-reduce (``in-step/step``: its extra
  cost over the plain step, from two medians: noisy around zero).

Worlds: ``SimulatedWorld(2)`` in this process (stages 1 and 2), and with
``--gloo`` two gloo ranks under ``torchrun`` (the script relaunches itself;
rank 0 prints). Each mode runs ``--steps`` timed calls per round over
``--rounds`` interleaved rounds (so machine load hits every mode alike); the
table gives medians in ms and the check's cost as a percentage of the step's
median. The check alone is measured on the state the steps produce.

How to run (from the repository root)::

    python benchmarks/bench_replicas.py [--steps 10] [--rounds 3] [--gloo]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import fzero  # noqa: E402
from fzero.testing import run_torchrun  # noqa: E402
from models import DEFAULT_CONFIG, build_model, make_criterion, random_batch  # noqa: E402


def measure(comm: fzero.Communicator, stage: int, steps: int, rounds: int, sync=None) -> dict[str, float]:
    """Median ms per mode. ``sync`` (a barrier on real ranks) runs untimed before each
    call of the check-only modes, so that they do not time the ranks' skew."""
    cfg = DEFAULT_CONFIG
    model = build_model(cfg)
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-3, weight_decay=0.1), comm, stage=stage)
    step = fzero.make_train_step(fzero.module_loss(model, make_criterion(cfg.vocab)), comm)
    checked = fzero.make_train_step(fzero.module_loss(model, make_criterion(cfg.vocab)), comm,
                                    check_replicas_every=1)
    batches = [comm.split_batch(random_batch(cfg, seed)) for seed in range(4)]
    for b in batches[:2]:  # warm-up
        state, _ = step(state, b)
        state, _ = checked(state, b)
    fzero.replicas.check_replicas(state, comm)
    fzero.replicas.replicas_differ(state, comm)
    k = fzero.replicas.replica_digest(state, comm).shape[1]
    tiny = torch.zeros(comm.local_ranks, 2 * k, dtype=torch.float64)
    times: dict[str, list[float]] = {
        "step": [], "check_replicas": [], "replicas_differ": [], "all_reduce": [], "step + check": [],
        "step, in-step check": [],
    }
    i = 0
    for _ in range(rounds):
        for mode in times:
            for _ in range(steps):
                b = batches[i % len(batches)]
                i += 1
                if sync is not None and not mode.startswith("step"):
                    sync()
                t0 = time.perf_counter()
                if mode == "step":
                    state, _ = step(state, b)
                elif mode == "check_replicas":
                    fzero.replicas.check_replicas(state, comm)
                elif mode == "replicas_differ":
                    differ = fzero.replicas.replicas_differ(state, comm)
                elif mode == "all_reduce":
                    comm.all_reduce(tiny, "max")
                elif mode == "step, in-step check":
                    state, _ = checked(state, b)
                else:
                    state, _ = step(state, b)
                    fzero.replicas.check_replicas(state, comm)
                times[mode].append(time.perf_counter() - t0)
    assert not bool(differ)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def table(rows: list[tuple[str, dict[str, float]]]) -> str:
    head = (f"{'world':<22} {'step':>9} {'check':>9} {'differ':>9} {'tiny AR':>9} {'step+check':>11} "
            f"{'check/step':>11} {'differ/step':>12} {'in-step':>9} {'in-step/step':>13}")
    lines = [head, "-" * len(head)]
    for name, r in rows:
        lines.append(
            f"{name:<22} {r['step']:>9.2f} {r['check_replicas']:>9.3f} {r['replicas_differ']:>9.3f} "
            f"{r['all_reduce']:>9.3f} {r['step + check']:>11.2f} {100 * r['check_replicas'] / r['step']:>10.2f}% "
            f"{100 * r['replicas_differ'] / r['step']:>11.2f}% {r['step, in-step check']:>9.2f} "
            f"{100 * (r['step, in-step check'] / r['step'] - 1):>12.2f}%"
        )
    return "\n".join(lines)


def gloo_worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from fzero.dist import TorchCommunicator

    dist.init_process_group("gloo")
    comm = TorchCommunicator()
    rows = [(f"gloo W=2, stage {s}", measure(comm, s, args.steps, args.rounds, sync=dist.barrier)) for s in (1, 2)]
    if comm.rank == 0:
        print(table(rows), flush=True)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--gloo", action="store_true", help="also measure two gloo ranks under torchrun")
    p.add_argument("--timeout", type=float, default=420)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.worker:
        gloo_worker(args)
        return
    cfg = DEFAULT_CONFIG
    n = sum(q.numel() for q in build_model(cfg).parameters())
    print(f"TinyGPT {n:,} parameters, batch {cfg.global_batch}x{cfg.seq_len}, AdamW fp32, 1 thread; "
          f"medians of {args.steps * args.rounds} calls, ms")
    rows = [(f"SimulatedWorld(2), s{s}", measure(fzero.SimulatedWorld(2), s, args.steps, args.rounds)) for s in (1, 2)]
    print(table(rows), flush=True)
    if args.gloo:
        rc, out = run_torchrun(
            2, os.path.abspath(__file__),
            ["--worker", "--steps", str(args.steps), "--rounds", str(args.rounds)],
            timeout=args.timeout, pythonpath=[os.path.dirname(HERE)],
        )
        print(out if rc == 0 else f"gloo run failed (exit {rc}):\n{out[-3000:]}")


if __name__ == "__main__":
    main()
