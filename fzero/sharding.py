"""This rank's shards of the flat layout (:class:`ShardState`) and three pure pieces of a step:
:func:`reduce_scatter_grads` (gradients in, averaged shards out), :func:`shard_step` (shards and gradients in, next
shards and optimizer state out), :func:`all_gather_params` (shards in, gathered compute-dtype buffers out). Each starts
all its collectives before waiting for any, when its caller chooses (:mod:`fzero.grads`: as a bucket's gradient
completes).

Imports: ``fzero.comm``, ``fzero.layout``, ``fzero.optim``, ``fzero.pytree``, ``fzero.scaler``, ``fzero.scopes``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from .comm import Communicator, gradient_divide_factors
from .layout import (
    FlatGrads,
    FlatGroup,
    Layout,
    ParamSlot,
    build_layout,
    compute_dtype,
    flat_grads,
    flat_shard,
    group_views,
    named_leaves,
    param_tree,
    shard_pieces,
    stack_rows,
    trainable_index,
)
from .optim import Optimizer, OptState, Update, check_compilable, init_scalars, init_vectors, vector_dtype
from .pytree import pytree_dataclass, replace, static_field
from .scaler import local_sq_norm
from .scopes import GATHER, GRAD_REDUCTION, UPDATE, step_scope

__all__ = ["ShardState", "init_shard", "shard_layout", "check_world", "reduce_scatter_grads", "all_gather_params",
           "full_params", "shard_step", "global_norm", "stack_rows", "LOW_PRECISION", "group_comm", "used_positions"]

LOW_PRECISION = (torch.float16, torch.bfloat16)


@pytree_dataclass
class ShardState:
    """This process's shards. Leaves: ``master``, per flat group one ``[R, shard_numel]`` in its master dtype (float32,
    or float64 for float64); ``frozen``, the frozen parameters whole (replicated), or at stage 3 one ``[R,
    shard_numel]`` per frozen group in its held dtype. Static: the :class:`~fzero.layout.Layout`."""

    master: tuple[torch.Tensor, ...]
    frozen: tuple[torch.Tensor, ...]
    layout: Layout = static_field()


def shard_layout(params: Any, comm: Communicator, *, trainable: Any | None = None,
                 optimizer: Optimizer | None = None, bucket_of: Any | None = None,
                 keep_dtype: Any | None = None, alignment: int = 16, shard_frozen: bool = False,
                 axis_of: Callable[[str], str] | None = None) -> Layout:
    """The layout of ``params`` (shapes only) for ``comm``'s world, checked across ranks (``comm.check_layout``: one
    small all-gather). ``axis_of(path)``: a parameter's parameter group, one of ``comm.groups`` (``""``: the world)."""
    axes = tuple((name, c.world_size, c.parts) for name, c in comm.groups.items())
    layout = build_layout(params, comm.world_size, trainable=trainable,
                          group_of=optimizer.group_of if optimizer is not None else None, bucket_of=bucket_of,
                          keep_dtype=keep_dtype, alignment=alignment, shard_frozen=shard_frozen, axis_of=axis_of,
                          axes=axes)
    comm.check_layout(layout)
    return layout


def group_comm(comm: Communicator, group: FlatGroup | ParamSlot) -> Communicator:
    """The communicator ``group`` (a flat group or a parameter's slot) is sharded over: its parameter group's
    (:attr:`~fzero.comm.Communicator.groups`), or ``comm`` itself."""
    return comm.param_group(group.axis)


def rows_positions(layout: Layout, comm: Communicator) -> list[dict[int, int]]:
    """Per local row, ``{index in layout.slots: position in the per-parameter vectors}`` (its rank groups')."""
    if not layout.axes:
        return [trainable_index(layout)] * comm.local_ranks
    parts = [comm.param_group(name).part for name, _, _ in layout.axes]
    return [trainable_index(layout, {name: p[r] for (name, _, _), p in zip(layout.axes, parts)})
            for r in range(comm.local_ranks)]


def init_shard(params: Any, comm: Communicator, *, layout: Layout | None = None,
               frozen_storage: Callable[[FlatGroup], torch.dtype] | None = None,
               values: Mapping[str, Callable[[str, int], torch.Tensor | None]] | None = None,
               **layout_kw: Any) -> ShardState:
    """This process's shards of ``params`` (``nn.Module`` or pytree): each local rank materialises only the
    slice it owns. ``layout``: the one :func:`shard_layout` built, else built here from ``layout_kw``
    (``trainable``, ``optimizer``, ``bucket_of``, ``keep_dtype``, ``alignment``). ``frozen_storage``: the dtype each
    frozen group's rows are built in (:meth:`~fzero.precision.MixedPrecision.frozen_storage`; default its own).
    ``values``: per parameter group, ``fn(path, rank group)`` giving a row's own value of a parameter (one process
    holding several rank groups of experts), or None where ``params``' is it."""
    layout = layout if layout is not None else shard_layout(params, comm, **layout_kw)
    leaves = [x for _, x in named_leaves(params)[0]]
    master = tuple(_group_rows(layout, g, leaves, comm, (values or {}).get(g.axis)) for g in layout.groups)
    # a module's frozen parameters are shared with it (never written); a pytree's are copied
    own = (lambda t: t.detach()) if isinstance(params, torch.nn.Module) else (lambda t: t.detach().clone())
    return ShardState(master, frozen_rows(layout, leaves, comm.ranks, own, frozen_storage), layout)


def shard_rows(layout: Layout, group: FlatGroup, leaves: Sequence[torch.Tensor], ranks: Sequence[int],
               dtype: torch.dtype) -> torch.Tensor:
    """The rows ``[len(ranks), shard_numel]`` in ``dtype`` of ``group`` for ``ranks``, from whole ``leaves`` (layout
    order): each row written in place, no stacked second copy, a tensor of its own (not a view)."""
    out = torch.zeros(len(ranks), group.shard_numel, dtype=dtype, device=leaves[group.slots[0]].device)
    for row, r in enumerate(ranks):
        flat_shard(layout, group, leaves, r, out=out[row])
    return out


def _group_rows(layout: Layout, group: FlatGroup, leaves: Sequence[torch.Tensor], comm: Communicator,
                values: Callable[[str, int], torch.Tensor | None] | None) -> torch.Tensor:
    """:func:`shard_rows` of ``group`` over its parameter group's ranks, each row from its rank group's ``values``."""
    over = group_comm(comm, group)
    if values is None:
        return shard_rows(layout, group, leaves, over.ranks, group.master_dtype)
    out = torch.zeros(comm.local_ranks, group.shard_numel, dtype=group.master_dtype,
                      device=leaves[group.slots[0]].device)
    for row, (rank, part) in enumerate(zip(over.ranks, over.part)):
        own = list(leaves)
        for i in group.slots:
            value = values(layout.slots[i].path, part)
            own[i] = own[i] if value is None else value
        flat_shard(layout, group, own, rank, out=out[row])
    return out


def frozen_rows(layout: Layout, leaves: Sequence[torch.Tensor | None], ranks: Sequence[int],
                whole: Callable[[torch.Tensor], torch.Tensor] = torch.Tensor.detach,
                dtype_of: Callable[[FlatGroup], torch.dtype] | None = None) -> tuple[torch.Tensor, ...]:
    """:attr:`ShardState.frozen` from whole ``leaves`` (layout order; frozen ones read): ``whole(leaf)`` per frozen
    parameter, or at stage 3 each frozen group's rows in ``dtype_of(group)`` (default: its dtype)."""
    if layout.frozen_groups:
        return tuple(shard_rows(layout, g, leaves, ranks, dtype_of(g) if dtype_of else g.dtype)
                     for g in layout.frozen_groups)
    return tuple(whole(leaves[i]) for i, s in enumerate(layout.slots) if s.group < 0)


def frozen_params(shard: ShardState, comm: Communicator) -> Iterator[tuple[ParamSlot, torch.Tensor]]:
    """``(slot, whole tensor)`` of every frozen parameter, in the dtype it is held in: at stage 3 gathered lazily, one
    ``all_gather`` per frozen group (one group's buffer live at a time if the caller keeps no views)."""
    lay = shard.layout
    if not lay.frozen_groups:
        yield from zip(lay.frozen_slots, shard.frozen)
    for g, f in zip(lay.frozen_groups, shard.frozen):
        flat = all_gather_params(shard, comm, f.dtype, groups=(g,))[0][0]
        yield from zip((lay.slots[i] for i in g.slots), group_views(lay, g, flat))


def used_positions(layout: Layout, used: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Used flags ``[R, T]`` (``layout.trainable_slots`` order) placed at each row's positions in the per-parameter
    vectors, ``[R, Layout.num_positions]``, zero elsewhere: summed over the world, a parameter group's flags then count
    the ranks of each rank group apart. Copies of static runs on the device (no host list sent). No collective."""
    if not layout.axes:
        return used
    index = trainable_index(layout)
    out = used.new_zeros(used.shape[0], layout.num_positions)
    for r, where in enumerate(rows_positions(layout, comm)):
        moved = sorted((index[i], p) for i, p in where.items())
        start = 0
        while start < len(moved):  # one copy per run of consecutive positions
            end = start + 1
            while end < len(moved) and moved[end][0] == moved[end - 1][0] + 1 and moved[end][1] == moved[end - 1][1] + 1:
                end += 1
            (k, p), n = moved[start], end - start
            out[r, p:p + n] = used[r, k:k + n]
            start = end
    return out


def check_world(shard: ShardState, comm: Communicator) -> None:
    """``ValueError`` if ``shard`` was built for another world than ``comm``'s, or a donating step consumed it."""
    lay = shard.layout
    if lay.world_size != comm.world_size:
        raise ValueError(f"ShardState.layout.world_size is {lay.world_size} but the communicator's world size is "
                         f"{comm.world_size}: this state was built for another world (reshard it first)")
    for name, world, parts in lay.axes:
        c = comm.param_group(name)
        if (c.world_size, c.parts) != (world, parts):
            raise ValueError(f"parameter group {name!r}: the state was built for {parts} rank groups of {world} ranks, "
                             f"the communicator has {c.parts} of {c.world_size}")
    for g, m in zip(lay.groups, shard.master):
        if m.numel() == 0 and g.shard_numel > 0:
            raise ValueError(f"ShardState.master[{g.index}] is empty: this state was donated to a step "
                             "(donate=True) and consumed; use the state that step returned")
        if tuple(m.shape) != (comm.local_ranks, g.shard_numel):
            raise ValueError(f"ShardState.master[{g.index}] has shape {tuple(m.shape)}, expected "
                             f"({comm.local_ranks}, {g.shard_numel}) for this communicator")


def _average_start(flat: torch.Tensor, comm: Communicator, reduce_dtype: torch.dtype, out_dtype: torch.dtype,
                   via_all_reduce: bool, world: int | None = None) -> Callable[[], torch.Tensor]:
    """Start averaging one flat gradient ``[R, padded]`` into this rank's shard (16 bits: FSDP's divide factors).
    ``world``: divide the sum over ``comm``'s ranks by this many instead (a parameter group's gradient is summed over
    its rank group and divided by the whole world's size: the mean loss's gradient, as DDP's)."""
    x = flat.to(reduce_dtype)
    low = reduce_dtype in LOW_PRECISION
    divide = world if world is not None and world != comm.world_size else None
    pre, post = gradient_divide_factors(divide or comm.world_size) if low else (1, 1)
    if pre > 1:
        x = x / pre
    op = "sum" if low or divide else "avg"
    done = comm.all_reduce_shard_start(x, op) if via_all_reduce else comm.reduce_scatter_start(x, op)
    if divide and not low:
        return lambda: done().div_(divide).to(out_dtype)
    return lambda: (done() / post if post > 1 else done()).to(out_dtype)


def reduce_scatter_grads(shard: ShardState, grads: Any, comm: Communicator, *,
                         reduce_dtype: torch.dtype | None = None, via_all_reduce: bool = False
                         ) -> tuple[torch.Tensor, ...]:
    """Gradients averaged over ranks: this rank's shard of each flat group. ``grads``: a tree shaped like the parameters
    (leaves ``[R, *shape]``; frozen ones absent or None), or a :class:`~fzero.layout.FlatGrads` of some flat groups (a
    bucket's). Returns ``[R, shard_numel]`` per flat group (``grads``' or the layout's), in the master dtype, padding
    zero. Collectives: one ``reduce_scatter`` per flat group (``via_all_reduce``: ZeRO-1's ``all_reduce``), all started
    before any is waited for, in ``reduce_dtype`` (default: the master dtype; 16 bits: FSDP's divide factors)."""
    check_world(shard, comm)
    if not isinstance(grads, FlatGrads):
        grads = flat_grads(shard.layout, grads, comm.local_ranks)
    groups = grads.groups
    for g, f in zip(groups, grads):
        if tuple(f.shape) != (comm.local_ranks, g.padded_numel):
            raise ValueError(f"reduce_scatter_grads: flat group {g.index} has shape {tuple(f.shape)}, expected "
                             f"{(comm.local_ranks, g.padded_numel)}")
    with step_scope(GRAD_REDUCTION, comm.traced):
        if _joined(groups, lambda g: reduce_dtype or g.master_dtype):
            # rank-major, so each element is summed with the same elements in the same order
            rows, rdtype, over = comm.local_ranks, reduce_dtype or groups[0].master_dtype, group_comm(comm, groups[0])
            joined = torch.cat([f.to(rdtype).view(rows, over.world_size, g.shard_numel) for g, f in zip(groups, grads)],
                               dim=2).reshape(rows, -1)
            whole = _average_start(joined, over, rdtype, rdtype, via_all_reduce, comm.world_size)()
            return tuple(piece.to(g.master_dtype) for g, piece in zip(groups, _cut(whole, groups)))
        started = [_average_start(f, group_comm(comm, g), reduce_dtype or g.master_dtype, g.master_dtype,
                                  via_all_reduce, comm.world_size) for g, f in zip(groups, grads)]
        return tuple(done() for done in started)


# Flat groups of up to this many padded elements in all share one collective: one latency, for two buffers and a copy
JOIN_NUMEL = 1 << 22


def _joined(groups: Sequence[FlatGroup], dtype_of: Callable[[FlatGroup], torch.dtype]) -> bool:
    """Whether ``groups`` travel joined: several, of one travel dtype and parameter group, small (:data:`JOIN_NUMEL`)."""
    return len(groups) > 1 and len({(dtype_of(g), g.axis) for g in groups}) == 1 and \
        sum(g.padded_numel for g in groups) <= JOIN_NUMEL


def _cut(whole: torch.Tensor, groups: Sequence[FlatGroup]) -> list[torch.Tensor]:
    """``[..., sum(shard_numel)]`` cut into each group's ``[..., shard_numel]``."""
    out, offset = [], 0
    for g in groups:
        out.append(whole[..., offset:offset + g.shard_numel])
        offset += g.shard_numel
    return out


def all_gather_params(shard: ShardState, comm: Communicator, dtype: torch.dtype | None = None, *,
                      groups: Sequence[FlatGroup] | None = None, into: Sequence[torch.Tensor] | None = None
                      ) -> tuple[torch.Tensor, ...]:
    """The gathered flat parameter buffers ``[R, padded_numel]`` of every flat group (or of ``groups``: a stage-3
    unit's, frozen groups too) in the compute dtype ``dtype`` (a group keeping its own dtype gets it,
    :func:`fzero.layout.compute_dtype`): a stage 1-2 state's ``params``, a stage-3 unit's compute buffers. ``into``:
    write into these buffers (a donated state's, which the module's parameters view). Collectives: one ``all_gather``
    per flat group of the master shard cast first (16-bit compute moves 16-bit data), all started before any waits."""
    check_world(shard, comm)
    groups = shard.layout.groups if groups is None else groups
    with step_scope(GATHER, comm.traced):
        xs = [(shard.master if g.opt_group >= 0 else shard.frozen)[g.index].to(compute_dtype(g, dtype))
              for g in groups]
        if into is not None:
            for axis in dict.fromkeys(g.axis for g in groups):  # each parameter group's over its own ranks
                mine = [i for i, g in enumerate(groups) if g.axis == axis]
                comm.param_group(axis).all_gather_into([xs[i] for i in mine], [into[i] for i in mine])
            return tuple(into)
        if _joined(groups, lambda g: compute_dtype(g, dtype)):
            rows, over = comm.local_ranks, group_comm(comm, groups[0])
            full = over.all_gather(torch.cat(xs, dim=1)).view(rows, over.world_size, -1)
            return tuple(p.reshape(rows, g.padded_numel) for g, p in zip(groups, _cut(full, groups)))
        started = [group_comm(comm, g).all_gather_start(x) for g, x in zip(groups, xs)]
        return tuple(done() for done in started)


def full_params(shard: ShardState, comm: Communicator, dtype: torch.dtype | None = None) -> Any:
    """Every parameter in the model's structure, each leaf ``[R, *shape]`` in ``dtype`` (:func:`all_gather_params`'
    buffers viewed per parameter; frozen ones broadcast views of their replicated copy)."""
    frozen = {s.path: f for s, f in frozen_params(shard, comm)}
    return param_tree(shard.layout, all_gather_params(shard, comm, dtype), frozen, dtype)


def global_norm(grads: Sequence[torch.Tensor], comm: Communicator) -> torch.Tensor:
    """L2 norm (0-d float32) of gradients sharded as ``[R, shard_numel]`` (padding zero): one ``all_reduce(sum)``."""
    return comm.all_reduce(local_sq_norm(grads), "sum")[0].sqrt().float()


def _rows_ranks(layout: Layout, master: Sequence[torch.Tensor], comm: Communicator | None) -> list[int]:
    """The global ranks of the shards' rows: the communicator's, or a simulated world's 0..R-1."""
    if comm is not None:
        return list(comm.ranks)
    rows = master[0].shape[0] if master else 0
    if rows != layout.world_size or layout.axes:
        raise ValueError("shard_step: on a real rank or with parameter groups, parameters without a gradient and "
                         "rules that update by piece need the rows' ranks: pass comm=")
    return list(range(rows))


def _rows_of(layout: Layout, group: FlatGroup, master: Sequence[torch.Tensor],
             comm: Communicator | None) -> list[tuple[int, dict[int, int]]]:
    """Per local row, ``(the rank whose shard of group it holds, its positions in the per-parameter vectors)``."""
    if not layout.axes:
        where = trainable_index(layout)
        return [(r, where) for r in _rows_ranks(layout, master, comm)]
    _rows_ranks(layout, master, comm)  # comm given
    return list(zip(group_comm(comm, group).ranks, rows_positions(layout, comm)))


def shard_step(shard: ShardState, opt_state: OptState, grads: Sequence[torch.Tensor],
               found_inf: torch.Tensor | None = None, *, used: torch.Tensor | None = None,
               comm: Communicator | None = None, donate: bool = False) -> tuple[ShardState, OptState]:
    """The update rule on every flat group's master shard: the next ``(ShardState, OptState)``. ``grads``: per flat
    group ``[R, shard_numel]``, unscaled (:func:`fzero.unscale_and_check`). ``found_inf``: 0-d, agreed; nonzero keeps
    every value bitwise and the step count (selection, no host sync). ``used`` (``[T]`` bool, agreed,
    ``Layout.trainable_slots`` order; ``None``: all): parameters some rank had a gradient for; one without keeps its
    value and moments, and ``opt_state.missed`` counts the steps it sat out (its own step count, torch.optim's ``step``,
    is ``step - missed``); their own step scalars take one pass (traced unless ``OptState.all_stepped``). ``donate``:
    update shards and moments in place (consuming the inputs), else copies; both run the rule's in-place form (fused
    Adam(W)) and give the same bits. ``comm``: the rows' ranks (and :func:`fzero.muon`'s collectives)."""
    lay, opt = shard.layout, opt_state.optimizer
    if len(grads) != len(lay.groups):
        raise ValueError(f"shard_step: got {len(grads)} gradient shards for {len(lay.groups)} flat groups")
    if len(opt_state.moments) != len(lay.groups):
        raise ValueError(f"shard_step: OptState.moments has {len(opt_state.moments)} flat groups, the layout "
                         f"{len(lay.groups)}: the optimizer state belongs to another layout")
    for g, p, grad in zip(lay.groups, shard.master, grads):
        if tuple(grad.shape) != tuple(p.shape):
            raise ValueError(f"shard_step: gradient shard of flat group {g.index} has shape {tuple(grad.shape)}, "
                             f"the master shard {tuple(p.shape)}")
    n = lay.num_positions
    if used is not None and tuple(used.shape) != (n,):
        raise ValueError(f"shard_step: used must be [{n}] (one flag per trainable parameter, Layout.num_positions), "
                         f"got {tuple(used.shape)}")
    traced = comm is not None and comm.traced
    with step_scope(UPDATE, traced):
        missed = opt_state.missed[0] if opt_state.missed else opt_state.step.new_zeros(n)
        if not opt.elementwise:
            if lay.axes:
                raise ValueError(f"shard_step: {opt.name} updates shards by piece (a ShardRule), which parameter "
                                 "groups do not support yet: use an elementwise rule (SGD, Adam, AdamW)")
            if traced:
                check_compilable(opt)
            return _step_in_place(shard, opt_state, grads, found_inf, used, comm, donate, missed)
        # known on the host without reading the device: every parameter has a gradient and none ever sat out a step
        plain = used is None and opt_state.all_stepped
        skip = None if found_inf is None else found_inf.to(torch.bool)
        step = opt_state.step + 1 if skip is None else opt_state.step + (~skip).to(opt_state.step.dtype)
        grads = tuple(g.to(p.dtype) for g, p in zip(grads, shard.master))
        master, moments, fused = shard.master, opt_state.moments, None
        if plain or not traced:  # the rule's in-place form (torch's fused kernel), on copies unless donating
            master = tuple(p if donate else p.clone() for p in master)
            moments = tuple(tuple(m if donate else m.clone() for m in ms) for ms in moments)
            hold = found_inf
            if not plain:
                # eagerly the fused kernel still runs where it applies, decided on the device: where every parameter
                # had a gradient on some rank and none sat out a step (the common case), else the written-out rule
                # below, each a no-op where the other applies; the bits of either, no host read
                fused = ~missed.any() if used is None else used.all() & ~missed.any()
                hold = (~fused if skip is None else skip | ~fused).to(torch.float32)
            for g, p, grad, ms in zip(lay.groups, master, grads, moments):
                opt.update_(p, grad, ms, opt_state.hyper[g.opt_group], opt_state.step, hold)
            if plain:
                return replace(shard, master=master), replace(opt_state, step=step, moments=moments)
            donate = True  # the copies are this step's own
        applied = torch.ones((), dtype=torch.bool, device=step.device) if skip is None else ~skip
        take_all = applied if fused is None else applied & ~fused
        flags = torch.ones(n, dtype=torch.bool, device=missed.device) if used is None else used.to(missed.device)
        steps = opt_state.step.to(missed.device) - missed
        out_missed = (missed + (~flags & applied.to(missed.device)).to(missed.dtype),)
        new_master, new_moments = [], []
        for g, p, grad, ms in zip(lay.groups, master, grads, moments):
            hyper = opt_state.hyper[g.opt_group]
            per_slot = torch.cat([opt.step_scalars(hyper, steps), flags.to(torch.float64).unsqueeze(1)], dim=1)
            p2, m2 = _update_by_element(opt, lay, g, p, grad, ms, hyper, opt_state.step, per_slot.to(p.device),
                                        take_all.to(p.device), _rows_of(lay, g, shard.master, comm), donate)
            new_master.append(p2)
            new_moments.append(tuple(m2))
        # whether some parameter sat out this step is on the device: from now on the host assumes one did
        return (replace(shard, master=tuple(new_master)),
                replace(opt_state, step=step, moments=tuple(new_moments), missed=out_missed, all_stepped=False))


def _update_by_element(opt: Optimizer, layout: Layout, group: FlatGroup, p: torch.Tensor, grad: torch.Tensor,
                       moments: tuple[torch.Tensor, ...], hyper: Any, step: torch.Tensor, per_slot: torch.Tensor,
                       take_all: torch.Tensor, rows: Sequence[tuple[int, dict[int, int]]],
                       donate: bool) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """One flat group's update, each parameter with its own step scalars (``per_slot[k]``, then its used flag), only
    where used and ``take_all``; padding left alone. ``rows``: each local row's shard rank and positions
    (:func:`_rows_of`). Each element's row filled in piece by piece (static): one pass, fused when compiled."""
    names = opt.step_scalar_names
    table = torch.cat([per_slot, per_slot.new_zeros(1, per_slot.shape[1])])  # last row: the padding's
    index = []
    for rank, where in rows:
        # each piece's elements take its row, the padding the last: fills on the device (no host list copied to it,
        # which would wait for the device; traced, one fused kernel)
        row = torch.full((group.shard_numel,), table.shape[0] - 1, dtype=torch.int32, device=p.device)
        for k, lo, hi in shard_pieces(layout, group, rank, where):
            if k is not None and hi > lo:
                row.narrow(0, lo, hi - lo).fill_(k)
        index.append(row)
    index = torch.stack(index)  # [R, n]: each element's row of the table
    spread = {name: table[index, j].to(p.dtype) for j, name in enumerate(names)}
    new_p, new_m = opt.update(p, grad, moments, hyper, step, spread)
    take = (table[index, len(names)] != 0) & take_all
    new = (torch.where(take, new_p, p), *(torch.where(take, b, a) for a, b in zip(moments, new_m)))
    if not donate:
        return new[0], new[1:]
    torch._foreach_copy_([p, *moments], list(new))  # written back in one read-modify-write pass
    return p, moments


def _step_in_place(shard: ShardState, opt_state: OptState, grads: Sequence[torch.Tensor],
                   found_inf: torch.Tensor | None, used: torch.Tensor | None, comm: Communicator | None,
                   donate: bool, missed: torch.Tensor) -> tuple[ShardState, OptState]:
    """Eager :func:`shard_step` of a ``ShardRule``: ``found_inf`` and ``used`` read on the host (as torch.optim reads
    ``found_inf``); only the parameters that take the step are updated, at their own step counts and scalar state."""
    opt, lay = opt_state.optimizer, shard.layout
    n = len(lay.trainable_slots)
    ranks = _rows_ranks(lay, shard.master, comm)
    applied = found_inf is None or not bool(found_inf)
    take = [applied] * n if used is None else [applied and bool(u) for u in used.tolist()]
    step = int(opt_state.step)
    master = [p if donate else p.clone() for p in shard.master]
    moments = [tuple(m if donate else m.clone() for m in ms) for ms in opt_state.moments]
    vectors: list[torch.Tensor] = []
    if opt.vector_names:  # per-parameter vector state (replicated): created at the first step if absent
        vectors = list(opt_state.vectors) or list(init_vectors(opt, [s.shape for s in lay.trainable_slots],
                                                               vector_dtype(shard.master), shard.master[0].device))
        vectors = vectors if donate else [v.clone() for v in vectors]
    scalars = [s.tolist() for s in (opt_state.scalars or init_scalars(opt, n))]
    if applied:  # found_inf is agreed: every rank calls the rule's collectives, or none
        opt.update_shards(Update(lay, tuple(master), tuple(g.to(p.dtype) for g, p in zip(grads, master)),
                                 tuple(moments), opt_state.hyper, [step - int(m) for m in missed.tolist()], take,
                                 ranks, scalars, vectors), comm)
    sat_out = [applied and not t for t in take]
    new_missed = missed + torch.tensor(sat_out, dtype=torch.int64, device=missed.device)
    return (replace(shard, master=tuple(master)),
            replace(opt_state, step=opt_state.step + int(applied), moments=tuple(moments),
                    missed=(new_missed,) if (opt_state.missed or used is not None) else (),
                    # per-parameter scalars stay host numbers: the rules read them on the host (OptState)
                    scalars=tuple(torch.tensor(s, dtype=torch.float64, device="cpu") for s in scalars),
                    vectors=tuple(vectors),
                    all_stepped=opt_state.all_stepped and not any(sat_out)))
