"""Interchange with ``torch.optim``: the full model state dict and a ``torch.optim`` state dict
from a live state, and a state from them, for any rule with a ``torch.optim`` equivalent (SGD,
Adam, AdamW, and every class run by :func:`fzero.from_torch_optim`): the rule's own
``torch_state``/``from_torch_state``/``hyper_from_torch_group`` translate each parameter's state.

Memory: the exports gather one flat buffer at a time (one ``all_gather``); each
exported tensor is a view of that buffer, so the result is the only full copy.
The offline consolidation (:mod:`fzero.checkpoint.offline`) builds the same dicts
from a checkpoint with the same helpers (:func:`torch_order`, :func:`torch_optim_dict`).

Imports: :mod:`fzero.state` and below (``fzero.torch_optim_rules`` for a manifest's torch.optim
class), :mod:`fzero.checkpoint.errors`.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch

from ..comm import Communicator
from ..layout import Layout, flat_shard, group_views
from ..materialize import has_meta, to_empty_tied
from ..optim import Adam, Optimizer, SGD, init_vectors, vector_spans
from ..torch_optim_rules import torch_rule_from_manifest
from ..pytree import replace
from ..sharding import all_gather_params, check_world
from ..module import ModuleSpec, restore_parameters
from ..state import TrainState, ensure_live, hand_over_parameters
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


def _torch_class(optimizer: Optimizer) -> type:
    """The ``torch.optim`` class of ``optimizer`` (:meth:`~fzero.optim.Optimizer.torch_class`),
    or ``CheckpointMismatchError`` for a rule without one."""
    cls = optimizer.torch_class()
    if cls is None:
        raise CheckpointMismatchError(f"optimizer {optimizer.name} has no torch.optim equivalent: there is "
                                      "no torch.optim state dict to exchange")
    return cls


def _torch_param_group(optimizer: Any, hyper: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The param group (without ``params``) torch's optimizer class keeps for these
    hyperparameters: the class itself fills in every key of this torch version."""
    probe = _torch_class(optimizer)([torch.zeros(1, requires_grad=True)], **optimizer.torch_kwargs(hyper))
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
    _torch_class(opt)
    step = int(state.opt.step)
    own = own_steps(lay, step, state.opt.missed)
    moments: dict[int, dict[str, torch.Tensor]] = {}
    if step > 0 and opt.moment_names:
        for g in lay.groups:
            for name, rows in zip(opt.moment_names, state.opt.moments[g.index]):
                full = _full_flat(rows, comm)
                for i, v in zip(g.slots, group_views(lay, g, full)):
                    moments.setdefault(i, {})[name] = v.to(lay.slots[i].dtype)
    return torch_optim_dict(opt, _torch_order(lay, opt), step, state.opt.hyper, moments, own,
                            slot_scalars(lay, opt, state.opt.scalars), lay,
                            vectors=slot_vectors(lay, opt, state.opt.vectors))


def slot_vectors(layout: Layout, optimizer: Optimizer,
                 vectors: Sequence[torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    """``{slot index: {vector name: 1-D tensor}}`` from ``OptState.vectors`` (joined in
    ``Layout.trainable_slots`` order; copies, on the CPU); ``{}`` for a rule without any."""
    if not optimizer.vector_names or not vectors:
        return {}
    slots = [i for i, s in enumerate(layout.slots) if s.group >= 0]
    spans = vector_spans(optimizer, [layout.slots[i].shape for i in slots])
    out: dict[int, dict[str, torch.Tensor]] = {}
    for name, v, span in zip(optimizer.vector_names, vectors, spans):
        for i, (a, b) in zip(slots, span):
            out.setdefault(i, {})[name] = v[a:b].detach().cpu().clone()
    return out


def slot_scalars(layout: Layout, optimizer: Optimizer,
                 scalars: Sequence[torch.Tensor]) -> dict[int, dict[str, float]]:
    """``{slot index: {scalar name: value}}`` from ``OptState.scalars`` (``[T]`` vectors)."""
    slots = [i for i, s in enumerate(layout.slots) if s.group >= 0]
    values = [v.tolist() for v in scalars] if scalars else [[0.0] * len(slots) for _ in optimizer.scalar_names]
    return {i: {n: vs[k] for n, vs in zip(optimizer.scalar_names, values)} for k, i in enumerate(slots)}


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
    scalars: Optional[Mapping[int, Mapping[str, float]]] = None,
    layout: Optional[Any] = None,
    shapes: Optional[Mapping[int, tuple[tuple[int, ...], torch.dtype]]] = None,
    vectors: Optional[Mapping[int, Mapping[str, torch.Tensor]]] = None,
) -> dict[str, Any]:
    """A ``torch.optim`` state dict. ``optimizer``: an :class:`~fzero.optim.Optimizer` (its
    ``torch_state`` builds each parameter's state); ``order``: :func:`torch_order`;
    ``moments``: ``{slot: {name: tensor}}`` in the parameter's shape and dtype (used only when
    ``step > 0``); ``own``: each slot's own step count (:func:`own_steps`; default ``step``);
    ``scalars``: each slot's scalar state (:func:`slot_scalars`); ``layout`` or ``shapes``
    (``{slot: (shape, dtype)}``): the parameters' shapes; ``vectors``: each slot's vector state
    (:func:`slot_vectors`, for a rule with ``vector_names``). A parameter that never took a step
    has the state torch gives it before its first step (none for most classes)."""
    index = {slot: n for n, slot in enumerate(i for group in order for i in group)}
    if shapes is None:
        shapes = {i: (tuple(layout.slots[i].shape), layout.slots[i].dtype) for i in index} if layout else {}
    per_param: dict[int, dict[str, Any]] = {}
    for k, slots in enumerate(order):
        fills = _fills_at_construction(optimizer, hyper[k])
        for slot in slots:
            mine = step if own is None else own.get(slot, step)
            if mine > 0:
                extra = {"vectors": (vectors or {}).get(slot, {})} if optimizer.vector_names else {}
                st = optimizer.torch_state(mine, moments[slot] if optimizer.moment_names else {},
                                           (scalars or {}).get(slot, {}), *shapes.get(slot, ((), torch.float32)),
                                           **extra)
            elif fills:
                st = _initial_torch_state(optimizer, hyper[k], *shapes[slot])
            else:
                st = {}
            if st:
                per_param[index[slot]] = st
    groups = []
    for k, slots in enumerate(order):
        group = _torch_param_group(optimizer, hyper[k])
        group["params"] = [index[i] for i in slots]
        groups.append(group)
    return {"state": dict(sorted(per_param.items())), "param_groups": groups}


def rule_from_manifest(section: Mapping[str, Any]) -> Optimizer:
    """The update rule a checkpoint's manifest names, rebuilt for its torch.optim state dict
    (hyperparameter values come from the checkpoint): the built-ins, and ``torch.optim``'s own
    classes run by :func:`fzero.from_torch_optim` (found by name in ``torch.optim``: nothing a
    checkpoint names is imported). Others: ``CheckpointMismatchError`` naming the rule."""
    kind = section.get("kind")
    names = tuple((n, 0.0) for n in section["hyperparameters"][0])
    if kind == "sgd":
        return SGD(names, nesterov=bool(section.get("nesterov")), maximize=bool(section.get("maximize")),
                   momentum_buffer=bool(section.get("momentum_buffer")))
    if kind in ("adam", "adamw"):
        return Adam(names, decoupled=kind == "adamw", maximize=bool(section.get("maximize")),
                    amsgrad=bool(section.get("amsgrad")))
    if kind == "adafactor":
        from ..adafactor_rules import Adafactor

        return Adafactor(names, maximize=bool(section.get("maximize")))
    rule = torch_rule_from_manifest(section)
    if rule is None:
        raise CheckpointMismatchError(
            f"optimizer {kind}: only fzero's built-in rules and torch.optim's own classes can be rebuilt from a "
            "checkpoint; export_torch_optim_state_dict gives the state dict from a live state")
    return rule


def _fills_at_construction(optimizer: Optimizer, hyper: Mapping[str, torch.Tensor]) -> bool:
    """Whether the torch class gives a parameter state when it is constructed (Adagrad)."""
    return bool(_torch_class(optimizer)([torch.zeros(1)], **optimizer.torch_kwargs(hyper)).state)


def _initial_torch_state(optimizer: Optimizer, hyper: Mapping[str, torch.Tensor], shape: tuple[int, ...],
                         dtype: torch.dtype) -> dict[str, Any]:
    """A never-stepped parameter's state in a torch class that fills it at construction: what
    the class itself gives a parameter of this shape and dtype."""
    param = torch.zeros(shape, dtype=dtype)
    return dict(_torch_class(optimizer)([param], **optimizer.torch_kwargs(hyper)).state.get(param, {}))


def _torch_group_hyper(
    optimizer: Optimizer, k: int, group: Mapping[str, Any], template: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """fzero's hyperparameters of optimizer group ``k`` from a torch param group
    (:meth:`~fzero.optim.Optimizer.hyper_from_torch_group`); ``CheckpointMismatchError`` naming
    what differs when it belongs to another optimizer or to other static settings."""
    try:
        values = optimizer.hyper_from_torch_group(group)
    except ValueError as e:
        raise CheckpointMismatchError(f"torch param group {k} {e}") from None
    out = {}
    for name, t in template.items():
        if name not in values:
            raise CheckpointMismatchError(f"torch param group {k} has no {name!r}")
        out[name] = torch.tensor(float(values[name]), dtype=t.dtype, device=t.device)
    return out


def _torch_steps(optimizer: Optimizer, layout: Layout, per_slot: Mapping[int, Mapping[str, Any]]
                 ) -> tuple[int, list[int], list[dict[str, torch.Tensor]], list[dict[str, float]]]:
    """fzero's step count from torch's per-parameter state (the largest, the optimizer's); per
    trainable slot the steps it sat out (``OptState.missed``), its moments and scalars."""
    slots = [i for i, s in enumerate(layout.slots) if s.group >= 0]
    read = [optimizer.from_torch_state(per_slot.get(i, {})) for i in slots]
    step = max((r[0] for r in read), default=0)
    return step, [step - r[0] for r in read], [r[1] for r in read], [r[2] for r in read]


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
            leaves[i] = _moment_or_zeros(opt.from_torch_state(st)[1], name, lay.slots[i].shape)
        per_moment.append(_own_rows(lay, leaves, comm, dev))
    moments = tuple(tuple(m[g.index] for m in per_moment) for g in lay.groups)
    frozen_slots = [i for i, s in enumerate(lay.slots) if s.group < 0]
    frozen = tuple(
        params[i].to(device=f.device, dtype=lay.slots[i].dtype).clone()
        for i, f in zip(frozen_slots, template.shard.frozen)
    )
    count, missed, _, read_scalars = _torch_steps(opt, lay, per_slot)
    step = template.opt.step.new_tensor(count)
    shard = replace(template.shard, master=master, frozen=frozen)
    scalars = tuple(torch.tensor([s.get(name, 0.0) for s in read_scalars], dtype=torch.float64)
                    for name in opt.scalar_names)
    new_opt = replace(template.opt, step=step, hyper=hyper, moments=moments, scalars=scalars,
                      vectors=_torch_vectors(template, per_slot))
    if template.opt.missed or any(missed):
        new_opt = replace(new_opt, missed=(torch.tensor(missed, dtype=torch.int64, device=step.device),))
    gathered = all_gather_params(shard, comm, template.precision.param_dtype) if len(template.params) else ()
    return replace(template, shard=shard, opt=new_opt, params=gathered)


def _torch_vectors(template: TrainState, per_slot: Mapping[int, Mapping[str, Any]]) -> tuple[torch.Tensor, ...]:
    """``OptState.vectors`` from torch's per-parameter state (zeros for a parameter torch has
    not stepped); ``CheckpointMismatchError`` naming the state and parameter whose size differs."""
    lay, opt = template.layout, template.opt.optimizer
    if not opt.vector_names:
        return template.opt.vectors
    slots = [i for i, s in enumerate(lay.slots) if s.group >= 0]
    shapes = [lay.slots[i].shape for i in slots]
    out = [t.clone() for t in init_vectors(opt, shapes, template.opt.vectors[0].dtype if template.opt.vectors
                                           else template.shard.master[0].dtype, template.shard.master[0].device)]
    for i, shape, *spans in zip(slots, shapes, *vector_spans(opt, shapes)):
        read = opt.vectors_from_torch_state(per_slot.get(i, {}), tuple(shape))
        for name, v, (a, b) in zip(opt.vector_names, out, spans):
            if name not in read:
                continue
            if read[name].numel() != b - a:
                raise CheckpointMismatchError(
                    f"torch optimizer state {name!r} of {lay.slots[i].path!r} has {read[name].numel()} elements, "
                    f"this state's optimizer keeps {b - a} for its shape {tuple(shape)}")
            v[a:b] = read[name].detach().to(v.dtype)
    return tuple(out)


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
