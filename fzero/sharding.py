"""This rank's shard of the flat layout and the pure functions that move data
between full parameters/gradients and shards.

Imports: ``fzero.layout``, ``fzero.comm``, ``fzero.optim``, ``fzero.pytree``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch
import torch.utils._pytree as tp

from . import scratch
from .comm import Communicator, gradient_divide_factors
from .layout import (
    FlatGroup,
    Layout,
    build_layout,
    check_floating_tensor,
    compute_dtype,
    flat_shard,
    flatten_group,
    group_views,
    named_leaves,
)
from .optim import OptState, Optimizer, Piece, _vector_dtype, check_compilable, init_scalars, init_vectors
from .pytree import pytree_dataclass, replace, static_field
from .scaler import local_sq_norm

__all__ = [
    "ShardState",
    "init_shard",
    "shard_layout",
    "check_world",
    "reduce_scatter_grads",
    "gather_flat_params",
    "gather_flat_params_into",
    "gather_step_params",
    "all_gather_params",
    "trainable_views",
    "merge_params",
    "average_flat_grads",
    "local_sq_norm",
    "stack_rows",
    "shard_step",
    "global_norm",
    "travel_joined",
    "update_by_piece",
    "plain_update_known",
    "LOW_PRECISION",
]

LOW_PRECISION = (torch.float16, torch.bfloat16)


@pytree_dataclass
class ShardState:
    """This process's shards of the flat layout.

    Leaves: ``master``, one ``[R, shard_numel]`` tensor per flat group in the
    group's master dtype (float32; float64 for float64 parameters);
    ``frozen``, the frozen parameters in full (replicated, no rank axis).
    Static: the :class:`~fzero.layout.Layout`.
    """

    master: tuple[torch.Tensor, ...]
    frozen: tuple[torch.Tensor, ...]
    layout: Layout = static_field()


def init_shard(
    params: Any,
    comm: Communicator,
    *,
    trainable: Optional[Any] = None,
    optimizer: Optional[Optimizer] = None,
    bucket_of: Optional[Any] = None,
    keep_dtype: Optional[Any] = None,
    alignment: int = 16,
) -> ShardState:
    """Lay out ``params`` (``nn.Module`` or pytree) for ``comm`` and build this process's shards.

    Each local rank materialises only the slice it owns. ``optimizer`` assigns
    parameter groups by path; ``keep_dtype(path)``: see :func:`fzero.layout.build_layout`.
    Collective: ``comm.check_layout`` (on a real process group, one ``all_gather_object``
    that makes every rank raise if the ranks built different layouts).
    """
    layout = shard_layout(params, comm, trainable=trainable, optimizer=optimizer, bucket_of=bucket_of,
                          keep_dtype=keep_dtype, alignment=alignment)
    leaves = [x for _, x in named_leaves(params)[0]]
    master = tuple(_master_rows(layout, g, leaves, comm.ranks) for g in layout.groups)
    # A module's frozen parameters are shared with it, never written (one copy in memory); a
    # pytree's are copied, since its tensors stay the caller's to change.
    own = (lambda t: t.detach()) if isinstance(params, torch.nn.Module) else (lambda t: t.detach().clone())
    frozen = tuple(own(leaves[i]) for i, s in enumerate(layout.slots) if s.group < 0)
    return ShardState(master, frozen, layout)


def _master_rows(layout: Layout, group: FlatGroup, leaves: Sequence[torch.Tensor],
                 ranks: Sequence[int]) -> torch.Tensor:
    """``[R, shard_numel]``: each local rank's shard written in place (no stacked second copy;
    a contiguous tensor of its own, not a view, as a compiled step wants its inputs)."""
    out = torch.zeros(len(ranks), group.shard_numel, dtype=group.master_dtype,
                      device=leaves[group.slots[0]].device)
    for row, r in enumerate(ranks):
        flat_shard(layout, group, leaves, r, out=out[row])
    return out


def shard_layout(
    params: Any,
    comm: Communicator,
    *,
    trainable: Optional[Any] = None,
    optimizer: Optional[Optimizer] = None,
    bucket_of: Optional[Any] = None,
    keep_dtype: Optional[Any] = None,
    alignment: int = 16,
) -> Layout:
    """The layout :func:`init_shard` builds for ``params`` and ``comm`` (shapes only: a meta
    module is laid out as it is). Collective: ``comm.check_layout``."""
    layout = build_layout(
        params,
        comm.world_size,
        trainable=trainable,
        group_of=optimizer.group_of if optimizer is not None else None,
        bucket_of=bucket_of,
        keep_dtype=keep_dtype,
        alignment=alignment,
    )
    comm.check_layout(layout)
    return layout


def check_world(shard: ShardState, comm: Communicator) -> None:
    """Raise ``ValueError`` if ``shard`` was built for another world than ``comm``'s."""
    lay = shard.layout
    if lay.world_size != comm.world_size:
        raise ValueError(
            f"ShardState.layout.world_size is {lay.world_size} but the communicator's world size is "
            f"{comm.world_size}: this state was built for another world (reshard it first)"
        )
    for g, m in zip(lay.groups, shard.master):
        if m.numel() == 0 and g.shard_numel > 0:
            raise ValueError(
                f"ShardState.master[{g.index}] is empty: this state was donated to a step "
                "(donate=True) and consumed; use the state that step returned"
            )
        if tuple(m.shape) != (comm.local_ranks, g.shard_numel):
            raise ValueError(
                f"ShardState.master[{g.index}] has shape {tuple(m.shape)}, expected "
                f"({comm.local_ranks}, {g.shard_numel}) for this communicator"
            )


def _grad_leaves(layout: Layout, grads: Any, rows: int) -> list[Optional[torch.Tensor]]:
    """Gradients in layout order (None for frozen slots), validated against the layout."""
    named, _ = named_leaves(grads)
    by_path = dict(named)
    known = set(layout.paths)
    for path in by_path:
        if path not in known:
            raise ValueError(f"grads has an entry {path!r} that is not a parameter of the layout")
    out: list[Optional[torch.Tensor]] = []
    for s in layout.slots:
        g = by_path.get(s.path)
        if s.group < 0:
            out.append(None)
            continue
        if g is None:
            raise ValueError(f"grads is missing trainable parameter {s.path!r}")
        check_floating_tensor(f"grads[{s.path!r}]", g)
        if tuple(g.shape) != (rows, *s.shape):
            raise ValueError(
                f"grads[{s.path!r}] has shape {tuple(g.shape)}; parameter {s.path!r} needs "
                f"{(rows, *s.shape)} (leading local-rank axis {rows})"
            )
        out.append(g)
    return out


def reduce_scatter_grads(
    shard: ShardState,
    grads: Any,
    comm: Communicator,
    *,
    reduce_dtype: Optional[torch.dtype] = None,
    via_all_reduce: bool = False,
    flat: bool = False,
    start: bool = False,
) -> Any:
    """Average gradients over ranks and keep this rank's shard of each flat group.

    ``grads``: a tree shaped like the parameters (``{path: tensor}`` or the
    model's own structure), each leaf ``[R, *shape]`` in any floating dtype;
    frozen parameters may be absent or None. ``flat=True``: ``grads`` is already
    flat, one ``[R, padded_numel]`` buffer per flat group of the layout (what
    :func:`fzero.grads.loss_grads` gives unreduced). Returns one ``[R, shard_numel]``
    tensor per flat group in the master dtype, padding zero. ``start=True``: the
    collectives are started now and a function is returned that waits and gives them
    (whatever runs in between overlaps the communication).

    Communication: the flat groups of one reduce dtype travel joined in one
    ``reduce_scatter`` while small (:func:`average_flat_groups_start`; the same bits as one
    per group), otherwise one per flat group (``via_all_reduce``: ``all_reduce`` and a
    local slice, ZeRO stage 1), in ``reduce_dtype`` (default: the master dtype). In
    fp16/bf16 the gradients are divided by FSDP's pre-factor before the sum and by the
    post-factor after it, in that dtype, then cast to the master dtype; otherwise the sum
    is divided by W.
    """
    check_world(shard, comm)
    lay = shard.layout
    if flat:
        flats = tuple(grads)
        if len(flats) != len(lay.groups):
            raise ValueError(f"reduce_scatter_grads(flat=True): {len(flats)} flat buffers for "
                             f"{len(lay.groups)} flat groups of the layout")
        for g, f in zip(lay.groups, flats):
            if tuple(f.shape) != (comm.local_ranks, g.padded_numel):
                raise ValueError(f"reduce_scatter_grads(flat=True): flat group {g.index} has shape "
                                 f"{tuple(f.shape)}, expected {(comm.local_ranks, g.padded_numel)}")
    else:
        leaves = _grad_leaves(lay, grads, comm.local_ranks)
        flats = tuple(flatten_group(lay, g, leaves) for g in lay.groups)
    done = average_flat_groups_start(flats, lay.groups, comm, reduce_dtype, via_all_reduce)
    return done if start else done()


def average_flat_grads(
    flat: torch.Tensor,
    comm: Communicator,
    reduce_dtype: torch.dtype,
    out_dtype: torch.dtype,
    via_all_reduce: bool = False,
) -> torch.Tensor:
    """Average one flat gradient buffer ``[R, padded]`` over ranks, keep this rank's shard.

    The communication of :func:`reduce_scatter_grads`, for an already flat buffer.
    """
    return average_flat_grads_start(flat, comm, reduce_dtype, out_dtype, via_all_reduce)()


def average_flat_grads_start(
    flat: torch.Tensor,
    comm: Communicator,
    reduce_dtype: torch.dtype,
    out_dtype: torch.dtype,
    via_all_reduce: bool = False,
) -> Callable[[], torch.Tensor]:
    """:func:`average_flat_grads` started now and finished when the returned function is
    called; the reduce-scatter overlaps whatever runs in between
    (``Communicator.reduce_scatter_start``). In 16 bits, FSDP's pre/post divide factors keep
    the sum in range; otherwise the collective averages."""
    x = flat.to(reduce_dtype)
    low = reduce_dtype in LOW_PRECISION
    pre, post = gradient_divide_factors(comm.world_size) if low else (1, 1)
    if pre > 1:
        x = x / pre
    op = "sum" if low else "avg"
    if via_all_reduce:
        done = comm.all_reduce_shard_start(x, op)
    else:
        done = comm.reduce_scatter_start(x, op)

    def finish() -> torch.Tensor:
        y = done()
        return (y / post if post > 1 else y).to(out_dtype)

    return finish


def gather_flat_params(
    shard: ShardState, comm: Communicator, dtype: Optional[torch.dtype] = None,
    then: Optional[Callable[[FlatGroup, torch.Tensor], None]] = None,
) -> tuple[torch.Tensor, ...]:
    """Full flat parameter buffers ``[R, padded_numel]`` per flat group, in ``dtype``.

    ``dtype``: the compute dtype (default: each group's parameter dtype; a group that keeps its
    dtype gets its own, :func:`fzero.layout.compute_dtype`, as everywhere below). The
    master shard is cast *before* the ``all_gather`` (one per flat group), so
    16-bit compute moves 16-bit data. ``then(group, flat)`` runs as each group
    arrives, before the next is gathered (init hands a module's parameters over
    group by group with it).
    """
    check_world(shard, comm)
    out = []
    for g, m in zip(shard.layout.groups, shard.master):
        out.append(comm.all_gather(m.to(compute_dtype(g, dtype))))
        if then is not None:
            then(g, out[-1])
    return tuple(out)


def gather_flat_params_at_once(
    shard: ShardState, comm: Communicator, dtype: Optional[torch.dtype] = None
) -> tuple[torch.Tensor, ...]:
    """:func:`gather_flat_params` for every flat group in one ``all_gather``
    (:func:`gather_flat_groups_start` of all groups, waited for at once)."""
    check_world(shard, comm)
    return gather_flat_groups_start(shard, shard.layout.groups, comm, dtype)()


# Flat groups of up to this many padded elements in all travel joined in one collective (one
# latency; measured faster on gloo for small models, design.md); larger ones go one collective
# per flat group, each straight into its own buffer: joining would cost a send buffer and a
# rank-major receive buffer of their size and a copy to cut the groups back out, which at
# GPT-2-small size took longer than the collective itself (fresh memory faults in at about
# 2 GB/s on this project's machine; a copy into memory already mapped runs at 7 GB/s).
GATHER_AT_ONCE_NUMEL = 1 << 22


def gather_flat_params_into(
    shard: ShardState,
    comm: Communicator,
    out: Sequence[torch.Tensor],
    dtype: Optional[torch.dtype] = None,
) -> tuple[torch.Tensor, ...]:
    """:func:`gather_flat_params` written into ``out`` (one ``[R, padded_numel]`` buffer per flat
    group, in ``dtype``; e.g. the gathered parameters of a state a donating step consumes, which
    the next forward then reads in place). One ``all_gather`` per flat group, all started before
    any is waited for. Returns ``out``."""
    check_world(shard, comm)
    pairs = [(m.to(compute_dtype(g, dtype)), o) for g, m, o in zip(shard.layout.groups, shard.master, out)]
    if torch.compiler.is_compiling():
        if comm.traced_gather_into_many(pairs):  # gloo: one operator, straight into ``out``
            return tuple(o for _, o in pairs)
        # traced, each gather lands in a buffer of its own before it is copied in: one at a
        # time, so one group's buffer is alive at once, not the whole model's
        return tuple(comm.all_gather_into_start(m, o)() for m, o in pairs)
    started = [comm.all_gather_into_start(m, o) for m, o in pairs]
    return tuple(done() for done in started)


def gather_step_params(
    shard: ShardState,
    comm: Communicator,
    dtype: Optional[torch.dtype] = None,
    into: Optional[Sequence[torch.Tensor]] = None,
) -> tuple[torch.Tensor, ...]:
    """The gathered parameters the next step reads, ``[R, padded_numel]`` per flat group.

    ``into``: buffers to overwrite (a donated state's; :func:`gather_flat_params_into`),
    otherwise new buffers (:func:`gather_flat_params_at_once`). Same values either way."""
    if into is not None:
        return gather_flat_params_into(shard, comm, into, dtype)
    return gather_flat_params_at_once(shard, comm, dtype)


def travel_joined(groups: Sequence[FlatGroup]) -> bool:
    """Whether ``groups`` travel joined in one collective: only while they are small (see
    :data:`GATHER_AT_ONCE_NUMEL`); joining copies them into one send and one receive buffer."""
    return sum(g.padded_numel for g in groups) <= GATHER_AT_ONCE_NUMEL


def gather_flat_groups_start(
    shard: ShardState, groups: Sequence[FlatGroup], comm: Communicator, dtype: Optional[torch.dtype] = None
) -> Callable[[], tuple[torch.Tensor, ...]]:
    """Start gathering the full flat buffers of ``groups`` in one ``all_gather``; the returned
    function waits and gives them, ``[R, padded_numel]`` each, in ``dtype`` (default: each
    group's parameter dtype).

    The shards are concatenated ``[R, S]``, gathered ``[R, W*S]`` (rank-major), and each
    group's ``[R, W*shard]`` buffer is cut back out: the same values as one gather per
    group, one collective's latency instead of one per group. Groups that would travel in
    different dtypes (``dtype=None`` with float32 and float64 groups), or more than
    :data:`GATHER_AT_ONCE_NUMEL` elements in all, gather one by one (all started at once).
    """
    rows, world = comm.local_ranks, comm.world_size
    dtypes = {compute_dtype(g, dtype) for g in groups}
    if len(groups) == 1 or len(dtypes) != 1 or not travel_joined(groups):
        started = [comm.all_gather_start(shard.master[g.index].to(compute_dtype(g, dtype))) for g in groups]
        return lambda: tuple(done() for done in started)
    travel = dtypes.pop()
    joined = comm.all_gather_start(scratch.cat([shard.master[g.index].to(travel) for g in groups], dim=1))

    def cut() -> tuple[torch.Tensor, ...]:
        full = joined().view(rows, world, -1)
        out, offset = [], 0
        for g in groups:
            out.append(scratch.reshaped(full[:, :, offset : offset + g.shard_numel], (rows, g.padded_numel)))
            offset += g.shard_numel
        return tuple(out)

    return cut


def average_flat_grads_at_once(
    flats: Sequence[torch.Tensor], layout: Layout, comm: Communicator, reduce_dtype: Optional[torch.dtype]
) -> tuple[torch.Tensor, ...]:
    """:func:`average_flat_grads` of every flat group ``[R, padded]`` in one ``reduce_scatter``
    (:func:`average_flat_groups_start` of all groups, waited for at once)."""
    return average_flat_groups_start(flats, layout.groups, comm, reduce_dtype)()


def reduces_joined(groups: Sequence[FlatGroup], reduce_dtype: Optional[torch.dtype]) -> bool:
    """Whether :func:`average_flat_groups_start` reduces ``groups`` in one collective: several
    groups of one reduce dtype, small enough to join (:data:`GATHER_AT_ONCE_NUMEL`)."""
    dtypes = {reduce_dtype or g.master_dtype for g in groups}
    return len(groups) > 1 and len(dtypes) == 1 and travel_joined(groups)


def average_flat_groups_start(
    flats: Sequence[torch.Tensor],
    groups: Sequence[FlatGroup],
    comm: Communicator,
    reduce_dtype: Optional[torch.dtype],
    via_all_reduce: bool = False,
) -> Callable[[], tuple[torch.Tensor, ...]]:
    """:func:`average_flat_grads_start` of the flat gradients ``flats`` (``[R, padded]``, one per
    group of ``groups``) in one collective; the returned function waits and gives each
    group's averaged shard ``[R, shard_numel]`` in its master dtype.

    Groups of one reduce dtype are rearranged rank-major and joined, so each element is
    summed with the same elements in the same rank order as one collective per group: the
    same bits (``SimulatedWorld``, and gloo at W = 2). Groups that reduce in different dtypes,
    or more than :data:`GATHER_AT_ONCE_NUMEL` elements in all, go one by one (all started)."""
    if not reduces_joined(groups, reduce_dtype):
        started = [average_flat_grads_start(f, comm, reduce_dtype or g.master_dtype, g.master_dtype, via_all_reduce)
                   for g, f in zip(groups, flats)]
        return lambda: tuple(done() for done in started)
    rows, world = comm.local_ranks, comm.world_size
    rdtype = reduce_dtype or groups[0].master_dtype
    joined = torch.cat([f.to(rdtype).view(rows, world, g.shard_numel) for g, f in zip(groups, flats)], dim=2)
    reduced = average_flat_grads_start(joined.reshape(rows, -1), comm, rdtype, rdtype, via_all_reduce)

    def cut() -> tuple[torch.Tensor, ...]:
        whole = reduced()
        out, offset = [], 0
        for g in groups:
            out.append(whole[:, offset : offset + g.shard_numel].to(g.master_dtype))
            offset += g.shard_numel
        return tuple(out)

    return cut


def trainable_views(layout: Layout, flat: Sequence[torch.Tensor], row: int) -> dict[str, torch.Tensor]:
    """One rank's trainable parameters ``{path: view of flat[g][row]}`` (what a step differentiates)."""
    out = {}
    for g in layout.groups:
        for i, v in zip(g.slots, group_views(layout, g, flat[g.index][row])):
            out[layout.slots[i].path] = v
    return out


def merge_params(
    layout: Layout,
    trainable: Mapping[str, torch.Tensor],
    frozen: Sequence[torch.Tensor],
    dtype: Optional[torch.dtype] = None,
) -> Any:
    """The full parameter tree in the user's structure: trainable leaves from
    ``trainable`` (by path), frozen leaves from ``frozen`` cast to their compute dtype under ``dtype``."""
    frozen_iter = iter(frozen)
    leaves = []
    for s in layout.slots:
        if s.group >= 0:
            leaves.append(trainable[s.path])
        else:
            leaves.append(next(frozen_iter).to(compute_dtype(s, dtype)))
    return tp.tree_unflatten(leaves, layout.spec)


def all_gather_params(
    shard: ShardState,
    comm: Communicator,
    dtype: Optional[torch.dtype] = None,
    *,
    flat: bool = False,
    into: Optional[Sequence[torch.Tensor]] = None,
) -> Any:
    """The full parameters in the model's structure, each leaf ``[R, *shape]`` in ``dtype``.

    One ``all_gather`` per flat group (see :func:`gather_flat_params`); the master
    shard is cast to ``dtype`` before it, so 16-bit compute moves 16-bit data;
    frozen leaves are broadcast views of the replicated copy.

    ``flat=True``: the gathered flat buffers instead, one ``[R, padded_numel]`` per flat
    group (what a stage 1-2 :class:`~fzero.state.TrainState` keeps in ``params``): small
    groups travel joined in one ``all_gather``. ``into``: write them into these buffers
    (a donated state's, which the module's parameters view) instead of new ones; every
    gather is started before any is waited for. Same values either way.
    """
    if flat:
        return gather_step_params(shard, comm, dtype, into)
    if into is not None:
        raise ValueError("all_gather_params: into= writes flat buffers; pass flat=True")
    flat_bufs = gather_flat_params(shard, comm, dtype)
    lay = shard.layout
    leaves: list[Optional[torch.Tensor]] = [None] * len(lay.slots)
    for g in lay.groups:
        for i in g.slots:
            s = lay.slots[i]
            leaves[i] = flat_bufs[g.index][:, s.offset : s.offset + s.numel].reshape(comm.local_ranks, *s.shape)
    frozen_iter = iter(shard.frozen)
    for i, s in enumerate(lay.slots):
        if s.group < 0:
            f = next(frozen_iter).to(compute_dtype(s, dtype))
            leaves[i] = f.unsqueeze(0).expand(comm.local_ranks, *f.shape)
    return tp.tree_unflatten(leaves, lay.spec)


def stack_rows(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-rank tensors stacked on a new local-rank axis; one rank (a real process): a view."""
    return rows[0].unsqueeze(0) if len(rows) == 1 else torch.stack(list(rows))


def global_norm(grads: Sequence[torch.Tensor], comm: Communicator) -> torch.Tensor:
    """L2 norm of gradients sharded as ``[R, shard_numel]`` tensors (0-d, float32).

    Each element is counted once (shards are disjoint, padding is zero).
    One ``all_reduce(sum)`` of ``R`` elements. Non-finite gradients give a
    non-finite norm.
    """
    return comm.all_reduce(local_sq_norm(grads), "sum")[0].sqrt().float()


def trainable_index(layout: Layout) -> dict[int, int]:
    """``{index in layout.slots: position in layout.trainable_slots}`` (the order of per-parameter
    vectors such as ``OptState.missed`` and a step's ``used`` flags)."""
    return {i: k for k, i in enumerate(i for i, s in enumerate(layout.slots) if s.group >= 0)}


def shard_pieces(layout: Layout, group: FlatGroup, rank: int,
                 where: Optional[Mapping[int, int]] = None) -> list[tuple[Optional[int], int, int]]:
    """``(parameter, lo, hi)`` for each parameter's piece of ``group``'s shard on ``rank``, in
    shard coordinates: ``parameter`` is its :func:`trainable_index` position (``None``: the
    padding). Static: a function of the layout only. No collective."""
    where = trainable_index(layout) if where is None else where
    lo, hi = rank * group.shard_numel, (rank + 1) * group.shard_numel
    out, begin = [], 0
    ends = [(where[i], layout.slots[i].numel) for i in group.slots] + [(None, group.padded_numel - group.numel)]
    for k, n in ends:
        a, b = max(begin, lo), min(begin + n, hi)
        if b > a:
            out.append((k, a - lo, b - lo))
        begin += n
    return out


def _update_by_element(opt: Optimizer, layout: Layout, group: FlatGroup, p: torch.Tensor, grad: torch.Tensor,
                       moments: tuple[torch.Tensor, ...], hyper: Mapping[str, torch.Tensor], step: torch.Tensor,
                       per_slot: torch.Tensor, take_all: torch.Tensor, ranks: Sequence[int],
                       where: Mapping[int, int], donate: bool) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The update of one flat group's shards ``[R, n]`` with each parameter's own step
    scalars (``per_slot[k]``: :meth:`Optimizer.step_scalars`, then the used flag), taken only
    where its parameter is used and ``take_all`` (0-d bool) holds; the padding is left alone.
    Donating: written into ``p`` and ``moments``; else new tensors. One pass over the shard:
    each element finds its parameter's row by a binary search of the static piece ends
    (``bucketize``), so a compiled step fuses the look-up into the update and writes a donated
    shard in place. Inductor keeps the look-up's index (int32, the shard's element count) as a
    buffer. Other forms were worse in a graph: the scalars spread over the shard ``[R, n, k]``
    (+454 MiB at the step's peak on a 54M TinyGPT), pieces copied into slices of a donated
    shard (each a copy of the whole shard). Eagerly this runs only once some parameter has
    sat out a step."""
    names = opt.step_scalar_names
    table = torch.cat([per_slot, per_slot.new_zeros(1, per_slot.shape[1])])  # last row: the padding's
    padding_row = table.shape[0] - 1
    index = []
    for rank in ranks:
        pieces = shard_pieces(layout, group, rank, where)
        ends = torch.tensor([hi for _, _, hi in pieces], dtype=torch.int32, device=p.device)
        rows = torch.tensor([padding_row if k is None else k for k, _, _ in pieces], dtype=torch.int32,
                            device=p.device)
        position = torch.arange(group.shard_numel, dtype=torch.int32, device=p.device)
        index.append(rows[torch.bucketize(position, ends, right=True, out_int32=True)])
    index = torch.stack(index)  # [R, n]: each element's row of the table
    spread = {name: table[index, j].to(p.dtype) for j, name in enumerate(names)}
    new_p, new_m = opt.update(p, grad, moments, hyper, step, spread)
    take = (table[index, len(names)] != 0) & take_all
    new_p = torch.where(take, new_p, p)
    new_m = tuple(torch.where(take, b, a) for a, b in zip(moments, new_m))
    if not donate:
        return new_p, new_m
    for old, new in zip((p, *moments), (new_p, *new_m)):
        old.copy_(new)
    return p, moments


def _piece_views(layout: Layout, group: FlatGroup, row: int, rank: int, where: Mapping[int, int],
                 tensors: Sequence[torch.Tensor]) -> dict[int, list[torch.Tensor]]:
    """``{parameter: [view of each of tensors[j][row] on its piece]}`` for every parameter of
    ``group``; a parameter with no piece on ``rank`` gets empty views (it still updates its
    per-parameter scalar state, which every rank holds)."""
    pieces = {k: (lo, hi) for k, lo, hi in shard_pieces(layout, group, rank, where) if k is not None}
    out = {}
    for i in group.slots:
        lo, hi = pieces.get(where[i], (0, 0))
        out[where[i]] = [t[row, lo:hi] for t in tensors]
    return out


def update_by_piece(opt: Optimizer, layout: Layout, group: FlatGroup, p: torch.Tensor, grad: torch.Tensor,
                     moments: tuple[torch.Tensor, ...], hyper: Mapping[str, torch.Tensor], own: Sequence[int],
                     take: Sequence[bool], scalars: list[list[float]], ranks: Sequence[int],
                     where: Mapping[int, int]) -> None:
    """In place: each parameter of ``group`` that takes the step (``take``, by trainable
    index) updates its piece of every row of ``p`` and ``moments`` (``[R, n]``) by the rule's
    :meth:`~fzero.optim.Optimizer.update_pieces`, at its own step count ``own``; ``scalars``
    (per scalar name, per parameter) gets its new scalar state. Padding is not touched."""
    pieces = []
    for row, rank in enumerate(ranks):
        for k, views in _piece_views(layout, group, row, rank, where, (p, grad, *moments)).items():
            if take[k]:
                pieces.append(Piece(k, own[k], views[0], views[1], tuple(views[2:]),
                                    tuple(s[k] for s in scalars)))
    for piece, new in zip(pieces, opt.update_pieces(pieces, hyper)):
        for s, v in zip(scalars, new):
            s[piece.param] = v  # every piece of a parameter gives the same values


# Whether no parameter has ever sat out a step, as fzero.compiled.compiled_step knows it on the
# host before each call; read by a trace of shard_step as a constant (dynamo guards on it).
_PLAIN_UPDATE = {"known": False}


@contextlib.contextmanager
def plain_update_known(no_missed: bool) -> Iterator[None]:
    """Inside: a traced :func:`shard_step` given ``uniform=True`` may run the plain update when
    ``no_missed`` (no parameter ever sat out a step, known on the host; see
    :func:`fzero.compiled.compiled_step`). Outside, a trace assumes nothing and selects."""
    before = _PLAIN_UPDATE["known"]
    _PLAIN_UPDATE["known"] = no_missed
    try:
        yield
    finally:
        _PLAIN_UPDATE["known"] = before


def shard_step(
    shard: ShardState,
    opt_state: OptState,
    grads: Sequence[torch.Tensor],
    found_inf: Optional[torch.Tensor] = None,
    *,
    donate: bool = False,
    used: Optional[torch.Tensor] = None,
    ranks: Optional[Sequence[int]] = None,
    uniform: bool = False,
    comm: Optional[Communicator] = None,
) -> tuple[ShardState, OptState]:
    """Apply the optimizer to every flat group's master shard.

    ``grads``: per flat group ``[R, shard_numel]`` (from :func:`reduce_scatter_grads`,
    unscaled). ``found_inf``: 0-d, agreed across ranks; when it is nonzero the
    returned states hold bitwise the input values (selection, not a Python
    branch on a tensor; no host sync) and the step count holds.

    ``used`` (``[T]`` bool, agreed across ranks, ``Layout.trainable_slots`` order):
    whether some rank had a gradient for each parameter. A parameter without one is
    left alone, moments included (``torch.optim`` skips a parameter whose gradient is
    ``None``, DDP leaves it ``None``), and ``opt_state.missed`` counts the step for it,
    so its own step count (Adam's bias correction, SGD's first momentum) is
    ``step - missed``, as torch.optim's per-parameter ``step``. ``ranks``: the global
    ranks of the shards' rows (the communicator's ``ranks``), needed with ``used``.
    ``uniform``: compiled, the caller's static knowledge that this rank had a gradient for
    every parameter, so every flag of ``used`` comes back set; with
    :func:`plain_update_known` saying no parameter ever missed a step (``compiled_step`` does),
    the plain update runs (eagerly both are read on the host).
    ``None``: every parameter takes the step (DeepSpeed's flat behaviour: no gradient
    is a zero gradient).

    ``donate=False`` (pure): the inputs are untouched; the result is new
    buffers. ``donate=True``: master shards and moments are updated in place
    and the returned states hold the same tensors; the inputs are consumed
    (see :func:`fzero.step.make_train_step` for the bookkeeping that makes a
    consumed state raise). Eagerly both run torch's fused Adam(W) kernel (the
    pure form on fresh copies), so they give bitwise the same numbers; with ``used``,
    eagerly, when every parameter had a gradient and none ever missed a step (read on
    the host: a ``[T]`` vector), and otherwise the written-out update with per-element
    step scalars and a mask. A rule that updates by piece (``Optimizer.by_piece``:
    :func:`fzero.from_torch_optim`) runs eagerly on each parameter's piece instead, with its
    per-parameter scalars (``OptState.scalars``); traced, it raises naming the rule.
    No collective, except for a rule with ``Optimizer.needs_comm`` (:func:`fzero.muon`): it
    calls the collectives of ``comm`` (required for it, and its ``ranks`` are the rows').
    """
    lay = shard.layout
    if len(grads) != len(lay.groups):
        raise ValueError(f"shard_step: got {len(grads)} gradient shards for {len(lay.groups)} flat groups")
    if len(opt_state.moments) != len(lay.groups):
        raise ValueError(
            f"shard_step: OptState.moments has {len(opt_state.moments)} flat groups, the layout "
            f"{len(lay.groups)}: the optimizer state belongs to another layout"
        )
    opt = opt_state.optimizer
    if opt.by_piece:
        return _shard_step_by_piece(shard, opt_state, grads, found_inf, donate=donate, used=used, ranks=ranks,
                                    comm=comm)
    skip = None if found_inf is None else found_inf.to(torch.bool)
    applied = torch.ones((), dtype=torch.bool) if skip is None else ~skip
    missed = opt_state.missed
    if used is not None:
        n = len(lay.trainable_slots)
        if ranks is None or tuple(used.shape) != (n,):
            raise ValueError(f"shard_step: used must be [{n}] (one flag per trainable parameter) with the "
                             f"rows' ranks, got {tuple(used.shape)} and ranks={ranks!r}")
        before = missed[0] if missed else torch.zeros(n, dtype=torch.int64, device=used.device)
        if (uniform and _PLAIN_UPDATE["known"] if torch.compiler.is_compiling()
                else (bool(used.all()) and not bool(before.any()))):
            used = None  # every parameter steps alike: the plain (fused) update, and missed stays 0
        else:
            steps = opt_state.step.to(before.device) - before
            missed = (before + (~used & applied.to(used.device)).to(before.dtype),)
            where = trainable_index(lay)
    out_of_place = not donate and torch.compiler.is_compiling()
    new_master, new_moments = [], []
    for g, p, grad, moments in zip(lay.groups, shard.master, grads, opt_state.moments):
        if tuple(grad.shape) != tuple(p.shape):
            raise ValueError(
                f"shard_step: gradient shard of flat group {g.index} has shape {tuple(grad.shape)}, "
                f"the master shard {tuple(p.shape)}"
            )
        hyper = opt_state.hyper[g.opt_group]
        grad = grad.to(p.dtype)
        if used is not None:
            # per parameter: its step count's scalars and whether it takes the step; written
            # out, selected by torch.where (eager or compiled), in place when donating
            per_slot = torch.cat([opt.step_scalars(hyper, steps), used.to(torch.float64).unsqueeze(1)], dim=1)
            p2, m2 = _update_by_element(opt, lay, g, p, grad, moments, hyper, opt_state.step,
                                          per_slot.to(p.device), applied.to(p.device), ranks, where, donate)
        elif out_of_place:
            # Compiled and pure: inductor writes fresh outputs in one fused pass.
            p2, m2 = opt.update(p, grad, moments, hyper, opt_state.step)
            if skip is not None:
                p2 = torch.where(skip, p, p2)
                m2 = tuple(torch.where(skip, a, b) for a, b in zip(moments, m2))
        else:
            p2, m2 = (p, moments) if donate else (p.clone(), tuple(m.clone() for m in moments))
            opt.update_(p2, grad, m2, hyper, opt_state.step, found_inf)
        new_master.append(p2)
        new_moments.append(tuple(m2))
    step = opt_state.step + 1 if skip is None else opt_state.step + (~skip).to(opt_state.step.dtype)
    return (
        replace(shard, master=tuple(new_master)),
        replace(opt_state, step=step, moments=tuple(new_moments), missed=missed),
    )


def _shard_step_by_piece(
    shard: ShardState,
    opt_state: OptState,
    grads: Sequence[torch.Tensor],
    found_inf: Optional[torch.Tensor],
    *,
    donate: bool,
    used: Optional[torch.Tensor],
    ranks: Optional[Sequence[int]],
    comm: Optional[Communicator] = None,
) -> tuple[ShardState, OptState]:
    """:func:`shard_step` for a rule that updates each parameter's piece
    (:attr:`~fzero.optim.Optimizer.by_piece`): eagerly only. ``found_inf`` and ``used`` are
    read on the host (torch.optim's own loop reads its ``found_inf`` the same way), and
    only the parameters that take the step are updated, at their own step counts
    (``step - missed``), with their own scalar state (``OptState.scalars``)."""
    if torch.compiler.is_compiling():
        check_compilable(opt_state.optimizer)
    opt, lay = opt_state.optimizer, shard.layout
    n = len(lay.trainable_slots)
    if opt.needs_comm and comm is None:
        raise ValueError(f"shard_step: optimizer {opt.name} calls collectives in its step: pass comm=")
    if ranks is None and comm is not None:
        ranks = comm.ranks
    if ranks is None:
        if used is not None:
            raise ValueError("shard_step: used needs the rows' ranks (ranks=comm.ranks)")
        ranks = _rows_as_ranks(lay, shard.master)
    missed = opt_state.missed[0] if opt_state.missed else torch.zeros(n, dtype=torch.int64)
    applied = found_inf is None or not bool(found_inf)
    take = [applied] * n if used is None else [applied and bool(u) for u in used.tolist()]
    step = int(opt_state.step)
    own = [step - int(m) for m in missed.tolist()]
    scalars = [s.tolist() for s in (opt_state.scalars or init_scalars(opt, n))]
    where = trainable_index(lay)
    new_master, new_moments = [], []
    for g, p, grad, moments in zip(lay.groups, shard.master, grads, opt_state.moments):
        if tuple(grad.shape) != tuple(p.shape):
            raise ValueError(f"shard_step: gradient shard of flat group {g.index} has shape "
                             f"{tuple(grad.shape)}, the master shard {tuple(p.shape)}")
        p2, m2 = (p, moments) if donate else (p.clone(), tuple(m.clone() for m in moments))
        if applied and not opt.needs_comm:
            update_by_piece(opt, lay, g, p2, grad.to(p.dtype), m2, opt_state.hyper[g.opt_group], own, take,
                             scalars, ranks, where)
        new_master.append(p2)
        new_moments.append(tuple(m2))
    vectors: list[torch.Tensor] = []
    if opt.vector_names:  # per-parameter vector state (replicated): created at the first step if absent
        vectors = list(opt_state.vectors) or list(init_vectors(
            opt, [s.shape for s in lay.trainable_slots], _vector_dtype(shard.master), shard.master[0].device))
        if not donate:
            vectors = [v.clone() for v in vectors]
    if applied and opt.needs_comm:  # found_inf is agreed: every rank calls the collectives, or none
        kw = {"vectors": vectors} if opt.vector_names else {}
        opt.update_with_comm(lay, new_master, grads, new_moments, opt_state.hyper, own, take, ranks, comm, **kw)
    sat_out = [applied and not t for t in take]
    new_missed = missed + torch.tensor(sat_out, dtype=torch.int64, device=missed.device)
    new_scalars = tuple(torch.tensor(s, dtype=torch.float64) for s in scalars)
    return (
        replace(shard, master=tuple(new_master)),
        replace(opt_state, step=opt_state.step + int(applied), moments=tuple(new_moments),
                missed=(new_missed,) if (opt_state.missed or used is not None) else (), scalars=new_scalars,
                vectors=tuple(vectors)),
    )


def _rows_as_ranks(layout: Layout, master: Sequence[torch.Tensor]) -> list[int]:
    """The rows' ranks when the caller gave none: a simulated world's rows are ranks 0..R-1;
    one row of a larger world cannot be placed without them."""
    rows = master[0].shape[0] if master else 0
    if rows != layout.world_size:
        raise ValueError("shard_step: a rule that updates by piece needs the rows' ranks (ranks=comm.ranks) "
                         "on a real rank")
    return list(range(rows))
