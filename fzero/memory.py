"""Memory accounting: training-state bytes per rank by kind, for a stage and world size.

What is counted is ZeRO's model of the training state (Rajbhandari et al.,
2020): compute-dtype parameters, the gradient buffer the optimizer consumes,
the fp32 master copy and the optimizer moments. With Adam and 16-bit
compute and communication it gives the paper's ``4Ψ + 12Ψ/N`` (stage 1),
``2Ψ + 14Ψ/N`` (stage 2) and ``16Ψ/N`` (stage 3) bytes, computed here on the
padded layout. ``padding`` says how much of that total is padding (averaged
over ranks), so ``total - padding`` is the formula on the real parameter count.

Each kind is split into what the :class:`~fzero.state.TrainState` *holds* between
steps and what lives only *inside* a step (``held`` and ``transient``; ``by_kind``
is their sum, the paper's model):

=====  ===========================================  ===========================================
stage  held between steps                           transient (inside a step only)
=====  ===========================================  ===========================================
1      full compute-dtype params; master, moments   full gradient buffer (reduce dtype)
       shards (``4Ψ + 12Ψ/N`` with Adam, 16-bit)    (``2Ψ``)
2      full compute-dtype params; master, moments   gradient shard (``2Ψ/N``)
       shards (``2Ψ + 12Ψ/N``)
3      master and moment shards only (``12Ψ/N``)    compute-dtype param shard and gradient
                                                    shard (``4Ψ/N``): the step casts the
                                                    master on the fly and reduces per unit
=====  ===========================================  ===========================================

Beside the paper's model, ``step_buffers`` predicts the step's own scratch memory by
the profiler scope it is allocated in (:mod:`fzero.scopes`), so a census can check
it: in stages 1-2 eagerly, ``fzero::grad_buckets``, the bucket buffers each rank's
gradients are copied into during backward: the :data:`~fzero.buckets.MAX_IN_FLIGHT`
``+ 1`` largest buckets of the compute dtype (two reductions under way and one
bucket filling; a bucket of one parameter that fills its flat group exactly takes
autograd's gradient on a real rank and needs no buffer). Given the communicator, the
buffers are replayed with the schedule below instead, which knows when a smaller
bucket reuses a larger one's buffer.

Given the communicator (``comm=``), also ``fzero::grad_reduction``: what the eager stage
1-2 gradient reductions allocate at their peak, the averaged shards so far (the paper's
transient gradient) with the receive buffers and copies of the reductions under way.
It replays the step's schedule (launches in reverse bucket order, at most
``MAX_IN_FLIGHT`` under way, casts to the reduce dtype, FSDP's divide factors, groups of
a bucket joined in one collective) with what one reduction allocates on that
communicator (:meth:`fzero.comm.Communicator.reduction_footprint`), for one micro-batch
per step. The same replay gives ``step_peak``: the step's gradient memory together
(bucket buffers, autograd's gradients of lone-parameter buckets, reductions) at its
peak, which on a real rank comes after backward, when the activations are gone: it is
what a census finds beside the state at the step's peak (162M parameters, gloo W=2,
stages 1-2: equal to 0.01 MiB).

Stage 3 eagerly, given the communicator: ``step_buffers`` predicts ``fzero::gather``
(the gathered parameters: the root and at most two units held, plus what the gather path
allocates beside them: the shards cast and joined to send, the received buffers, the
copies cutting a joined gather into its flat groups, prefetches and backward's regathers)
and ``fzero::grad_reduction`` (the simulated world's stacked rows and the reductions'
buffers), and ``step_peak`` both together, by a replay of the unit schedule
(:func:`_replay_stage3`; units are the layout's buckets, bucket 0 the root). Checked
against the census on the simulated world at W = 1, 2, 3 (``tests/test_census_stage3.py``:
units of unequal sizes, fp32 and bf16, a five-block GPT-2): the census is above the
prediction by the 64 bytes of the simulated all-gather's index scratch and the 0-d
scalars of an fp32 average, no more. The common schedule is assumed: a forward that calls
every unit once in bucket order (a chain of blocks), one micro-batch. On a real rank among
others (``TorchCommunicator`` on gloo, W > 1) the step runs another schedule, replayed by
:class:`_RankReplay`: each unit call's gather carries the call-check tag, and in backward a
unit's reduction and the gather of the unit two before it travel in one all-to-all
(``comm.batched()``), whose joined buffers are named ``fzero::grad_reduction``; what a
gather allocates is :meth:`~fzero.comm.Communicator.gather_footprint`'s. Checked against
the census on every rank at W = 2, 3 (``tests/test_census_stage3_gloo.py``, the same models):
equal to the byte but for the 12 bytes of an fp32 average's scalars, and what the census
cannot see freed (a buffer whose last reference gloo's own thread drops). Not predicted (no
entry): other backends and reduce paths than gloo's all-to-all, and on a real rank a unit
of several flat groups prefetched in a batch or of groups in several compute dtypes.

==========================  ===========  ===================================================
``step_buffers`` scope      stages       predicted
==========================  ===========  ===================================================
``fzero::grad_buckets``     1-2          always (the replay's pool, given ``comm``)
``fzero::grad_reduction``   1-2, 3       given ``comm`` (stage 3: the simulated world, gloo;
                                         compiled: stages 1-3, fp32, gloo)
``fzero::gather``           3            given ``comm`` (the simulated world, gloo;
                                         compiled: fp32, gloo)
==========================  ===========  ===================================================

Compiled (``compiled=True``), stages 1-2 in fp32 on one local rank, given a communicator whose
traced reductions are known (:meth:`~fzero.comm.Communicator.traced_reduction_footprint`:
gloo's operators, ``fzero.dist``): ``fzero::grad_reduction`` and ``step_peak`` by
:func:`_replay_compiled`, each flat group reduced as backward completes it, one at a time
(stage 1's all-reduce keeps only the rank's chunk: ``fzero::all_reduce_shard``, so its
buffers are stage 2's). Checked against the census on gloo W=2 (``tests/test_compiled_memory.py``,
and at 162M parameters: 457.17 and 604.54 MiB predicted, 457.17 and 604.55 counted). Compiled stage 3
in fp32 on one local rank that regathers, given a communicator whose traced gathers and
reductions are known (gloo's point-to-point and all-to-all operators): ``fzero::gather``,
the root and the largest unit, and ``fzero::grad_reduction``, the shards reduced so far
beside one flat group's received buffer and shard, units from the last to the first, then
the root (:func:`_compiled_stage3_scopes`; no ``step_peak``: the step's peak there holds
activations). Checked likewise: a GPT-2 of ``transformers``, and at 162M 322.17 and 604.92
MiB predicted and counted. Not predicted for compiled steps: 16-bit casts
(inductor writes them into buffers freed earlier in the graph), other communicators.

Not counted at all (they depend on the model and the batch, not on Ψ alone):
activations; deferring accumulation, the full local gradients. ``GatherTracker`` measures
the gathered parameters (``benchmarks/bench_zero3_memory.py``).

Imports: ``fzero.buckets``, ``fzero.comm``, ``fzero.layout``, ``fzero.optim``, ``fzero.precision``,
``fzero.scopes``, ``fzero.sharding``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Optional, Sequence, Union

import torch

from . import scratch
from .buckets import MAX_IN_FLIGHT, buckets_of
from .comm import Communicator, GatherFootprint, gradient_divide_factors
from .layout import FlatGroup, Layout
from .optim import Optimizer
from .precision import MixedPrecision
from .scopes import GATHER, GRAD_BUCKETS, GRAD_REDUCTION
from .sharding import LOW_PRECISION, travel_joined, reduces_joined

__all__ = ["MemoryReport", "memory_report", "zero_paper_bytes", "format_memory_table", "bucket_buffer_bytes",
           "reduction_buffer_bytes", "step_buffer_peak"]

KINDS = ("params", "grads", "master", "moments")


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Bytes per rank. ``by_kind``: params, grads, master, moments (padded buffers), the
    paper's model; ``held``: the part of each kind the state keeps between steps;
    ``transient``: the part that exists only inside a step (``held + transient ==
    by_kind`` for every kind); ``padding``: the part of the total that is padding,
    averaged over ranks; ``step_buffers``: the eager step's own scratch memory at its
    peak, by profiler scope (module doc), outside the paper's model; ``step_peak`` (given
    the communicator, stages 1-2): the peak of the eager step's gradient memory together,
    bucket buffers, lone-parameter gradients and reductions (:func:`step_buffer_peak`); at
    stage 3 the gathers and reductions together."""

    stage: int
    world_size: int
    num_params: int
    by_kind: dict[str, float]
    padding: float
    held: dict[str, float] = dataclasses.field(default_factory=dict)
    transient: dict[str, float] = dataclasses.field(default_factory=dict)
    step_buffers: dict[str, float] = dataclasses.field(default_factory=dict)
    step_peak: Optional[float] = None

    @property
    def total(self) -> float:
        return sum(self.by_kind.values())

    @property
    def held_total(self) -> float:
        """Bytes the training state holds between steps."""
        return sum(self.held.values())

    @property
    def transient_total(self) -> float:
        """Bytes of the paper's model that live only inside a step."""
        return sum(self.transient.values())


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def memory_report(
    layout: Layout,
    optimizer: Optimizer,
    *,
    stage: int,
    precision: MixedPrecision = MixedPrecision(),
    world_size: Optional[int] = None,
    local_ranks: int = 1,
    comm: Optional[Communicator] = None,
    compiled: bool = False,
) -> MemoryReport:
    """Training-state bytes per rank for ``layout``'s parameters.

    ``world_size`` re-lays the parameters for that many ranks (default: the
    layout's own). Full buffers are counted whole, sharded ones as one shard:
    parameters are full in stages 1-2 and sharded in stage 3; the gradient
    buffer (in ``precision.reduce_dtype``, default the master dtype) is full in
    stage 1 and sharded in stages 2-3; master and moments are always sharded.
    Held between steps: master and moments, and the parameters in stages 1-2;
    the rest is transient (see the module doc). ``local_ranks``: ranks this process
    simulates (:class:`~fzero.comm.SimulatedWorld`), which share their bucket buffers.
    ``comm``: the communicator the step runs on (its ``local_ranks`` then apply); with it,
    ``step_buffers`` also predicts the gradient reductions' buffers and, at stage 3, the
    gathered parameters (module doc). ``compiled=True``: the step is compiled (``step_buffers``
    and ``step_peak`` then predict the compiled step's reductions at stage 2, and its gathers
    and reductions at stage 3, in fp32 on one local rank, with a communicator that says what
    its traced collectives allocate: gloo's operators; nothing otherwise). No collective is
    called.
    """
    if comm is not None:
        local_ranks = comm.local_ranks
    if stage not in (1, 2, 3):
        raise ValueError(f"memory_report: stage must be 1, 2 or 3, got {stage!r}")
    if world_size is not None and world_size != layout.world_size:
        layout = layout.with_world_size(world_size)
    n = layout.world_size
    k = len(optimizer.moment_names)
    by_kind = dict.fromkeys(KINDS, 0.0)
    padding = 0.0
    for g in layout.groups:
        full, shard, pad = g.padded_numel, g.shard_numel, g.padding
        master = _size(g.master_dtype)
        rows = {
            "params": (_size(precision.compute_dtype(g)), stage == 3),
            "grads": (_size(precision.reduce_dtype or g.master_dtype), stage >= 2),
            "master": (master, True),
            "moments": (k * master, True),
        }
        for kind, (itemsize, sharded) in rows.items():
            by_kind[kind] += itemsize * (shard if sharded else full)
            padding += itemsize * (pad / n if sharded else pad)
    held = {kind: by_kind[kind] if _held(kind, stage) else 0.0 for kind in KINDS}
    transient = {kind: by_kind[kind] - held[kind] for kind in KINDS}
    buffers: dict[str, float] = {}
    step_peak = None
    if compiled and stage == 3:
        scopes = _compiled_stage3_scopes(layout, precision, comm) if comm is not None else None
        if scopes is not None:
            buffers[GATHER], buffers[GRAD_REDUCTION] = scopes
    elif compiled:
        replayed = _replay_compiled(layout, precision, comm, stage) if comm is not None else None
        if replayed is not None:
            buffers[GRAD_REDUCTION], step_peak = replayed
    elif stage < 3:
        buffers[GRAD_BUCKETS] = bucket_buffer_bytes(layout, precision, local_ranks)
        peaks = _replay_reductions(layout, precision, comm, stage) if comm is not None else None
        if peaks is not None:  # the replay knows which bucket buffers the pool reuses
            buffers[GRAD_BUCKETS], buffers[GRAD_REDUCTION], step_peak = peaks[2], peaks[0], peaks[1]
    elif comm is not None:
        three = _replay_stage3(layout, precision, comm)
        if three is not None:
            buffers[GATHER], buffers[GRAD_REDUCTION], step_peak = three
    return MemoryReport(stage, n, layout.num_params, by_kind, padding, held, transient, buffers, step_peak)


def bucket_buffer_bytes(layout: Layout, precision: MixedPrecision = MixedPrecision(), local_ranks: int = 1) -> float:
    """Per rank, the most bytes of gradient bucket buffers an eager stage 1-2 step holds at
    once: the ``MAX_IN_FLIGHT + 1`` largest buckets (``[local_ranks, padded]`` per flat group,
    in the compute dtype), without the buckets of one parameter that fills its flat group
    exactly on a real rank (autograd's gradient is reduced as it is)."""
    sizes = []
    for groups in buckets_of(layout):
        lone = local_ranks == 1 and len(groups) == 1 and len(groups[0].slots) == 1 and not groups[0].padding
        if groups and not lone:
            sizes.append(sum(_size(precision.compute_dtype(g)) * local_ranks * g.padded_numel for g in groups))
    return float(sum(sorted(sizes, reverse=True)[: MAX_IN_FLIGHT + 1])) / local_ranks


class _Heap:
    """Live bytes and their peak, for replaying a schedule of allocations; ``also``: another
    heap that sees the same allocations (and others of its own)."""

    def __init__(self, also: Optional["_Heap"] = None) -> None:
        self.live = self.peak = 0
        self.also = also

    def alloc(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        if self.also is not None:
            self.also.alloc(nbytes)

    def free(self, nbytes: int) -> None:
        self.live -= nbytes
        if self.also is not None:
            self.also.free(nbytes)


def reduction_buffer_bytes(
    layout: Layout, precision: MixedPrecision, comm: Communicator, *, stage: int
) -> Optional[float]:
    """Per rank, the peak bytes an eager stage 1-2 step's gradient reductions allocate
    (profiler scope ``fzero::grad_reduction``), or ``None`` when ``comm`` does not say what
    a reduction allocates. Replays :class:`fzero.buckets.BucketReduction`'s schedule for one
    micro-batch: launches in reverse bucket order, at most :data:`MAX_IN_FLIGHT` under way
    (starting another waits for the oldest); per launch :func:`fzero.sharding.
    average_flat_groups_start` (groups joined in one collective or one collective each, the
    cast to the reduce dtype, FSDP's divide factors in 16 bits, the cast of the result to
    the master dtype); per collective ``comm.reduction_footprint``."""
    peaks = _replay_reductions(layout, precision, comm, stage)
    return None if peaks is None else peaks[0]


def step_buffer_peak(
    layout: Layout, precision: MixedPrecision, comm: Communicator, *, stage: int
) -> Optional[float]:
    """Per rank, the peak bytes of everything an eager stage 1-2 step allocates for its
    gradients, together: the bucket buffers (:class:`fzero.buckets.BufferPool`: a free
    buffer that fits is reused, at most ``MAX_IN_FLIGHT + 1`` kept), autograd's gradient of
    a parameter that is a bucket by itself (kept until its reduction is waited for), and
    what the reductions allocate (:func:`reduction_buffer_bytes`). Activations are not in
    it (backward frees them as it goes: at the step's peak, after backward, they are
    gone). ``None`` when ``comm`` does not say what a reduction allocates."""
    peaks = _replay_reductions(layout, precision, comm, stage)
    return None if peaks is None else peaks[1]


class _Pool:
    """:class:`fzero.buckets.BufferPool`'s choices, replayed on a heap: sizes only."""

    def __init__(self, heap: "_Heap", limit: int = MAX_IN_FLIGHT + 1):
        self.heap, self.limit, self.free = heap, limit, []  # free: (numel, itemsize)

    def take(self, numel: int, itemsize: int) -> tuple[int, int]:
        fits = [b for b in self.free if b[0] >= numel and b[1] == itemsize]
        if fits:
            got = min(fits)
            self.free.remove(got)
            return got
        self.heap.alloc(numel * itemsize)
        return numel, itemsize

    def give(self, buf: tuple[int, int]) -> None:
        self.free.append(buf)
        if len(self.free) > self.limit:
            drop = min(self.free)
            self.free.remove(drop)
            self.heap.free(drop[0] * drop[1])


class _Started(NamedTuple):
    """A reduction under way in :func:`_replay_reductions`. ``wait``: what its wait does, in
    order: bytes allocated (results), freed (what was sent), allocated (divided and cast
    results), freed (receive buffers, results divided or cast away); ``result``: the bytes of
    its result before any cut; ``keeps_input``: the communicator keeps what is sent until the
    wait; ``sends_input``: what is sent is the caller's own tensor, not a copy."""

    wait: tuple[list[int], list[int], list[int], list[int]]
    result: int
    keeps_input: bool
    sends_input: bool


def _after_the_sum(result: int, shard: int, rdtype: torch.dtype, out_dtype: torch.dtype,
                   world: int) -> list[tuple[int, int]]:
    """What a reduction's result goes through once summed, as ``(bytes made, bytes dropped)``
    in order: in 16 bits the division by FSDP's post-factor (a new ``shard``-element buffer),
    then the cast to ``out_dtype``; ``result``: the summed result's bytes."""
    steps = []
    if rdtype in LOW_PRECISION and gradient_divide_factors(world)[1] > 1:
        steps.append((shard * _size(rdtype), result))
        result = shard * _size(rdtype)
    if out_dtype != rdtype:
        steps.append((shard * _size(out_dtype), result))
    return steps


def _collective(heap: "_Heap", comm: Communicator, stage: int, numel: int, in_dtype: torch.dtype,
                rdtype: torch.dtype, out_dtype: torch.dtype) -> Optional[_Started]:
    """Start one reduction of a ``[R, numel]`` flat gradient in ``in_dtype`` (its
    allocations replayed now): what its wait does (:class:`_Started`)."""
    rows, world = comm.local_ranks, comm.world_size
    pre, _ = gradient_divide_factors(world)
    low = rdtype in LOW_PRECISION
    fp = comm.reduction_footprint(numel, "sum" if low else "avg", via_all_reduce=stage == 1)
    if fp is None:
        return None
    size, shard = _size(rdtype), rows * numel // world
    send = 0
    if in_dtype != rdtype:
        send = rows * numel * size
        heap.alloc(send)
    if low and pre > 1:  # divided into a new buffer; the cast (if any) is dropped
        heap.alloc(rows * numel * size)
        heap.free(send)
        send = rows * numel * size
    heap.alloc(fp.held * size)
    if fp.result_first:
        heap.alloc(fp.result * size)
    heap.alloc(fp.scratch * size)
    heap.free(fp.scratch * size)
    if not fp.keeps_input:
        heap.free(send)
        send = 0
    results = [] if fp.result_first else [fp.result * size]
    then, rest = [], [fp.held * size]
    result = fp.result * size
    for made, dropped in _after_the_sum(result, shard, rdtype, out_dtype, world):
        then.append(made)
        rest.append(dropped)
        result = made
    # whether the collective keeps the caller's own tensor (not a copy) until the wait
    sends_input = fp.keeps_input and in_dtype == rdtype and not (low and pre > 1)
    return _Started((results, [send], then, rest), result, fp.keeps_input, sends_input)


def _replay_reductions(
    layout: Layout, precision: MixedPrecision, comm: Communicator, stage: int
) -> Optional[tuple[float, float, float]]:
    """The replay behind :func:`reduction_buffer_bytes` and :func:`step_buffer_peak`: per
    rank, the peak of the reductions' own allocations, the peak of those together with the
    bucket buffers and lone-parameter gradients, and the peak of the bucket buffers."""
    rows, world = comm.local_ranks, comm.world_size
    pre, post = gradient_divide_factors(world)
    every = _Heap()  # the reductions' allocations and the gradients' buffers together
    heap = _Heap(also=every)
    pool = _Pool(_Heap(also=every))
    # Per launch under way, what its wait does, in order: allocate the results, free what was
    # sent (the communicator keeps it until then), allocate the divided and cast results,
    # free the rest (receive buffers, results cast or divided away).
    started: list[tuple[list[int], list[int], list[int], list[int]]] = []

    grads: list[tuple[list[tuple[int, int]], int]] = []  # per launch under way: pool buffers, a lone gradient

    def wait_oldest() -> None:
        for phase, nbytes in zip((heap.alloc, heap.free, heap.alloc, heap.free), started.pop(0)):
            for b in nbytes:
                phase(b)
        buffers, lone = grads.pop(0)
        for buf in buffers:
            pool.give(buf)
        every.free(lone)

    def gradient(groups: Sequence[FlatGroup]) -> tuple[list[tuple[int, int]], int]:
        """A bucket's gradient: autograd's own for a lone parameter filling its group on a
        real rank (:class:`fzero.buckets.BucketWatcher`), else a pool buffer per group."""
        if rows == 1 and len(groups) == 1 and len(groups[0].slots) == 1 and not groups[0].padding:
            nbytes = groups[0].padded_numel * _size(precision.compute_dtype(groups[0]))
            every.alloc(nbytes)
            return [], nbytes
        return [pool.take(rows * g.padded_numel, _size(precision.compute_dtype(g))) for g in groups], 0

    order = [gs for gs in reversed(buckets_of(layout)) if gs]
    # Several local ranks run their backward one after another: the first one reaches every
    # bucket before any is complete, so all take their buffers before the first launch.
    # One rank: a bucket takes its buffers as backward reaches it, before the launch that
    # waits for the oldest.
    taken = [gradient(gs) for gs in order] if rows > 1 else []
    for i, groups in enumerate(order):
        grads.append(taken[i] if taken else gradient(groups))
        while len(started) >= MAX_IN_FLIGHT:
            wait_oldest()
        if reduces_joined(groups, precision.reduce_dtype):
            rdtype = precision.reduce_dtype or groups[0].master_dtype
            joined = rows * sum(g.padded_numel for g in groups) * _size(rdtype)
            casts = sum(rows * g.padded_numel * _size(rdtype)
                        for g in groups if precision.compute_dtype(g) != rdtype)
            heap.alloc(casts)  # each group cast, then joined
            heap.alloc(joined)
            heap.free(casts)
            one = _collective(heap, comm, stage, sum(g.padded_numel for g in groups), rdtype, rdtype, rdtype)
            if one is None:
                return None
            results, sent, then, rest = one.wait
            if (rdtype in LOW_PRECISION and pre > 1) or not one.keeps_input:
                heap.free(joined)  # the divided copy travels instead, or nothing keeps it
            else:
                sent.append(joined)
            # each group's shard cut back out: a view, or a copy in its master dtype
            cast = [rows * g.shard_numel * _size(g.master_dtype) for g in groups if g.master_dtype != rdtype]
            then += cast
            if len(cast) == len(groups):
                rest.append(one.result)
            started.append((results, sent, then, rest))
            continue
        phases: tuple[list[int], list[int], list[int], list[int]] = ([], [], [], [])
        for g in groups:
            one = _collective(heap, comm, stage, g.padded_numel, precision.compute_dtype(g),
                             precision.reduce_dtype or g.master_dtype, g.master_dtype)
            if one is None:
                return None
            for mine, theirs in zip(phases, one.wait):
                mine += theirs
            if grads[-1][1] and not one.sends_input:
                # nothing keeps the lone parameter's gradient once its reduction has started
                every.free(grads[-1][1])
                grads[-1] = (grads[-1][0], 0)
        started.append(phases)
    while started:
        wait_oldest()
    return float(heap.peak) / rows, float(every.peak) / rows, float(pool.heap.peak) / rows


def _all_fp32(layout: Layout, precision: MixedPrecision) -> bool:
    """Whether every flat group computes, reduces and keeps its master copy in fp32: the only
    compiled steps replayed (in 16 bits inductor writes casts into buffers freed earlier in the
    graph, which a replay of the traced code does not see)."""
    dtypes = {precision.reduce_dtype or g.master_dtype for g in layout.groups} | \
        {precision.compute_dtype(g) for g in layout.groups} | {g.master_dtype for g in layout.groups}
    return dtypes == {torch.float32}


def _replay_compiled(layout: Layout, precision: MixedPrecision, comm: Communicator,
                     stage: int) -> Optional[tuple[float, float]]:
    """A compiled stage-1 or -2 step in fp32 on one local rank, when ``comm`` says what a traced
    reduction allocates (:meth:`~fzero.comm.Communicator.traced_reduction_footprint`: gloo's
    operators): per rank, the peak of ``fzero::grad_reduction`` (what the reductions
    allocate) and ``step_peak``, the step's gradient memory together at its peak; else
    ``None``.

    The schedule (measured on gloo, module doc): backward completes the flat groups from the
    last to the first, and each is reduced as soon as it is complete, one reduction at a time.
    A group's parameters' gradients are cut into its flat buffer (both live while the cut
    runs; a group of one unpadded parameter is its gradient), reduced, and the flat buffer
    dropped; the shard stays. Small groups are joined first
    (:func:`fzero.sharding.reduces_joined`): every group's gradients, one joined buffer, one
    reduction, each group's shard a view of its result."""
    if comm.local_ranks != 1 or stage == 3 or not _all_fp32(layout, precision):
        return None
    size = _size(torch.float32)
    every = _Heap()
    red = _Heap(also=every)

    def reduce(numel: int, send: int) -> bool:
        fp = comm.traced_reduction_footprint(numel, via_all_reduce=stage == 1)
        if fp is None:
            return False
        received, result = fp
        red.alloc(received * size)  # received, freed before the operator returns
        red.alloc(result * size)  # this rank's shard, kept
        red.free(received * size)
        every.free(send)
        return True

    groups = list(layout.groups)
    if reduces_joined(groups, precision.reduce_dtype):
        params = sum(layout.slots[i].numel for g in groups for i in g.slots) * size
        joined = sum(g.padded_numel for g in groups) * size
        every.alloc(params)
        every.alloc(joined)
        every.free(params)
        if not reduce(sum(g.padded_numel for g in groups), joined):
            return None
        return float(red.peak), float(every.peak)
    for g in reversed(groups):
        flat = g.padded_numel * size
        if len(g.slots) > 1 or g.padding:
            params = sum(layout.slots[i].numel for i in g.slots) * size
            every.alloc(params)
            every.alloc(flat)
            every.free(params)
        else:
            every.alloc(flat)
        if not reduce(g.padded_numel, flat):
            return None
    return float(red.peak), float(every.peak)


def _compiled_stage3_scopes(layout: Layout, precision: MixedPrecision,
                            comm: Communicator) -> Optional[tuple[float, float]]:
    """A compiled stage-3 step in fp32 on one local rank that regathers (one micro-batch), with a
    communicator whose traced reductions and gathers are known (gloo's operators): per rank,
    the peaks of ``fzero::gather`` and ``fzero::grad_reduction``, or ``None``.

    The graph runs in its traced order (``fzero.compiled`` turns inductor's reordering off
    for it): the root's groups gathered first and held, each unit's groups gathered for its
    forward and again for its backward, one unit at a time; each flat group reduced by one
    operator (the received buffer, freed inside it, and the result, which is the gradient
    shard the optimizer reads at the end). So the gathers' peak is the root and the largest
    unit; the reductions', as backward reduces the units from the last to the first and then
    the root, the shards reduced so far beside one group's received buffer and shard."""
    if comm.local_ranks != 1 or not _all_fp32(layout, precision):
        return None
    size = _size(torch.float32)
    received = [comm.traced_reduction_footprint(g.padded_numel) for g in layout.groups]
    gathered = [comm.traced_gather_footprint(g.shard_numel) for g in layout.groups]
    if any(r is None for r in received) or any(n is None for n in gathered):
        return None
    units: dict[int, int] = {}
    for g, n in zip(layout.groups, gathered):
        units[g.bucket] = units.get(g.bucket, 0) + n * size
    root = units.pop(0, 0)
    gathers = root + max(units.values(), default=0)
    groups = layout.groups
    order = sorted(range(len(groups)), key=lambda i: (groups[i].bucket == 0, -groups[i].bucket, -i))
    kept = reductions = 0
    for i in order:
        got, shard = received[i]  # type: ignore[misc]
        reductions = max(reductions, kept + (got + shard) * size)
        kept += shard * size
    return float(gathers), float(reductions)


class _Buf:
    """A replayed buffer freed when its last holder lets it go."""

    def __init__(self, heap: Union[_Heap, "_Spares"], nbytes: int, holders: int = 1):
        self.heap, self.nbytes, self.holders = heap, nbytes, holders
        heap.alloc(nbytes)

    def drop(self) -> None:
        self.holders -= 1
        if self.holders == 0:
            self.heap.free(self.nbytes)


def _replay_stage3(
    layout: Layout, precision: MixedPrecision, comm: Communicator
) -> Optional[tuple[float, float, float]]:
    """The eager stage-3 step of one micro-batch, replayed (:mod:`fzero.units`), per rank: the
    peak of the gathers' allocations (``fzero::gather``), of the gradient reductions'
    (``fzero::grad_reduction``) and of both together. ``None`` where ``comm`` does not say
    what a gather or a reduction allocates. A real rank among others runs another schedule
    (call-check tags, batched collectives): :func:`_replay_stage3_rank`.

    The schedule assumed is the common one: the forward calls every unit once, in bucket
    order (a chain of blocks, GPT-2/Llama style), and backward completes them in reverse. A
    model that calls units out of order, twice, or not at all prefetches other units (the
    prediction of the next unit is then wrong, and the gather is waited for where it is
    needed), which this replay does not follow."""
    rows, world = comm.local_ranks, comm.world_size
    if rows == 1 and world > 1:
        return _replay_stage3_rank(layout, precision, comm)
    buckets = buckets_of(layout)
    n = len(buckets)  # the root (bucket 0) and the units 1 .. n - 1
    if n < 2 or any(not gs for gs in buckets[1:]):
        return None
    every = _Heap()
    gheap, rheap = _Heap(also=every), _Heap(also=every)

    def csize(g: FlatGroup) -> int:
        return _size(precision.compute_dtype(g))

    def received(numel: int, g: FlatGroup) -> Optional[int]:
        got = comm.gather_footprint(numel)
        return None if got is None else got.received * csize(g)

    def start(bs: Sequence[int]) -> Optional[dict[int, Callable[[], list[_Buf]]]]:
        """:func:`fzero.units._start_gather` of buckets ``bs``: per bucket, its take (the
        buffers its flats hold)."""
        groups = [g for b in bs for g in buckets[b]]
        if len(groups) == 1 or len({precision.compute_dtype(g) for g in groups}) != 1 \
                or not travel_joined(groups):
            per = {}
            for g in groups:
                cast = rows * g.shard_numel * csize(g) if precision.compute_dtype(g) != g.master_dtype else 0
                gheap.alloc(cast)
                got = received(g.shard_numel, g)
                if got is None:
                    return None
                per[g.index] = _Buf(gheap, got)
                gheap.free(cast)
            return {b: (lambda b=b: [per[g.index] for g in buckets[b]]) for b in bs}
        casts = [rows * g.shard_numel * csize(g) for g in groups if precision.compute_dtype(g) != g.master_dtype]
        for c in casts:
            gheap.alloc(c)
        sent = rows * sum(g.shard_numel for g in groups) * csize(groups[0])
        gheap.alloc(sent)
        for c in casts:
            gheap.free(c)
        got = received(sum(g.shard_numel for g in groups), groups[0])
        if got is None:
            return None
        whole = _Buf(gheap, got, holders=len(bs))  # the closures of buckets not taken yet
        gheap.free(sent)
        copies: dict[int, _Buf] = {}

        def take(b: int) -> list[_Buf]:
            if not copies:  # the first take cuts every group out
                for g in groups:
                    if rows * world > 1:
                        copies[g.index] = _Buf(gheap, rows * g.padded_numel * csize(g))
                    else:  # a view of the received buffer
                        whole.holders += 1
                        copies[g.index] = whole
            whole.drop()
            return [copies[g.index] for g in buckets[b]]

        return {b: (lambda b=b: take(b)) for b in bs}

    def drop(flats: list[_Buf]) -> None:
        for f in flats:
            f.drop()

    # -- the reductions (fzero.buckets.BucketReduction, launches (0, 1), (2,), ..., (n - 1,))
    started: list[tuple[list[int], list[int], list[int], list[int]]] = []
    rdtype_of = {g.index: precision.reduce_dtype or g.master_dtype for gs in buckets for g in gs}
    _, post = gradient_divide_factors(world)

    def wait_oldest() -> None:
        for phase, nbytes in zip((rheap.alloc, rheap.free, rheap.alloc, rheap.free), started.pop(0)):
            for b in nbytes:
                phase(b)

    def launch(bs: Sequence[int]) -> bool:
        while len(started) >= MAX_IN_FLIGHT:
            wait_oldest()
        groups = [g for b in bs for g in buckets[b]]
        # each group's rows stacked (one rank: a view of its gradient)
        stacks = [rows * g.padded_numel * csize(g) if rows > 1 else 0 for g in groups]
        for st in stacks:
            rheap.alloc(st)
        kept: list[int] = []
        if reduces_joined(groups, precision.reduce_dtype):
            rdtype = rdtype_of[groups[0].index]
            pre = gradient_divide_factors(world)[0]
            joined = rows * sum(g.padded_numel for g in groups) * _size(rdtype)
            casts = sum(rows * g.padded_numel * _size(rdtype)
                        for g in groups if precision.compute_dtype(g) != rdtype)
            rheap.alloc(casts)
            rheap.alloc(joined)
            rheap.free(casts)
            one = _collective(rheap, comm, 3, sum(g.padded_numel for g in groups), rdtype, rdtype, rdtype)
            if one is None:
                return False
            results, sent, then, rest = one.wait
            cast = [rows * g.shard_numel * _size(g.master_dtype) for g in groups if g.master_dtype != rdtype]
            then += cast
            if world == 1 and not one.result:
                # the identity: the joined gradient is the result, kept until each group is cut
                # out of it in its master dtype (or to the end: the shards view it)
                rest.append(joined if len(cast) == len(groups) else 0)
            else:
                if (rdtype in LOW_PRECISION and pre > 1) or not one.keeps_input:
                    rheap.free(joined)
                else:
                    sent.append(joined)
                if len(cast) == len(groups):
                    rest.append(one.result)
            phases = (results, sent, then, rest)
        else:
            phases = ([], [], [], [])
            for i, g in enumerate(groups):
                one = _collective(rheap, comm, 3, g.padded_numel, precision.compute_dtype(g),
                                  rdtype_of[g.index], g.master_dtype)
                if one is None:
                    return False
                for mine, theirs in zip(phases, one.wait):
                    mine += theirs
                if one.sends_input and stacks[i]:  # the stack itself travels: kept until the wait
                    phases[1].append(stacks[i])
                    kept.append(i)
        for i, st in enumerate(stacks):
            if i not in kept:
                rheap.free(st)
        started.append(phases)
        return True

    # -- each local rank's forward and backward in turn (fzero.units._RankRun)
    root_before: Optional[list[_Buf]] = None
    for r in range(rows):
        ahead = start((0, 1))  # the root travels with the first unit
        if ahead is None:
            return None
        cache: dict[int, list[_Buf]] = {}
        root = ahead.pop(0)()
        if root_before is not None:  # the previous rank's root, held until this one's arrived
            drop(root_before)
        for b in range(1, n):
            keep = b == n - 1 or b == n - 2
            if b + 1 < n:  # the unit predicted next
                nxt = start((b + 1,))
                if nxt is None:
                    return None
                ahead.update(nxt)
            flats = ahead.pop(b)()
            if keep:
                cache[b] = flats
            else:  # saved as tokens: nothing holds the unit after its forward
                drop(flats)

        def held(b: int) -> bool:
            return b in cache or b in ahead

        def prefetch(b: int) -> bool:
            if b >= 1 and not held(b):
                got = start((b,))
                if got is None:
                    return False
                ahead.update(got)
            return True

        for b in range(n - 1, 0, -1):
            if b not in cache:  # regathered (prefetched) for its backward
                cache[b] = ahead.pop(b)() if b in ahead else start((b,))[b]()  # type: ignore[index]
            if not prefetch(b - 1):
                return None
            drop(cache.pop(b))  # its gradient is complete: dropped, its reduction started
            if r == rows - 1 and b >= 2 and not launch((b,)):
                return None
            if b >= 3 and held(b - 1) and not prefetch(b - 2):
                return None
        # the root's gradient and the first unit's travel together, once both are complete
        if r == rows - 1 and not launch((0, 1)):
            return None
        root_before = root
    while started:
        wait_oldest()
    return float(gheap.peak) / rows, float(rheap.peak) / rows, float(every.peak) / rows


class _Chain:
    """Buffers a started gather's closures hold until every bucket it carries was taken (the
    received buffer; the flats cut out of it); each buffer keeps its own holders beside."""

    def __init__(self, takes: int):
        self.takes = takes
        self.bufs: list[_Buf] = []

    def hold(self, buf: _Buf) -> _Buf:
        buf.holders += 1
        self.bufs.append(buf)
        return buf

    def taken(self) -> None:
        self.takes -= 1
        if self.takes == 0:
            for b in self.bufs:
                b.drop()


class _Spares:
    """:class:`fzero.scratch.ScratchPool` replayed on sizes, over ``heap``: a freed buffer of at
    least ``scratch.MIN_BYTES`` stays allocated as a spare (at most ``scratch.PER_SIZE`` of one
    size) until an allocation of its size takes it, or :meth:`release`."""

    def __init__(self, heap: _Heap):
        self.heap, self.per_size, self.min_bytes = heap, scratch.PER_SIZE, scratch.MIN_BYTES
        self.spare: dict[int, int] = {}

    def alloc(self, nbytes: int) -> None:
        if nbytes >= self.min_bytes and self.spare.get(nbytes, 0):
            self.spare[nbytes] -= 1
            return
        self.heap.alloc(nbytes)

    def free(self, nbytes: int) -> None:
        if nbytes >= self.min_bytes and self.spare.get(nbytes, 0) < self.per_size:
            self.spare[nbytes] = self.spare.get(nbytes, 0) + 1
            return
        self.heap.free(nbytes)

    def release(self) -> None:
        """The pool's ``release_free`` at the end of backward: every spare goes."""
        for nbytes, k in self.spare.items():
            for _ in range(k):
                self.heap.free(nbytes)
        self.spare.clear()


class _Joint:
    """A batch's joined all-to-all (:meth:`fzero.dist.TorchCommunicator.batched`), replayed: the
    send buffer goes at the first wait of its collectives, the receive buffer once every one
    has been waited for and let go (both into the step's scratch pool: ``heap`` a
    :class:`_Spares`)."""

    def __init__(self, heap: Union[_Heap, _Spares], nbytes: int, parts: int):
        self.heap, self.nbytes, self.sent = heap, nbytes, True
        heap.alloc(nbytes)
        self.received = _Buf(heap, nbytes, holders=parts)

    def waited(self) -> None:
        if self.sent:
            self.heap.free(self.nbytes)
            self.sent = False


class _Part:
    """One collective of a replayed batch: its dtype, the bytes of its rows in a joined
    all-to-all, what it allocates started alone, and the joint it travels in, once issued."""

    def __init__(self, dtype: torch.dtype, nbytes: int, alone: Callable[[], None]):
        self.dtype, self.nbytes, self.alone = dtype, nbytes, alone
        self.joint: Optional[_Joint] = None


# the call-check tag: three int64 values, one element per byte (fzero.units._encode_tag)
_TAG_VALUES = 3

_Take = Callable[[], list[_Buf]]


class _Unknown(Exception):
    """What the replay of a real rank's step does not model, or the communicator does not say."""


def _replay_stage3_rank(
    layout: Layout, precision: MixedPrecision, comm: Communicator
) -> Optional[tuple[float, float, float]]:
    """:func:`_replay_stage3` on a real rank among others (``local_ranks == 1``, ``W > 1``):
    :class:`_RankReplay`. ``None`` where the communicator does not say what a gather or a
    reduction allocates, or does not batch them (only gloo's all-to-all path is replayed:
    the reduction's input is kept by the batch until its wait), or the layout needs what the
    replay does not model (a unit of several flat groups prefetched in a batch, groups of
    several compute dtypes in a unit)."""
    buckets = buckets_of(layout)
    fp = comm.gather_footprint(1)
    if len(buckets) < 3 or any(not gs for gs in buckets) or fp is None or not fp.batched:
        return None
    replay = _RankReplay(buckets, precision, comm)
    try:
        replay.run()
    except _Unknown:
        return None
    return float(replay.gheap.peak), float(replay.rheap.peak), float(replay.every.peak)


class _RankReplay:
    """:class:`fzero.units._RankRun` on one real rank, replayed for one micro-batch: its forward
    with the call-check carriers (a unit's call checks the previous carrier's tags and starts
    the tagged gather of the next unit; the last unit's call defers its tag to the end's), its
    backward with a unit's reduction and the gather of the unit two before it in one batch
    (``comm.batched()``; on gloo one all-to-all per dtype). What a gather allocates is
    ``comm.gather_footprint``'s (:class:`~fzero.comm.GatherFootprint`), a reduction
    ``comm.reduction_footprint``'s."""

    def __init__(self, buckets: Sequence[Sequence[FlatGroup]], precision: MixedPrecision, comm: Communicator):
        self.buckets, self.precision, self.comm = buckets, precision, comm
        self.n, self.world = len(buckets), comm.world_size
        self.every = _Heap()
        self.gheap, self.rheap = _Heap(also=self.every), _Heap(also=self.every)
        self.joints = _Spares(self.rheap)  # the joined all-to-alls' buffers, reused (fzero.scratch)
        self.batch: Optional[list[_Part]] = None  # the parts of the batch under way
        self.started: list[list[tuple[Callable[[], None], Callable[[], None]]]] = []  # reductions
        self.ahead: dict[int, _Take] = {}  # started gathers by bucket
        self.cache: dict[int, list[_Buf]] = {}  # units kept or regathered
        self.events: list[int] = []  # the forward's unit calls; 0: its end
        self.pending: list[Callable[[], None]] = []  # the last carrier's tags, not yet checked
        self.deferred = False

    # -- what the communicator allocates
    def cdtype(self, g: FlatGroup) -> torch.dtype:
        return self.precision.compute_dtype(g)

    def footprint(self, numel: int) -> GatherFootprint:
        fp = self.comm.gather_footprint(numel)
        if fp is None:
            raise _Unknown
        return fp

    def add(self, part: _Part) -> None:
        """A collective started: into the batch under way, or at once."""
        if self.batch is None:
            part.alone()
        else:
            self.batch.append(part)

    def batched(self, body: Callable[[], None]) -> None:
        """``body`` in a batch; at its end the parts go, one all-to-all per dtype (a part alone
        in its dtype is started alone), named by the reduction (:mod:`fzero.dist`)."""
        self.batch = []
        body()
        parts, self.batch = self.batch, None
        by_dtype: dict[torch.dtype, list[_Part]] = {}
        for p in parts:
            by_dtype.setdefault(p.dtype, []).append(p)
        for group in by_dtype.values():
            if len(group) == 1:
                group[0].alone()
                continue
            joint = _Joint(self.joints, sum(p.nbytes for p in group), len(group))
            for p in group:
                p.joint = joint

    # -- the gathers (fzero.units._start_gather, _start_tagged)
    def gather_alone(self, numel: int, itemsize: int, chain: _Chain) -> _Buf:
        """One ``all_gather_start`` of ``numel`` elements outside a batch: its result, held by
        the started gather's closures (``chain``)."""
        fp = self.footprint(numel)
        out = chain.hold(_Buf(self.gheap, fp.received * itemsize, holders=0))
        self.gheap.alloc(fp.scratch * itemsize)
        self.gheap.free(fp.scratch * itemsize)
        return out

    def plain(self, bs: Sequence[int]) -> dict[int, _Take]:
        """:func:`fzero.units._start_gather` of buckets ``bs`` outside a batch: per bucket, its
        take (the buffers its flats hold)."""
        groups = [g for b in bs for g in self.buckets[b]]
        chain = _Chain(len(bs))
        flats: dict[int, _Buf] = {}
        if len(groups) == 1 or len({self.cdtype(g) for g in groups}) != 1 or not travel_joined(groups):
            waits = [self.plain_group(g, chain, flats) for g in groups]
        else:
            waits = [self.plain_joined(groups, chain, flats)]
        arrived: list[bool] = []

        def take(b: int) -> list[_Buf]:
            if not arrived:  # the first take waits for every group
                arrived.append(True)
                for w in waits:
                    w()
            got = [flats[g.index] for g in self.buckets[b]]
            for f in got:  # the unit's own hold
                f.holders += 1
            chain.taken()
            return got

        return {b: (lambda b=b: take(b)) for b in bs}

    def plain_group(self, g: FlatGroup, chain: _Chain, flats: dict[int, _Buf]) -> Callable[[], None]:
        """One group's gather by itself (its result is its flat buffer): its wait."""
        cast = g.shard_numel * _size(self.cdtype(g)) if self.cdtype(g) != g.master_dtype else 0
        self.gheap.alloc(cast)
        flats[g.index] = self.gather_alone(g.shard_numel, _size(self.cdtype(g)), chain)
        if not self.footprint(g.shard_numel).keeps_input:
            self.gheap.free(cast)
            cast = 0
        return lambda: self.gheap.free(cast)  # what was sent, kept until the wait

    def plain_joined(self, groups: Sequence[FlatGroup], chain: _Chain, flats: dict[int, _Buf]) -> Callable[[], None]:
        """Groups gathered joined (:func:`fzero.sharding.gather_flat_groups_start`): its wait,
        which cuts each group out of the rank-major rows (a copy each)."""
        size = _size(self.cdtype(groups[0]))
        casts = [g.shard_numel * size for g in groups if self.cdtype(g) != g.master_dtype]
        for c in casts:
            self.gheap.alloc(c)
        sent = sum(g.shard_numel for g in groups) * size
        self.gheap.alloc(sent)
        for c in casts:
            self.gheap.free(c)
        self.gather_alone(sum(g.shard_numel for g in groups), size, chain)
        if not self.footprint(1).keeps_input:
            self.gheap.free(sent)
            sent = 0

        def cut() -> None:
            self.gheap.free(sent)
            for g in groups:
                flats[g.index] = chain.hold(_Buf(self.gheap, g.padded_numel * size, holders=0))

        return cut

    def batched_gather(self, b: int) -> dict[int, _Take]:
        """The gather of unit ``b`` (one flat group) started in a batch: its take."""
        if len(self.buckets[b]) != 1:
            raise _Unknown  # a joined gather in a joined all-to-all: not replayed
        g = self.buckets[b][0]
        size, k, heap = _size(self.cdtype(g)), g.shard_numel, self.gheap
        cast = k * size if self.cdtype(g) != g.master_dtype else 0
        heap.alloc(cast)  # what is sent: the batch's part holds it until the take lets it go
        got: list[_Buf] = []

        def alone() -> None:
            fp = self.footprint(k)
            got.append(_Buf(heap, fp.received * size))
            heap.alloc(fp.scratch * size)
            heap.free(fp.scratch * size)

        part = _Part(self.cdtype(g), self.world * k * size, alone)
        self.add(part)

        def take() -> list[_Buf]:
            if part.joint is not None:
                part.joint.waited()
                got.append(_Buf(heap, self.world * k * size))  # its rows copied out of the joint
                part.joint.received.drop()
            heap.free(cast)
            return got[:1]

        return {b: take}

    def tagged(self, bucket: Optional[int]) -> tuple[dict[int, _Take], Callable[[], None]]:
        """:func:`fzero.units._start_tagged`: the carrier of a call's tag and of ``bucket``'s
        gather (if any): per bucket its take, and the wait for the tags."""
        groups = self.buckets[bucket] if bucket is not None else ()
        travel = self.cdtype(groups[0]) if groups else torch.float32
        if any(self.cdtype(g) != travel for g in groups):
            raise _Unknown  # groups of another travel dtype beside the tagged ones: not replayed
        size, tag, heap = _size(travel), 8 * _TAG_VALUES, self.gheap
        heap.alloc(8 * _TAG_VALUES)  # the values as int64, then their bytes in the travel dtype
        heap.alloc(tag * size)
        heap.free(8 * _TAG_VALUES)
        casts = [g.shard_numel * size for g in groups if travel != g.master_dtype]
        for c in casts:
            heap.alloc(c)
        total = tag + sum(g.shard_numel for g in groups)
        sent = total * size
        heap.alloc(sent)
        for c in casts:
            heap.free(c)
        fp = self.footprint(total)
        received = _Buf(heap, fp.received * size, holders=2 if groups else 1)  # the tags' wait, the take
        heap.alloc(fp.scratch * size)
        heap.free(fp.scratch * size)
        if not fp.keeps_input:
            heap.free(sent)
            sent = 0
        heap.free(tag * size)  # the tag itself, once started
        decoded: list[bool] = []

        def arrive() -> None:
            if not decoded:
                decoded.append(True)
                heap.free(sent)
                heap.alloc(self.world * tag * size)  # the tags read back: rounded, as bytes
                heap.alloc(self.world * tag)
                heap.free(self.world * tag * size)
                heap.free(self.world * tag)

        def tags() -> None:
            arrive()
            received.drop()

        def take() -> list[_Buf]:
            arrive()
            copies = [_Buf(heap, g.padded_numel * size) for g in groups]  # cut out of the rows
            received.drop()
            return copies

        return ({bucket: take} if bucket is not None else {}), tags

    # -- the reductions (fzero.buckets.BucketReduction: launches (0, 1), (2,), ..., (n - 1,))
    def wait_oldest(self) -> None:
        pieces = self.started.pop(0)
        for arrive, _ in pieces:  # each waited for and finished in turn
            arrive()
        for _, release in pieces:  # then let go
            release()

    def launch(self, bs: Sequence[int]) -> None:
        while len(self.started) >= MAX_IN_FLIGHT:
            self.wait_oldest()
        groups = [g for b in bs for g in self.buckets[b]]
        rd = self.precision.reduce_dtype
        if reduces_joined(groups, rd):
            rdtype = rd or groups[0].master_dtype
            numel = sum(g.padded_numel for g in groups)
            casts = sum(g.padded_numel * _size(rdtype) for g in groups if self.cdtype(g) != rdtype)
            self.rheap.alloc(casts)  # each group cast, then joined rank-major
            self.rheap.alloc(numel * _size(rdtype))
            self.rheap.free(casts)
            self.started.append([self.piece(numel, rdtype, rdtype, rdtype, numel * _size(rdtype), groups)])
        else:  # autograd's gradient of each group travels as it is (out of scope)
            self.started.append([self.piece(g.padded_numel, self.cdtype(g), rd or g.master_dtype, g.master_dtype, 0)
                                 for g in groups])

    def piece(self, numel: int, in_dtype: torch.dtype, rdtype: torch.dtype, out_dtype: torch.dtype,
              flat: int, cuts: Sequence[FlatGroup] = ()) -> tuple[Callable[[], None], Callable[[], None]]:
        """:func:`fzero.sharding.average_flat_grads_start` of ``numel`` elements (``flat``: the
        bytes of its input if the step made it in scope, a joined gradient), then the cut of
        ``cuts`` (joined groups) in their master dtype: its arrival and its release."""
        size, low, heap = _size(rdtype), rdtype in LOW_PRECISION, self.rheap
        pre, post = gradient_divide_factors(self.world) if low else (1.0, 1.0)
        fp = self.comm.reduction_footprint(numel, "sum" if low else "avg")
        if fp is None:
            raise _Unknown
        x, made = flat, False  # what travels: the batch's part holds it until the release
        if in_dtype != rdtype:
            heap.alloc(numel * size)
            x, made = numel * size, True
        if pre > 1:  # divided into a new buffer; the cast goes
            heap.alloc(numel * size)
            if made:
                heap.free(x)
            x, made = numel * size, True
        if made:
            heap.free(flat)  # the joined gradient goes once what travels is made of it
        own: list[_Buf] = []

        def alone() -> None:
            own.append(_Buf(heap, fp.held * size))
            if fp.result_first:
                heap.alloc(fp.result * size)
            heap.alloc(fp.scratch * size)
            heap.free(fp.scratch * size)

        part = _Part(rdtype, numel * size, alone)
        self.add(part)
        frees = [x]

        def arrive() -> None:
            if not fp.result_first:
                heap.alloc(fp.result * size)
            if part.joint is not None:
                part.joint.waited()
            frees.extend(self.finished(fp.result * size, numel // self.world, rdtype, out_dtype, cuts))

        def release() -> None:
            for nbytes in frees:
                heap.free(nbytes)
            for buf in own:
                buf.drop()
            if part.joint is not None:
                part.joint.received.drop()

        return arrive, release

    def finished(self, result: int, shard: int, rdtype: torch.dtype, out_dtype: torch.dtype,
                 cuts: Sequence[FlatGroup]) -> list[int]:
        """A reduced ``result`` (bytes) finished: divided after the sum in 16 bits, cast to
        ``out_dtype``, each of ``cuts`` cut out in its master dtype. Allocates what that makes;
        returns the bytes it leaves to free."""
        heap, frees = self.rheap, []
        for made, dropped in _after_the_sum(result, shard, rdtype, out_dtype, self.world):
            heap.alloc(made)
            frees.append(dropped)
            result = made
        cast = [g.shard_numel * _size(g.master_dtype) for g in cuts if g.master_dtype != rdtype]
        for c in cast:
            heap.alloc(c)
        if cuts and len(cast) == len(cuts):
            frees.append(result)
        return frees

    # -- the schedule
    def held(self, b: int) -> bool:
        return b in self.cache or b in self.ahead

    def verify(self) -> None:
        if self.pending:
            self.pending.pop()()

    def event(self, e: int) -> None:
        """:meth:`fzero.units._RankRun.event`: unit ``e``'s call, or (0) the forward's end."""
        self.verify()
        nxt = None
        if not self.deferred:  # the unit after the last one called, unless called or held
            guess = (self.events[-1] if self.events else 0) + 2
            nxt = guess if guess < self.n and guess not in self.events and not self.held(guess) else None
        self.events.append(e)
        defer = nxt is None and e != 0 and self.held(e) and not self.deferred
        self.deferred = defer
        if not defer:
            got, tags = self.tagged(nxt)
            self.ahead.update(got)
            self.pending.append(tags)
        if e == 0 or not self.held(e):
            self.verify()

    def prefetch(self, b: int) -> None:
        if b >= 1 and not self.held(b):
            self.ahead.update(self.plain((b,)))

    def deliver(self, b: int) -> None:
        """Unit ``b``'s gradient complete: the unit dropped, its reduction started with the
        gather of the unit two before it (if the one before is held)."""
        for f in self.cache.pop(b):
            f.drop()
        if b >= 2:
            self.launch((b,))
        if b >= 3 and self.held(b - 1) and not self.held(b - 2):
            self.ahead.update(self.batched_gather(b - 2))

    def run(self) -> None:
        n = self.n
        self.ahead.update(self.plain((0, 1)))  # the root travels with the first unit
        self.ahead.pop(0)()  # held to the end of the step
        for b in range(1, n):
            self.event(b)
            flats = self.ahead.pop(b)()
            if b >= n - 2:  # the last two units are kept from forward to backward
                self.cache[b] = flats
            else:  # saved as tokens: nothing holds the unit after its forward
                for f in flats:
                    f.drop()
        self.event(0)
        for b in range(n - 1, 0, -1):
            if b not in self.cache:  # regathered (prefetched) for its backward
                self.cache[b] = self.ahead.pop(b)()
            self.prefetch(b - 1)
            self.batched(lambda b=b: self.deliver(b))
        # the root's gradient and the first unit's travel together, once both are complete
        self.batched(lambda: self.launch((0, 1)))
        while self.started:
            self.wait_oldest()
        self.joints.release()


def _held(kind: str, stage: int) -> bool:
    """Whether the state keeps ``kind`` between steps: master and moments always; the
    gathered compute-dtype parameters in stages 1-2 (``TrainState.params``); gradients never."""
    return kind in ("master", "moments") or (kind == "params" and stage < 3)


def zero_paper_bytes(num_params: int, stage: int, world_size: int, k: int = 12) -> float:
    """The ZeRO paper's per-rank bytes with 16-bit parameters and gradients and ``k``
    bytes of optimizer state per parameter (12 for mixed-precision Adam)."""
    psi, n = num_params, world_size
    return {1: 4 * psi + k * psi / n, 2: 2 * psi + (2 + k) * psi / n, 3: (4 + k) * psi / n}[stage]


def format_memory_table(reports: list[MemoryReport]) -> str:
    """A plain-text table of reports (MiB per rank): each kind, then what the state holds
    between steps, what lives only inside a step, and the total (the paper's model)."""
    mib = 2.0**20
    head = (f"{'stage':>5} {'ranks':>5} " + " ".join(f"{k:>9}" for k in KINDS)
            + f" {'padding':>9} {'held':>9} {'in-step':>9} {'total':>9}")
    lines = [head + "   (MiB per rank)"]
    for r in reports:
        cells = " ".join(f"{r.by_kind[k] / mib:8.3f}{' ' if r.held[k] or not r.by_kind[k] else '*'}" for k in KINDS)
        lines.append(f"{r.stage:>5} {r.world_size:>5} {cells} {r.padding / mib:9.3f} "
                     f"{r.held_total / mib:9.3f} {r.transient_total / mib:9.3f} {r.total / mib:9.3f}")
    lines.append("* only inside a step; held: the training state between steps")
    return "\n".join(lines)
