"""The training state and how it is built: :class:`TrainState`, :func:`init_train_state`.

A :class:`TrainState` is everything a step carries from one step to the next: this
process's shards and master copy (:class:`~fzero.sharding.ShardState`), the optimizer
state (:class:`~fzero.optim.OptState`), the loss scale (:class:`~fzero.scaler.ScalerState`),
the gathered compute-dtype parameters (stages 1-2), the module's buffers and each local
rank's generator state. Static: the :class:`~fzero.precision.MixedPrecision` policy and the
:class:`~fzero.module.ModuleSpec` (which names the stage-3 units: the state knows its stage).

Building it (:func:`init_train_state`) hands the module's parameters to the state
(:func:`hand_over_parameters`); a donating step consumes the state it is given
(:func:`consume`, :func:`ensure_live`). No step composition here: :mod:`fzero.step`
imports this module, never the reverse.

Imports: buckets, comm, layout, materialize, module, optim, precision, pytree,
rng, scaler, sharding, units.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
import torch.utils._pytree as tp

from .buckets import size_buckets
from .comm import Communicator
from .layout import FlatGroup, group_views, named_leaves
from .materialize import Init, check_init, materialized_shard
from .module import (ModuleSpec, UnitPolicy, adopt_parameters, check_materialized, default_units, init_buffers,
                     module_spec, release_parameters, select_units, unit_buckets)
from .optim import OptState, Optimizer, init_opt_state
from .precision import MixedPrecision
from .pytree import pytree_dataclass, replace, static_field
from .rng import init_rng
from .scaler import ScalerState, init_scaler, static_scaler
from .sharding import ShardState, all_gather_params, init_shard

__all__ = ["TrainState", "init_train_state", "hand_over_parameters", "ensure_live", "consume"]


@pytree_dataclass
class TrainState:
    """Everything a training step carries from one step to the next.

    ``params``: the gathered compute-dtype flat buffers ``[R, padded_numel]``,
    one per flat group (stages 1 and 2 keep full parameters between steps;
    ``()`` for stage 3). ``buffers``: the module's buffers, one ``[R, *shape]``
    tensor each in its own dtype, in ``ModuleSpec.buffers`` order (each rank's
    copy, as each DDP rank has its own). ``rng``: ``()`` or one ``[R, n]``
    uint8 tensor, each rank's generator state (see :mod:`fzero.rng`).
    ``calls``: ``()`` or one 0-d int64 CPU tensor, the step calls this state has seen,
    skipped steps included (``opt.step`` counts applied updates): what the step's host-side
    schedules (the replica check's every N calls) are counted from, so a run resumed from a
    checkpoint keeps its schedule. On the CPU whatever the device: read without a device sync.
    Static: the ZeRO ``stage`` (1, 2 or 3; the one place that says it), the
    :class:`MixedPrecision` policy and the :class:`ModuleSpec`.
    """

    shard: ShardState
    opt: OptState
    scaler: ScalerState
    params: tuple[torch.Tensor, ...]
    buffers: tuple[torch.Tensor, ...] = ()
    rng: tuple[torch.Tensor, ...] = ()
    calls: tuple[torch.Tensor, ...] = ()
    stage: int = static_field(default=2)
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

    ``precision``: with a ``param_dtype``, the parameters of its ``keep_dtype`` module
    classes (BatchNorm by default) keep their own dtype, in flat groups of their own
    (:meth:`MixedPrecision.keeps`; a ``ValueError`` for a BatchNorm left out whose
    statistics are not in ``param_dtype``).

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
    layout_kw = dict(trainable=trainable, optimizer=optimizer, alignment=alignment, bucket_of=bucket_of,
                     keep_dtype=precision.keeps(params))
    if init is None:
        shard, made_buffers = init_shard(params, comm, **layout_kw), None
    else:
        shard, made_buffers = materialized_shard(params, comm, init, unit_names, **layout_kw)
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
            gathered = []
            for g in shard.layout.groups:
                gathered += all_gather_params(shard, comm, precision.param_dtype, groups=(g,))
                hand_over_parameters(params, shard.layout, gathered[-1:], stage, groups=(g,))
            gathered = tuple(gathered)
    elif stage < 3:
        gathered = all_gather_params(shard, comm, precision.param_dtype)
    calls = (torch.zeros((), dtype=torch.int64),)
    return TrainState(shard, opt, scaler, gathered, buffers, rng, calls, stage, precision, spec)


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
