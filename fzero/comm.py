"""Communicators: the only way fzero's functions talk to other ranks.

Every tensor that differs between ranks carries a leading *local-rank axis* of size
``R = comm.local_ranks``: ``R == world_size`` in :class:`SimulatedWorld` (every rank in one
process) and ``R == 1`` on a real rank (:class:`fzero.dist.TorchCommunicator`). Collectives
are methods over that axis, so one step runs unchanged on both, eagerly or traced.

Shapes (``W`` world size, ``R`` local ranks):

* ``all_reduce(x, op)``: ``[R, ...] -> [R, ...]``, ``op`` in sum/avg/max;
* ``reduce_scatter(x, op)``: ``[R, W*n] -> [R, n]``, row ``r`` keeps chunk ``ranks[r]``;
* ``all_gather(x)``: ``[R, n] -> [R, W*n]``, chunks in rank order;
* ``broadcast(x, src)``: every row becomes rank ``src``'s (any dtype);
* ``*_start``: the same collective started now; the returned function waits and gives the
  result (a piece starts all its collectives before it waits for any);
  ``all_reduce_shard_start`` is ZeRO-1's all-reduce of which each rank keeps its chunk,
  ``all_gather_into_start`` writes into the caller's buffer.

Declared capabilities, read by the pieces instead of the communicator's type:
``traced`` (this communicator's collectives are being traced into a graph:
:meth:`Communicator.tracing` gives it to the wrapper that compiles a step), ``overlaps``
(its collectives may run on a thread of their own while backward goes on),
:meth:`Communicator.reusing_buffers` (a block whose receive buffers may be reused), and
``reduce_scatter_buffers``/``all_reduce_buffers`` (what one gradient reduction allocates
beside its result, per element of one rank's input: :func:`fzero.memory_report` states it). ``avg`` is a sum divided by ``W`` everywhere, so simulated
and real worlds round alike.

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
           "gradient_divide_factors"]

ReduceOp = Literal["sum", "avg", "max"]


class CollectiveError(RuntimeError):
    """A collective did not complete on this rank: a peer stalled past the communicator's
    timeout, or died. ``collective`` names it, ``step`` is the train step it belonged to
    (``state.opt.step + 1``; None outside a step), ``timeout`` the bound in seconds.

    The process group is unusable afterwards: end the process and let the launcher
    (``torchrun``) stop or restart the job."""

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
    """FSDP's ``(pre, post)`` factors, ``pre * post == world_size``: a 16-bit reduction divides
    by ``pre`` before the sum and by ``post`` after it, so the sum neither overflows nor
    underflows."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    pre = 1
    while world_size % pre == 0 and world_size / pre > pre:
        pre *= 2
    return float(pre), world_size / pre


class Communicator:
    """Base class: subclasses implement ``all_reduce``, ``reduce_scatter`` and ``all_gather``.

    Attributes: ``world_size`` (W), ``local_ranks`` (R), ``ranks`` (the global rank of each
    local row), and the capabilities of the module doc."""

    world_size: int
    local_ranks: int
    ranks: tuple[int, ...]
    traced: bool = False
    overlaps: bool = False
    # what one gradient reduction allocates beside its result, per element of one rank's input
    reduce_scatter_buffers: float = 0.0
    all_reduce_buffers: float = 0.0

    def all_reduce(self, x: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        raise NotImplementedError

    def reduce_scatter(self, x: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        raise NotImplementedError

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

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
        """ZeRO-1's reduction of ``x`` ``[R, W*n]``: an ``all_reduce`` of which each rank keeps
        its chunk ``[R, n]`` (what :meth:`take_shard` cuts)."""
        self._chunk(x, "all_reduce_shard")
        reduced = self.all_reduce_start(x, op)
        return lambda: self.take_shard(reduced())

    def all_gather_into_start(self, x: torch.Tensor, out: torch.Tensor) -> Callable[[], torch.Tensor]:
        """``all_gather`` of ``x`` ``[R, n]`` written into ``out`` ``[R, W*n]`` (same dtype): the
        parameters the next forward reads. Default: gathered, then copied."""
        self._check_into(x, out)
        started = self.all_gather_start(x)
        return lambda: out.copy_(started())

    def all_gather_into(self, xs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]) -> None:
        """``all_gather_into_start`` of every pair, all started before any is waited for."""
        for done in [self.all_gather_into_start(x, o) for x, o in zip(xs, outs)]:
            done()

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``[R, n] -> [R, n]``: every row becomes rank ``src``'s. Generic form: an
        ``all_gather`` and a slice (W times a broadcast's traffic)."""
        self._check_rows(x, "broadcast")
        self._check_src(src)
        n = x.shape[1]
        return self.all_gather(x)[:, src * n:(src + 1) * n].contiguous()

    def tracing(self) -> "Communicator":
        """This communicator as a compiled step traces it (``traced`` set); a wrapper of another
        communicator (``.inner``) traces that one too. No communication."""
        out = copy.copy(self)
        out.traced = True
        if isinstance(getattr(self, "inner", None), Communicator):
            out.inner = self.inner.tracing()
        return out

    def reusing_buffers(self) -> ContextManager[None]:
        """A block in which the communicator may hand out its own receive buffers again once
        nothing refers to them (stage 3's gathers; ``TorchCommunicator`` eagerly). Default:
        nothing is reused."""
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
        """A global batch cut per rank (dim 0 divisible by ``W * micro_batches``) with the
        local-rank axis: ``[R, B // W, ...]``, or ``[R, K, B // (W K), ...]`` with
        ``micro_batches=K``. As ``DistributedSampler``, for examples and tests."""
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

    def _check_src(self, src: int) -> None:
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
    """All ``world_size`` ranks in one process; collectives are reductions over dim 0.

    Deterministic, and equal to gloo bit for bit (fzero's gloo reduce-scatter sums the rows
    in rank order, as here). With one rank, reductions return their input (no copy);
    ``all_gather`` always allocates."""

    def __init__(self, world_size: int):
        if not (isinstance(world_size, int) and world_size >= 1):
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        self.world_size = self.local_ranks = world_size
        self.ranks = tuple(range(world_size))
        # measured by census (tests/test_memory_census.py): a reduce-scatter's sum is its result;
        # an all-reduce's sum is repeated to every row
        self.reduce_scatter_buffers, self.all_reduce_buffers = 0.0, float(world_size)

    def __repr__(self) -> str:
        return f"SimulatedWorld({self.world_size})"

    def _reduce0(self, x: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        if op == "max":
            return x.amax(dim=0)
        if op not in ("sum", "avg"):
            raise ValueError(f"unknown reduce op {op!r}")
        total = x.sum(dim=0)  # a new tensor: averaged in place, the same bits without a second buffer
        return total.div_(self.world_size) if op == "avg" and self.world_size > 1 else total

    def all_reduce(self, x: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        self._check_rows(x, "all_reduce")
        if op not in ("sum", "avg", "max"):
            raise ValueError(f"unknown reduce op {op!r}")
        if self.world_size == 1:  # the identity: no copy
            return x
        return self._reduce0(x, op).unsqueeze(0).repeat(self.world_size, *([1] * (x.dim() - 1)))

    def reduce_scatter(self, x: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        self._check_rows(x, "reduce_scatter")
        if op == "max":
            raise ValueError("reduce_scatter supports 'sum' and 'avg'")
        n = self._chunk(x, "reduce_scatter")
        if self.world_size == 1:
            return x
        return self._reduce0(x.reshape(self.world_size, self.world_size, n), op)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        self._check_rows(x, "all_gather")
        if x.dim() != 2:
            raise ValueError(f"all_gather: expected shape [R, n], got {tuple(x.shape)}")
        # always a new buffer: a gather's output never aliases its input
        return x.reshape(1, -1).expand(self.world_size, -1).clone()

    def all_gather_into_start(self, x: torch.Tensor, out: torch.Tensor) -> Callable[[], torch.Tensor]:
        self._check_into(x, out)
        out.copy_(x.reshape(1, -1).expand(self.world_size, -1))
        return lambda: out

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        self._check_rows(x, "broadcast")
        self._check_src(src)
        return x[src].unsqueeze(0).repeat(self.world_size, *([1] * (x.dim() - 1)))


@dataclasses.dataclass(frozen=True)
class CollectiveRecord:
    """One collective as one rank saw it. ``elements``: the full buffer it is about, per rank
    (input of all-reduce and reduce-scatter, output of all-gather); ``moved``: elements each
    rank sends with the ring algorithm (``2 (W-1)/W`` of it for all-reduce, ``(W-1)/W`` for
    the others); ``bytes = moved * itemsize``."""

    op: str
    dtype: torch.dtype
    elements: int
    moved: float
    bytes: float


class CountingCommunicator(Communicator):
    """Wraps a communicator and records every collective it runs (eagerly; traced, the records
    are made once, while tracing)."""

    def __init__(self, inner: Communicator):
        self.inner = inner
        self.world_size, self.local_ranks, self.ranks = inner.world_size, inner.local_ranks, inner.ranks
        self.overlaps = inner.overlaps
        self.reduce_scatter_buffers, self.all_reduce_buffers = inner.reduce_scatter_buffers, inner.all_reduce_buffers
        self.records: list[CollectiveRecord] = []

    def __repr__(self) -> str:
        return f"CountingCommunicator({self.inner!r})"

    def reset(self) -> None:
        self.records.clear()

    def _record(self, op: str, x: torch.Tensor, elements: int, ring_factor: float) -> None:
        w = self.world_size
        moved = elements * ring_factor * (w - 1) / w
        self.records.append(CollectiveRecord(op, x.dtype, elements, moved, moved * x.element_size()))

    def _reduce_scatter_record(self, x: torch.Tensor) -> None:
        if getattr(self.inner, "reduce_scatter_via", None) == "all_reduce":
            self._record("all_reduce", x, x[0].numel(), 2.0)  # what the backend really sends
        else:
            self._record("reduce_scatter", x, x[0].numel(), 1.0)

    def all_reduce(self, x: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        self._record("all_reduce", x, x[0].numel(), 2.0)
        return self.inner.all_reduce(x, op)

    def reduce_scatter(self, x: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        self._reduce_scatter_record(x)
        return self.inner.reduce_scatter(x, op)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        self._record("all_gather", x, x[0].numel() * self.world_size, 1.0)
        return self.inner.all_gather(x)

    # started collectives are recorded when issued: the records give the order a step issues them
    def all_reduce_start(self, x: torch.Tensor, op: ReduceOp = "sum") -> Callable[[], torch.Tensor]:
        self._record("all_reduce", x, x[0].numel(), 2.0)
        return self.inner.all_reduce_start(x, op)

    def reduce_scatter_start(self, x: torch.Tensor, op: ReduceOp = "sum") -> Callable[[], torch.Tensor]:
        self._reduce_scatter_record(x)
        return self.inner.reduce_scatter_start(x, op)

    def all_reduce_shard_start(self, x: torch.Tensor, op: ReduceOp = "sum") -> Callable[[], torch.Tensor]:
        self._record("all_reduce", x, x[0].numel(), 2.0)
        return self.inner.all_reduce_shard_start(x, op)

    def all_gather_start(self, x: torch.Tensor) -> Callable[[], torch.Tensor]:
        self._record("all_gather", x, x[0].numel() * self.world_size, 1.0)
        return self.inner.all_gather_start(x)

    def all_gather_into_start(self, x: torch.Tensor, out: torch.Tensor) -> Callable[[], torch.Tensor]:
        self._record("all_gather", x, x[0].numel() * self.world_size, 1.0)
        return self.inner.all_gather_into_start(x, out)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        # a tree broadcast sends the buffer about once per rank: ring factor W/(W-1)
        self._record("broadcast", x, x[0].numel(), self.world_size / max(self.world_size - 1, 1))
        return self.inner.broadcast(x, src)

    def check_layout(self, layout: Any) -> None:
        self.inner.check_layout(layout)

    def totals(self, ops: Sequence[str] | None = None, min_elements: int = 0) -> dict[str, float]:
        """Sums over the records (optionally only ``ops``, only buffers of ``min_elements`` or more)."""
        rows = [r for r in self.records if (ops is None or r.op in ops) and r.elements >= min_elements]
        return {"calls": len(rows), "elements": sum(r.elements for r in rows),
                "moved": sum(r.moved for r in rows), "bytes": sum(r.bytes for r in rows)}
