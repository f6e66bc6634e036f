"""What :class:`fzero.dist.TorchCommunicator` does on gloo, and its bounded waits: point-to-point all-gather and
reduce-scatter, host buffers handed out again (:class:`ScratchPool`), and traced collectives as operators that run the
eager c10d calls inside a compiled graph and wait there, one at a time, within the communicator's timeout (a functional
collective takes none, and gloo's thread frees its buffers whenever inductor's schedule lets it).

Imports: comm, scopes.
"""

from __future__ import annotations

import datetime
import functools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..comm import CollectiveError
from ..scopes import GATHER, GRAD_REDUCTION, step_scope

__all__ = ["Bound", "wait", "waiter", "Works", "point_to_point_gather", "point_to_point_reduce_scatter",
           "point_to_point_all_reduce", "ScratchPool", "C10D_OP", "host_group"]

C10D_OP = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
TRACED_REDUCE_TAG = 1 << 30  # a traced reduce-scatter waits inside its operator: one tag serves them all
TRACED_ALL_REDUCE_TAGS = ((1 << 30) + 1, (1 << 30) + 2)  # a traced all-reduce's two phases, likewise
# (collective, rank, timeout in seconds): what a bounded wait names when it gives up
Bound = tuple[str, int, float] | None


def wait(work: Any, bound: Bound) -> None:
    """``work.wait()``; with a bound, c10d's ``wait(timeout)``, and a failure (the timeout, or a peer that
    died) as :class:`~fzero.comm.CollectiveError` naming the collective."""
    if bound is None:
        return work.wait()
    what, rank, seconds = bound
    try:
        done = work.wait(timeout=datetime.timedelta(seconds=seconds))
    except RuntimeError as e:  # c10d's DistBackendError and gloo's timeouts are RuntimeErrors
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CollectiveError(what, rank, seconds, text) from e
    if done is False:  # backends that report a timeout instead of raising
        raise CollectiveError(what, rank, seconds, "the wait timed out")


def waiter(work: Any, result: Callable[[], torch.Tensor], bound: Bound = None,
           sent: torch.Tensor | None = None) -> Callable[[], torch.Tensor]:
    """A function that waits for ``work`` and gives ``result()``. The ``Work`` is dropped once waited for (it
    keeps its launch's saved-tensor hooks: a reference cycle through C++ otherwise). ``sent`` is kept until the
    wait, so a step's memory does not depend on when gloo's thread lets it go."""
    pending, keep = [work], [sent]

    def done() -> torch.Tensor:
        while pending:
            wait(pending.pop(), bound)
        out = result()
        keep.clear()
        return out

    return done


class Works:
    """Several c10d works waited for as one, within one deadline when given a timeout."""

    def __init__(self, works: list[Any]):
        self.works = works

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        end = None if timeout is None else time.monotonic() + timeout.total_seconds()
        for w in self.works:
            limit = {} if end is None else {"timeout": datetime.timedelta(seconds=max(end - time.monotonic(), 0.001))}
            if w.wait(**limit) is False:
                return False
        return True


def host_group(pg: dist.ProcessGroup) -> dist.ProcessGroup:
    """A new gloo group of ``pg``'s ranks, for host-side work that must never interleave with the collectives on ``pg``
    (a background checkpoint's writer: torch's advice for ``async_save``). ``new_group`` with local synchronization:
    a collective of ``pg``'s ranks only, each of which must call it; gloo's default timeout."""
    return dist.new_group(dist.get_process_group_ranks(pg), backend="gloo", use_local_synchronization=True)


def _peers(rank: int, world: int) -> list[tuple[int, int]]:  # (dst, src) per round: send k ahead, receive k behind
    return [((rank + k) % world, (rank - k) % world) for k in range(1, world)]


def point_to_point_gather(out: torch.Tensor, sent: torch.Tensor, group: dist.ProcessGroup | None, rank: int,
                          world: int, tag: int) -> Works:
    """Start an all-gather of ``sent`` (``[n]``, contiguous) into ``out`` (``[world * n]``, rank-major):
    ``world - 1`` sends and receives, each peer's shard received straight into its place (gloo's own all-gather
    receives into a fresh buffer and copies out of it), this rank's copied there."""
    n, works = sent.numel(), []
    for dst, src in _peers(rank, world):
        works += [dist.isend(sent, group=group, group_dst=dst, tag=tag),
                  dist.irecv(out[src * n:(src + 1) * n], group=group, group_src=src, tag=tag)]
    out[rank * n:(rank + 1) * n].copy_(sent)
    return Works(works)


def point_to_point_reduce_scatter(sent: torch.Tensor, group: dist.ProcessGroup | None, rank: int, world: int,
                                  tag: int, empty: Callable[[int], torch.Tensor]) -> tuple[Works, Callable[[], Any]]:
    """Start a reduce-scatter of ``sent`` (``[world * n]``): chunk ``k`` to rank ``k``. Returns the works and, for when
    they are done, the new ``[n]`` sum in rank order (:func:`fzero.comm.rank_order_sum`), whose first peer term (``c1``
    on rank 0, as ``c0 + c1 == c1 + c0``; else ``c0``) is received into the result; further peers use ``empty(n)``."""
    n = sent.numel() // world
    mine = [sent[k * n:(k + 1) * n] for k in range(world)]
    if world == 1:
        return Works([]), mine[0].clone
    first, out = (1 if rank == 0 else 0), sent.new_empty(n)
    terms, works = {rank: mine[rank]}, []
    for dst, src in _peers(rank, world):
        terms[src] = out if src == first else empty(n)
        works += [dist.isend(mine[dst], group=group, group_dst=dst, tag=tag),
                  dist.irecv(terms[src], group=group, group_src=src, tag=tag)]
    return Works(works), lambda: functools.reduce(torch.Tensor.add_, [terms[k] for k in range(world) if k != first],
                                                  out)


def point_to_point_all_reduce(sent: torch.Tensor, group: dist.ProcessGroup | None, rank: int, world: int,
                              tags: tuple[int, int], empty: Callable[[int], torch.Tensor],
                              bound: Bound) -> Callable[[], torch.Tensor]:
    """Start an all-reduce (sum) of ``sent`` (``[n]``, contiguous) whose every element is the ranks' values added in
    rank order, as :func:`fzero.comm.rank_order_sum` adds them in the simulated world, at every world size (beyond
    2 ranks the backend's all-reduce adds in an order of its algorithm's choosing). Two phases, the traffic of a ring
    all-reduce (``2 (world - 1) / world`` of ``sent`` out of each rank): :func:`point_to_point_reduce_scatter` of
    ``sent`` zero-padded to ``world`` equal chunks of ``m``; then, once that is done and ``sent`` let go of,
    :func:`point_to_point_gather` of the chunks into a new ``[world * m]`` (tags: one per phase). Beside the result:
    ``(world - 1) m`` received in the first phase, this rank's chunk in the second. Returns the wait (each phase
    within ``bound``): the ``[n]`` sum, a view of that buffer."""
    n = sent.numel()
    m = -(-n // world)
    padded = sent if n == world * m else torch.cat([sent, sent.new_zeros(world * m - n)])
    works, total = point_to_point_reduce_scatter(padded, group, rank, world, tags[0], empty)
    pending = [works, total]
    del padded, works, total  # what the reduce-scatter reads is held by its works until they are waited for

    def done() -> torch.Tensor:
        works, total = pending
        pending.clear()
        wait(works, bound)
        mine = total()
        del works, total  # ``sent`` and the received terms: let go before the result is allocated
        out = mine.new_empty(world * m)
        wait(point_to_point_gather(out, mine, group, rank, world, tags[1]), bound)
        return out[:n]

    return done


def average_owned(total: torch.Tensor, op: str, world: int) -> torch.Tensor:
    """``avg``'s division in place, for a result buffer the collective allocated itself."""
    return total.div_(world) if op == "avg" and world > 1 else total


def _group_and_bound(group_name: str, what: str, timeout: float) -> tuple[dist.ProcessGroup, Bound]:
    """A traced operator's process group, and the bound of its wait for ``what`` (``timeout`` 0: none)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name)
    return group, ((what, dist.get_rank(group), timeout) if timeout > 0 else None)


@torch.library.custom_op("fzero::gather_point_to_point_many", mutates_args=("outs",))
def _gather_many(outs: list[torch.Tensor], sents: list[torch.Tensor], group_name: str, timeout: float) -> None:
    """:func:`point_to_point_gather` of each ``sents[k]`` into ``outs[k]``, all started before one deadline (it
    returns nothing, so torch makes its fake itself)."""
    what = f"all_gather of {sum(out.numel() for out in outs)} {outs[0].dtype} in {len(outs)} groups"
    group, bound = _group_and_bound(group_name, what, timeout)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    works = Works([w for k, (out, sent) in enumerate(zip(outs, sents))
                   for w in point_to_point_gather(out, sent, group, rank, world, k).works])
    wait(works, bound)


@torch.library.custom_op("fzero::all_gather_point_to_point", mutates_args=())
def _gather_new(sent: torch.Tensor, world: int, group_name: str, timeout: float) -> torch.Tensor:
    """The gather into a new ``[world * n]``: a compiled stage-3 step recomputes it in backward (``fzero.units``)."""
    with step_scope(GATHER):
        out = sent.new_empty(world * sent.numel())
        _gather_many([out], [sent], group_name, timeout)
    return out


@_gather_new.register_fake
def _(sent: torch.Tensor, world: int, group_name: str, timeout: float) -> torch.Tensor:
    return sent.new_empty(world * sent.numel())


@torch.library.custom_op("fzero::reduce_scatter_all_to_all", mutates_args=())
def _reduce_scatter_op(sent: torch.Tensor, world: int, op: str, group_name: str, timeout: float) -> torch.Tensor:
    """:func:`point_to_point_reduce_scatter` of ``sent`` (``[world * n]``), waited for: this rank's ``[n]`` sum."""
    what = f"reduce_scatter ({op}, point to point) of {sent.numel()} {sent.dtype}"
    group, bound = _group_and_bound(group_name, what, timeout)
    with step_scope(GRAD_REDUCTION):
        works, total = point_to_point_reduce_scatter(sent, group, dist.get_rank(group), world, TRACED_REDUCE_TAG,
                                                     sent.new_empty)
        wait(works, bound)
        return average_owned(total(), op, world)


@_reduce_scatter_op.register_fake
def _(sent: torch.Tensor, world: int, op: str, group_name: str, timeout: float) -> torch.Tensor:
    return sent.new_empty(sent.numel() // world)


@torch.library.custom_op("fzero::all_reduce_shard", mutates_args=())
def _all_reduce_op(x: torch.Tensor, world: int, rank: int, op: str, group_name: str, timeout: float,
                   rank_order: bool) -> torch.Tensor:
    """``all_reduce`` of ``x``: with ``rank_order`` :func:`point_to_point_all_reduce`'s, else c10d's of a copy;
    ``rank`` -1 returns the whole, a rank its chunk ``[numel / world]`` (ZeRO-1: the whole sum is freed
    inside, so a compiled stage-1 step holds one group's sum at a time)."""
    group, bound = _group_and_bound(group_name, f"all_reduce ({op}) of {x.numel()} {x.dtype}", timeout)
    with step_scope(GRAD_REDUCTION):
        if rank_order:
            out = point_to_point_all_reduce(x.contiguous(), group, dist.get_rank(group), world,
                                            TRACED_ALL_REDUCE_TAGS, x.new_empty, bound)()
        else:
            out = x.clone()
            wait(dist.all_reduce(out, C10D_OP[op], group=group, async_op=True), bound)
        if rank >= 0:
            n = x.numel() // world
            out = out[rank * n:(rank + 1) * n].clone()
        return average_owned(out, op, world)


@_all_reduce_op.register_fake
def _(x: torch.Tensor, world: int, rank: int, op: str, group_name: str, timeout: float,
      rank_order: bool) -> torch.Tensor:
    return torch.empty_like(x) if rank < 0 else x.new_empty(x.numel() // world)


# The storage's reference count (a private torch function: where a torch lacks it, nothing is pooled)
_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)
MIN_BYTES = 1 << 20  # smaller blocks come from glibc's heap, which keeps freed memory mapped anyway
SLACK = 1.25  # a request may take a free buffer up to this many times its size (a lower peak than exact sizes)


class ScratchPool:
    """Host buffers of at least :data:`MIN_BYTES` (eager stage 3 gathers into the same few sizes, which glibc maps
    afresh and faults in page by page), handed out again once nothing refers to their storage (reuse cannot change a
    value); at most ``per_size`` free buffers of one size are kept."""

    def __init__(self, per_size: int = 2):
        self.per_size = per_size
        self.bufs: dict[int, list[torch.Tensor]] = {}  # nbytes -> 1-D uint8 bases handed out
        self.reused = self.fresh = 0

    @staticmethod
    def _free(base: torch.Tensor) -> bool:
        return int(_USE_COUNT(base.untyped_storage()._cdata)) - 1 <= 1  # type: ignore[misc]

    def empty(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        nbytes = math.prod(int(s) for s in shape) * dtype.itemsize
        if nbytes < MIN_BYTES or torch.device(device).type != "cpu" or _USE_COUNT is None:
            return torch.empty(tuple(shape), dtype=dtype, device=device)
        sizes = sorted(k for k in self.bufs if nbytes <= k <= nbytes * SLACK)
        base = next((b for size in sizes for b in self.bufs[size] if self._free(b)), None)
        if base is None:
            base = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self.bufs.setdefault(nbytes, []).append(base)
            self.fresh += 1
        else:
            self.reused += 1
        out = torch.empty(0, dtype=dtype, device=device).set_(base.untyped_storage(), 0, tuple(shape))
        self._trim()  # after ``out`` holds its buffer: a buffer just handed out is never spare
        return out

    def _trim(self) -> None:
        """Drops each size's free buffers beyond the first ``per_size``."""
        for size, bases in list(self.bufs.items()):
            spare = [b for b in bases if self._free(b)][self.per_size:]
            self.bufs[size] = [b for b in bases if not any(b is s for s in spare)]
            if not self.bufs[size]:
                del self.bufs[size]

    def clear(self) -> None:
        self.bufs.clear()

    def held_bytes(self) -> int:
        return sum(size * len(v) for size, v in self.bufs.items())
