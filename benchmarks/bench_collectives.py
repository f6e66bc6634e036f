"""Cost of one collective on gloo, by way of computing it: what ``TorchCommunicator`` chooses from.

What it measures: wall time of one blocking collective on ``--world`` CPU ranks
over gloo (rank 0's ``time.perf_counter`` around the call; every rank calls),
one intra-op thread per rank, for buffers of ``--sizes`` float32 elements per
rank (the size of the input: ``[W*n]`` for the reductions, the shard ``[n]``
for the gathers). Ways, each on the same input:

* ``reduce-scatter`` (each rank keeps its chunk of the sum):
  ``native`` (``dist.reduce_scatter_single``), ``all_to_all`` (chunk ``k`` of
  every rank sent to rank ``k`` by ``dist.all_to_all_single``, summed there:
  ``TorchCommunicator``'s default on gloo), ``all_reduce`` (the whole sum,
  then a slice);
* ``all-gather``: ``native`` (``dist.all_gather_single``; gloo allocates a
  buffer of the output's size in every call and copies out of it),
  ``all_to_all`` (the shard repeated W times, exchanged) and
  ``point_to_point`` (``isend``/``irecv`` of the shard straight into the
  output: ``TorchCommunicator``'s default on gloo, ``all_gather_via``);
* ``all-reduce``: ``native`` (``dist.all_reduce``, in gloo's order) and ``rank_order``
  (``fzero.dist.gloo.point_to_point_all_reduce``: a point-to-point reduce-scatter adding in rank
  order, then the point-to-point all-gather: ``TorchCommunicator``'s sums beyond 2 ranks,
  ``all_reduce_via="rank_order"``).

Each size runs every way ``--reps`` times per round over ``--rounds`` rounds in
an order that rotates per round (load from other processes hits every way
alike), after a ``dist.barrier()``; the table gives the median in us and the
ratio to the native way of the same collective.

How to run (from the repository root; it launches itself under
``python -m torch.distributed.run --standalone`` in a new session and kills
the group after ``--timeout`` seconds)::

    python benchmarks/bench_collectives.py [--world 2] [--sizes 2000,100000,1000000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta

import torch

from fzero.testing import run_torchrun


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2, help="ranks (gloo, this machine)")
    p.add_argument("--sizes", default="2000,100000,400000,1000000", help="float32 elements per rank")
    p.add_argument("--reps", type=int, default=20, help="calls per way per round")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    p.add_argument("--timeout", type=float, default=300.0, help="kill torchrun and all ranks after this many s")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def ways(n: int, world: int) -> dict[tuple[str, str], Callable[[], object]]:
    """``{(collective, way): call}`` on buffers of ``n`` elements per rank."""
    import torch.distributed as dist

    from fzero.dist import _c10d_all_gather, _c10d_reduce_scatter  # the *_single names where torch has them
    from fzero.dist.gloo import point_to_point_all_reduce as _point_to_point_all_reduce
    from fzero.dist.gloo import point_to_point_gather as _point_to_point_gather

    full = torch.randn(n)  # a reduction's input
    chunk = n // world
    mine, received, total = torch.empty(chunk), torch.empty(n), torch.empty(n)
    shard, gathered, repeated = torch.randn(n // world), torch.empty(n), torch.empty(n)

    def rs_all_to_all() -> torch.Tensor:
        dist.all_to_all_single(received, full)
        return received.view(world, chunk).sum(0)

    def rs_all_reduce() -> torch.Tensor:
        total.copy_(full)  # all_reduce works in place
        dist.all_reduce(total)
        return total[dist.get_rank() * chunk:][:chunk]

    return {
        ("reduce-scatter", "native"): lambda: _c10d_reduce_scatter(mine, full),
        ("reduce-scatter", "all_to_all"): rs_all_to_all,
        ("reduce-scatter", "all_reduce"): rs_all_reduce,
        ("all-gather", "native"): lambda: _c10d_all_gather(gathered, shard),
        ("all-gather", "all_to_all"): lambda: dist.all_to_all_single(repeated, shard.repeat(world)),
        ("all-gather", "point_to_point"): lambda: _point_to_point_gather(gathered, shard, None, dist.get_rank(),
                                                                        world, 1).wait(),
        ("all-reduce", "native"): lambda: dist.all_reduce(total),
        ("all-reduce", "rank_order"): lambda: _point_to_point_all_reduce(full, None, dist.get_rank(), world, (3, 5),
                                                                         torch.empty, None)(),
    }


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = [int(s) // world * world for s in args.sizes.split(",")]
    times: dict[tuple[int, str, str], list[float]] = {}
    for n in sizes:
        calls = ways(n, world)
        keys = list(calls)
        for key in keys:  # warm-up: connections, allocations
            calls[key]()
        for rnd in range(args.rounds):
            for key in keys[rnd % len(keys):] + keys[: rnd % len(keys)]:
                dist.barrier()
                for _ in range(args.reps):
                    t0 = time.perf_counter()
                    calls[key]()
                    times.setdefault((n, *key), []).append(time.perf_counter() - t0)
    if rank == 0:
        print(f"gloo, W={world}, float32, median us per call ({args.rounds} rounds x {args.reps} calls)")
        print(f"{'elements/rank':>13}  {'collective':<15} {'way':<14} {'us':>8}  {'/ native':>8}")
        for n in sizes:
            for (m, coll, way), ts in times.items():
                if m != n:
                    continue
                med = statistics.median(ts) * 1e6
                ref = statistics.median(times[(n, coll, "native")]) * 1e6
                print(f"{n:>13}  {coll:<15} {way:<14} {med:8.0f}  {med / ref:8.2f}")
    dist.destroy_process_group()


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    here = os.path.dirname(os.path.abspath(__file__))
    print(f"launching {os.path.basename(__file__)} under torchrun with {args.world} ranks", flush=True)
    rc, _ = run_torchrun(args.world, os.path.abspath(__file__), ["--worker", *sys.argv[1:]],
                         timeout=args.timeout, pythonpath=[here], capture=False)
    if rc is None:
        print(f"bench: exceeded --timeout {args.timeout:.0f}s; torchrun and every rank were killed", flush=True)
    sys.exit(124 if rc is None else rc)


if __name__ == "__main__":
    main()
