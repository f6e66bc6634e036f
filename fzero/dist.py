"""The communicator over a ``torch.distributed`` process group.

One process is one rank: the local-rank axis has size 1. Eagerly, collectives
are c10d calls with ``async_op=True`` (the ``*_start`` methods return a
function that waits for the ``Work``); under ``torch.compile(fullgraph=True)``
they are ``torch.distributed._functional_collectives`` calls, which trace (the
c10d calls break the graph), except on gloo, where a step's reductions and
point-to-point gathers are custom operators of fzero's that run the eager c10d
calls inside the graph and wait for them there: within the communicator's
timeout, one at a time. Both run the
process group's own algorithm, so eager and compiled steps reduce to the same
bits. Works with any backend; launched by ``torchrun``.

Imports: ``fzero.comm``, ``fzero.layout``, ``fzero.scopes``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import os
import time
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from .comm import CollectiveError, Communicator, GatherFootprint, ReduceOp, ReductionFootprint
from .layout import Layout, first_difference
from . import scratch
from .scopes import GATHER, GRAD_REDUCTION, step_scope

__all__ = ["TorchCommunicator", "LayoutMismatchError", "REDUCE_SCATTER_PATHS", "ALL_GATHER_PATHS",
           "launcher_world_size", "choose_comm"]

REDUCE_SCATTER_PATHS = ("reduce_scatter", "all_to_all", "all_reduce")
ALL_GATHER_PATHS = ("all_gather", "point_to_point")

def launcher_world_size(env: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """The world size a launcher gave this process (``torchrun`` and torch's elastic agent set
    ``WORLD_SIZE``, ``RANK`` and ``LOCAL_RANK`` for every rank), or ``None`` when it was not
    started by one. ``env``: default ``os.environ``. No collective."""
    env = os.environ if env is None else env
    if "LOCAL_RANK" not in env or "WORLD_SIZE" not in env:
        return None
    return int(env["WORLD_SIZE"])


def choose_comm(requested: str, env: Optional[Mapping[str, str]] = None) -> str:
    """``"sim"`` or ``"torch"`` for a script's ``--comm {auto,sim,torch}``: ``auto`` is
    ``torch`` under a launcher and ``sim`` otherwise. ``sim`` under a launcher of several ranks
    raises ``ValueError``: every process would run its own simulated world (the same run N
    times, each writing the same files) instead of one run over N ranks."""
    if requested not in ("auto", "sim", "torch"):
        raise ValueError(f"--comm must be auto, sim or torch, got {requested!r}")
    world = launcher_world_size(env)
    if requested == "auto":
        return "torch" if world is not None else "sim"
    if requested == "sim" and world is not None and world > 1:
        raise ValueError(
            f"--comm sim under a launcher of {world} ranks (WORLD_SIZE={world}): each process would "
            "run its own simulated world and write the same files; use --comm torch (or auto) under "
            "torchrun, or run the script without torchrun for a simulated world"
        )
    return requested


# torch 2.13 deprecates all_gather_tensor in favour of all_gather_single; older torch lacks the latter.
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


# torch 2.13 deprecates the *_tensor names of c10d in favour of *_single; older torch lacks those.
_c10d_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_c10d_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_C10D_OP = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def _eager() -> bool:
    """Eagerly, collectives go through c10d with ``async_op=True``: the functional ones cost
    about 0.1-0.3 ms more per call on gloo (a Python autograd wrapper and an
    ``AsyncCollectiveTensor`` per result; measured, see design.md). Traced, the
    functional ones are the only kind dynamo keeps in the graph. Both run the same
    process-group algorithm, so the bits agree."""
    return not torch.compiler.is_compiling()


def _average(total: torch.Tensor, op: ReduceOp, world_size: int) -> torch.Tensor:
    return total / world_size if op == "avg" and world_size > 1 else total


def _average_owned(total: torch.Tensor, op: ReduceOp, world_size: int) -> torch.Tensor:
    """:func:`_average` in place, for a result buffer the collective allocated itself: the same
    bits without a second buffer of its size (a stage-2 step's whole gradient shard)."""
    return total.div_(world_size) if op == "avg" and world_size > 1 else total


# (collective, rank, timeout in seconds): what a bounded wait names when it gives up
_Bound = Optional[tuple[str, int, float]]


def _waiter(work: Any, result: Callable[[], torch.Tensor], bound: _Bound = None,
            sent: Optional[torch.Tensor] = None) -> Callable[[], torch.Tensor]:
    """A function that waits for ``work`` (at most ``bound``'s timeout) and gives ``result()``.

    The ``Work`` is dropped once waited for: it keeps the thread-local state of its launch,
    saved-tensor hooks included, so a ``Work`` held by an object those hooks reach would be a
    reference cycle through C++ that Python's collector cannot free (stage 3 leaked each
    step's gradients that way). ``sent``: the tensor the collective sends, kept until the
    wait. The backend drops it when the collective completes, before or after the wait as
    timing goes; kept, a step's memory does not depend on timing (and
    :func:`fzero.memory.memory_report` can predict it)."""
    pending = [work]
    keep = [sent]

    def done() -> torch.Tensor:
        if pending:
            _wait(pending.pop(), bound)
        out = result()
        keep.clear()
        return out

    return done


class _Works:
    """Several c10d works waited for as one (a point-to-point gather's sends and receives),
    within one deadline when given a timeout."""

    def __init__(self, works: list[Any]):
        self.works = works

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        if timeout is None:
            for w in self.works:
                w.wait()
            return True
        deadline = time.monotonic() + timeout.total_seconds()
        for w in self.works:
            left = max(deadline - time.monotonic(), 0.001)
            if w.wait(timeout=datetime.timedelta(seconds=left)) is False:
                return False
        return True


def _point_to_point_gather(out: torch.Tensor, sent: torch.Tensor, group: Optional[dist.ProcessGroup], rank: int,
                           world: int, tag: int) -> _Works:
    """Start an all-gather of ``sent`` (``[n]``, contiguous) into ``out`` (``[world * n]``,
    rank-major) as ``world - 1`` sends and receives: each peer's shard is received straight
    into its place in ``out``, this rank's is copied there.

    Why not the backend's all-gather on gloo: it receives into a buffer of the output's size
    that it allocates for each call and then copies into the output. Measured (gloo W=2, 2
    cores, one call of 81M floats per rank): 1.44 s and 158 000 page faults, against 0.38-0.50
    s and none this way; 11M floats: 193 ms against 52 ms."""
    n = sent.numel()
    works = []
    for k in range(1, world):
        dst, src = (rank + k) % world, (rank - k) % world
        works.append(dist.isend(sent, group=group, group_dst=dst, tag=tag))
        works.append(dist.irecv(out[src * n:(src + 1) * n], group=group, group_src=src, tag=tag))
    out[rank * n:(rank + 1) * n].copy_(sent)
    return _Works(works)


@torch.library.custom_op("fzero::gather_point_to_point", mutates_args=("out",))
def _gather_point_to_point_op(out: torch.Tensor, sent: torch.Tensor, group_name: str, timeout: float) -> None:
    """:func:`_point_to_point_gather` of ``sent`` into ``out``, waited for (at most ``timeout``
    seconds, 0: the process group's own): the form a compiled graph calls (an opaque operator
    that writes ``out``; dynamo keeps no ``isend``)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name)
    works = _point_to_point_gather(out, sent, group, dist.get_rank(group), dist.get_world_size(group), 0)
    _wait(works, _traced_bound(f"all_gather of {out.numel()} {out.dtype}", group, timeout))


@_gather_point_to_point_op.register_fake
def _(out: torch.Tensor, sent: torch.Tensor, group_name: str, timeout: float) -> None:
    return None


@torch.library.custom_op("fzero::gather_point_to_point_many", mutates_args=("outs",))
def _gather_point_to_point_many_op(outs: list[torch.Tensor], sents: list[torch.Tensor], group_name: str,
                                   timeout: float) -> None:
    """:func:`_point_to_point_gather` of each ``sents[k]`` into ``outs[k]``, every one started
    before any is waited for (each with its own tag), within one deadline: the traced form of
    the eager path's parameter gathers after the update (one operator per group waited for
    each in turn; 162M, gloo W=2: 3.84-3.99 s a step against 3.71-3.73 this way)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    works = _Works([w for k, (out, sent) in enumerate(zip(outs, sents))
                    for w in _point_to_point_gather(out, sent, group, rank, world, k).works])
    total = sum(out.numel() for out in outs)
    _wait(works, _traced_bound(f"all_gather of {total} {outs[0].dtype} in {len(outs)} groups", group, timeout))


@_gather_point_to_point_many_op.register_fake
def _(outs: list[torch.Tensor], sents: list[torch.Tensor], group_name: str, timeout: float) -> None:
    return None


@torch.library.custom_op("fzero::all_gather_point_to_point", mutates_args=())
def _all_gather_point_to_point_op(sent: torch.Tensor, world: int, group_name: str, timeout: float) -> torch.Tensor:
    """:func:`_point_to_point_gather` of ``sent`` (``[n]``) into a new ``[world * n]``: the
    functional form, which a compiled stage-3 step recomputes in backward instead of keeping
    the unit (``fzero.units``' regather policy)."""
    with step_scope(GATHER):  # a census names it as the eager gathers
        out = sent.new_empty(world * sent.numel())
        _gather_point_to_point_op(out, sent, group_name, timeout)
    return out


@_all_gather_point_to_point_op.register_fake
def _(sent: torch.Tensor, world: int, group_name: str, timeout: float) -> torch.Tensor:
    return sent.new_empty(world * sent.numel())


def _traced_bound(what: str, group: dist.ProcessGroup, timeout: float) -> _Bound:
    """A traced operator's bound: ``timeout`` 0 is none (the process group's own)."""
    return (what, dist.get_rank(group), timeout) if timeout > 0 else None


# Traced gloo reductions. A functional collective's buffers (what it sends, what it receives)
# are let go by gloo's own thread when it completes, and inductor places its start and its wait
# as its passes decide: at 162M a compiled stage-2 step held every group's received buffer at
# once, and a census could not tell when any of them was freed. These operators run the eager
# code inside the graph, waited for before they return: one reduction at a time, its buffers
# dropped before the next starts, within the communicator's timeout (which a functional
# collective does not take).


@torch.library.custom_op("fzero::reduce_scatter_all_to_all", mutates_args=())
def _reduce_scatter_all_to_all_op(sent: torch.Tensor, world: int, op: str, group_name: str,
                                  timeout: float) -> torch.Tensor:
    """Rank ``k``'s chunk of every rank's ``sent`` (``[world * n]``) arrives at rank ``k`` and is
    summed there, ``[world, n].sum(0)``, then averaged in place when ``op`` is ``"avg"``: the
    eager path's kernels (``TorchCommunicator._reduce_scatter_all_to_all``). Allocates the
    received ``[world * n]`` (freed before it returns) and the result ``[n]``."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name)
    n = sent.numel() // world
    with step_scope(GRAD_REDUCTION):
        received = sent.new_empty(world * n)
        work = dist.all_to_all_single(received, sent, group=group, async_op=True)
        _wait(work, _traced_bound(f"reduce_scatter ({op}, as all_to_all_single) of {sent.numel()} {sent.dtype}",
                                  group, timeout))
        del work  # our reference goes now; gloo's thread may hold the last one a moment longer
        total = received.view(world, n).sum(0)
        del received
        return _average_owned(total, op, world)


@_reduce_scatter_all_to_all_op.register_fake
def _(sent: torch.Tensor, world: int, op: str, group_name: str, timeout: float) -> torch.Tensor:
    return sent.new_empty(sent.numel() // world)


def _summed_copy(x: torch.Tensor, op: str, group_name: str, timeout: float) -> torch.Tensor:
    """A copy of ``x`` all-reduced in place (c10d's ``SUM``, or ``MAX``) and waited for within
    ``timeout``: what both traced all-reduce operators start from."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name)
    out = x.clone()
    work = dist.all_reduce(out, _C10D_OP[op], group=group, async_op=True)
    _wait(work, _traced_bound(f"all_reduce ({op}) of {out.numel()} {out.dtype}", group, timeout))
    return out


@torch.library.custom_op("fzero::all_reduce_waited", mutates_args=())
def _all_reduce_op(x: torch.Tensor, world: int, op: str, group_name: str, timeout: float) -> torch.Tensor:
    """``all_reduce`` of a copy of ``x``, waited for, averaged in place when ``op`` is ``"avg"``:
    the eager path's (``TorchCommunicator.all_reduce_start``). Allocates the copy, which it
    returns."""
    with step_scope(GRAD_REDUCTION):
        return _average_owned(_summed_copy(x, op, group_name, timeout), op, world)


@_all_reduce_op.register_fake
def _(x: torch.Tensor, world: int, op: str, group_name: str, timeout: float) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("fzero::all_reduce_shard", mutates_args=())
def _all_reduce_shard_op(x: torch.Tensor, world: int, rank: int, op: str, group_name: str,
                         timeout: float) -> torch.Tensor:
    """ZeRO-1's reduction (``TorchCommunicator.all_reduce_shard_start``): ``all_reduce`` of a copy
    of ``x`` (``[world * n]``), waited for; rank ``rank``'s chunk ``[n]`` copied out, averaged in
    place when ``op`` is ``"avg"``. Allocates the copy (freed before it returns) and the chunk.
    (Returning the whole sum, inductor ran every group's all-reduce before cutting any: a
    compiled stage-1 step held the whole gradient's sum at once.)"""
    n = x.numel() // world
    with step_scope(GRAD_REDUCTION):
        whole = _summed_copy(x, op, group_name, timeout)
        mine = whole[rank * n : (rank + 1) * n].clone()
        del whole
        return _average_owned(mine, op, world)


@_all_reduce_shard_op.register_fake
def _(x: torch.Tensor, world: int, rank: int, op: str, group_name: str, timeout: float) -> torch.Tensor:
    return x.new_empty(x.numel() // world)


def _wait(work: Any, bound: _Bound) -> None:
    """``work.wait()``; with a bound, c10d's ``wait(timeout)``, and a failure (the timeout, or
    a peer that died) as :class:`~fzero.comm.CollectiveError` naming the collective."""
    if bound is None:
        work.wait()
        return
    what, rank, seconds = bound
    try:
        done = work.wait(timeout=datetime.timedelta(seconds=seconds))
    except RuntimeError as e:  # c10d's DistBackendError and gloo's timeouts are RuntimeErrors
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CollectiveError(what, rank, seconds, text) from e
    if done is False:  # backends that report a timeout instead of raising
        raise CollectiveError(what, rank, seconds, "the wait timed out")


@dataclasses.dataclass
class _Part:
    """One collective of a batch: ``send`` ``[W, k]`` (row ``j`` goes to rank ``j``),
    ``finish`` of what arrived ``[W, k]`` (row ``j`` from rank ``j``), ``alone`` to start it by
    itself; ``scope``: the profiler scope its buffers are allocated in when it is issued
    (:mod:`fzero.scopes`: the block ends outside the scopes its collectives were started in);
    ``result`` (waits, gives it) once issued."""

    send: torch.Tensor
    finish: Callable[[torch.Tensor], torch.Tensor]
    alone: Callable[[], Callable[[], torch.Tensor]]
    scope: str
    result: Optional[Callable[[], torch.Tensor]] = None


def _cut(finish: Callable[[torch.Tensor], torch.Tensor], arrived: Callable[[], torch.Tensor],
         lo: int, hi: int) -> torch.Tensor:
    return finish(arrived()[:, lo:hi])


class _Batch:
    """Collectives started in a ``TorchCommunicator.batched`` block, issued as one
    ``all_to_all_single`` per dtype; a part alone in its dtype is started by itself, as
    outside a block."""

    def __init__(self, group: Optional[dist.ProcessGroup], bound: Callable[[str], _Bound]):
        self.group = group
        self.bound = bound
        self.pending: list[_Part] = []

    def add(self, part: _Part) -> Callable[[], torch.Tensor]:
        self.pending.append(part)

        def done() -> torch.Tensor:
            if part.result is None:  # waited for inside the block: issue what is pending now
                self.issue()
            return part.result()  # type: ignore[misc]

        return done

    def issue(self) -> None:
        parts, self.pending = self.pending, []
        by_dtype: dict[torch.dtype, list[_Part]] = {}
        for part in parts:  # in the order they were started: the same on every rank
            by_dtype.setdefault(part.send.dtype, []).append(part)
        for group in by_dtype.values():
            if len(group) == 1:
                with step_scope(group[0].scope):
                    group[0].result = group[0].alone()
                continue
            # the joined buffers hold a reduction's rows beside the gathers': named by it
            scope = GRAD_REDUCTION if any(p.scope == GRAD_REDUCTION for p in group) else group[0].scope
            with step_scope(scope):
                send = scratch.cat([p.send for p in group], dim=1)
                received = scratch.empty(send.shape, send.dtype, send.device)
                work = dist.all_to_all_single(received, send, group=self.group, async_op=True)
            # the joined send is kept until the wait, as a collective's own send (see _waiter)
            arrived = _waiter(work, lambda received=received: received,
                              self.bound(f"all_to_all_single of {len(group)} batched reduce-scatters/all-gathers"),
                              send)
            lo = 0
            for p in group:
                hi = lo + p.send.shape[1]
                # the result holds the part's finish, not the part: a part holding a function
                # that holds it would be a cycle keeping the received buffer (and the Work) alive
                # until Python's cyclic collector ran (RSS grew about 0.36 MB a step)
                p.result = functools.partial(_cut, p.finish, arrived, lo, hi)
                lo = hi


class LayoutMismatchError(ValueError):
    """Ranks built different parameter layouts (different models or settings)."""


class TorchCommunicator(Communicator):
    """Collectives over ``group`` (default: the world group) for this process's rank.

    ``reduce_scatter_via``: how a reduce-scatter is computed.
    ``"reduce_scatter"``: the backend's own. ``"all_to_all"``: each rank
    sends every other rank that rank's chunk (``all_to_all_single``) and sums
    what it received in rank order: a reduce-scatter's traffic, and the same
    sum, bit for bit, as :class:`fzero.SimulatedWorld`'s at any W.
    ``"all_reduce"``: an all-reduce and a local slice (twice the traffic).
    The default, ``None``, is ``"all_to_all"`` on gloo, whose own
    reduce-scatter is its slowest collective (gloo W=2, one call, median:
    100k floats per rank 798 us native, 691 us all-reduce, 432 us all-to-all;
    1M floats 5.5, 4.7 and 2.6 ms; ``benchmarks/bench_collectives.py``), and
    the backend's own elsewhere (NCCL's reduce-scatter is the fastest there is).

    ``all_gather_via``: how an eager all-gather travels. ``"all_gather"``: the backend's own.
    ``"point_to_point"``: each rank sends its shard to every other rank and receives theirs
    straight into the output (``isend``/``irecv``; the same traffic, and the same bits: a
    gather only copies). The default, ``None``, is ``"point_to_point"`` on gloo, whose own
    all-gather allocates a buffer of the output's size for every call and copies out of it
    (gloo W=2, one gather of 81M floats per rank: 1.44 s against 0.38-0.50 s;
    ``_point_to_point_gather``), and the backend's own elsewhere. Traced, the point-to-point
    gather is one operator of the graph (``fzero::gather_point_to_point``: dynamo keeps no
    ``isend`` in a graph), waited for inside it; the backend's own is the functional
    all-gather.

    ``timeout`` (seconds or a ``timedelta``; default None: the process group's own, 30
    minutes unless ``init_process_group(timeout=...)`` said otherwise): the longest a rank
    waits for one collective of a step. A peer that stalls (stopped, swapped out,
    deadlocked) or dies then fails this rank with :class:`~fzero.comm.CollectiveError`
    naming the collective and the train step, instead of leaving it blocked. Compiled steps
    on gloo too: there a step's reductions and point-to-point gathers are fzero's own
    operators (``fzero::reduce_scatter_all_to_all``, ``fzero::all_reduce_shard``,
    ``fzero::all_reduce_waited``, ``fzero::gather_point_to_point``), waited for inside the
    graph within the timeout. Pass the same bound to ``init_process_group(timeout=...)``: it
    bounds what runs outside the step (``check_layout`` at init, checkpoint saving and
    loading, barriers) and the functional collectives of compiled steps on other backends,
    which take no timeout of their own.
    """

    def __init__(
        self,
        group: Optional[dist.ProcessGroup] = None,
        *,
        reduce_scatter_via: Optional[str] = None,
        timeout: Optional[Union[float, datetime.timedelta]] = None,
        all_gather_via: Optional[str] = None,
    ):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "TorchCommunicator needs an initialised default process group: call "
                "torch.distributed.init_process_group (e.g. under torchrun) first"
            )
        # The default group is not held (None means "the default group" to c10d): a
        # communicator that held it would keep gloo's worker threads alive after
        # destroy_process_group, and a worker releasing a finished collective's tensors while
        # the interpreter shuts down aborts the process ("terminate called without an active
        # exception", torch's gloo backend; seen in about 1 of 10 runs under load).
        self._pg = group
        self._name = (group if group is not None else dist.group.WORLD).group_name  # traced calls
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.local_ranks = 1
        self.ranks = (self.rank,)
        self.backend = str(dist.get_backend(group))
        if reduce_scatter_via is None:
            reduce_scatter_via = "all_to_all" if self.backend == "gloo" else "reduce_scatter"
        if reduce_scatter_via not in REDUCE_SCATTER_PATHS:
            raise ValueError(f"reduce_scatter_via must be one of {REDUCE_SCATTER_PATHS}, got {reduce_scatter_via!r}")
        self.reduce_scatter_via = reduce_scatter_via
        if all_gather_via is None:
            all_gather_via = "point_to_point" if self.backend == "gloo" else "all_gather"
        if all_gather_via not in ALL_GATHER_PATHS:
            raise ValueError(f"all_gather_via must be one of {ALL_GATHER_PATHS}, got {all_gather_via!r}")
        self.all_gather_via = all_gather_via
        self._sent_tags = 0  # point-to-point gathers started: each its own tag, in the same order on every rank
        if isinstance(timeout, datetime.timedelta):
            timeout = timeout.total_seconds()
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds or a timedelta, got {timeout!r}")
        self.timeout = None if timeout is None else float(timeout)
        self._batch: Optional[_Batch] = None

    def _bound(self, collective: str) -> _Bound:
        """What a wait for ``collective`` is bounded by: None without a timeout."""
        return None if self.timeout is None else (collective, self.rank, self.timeout)

    @contextlib.contextmanager
    def batched(self) -> Iterator[None]:
        """Eagerly with ``reduce_scatter_via="all_to_all"``: the reduce-scatters and all-gathers
        started in the block travel in one ``all_to_all_single`` per dtype, issued at the end of
        the block (or when one is waited for in it): one collective's latency for several (stage
        3 sends a unit's gradient and the gather of a later unit together). Otherwise, and
        nested, each collective goes as it is started."""
        if self._batch is not None or not _eager() or self.reduce_scatter_via != "all_to_all" \
                or self.world_size == 1:
            yield
            return
        self._batch = batch = _Batch(self._pg, self._bound)
        try:
            yield
        finally:
            self._batch = None
            batch.issue()

    @property
    def group(self) -> Optional[dist.ProcessGroup]:
        """The process group (the default one while it exists, when none was given)."""
        return self._pg if self._pg is not None else dist.group.WORLD

    def __repr__(self) -> str:
        bound = "" if self.timeout is None else f", timeout={self.timeout:g}s"
        return f"TorchCommunicator(rank={self.rank}, world_size={self.world_size}, backend={self.backend}{bound})"

    def _finish(self, total: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        # A functional collective's result is waited for here, so states hold plain tensors (an
        # AsyncCollectiveTensor in a state would make a compiled step trace a second graph).
        total = funcol.wait_tensor(total)
        return _average(total, op, self.world_size)

    def all_reduce(self, x: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        return self.all_reduce_start(x, op)()

    def all_reduce_start(self, x: torch.Tensor, op: ReduceOp = "sum") -> Callable[[], torch.Tensor]:
        """Launch the collective; the returned function waits for it."""
        self._check_rows(x, "all_reduce")
        if op not in ("sum", "avg", "max"):
            raise ValueError(f"unknown reduce op {op!r}")
        if _eager():
            out = x[0].clone()  # c10d reduces in place; the caller's tensor stays as it was
            work = dist.all_reduce(out, _C10D_OP[op], group=self._pg, async_op=True)
            return _waiter(work, lambda: _average_owned(out, op, self.world_size).unsqueeze(0),
                           self._bound(f"all_reduce ({op}) of {out.numel()} {out.dtype}"))
        if self.backend == "gloo":
            out = torch.ops.fzero.all_reduce_waited(x[0], self.world_size, op, self._name, self.timeout or 0.0)
            return lambda: out.unsqueeze(0)
        started = funcol.all_reduce(x[0], "max" if op == "max" else "sum", self._name)
        return lambda: self._finish(started, op).unsqueeze(0)

    def all_reduce_shard_start(self, x: torch.Tensor, op: ReduceOp = "sum") -> Callable[[], torch.Tensor]:
        """Traced on gloo, one operator, ``fzero::all_reduce_shard``: the whole sum is freed inside
        it, so a compiled stage-1 step holds one group's sum at a time. Otherwise the default
        (``all_reduce_start``, then ``take_shard``)."""
        if _eager() or self.backend != "gloo" or self.world_size == 1:
            return super().all_reduce_shard_start(x, op)
        self._check_rows(x, "all_reduce_shard")
        self._chunk(x, "all_reduce_shard")
        if op not in ("sum", "avg"):
            raise ValueError(f"all_reduce_shard supports 'sum' and 'avg', got {op!r}")
        out = torch.ops.fzero.all_reduce_shard(x[0], self.world_size, self.rank, op, self._name,
                                               self.timeout or 0.0)
        return lambda: out.unsqueeze(0)

    def reduce_scatter(self, x: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        return self.reduce_scatter_start(x, op)()

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return self.all_gather_start(x)()

    def all_gather_start(self, x: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Launch the collective; the returned function waits for it: ``[1, W*n]``."""
        self._check_rows(x, "all_gather")
        if x.dim() != 2:
            raise ValueError(f"all_gather: expected shape [R, n], got {tuple(x.shape)}")
        if not _eager() and self.all_gather_via == "point_to_point" and self.world_size > 1:
            out = torch.ops.fzero.all_gather_point_to_point(x[0].contiguous(), self.world_size, self._name,
                                                            self.timeout or 0.0)
            return lambda: out.unsqueeze(0)
        if not _eager():
            started = _all_gather(x[0].contiguous(), 0, self._name)
            return lambda: self._finish(started, "sum").unsqueeze(0)

        def alone() -> Callable[[], torch.Tensor]:
            out = scratch.empty((self.world_size * x.shape[1],), x.dtype, x.device)
            sent = x[0].contiguous()
            work = self._gather_into(out, sent)
            # what is sent is kept until the wait (see _waiter): a stage-3 step's memory then
            # does not depend on when gloo's thread lets it go
            return _waiter(work, lambda: out.unsqueeze(0), self._bound(f"all_gather of {out.numel()} {out.dtype}"),
                           sent)

        if self._batch is not None:  # every rank receives this rank's row
            return self._batch.add(_Part(x[0].expand(self.world_size, x.shape[1]),
                                         lambda got: scratch.reshaped(got, (1, got.numel())), alone, GATHER))
        return alone()

    def all_gather_into_start(self, x: torch.Tensor, out: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Eagerly, c10d gathers straight into ``out`` (no buffer of its size allocated);
        traced, the point-to-point operator writes it, or the functional gather's result is
        copied into it."""
        self._check_into(x, out)
        if not _eager() and self.all_gather_via == "point_to_point" and self.world_size > 1 \
                and out.is_contiguous():
            torch.ops.fzero.gather_point_to_point(out[0], x[0].contiguous(), self._name, self.timeout or 0.0)
            return lambda: out
        if not _eager() or self._batch is not None or not out.is_contiguous():
            started = self.all_gather_start(x)
            return lambda: out.copy_(started())
        sent = x[0].contiguous()
        work = self._gather_into(out[0], sent)
        return _waiter(work, lambda: out, self._bound(f"all_gather of {out[0].numel()} {out.dtype}"), sent)

    def traced_gather_into_many(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """On gloo's point-to-point path: every ``(x, out)`` gathered by one operator,
        ``fzero::gather_point_to_point_many`` (each group's sends and receives started before
        any is waited for)."""
        if self.all_gather_via != "point_to_point" or self.world_size == 1 \
                or not all(o.is_contiguous() and o.shape[0] == 1 for _, o in pairs):
            return False
        for x, out in pairs:
            self._check_into(x, out)
        torch.ops.fzero.gather_point_to_point_many([o[0] for _, o in pairs], [x[0].contiguous() for x, _ in pairs],
                                                   self._name, self.timeout or 0.0)
        return True

    def _gather_into(self, out: torch.Tensor, sent: torch.Tensor) -> Any:
        """Start the eager all-gather of ``sent`` into ``out`` (``[W * n]``) the way
        ``all_gather_via`` says; its work."""
        if self.all_gather_via == "point_to_point" and self.world_size > 1:
            self._sent_tags = (self._sent_tags + 1) % (1 << 30)
            return _point_to_point_gather(out, sent, self._pg, self.rank, self.world_size, self._sent_tags)
        return _c10d_all_gather(out, sent, group=self._pg, async_op=True)

    def reduction_footprint(self, numel: int, op: ReduceOp = "sum",
                            via_all_reduce: bool = False) -> ReductionFootprint:
        """Eagerly (measured by ``tests/dist_cases.py``'s census case on gloo): the
        ``all_to_all`` path receives every rank's chunk for this rank in a buffer of the
        input's size and sums it into the result when waited for; ``all_reduce`` reduces a
        copy in place (c10d) and then takes this rank's chunk (with ``sum``, a view of the
        copy: the whole copy is kept); the backend's own allocates the result when it starts,
        and gloo also copies the input until it is done."""
        world = self.world_size
        n = numel // world
        if world == 1:
            return ReductionFootprint(0, numel, result_first=True)
        if via_all_reduce or self.reduce_scatter_via == "all_reduce":
            # the copy is what travels: nothing keeps the input
            if via_all_reduce or op == "avg":
                return ReductionFootprint(held=numel, result=n, keeps_input=False)
            return ReductionFootprint(0, numel, result_first=True, keeps_input=False)
        if self.reduce_scatter_via == "all_to_all":
            return ReductionFootprint(held=numel, result=n)
        return ReductionFootprint(held=numel if self.backend == "gloo" else 0, result=n, result_first=True)

    def traced_reduction_footprint(self, numel: int, via_all_reduce: bool = False) -> Optional[tuple[int, int]]:
        """On gloo, where a traced reduction is one of fzero's operators: the received ``[numel]``
        (``fzero::reduce_scatter_all_to_all``, on the all-to-all path) or the copy that is
        all-reduced (``fzero::all_reduce_shard``), freed before it returns, and the result
        ``[numel / W]``. ``None`` on the other paths (measured only there)."""
        if self.backend != "gloo" or self.world_size == 1:
            return None
        if not via_all_reduce and self.reduce_scatter_via != "all_to_all":
            return None
        return numel, numel // self.world_size

    def traced_gather_footprint(self, numel: int) -> Optional[int]:
        """On gloo's point-to-point path (``fzero::all_gather_point_to_point``): the result
        ``[W * numel]`` and nothing else; ``None`` on the functional all-gather."""
        if self.backend != "gloo" or self.world_size == 1 or self.all_gather_via != "point_to_point":
            return None
        return self.world_size * numel

    def gather_footprint(self, numel: int) -> Optional[GatherFootprint]:
        """Eagerly on gloo (measured by ``tests/census_stage3_worker.py``'s census): the result
        ``[W * numel]``; gloo's own all-gather (``all_gather_via="all_gather"``) also allocates
        a buffer of its size and frees it again while it starts, the point-to-point one
        nothing more; what is sent is kept until the wait (:func:`_waiter`). In a
        :meth:`batched` block (``reduce_scatter_via="all_to_all"``) it rides in the block's
        all-to-all. Other backends, and one rank alone: not measured (``None``)."""
        if self.backend != "gloo" or self.world_size == 1:
            return None
        total = self.world_size * numel
        return GatherFootprint(total, scratch=total if self.all_gather_via == "all_gather" else 0, keeps_input=True,
                               batched=self.reduce_scatter_via == "all_to_all")

    def reduce_scatter_start(self, x: torch.Tensor, op: ReduceOp = "sum") -> Callable[[], torch.Tensor]:
        """Launch the collective; the returned function waits for it and takes this rank's
        shard (``reduce_scatter`` calls it at once)."""
        self._check_rows(x, "reduce_scatter")
        if op not in ("sum", "avg"):
            raise ValueError("reduce_scatter supports 'sum' and 'avg'")
        n = self._chunk(x, "reduce_scatter")
        mine = slice(self.rank * n, (self.rank + 1) * n)
        if self.reduce_scatter_via == "all_reduce":
            # the whole sum is waited for before it is sliced (slicing first made the compiled
            # graph slower on gloo)
            reduced = self.all_reduce_start(x, "sum")
            return lambda: _average(reduced()[0, mine], op, self.world_size).unsqueeze(0)
        if self.reduce_scatter_via == "all_to_all":
            return self._reduce_scatter_all_to_all(x, op, n)
        if _eager():
            out = x.new_empty(n)
            sent = x[0].contiguous()
            work = _c10d_reduce_scatter(out, sent, dist.ReduceOp.SUM, group=self._pg, async_op=True)
            return _waiter(work, lambda: _average_owned(out, op, self.world_size).unsqueeze(0),
                           self._bound(f"reduce_scatter ({op}) of {x[0].numel()} {x.dtype}"), sent)
        started = funcol.reduce_scatter_tensor(x[0], "sum", 0, self._name)
        return lambda: self._finish(started, op).unsqueeze(0)

    def _reduce_scatter_all_to_all(self, x: torch.Tensor, op: ReduceOp, n: int) -> Callable[[], torch.Tensor]:
        """Rank ``k``'s chunk of every rank's ``x`` arrives at rank ``k`` (``[W, n]``, in rank
        order) and is summed there: ``sum(0)``, the kernel ``SimulatedWorld`` sums with."""
        world = self.world_size

        def summed(received: torch.Tensor) -> torch.Tensor:  # [W, n] or [W * n]
            total = received.reshape(world, n).sum(0) if world > 1 else received.reshape(n)
            # eagerly `total` is this call's own buffer: average it in place
            return (_average_owned if _eager() else _average)(total, op, world).unsqueeze(0)

        if not _eager() and self.backend == "gloo":
            out = torch.ops.fzero.reduce_scatter_all_to_all(x[0].contiguous(), world, op, self._name,
                                                            self.timeout or 0.0)
            return lambda: out.unsqueeze(0)
        if not _eager():
            started = funcol.all_to_all_single(x[0].contiguous(), None, None, self._name)
            return lambda: summed(funcol.wait_tensor(started))

        def alone() -> Callable[[], torch.Tensor]:
            out = scratch.empty((world * n,), x.dtype, x.device)
            sent = x[0].contiguous()
            work = dist.all_to_all_single(out, sent, group=self._pg, async_op=True)
            return _waiter(work, lambda: summed(out),
                           self._bound(f"reduce_scatter ({op}, as all_to_all_single) of {x[0].numel()} {x.dtype}"),
                           sent)

        if self._batch is not None:
            return self._batch.add(_Part(x[0].view(world, n), summed, alone, GRAD_REDUCTION))
        return alone()

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        self._check_rows(x, "broadcast")
        if not 0 <= src < self.world_size:
            raise ValueError(f"broadcast: src must be a rank in [0, {self.world_size}), got {src}")
        if self.timeout is not None and _eager():  # c10d's work, so that the wait is bounded
            out = x[0].contiguous().clone()
            work = dist.broadcast(out, group_src=src, group=self._pg, async_op=True)
            return _waiter(work, lambda: out, self._bound(f"broadcast of {out.numel()} {out.dtype}"))().unsqueeze(0)
        # the functional op takes the rank within the group (the process group's root rank)
        out = funcol.broadcast(x[0].contiguous(), src, self._name)
        return funcol.wait_tensor(out).unsqueeze(0)

    def check_layout(self, layout: Layout) -> None:
        """Raise :class:`LayoutMismatchError` on every rank unless all ranks built ``layout`` alike.

        One ``all_gather_object`` of the layout's description; every rank
        takes part whatever it built, so disagreement is an error, not a hang.
        """
        rows = layout.describe()
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, (layout.fingerprint, rows), group=self._pg)
        fingerprints = [g[0] for g in gathered]
        if len(set(fingerprints)) == 1:
            return
        odd = next(r for r, f in enumerate(fingerprints) if f != fingerprints[0])
        why = first_difference(gathered[0][1], gathered[odd][1])
        raise LayoutMismatchError(
            f"rank {self.rank}: ranks built different parameter layouts "
            f"(rank 0 vs rank {odd}: {why}); every rank must build the same model "
            "with the same trainable set, parameter groups, dtypes and alignment"
        )
