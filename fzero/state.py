"""The training state and how it is built: :class:`TrainState`, :func:`init_train_state`. Building it hands the module's
parameters to the state (:func:`fzero.module.hand_over_parameters`); a donating step consumes the state it is given
(:func:`consume`, :func:`ensure_live`). :mod:`fzero.step` imports this module, never the reverse.

Imports: buckets, comm, layout, materialize, module, optim, precision, pytree, rng, scaler, sharding.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.utils._pytree as tp

from .buckets import size_buckets
from .comm import Communicator
from .layout import named_leaves
from .materialize import Init, check_init, materialize
from .module import (
    ModuleSpec,
    UnitPolicy,
    check_materialized,
    default_units,
    hand_over_frozen,
    hand_over_parameters,
    init_buffers,
    module_spec,
    release_parameters,
    select_units,
    unit_buckets,
)
from .optim import Optimizer, OptState, init_opt_state
from .precision import MixedPrecision
from .pytree import pytree_dataclass, replace, static_field
from .rng import init_rng
from .scaler import ScalerState, init_scaler, static_scaler
from .sharding import ShardState, all_gather_params, init_shard, shard_layout

__all__ = ["TrainState", "init_train_state", "ensure_live", "consume"]


@pytree_dataclass
class TrainState:
    """Everything a step carries to the next.

    ``params``: gathered compute-dtype flat buffers ``[R, padded_numel]``, one per flat group (stage 3: ``()``).
    ``buffers``: module buffers ``[R, *shape]``, own dtypes, ``ModuleSpec.buffers`` order. ``rng``: ``()`` or one ``[R,
    n]`` uint8 tensor (:mod:`fzero.rng`). ``calls``: ``()`` or one 0-d int64 CPU tensor, step calls seen, skipped
    included (host-side schedules count from it, so a resumed run keeps them; on CPU: no sync). Static: the ZeRO
    ``stage`` (1-3; only here), :class:`MixedPrecision` and :class:`ModuleSpec`."""

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

    @property
    def device(self) -> torch.device:
        """The device the state lives on (its shards'; ``init_train_state(device=...)``)."""
        held = (*self.shard.master, *self.shard.frozen, *self.params)
        return held[0].device if held else self.opt.step.device


def init_train_state(params: Any, optimizer: Optimizer, comm: Communicator, *, stage: int = 2,
                     units: UnitPolicy | None = None, bucket_numel: int | None = None,
                     precision: MixedPrecision = MixedPrecision(), scaler: ScalerState | None = None,
                     trainable: Callable[[str], bool] | None = None, alignment: int = 16,
                     seed: int | None = 0, init: Init | None = None,
                     device: torch.device | str | None = None,
                     groups: Mapping[str, Callable[[str], bool]] | None = None) -> TrainState:
    """The initial state for ``params`` (an ``nn.Module`` or a pytree of tensors); each local rank builds only its own
    shards. Stages 1-2 keep the gathered compute-dtype parameters, stage 3 none.

    ``units``: the wrap policy choosing an ``nn.Module``'s shard units (module classes or a predicate ``(name, module)
    -> bool``; allowed at stages 1-2 too): one bucket per unit, the rest and tied parameters to the root. Stage 3
    without it: the blocks a ``transformers`` model names in ``_no_split_modules`` (:func:`fzero.module.default_units`).
    ``bucket_numel`` (stages 1-2 without ``units``; default :func:`fzero.buckets.default_bucket_numel`): gradients are
    reduced in buckets (flat groups) of about this many elements as backward completes them (DDP's ``bucket_cap_mb``).
    ``scaler``: default dynamic in fp16, a static 1 otherwise. ``precision``: ``keep_dtype`` parameters get flat groups
    of their own (:meth:`MixedPrecision.keeps`). ``seed``: rank ``r``'s generator starts from ``rank_seed(seed, r)``;
    ``None``: the step draws from the caller's generator. ``device``: where the state lives; default the device of
    ``params`` (a model moved with ``.to("cuda:0")`` gives a state on ``cuda:0``), for a meta model built with
    ``init=`` (or :func:`fzero.pretrained`) the CPU. Every state tensor is built on it (the pieces and files go
    straight to it), but two kinds torch keeps on the host: the hyperparameters (0-d float64, taken by kernels as
    scalars) and the generators' states and ``calls`` counter (``TrainState``). ``ValueError``/``TypeError`` for a bad
    stage, units or bucket_numel, parameters on several devices, or a ``device`` other than theirs. Collectives:
    ``comm.check_layout``; stages 1-2 one ``all_gather`` per flat group.

    ``groups``: ``{name: predicate(path)}``, the trainable parameters sharded and averaged over parameter group
    ``name``'s communicator (``comm.param_group(name)``: an expert-data-parallel group, the ranks holding the same experts)
    instead of the world: their flat groups are their own, each rank group holds its own values of them (each rank
    builds them from its own ``params``), their gradients are summed over the rank group and divided by the world's
    size (the gradient of the world's mean loss, as DDP's), and the step's norm and overflow check see each of their
    elements once. Every other parameter is sharded over the world. A predicate with a ``values(path, rank_group)``
    method (:func:`fzero.moe.expert_parallel`'s) gives each rank group's own initial values where it returns one (one
    process holding every rank group). ``ValueError`` before any collective: a path in
    two groups, a group the communicator lacks or that matches no trainable parameter, a frozen parameter in a group,
    and what groups do not support yet (an update rule that is not elementwise, ``init=``)."""
    if stage not in (1, 2, 3):
        raise ValueError(f"init_train_state: stage must be 1, 2 or 3, got {stage!r}")
    is_module = isinstance(params, torch.nn.Module)
    if stage == 3 and units is None and not is_module:
        raise TypeError(f"init_train_state: stage 3 shards an nn.Module unit by unit, got {type(params).__name__}; "
                        "pytrees of tensors train at stages 1-2")
    if bucket_numel is not None and (stage == 3 or units is not None):
        raise ValueError("init_train_state: bucket_numel cuts stages 1-2 into gradient buckets by size; with "
                         "units= (or at stage 3) the shard units are the buckets: give one or the other")
    if units is not None and not is_module:
        raise TypeError("init_train_state: `units` chooses submodules of an nn.Module, got "
                        f"{type(params).__name__}; stage 3 shards an nn.Module "
                        "(pytrees of tensors train at stages 1-2)")
    # 1. the layout: the buckets (shard units, or sizes), the kept dtypes, built and checked across ranks
    if is_module and init is None:
        check_materialized(params)  # a module an earlier stage-3 state took: say so
    device = _state_device(params, device, made=init is not None)
    unit_names: tuple[str, ...] = ()
    if units is not None:
        unit_names = select_units(params, units)
    elif stage == 3:  # the default wrap policy: the blocks a transformers model names
        unit_names = default_units(params)
    bucket_of = unit_buckets(params, unit_names).__getitem__ if unit_names else None
    keep_dtype = precision.keeps(params)
    if bucket_of is None and stage < 3:
        bucket_of = size_buckets(params, bucket_numel, trainable).__getitem__
    axis_of = None
    if groups:
        axis_of = _axis_of(params, groups, comm, optimizer, init, trainable)
    layout = shard_layout(params, comm, trainable=trainable, optimizer=optimizer, alignment=alignment,
                          bucket_of=bucket_of, keep_dtype=keep_dtype, shard_frozen=stage == 3, axis_of=axis_of)
    # 2. the shards: filled by init on a meta model, else cut from the values params hold
    check_init(params, init)
    made_buffers = None
    if init is not None:
        made = materialize(params, layout, comm, init, unit_names, device)
        shard, made_buffers = ShardState(made.master, made.frozen, layout), made.buffers
        del made
    else:
        values = {name: g.values for name, g in (groups or {}).items() if callable(getattr(g, "values", None))}
        shard = init_shard(params, comm, layout=layout, frozen_storage=precision.frozen_storage, values=values)
    if precision.frozen_dtype is not None:  # rounded once; a module's frozen parameters hold the copy
        frozen, shard = list(shard.frozen), replace(shard, frozen=())
        shard = replace(shard, frozen=hand_over_frozen(params, layout, frozen, precision.frozen_storage))
    # 3. the state
    opt = init_opt_state(optimizer, shard.master, len(layout.trainable_slots),
                         [s.shape for s in layout.trainable_slots])
    # per parameter (a parameter group's: per rank group), the steps it sat out (make_train_step(unused="skip"))
    opt = replace(opt, missed=(torch.zeros(layout.num_positions, dtype=torch.int64, device=opt.step.device),))
    if scaler is None:
        scaler = init_scaler() if precision.param_dtype == torch.float16 else static_scaler(1.0)
    scaler = tp.tree_map(lambda t: t.to(device), scaler)  # scaled and unscaled on the device: no copy per step
    rng = () if seed is None else (init_rng(seed, comm.data_ranks, device),)
    spec, buffers = ModuleSpec(), ()
    if is_module:
        spec = replace(module_spec(params), units=unit_names)
        buffers = init_buffers(params, spec, comm.local_ranks) if made_buffers is None else made_buffers
        if stage == 3:  # the state holds the only copy, in shards: the module's parameters go to meta
            release_parameters(params, list(layout.paths))
    # stages 1-2: gathered group by group, a module's parameters made views of their group at once, so the module's own
    # copy of a group is freed before the next is gathered (init peak: one model and one group, not two models)
    gathered: list[torch.Tensor] = []
    for g in layout.groups if stage < 3 else ():
        gathered += all_gather_params(shard, comm, precision.param_dtype, groups=(g,))
        if is_module:
            hand_over_parameters(params, layout, gathered[-1:], groups=(g,))
    gathered = tuple(gathered)
    calls = (torch.zeros((), dtype=torch.int64, device="cpu"),)  # a host counter (TrainState), whatever the device
    return TrainState(shard, opt, scaler, gathered, buffers, rng, calls, stage, precision, spec)


def _axis_of(params: Any, groups: Mapping[str, Callable[[str], bool]], comm: Communicator, optimizer: Optimizer,
             init: Init | None, trainable: Callable[[str], bool] | None) -> Callable[[str], str]:
    """Each parameter's parameter group (``""``: the world) by the ``groups`` predicates, checked (ValueError)."""
    for name in groups:
        comm.param_group(name)  # a group the communicator lacks: named
    if not optimizer.elementwise:
        raise ValueError(f"init_train_state: groups= with {optimizer.name}, which updates shards by piece: parameter "
                         "groups take an elementwise rule yet (SGD, Adam, AdamW)")
    if init is not None:
        raise ValueError("init_train_state: groups= with init= (a meta model built piece by piece) is not supported "
                         "yet: build the model's values first")
    is_module = isinstance(params, torch.nn.Module)
    leaves = dict(named_leaves(params)[0])
    axis: dict[str, str] = {}
    for path in leaves:
        hits = [name for name, chosen in groups.items() if chosen(path)]
        if len(hits) > 1:
            raise ValueError(f"init_train_state: parameter {path!r} is in parameter groups {hits[0]!r} and "
                             f"{hits[1]!r}: each parameter is sharded over one group")
        axis[path] = hits[0] if hits else ""
    train = {p for p, x in leaves.items()
             if ((x.requires_grad if is_module else True) if trainable is None else bool(trainable(p)))}
    for name in groups:
        if not any(a == name and p in train for p, a in axis.items()):
            raise ValueError(f"init_train_state: groups[{name!r}] matches no trainable parameter")
    return axis.__getitem__


def _state_device(params: Any, device: torch.device | str | None, made: bool) -> torch.device:
    """The device a state of ``params`` lives on: ``device`` if given, else the one device their tensors are on (a meta
    model made by ``init=``: the CPU). ``ValueError`` naming a tensor on another device than the rest or ``device``.
    ``made``: ``init=`` builds the values (the module's buffers are copied to the device then, so not checked)."""
    if isinstance(params, torch.nn.Module):
        named = [*params.named_parameters(remove_duplicate=True),
                 *(() if made else params.named_buffers(remove_duplicate=True))]
    else:
        named = [(tp.keystr(path), x) for path, x in tp.tree_flatten_with_path(params)[0]
                 if isinstance(x, torch.Tensor)]
    # a model made by init= is on the meta device: its values are built on `device` (fzero.materialize); one without
    # init= on meta is refused by check_init, naming the way out
    placed = [(name, x.device) for name, x in named if not x.is_meta]
    if device is not None:
        want = torch.device(device)
    elif placed:
        want = placed[0][1]
    else:
        want = torch.device("cpu")
    if want.type == "cuda" and want.index is None:  # "cuda": the current device, as tensors made on it say
        want = torch.device("cuda", torch.cuda.current_device())
    for name, at in placed:
        if at != want:
            given = f"device={str(device)!r}" if device is not None else f"{placed[0][0]!r} on {placed[0][1]}"
            raise ValueError(f"init_train_state: {name!r} is on {at}, but {given}: a state lives on one device; "
                             f"move the model first (model.to({str(want)!r}))")
    return want


_CONSUMED = "_fzero_consumed"


def ensure_live(state: TrainState) -> None:
    """Raise ``ValueError`` if ``state`` was donated to a step (and so consumed)."""
    if getattr(state, _CONSUMED, False):
        raise ValueError("this TrainState was donated to a step (donate=True) and consumed: its buffers now "
                         "belong to the state that step returned; use that one")


def consume(old: TrainState, new: TrainState) -> TrainState:
    """Hand ``old``'s donated buffers (master shards, moments, gathered parameters) to ``new`` and make ``old``
    unusable: each emptied by ``set_()`` once ``new`` holds a fresh tensor sharing its storage instead. No copy, no
    collective."""
    donated = {id(t): t for t in [*old.shard.master, *(m for ms in old.opt.moments for m in ms), *old.params]}

    def keep(x: Any) -> Any:
        return x.new_empty(0).set_(x) if isinstance(x, torch.Tensor) and id(x) in donated else x

    new = tp.tree_map(keep, new)
    for t in donated.values():
        t.set_()
    object.__setattr__(old, _CONSUMED, True)
    return new
