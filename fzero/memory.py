"""Memory per rank, from the layout: :func:`memory_report`. First ZeRO's model of the training state (Rajbhandari et
al., 2020) on the actual padded layout: compute-dtype parameters, the gradient the optimizer consumes, the fp32 master
and the moments (with Adam and 16-bit compute and communication the paper's ``4Ψ + 12Ψ/N``, ``2Ψ + 14Ψ/N`` and ``16Ψ/N``
bytes at stages 1-3), and the frozen parameters, each split into what the state *holds* between steps and what lives
only *inside* a step. Then ``step_buffers``: the eager step's own buffers at their peak, by profiler scope
(:mod:`fzero.scopes`):

* ``fzero::grad_buckets`` (stages 1-2): the ``MAX_IN_FLIGHT + 1`` largest buckets in the compute dtype, ``[R, padded]``
  each (two reductions under way, one bucket filling);
* ``fzero::grad_reduction``: the averaged gradient shards and, for the reductions under way, the communicator's
  declared ``reduce_scatter_buffers``/``all_reduce_buffers`` times their input;
* ``fzero::gather`` (stage 3): the root and the three largest units gathered at once.

Beside the training state, ``module_params``: what the module's own parameters hold between steps that the state's
buffers do not (``init_train_state(model, ...)`` at stages 1-2; stage 3 moves them to the meta device: 0). A trainable
parameter whose compute dtype is its own dtype is a view of the state's gathered buffer, which a donating step gathers
into (0); after a pure step it still views the *first* state's buffer, which nothing else holds then (the group's
compute-dtype bytes, once more). One whose compute dtype differs (fp32 parameters under ``param_dtype=bf16``) is never a
view: the module keeps its own copy, its dtype's bytes per element, unpadded (+4 bytes per fp32 parameter), one per
process whatever the steps. Frozen parameters are shared with the state (0).

Not counted: activations, a deferred accumulation's whole gradients. ``tests/test_memory_census.py`` holds these within
10 % of what :class:`fzero.testing.Census` measures, ``module_params`` to the byte.

Imports: buckets, comm, layout, optim, precision, scopes, sharding.
"""

from __future__ import annotations

import dataclasses

import torch

from .buckets import MAX_IN_FLIGHT, buckets_of
from .comm import Communicator, gradient_divide_factors
from .layout import FlatGroup, Layout
from .optim import Optimizer
from .precision import MixedPrecision
from .scopes import GATHER, GRAD_BUCKETS, GRAD_REDUCTION
from .sharding import JOIN_NUMEL

__all__ = ["MemoryReport", "memory_report", "zero_paper_bytes", "format_memory_table"]

KINDS = ("params", "grads", "master", "moments", "frozen")

# the units a stage-3 step holds gathered at once besides the root (module doc)
UNITS_HELD = 2
LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Bytes per rank. ``by_kind``: params, grads, master, moments and the frozen parameters; ``held``/``transient``:
    each kind's part kept between steps / only inside one (sum: ``by_kind``); ``padding``: total padding, averaged over
    ranks; ``step_buffers``: the eager step's buffers' peaks by scope; ``step_peak``: those together;
    ``module_params``: what the module's own parameters hold beside the state between steps (module doc; not in
    ``by_kind``, which is the training state's, ZeRO's formula)."""

    stage: int
    world_size: int
    num_params: int
    by_kind: dict[str, float]
    padding: float
    held: dict[str, float] = dataclasses.field(default_factory=dict)
    transient: dict[str, float] = dataclasses.field(default_factory=dict)
    step_buffers: dict[str, float] = dataclasses.field(default_factory=dict)
    step_peak: float | None = None
    module_params: float = 0.0

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

    @property
    def held_with_module(self) -> float:
        """Bytes held between steps, the training state's and the module's own parameters' together."""
        return self.held_total + self.module_params


def _size(dtype: torch.dtype) -> int:
    return dtype.itemsize


def memory_report(layout: Layout, optimizer: Optimizer, *, stage: int, precision: MixedPrecision = MixedPrecision(),
                  world_size: int | None = None, local_ranks: int = 1,
                  comm: Communicator | None = None, donate: bool = False, module: bool = True) -> MemoryReport:
    """Bytes per rank for ``layout``'s parameters at ``stage`` (module doc). ``world_size``: laid out for that many
    ranks instead (default: the layout's own). ``local_ranks``: ranks this process simulates (a process's one copy of
    something counts ``1 / local_ranks`` per rank); ``comm``: the step's communicator (its ``local_ranks`` and
    ``buffer_factor`` then apply). ``donate``: the steps donate (``make_train_step(donate=)``), which only changes
    ``module_params``. ``module``: the parameters are a materialised ``nn.Module``'s that ``init_train_state`` took
    over; ``False`` for a pytree (its tensors stay the caller's) or a meta-device module built by ``init=`` (it stays
    on meta): no module copy (``module_params`` 0). No collective."""
    if stage not in (1, 2, 3):
        raise ValueError(f"memory_report: stage must be 1, 2 or 3, got {stage!r}")
    if comm is not None:
        local_ranks = comm.local_ranks
    shard_frozen = stage == 3 and bool(layout.frozen_slots)  # whatever the layout was built for
    if (world_size or layout.world_size) != layout.world_size or shard_frozen != bool(layout.frozen_groups):
        layout = layout.with_world_size(world_size or layout.world_size, shard_frozen)
    n, k = layout.world_size, len(optimizer.moment_names)
    by_kind = dict.fromkeys(KINDS, 0.0)
    padding = 0.0
    for g in layout.groups:
        master = _size(g.master_dtype)
        rows = {"params": (_size(precision.compute_dtype(g)), stage == 3),
                "grads": (_size(precision.reduce_dtype or g.master_dtype), stage >= 2),
                "master": (master, True), "moments": (k * master, True)}
        for kind, (itemsize, sharded) in rows.items():  # a parameter group's: sharded over its rank group
            by_kind[kind] += itemsize * (g.shard_numel if sharded else g.padded_numel)
            padding += itemsize * (g.padding / layout.axis_size(g.axis) if sharded else g.padding)
    for g in layout.frozen_groups:  # stage 3: sharded like the master
        by_kind["frozen"] += _size(precision.frozen_storage(g)) * g.shard_numel
        padding += _size(precision.frozen_storage(g)) * g.padding / n
    by_kind["frozen"] += sum(s.numel * _size(precision.frozen_storage(s)) for s in layout.frozen_slots
                             if s.frozen_group < 0)
    held = {kind: by_kind[kind] if kind in ("master", "moments", "frozen") or (kind == "params" and stage < 3)
            else 0.0 for kind in KINDS}
    transient = {kind: by_kind[kind] - held[kind] for kind in KINDS}
    buffers, peak = _step_buffers(layout, precision, stage, local_ranks, comm)
    own = _module_params(layout, precision, stage, local_ranks, donate) if module else 0.0
    return MemoryReport(stage, n, layout.num_params, by_kind, padding, held, transient, buffers, peak, own)


def _module_params(layout: Layout, precision: MixedPrecision, stage: int, rows: int, donate: bool) -> float:
    """Per rank, the bytes the module's own parameters hold between steps beside the state's buffers (module doc):
    ``fzero.module.hand_over_parameters`` makes a trainable parameter a view of row 0 of its group's gathered buffer
    (``[rows, padded_numel]`` in the compute dtype) only where the compute dtype is its own."""
    if stage == 3:  # moved to the meta device (frozen ones too): nothing
        return 0.0
    out = 0.0
    for g in layout.groups:
        compute = precision.compute_dtype(g)
        slots = [layout.slots[i] for i in g.slots]
        # not a view: the module's own tensor (numel elements of its dtype), one per process
        out += sum(s.numel * _size(s.dtype) for s in slots if s.dtype != compute) / rows
        if not donate and any(s.dtype == compute for s in slots):
            # a view of the first state's buffer, which a pure step replaced: the process's whole [rows, padded]
            out += _size(compute) * g.padded_numel
    return out  # frozen parameters: the state's tensors are the module's (shared, or its rounded copy)


def _bytes(groups: tuple[FlatGroup, ...], dtype_of) -> int:  # noqa: ANN001 - FlatGroup -> dtype
    return sum(_size(dtype_of(g)) * g.padded_numel for g in groups)


def _step_buffers(layout: Layout, precision: MixedPrecision, stage: int, rows: int,
                  comm: Communicator | None) -> tuple[dict[str, float], float]:
    """Per rank, the eager step's own buffers at their peak by scope, and their joint peak (process's / ``rows``)."""
    compute = lambda g: precision.compute_dtype(g)  # noqa: E731
    reduce = lambda g: precision.reduce_dtype or g.master_dtype  # noqa: E731
    world = layout.world_size
    buckets = [b for b in buckets_of(layout) if b]
    shards = rows * sum(_size(g.master_dtype) * g.shard_numel for g in layout.groups)
    # one reduction's own buffers (the communicator states them per element of one rank's input)
    factor = 0.0 if comm is None or world == 1 else comm.all_reduce_buffers if stage == 1 \
        else comm.reduce_scatter_buffers
    # ZeRO-1's all-reduce may let go of its input before its whole sum exists (rank order, point to point): what it
    # holds beside the input until then (else the input is held throughout)
    first = comm.all_reduce_input_buffers if stage == 1 and comm is not None and world > 1 else None
    # one reduction call's buffers beside its result: the communicator's share, the joined copy of small groups
    launches = buckets if stage < 3 else [buckets[0] + buckets[1], *buckets[2:]] if len(buckets) > 1 else buckets
    # (and a cast of the input to another reduce dtype; joined groups are cast, then copied into one buffer)
    casts = any(_size(compute(g)) != _size(reduce(g)) for g in layout.groups)
    # a 16-bit reduction divides a copy of its input by FSDP's pre-factor (a cast's in place of it)
    divided = comm is not None and precision.reduce_dtype in LOW_PRECISION and gradient_divide_factors(world)[0] > 1 \
        and not casts
    inputs = [divided + rows * casts + rows * (len(b) > 1 and sum(g.padded_numel for g in b) <= JOIN_NUMEL) * (1 + casts)
              for b in launches]
    if first is None:
        factor += divided  # the divided copy is held throughout, as the communicator's own buffers
        cost = [_bytes(b, reduce) * (factor + copies - divided) for b, copies in zip(launches, inputs)]
    else:  # its input copies let go of before the whole sum exists
        cost = [_bytes(b, reduce) * max(factor, first + copies) for b, copies in zip(launches, inputs)]
    reduction = shards + max(cost, default=0)  # the step runs its reductions one at a time
    if stage < 3:
        same = all(_size(compute(g)) == _size(reduce(g)) == _size(g.master_dtype) for g in layout.groups)
        kept = world == 1 and same and stage == 2  # one rank's reduce-scatter is its input: buckets kept as shards
        # launch order (last first); on a real rank a one-parameter bucket filling its group is autograd's gradient
        order = list(range(len(buckets) - 1, -1, -1))
        size = [0 if rows == 1 and len(b) == 1 and len(b[0].slots) == 1 and not b[0].padding
                else rows * _bytes(b, compute) for b in buckets]
        shard = [0 if kept else rows * sum(_size(g.master_dtype) * g.shard_numel for g in b) for b in buckets]
        held = peak = done = 0.0
        pool: list[float] = []  # bucket buffers given back, the largest kept (MAX_IN_FLIGHT + 1)
        for k, i in enumerate(order):
            # simulated ranks run in turn: every bucket waits for the last; a real rank fills each just in time
            waiting = sum(size[j] for j in order[k:]) if rows > 1 else size[i]
            buckets_live = waiting + sum(pool)
            held = max(held, buckets_live)
            # reduce-scatter sums into its result, buffers held; ZeRO-1's all-reduce cuts its chunk once the cast is
            # gone
            reducing = 0 if kept else cost[i] + shard[i] if stage == 2 else \
                max(cost[i], factor * _bytes(buckets[i], reduce) + shard[i])
            peak = max(peak, buckets_live + done + reducing)
            done += shard[i]
            if not kept:
                pool = sorted(pool + [size[i]], reverse=True)[:MAX_IN_FLIGHT + 1]
        if kept:
            held, reduction = float(sum(size)), 0.0
        out = {GRAD_BUCKETS: float(held), GRAD_REDUCTION: reduction}
    else:
        if world == 1 and all(_size(compute(g)) == _size(reduce(g)) == _size(g.master_dtype) for g in layout.groups):
            reduction = shards = 0  # one rank's reduce-scatter is its input: autograd's own gradient
        by: dict[int, int] = {}  # per bucket, its flat and frozen groups gathered
        for g in (*layout.groups, *layout.frozen_groups):
            by[g.bucket] = by.get(g.bucket, 0) + _size(compute(g)) * g.padded_numel
        units = sorted((v for k, v in by.items() if k > 0), reverse=True)
        # each local rank's run gathers every row ([W, padded]) in the simulated world, one run at a time
        rank_rows = world if rows > 1 else 1
        gathered = rank_rows * (by.get(0, 0) + sum(units[:UNITS_HELD]))
        if any(_size(compute(g)) != _size(g.master_dtype) for g in layout.groups):
            # the master shards cast to the compute dtype to be sent: every row's ([R, n]) at once
            gathered += max(by.values()) * (1 if rows > 1 else 1 / world)
        if comm is not None and comm.node is not None:  # hpZ: each unit's node slice, from its forward to its backward
            gathered += rank_rows * sum(units) / comm.node.world_size
        out = {GATHER: float(gathered), GRAD_REDUCTION: reduction}
        # backward, last unit first: its reduction, the root, the two units before it, the shards so far; last the
        # root's
        shard_of = {b[0].bucket: rows * sum(_size(g.master_dtype) * g.shard_numel for g in b) for b in buckets}
        cost_of = dict(zip([b[0].bucket for b in launches], cost))
        done, peak = 0.0, gathered
        for k in sorted((u for u in by if u > 0), reverse=True):
            done += shard_of.get(k, 0) if shards else 0
            held = by.get(0, 0) + by.get(k - 1, 0) * (k > 1) + by.get(k - 2, 0) * (k > 2)
            peak = max(peak, rank_rows * held + done + cost_of.get(k, 0))
        peak = max(peak, rank_rows * by.get(0, 0) + shards + cost[0])
    return {k: v / rows for k, v in out.items()}, peak / rows


def zero_paper_bytes(num_params: int, stage: int, world_size: int, k: int = 12) -> float:
    """ZeRO paper's per-rank bytes (16-bit params and grads, ``k`` optimizer bytes per parameter; 12: mixed Adam)."""
    psi, n = num_params, world_size
    return {1: 4 * psi + k * psi / n, 2: 2 * psi + (2 + k) * psi / n, 3: (4 + k) * psi / n}[stage]


def format_memory_table(reports: list[MemoryReport]) -> str:
    """A plain-text table of reports (MiB per rank): each kind, held, the module's own parameters, in-step, total,
    the step's buffers at peak."""
    mib = 2.0**20
    head = (f"{'stage':>5} {'ranks':>5} " + " ".join(f"{k:>9}" for k in KINDS)
            + f" {'padding':>9} {'held':>9} {'module':>9} {'in-step':>9} {'total':>9} {'buffers':>9}")
    lines = [head + "   (MiB per rank)"]
    for r in reports:
        cells = " ".join(f"{r.by_kind[k] / mib:8.3f}{' ' if r.held[k] or not r.by_kind[k] else '*'}" for k in KINDS)
        lines.append(f"{r.stage:>5} {r.world_size:>5} {cells} {r.padding / mib:9.3f} {r.held_total / mib:9.3f} "
                     f"{r.module_params / mib:9.3f} {r.transient_total / mib:9.3f} {r.total / mib:9.3f} "
                     f"{(r.step_peak or 0) / mib:9.3f}")
    lines.append("* only inside a step; held: the training state between steps; module: the module's own parameters "
                 "beside it; buffers: the step's own at their peak")
    return "\n".join(lines)
