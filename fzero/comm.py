"""Communicators: the only way fzero's functions talk to other ranks. A tensor that differs between ranks has a leading
*local-rank axis* of size ``R = comm.local_ranks``: ``R == W`` (the world size) in :class:`SimulatedWorld`, ``R == 1``
on a real rank (``fzero.dist``). Collectives are methods over it: one step runs on both, eagerly or traced.

Imports: torch only.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Any, Callable, ContextManager, Literal, Sequence

import torch
import torch.utils._pytree as tp

__all__ = ["CollectiveError", "Communicator", "SimulatedWorld", "CountingCommunicator", "CollectiveRecord",
           "gradient_divide_factors", "rank_order_sum"]
ReduceOp = Literal["sum", "avg", "max"]


class CollectiveError(RuntimeError):
    """A collective did not complete on this rank: a peer stalled past the communicator's timeout, or died.
    ``collective`` names it, ``step`` the train step (``state.opt.step + 1``; None outside one), ``timeout`` the bound
    in seconds. The group is then unusable: end the process, for torchrun to stop or restart the job."""

    def __init__(self, collective: str, rank: int, timeout: float | None, cause: str, step: int | None = None):
        self.collective, self.rank, self.timeout, self.cause, self.step = collective, rank, timeout, cause, step
        within = "" if timeout is None else f" within {timeout:g} s"
        during = "" if step is None else f" during step {step}"
        super().__init__(f"rank {rank}: collective {collective}{during} did not complete{within} (a peer rank "
                         f"stalled or died): {cause}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.collective, self.rank, self.timeout, self.cause, self.step))

    def at_step(self, step: int) -> "CollectiveError":
        """The same error, naming the train step it happened in."""
        return type(self)(self.collective, self.rank, self.timeout, self.cause, step)


def gradient_divide_factors(world_size: int) -> tuple[float, float]:
    """FSDP's ``(pre, post)`` factors, ``pre * post == world_size``: a 16-bit reduction divides by ``pre``
    before the sum and by ``post`` after it, so the sum neither overflows nor underflows."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    pre = 1
    while world_size % pre == 0 and world_size / pre > pre:
        pre *= 2
    return float(pre), world_size / pre


def rank_order_sum(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """A new ``rows[0] + rows[1] + ...``, one row at a time in rank order in the rows' dtype (as a ring adds on the
    wire): the one definition of a reduce-scatter's sum, so every communicator and path gives the same bits."""
    total = rows[0] + rows[1] if len(rows) > 1 else rows[0].clone()
    for row in rows[2:]:
        total.add_(row)
    return total


class Communicator:
    """Base class: subclasses implement each of ``all_reduce``, ``reduce_scatter``, ``all_gather`` or its ``*_start``
    form (started now; the returned function waits, gives the result). Pieces read the capabilities below."""

    world_size: int  # W
    local_ranks: int  # R
    ranks: tuple[int, ...]  # the global rank of each local row
    traced: bool = False  # its collectives are being traced into a graph (see ``tracing``)
    overlaps: bool = False  # they may run on a thread of their own while backward goes on
    # what one gradient reduction allocates beside its result, per element of one rank's input (memory_report)
    reduce_scatter_buffers: float = 0.0
    all_reduce_buffers: float = 0.0

    def all_reduce(self, x: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """``[R, ...] -> [R, ...]``, ``op`` in sum/avg/max (``avg``: the sum divided by ``W``, everywhere)."""
        if type(self).all_reduce_start is Communicator.all_reduce_start:
            raise NotImplementedError
        return self.all_reduce_start(x, op)()

    def reduce_scatter(self, x: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """``[R, W*n] -> [R, n]``, ``op`` sum or avg: row ``r`` keeps chunk ``ranks[r]`` of the sum."""
        if type(self).reduce_scatter_start is Communicator.reduce_scatter_start:
            raise NotImplementedError
        return self.reduce_scatter_start(x, op)()

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """``[R, n] -> [R, W*n]``: every rank's chunk, in rank order."""
        if type(self).all_gather_start is Communicator.all_gather_start:
            raise NotImplementedError
        return self.all_gather_start(x)()

    def all_reduce_start(self, x: torch.Tensor, op: ReduceOp = "sum") -> Callable[[], torch.Tensor]:
        out = self.all_reduce(x, op)
        return lambda: out

    def reduce_scatter_start(self, x: torch.Tensor, op: ReduceOp = "sum") -> Callable[[], torch.Tensor]:
        out = self.reduce_scatter(x, op)
        return lambda: out

    def all_gather_start(self, x: torch.Tensor) -> Callable[[], torch.Tensor]:
        out = self.all_gather(x)
        return lambda: out

    def all_reduce_shard_start(self, x: torch.Tensor, op: ReduceOp = "sum") -> Callable[[], torch.Tensor]:
        """ZeRO-1's reduction: ``all_reduce`` of ``x`` ``[R, W*n]``, each rank keeping its chunk ``[R, n]``."""
        self._chunk(x, "all_reduce_shard")
        reduced = self.all_reduce_start(x, op)
        return lambda: self.take_shard(reduced())

    def all_gather_into_start(self, x: torch.Tensor, out: torch.Tensor) -> Callable[[], torch.Tensor]:
        """``all_gather`` of ``x`` ``[R, n]`` into ``out`` ``[R, W*n]`` (same dtype); default: gathered, then copied."""
        self._check_into(x, out)
        started = self.all_gather_start(x)
        return lambda: out.copy_(started())

    def all_gather_into(self, xs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]) -> None:
        """``all_gather_into_start`` of every pair, all started before any is waited for."""
        for done in [self.all_gather_into_start(x, o) for x, o in zip(xs, outs)]:
            done()

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``[R, n] -> [R, n]``, any dtype: every row becomes rank ``src``'s (here: a gather, W times the traffic)."""
        self._check_broadcast(x, src)
        n = x.shape[1]
        return self.all_gather(x)[:, src * n:(src + 1) * n].contiguous()

    def tracing(self) -> "Communicator":
        """A copy as a compiled step traces it: ``traced`` set (a wrapper's ``.inner`` too). No communication."""
        out = copy.copy(self)
        out.traced = True
        if isinstance(getattr(self, "inner", None), Communicator):
            out.inner = self.inner.tracing()
        return out

    def reusing_buffers(self) -> ContextManager[None]:
        """A block in which received buffers may be handed out again once nothing refers to them (default: never)."""
        inner = getattr(self, "inner", None)
        return inner.reusing_buffers() if isinstance(inner, Communicator) else contextlib.nullcontext()

    def check_layout(self, layout: Any) -> None:
        """Raise unless every rank built the same layout (one process: nothing to compare)."""

    def take_shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of a ``[R, W*n]`` tensor: ``[R, n]``. No communication."""
        self._check_rows(x, "take_shard")
        n = self._chunk(x, "take_shard")
        return torch.stack([x[i, r * n:(r + 1) * n] for i, r in enumerate(self.ranks)])

    def split_batch(self, batch: Any, micro_batches: int = 1) -> Any:
        """A global batch cut per rank, as ``DistributedSampler`` (for examples and tests): ``[B, ...]`` (``B``
        divisible by ``W * K``, ``K = micro_batches``) -> ``[R, B // W, ...]``, or ``[R, K, B // (W K), ...]``."""
        parts_n = self.world_size * micro_batches

        def one(path: Any, x: torch.Tensor) -> torch.Tensor:
            if x.dim() == 0 or x.shape[0] % parts_n:
                raise ValueError(f"split_batch: batch{tp.keystr(path)} has shape {tuple(x.shape)}; dim 0 must be "
                                 f"divisible by the world size {self.world_size} times micro_batches {micro_batches}")
            lead = (self.world_size,) if micro_batches == 1 else (self.world_size, micro_batches)
            parts = x.reshape(*lead, x.shape[0] // parts_n, *x.shape[1:])
            return parts[list(self.ranks)] if self.local_ranks < self.world_size else parts

        return tp.tree_map_with_path(one, batch)

    def _check_rows(self, x: torch.Tensor, what: str) -> None:
        if x.dim() < 1 or x.shape[0] != self.local_ranks:
            raise ValueError(f"{what}: expected a leading local-rank axis of size {self.local_ranks}, "
                             f"got shape {tuple(x.shape)}")

    def _check_broadcast(self, x: torch.Tensor, src: int) -> None:
        self._check_rows(x, "broadcast")
        if not 0 <= src < self.world_size:
            raise ValueError(f"broadcast: src must be a rank in [0, {self.world_size}), got {src}")

    def _check_into(self, x: torch.Tensor, out: torch.Tensor) -> None:
        self._check_rows(x, "all_gather_into_start")
        want = (self.local_ranks, self.world_size * x.shape[-1])
        if x.dim() != 2 or tuple(out.shape) != want or out.dtype != x.dtype:
            raise ValueError(f"all_gather_into_start: x {tuple(x.shape)} {x.dtype} needs out of shape {want} "
                             f"and dtype {x.dtype}, got {tuple(out.shape)} {out.dtype}")

    def _chunk(self, x: torch.Tensor, what: str) -> int:
        if x.dim() != 2 or x.shape[1] % self.world_size:
            raise ValueError(f"{what}: expected shape [R, W*n] with W={self.world_size}, got {tuple(x.shape)}")
        return x.shape[1] // self.world_size


class SimulatedWorld(Communicator):
    """All ``world_size`` ranks in one process: a reduce-scatter adds the rows in rank order (:func:`rank_order_sum`:
    ``fzero.dist``'s point-to-point bits), an all-reduce sums over dim 0; one rank's reductions return their input."""

    def __init__(self, world_size: int):
        if not (isinstance(world_size, int) and world_size >= 1):
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        self.world_size, self.local_ranks, self.ranks = world_size, world_size, tuple(range(world_size))
        self.reduce_scatter_buffers, self.all_reduce_buffers = 0.0, float(world_size)  # the sum, one per row

    def __repr__(self) -> str:
        return f"SimulatedWorld({self.world_size})"

    def all_reduce(self, x: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        self._check_rows(x, "all_reduce")
        if op not in ("sum", "avg", "max"):
            raise ValueError(f"unknown reduce op {op!r}")
        if self.world_size == 1:  # the identity: no copy
            return x
        total = x.amax(dim=0) if op == "max" else x.sum(dim=0)  # new: averaged in place, the same bits
        total = total.div_(self.world_size) if op == "avg" else total
        return total.unsqueeze(0).repeat(self.world_size, *([1] * (x.dim() - 1)))

    def reduce_scatter(self, x: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        self._check_rows(x, "reduce_scatter")
        if op == "max":
            raise ValueError("reduce_scatter supports 'sum' and 'avg'")
        n = self._chunk(x, "reduce_scatter")
        if self.world_size == 1:
            return x
        total = rank_order_sum(x.reshape(self.world_size, self.world_size, n).unbind(0))
        return total.div_(self.world_size) if op == "avg" else total

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        self._check_rows(x, "all_gather")
        if x.dim() != 2:
            raise ValueError(f"all_gather: expected shape [R, n], got {tuple(x.shape)}")
        return x.reshape(1, -1).expand(self.world_size, -1).clone()  # a gather's output never aliases its input

    def all_gather_into_start(self, x: torch.Tensor, out: torch.Tensor) -> Callable[[], torch.Tensor]:
        self._check_into(x, out)
        out.copy_(x.reshape(1, -1).expand(self.world_size, -1))
        return lambda: out

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        self._check_broadcast(x, src)
        return x[src].unsqueeze(0).repeat(self.world_size, *([1] * (x.dim() - 1)))


@dataclasses.dataclass(frozen=True)
class CollectiveRecord:
    """One collective as one rank saw it: ``elements`` of its buffer per rank (the input of all-reduce and
    reduce-scatter, the output of all-gather); ``moved``, the elements each rank sends (ring: ``2 (W-1)/W`` of them for
    all-reduce, ``(W-1)/W`` otherwise; a tree broadcast: about all); ``bytes = moved * itemsize``."""

    op: str
    dtype: torch.dtype
    elements: int
    moved: float
    bytes: float


class CountingCommunicator(Communicator):
    """Wraps a communicator and records every collective it runs, in the order issued (traced: once, while tracing)."""

    def __init__(self, inner: Communicator):
        self.inner, self.overlaps = inner, inner.overlaps
        self.world_size, self.local_ranks, self.ranks = inner.world_size, inner.local_ranks, inner.ranks
        self.reduce_scatter_buffers, self.all_reduce_buffers = inner.reduce_scatter_buffers, inner.all_reduce_buffers
        self.records: list[CollectiveRecord] = []

    def __repr__(self) -> str:
        return f"CountingCommunicator({self.inner!r})"

    def reset(self) -> None:
        self.records.clear()

    def _record(self, op: str, x: torch.Tensor) -> Communicator:
        """Record collective ``op`` of ``x``; return the wrapped communicator, which runs it."""
        if op == "reduce_scatter" and getattr(self.inner, "reduce_scatter_via", None) == "all_reduce":
            op = "all_reduce"  # what the backend really sends
        w = self.world_size
        elements = x[0].numel() * (w if op == "all_gather" else 1)
        ring_factor = {"all_reduce": 2.0, "broadcast": w / max(w - 1, 1)}.get(op, 1.0)
        moved = elements * ring_factor * (w - 1) / w
        self.records.append(CollectiveRecord(op, x.dtype, elements, moved, moved * x.element_size()))
        return self.inner

    def all_reduce_start(self, x: torch.Tensor, op: ReduceOp = "sum") -> Callable[[], torch.Tensor]:
        return self._record("all_reduce", x).all_reduce_start(x, op)

    def reduce_scatter_start(self, x: torch.Tensor, op: ReduceOp = "sum") -> Callable[[], torch.Tensor]:
        return self._record("reduce_scatter", x).reduce_scatter_start(x, op)

    def all_reduce_shard_start(self, x: torch.Tensor, op: ReduceOp = "sum") -> Callable[[], torch.Tensor]:
        return self._record("all_reduce", x).all_reduce_shard_start(x, op)

    def all_gather_start(self, x: torch.Tensor) -> Callable[[], torch.Tensor]:
        return self._record("all_gather", x).all_gather_start(x)

    def all_gather_into_start(self, x: torch.Tensor, out: torch.Tensor) -> Callable[[], torch.Tensor]:
        return self._record("all_gather", x).all_gather_into_start(x, out)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        return self._record("broadcast", x).broadcast(x, src)

    def check_layout(self, layout: Any) -> None:
        self.inner.check_layout(layout)

    def totals(self, ops: Sequence[str] | None = None, min_elements: int = 0) -> dict[str, float]:
        """Sums over the records (optionally only ``ops``, only buffers of ``min_elements`` or more)."""
        rows = [r for r in self.records if (ops is None or r.op in ops) and r.elements >= min_elements]
        return {"calls": len(rows), "elements": sum(r.elements for r in rows),
                "moved": sum(r.moved for r in rows), "bytes": sum(r.bytes for r in rows)}
