"""Composition of the pure pieces into one training step (ZeRO stages 1, 2 and 3).

A step, for every local rank ``r`` (one on a real rank, W in the simulated world):

1. hyperparameter schedules are evaluated at the step count;
2. for each of ``accum_steps`` micro-batches: module buffers broadcast from
   rank 0 (``broadcast_buffers``), then forward and backward of the loss
   multiplied by the loss scale (stages 1-2: ``torch.autograd.grad`` with
   respect to leaf views of the gathered compute-dtype buffers, concatenated
   per flat group, under the rank's generator state; stage 3: unit by unit,
   see :mod:`fzero.units`), and the gradients averaged
   over ranks: ``reduce_scatter`` (stages 2-3) or, for stage 1 and deferred
   stage 2, accumulated locally and reduced once (stage 1 by ``all_reduce``
   and a local slice);
3. one ``all_reduce(sum)`` of (sum of squares of the scaled gradient shards,
   loss) per rank: the global norm, the overflow flag agreed by every rank,
   and the mean loss; one pass unscales and clips;
4. ``shard_step`` (skipped bitwise by selection on overflow),
   ``update_scale``, and, for stages 1-2, ``all_gather`` of the new
   parameters in the compute dtype for the next step.

Imports: comm, layout, materialize, module, optim, precision, pytree, rng, scaler, schedules, sharding, units.
"""

from __future__ import annotations

import contextlib
import logging
import types
import warnings
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence

import torch
import torch.utils._pytree as tp

from .comm import CollectiveError, Communicator
from .buckets import BucketReduction, BucketWatcher, BufferPool, buckets_of, size_buckets
from .layout import FlatGroup, flatten_one, group_views, named_leaves
from .host_malloc import apply_host_malloc_policy
from .materialize import Init, check_init, materialized_shard
from .module import (
    ModuleLoss, ModuleSpec, adopt_parameters, broadcast_buffers as broadcast_module_buffers, check_loss,
    check_materialized, init_buffers, module_loss, module_spec, release_parameters, row_of,
)
from .optim import OptState, Optimizer, check_compilable, init_opt_state
from .precision import MixedPrecision
from .pytree import pytree_dataclass, replace, static_field
from .scaler import ScalerState, init_scaler, scale, static_scaler, update_scale
from .replicas import ReplicaDivergenceError, check_replicas, digest_parts, parts_differ
from .scopes import UPDATE, scoped
from .rng import init_rng, rank_rng
from .schedules import Schedule
from .units import CompiledUnits, UnitPolicy, compiled_unit_grads, default_units, select_units, unit_buckets, unit_grads
from .sharding import (
    ShardState,
    average_flat_grads,
    average_flat_grads_at_once,
    check_world,
    gather_flat_params,
    gather_flat_params_at_once,
    gather_step_params,
    init_shard,
    local_sq_norm,
    merge_params,
    shard_step,
    stack_rows,
    trainable_views,
)

__all__ = [
    "TrainState",
    "init_train_state",
    "make_train_step",
    "module_loss",
    "check_batch",
    "compiled_step",
    "ensure_live",
    "consume",
    "LossFn",
    "StepFn",
]

LossFn = Callable[[Any, Any], torch.Tensor]
UNUSED = ("skip", "zeros")  # make_train_step(unused=...): what a parameter without a gradient does


@pytree_dataclass
class TrainState:
    """Everything a training step carries from one step to the next.

    ``params``: the gathered compute-dtype flat buffers ``[R, padded_numel]``,
    one per flat group (stages 1 and 2 keep full parameters between steps;
    ``()`` for stage 3). ``buffers``: the module's buffers, one ``[R, *shape]``
    tensor each in its own dtype, in ``ModuleSpec.buffers`` order (each rank's
    copy, as each DDP rank has its own). ``rng``: ``()`` or one ``[R, n]``
    uint8 tensor, each rank's generator state (see :mod:`fzero.rng`).
    Static: the :class:`MixedPrecision` policy and the :class:`ModuleSpec`.
    """

    shard: ShardState
    opt: OptState
    scaler: ScalerState
    params: tuple[torch.Tensor, ...]
    buffers: tuple[torch.Tensor, ...] = ()
    rng: tuple[torch.Tensor, ...] = ()
    precision: MixedPrecision = static_field(default=MixedPrecision())
    module: ModuleSpec = static_field(default=ModuleSpec())

    @property
    def layout(self):  # noqa: ANN201 - Layout, re-exported for convenience
        return self.shard.layout


def _device_of(params: Any) -> torch.device:
    leaves = [x for _, x in named_leaves(params)[0]]
    # a meta model is materialised on the CPU (fzero.materialize)
    return leaves[0].device if leaves and not leaves[0].is_meta else torch.device("cpu")


def init_train_state(
    params: Any,
    optimizer: Optimizer,
    comm: Communicator,
    *,
    stage: int = 2,
    units: Optional[UnitPolicy] = None,
    bucket_numel: Optional[int] = None,
    precision: MixedPrecision = MixedPrecision(),
    scaler: Optional[ScalerState] = None,
    trainable: Optional[Callable[[str], bool]] = None,
    alignment: int = 16,
    seed: Optional[int] = 0,
    init: Optional[Init] = None,
) -> TrainState:
    """The initial state for ``params`` (an ``nn.Module`` or a pytree of tensors).

    Each local rank builds only its own shards. ``stage`` 1-2 keep the gathered
    compute-dtype parameters in the state; stage 3 keeps none (``params == ()``).
    ``units`` (stage 3; allowed at stages 1-2, which then share stage 3's
    layout): the wrap policy choosing the shard units of an ``nn.Module``,
    module classes or a predicate ``(name, module) -> bool`` (see
    :mod:`fzero.units`); its parameters go one bucket per unit, the rest (and
    tied parameters) to the root. At stage 3 without ``units``: the submodules
    whose class a ``transformers`` model names in ``_no_split_modules``
    (:func:`fzero.units.default_units`; a ``ValueError`` says to pass ``units=``
    for a model that names none). Checkpoints move between stages either way.
    ``bucket_numel`` (stages 1-2 without ``units``; default
    :data:`fzero.buckets.DEFAULT_BUCKET_NUMEL`, 2^24): gradients are reduced in buckets
    of about this many elements, in reverse registration order, each started as
    soon as backward has completed it (DDP's ``bucket_cap_mb``, DeepSpeed's
    ``reduce_bucket_size``); each bucket is a flat group of the layout.
    ``scaler`` defaults to a dynamic
    :func:`~fzero.scaler.init_scaler` when computing in fp16 and to a static
    scale of 1 otherwise.

    A module's buffers (BatchNorm statistics, ...) become ``state.buffers``,
    one copy per rank. ``seed``: rank ``r``'s generator starts from
    ``rank_seed(seed, r)`` (see :mod:`fzero.rng`); ``None``: the step draws
    from the caller's generator, as plain torch code does.
    Collectives: ``comm.check_layout``; for stages 1-2 one ``all_gather`` per
    flat group.
    """
    if stage not in (1, 2, 3):
        raise ValueError(f"init_train_state: stage must be 1, 2 or 3, got {stage!r}")
    if stage == 3 and units is None and not isinstance(params, torch.nn.Module):
        raise TypeError(
            f"init_train_state: stage 3 shards an nn.Module unit by unit, got {type(params).__name__}; "
            "pytrees of tensors train at stages 1-2"
        )
    if bucket_numel is not None and (stage == 3 or units is not None):
        raise ValueError(
            "init_train_state: bucket_numel cuts stages 1-2 into gradient buckets by size; with "
            "units= (or at stage 3) the shard units are the buckets: give one or the other"
        )
    if isinstance(params, torch.nn.Module) and init is None:
        check_materialized(params)  # a module an earlier stage-3 state took: say so
    unit_names: tuple[str, ...] = ()
    bucket_of = None
    if units is None and stage < 3:
        bucket_of = size_buckets(params, bucket_numel, trainable).__getitem__
    if units is not None:
        if not isinstance(params, torch.nn.Module):
            raise TypeError(
                f"init_train_state: `units` chooses submodules of an nn.Module, got {type(params).__name__}; "
                "stage 3 shards an nn.Module (pytrees of tensors train at stages 1-2)"
            )
        unit_names = select_units(params, units)
    elif stage == 3:  # the default wrap policy: the blocks a transformers model names
        unit_names = default_units(params)
    if unit_names:
        buckets = unit_buckets(params, unit_names)
        bucket_of = buckets.__getitem__
    check_init(params, init)
    layout_kw = dict(trainable=trainable, optimizer=optimizer, alignment=alignment, bucket_of=bucket_of)
    if init is None:
        shard, made_buffers = init_shard(params, comm, **layout_kw), None
    else:
        shard, made_buffers = materialized_shard(params, comm, init, unit_names, **layout_kw)
    apply_host_malloc_policy(shard.master[0].device.type if shard.master else "cpu")
    opt = init_opt_state(optimizer, shard.master, len(shard.layout.trainable_slots),
                         [s.shape for s in shard.layout.trainable_slots])
    # per parameter, the steps it sat out (make_train_step(unused="skip")): none yet
    opt = replace(opt, missed=(torch.zeros(len(shard.layout.trainable_slots), dtype=torch.int64,
                                           device=opt.step.device),))
    if scaler is None:
        scaler = init_scaler() if precision.param_dtype == torch.float16 else static_scaler(1.0)
    spec, buffers, gathered = ModuleSpec(), (), ()
    rng = () if seed is None else (init_rng(seed, comm.ranks, _device_of(params)),)
    if isinstance(params, torch.nn.Module):
        spec = replace(module_spec(params), units=unit_names)
        buffers = init_buffers(params, spec, comm.local_ranks) if made_buffers is None else made_buffers
        if stage == 3:
            hand_over_parameters(params, shard.layout, (), stage)
        else:
            # group by group, so the module's own copy of a group is freed before the next group
            # is gathered: the init peak holds one model and one group, not two models
            gathered = gather_flat_params(shard, comm, precision.param_dtype, then=lambda g, flat: (
                hand_over_parameters(params, shard.layout, (flat,), stage, groups=(g,))))
    elif stage < 3:
        gathered = gather_flat_params(shard, comm, precision.param_dtype)
    return TrainState(shard, opt, scaler, gathered, buffers, rng, precision, spec)


def hand_over_parameters(module: torch.nn.Module, layout: Any, gathered: tuple[torch.Tensor, ...],
                         stage: int, groups: Optional[Sequence[FlatGroup]] = None) -> set[str]:
    """After :func:`init_train_state` the state owns the module's trainable parameters: one
    copy in memory, not the module's and the state's.

    Stages 1-2: each parameter becomes a view of row 0 of the gathered buffers (when the
    compute dtype is the parameter's; with a different compute dtype the module keeps its
    own copy). A donating step gathers into those buffers, so the module follows the
    training; a pure step returns new buffers and the module keeps the ones it views.
    ``groups``: only these flat groups, ``gathered`` holding their buffers in that order.
    Stage 3: the parameters move to the meta device (as FSDP2 and DeepSpeed's ZeRO-3 leave a
    module): :func:`fzero.write_back` gives them values again. Returns the names of the
    parameters that now view the state. No collective."""
    if stage == 3:
        release_parameters(module, [s.path for s in layout.trainable_slots])
        return set()
    metas = {n for n, p in module.named_parameters() if p.is_meta}  # built on meta: it stays there
    adopted = {}
    for g, flat in zip(layout.groups if groups is None else groups, gathered):
        for i, v in zip(g.slots, group_views(layout, g, flat[0])):
            s = layout.slots[i]
            if v.dtype == s.dtype and s.path not in metas:
                adopted[s.path] = v
    adopt_parameters(module, adopted)
    return set(adopted)


def _check_leaf(path: Any, x: Any, what: str, rows: int, accum_steps: int) -> None:
    if not isinstance(x, torch.Tensor):
        return
    need = 2 if accum_steps > 1 else 1
    if x.dim() >= need and x.shape[0] == rows and (accum_steps == 1 or x.shape[1] == accum_steps):
        if x.dim() > need and x.shape[need] == 0:
            # an empty batch's mean loss is NaN, which is not an overflow (found_inf stays 0),
            # and the optimizer would still decay every parameter: refuse it before any collective
            per = "per rank and micro-batch" if accum_steps > 1 else "per rank"
            raise ValueError(
                f"{what}: batch{tp.keystr(path)} is empty: shape {tuple(x.shape)}, 0 examples {per} "
                f"(dim {need}); every rank needs at least one example"
            )
        return
    if accum_steps > 1:
        want, fix = f"[{rows}, {accum_steps}, ...] (local ranks, micro-batches)", \
            f"comm.split_batch(batch, micro_batches={accum_steps})"
    else:
        want, fix = f"[{rows}, ...] (local ranks)", "comm.split_batch(batch)"
    raise ValueError(
        f"{what}: batch{tp.keystr(path)} has shape {tuple(x.shape)}, but every batch leaf must be "
        f"{want}: split the global batch with {fix}"
    )


def check_batch(batch: Any, rows: int, accum_steps: int = 1, what: str = "train step") -> None:
    """Raise ``ValueError`` unless every tensor leaf of ``batch`` is ``[R, ...]``
    (``[R, K, ...]`` with ``accum_steps=K``), naming the leaf, its shape and the fix,
    or if a leaf's batch dimension (the one after those axes) is empty.
    Shapes are static: free under compile."""
    tp.tree_map_with_path(lambda p, x: _check_leaf(p, x, what, rows, accum_steps), batch)


class RankGrads(NamedTuple):
    """What one micro-batch's forward and backward gives, per local rank."""

    flat: tuple[torch.Tensor, ...]      # per flat group [R, padded], compute dtype, scaled
    losses: torch.Tensor                # [R] fp32, unscaled
    buffers: tuple[torch.Tensor, ...]   # the buffers the forward left, [R, ...] each
    rng: tuple[torch.Tensor, ...]       # the generator states it left (or the input's)
    used: torch.Tensor                  # [R, T] float64: 1 where the rank had a gradient
    every: bool = False                 # all of used is 1 (known in Python; compiled: when tracing)


def local_flat_grads(
    loss_fn: LossFn,
    state: TrainState,
    batch: Any,
    rows: int,
    reduction: Optional[BucketReduction] = None,
) -> RankGrads:
    """Each local rank's gradient of its scaled loss, its loss, buffers and generator.

    Ordinary autograd: rank ``r``'s parameters are fresh leaf tensors viewing
    row ``r`` of the gathered buffers (no copy; the state is never written),
    ``torch.autograd.grad`` differentiates the scaled loss with respect to
    them, and the gradients are concatenated per flat group. One leaf per
    parameter, not one flat leaf: autograd would zero-fill the whole flat
    gradient once per parameter slice. Buffers reach the forward as fresh
    copies (it may update them in place: BatchNorm); they are passed with
    the parameters in one ``{name: tensor}`` mapping, as ``functional_call``
    takes them. Eagerly, rank ``r``'s generator state is installed for its
    forward and backward (:func:`fzero.rng.rank_rng`). A :class:`ModuleLoss`
    keeps its module bound to the rank's tensors until backward has finished,
    so that activation checkpointing recomputes with them.

    ``reduction`` (eager only): each bucket's flat gradient goes to it as soon
    as backward has completed the bucket (:class:`fzero.buckets.BucketWatcher`),
    which starts its collective while backward goes on; ``RankGrads.flat`` is
    then empty. Otherwise no collective.
    """
    lay, shard, scaler = state.layout, state.shard, state.scaler
    dtype = state.precision.param_dtype
    names = state.module.buffers
    swap_rng = bool(state.rng) and not torch.compiler.is_compiling()
    device = state.params[0].device
    train_slots = lay.trainable_slots
    flat: list[list[torch.Tensor]] = [[] for _ in lay.groups]
    losses: list[torch.Tensor] = []
    new_rng: list[torch.Tensor] = []
    new_buffers: list[list[torch.Tensor]] = [[] for _ in names]
    used: list[list[float]] = []
    train_index = [i for i, s in enumerate(lay.slots) if s.group >= 0]
    for r in range(rows):
        batch_r = row_of(batch, r)
        views = trainable_views(lay, state.params, r)
        leaves = [views[s.path].detach().requires_grad_(True) for s in train_slots]
        watcher = None
        if reduction is not None:
            watcher = BucketWatcher(lay, reduction.groups, r, reduction.buffers,
                                    lambda b, grads, r=r: reduction.add(b, r, grads), rows)
            watcher.watch(leaves)
        tensors = merge_params(lay, {s.path: v for s, v in zip(train_slots, leaves)}, shard.frozen, dtype)
        bufs = [b[r].clone() for b in state.buffers]
        if bufs:
            tensors = {**tensors, **dict(zip(names, bufs))}
        bound = loss_fn.bound(tensors) if isinstance(loss_fn, ModuleLoss) else contextlib.nullcontext()
        forward = loss_fn.forward_loss if isinstance(loss_fn, ModuleLoss) else loss_fn
        try:
            with rank_rng(state.rng[0][r] if swap_rng else None, device, new_rng), torch.enable_grad(), bound:
                loss = forward(tensors, batch_r)
                check_loss(loss)
                loss = loss.float()
                if watcher is not None:
                    # gradients go into the bucket buffers as backward completes them (the
                    # watcher's hooks); none is kept here
                    torch.autograd.backward(scale(scaler, loss), inputs=leaves)
                else:
                    grads = torch.autograd.grad(scale(scaler, loss), leaves, allow_unused=True)
        finally:
            if watcher is not None:
                watcher.close()
        if watcher is not None:
            watcher.finish()
            used.append([float(i in watcher.used) for i in train_index])
        else:
            # which parameters the loss reached is known when tracing: a constant of the graph
            used.append([float(g is not None) for g in grads])
            by_path = {
                s.path: g if g is not None else torch.zeros(s.shape, dtype=v.dtype, device=device)
                for s, v, g in zip(train_slots, leaves, grads)
            }
            slot_grads = [by_path.get(s.path) for s in lay.slots]
            for g in lay.groups:
                flat[g.index].append(flatten_one(lay, g, slot_grads))
            del grads
        losses.append(loss.detach())
        for i, b in enumerate(bufs):
            new_buffers[i].append(b)
    return RankGrads(
        tuple(stack_rows(f) for f in flat if f),
        torch.stack(losses),
        tuple(stack_rows(b) for b in new_buffers),
        (stack_rows(new_rng),) if swap_rng else state.rng,
        torch.tensor(used, dtype=torch.float64, device=device),
        all(all(row) for row in used),
    )


def apply_schedules(state: TrainState, schedules: Mapping[str, Schedule]) -> TrainState:
    """Set scheduled hyperparameters from the step count (inside the step: no recompiles).

    The default group takes ``schedule(step)``; a group whose base value differs
    takes it scaled by ``base_group / base_default`` (as ``LambdaLR`` scales each
    group's base learning rate).
    """
    if not schedules:
        return state
    opt = state.opt
    hyper = [dict(h) for h in opt.hyper]
    for name, schedule in schedules.items():
        if name not in hyper[0]:
            raise ValueError(
                f"schedules: {opt.optimizer.name} has no hyperparameter {name!r}; expected one of {sorted(hyper[0])}"
            )
        value = schedule(opt.step).to(torch.float64).reshape(())
        base0 = opt.optimizer.hyperparams(0)[name]
        for i, h in enumerate(hyper):
            base = opt.optimizer.hyperparams(i)[name]
            h[name] = value.to(h[name].device) * (base / base0 if base0 and base != base0 else 1.0)
    return replace(state, opt=replace(opt, hyper=tuple(hyper)))


StepFn = Callable[[TrainState, Any], tuple[TrainState, dict[str, torch.Tensor]]]


class Micro(NamedTuple):
    """One micro-step's result: the state with the buffers and generators its forward left;
    per flat group the reduced shards ``[R, shard_numel]`` (or, deferring, the full local
    gradients ``[R, padded]``); the losses ``[R]``; ``final``: the shards are already the
    average over every micro-batch (a deferred accumulation reduced in the last backward)."""

    state: "TrainState"
    grads: tuple[torch.Tensor, ...]
    losses: torch.Tensor
    final: bool = False
    used: Optional[torch.Tensor] = None  # [R, T] float64: 1 where the rank had a gradient
    every: bool = False  # all of used is 1, known in Python (compiled: when tracing)


def make_train_step(
    loss_fn: LossFn,
    comm: Communicator,
    *,
    stage: int = 2,
    clip_norm: Optional[float] = None,
    accum_steps: int = 1,
    defer_reduce: bool = False,
    schedules: Optional[Mapping[str, Schedule]] = None,
    donate: bool = False,
    compile: bool = False,
    broadcast_buffers: bool = True,
    check_replicas_every: int = 0,
    replica_check: str = "raise",
    unused: str = "skip",
) -> StepFn:
    """A step ``(state, batch) -> (state, metrics)`` for ZeRO stage 1, 2 or 3.

    ``loss_fn(params, batch)``: a 0-d loss for one rank's micro-batch, where
    ``params`` has the structure of the parameters given to
    :func:`init_train_state`; at stage 3 a :func:`fzero.module_loss` (the step
    binds each unit's gathered parameters into the module). ``batch``: any tree whose
    leaves carry the local-rank axis ``[R, ...]`` (see ``comm.split_batch``).

    ``clip_norm``: clip the global gradient norm as
    ``torch.nn.utils.clip_grad_norm_`` does, fused with unscaling (one pass).
    ``accum_steps=K``: batch leaves are ``[R, K, ...]``; the gradients of the K
    micro-batches (mean loss each) are averaged, then the optimizer runs once:
    equal to one step on the K-times larger batch. Stage 2 and 3 reduce every
    micro-step into fp32 shard accumulators; stage 1 accumulates full local
    gradients and reduces once, and so does stage 2 with ``defer_reduce=True``
    (no gradient communication on the first K-1 micro-steps, full-size
    accumulators). Stage 3 cannot defer (it never holds full gradients).
    ``schedules``: ``{hyperparameter: schedule(step) -> value}``, evaluated
    inside the step at the optimizer's step count; the default group gets the
    value, other groups the value scaled by their base ratio to the default.

    Metrics (0-d): ``loss`` (mean over ranks, unscaled), ``found_inf``,
    ``scale`` (the scale used in this step), ``grad_norm`` (unscaled, before
    clipping), ``lr`` (the default group's). Runs eagerly or under
    ``torch.compile(fullgraph=True)``; nothing recompiles as values change.

    ``donate=False``: pure; the input state is untouched and stays valid.
    ``donate=True`` (JAX's ``donate_argnums``): the step updates the master
    shards and optimizer moments in place and the returned state owns those
    buffers; the input state is *consumed*: its tensors are emptied, and
    passing it to a step or to fzero's functions raises ``ValueError``.
    ``compile=True``: the step is ``torch.compile(fullgraph=True)``-ed inside
    that bookkeeping (compile a donating step this way, not from outside).
    Donated and pure steps give bitwise the same numbers.

    ``broadcast_buffers=True`` (DDP's default): before every forward, each
    rank's module buffers are replaced by rank 0's (one ``broadcast`` per
    buffer dtype); each rank's forward then updates its own copy (BatchNorm
    statistics of its own batch). ``False``: every rank keeps its own buffers.

    ``check_replicas_every=N``: every step digests what every rank must hold
    alike (scaler, step, hyperparameters, gathered parameters, frozen
    parameters) in the state it is given, and the digest rides on the step's
    one scalar ``all_reduce`` (no collective of its own; compile-safe):
    ``metrics["replicas_differ"]``. ``replica_check="raise"`` reads it every N
    steps (the only host sync) and raises :class:`fzero.ReplicaDivergenceError`
    naming the item and the ranks; ``"flag"`` only reports it.

    The batch is checked at trace time: every tensor leaf must be ``[R, ...]``
    (``[R, K, ...]`` with ``accum_steps=K``), else a ``ValueError`` names it.
    A collective that fails (a ``TorchCommunicator(timeout=...)`` that a stalled peer
    outlasted, or a dead peer) raises :class:`fzero.CollectiveError` naming it and the step.

    ``unused``: a parameter that no rank's loss reached in a step (no gradient on any rank,
    over every micro-batch). ``"skip"`` (default, DDP with ``find_unused_parameters=True``
    and ``torch.optim``): it is not updated, no weight decay, no moment change, and its own
    step count (``state.opt.step - state.opt.missed``) does not advance; a parameter used on
    one rank only takes that rank's gradient averaged over all ranks, as in DDP. Which
    parameters had a gradient rides on the step's one scalar ``all_reduce`` (``T`` more
    float64 values, ``T`` trainable parameters; no collective of its own).
    ``"zeros"``: no gradient is a zero gradient and every parameter takes every step
    (DeepSpeed's flat buffers): weight decay and momentum still move an unused parameter.
    """
    if stage not in (1, 2, 3):
        raise ValueError(f"make_train_step: stage must be 1, 2 or 3, got {stage!r}")
    if unused not in UNUSED:
        raise ValueError(f"make_train_step: unused must be one of {UNUSED}, got {unused!r}")
    if clip_norm is not None and not clip_norm > 0:
        raise ValueError(f"make_train_step: clip_norm must be positive, got {clip_norm}")
    if not (isinstance(accum_steps, int) and accum_steps >= 1):
        raise ValueError(f"make_train_step: accum_steps must be a positive int, got {accum_steps!r}")
    if defer_reduce and stage == 3:
        raise ValueError("make_train_step: stage 3 reduces every micro-step (defer_reduce needs full gradients)")
    if stage == 3 and not isinstance(loss_fn, ModuleLoss):
        raise TypeError(
            "make_train_step: stage 3 gathers each shard unit's parameters in the unit's forward and "
            "needs the module: give fzero.module_loss(model, ...) (with a state built by "
            "init_train_state(model, ..., stage=3, units=...))"
        )
    schedules = dict(schedules or {})
    defer = stage == 1 or defer_reduce
    pool = BufferPool()  # eager stages 1-2: gradient bucket buffers reused within a step
    # compiled stage 3 with one backward per graph (one local rank, one micro-batch): the units
    # regather in backward (fzero.units.CompiledUnits); otherwise every bucket is gathered at once
    regather = CompiledUnits(loss_fn.module) if (
        compile and stage == 3 and comm.local_ranks * accum_steps == 1) else None

    def micro_batch(batch: Any, k: int) -> Any:
        if accum_steps == 1:
            return batch
        return tp.tree_map(lambda x: x[:, k] if isinstance(x, torch.Tensor) else x, batch)

    def stage3_micro(state: TrainState, batch: Any, prior: Any, last: bool) -> Micro:
        """As ``stage12_micro``, gathering each unit's parameters inside the step (fzero.units)."""
        if not state.module.units:
            raise ValueError(
                "make_train_step(stage=3): this state has no shard units; build it with "
                "init_train_state(model, ..., stage=3, units=...)"
            )
        if broadcast_buffers and state.buffers:
            state = replace(state, buffers=broadcast_module_buffers(state.buffers, comm))
        reduce_dtype = state.precision.reduce_dtype
        if torch.compiler.is_compiling() and regather is not None:
            # One rank, one micro-batch: each unit gathered in its forward and again in backward,
            # reduced in backward (fzero.units.compiled_unit_grads)
            out = compiled_unit_grads(
                regather, loss_fn, state.shard, comm, batch, units=state.module.units,
                buffers=state.buffers, buffer_names=state.module.buffers,
                scale_loss=lambda loss: scale(state.scaler, loss),
                param_dtype=state.precision.param_dtype, reduce_dtype=reduce_dtype,
            )
            return Micro(replace(state, buffers=out.buffers), out.shards, out.losses, used=out.used, every=out.every)
        if torch.compiler.is_compiling():
            # Module hooks and saved-tensor hooks do not trace: in a graph, every bucket is
            # gathered inside the step and inductor keeps it to its last use in backward
            # (FSDP's reshard_after_forward=False); between steps the state holds shards only.
            # One gather and one reduce for all buckets: the graph holds them all anyway.
            gathered = gather_flat_params_at_once(state.shard, comm, state.precision.param_dtype)
            out = local_flat_grads(loss_fn, replace(state, params=gathered), batch, comm.local_ranks)
            return Micro(replace(state, buffers=out.buffers, rng=out.rng),
                         average_flat_grads_at_once(out.flat, state.layout, comm, reduce_dtype), out.losses,
                         used=out.used, every=out.every)
        units_out = unit_grads(
            loss_fn, state.shard, comm, batch, units=state.module.units, buffers=state.buffers,
            buffer_names=state.module.buffers, rng=state.rng[0] if state.rng else None,
            scale_loss=lambda loss: scale(state.scaler, loss),
            param_dtype=state.precision.param_dtype, reduce_dtype=reduce_dtype,
        )
        return Micro(replace(state, buffers=units_out.buffers, rng=units_out.rng or state.rng),
                     units_out.shards, units_out.losses, used=units_out.used, every=units_out.every)

    def stage12_micro(state: TrainState, batch: Any, prior: Any, last: bool) -> Micro:
        """The state with the buffers and generators the forward left; per flat group the
        reduced shards (or, deferring, the full local gradients); the losses ``[R]``.

        Eagerly, each bucket's reduction starts during backward, as soon as its gradient is
        complete (:class:`fzero.buckets.BucketReduction`), and is waited for after backward.
        Deferring, the first ``K - 1`` micro-steps only accumulate; the last one reduces, in
        its backward, ``(prior + gradient) / K`` (``prior``: the accumulated gradients), so
        the result is already the average over micro-batches (``Micro.final``)."""
        if broadcast_buffers and state.buffers:
            state = replace(state, buffers=broadcast_module_buffers(state.buffers, comm))
        lay, rows = state.layout, comm.local_ranks
        reduce_dtype = state.precision.reduce_dtype
        if torch.compiler.is_compiling() or (defer and not last):
            out = local_flat_grads(loss_fn, state, batch, rows)
            state = replace(state, buffers=out.buffers, rng=out.rng)
            if defer:
                return Micro(state, out.flat, out.losses, used=out.used, every=out.every)
            return Micro(state, average_flat_grads_at_once(out.flat, lay, comm, reduce_dtype), out.losses,
                         used=out.used, every=out.every)
        prepare = None
        if defer and prior is not None:
            def prepare(g: FlatGroup, flat: torch.Tensor) -> torch.Tensor:
                # the same operations as the accumulation loop in `step`, bucket by bucket
                return (prior[g.index].to(g.master_dtype) + flat) / accum_steps
        buckets = buckets_of(lay)
        reduction = BucketReduction(
            buckets, comm, reduce_dtype, [(b,) for b in range(len(buckets) - 1, -1, -1)], in_order=True,
            via_all_reduce=stage == 1, prepare=prepare, pool=pool, dtype=state.precision.param_dtype,
            device=state.params[0].device,
        )
        out = local_flat_grads(loss_fn, state, batch, rows, reduction)
        shards = reduction.finish(state.params[0].device, state.precision.param_dtype)
        return Micro(replace(state, buffers=out.buffers, rng=out.rng), shards, out.losses, final=defer,
                     used=out.used, every=out.every)

    # Compiled: whether no parameter has ever sat out a step (state.opt.missed all zero), read on
    # the host before each call (a CPU vector: no device sync) and read by the trace as a
    # constant, so a step whose every parameter had a gradient compiles the plain update.
    # Dynamo guards on it: the one time it turns False, the step compiles once more.
    hint = {"no_missed": False}

    def step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, torch.Tensor]]:
        check_world(state.shard, comm)
        if stage == 3 and state.params:
            raise ValueError("make_train_step(stage=3): this state keeps gathered parameters; build it "
                             "with init_train_state(..., stage=3)")
        if stage < 3 and not state.params:
            raise ValueError(f"make_train_step(stage={stage}): this state was built for stage 3 and keeps "
                             "no gathered parameters; build it with init_train_state(..., stage=1 or 2)")
        check_batch(batch, comm.local_ranks, accum_steps)
        parts = digest_parts(state, comm) if check_replicas_every else None
        buffers_in = state.buffers  # what a skipped step keeps (before any broadcast or forward)
        state = apply_schedules(state, schedules)
        micro = stage3_micro if stage == 3 else stage12_micro
        groups = state.layout.groups
        acc: tuple[torch.Tensor, ...] = ()
        loss_sum: Optional[torch.Tensor] = None
        used: Optional[torch.Tensor] = None
        every = True
        final = False
        for k in range(accum_steps):
            last = k == accum_steps - 1
            m = micro(state, micro_batch(batch, k), acc if k else None, last)
            state, final = m.state, m.final
            if final or not k:
                acc = m.grads
            else:  # accumulate in the master dtype (fp32), whatever the gradients' dtype
                acc = tuple(a.to(g.master_dtype) + p for a, p, g in zip(acc, m.grads, groups))
            loss_sum = m.losses if loss_sum is None else loss_sum + m.losses
            used = m.used if used is None else used + m.used
            every = every and m.every
        if not torch.compiler.is_compiling():
            pool.clear()  # between steps a rank holds its state, not scratch buffers
        if accum_steps > 1:
            loss_sum = loss_sum / accum_steps
            if not final:
                acc = tuple(a / accum_steps for a in acc)
        if stage < 3 and defer and not final:
            reduce_dtype = state.precision.reduce_dtype
            acc = tuple(
                average_flat_grads(a, comm, reduce_dtype or g.master_dtype, g.master_dtype, stage == 1)
                for g, a in zip(groups, acc)
            )
        return finish_step(state, acc, loss_sum, comm, clip_norm=clip_norm, donate=donate, replica_parts=parts,
                           buffers_in=buffers_in, used=used if unused == "skip" else None,
                           uniform=every and hint["no_missed"])

    core: StepFn = step
    if compile:
        compiled = compiled_step(step, comm.local_ranks * accum_steps, regather=regather is not None)

        def core(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, torch.Tensor]]:
            # before the graph: a bad shape raises our error, not a recompile that fails inside
            check_batch(batch, comm.local_ranks, accum_steps)
            check_compilable(state.opt.optimizer)
            hint["no_missed"] = no_missed_steps(state.opt)
            if regather is None or stage != 3:
                return compiled(state, batch)
            with regather.installed(state.module.units):
                return compiled(state, batch)
    if check_replicas_every:
        core = _checking_replicas(core, comm, check_replicas_every, replica_check)
    core = _naming_step(core)
    if not donate:
        return core

    def donating_step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, torch.Tensor]]:
        ensure_live(state)
        new_state, metrics = core(state, batch)
        return consume(state, new_state), metrics

    return donating_step


def _naming_step(step: StepFn) -> StepFn:
    """A :class:`~fzero.comm.CollectiveError` raised in the step (a peer stalled past the
    communicator's timeout, or died) names the step it happened in, ``opt.step + 1``."""

    def named(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, torch.Tensor]]:
        try:
            return step(state, batch)
        except CollectiveError as e:
            if e.step is not None:
                raise
            raise e.at_step(int(state.opt.step) + 1) from e

    return named


def _checking_replicas(step: StepFn, comm: Communicator, every: int, mode: str) -> StepFn:
    """Every ``every`` calls, read the step's ``replicas_differ`` (a host sync; none on the
    other calls) and, if set, name what differs with :func:`fzero.check_replicas`."""
    if not (isinstance(every, int) and every >= 1):
        raise ValueError(f"make_train_step: check_replicas_every must be a positive int, got {every!r}")
    if mode not in ("raise", "flag"):
        raise ValueError(f"make_train_step: replica_check must be 'raise' or 'flag', got {mode!r}")
    if mode == "flag":
        return step
    calls = [0]

    def run(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, torch.Tensor]]:
        new_state, metrics = step(state, batch)
        calls[0] += 1
        if calls[0] % every == 0 and bool(metrics["replicas_differ"]):
            # the digest was of the state this step was given: name what differs there (a
            # donating step has updated only master shards and moments in place, which are
            # never compared, and consumes the state after this wrapper returns)
            check_replicas(state, comm)
            raise ReplicaDivergenceError(
                "replicas disagreed at the start of this step (the digest carried by its all-reduce), "
                "but a second look found no difference", []
            )
        return new_state, metrics

    return run


def compiled_step(step: StepFn, backward_regions: int = 1, regather: bool = False) -> StepFn:
    """``torch.compile(step, fullgraph=True)`` with what fzero's step needs around it.

    * ``torch._dynamo.config.trace_autograd_ops=True`` while tracing: torch
      2.13's dynamo graph-breaks on ``torch.autograd.grad`` otherwise (it
      is off by default). The flag is set only for this function's calls;
      compiling a step from outside needs it set by the caller.
    * Activation checkpointing: inductor rematerialises checkpointed regions of
      a forward-loss-backward graph only if the graph has one backward region.
      ``backward_regions`` (local ranks x micro-batches) > 1 turns that pass
      off (``torch._functorch.config.remat_using_tags_for_fwd_loss_bwd_graph``):
      the results are the same, inductor chooses what to keep. torch also
      refuses random ops (dropout) inside a rematerialised region.
    * Each rank's generator (:mod:`fzero.rng`): dynamo cannot swap generator
      states inside a graph, so row 0's state is installed around the
      compiled call and the state the call leaves is stored back. With one
      row (a real rank) the stream is carried exactly; with several rows
      (a compiled simulated world) every row draws from row 0's stream, and a
      warning says so the first time the step consumed randomness.
    * ``dynamic=False``: the graph specialises on shapes. Otherwise a step compiled after
      another step function of the same code in the process (another state, another stage)
      would be compiled with dynamic shapes, and round differently from the same step
      compiled first: the simulated world and gloo would no longer agree bitwise.
    * ``regather`` (stage 3, one local rank, one micro-batch; :class:`fzero.units.CompiledUnits`):
      dynamo applies the side effects of a checkpointed region once
      (``skip_fwd_side_effects_in_bwd_under_checkpoint``; the units bind their gathered
      parameters inside one), and torch's warning about in-place ops in checkpointed regions
      with a ``context_fn`` is dropped (those regions recompute only the gather and views).
    """
    dynamo_flags = {"trace_autograd_ops": True}
    if regather:
        # compiled stage 3's units bind their gathered parameters inside a checkpointed region
        # (fzero.units.CompiledUnits): a side effect that must not replay in backward, where the
        # remat pass recomputes only the gather
        dynamo_flags["skip_fwd_side_effects_in_bwd_under_checkpoint"] = True
    functorch_flags = {"remat_using_tags_for_fwd_loss_bwd_graph": backward_regions == 1}
    compiled = torch.compile(_with_own_code(step), fullgraph=True, dynamic=False)
    warned = []
    # Made once and re-entered on every call: each config patch object owns a ContextVar, and a
    # context keeps every variable ever set in it, so a new patch per call grew the heap by
    # about 0.4 kB a step for the life of the process.
    patches = (torch._dynamo.config.patch(**dynamo_flags), torch._functorch.config.patch(**functorch_flags))

    def run(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, torch.Tensor]]:
        device = state.params[0].device if state.params else state.shard.master[0].device
        with patches[0], patches[1], _quiet_regather_warning(regather):
            if not state.rng:
                return compiled(state, batch)
            left: list[torch.Tensor] = []
            with rank_rng(state.rng[0][0], device, left):
                new_state, metrics = compiled(state, batch)
        rng = state.rng[0]
        if not torch.equal(left[0], rng[0]):
            if rng.shape[0] > 1 and not warned:
                warned.append(True)
                warnings.warn(
                    "fzero: a compiled step on a simulated world of several ranks drew random numbers: "
                    "every rank drew from one generator (rank 0's), unlike real ranks; run it eagerly "
                    "for per-rank randomness", RuntimeWarning, stacklevel=2)
            rng = torch.cat([left[0].unsqueeze(0), rng[1:]])
        return replace(new_state, rng=(rng,)), metrics

    return run


def no_missed_steps(opt: OptState) -> bool:
    """Whether it is known without a device sync that no parameter ever sat out a step
    (``opt.missed`` absent, or a CPU vector of zeros)."""
    if not opt.missed:
        return True
    missed = opt.missed[0]
    return missed.device.type == "cpu" and not bool(missed.any())


def _with_own_code(fn: StepFn) -> StepFn:
    """``fn`` with a code object of its own. Dynamo keeps compiled graphs on the code object,
    and every step ``make_train_step`` builds shares one: without a copy, each new step (another
    model, stage or option in the same process) adds a guarded entry there, a later one
    recompiles inside its first steps, and the ninth hits dynamo's recompile limit, which
    ``fullgraph=True`` makes a hard error."""
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    own.__kwdefaults__, own.__qualname__, own.__doc__ = fn.__kwdefaults__, fn.__qualname__, fn.__doc__
    return own


class _RegatherWarningFilter(logging.Filter):
    """Drops torch's warning that a checkpoint under compile with a ``context_fn`` must not
    contain in-place ops: stage 3's regions (fzero.units.CompiledUnits) recompute only the
    gather and views, never an in-place op of the unit's own."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "context_fn is passed to torch.utils.checkpoint" not in record.getMessage()


@contextlib.contextmanager
def _quiet_regather_warning(on: bool) -> Any:
    if not on:
        yield
        return
    log, quiet = logging.getLogger("torch._higher_order_ops.wrap"), _RegatherWarningFilter()
    log.addFilter(quiet)
    try:
        yield
    finally:
        log.removeFilter(quiet)


_CONSUMED = "_fzero_consumed"


def ensure_live(state: TrainState) -> None:
    """Raise ``ValueError`` if ``state`` was donated to a step (and so consumed)."""
    if getattr(state, _CONSUMED, False):
        raise ValueError(
            "this TrainState was donated to a step (donate=True) and consumed: its buffers now "
            "belong to the state that step returned; use that one"
        )


def _donated(state: TrainState) -> list[torch.Tensor]:
    return [*state.shard.master, *(m for ms in state.opt.moments for m in ms), *state.params]


def consume(old: TrainState, new: TrainState) -> TrainState:
    """Hand ``old``'s donated buffers to ``new`` and make ``old`` unusable.

    Each donated tensor of ``old`` (master shards, moments, gathered
    parameters) is emptied with ``set_()``. A tensor that ``new`` holds as the
    very same object is first replaced in ``new`` by a fresh tensor sharing its
    storage, so ``new`` keeps the data. No copy, no collective.
    """
    donated = {id(t): t for t in _donated(old)}

    def keep(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and id(x) in donated:
            return x.new_empty(0).set_(x)
        return x

    new = tp.tree_map(keep, new)
    for t in donated.values():
        t.set_()
    object.__setattr__(old, _CONSUMED, True)
    return new


@scoped(UPDATE)
def finish_step(
    state: TrainState,
    shards: tuple[torch.Tensor, ...],
    losses: torch.Tensor,
    comm: Communicator,
    *,
    clip_norm: Optional[float],
    donate: bool,
    replica_parts: Optional[torch.Tensor] = None,
    buffers_in: Optional[tuple[torch.Tensor, ...]] = None,
    used: Optional[torch.Tensor] = None,
    uniform: bool = False,
) -> tuple[TrainState, dict[str, torch.Tensor]]:
    """The part of a step after gradient reduction, shared by every stage.

    ``shards``: averaged, still scaled gradient shards per flat group
    ``[R, shard_numel]``; ``losses``: ``[R]`` unscaled per-rank losses.
    One ``all_reduce(sum)`` of two values per rank (and the ``used`` flags) gives the global norm, the
    agreed overflow flag (a non-finite norm) and the mean loss; then one pass
    unscales and clips, the optimizer runs (skipped by selection on overflow),
    the scale is updated, and for stages 1-2 the new compute-dtype parameters
    are all-gathered. ``buffers_in``: the module buffers the step was given; a skipped
    step returns them instead of what its forward left (``state.buffers``), selected
    branch-free, so NaN BatchNorm statistics of an overflowing step are not kept.
    ``used``: ``[R, T]``, nonzero where rank ``r`` had a gradient for trainable parameter
    ``t``; it rides on the all-reduce, and a parameter no rank had a gradient for is left
    alone (:func:`fzero.sharding.shard_step`'s ``used``). ``None``: every parameter steps.
    ``uniform`` (static): this rank had a gradient for every parameter, so every flag comes
    back set, and no parameter ever sat out a step: the plain update is exact.
    """
    scaler = state.scaler
    # One all-reduce of (sum of squares of the *scaled* gradients, loss) per rank. The sum is
    # non-finite exactly when some rank has a non-finite gradient (or a shard norm beyond
    # fp32's range, which clip_grad_norm_ would call infinite too): found_inf comes agreed.
    local = torch.stack([local_sq_norm(shards), losses.double()], dim=1)
    if used is not None:  # which parameters had a gradient rides along too
        local = torch.cat([local, used.to(local.device, torch.float64)], dim=1)
    n_used = 0 if used is None else used.shape[1]
    if replica_parts is not None:  # the replica digest rides along: no collective of its own
        local = torch.cat([local, replica_parts], dim=1)
    sums = comm.all_reduce(local, "sum")[0]
    used_any = None if used is None else sums[2:2 + n_used] > 0
    scale64 = scaler.scale.double()
    norm64 = sums[0].sqrt() / scale64
    loss = (sums[1] / comm.world_size).float()
    found_inf = (~torch.isfinite(norm64)).float()
    # Unscale and clip in one pass (DeepSpeed's fused form): multiply by 1/scale (float64
    # reciprocal rounded to fp32, as torch.amp does) times clip_grad_norm_'s coefficient.
    factor = scale64.reciprocal().float().double()
    if clip_norm is not None:
        factor = factor * torch.clamp(clip_norm / (norm64 + 1e-6), max=1.0)
    eager = not torch.compiler.is_compiling()
    if eager:  # the step's own gradient shards: unscaled in place, no second copy
        for s in shards:
            s.mul_(factor.to(s.dtype))
    else:
        shards = tuple(s * factor.to(s.dtype) for s in shards)
    new_shard, new_opt = shard_step(state.shard, state.opt, shards, found_inf, donate=donate,
                                    used=used_any, ranks=comm.ranks,
                                    uniform=uniform, comm=comm)
    # A donating step gathers into the parameters it was given: the next forward reads the
    # buffers it read, which the module's parameters view (eagerly nothing of the parameters'
    # size is allocated; compiled, the functional gather's result is copied in, so the module
    # does not keep the first step's buffers alive beside the state's).
    into = state.params if donate else None
    params = gather_step_params(new_shard, comm, state.precision.param_dtype, into) if state.params else ()
    buffers = state.buffers
    if buffers_in is not None:
        skip = found_inf.to(torch.bool)
        buffers = tuple(torch.where(skip.to(new.device), old, new) for old, new in zip(buffers_in, buffers))
    new_state = replace(
        state, shard=new_shard, opt=new_opt, scaler=update_scale(scaler, found_inf), params=params,
        buffers=buffers,
    )
    metrics = {
        "loss": loss,
        "found_inf": found_inf,
        "scale": scaler.scale,
        "grad_norm": norm64.float(),
    }
    if "lr" in state.opt.hyper[0]:  # a user's rule may have no learning rate
        metrics["lr"] = state.opt.hyper[0]["lr"].float()
    if replica_parts is not None:
        metrics["replicas_differ"] = parts_differ(sums[2 + n_used:], comm.world_size).float()
    return new_state, metrics
