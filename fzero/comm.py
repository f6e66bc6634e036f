"""Communicators: the only way fzero's functions talk to other ranks.

Every tensor that differs between ranks carries a leading *local-rank axis*
of size ``R = comm.local_ranks``: ``R == world_size`` on the
:class:`SimulatedWorld` (all ranks in one process) and ``R == 1`` on a real
rank (:class:`fzero.dist.TorchCommunicator`). Collectives are plain methods
on that axis, so one step function runs unchanged on both and traces under
``torch.compile(fullgraph=True)``.

Shapes (``W`` = world size, ``R`` = local ranks):
  * ``all_reduce(x, op)``: ``[R, ...] -> [R, ...]``, ``op`` in sum/avg/max.
  * ``reduce_scatter(x, op)``: ``[R, W*n] -> [R, n]``; row ``r`` receives
    chunk ``ranks[r]`` of the reduction. ``op`` in sum/avg.
  * ``all_gather(x)``: ``[R, n] -> [R, W*n]``, chunks in rank order.
  * ``take_shard(x)``: ``[R, W*n] -> [R, n]``, this rank's chunk, no traffic.
  * ``all_reduce_shard_start(x, op)``: ZeRO-1's ``all_reduce`` of ``[R, W*n]`` of which
    each rank keeps its chunk, ``[R, n]`` (started; the returned function waits).
  * ``all_gather_into_start(x, out)``: the ``all_gather`` written into ``out``
    (``[R, W*n]``, the caller's buffer: the parameters the next forward reads);
  * ``all_reduce_start``, ``reduce_scatter_start``, ``all_gather_start``: the
    same collectives started now; each returns a function that waits for the
    result and gives it (on a process group: c10d ``async_op`` work, or an
    unwaited functional collective when traced; elsewhere they run at once).
  * ``broadcast(x, src)``: ``[R, n] -> [R, n]``, every row becomes rank
    ``src``'s row (any dtype; module buffers).

``avg`` is a sum followed by a division by ``W`` on every communicator (gloo
has no native average), so simulated and real worlds round identically.

Imports: torch only.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, ContextManager, Literal, Optional, Sequence

import torch
import torch.utils._pytree as tp

from . import scratch

__all__ = [
    "CollectiveError",
    "Communicator",
    "SimulatedWorld",
    "CountingCommunicator",
    "CollectiveRecord",
    "ReductionFootprint",
    "GatherFootprint",
    "gradient_divide_factors",
]

ReduceOp = Literal["sum", "avg", "max"]


class CollectiveError(RuntimeError):
    """A collective did not complete on this rank: a peer stalled past the communicator's
    timeout, or died. ``collective`` names it, ``step`` is the train step it belonged to
    (``state.opt.step + 1``; None outside a step), ``timeout`` the bound in seconds.

    The process group is unusable afterwards (peers may be inside the collective): end the
    process with an error, and let the launcher (``torchrun``) stop or restart the job."""

    def __init__(self, collective: str, rank: int, timeout: float | None, cause: str, step: int | None = None):
        self.collective, self.rank, self.timeout, self.cause, self.step = collective, rank, timeout, cause, step
        within = "" if timeout is None else f" within {timeout:g} s"
        during = "" if step is None else f" during step {step}"
        super().__init__(
            f"rank {rank}: collective {collective}{during} did not complete{within} (a peer rank stalled "
            f"or died): {cause}"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.collective, self.rank, self.timeout, self.cause, self.step))

    def at_step(self, step: int) -> "CollectiveError":
        """The same error, naming the train step it happened in."""
        return type(self)(self.collective, self.rank, self.timeout, self.cause, step)


def gradient_divide_factors(world_size: int) -> tuple[float, float]:
    """FSDP's ``(pre, post)`` factors with ``pre * post == world_size``.

    Low-precision gradient reduction divides by ``pre`` before the sum and by
    ``post`` after it, so the sum neither overflows (fp16) nor underflows.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    pre = 1
    while world_size % pre == 0 and world_size / pre > pre:
        pre *= 2
    return float(pre), world_size / pre


@dataclasses.dataclass(frozen=True)
class ReductionFootprint:
    """What one started gradient reduction allocates in this process, in elements of the
    dtype it reduces in, for an input ``[R, numel]`` (``R = local_ranks``; result ``[R, n]``,
    ``n = numel / W``): ``held`` from its start until it is waited for (receive buffers, a
    backend's copy of the input); ``result``, the reduced shard the caller keeps (allocated
    when it starts if ``result_first``, otherwise when it is waited for); ``scratch``,
    allocated and freed again while it starts; ``keeps_input``: the input itself is kept
    until the wait (an asynchronous collective holds it), so a copy made to send (a cast,
    a pre-divide) lives that long. :func:`fzero.memory.memory_report` predicts a step's
    reduction buffers from it (see :meth:`Communicator.reduction_footprint`)."""

    held: int
    result: int
    result_first: bool = False
    scratch: int = 0
    keeps_input: bool = True


@dataclasses.dataclass(frozen=True)
class GatherFootprint:
    """What one started ``all_gather`` of an ``[R, numel]`` input allocates in this process, in
    elements of its dtype: ``received``, the result, held until the caller drops it;
    ``scratch``, allocated and freed again while it starts; ``keeps_input``: the input is kept
    until the wait (a cast made to send lives that long). ``batched``: inside
    :meth:`Communicator.batched` it travels with the block's other collectives of its dtype
    in one all-to-all (``TorchCommunicator`` on gloo): its rows are copied into the block's
    joined send buffer (``[W, numel]``, kept until the first of the block's waits), arrive
    in the joined receive buffer (kept until every collective of the block was waited for
    and let go) and are copied out of it when waited for (``[W * numel]``, the result); alone
    in its dtype it is started as outside a block. :func:`fzero.memory.memory_report`
    predicts a stage-3 step's gathers from it."""

    received: int
    scratch: int = 0
    keeps_input: bool = False
    batched: bool = False


class Communicator:
    """Base class of communicators; subclasses implement the three collectives.

    Attributes: ``world_size`` (W), ``local_ranks`` (R), ``ranks`` (the
    global rank of each local row, length R).
    """

    world_size: int
    local_ranks: int
    ranks: tuple[int, ...]

    # -- collectives: subclasses implement -------------------------------------------
    def all_reduce(self, x: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        raise NotImplementedError

    def reduce_scatter(self, x: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        raise NotImplementedError

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def all_gather_start(self, x: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Start an ``all_gather``; the returned function gives its result (waiting for it
        then; stage 3 prefetches the next unit with it). Default: the collective runs now."""
        out = self.all_gather(x)
        return lambda: out

    def all_gather_into_start(self, x: torch.Tensor, out: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Start an ``all_gather`` of ``x`` ``[R, n]`` into ``out`` ``[R, W*n]`` (same dtype); the
        returned function waits and gives ``out``. No buffer of the result's size is allocated
        where the backend can write into ``out`` (c10d eagerly, the simulated world); traced or
        elsewhere the result is gathered and copied. Default: :meth:`all_gather` and a copy."""
        self._check_into(x, out)
        out.copy_(self.all_gather(x))
        return lambda: out

    def reduce_scatter_start(self, x: torch.Tensor, op: ReduceOp = "sum") -> Callable[[], torch.Tensor]:
        """Start a ``reduce_scatter``; the returned function gives its result (waiting for it
        then). Default: the collective runs now."""
        out = self.reduce_scatter(x, op)
        return lambda: out

    def all_reduce_start(self, x: torch.Tensor, op: ReduceOp = "sum") -> Callable[[], torch.Tensor]:
        """Start an ``all_reduce``; the returned function gives its result (waiting for it
        then). Default: the collective runs now."""
        out = self.all_reduce(x, op)
        return lambda: out

    def all_reduce_shard_start(self, x: torch.Tensor, op: ReduceOp = "sum") -> Callable[[], torch.Tensor]:
        """Start ZeRO-1's reduction of ``x`` ``[R, W*n]``: an ``all_reduce`` of which each rank
        keeps its own chunk; the returned function waits and gives ``[R, n]`` (what
        :meth:`take_shard` cuts). ``op``: ``"sum"`` or ``"avg"``. Default:
        :meth:`all_reduce_start`, then :meth:`take_shard`."""
        self._chunk(x, "all_reduce_shard")
        reduced = self.all_reduce_start(x, op)
        return lambda: self.take_shard(reduced())

    def batched(self) -> ContextManager[None]:
        """A block whose started collectives may travel together: a communicator that can
        carry several in one (``TorchCommunicator`` on gloo: one ``all_to_all``) issues them
        at the end of the block, or when one of them is waited for inside it. Default: each
        runs as it is started. Every rank must start the same collectives in the block."""
        return contextlib.nullcontext()

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``[R, n] -> [R, n]``: every row becomes rank ``src``'s row.

        The generic form is an ``all_gather`` and a local slice (W times the
        traffic of a real broadcast; wrappers inherit it for free).
        Communicators with a native broadcast override it.
        """
        self._check_rows(x, "broadcast")
        if not 0 <= src < self.world_size:
            raise ValueError(f"broadcast: src must be a rank in [0, {self.world_size}), got {src}")
        n = x.shape[1]
        return self.all_gather(x)[:, src * n : (src + 1) * n].contiguous()

    def reduction_footprint(self, numel: int, op: ReduceOp = "sum",
                            via_all_reduce: bool = False) -> ReductionFootprint | None:
        """The memory an eager, started reduction of a ``[R, numel]`` gradient allocates
        (``reduce_scatter_start``, or with ``via_all_reduce`` ``all_reduce_start`` and
        ``take_shard``, as ZeRO-1 reduces); ``None``: not known for this communicator (a
        memory report then predicts no reduction buffers). No communication."""
        return None

    def traced_reduction_footprint(self, numel: int, via_all_reduce: bool = False) -> Optional[tuple[int, int]]:
        """What one ``reduce_scatter`` of a ``[1, numel]`` gradient allocates inside a compiled
        step (with ``via_all_reduce``, one :meth:`all_reduce_shard_start`), as ``(received,
        result)`` elements: a buffer freed before the reduction returns, and the result it
        returns; ``None``: not known for this communicator (a memory report then predicts
        nothing for compiled steps). No communication."""
        return None

    def traced_gather_into_many(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Inside a compiled step: gather every ``(x, out)`` pair (as ``all_gather_into_start``)
        in one operator, if this communicator has one, and say whether it did; ``False``: the
        caller gathers them one by one."""
        return False

    def traced_gather_footprint(self, numel: int) -> Optional[int]:
        """The elements one ``all_gather`` of a ``[1, numel]`` shard allocates inside a compiled
        step (its result), or ``None``: not known for this communicator. No communication."""
        return None

    def gather_footprint(self, numel: int) -> Optional[GatherFootprint]:
        """What an eager, started ``all_gather`` of a ``[R, numel]`` input allocates in this
        process (:class:`GatherFootprint`), or ``None``: not known for this communicator (a
        memory report then predicts no stage-3 gathers). Only what ``all_gather_start``
        itself allocates: casts, joins and cuts are the caller's. No communication."""
        return None

    def check_layout(self, layout: Any) -> None:
        """Verify that every rank built the same layout (raise otherwise).

        In one process every rank is built from the same objects, so there is
        nothing to compare; :class:`fzero.dist.TorchCommunicator` compares.
        """

    # -- local helpers shared by every communicator -----------------------------------
    def take_shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of a ``[R, W*n]`` tensor: ``[R, n]``. No communication."""
        self._check_rows(x, "take_shard")
        n = self._chunk(x, "take_shard")
        return torch.stack([x[i, r * n : (r + 1) * n] for i, r in enumerate(self.ranks)])

    def split_batch(self, batch: Any, micro_batches: int = 1) -> Any:
        """Split a global batch into per-rank micro-batches with the local-rank axis.

        Every leaf's dim 0 (the global batch, divisible by W * micro_batches) is
        cut into W equal contiguous parts, one per rank; the result keeps this
        process's parts: ``[R, B // W, ...]``, or with ``micro_batches=K``
        (gradient accumulation) ``[R, K, B // (W K), ...]``.
        Like ``DistributedSampler``, for examples and tests.
        """
        parts_n = self.world_size * micro_batches

        def one(path: Any, x: torch.Tensor) -> torch.Tensor:
            if x.dim() == 0 or x.shape[0] % parts_n:
                raise ValueError(
                    f"split_batch: batch{tp.keystr(path)} has shape {tuple(x.shape)}; dim 0 must "
                    f"be divisible by the world size {self.world_size} times micro_batches {micro_batches}"
                )
            lead = (self.world_size,) if micro_batches == 1 else (self.world_size, micro_batches)
            parts = x.reshape(*lead, x.shape[0] // parts_n, *x.shape[1:])
            return parts[list(self.ranks)] if self.local_ranks < self.world_size else parts

        return tp.tree_map_with_path(one, batch)

    def _check_rows(self, x: torch.Tensor, what: str) -> None:
        if x.dim() < 1 or x.shape[0] != self.local_ranks:
            raise ValueError(
                f"{what}: expected a leading local-rank axis of size {self.local_ranks}, "
                f"got shape {tuple(x.shape)}"
            )

    def _check_into(self, x: torch.Tensor, out: torch.Tensor) -> None:
        self._check_rows(x, "all_gather_into_start")
        want = (self.local_ranks, self.world_size * x.shape[-1])
        if x.dim() != 2 or tuple(out.shape) != want or out.dtype != x.dtype:
            raise ValueError(
                f"all_gather_into_start: x {tuple(x.shape)} {x.dtype} needs out of shape {want} and "
                f"dtype {x.dtype}, got {tuple(out.shape)} {out.dtype}"
            )

    def _chunk(self, x: torch.Tensor, what: str) -> int:
        if x.dim() != 2 or x.shape[1] % self.world_size:
            raise ValueError(
                f"{what}: expected shape [R, W*n] with W={self.world_size}, got {tuple(x.shape)}"
            )
        return x.shape[1] // self.world_size


class SimulatedWorld(Communicator):
    """All ``world_size`` ranks in one process; collectives are reductions over dim 0.

    Deterministic, and equal to gloo bit for bit at W=2 (a sum of two terms
    rounds the same in any order); for W>2 the summation order may differ
    from the backend's, within rounding. With one rank, reductions are the
    identity and return their input itself (no copy); ``all_gather`` always
    allocates.
    """

    def __init__(self, world_size: int):
        if not (isinstance(world_size, int) and world_size >= 1):
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        self.world_size = world_size
        self.local_ranks = world_size
        self.ranks = tuple(range(world_size))

    def __repr__(self) -> str:
        return f"SimulatedWorld({self.world_size})"

    def reduction_footprint(self, numel: int, op: ReduceOp = "sum",
                            via_all_reduce: bool = False) -> ReductionFootprint:
        rows, world = self.local_ranks, self.world_size
        n = numel // world
        # every collective runs when it is started: nothing keeps its input
        if world == 1:  # the identity (take_shard still stacks its rows)
            return ReductionFootprint(0, rows * n if via_all_reduce else 0, keeps_input=False)
        if via_all_reduce:
            # the sum over rows ([numel]; with avg also its quotient) is repeated to every row
            # and kept until take_shard stacks each row's chunk
            return ReductionFootprint(held=rows * numel, result=rows * n, scratch=numel, keeps_input=False)
        # the rows' sum is the result at once; avg divides it into a new buffer
        return ReductionFootprint(0, rows * n, result_first=True, scratch=rows * n if op == "avg" else 0,
                                  keeps_input=False)

    def gather_footprint(self, numel: int) -> GatherFootprint:
        # every local rank's gather receives every rank's row: [W, R * numel] (a cost of
        # simulating: a real rank receives [1, W * numel]); repeat's own index scratch (64
        # bytes for a 2-d input, freed at once) is left out
        return GatherFootprint(self.world_size * self.local_ranks * numel)

    def _reduce0(self, x: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        if op == "max":
            return x.amax(dim=0)
        total = x.sum(dim=0)
        if op == "sum" or (op == "avg" and self.world_size == 1):  # x / 1 == x: skip the pass
            return total
        if op == "avg":
            return total / self.world_size
        raise ValueError(f"unknown reduce op {op!r}")

    def all_reduce(self, x: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        self._check_rows(x, "all_reduce")
        if op not in ("sum", "avg", "max"):
            raise ValueError(f"unknown reduce op {op!r}")
        if self.world_size == 1:  # the identity: no copy (a full pass per gradient buffer)
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

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        self._check_rows(x, "broadcast")
        if not 0 <= src < self.world_size:
            raise ValueError(f"broadcast: src must be a rank in [0, {self.world_size}), got {src}")
        return x[src].unsqueeze(0).repeat(self.world_size, *([1] * (x.dim() - 1)))

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        self._check_rows(x, "all_gather")
        if x.dim() != 2:
            raise ValueError(f"all_gather: expected shape [R, n], got {tuple(x.shape)}")
        # a new buffer always, as a real all-gather's: the output must never alias its input
        # (with W=1, expand().contiguous() would return the input itself)
        row = x.reshape(1, -1)
        out = scratch.empty((self.world_size, row.shape[1]), x.dtype, x.device)
        return out.copy_(row.expand(self.world_size, -1))

    def all_gather_into_start(self, x: torch.Tensor, out: torch.Tensor) -> Callable[[], torch.Tensor]:
        self._check_into(x, out)
        out.copy_(x.reshape(1, -1).expand(self.world_size, -1))
        return lambda: out


@dataclasses.dataclass(frozen=True)
class CollectiveRecord:
    """One collective as seen by one rank.

    ``elements``: the size of the full (unsharded) buffer the collective is
    about, per rank: input of all-reduce and reduce-scatter, output of
    all-gather. ``moved``: elements each rank sends with the bandwidth-optimal
    (ring) algorithm: ``2 (W-1)/W`` of it for all-reduce, ``(W-1)/W`` for the
    others. ``bytes`` = ``moved * itemsize``.
    """

    op: str
    dtype: torch.dtype
    elements: int
    moved: float
    bytes: float


class CountingCommunicator(Communicator):
    """Wraps a communicator and records every collective it runs.

    Counting is a Python side effect: run it eagerly (under torch.compile the
    records are made once, while tracing).
    """

    def __init__(self, inner: Communicator):
        self.inner = inner
        self.world_size = inner.world_size
        self.local_ranks = inner.local_ranks
        self.ranks = inner.ranks
        self.records: list[CollectiveRecord] = []

    def __repr__(self) -> str:
        return f"CountingCommunicator({self.inner!r})"

    def reset(self) -> None:
        self.records.clear()

    def _record(self, op: str, x: torch.Tensor, elements: int, ring_factor: float) -> None:
        w = self.world_size
        moved = elements * ring_factor * (w - 1) / w
        self.records.append(CollectiveRecord(op, x.dtype, elements, moved, moved * x.element_size()))

    def all_reduce(self, x: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        self._record("all_reduce", x, x[0].numel(), 2.0)
        return self.inner.all_reduce(x, op)

    def _record_reduce_scatter(self, x: torch.Tensor) -> None:
        if getattr(self.inner, "reduce_scatter_via", None) == "all_reduce":
            self._record("all_reduce", x, x[0].numel(), 2.0)  # what the backend really sends
        else:
            self._record("reduce_scatter", x, x[0].numel(), 1.0)

    def reduce_scatter(self, x: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        self._record_reduce_scatter(x)
        return self.inner.reduce_scatter(x, op)

    def check_layout(self, layout: Any) -> None:
        self.inner.check_layout(layout)

    def reduction_footprint(self, numel: int, op: ReduceOp = "sum",
                            via_all_reduce: bool = False) -> ReductionFootprint | None:
        return self.inner.reduction_footprint(numel, op, via_all_reduce)

    def gather_footprint(self, numel: int) -> Optional[GatherFootprint]:
        return self.inner.gather_footprint(numel)

    def batched(self) -> ContextManager[None]:
        """The inner communicator's: counting does not change what travels together (each
        collective of a batch is recorded as itself)."""
        return self.inner.batched()

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        self._record("all_gather", x, x[0].numel() * self.world_size, 1.0)
        return self.inner.all_gather(x)

    # Started collectives are recorded when they are issued and stay started (the inner
    # communicator's own start), so the records give the order in which a step issues them.
    def all_reduce_start(self, x: torch.Tensor, op: ReduceOp = "sum") -> Callable[[], torch.Tensor]:
        self._record("all_reduce", x, x[0].numel(), 2.0)
        return self.inner.all_reduce_start(x, op)

    def reduce_scatter_start(self, x: torch.Tensor, op: ReduceOp = "sum") -> Callable[[], torch.Tensor]:
        self._record_reduce_scatter(x)
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

    def totals(self, ops: Sequence[str] | None = None, min_elements: int = 0) -> dict[str, float]:
        """Sums over the records (optionally only ``ops``, only buffers of at least ``min_elements``)."""
        rows = [
            r for r in self.records
            if (ops is None or r.op in ops) and r.elements >= min_elements
        ]
        return {
            "calls": len(rows),
            "elements": sum(r.elements for r in rows),
            "moved": sum(r.moved for r in rows),
            "bytes": sum(r.bytes for r in rows),
        }
