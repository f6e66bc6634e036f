"""Interchange with ``torch.optim``: the full model state dict and a ``torch.optim`` (SGD, Adam,
AdamW) state dict from a live state, and a state from them.

Memory: the exports gather one flat buffer at a time (one ``all_gather``); each
exported tensor is a view of that buffer, so the result is the only full copy.
The offline consolidation (:mod:`fzero.checkpoint.offline`) builds the same dicts
from a checkpoint with the same helpers (:func:`torch_order`, :func:`torch_optim_dict`).

Imports: :mod:`fzero.step` and below, :mod:`fzero.checkpoint.errors`.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch

from ..comm import Communicator
from ..layout import Layout, flat_shard, group_views
from ..materialize import has_meta, to_empty_tied
from ..optim import Optimizer
from ..pytree import replace
from ..sharding import check_world, gather_flat_params
from ..module import ModuleSpec, restore_parameters
from ..step import TrainState, ensure_live, hand_over_parameters
from .errors import CheckpointMismatchError

def _full_flat(rows: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """The full padded flat buffer ``[W * shard_numel]`` from this process's ``[R, shard_numel]`` rows.

    One ``all_gather`` on a process group; in one process holding every rank the
    rows already are the buffer (copied, so exports never alias the state).
    """
    if comm.local_ranks == comm.world_size:
        return rows.reshape(-1).clone()
    if comm.local_ranks != 1:
        raise TypeError(f"export: unsupported communicator: {comm.local_ranks} of {comm.world_size} ranks here")
    return comm.all_gather(rows)[0]


def _torch_order(layout: Layout, optimizer: Optimizer) -> list[list[int]]:
    """Per optimizer group, the indices into ``layout.slots`` of its parameters in tree order:
    the order of the ``params`` of a torch optimizer built group by group from the model's
    parameters. torch numbers parameters consecutively in that order."""
    opt_groups = [layout.groups[s.group].opt_group if s.group >= 0 else -1 for s in layout.slots]
    return torch_order(opt_groups, optimizer.num_groups)


def torch_order(opt_groups: Sequence[int], num_groups: int) -> list[list[int]]:
    """:func:`_torch_order` from each parameter's optimizer group in tree order (-1: frozen)."""
    order: list[list[int]] = [[] for _ in range(num_groups)]
    for i, k in enumerate(opt_groups):
        if k >= 0:
            order[k].append(i)
    return order


_TORCH_CLASSES = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def _torch_kwargs(optimizer: Any, hyper: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    h = {k: float(v) for k, v in hyper.items()}
    if optimizer.kind == "sgd":
        return dict(
            lr=h["lr"], momentum=h["momentum"], dampening=h["dampening"], weight_decay=h["weight_decay"],
            nesterov=optimizer.nesterov, maximize=optimizer.maximize,
        )
    return dict(
        lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"], weight_decay=h["weight_decay"],
        amsgrad=optimizer.amsgrad, maximize=optimizer.maximize,
    )


def _torch_param_group(optimizer: Any, hyper: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The param group (without ``params``) torch's optimizer class keeps for these
    hyperparameters: the class itself fills in every key of this torch version."""
    cls = _TORCH_CLASSES[optimizer.kind]
    probe = cls([torch.zeros(1, requires_grad=True)], **_torch_kwargs(optimizer, hyper))
    group = dict(probe.param_groups[0])
    del group["params"]
    return group


def export_model_state_dict(state: TrainState, comm: Communicator) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` of the trained model: what ``load_state_dict(strict=True)`` takes.

    Parameters: the fp32 master's values cast to each parameter's own dtype and
    shape; frozen parameters copied. For a module: its persistent buffers (rank
    0's, as DDP's checkpoints hold them), every tied name (GPT-2's
    ``lm_head.weight``, the same tensor as ``transformer.wte.weight``, as torch
    has it), in the module's ``state_dict`` order. Collectives: one
    ``all_gather`` per flat group, one at a time; every exported trainable
    tensor is a view of its group's gathered buffer, so at most one full copy of
    the parameters exists.
    """
    ensure_live(state)
    check_world(state.shard, comm)
    lay = state.layout
    out: dict[str, torch.Tensor] = {}
    for g in lay.groups:
        full = _full_flat(state.shard.master[g.index], comm)
        for i, v in zip(g.slots, group_views(lay, g, full)):
            out[lay.slots[i].path] = v.to(lay.slots[i].dtype)
    for s, f in zip(lay.frozen_slots, state.shard.frozen):
        out[s.path] = f.detach().clone()
    spec = state.module
    buffers = {n: b[0].clone() for n, b, keep in zip(spec.buffers, state.buffers, spec.persistent) if keep}
    return module_state_dict({s.path: out[s.path] for s in lay.slots}, buffers, spec)


def module_state_dict(
    params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], spec: ModuleSpec
) -> dict[str, torch.Tensor]:
    """Parameters and buffers by canonical name, completed with tied names and put in
    the module's ``state_dict`` order (tree order for a pytree, whose spec is empty)."""
    out = {**params, **buffers}
    for alias, canonical in spec.aliases:
        if canonical in out:
            out[alias] = out[canonical]
    if not spec.state_dict_keys:
        return out
    return {k: out[k] for k in spec.state_dict_keys if k in out}


def write_back(state: TrainState, comm: Communicator, module: torch.nn.Module) -> torch.nn.Module:
    """Put the trained parameters and buffers (rank 0's) into ``module``.

    ``module`` is the model the state was built from (or one of the same
    architecture). Stages 1-2: each parameter whose dtype is the compute dtype
    becomes a view of this state's gathered parameters (no copy; as after
    :func:`fzero.init_train_state`); stage 3 (and parameters of another dtype):
    the values are copied in, giving parameters left on the meta device by
    ``init_train_state`` (a stage-3 state, or a model built on meta for
    ``init_train_state(init=...)``) memory of their own first
    (:func:`fzero.materialize.to_empty_tied`: tied names stay tied). Then the
    buffers, the non-persistent ones too. Collectives: those of
    :func:`export_model_state_dict`. Returns ``module``.
    """
    exported = export_model_state_dict(state, comm)
    viewed: set[str] = set()
    if state.params:
        viewed = hand_over_parameters(module, state.layout, state.params, stage=2)
    viewed |= {alias for alias, canonical in state.module.aliases if canonical in viewed}
    # parameters on meta get memory in place (the same Parameter objects; ties kept), and the
    # guard a stage-3 state installed goes; buffers of a model built on meta get it next
    restore_parameters(module, exported)
    if has_meta(module):
        to_empty_tied(module)
    _, unexpected = module.load_state_dict({k: v for k, v in exported.items() if k not in viewed}, strict=False)
    missing = set(module.state_dict(keep_vars=True)) - set(exported)
    if missing or unexpected:
        raise ValueError(f"write_back: the module does not match the state: missing {sorted(missing)[:4]}, "
                         f"unexpected {sorted(unexpected)[:4]}")
    named = dict(module.named_buffers())
    with torch.no_grad():
        for n, b, keep in zip(state.module.buffers, state.buffers, state.module.persistent):
            if not keep and n in named:
                named[n].copy_(b[0])
    return module


def export_torch_optim_state_dict(state: TrainState, comm: Communicator) -> dict[str, Any]:
    """The ``state_dict()`` of the ``torch.optim`` optimizer (SGD, Adam or AdamW) that
    would have trained the same model the same way; ``load_state_dict`` takes it as it is.

    Parameters are numbered as torch numbers them for an optimizer built from the
    model's trainable parameters group by group (optimizer group 0 first), each group
    in tree order: with one group, the model's parameter order. Per parameter:
    ``step`` (Adam/AdamW; a float32 0-d tensor, torch's non-capturable default) and
    the moments in the parameter's dtype; empty before the first applied step, as in
    torch. ``param_groups``: torch's keys for this torch version, the hyperparameters
    from the state. Collectives: one ``all_gather`` per flat group and moment, one at
    a time; exported moments are views of the gathered buffers.
    """
    ensure_live(state)
    check_world(state.shard, comm)
    lay, opt = state.layout, state.opt.optimizer
    step = int(state.opt.step)
    own = own_steps(lay, step, state.opt.missed)
    moments: dict[int, dict[str, torch.Tensor]] = {}
    if step > 0 and opt.moment_names:
        for g in lay.groups:
            for name, rows in zip(opt.moment_names, state.opt.moments[g.index]):
                full = _full_flat(rows, comm)
                for i, v in zip(g.slots, group_views(lay, g, full)):
                    moments.setdefault(i, {})[name] = v.to(lay.slots[i].dtype)
    return torch_optim_dict(opt, _torch_order(lay, opt), step, state.opt.hyper, moments, own)


def own_steps(layout: Layout, step: int, missed: Sequence[torch.Tensor]) -> dict[int, int]:
    """``{slot index: its own step count}`` (``step`` less the steps the parameter sat out
    without a gradient, ``OptState.missed``), for the trainable slots."""
    counts = missed[0].tolist() if missed else [0] * len(layout.trainable_slots)
    slots = [i for i, s in enumerate(layout.slots) if s.group >= 0]
    return {i: step - int(m) for i, m in zip(slots, counts)}


def torch_optim_dict(
    optimizer: Any,
    order: Sequence[Sequence[int]],
    step: int,
    hyper: Sequence[Mapping[str, torch.Tensor]],
    moments: Mapping[int, Mapping[str, torch.Tensor]],
    own: Optional[Mapping[int, int]] = None,
) -> dict[str, Any]:
    """A ``torch.optim`` state dict. ``optimizer``: anything with fzero's ``kind``, ``nesterov``,
    ``maximize``, ``amsgrad`` and ``moment_names`` (an :class:`Optimizer`, or a manifest's
    ``optimizer`` section); ``order``: :func:`torch_order`; ``moments``: ``{slot: {name: tensor}}``
    in the parameter's shape and dtype (used only when ``step > 0``); ``own``: each slot's own
    step count (:func:`own_steps`; default ``step``): a parameter that never took a step has no
    state, as in torch."""
    index = {slot: n for n, slot in enumerate(i for group in order for i in group)}
    per_param: dict[int, dict[str, Any]] = {}
    if step > 0 and optimizer.moment_names:
        for slot, n in index.items():
            mine = step if own is None else own.get(slot, step)
            if mine <= 0:
                continue
            per_param[n] = {} if optimizer.kind == "sgd" else {"step": torch.tensor(float(mine), dtype=torch.float32)}
            for name in optimizer.moment_names:
                per_param[n][name] = moments[slot][name]
    groups = []
    for k, slots in enumerate(order):
        group = _torch_param_group(optimizer, hyper[k])
        group["params"] = [index[i] for i in slots]
        groups.append(group)
    return {"state": dict(sorted(per_param.items())), "param_groups": groups}


def _torch_group_hyper(
    optimizer: Optimizer, k: int, group: Mapping[str, Any], template: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """fzero's hyperparameters of optimizer group ``k`` from a torch param group;
    ``CheckpointMismatchError`` naming what differs when it belongs to another kind
    of optimizer or to other static flags."""
    if "betas" in group:
        # torch >= 2.6 tells Adam from AdamW by this key; without it either reads the other's state.
        known = "decoupled_weight_decay" in group
        kind = "adamw" if group.get("decoupled_weight_decay") else "adam"
    elif "momentum" in group:
        known, kind = True, "sgd"
    else:
        raise CheckpointMismatchError(f"torch param group {k}: neither SGD's 'momentum' nor Adam's 'betas'")
    is_sgd = kind == "sgd"
    if kind != optimizer.kind and (known or is_sgd or optimizer.kind == "sgd"):
        raise CheckpointMismatchError(
            f"torch param group {k} belongs to {kind}, this state's optimizer is {optimizer.kind}"
        )
    flags = {"maximize": optimizer.maximize}
    if is_sgd:
        flags["nesterov"] = optimizer.nesterov
        if (float(group["momentum"]) != 0) != optimizer.momentum_buffer:
            raise CheckpointMismatchError(
                f"torch param group {k}: momentum {group['momentum']} but this state's SGD "
                f"{'has' if optimizer.momentum_buffer else 'has no'} momentum buffer"
            )
    else:
        flags["amsgrad"] = optimizer.amsgrad
    for flag, mine in flags.items():
        if bool(group.get(flag, False)) != mine:
            raise CheckpointMismatchError(f"torch param group {k}: {flag} {group.get(flag)}, here {mine}")
    values = dict(group)
    if not is_sgd:
        values["beta1"], values["beta2"] = group["betas"]
    out = {}
    for name, t in template.items():
        if name not in values:
            raise CheckpointMismatchError(f"torch param group {k} has no {name!r}")
        out[name] = torch.tensor(float(values[name]), dtype=t.dtype, device=t.device)
    return out


def _own_torch_step(optimizer: Optimizer, state: Mapping[str, Any]) -> int:
    """One parameter's step count in torch's state (SGD keeps none: 1 once it has a momentum
    buffer, which exists from the parameter's first step)."""
    if optimizer.kind == "sgd":
        return int(state.get("momentum_buffer") is not None)
    return int(float(state["step"])) if "step" in state else 0


def _torch_steps(optimizer: Optimizer, layout: Layout,
                 per_slot: Mapping[int, Mapping[str, Any]]) -> tuple[int, list[int]]:
    """fzero's step count from torch's per-parameter state (the largest, the optimizer's), and
    per trainable slot the steps it sat out (``OptState.missed``)."""
    slots = [i for i, s in enumerate(layout.slots) if s.group >= 0]
    own = [_own_torch_step(optimizer, per_slot.get(i, {})) for i in slots]
    step = max(own, default=0)
    return step, [step - k for k in own]


def import_torch_optim_state_dict(
    template: TrainState,
    model_state_dict: Mapping[str, torch.Tensor],
    optim_state_dict: Mapping[str, Any],
    comm: Communicator,
) -> TrainState:
    """A state for ``template``'s model, optimizer and world holding a ``torch.optim`` run's
    parameters and optimizer state, to continue a run trained without fzero.

    ``model_state_dict``: ``{path: tensor}`` (``module.state_dict()``; extra keys such
    as buffers are ignored). ``optim_state_dict``: a ``torch.optim.SGD/Adam/AdamW``
    ``state_dict()`` of an optimizer built group by group like fzero's groups (see
    :func:`export_torch_optim_state_dict`); parameters are matched by position within
    each group. Hyperparameters come from its param groups; scaler and precision
    from ``template``. Each rank slices out only its own shards: no collective but
    the ``all_gather`` that rebuilds ``params`` (skipped when the template's is empty).
    Raises :class:`CheckpointMismatchError` naming what differs (missing parameter,
    shape, group sizes, optimizer kind or flags).
    """
    ensure_live(template)
    check_world(template.shard, comm)
    lay, opt = template.layout, template.opt.optimizer
    params = _torch_params(lay, model_state_dict)
    hyper, per_slot = _torch_groups(template, optim_state_dict)
    dev = template.shard.master[0].device
    master = _own_rows(lay, params, comm, dev)
    per_moment = []
    for name in opt.moment_names:
        leaves: list[Optional[torch.Tensor]] = [None] * len(lay.slots)
        for i, st in per_slot.items():
            leaves[i] = _moment_or_zeros(st, name, lay.slots[i].shape)
        per_moment.append(_own_rows(lay, leaves, comm, dev))
    moments = tuple(tuple(m[g.index] for m in per_moment) for g in lay.groups)
    frozen_slots = [i for i, s in enumerate(lay.slots) if s.group < 0]
    frozen = tuple(
        params[i].to(device=f.device, dtype=lay.slots[i].dtype).clone()
        for i, f in zip(frozen_slots, template.shard.frozen)
    )
    count, missed = _torch_steps(opt, lay, per_slot)
    step = template.opt.step.new_tensor(count)
    shard = replace(template.shard, master=master, frozen=frozen)
    new_opt = replace(template.opt, step=step, hyper=hyper, moments=moments)
    if template.opt.missed or any(missed):
        new_opt = replace(new_opt, missed=(torch.tensor(missed, dtype=torch.int64, device=step.device),))
    gathered = gather_flat_params(shard, comm, template.precision.param_dtype) if len(template.params) else ()
    return replace(template, shard=shard, opt=new_opt, params=gathered)


def _own_rows(
    layout: Layout, leaves: Sequence[Optional[torch.Tensor]], comm: Communicator, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """This process's ``[R, shard_numel]`` rows of every flat group, from full per-slot
    ``leaves`` (None for slots outside the groups): each rank copies only its own slice."""
    return tuple(
        torch.stack([flat_shard(layout, g, leaves, r) for r in comm.ranks]).to(device) for g in layout.groups
    )


def _torch_params(layout: Layout, model_state_dict: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """Every parameter of ``layout`` from a model state dict, in slot order, shapes checked."""
    params = []
    for s in layout.slots:
        t = model_state_dict.get(s.path)
        if t is None:
            raise CheckpointMismatchError(f"model state dict has no parameter {s.path!r}")
        if tuple(t.shape) != s.shape:
            raise CheckpointMismatchError(
                f"model state dict: {s.path!r} has shape {tuple(t.shape)}, this model {s.shape}"
            )
        params.append(t.detach())
    return params


def _torch_groups(
    template: TrainState, optim_state_dict: Mapping[str, Any]
) -> tuple[tuple[dict[str, torch.Tensor], ...], dict[int, Mapping[str, Any]]]:
    """fzero's hyperparameters per optimizer group, and torch's per-parameter state by
    slot index (``{}`` for a parameter torch has not stepped): torch's parameters are
    matched by position within each param group to the group's slots in tree order."""
    lay, opt = template.layout, template.opt.optimizer
    groups = optim_state_dict["param_groups"]
    if len(groups) != opt.num_groups:
        raise CheckpointMismatchError(
            f"torch optimizer has {len(groups)} param groups, this state's optimizer {opt.num_groups}"
        )
    torch_state = optim_state_dict.get("state", {})
    per_slot: dict[int, Mapping[str, Any]] = {}
    hyper = []
    for k, (group, slots) in enumerate(zip(groups, _torch_order(lay, opt))):
        if len(group["params"]) != len(slots):
            raise CheckpointMismatchError(
                f"torch param group {k} has {len(group['params'])} parameters, this state's {len(slots)}"
            )
        hyper.append(_torch_group_hyper(opt, k, group, template.opt.hyper[k]))
        for pid, i in zip(group["params"], slots):
            per_slot[i] = torch_state.get(pid, {})
    return tuple(hyper), per_slot


def _moment_or_zeros(state: Mapping[str, Any], name: str, shape: tuple[int, ...]) -> torch.Tensor:
    # A parameter torch has not stepped yet has no state: its moments are zero.
    t = state.get(name)
    if t is None:
        return torch.zeros(shape)
    if tuple(t.shape) != shape:
        raise CheckpointMismatchError(
            f"torch optimizer state {name!r} has shape {tuple(t.shape)}, expected {shape}"
        )
    return t.detach()
