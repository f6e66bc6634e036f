"""Interchange with ``torch.optim``: the model state dict and a ``torch.optim`` state dict from a live state,
and a state from them, for every rule with a ``torch.optim`` equivalent (:func:`torch_equivalent`). Exports
gather one flat buffer at a time; :mod:`fzero.checkpoint.offline` builds the same dicts from a checkpoint.

Imports: comm, layout, materialize, optim, torch_optim_rules, adafactor_rules, pytree, sharding, module, state, errors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch.optim.optimizer import _get_scalar_dtype

from ..adafactor_rules import Adafactor
from ..comm import Communicator
from ..layout import FlatGroup, Layout, ParamSlot, group_views, trainable_index
from ..materialize import has_meta, to_empty_tied
from ..module import ModuleSpec, hand_over_parameters, restore_parameters
from ..optim import SGD, Adam, Optimizer, init_vectors, vector_spans
from ..pytree import replace
from ..sharding import all_gather_params, check_world, frozen_params, frozen_rows, group_comm, shard_rows
from ..state import TrainState, ensure_live
from ..torch_optim_rules import STEP, TorchOptimRule, tuple_names
from .errors import CheckpointMismatchError, refuse_param_groups

# what a parameter's torch state reads as: (own step count, moments, scalars, vectors), those present
Read = tuple[int, dict[str, torch.Tensor], dict[str, float], dict[str, torch.Tensor]]


class TorchEquivalent(NamedTuple):
    """A rule's ``torch.optim`` class and the translation of its state (:func:`torch_equivalent`)."""

    cls: type
    #: the class's constructor arguments for one group's hyperparameters (as floats)
    kwargs: Callable[[Mapping[str, float]], dict[str, Any]]
    #: one parameter's torch state from ``(own step > 0, moments, scalars, shape, dtype, vectors)``
    to_torch: Callable[..., dict[str, Any]]
    from_torch: Callable[[Mapping[str, Any]], Read]
    #: fzero's hyperparameters from a torch param group; ``ValueError`` naming what differs ("belongs to adam")
    hyper: Callable[[Mapping[str, Any]], dict[str, float]]


def _step_of(state: Mapping[str, Any], key: str = "step") -> int:
    return int(float(state[key])) if key in state else 0


def _present(state: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    return {k: state[k] for k in names if k in state}


def _same_flags(group: Mapping[str, Any], flags: Mapping[str, bool]) -> None:
    for flag, mine in flags.items():
        if bool(group.get(flag, False)) != mine:
            raise ValueError(f"has {flag} {group.get(flag)}, here {mine}")


def _sgd(opt: SGD) -> TorchEquivalent:
    def kwargs(h: Mapping[str, float]) -> dict[str, Any]:
        return dict(lr=h["lr"], momentum=h["momentum"], dampening=h["dampening"], weight_decay=h["weight_decay"],
                    nesterov=opt.nesterov, maximize=opt.maximize)

    def from_torch(state: Mapping[str, Any]) -> Read:
        # SGD keeps no step: 1 once it has a momentum buffer, which exists from the first step
        buf = state.get("momentum_buffer")
        return int(buf is not None), ({} if buf is None else {"momentum_buffer": buf}), {}, {}

    def hyper(group: Mapping[str, Any]) -> dict[str, float]:
        if "momentum" not in group or "betas" in group:
            other = "adam or adamw" if "betas" in group else "another optimizer"
            raise ValueError(f"belongs to {other} (no 'momentum'), this state's optimizer is sgd")
        if (float(group["momentum"]) != 0) != opt.momentum_buffer:
            raise ValueError(f"has momentum {group['momentum']} but this state's SGD "
                             f"{'has' if opt.momentum_buffer else 'has no'} momentum buffer")
        _same_flags(group, {"maximize": opt.maximize, "nesterov": opt.nesterov})
        return {k: float(group[k]) for k, _ in opt.defaults if k in group}

    return TorchEquivalent(torch.optim.SGD, kwargs, lambda own, moments, *_: dict(moments), from_torch, hyper)


def _adam(opt: Adam) -> TorchEquivalent:
    def kwargs(h: Mapping[str, float]) -> dict[str, Any]:
        return dict(lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"], weight_decay=h["weight_decay"],
                    amsgrad=opt.amsgrad, maximize=opt.maximize)

    def to_torch(own: int, moments: Mapping[str, torch.Tensor], *_: Any) -> dict[str, Any]:
        return {"step": torch.tensor(float(own), dtype=torch.float32), **moments}  # torch's non-capturable step

    def hyper(group: Mapping[str, Any]) -> dict[str, float]:
        if "betas" not in group:
            raise ValueError(f"belongs to {'sgd' if 'momentum' in group else 'another optimizer'}, "
                             f"this state's optimizer is {opt.name}")
        # torch >= 2.6 tells Adam from AdamW by this key; without it either reads the other's state
        if "decoupled_weight_decay" in group and bool(group["decoupled_weight_decay"]) != opt.decoupled:
            kind = "adamw" if group["decoupled_weight_decay"] else "adam"
            raise ValueError(f"belongs to {kind}, this state's optimizer is {opt.name}")
        _same_flags(group, {"maximize": opt.maximize, "amsgrad": opt.amsgrad})
        values = {**group, "beta1": group["betas"][0], "beta2": group["betas"][1]}
        return {k: float(values[k]) for k, _ in opt.defaults if k in values}

    return TorchEquivalent(torch.optim.AdamW if opt.decoupled else torch.optim.Adam, kwargs, to_torch,
                           lambda state: (_step_of(state), _present(state, opt.moment_names), {}, {}), hyper)


def _adafactor(opt: Adafactor) -> TorchEquivalent:
    def kwargs(h: Mapping[str, float]) -> dict[str, Any]:
        return dict(lr=h["lr"], beta2_decay=h["beta2_decay"], eps=(h.get("eps1"), h["eps2"]), d=h["d"],
                    weight_decay=h["weight_decay"], maximize=opt.maximize)

    def to_torch(own: int, moments: Mapping[str, torch.Tensor], scalars: Mapping[str, float], shape: tuple[int, ...],
                 dtype: torch.dtype, vectors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        # torch factors two dimensions or more: row_var [..., R, 1] and col_var [..., 1, C], else variance
        step = {"step": torch.tensor(float(own), dtype=_get_scalar_dtype())}
        if len(shape) < 2:
            return {**step, "variance": moments["variance"]}
        return {**step, "row_var": vectors["row_var"].reshape(*shape[:-1], 1).to(dtype),
                "col_var": vectors["col_var"].reshape(*shape[:-2], 1, shape[-1]).to(dtype)}

    def from_torch(state: Mapping[str, Any]) -> Read:
        return (_step_of(state), _present(state, opt.moment_names), {},
                {k: v.reshape(-1) for k, v in _present(state, opt.vector_names).items()})

    def hyper(group: Mapping[str, Any]) -> dict[str, float]:
        if "beta2_decay" not in group or "d" not in group:
            raise ValueError(f"belongs to another optimizer than {opt.name} (no 'beta2_decay' or 'd')")
        _same_flags(group, {"maximize": opt.maximize})
        eps1, eps2 = group["eps"]
        mine = "eps1" in dict(opt.defaults)
        if (eps1 is not None) != mine:
            raise ValueError(f"has eps1 {eps1!r}, here {'a number' if mine else 'None'} (eps1 None and a "
                             "number are different configurations)")
        out = {k: float(group[k]) for k in ("lr", "beta2_decay", "d", "weight_decay")}
        return {**out, "eps2": float(eps2), **({} if eps1 is None else {"eps1": float(eps1)})}

    return TorchEquivalent(torch.optim.Adafactor, kwargs, to_torch, from_torch, hyper)


def _torch_optim_rule(rule: TorchOptimRule) -> TorchEquivalent:
    def to_torch(own: int, moments: Mapping[str, torch.Tensor], scalars: Mapping[str, float], *_: Any
                 ) -> dict[str, Any]:
        return rule.torch_state(own, [moments[k] for k in rule.moment_names],
                                [scalars.get(k, 0.0) for k in rule.scalar_names])

    def from_torch(state: Mapping[str, Any]) -> Read:
        steps = [k for k, kind in rule.state if kind == STEP]
        own = _step_of(state, steps[0]) if steps else int(bool(state))
        scalars = {k: float(v) for k, v in _present(state, rule.scalar_names).items()}
        return own, _present(state, rule.moment_names), scalars, {}

    def hyper(group: Mapping[str, Any]) -> dict[str, float]:
        tupled = {x for t, n in rule.tuples for x in tuple_names(t, n)}
        singles = [k for k, _ in rule.defaults if k not in tupled]
        for key in [*singles, *(t for t, _ in rule.tuples)]:
            if key not in group:
                raise ValueError(f"has no {key!r}: it belongs to another optimizer than {rule.name}")
        for key, mine in rule.static:
            if key in group and group[key] != mine and key not in ("foreach", "fused"):
                raise ValueError(f"has {key} {group[key]!r}, here {mine!r}")
        out = {k: float(group[k]) for k in singles}
        for t, n in rule.tuples:
            out.update(zip(tuple_names(t, n), (float(v) for v in group[t])))
        return out

    return TorchEquivalent(rule.torch_cls, rule.torch_kwargs, to_torch, from_torch, hyper)


_EQUIVALENTS: dict[type, Callable[[Any], TorchEquivalent]] = {
    SGD: _sgd, Adam: _adam, Adafactor: _adafactor, TorchOptimRule: _torch_optim_rule}


def torch_equivalent(optimizer: Optimizer) -> TorchEquivalent:
    """``optimizer``'s ``torch.optim`` equivalent (by its type, a subclass as its base), or
    ``CheckpointMismatchError`` naming a rule without one."""
    for cls in type(optimizer).__mro__:
        if cls in _EQUIVALENTS:
            return _EQUIVALENTS[cls](optimizer)
    raise CheckpointMismatchError(f"optimizer {optimizer.name} has no torch.optim equivalent: there is "
                                  "no torch.optim state dict to exchange")


def _gathered(layout: Layout, group: FlatGroup, rows: torch.Tensor, comm: Communicator) -> dict[int, torch.Tensor]:
    """``{slot index: full tensor}`` of ``group`` in each parameter's dtype from this process's rows."""
    # one all_gather, or a copy when this process holds every rank: exports never alias the state
    if comm.local_ranks == comm.data_world_size * comm.parts:  # one copy of each shard (rank group 0's), in order
        held = list(zip(comm.part, comm.ranks))
        flat = rows[[held.index((0, j)) for j in range(comm.world_size)]].reshape(-1)
    elif comm.local_ranks != 1:
        raise TypeError(f"export: unsupported communicator: {comm.local_ranks} of {comm.world_size} ranks here")
    else:
        flat = comm.all_gather(rows)[0]
    return {i: v.to(layout.slots[i].dtype) for i, v in zip(group.slots, group_views(layout, group, flat))}


def _gathered_parts(layout: Layout, group: FlatGroup, rows: torch.Tensor, comm: Communicator) -> dict[int, torch.Tensor]:
    """:func:`_gathered` of a parameter group's flat group: every rank group's values, each parameter in its saved
    shape (:meth:`~fzero.layout.Layout.saved_shape`: rank group 0's first). One ``all_gather`` within this rank's
    group, then one ``broadcast`` per rank group from its first rank (in one process: copies)."""
    over = group_comm(comm, group)
    if comm.local_ranks > 1:  # every rank group here: each one's rows in shard order
        held = list(zip(over.part, over.ranks))
        flats = [rows[[held.index((q, j)) for j in range(over.world_size)]].reshape(-1) for q in range(over.parts)]
    else:
        mine = over.all_gather(rows)
        flats = [comm.broadcast(mine, over.rank_groups[q][0])[0] for q in range(over.parts)]
    parts = [dict(zip(group.slots, group_views(layout, group, flat))) for flat in flats]
    return {i: torch.cat([p[i].reshape(layout.slots[i].shape) for p in parts]).reshape(
                layout.saved_shape(layout.slots[i])).to(layout.slots[i].dtype) for i in group.slots}


BROADCAST_ELEMENTS = 1 << 22  # per broadcast of a live export's gather: 16 MiB of float32


def state_dict_tensors(state: TrainState) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """``(name, shape, dtype)`` of every tensor of the model state dict :func:`export_model_state_dict` gives, tied
    aliases left out, in its order (the module's ``state_dict`` order; a pytree's: parameters, then buffers)."""
    lay, spec = state.layout, state.module
    tensors = {s.path: (s.path, s.shape, s.dtype) for s in lay.slots}
    tensors.update({n: (n, tuple(b.shape[1:]), b.dtype)
                    for n, b, keep in zip(spec.buffers, state.buffers, spec.persistent) if keep})
    aliases = {a for a, _ in spec.aliases}
    order = [k for k in spec.state_dict_keys if k in tensors and k not in aliases] or list(tensors)
    return [tensors[k] for k in order]


def gathered_tensors(state: TrainState, comm: Communicator,
                     names: Sequence[str] | None = None) -> Iterator[torch.Tensor]:
    """Each tensor ``names`` names (default: every one of :func:`state_dict_tensors`, in its order) in turn, whole on
    every rank, on the state's device, in its dtype: one tensor's memory at a time (the caller keeps what it writes).
    Rank 0's buffers. Every rank passes the same ``names``.
    Collectives (one rank per process): a ``broadcast`` per piece of a sharded tensor (at most
    :data:`BROADCAST_ELEMENTS` each) from the rank holding it (a mesh: from the lowest such rank, over the replicas,
    then within each shard group); none in one process."""
    ensure_live(state)
    check_world(state.shard, comm)
    refuse_param_groups(state.layout, "export")
    lay, spec, shard = state.layout, state.module, state.shard
    holders = _holders(comm)
    slots = {s.path: s for s in lay.slots}
    whole_frozen = dict(zip((s.path for s in lay.frozen_slots), shard.frozen)) if not lay.frozen_groups else {}
    buffers = {n: b for n, b in zip(spec.buffers, state.buffers)}
    for name in [t[0] for t in state_dict_tensors(state)] if names is None else names:
        s = slots.get(name)
        if s is None:
            yield buffers[name][0].detach().clone()  # rank 0's: the first row of the simulated world, rank 0's own
        elif s.group >= 0:
            yield _gathered_slot(lay.groups[s.group], shard.master[s.group], s, comm, holders).to(s.dtype)
        elif s.path in whole_frozen:
            yield whole_frozen[s.path].detach().to(s.dtype, copy=True)
        else:
            f = s.frozen_group
            yield _gathered_slot(lay.frozen_groups[f], shard.frozen[f], s, comm, holders).to(s.dtype)


def _holders(comm: Communicator) -> list[int] | None:
    """For one rank per process, the data rank each shard rank's pieces are broadcast from (the same on every rank:
    :meth:`~fzero.comm.Communicator.holder`); None: the simulated world holds every row."""
    if comm.local_ranks == comm.data_world_size:
        return None
    if comm.local_ranks != 1:
        raise TypeError(f"export: unsupported communicator: {comm.local_ranks} of {comm.world_size} ranks here")
    return [comm.holder(r) for r in range(comm.world_size)]


def _gathered_slot(group: FlatGroup, rows: torch.Tensor, slot: ParamSlot, comm: Communicator,
                   holders: Sequence[int] | None) -> torch.Tensor:
    """The whole parameter ``slot`` of ``group`` (in the rows' dtype, its shape) from the shards holding its pieces:
    read from the rows in one process, else one ``broadcast`` per piece from its holder."""
    n, out = group.shard_numel, rows.new_empty(slot.numel)
    first, last = slot.offset // n, (slot.offset + slot.numel - 1) // n if slot.numel else -1
    for r in range(first, last + 1):
        lo, hi = max(r * n, slot.offset), min((r + 1) * n, slot.offset + slot.numel)
        if holders is None:
            out[lo - slot.offset: hi - slot.offset] = rows[comm.ranks.index(r), lo - r * n: hi - r * n]
            continue
        for a in range(lo, hi, BROADCAST_ELEMENTS):  # in bounded pieces: the tensor plus one piece in flight
            b = min(a + BROADCAST_ELEMENTS, hi)
            mine = rows[:, a - r * n: b - r * n] if comm.ranks[0] == r else rows.new_empty(1, b - a)
            out[a - slot.offset: b - slot.offset] = comm.broadcast(mine.contiguous(), holders[r])[0]
    return out.view(slot.shape)


def torch_order(opt_groups: Sequence[int], num_groups: int) -> list[list[int]]:
    """Per optimizer group, the slot indices of its parameters in tree order (``opt_groups``: each slot's
    group, -1 frozen): how torch numbers the ``params`` of an optimizer built group by group."""
    order: list[list[int]] = [[] for _ in range(num_groups)]
    for i, k in enumerate(opt_groups):
        if k >= 0:
            order[k].append(i)
    return order


def _torch_order(layout: Layout, optimizer: Optimizer) -> list[list[int]]:
    return torch_order([layout.groups[s.group].opt_group if s.group >= 0 else -1 for s in layout.slots],
                       optimizer.num_groups)


def export_model_state_dict(state: TrainState, comm: Communicator) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` of the trained model, what ``load_state_dict(strict=True)`` takes: the master's
    values in each parameter's dtype, frozen parameters, rank 0's persistent buffers and tied names, in the
    module's order. A parameter group's parameters (``init_train_state(groups=)``) in their saved shape, every rank
    group's values stacked: an expert-parallel block's experts, all of them, by expert index (what the unconverted
    block loads). Collectives: one ``all_gather`` per flat group, one at a time (at most one full copy; a parameter
    group's within its rank group, then a ``broadcast`` per rank group)."""
    ensure_live(state)
    check_world(state.shard, comm)
    lay, spec = state.layout, state.module
    out: dict[str, torch.Tensor] = {}
    for g in lay.groups:
        rows = state.shard.master[g.index]
        whole = _gathered(lay, g, rows, comm) if not g.axis else _gathered_parts(lay, g, rows, comm)
        out.update({lay.slots[i].path: v for i, v in whole.items()})
    out.update({s.path: f.detach().to(s.dtype, copy=True) for s, f in frozen_params(state.shard, comm)})
    buffers = {n: b[0].clone() for n, b, keep in zip(spec.buffers, state.buffers, spec.persistent) if keep}
    return module_state_dict({s.path: out[s.path] for s in lay.slots}, buffers, spec)


def module_state_dict(params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
                      spec: ModuleSpec) -> dict[str, torch.Tensor]:
    """Parameters and buffers by canonical name, with tied names, in the module's ``state_dict`` order (tree
    order for a pytree)."""
    out = {**params, **buffers}
    for alias, canonical in spec.aliases:
        if canonical in out:
            out[alias] = out[canonical]
    return {k: out[k] for k in spec.state_dict_keys if k in out} if spec.state_dict_keys else out


def write_back(state: TrainState, comm: Communicator, module: torch.nn.Module) -> torch.nn.Module:
    """Put the trained parameters and buffers (rank 0's, non-persistent ones too) into ``module`` (the model the state
    was built from, or one like it), and return it. Stages 1-2: parameters in the compute dtype become views of the
    state's gathered parameters; others are copied in, meta parameters getting memory on the state's device first (tied
    names stay tied).
    Collectives: those of :func:`export_model_state_dict`."""
    exported = export_model_state_dict(state, comm)
    viewed = hand_over_parameters(module, state.layout, state.params) if state.params else set()
    viewed |= {alias for alias, canonical in state.module.aliases if canonical in viewed}
    # meta parameters get memory in place (same Parameter objects, ties kept), a stage-3 guard goes
    restore_parameters(module, exported)
    if has_meta(module):  # on the state's device: the module comes back where it trained
        to_empty_tied(module, state.device)
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
    """The ``state_dict()`` of the ``torch.optim`` optimizer that would have trained the model the same way
    (``load_state_dict`` takes it as it is), or ``CheckpointMismatchError`` for a rule without one. Parameters are
    numbered as torch numbers an optimizer built group by group, each group in tree order. Per parameter: the class's
    state at its own step count (none before its first step); moments in the parameter's dtype. ``param_groups``: the
    class's keys, the state's values. Collectives: one ``all_gather`` per flat group and moment, one at a time."""
    ensure_live(state)
    check_world(state.shard, comm)
    refuse_param_groups(state.layout, "export_torch_optim_state_dict")
    lay, opt = state.layout, state.opt.optimizer
    torch_equivalent(opt)  # refused before anything is gathered
    step = int(state.opt.step)
    own = own_steps(lay, step, state.opt.missed)
    moments: dict[int, dict[str, torch.Tensor]] = {}
    if step > 0 and opt.moment_names:
        for g in lay.groups:
            for name, rows in zip(opt.moment_names, state.opt.moments[g.index]):
                for i, v in _gathered(lay, g, rows, comm).items():
                    moments.setdefault(i, {})[name] = v
    return torch_optim_dict(opt, _torch_order(lay, opt), step, state.opt.hyper, moments, own,
                            slot_scalars(lay, opt, state.opt.scalars), lay,
                            vectors=slot_vectors(lay, opt, state.opt.vectors))


def slot_vectors(layout: Layout, optimizer: Optimizer,
                 vectors: Sequence[torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    """``{slot index: {vector name: 1-D CPU copy}}`` from ``OptState.vectors``; ``{}`` without any."""
    slots = list(trainable_index(layout))
    spans = vector_spans(optimizer, [layout.slots[i].shape for i in slots])
    out: dict[int, dict[str, torch.Tensor]] = {}
    for name, v, span in zip(optimizer.vector_names, vectors, spans):
        for i, (a, b) in zip(slots, span):
            out.setdefault(i, {})[name] = v[a:b].detach().cpu().clone()
    return out


def slot_scalars(layout: Layout, optimizer: Optimizer, scalars: Sequence[torch.Tensor]) -> dict[int, dict[str, float]]:
    """``{slot index: {scalar name: value}}`` from ``OptState.scalars`` (``[T]`` vectors)."""
    slots = list(trainable_index(layout))
    values = [v.tolist() for v in scalars] if scalars else [[0.0] * len(slots) for _ in optimizer.scalar_names]
    return {i: {n: vs[k] for n, vs in zip(optimizer.scalar_names, values)} for k, i in enumerate(slots)}


def own_steps(layout: Layout, step: int, missed: Sequence[torch.Tensor]) -> dict[int, int]:
    """``{trainable slot index: its own step count}`` (``step`` less ``OptState.missed``)."""
    counts = missed[0].tolist() if missed else [0] * len(layout.trainable_slots)
    return {i: step - int(m) for i, m in zip(trainable_index(layout), counts)}


def torch_optim_dict(optimizer: Any, order: Sequence[Sequence[int]], step: int,
                     hyper: Sequence[Mapping[str, torch.Tensor]], moments: Mapping[int, Mapping[str, torch.Tensor]],
                     own: Mapping[int, int] | None = None,
                     scalars: Mapping[int, Mapping[str, float]] | None = None, layout: Any | None = None,
                     shapes: Mapping[int, tuple[tuple[int, ...], torch.dtype]] | None = None,
                     vectors: Mapping[int, Mapping[str, torch.Tensor]] | None = None) -> dict[str, Any]:
    """A ``torch.optim`` state dict of ``optimizer`` (:func:`torch_equivalent`). ``order``:
    :func:`torch_order`; ``moments``: ``{slot: {name: tensor}}`` in the parameter's shape and dtype (read
    when ``step > 0``); ``own``: each slot's step count (:func:`own_steps`; default ``step``); ``scalars``:
    :func:`slot_scalars`; ``layout`` or ``shapes`` (``{slot: (shape, dtype)}``); ``vectors``:
    :func:`slot_vectors`. A never-stepped parameter has the state the class gives it (none for most)."""
    eq = torch_equivalent(optimizer)
    index = {slot: n for n, slot in enumerate(i for group in order for i in group)}
    if shapes is None:
        shapes = {i: (tuple(layout.slots[i].shape), layout.slots[i].dtype) for i in index} if layout else {}
    per_param: dict[int, dict[str, Any]] = {}
    groups = []
    for k, slots in enumerate(order):
        kwargs = eq.kwargs({name: float(v) for name, v in hyper[k].items()})
        probe = eq.cls([torch.zeros(1)], **kwargs)
        group = {key: v for key, v in probe.param_groups[0].items() if key != "params"}
        groups.append({**group, "params": [index[i] for i in slots]})
        for slot in slots:
            mine = step if own is None else own.get(slot, step)
            if mine > 0:
                st = eq.to_torch(mine, moments[slot] if optimizer.moment_names else {}, (scalars or {}).get(slot, {}),
                                 *shapes.get(slot, ((), torch.float32)), (vectors or {}).get(slot, {}))
            elif probe.state:  # state at construction (Adagrad): what the class gives this shape and dtype
                param = torch.zeros(shapes[slot][0], dtype=shapes[slot][1])
                st = dict(eq.cls([param], **kwargs).state.get(param, {}))
            else:
                st = {}
            if st:
                per_param[index[slot]] = st
    return {"state": dict(sorted(per_param.items())), "param_groups": groups}


def rule_from_manifest(section: Mapping[str, Any]) -> Optimizer:
    """The rule a checkpoint's manifest names, rebuilt for its torch.optim state dict (hyperparameter values
    are the checkpoint's): the built-ins, and ``torch.optim``'s own classes (found by name in ``torch.optim``:
    nothing a checkpoint names is imported). Others: ``CheckpointMismatchError`` naming the rule."""
    kind = section.get("kind")
    names = tuple((n, 0.0) for n in section["hyperparameters"][0])
    flag = {k: bool(section.get(k)) for k in ("nesterov", "maximize", "momentum_buffer", "amsgrad")}
    if kind == "sgd":
        return SGD(names, nesterov=flag["nesterov"], maximize=flag["maximize"], momentum_buffer=flag["momentum_buffer"])
    if kind in ("adam", "adamw"):
        return Adam(names, decoupled=kind == "adamw", maximize=flag["maximize"], amsgrad=flag["amsgrad"])
    if kind == "adafactor":
        return Adafactor(names, maximize=flag["maximize"])
    module, _, qualname = (kind or "").rpartition(".")
    cls = getattr(torch.optim, qualname, None)
    if not module.startswith("torch.optim") or not isinstance(cls, type) or cls.__module__ != module:
        raise CheckpointMismatchError(
            f"optimizer {kind}: only fzero's built-in rules and torch.optim's own classes can be rebuilt from a "
            "checkpoint; export_torch_optim_state_dict gives the state dict from a live state")
    dtype = section.get("scalar_dtype", "None")  # the state layout is the manifest's (the probe's at save time)
    return TorchOptimRule(names, (), torch_cls=cls, static=tuple((k, v) for k, v in section.get("static", [])),
                          tuples=tuple((k, n) for k, n in section.get("tuples", [])),
                          state=tuple((k, kind) for k, kind in section.get("state", [])),
                          scalar_dtype=None if dtype == "None" else getattr(torch, dtype.removeprefix("torch.")))


def import_torch_optim_state_dict(template: TrainState, model_state_dict: Mapping[str, torch.Tensor],
                                  optim_state_dict: Mapping[str, Any], comm: Communicator) -> TrainState:
    """A state for ``template``'s model, optimizer and world holding a ``torch.optim`` run's parameters and
    optimizer state. ``model_state_dict``: ``{path: tensor}`` (extra keys ignored). ``optim_state_dict``: the
    ``state_dict()`` of the rule's ``torch.optim`` equivalent built group by group like fzero's groups,
    parameters matched by position within each group; hyperparameters come from its param groups, scaler and
    precision from ``template``. No collective but the ``all_gather`` rebuilding ``params`` (if the template
    has them). Raises :class:`CheckpointMismatchError` naming what differs."""
    ensure_live(template)
    check_world(template.shard, comm)
    refuse_param_groups(template.layout, "import_torch_optim_state_dict")
    lay, opt = template.layout, template.opt.optimizer
    eq = torch_equivalent(opt)
    params = _torch_params(lay, model_state_dict)
    hyper, per_slot = _torch_groups(template, optim_state_dict, eq)
    trainable = list(trainable_index(lay))
    read = {i: eq.from_torch(per_slot.get(i, {})) for i in trainable}
    dev = template.shard.master[0].device
    master = _own_rows(lay, params, comm, dev)
    per_moment = []
    for name in opt.moment_names:
        leaves = [_moment_or_zeros(read[i][1], name, s.shape) if i in read else None for i, s in enumerate(lay.slots)]
        per_moment.append(_own_rows(lay, leaves, comm, dev))
    moments = tuple(tuple(m[g.index] for m in per_moment) for g in lay.groups)
    frozen = tuple(f.to(t.device, t.dtype) for f, t in zip(frozen_rows(lay, params, comm.ranks, torch.clone),
                                                           template.shard.frozen))
    count = max((read[i][0] for i in trainable), default=0)  # the optimizer's step: the largest own count
    missed = [count - read[i][0] for i in trainable]
    step = template.opt.step.new_tensor(count)
    shard = replace(template.shard, master=master, frozen=frozen)
    scalars = tuple(torch.tensor([read[i][2].get(name, 0.0) for i in trainable], dtype=torch.float64)
                    for name in opt.scalar_names)
    new_opt = replace(template.opt, step=step, hyper=hyper, moments=moments, scalars=scalars,
                      vectors=_torch_vectors(template, read))
    if template.opt.missed or any(missed):
        new_opt = replace(new_opt, missed=(torch.tensor(missed, dtype=torch.int64, device=step.device),))
    gathered = all_gather_params(shard, comm, template.precision.param_dtype) if len(template.params) else ()
    return replace(template, shard=shard, opt=new_opt, params=gathered)


def _torch_vectors(template: TrainState, read: Mapping[int, Read]) -> tuple[torch.Tensor, ...]:
    """``OptState.vectors`` from torch's per-parameter state (zeros where torch has none), sizes checked."""
    lay, opt = template.layout, template.opt.optimizer
    if not opt.vector_names:
        return template.opt.vectors
    slots = list(trainable_index(lay))
    shapes = [lay.slots[i].shape for i in slots]
    dtype = template.opt.vectors[0].dtype if template.opt.vectors else template.shard.master[0].dtype
    out = init_vectors(opt, shapes, dtype, template.shard.master[0].device)
    for i, shape, *spans in zip(slots, shapes, *vector_spans(opt, shapes)):
        got = read[i][3]
        for name, v, (a, b) in zip(opt.vector_names, out, spans):
            if name not in got:
                continue
            if got[name].numel() != b - a:
                raise CheckpointMismatchError(
                    f"torch optimizer state {name!r} of {lay.slots[i].path!r} has {got[name].numel()} elements, "
                    f"this state's optimizer keeps {b - a} for its shape {tuple(shape)}")
            v[a:b] = got[name].detach().to(v.dtype)
    return out


def _own_rows(layout: Layout, leaves: Sequence[torch.Tensor | None], comm: Communicator,
              device: torch.device) -> tuple[torch.Tensor, ...]:
    """This process's ``[R, shard_numel]`` rows of every flat group from full per-slot ``leaves``."""
    return tuple(shard_rows(layout, g, leaves, comm.ranks, g.master_dtype).to(device) for g in layout.groups)


def _torch_params(layout: Layout, model_state_dict: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """Every parameter of ``layout`` from a model state dict, in slot order, shapes checked."""
    params = []
    for s in layout.slots:
        t = model_state_dict.get(s.path)
        if t is None:
            raise CheckpointMismatchError(f"model state dict has no parameter {s.path!r}")
        if tuple(t.shape) != s.shape:
            raise CheckpointMismatchError(f"model state dict: {s.path!r} has shape {tuple(t.shape)}, "
                                          f"this model {s.shape}")
        params.append(t.detach())
    return params


def _torch_groups(template: TrainState, optim_state_dict: Mapping[str, Any], eq: TorchEquivalent
                  ) -> tuple[tuple[dict[str, torch.Tensor], ...], dict[int, Mapping[str, Any]]]:
    """fzero's hyperparameters per optimizer group, and torch's per-parameter state by slot index (``{}``
    if torch has not stepped it), matched by position within each param group."""
    lay, opt = template.layout, template.opt.optimizer
    groups = optim_state_dict["param_groups"]
    if len(groups) != opt.num_groups:
        raise CheckpointMismatchError(f"torch optimizer has {len(groups)} param groups, this state's optimizer "
                                      f"{opt.num_groups}")
    torch_state = optim_state_dict.get("state", {})
    per_slot: dict[int, Mapping[str, Any]] = {}
    hyper = []
    for k, (group, slots) in enumerate(zip(groups, _torch_order(lay, opt))):
        if len(group["params"]) != len(slots):
            raise CheckpointMismatchError(f"torch param group {k} has {len(group['params'])} parameters, this "
                                          f"state's {len(slots)}")
        try:
            values = eq.hyper(group)
        except ValueError as e:
            raise CheckpointMismatchError(f"torch param group {k} {e}") from None
        out = {}
        for name, t in template.opt.hyper[k].items():
            if name not in values:
                raise CheckpointMismatchError(f"torch param group {k} has no {name!r}")
            out[name] = torch.tensor(float(values[name]), dtype=t.dtype, device=t.device)
        hyper.append(out)
        for pid, i in zip(group["params"], slots):
            per_slot[i] = torch_state.get(pid, {})
    return tuple(hyper), per_slot


def _moment_or_zeros(state: Mapping[str, Any], name: str, shape: tuple[int, ...]) -> torch.Tensor:
    # a parameter torch has not stepped yet has no state: its moments are zero
    t = state.get(name)
    if t is None:
        return torch.zeros(shape)
    if tuple(t.shape) != shape:
        raise CheckpointMismatchError(f"torch optimizer state {name!r} has shape {tuple(t.shape)}, expected {shape}")
    return t.detach()
