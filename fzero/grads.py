"""The gradient of each local rank's loss: :func:`loss_grads`, one function for stages 1-3.

A step differentiates every local rank's loss (one row on a real rank, W in the simulated
world) with respect to that rank's parameters, and, unless told to wait, averages the
gradients over ranks while backward runs. How depends on the state's stage, and on whether
the step is being compiled:

* stages 1-2, eagerly: ordinary autograd on leaf views of the gathered parameters; each
  gradient is copied into its bucket's buffer by a post-accumulate-grad hook, and a
  bucket's average over ranks starts as soon as backward has completed it
  (:class:`fzero.buckets.BucketReduction`; stage 1 by ``all_reduce`` and a local slice);
* stage 3, eagerly: unit by unit (:func:`fzero.units.unit_grads`): each unit's parameters
  gathered in its forward, again in its backward, its gradient reduced in backward;
* compiled (module hooks do not trace): the gradients of the whole backward, then one
  :func:`fzero.sharding.reduce_scatter_grads`; at stage 3 with one local rank and one
  micro-batch, the units regather in backward (:class:`fzero.units.CompiledUnits`).

Every path gives one result type, :class:`Grads`, and the same numbers.

Imports: buckets, layout, module, rng, scaler, sharding, state, units.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, NamedTuple, Optional

import torch

from . import scratch
from .buckets import BucketReduction, BucketWatcher, BufferPool, buckets_of
from .comm import Communicator
from .layout import FlatGroup, flatten_one
from .module import ModuleLoss, check_loss, row_of
from .pytree import replace
from .rng import rank_rng
from .scaler import scale
from .scratch import ScratchPool
from .sharding import all_gather_params, merge_params, reduce_scatter_grads, stack_rows, trainable_views
from .state import TrainState
from .units import CompiledUnits, compiled_unit_grads, unit_grads

__all__ = ["Grads", "Workspace", "loss_grads", "LossFn"]

LossFn = Callable[[Any, Any], torch.Tensor]


class Grads(NamedTuple):
    """One micro-batch's gradients, losses and what the forward left, per local rank.

    ``grads``: per flat group, either (:func:`loss_grads` with ``reduce=True``) the average
    over ranks of the scaled gradient, this rank's shard ``[R, shard_numel]`` in the master
    dtype, or (``reduce=False``) each local rank's own scaled gradient, the whole flat buffer
    ``[R, padded_numel]`` in the compute dtype. ``losses``: ``[R]`` fp32, unscaled.
    ``buffers``: the module buffers the forward left, ``[R, ...]`` each; ``rng``: the
    generator states it left (or the state's). ``used``: ``[R, T]`` float64, 1 where the
    rank's loss reached trainable parameter ``t``; ``every``: all of ``used`` is 1 (known in
    Python; compiled: when tracing)."""

    grads: tuple[torch.Tensor, ...]
    losses: torch.Tensor
    buffers: tuple[torch.Tensor, ...]
    rng: tuple[torch.Tensor, ...]
    used: torch.Tensor
    every: bool = False


class Workspace:
    """What the gradient computation of one step function reuses from call to call: the
    bucket buffers of eager stages 1-2 (a :class:`fzero.buckets.BufferPool`, emptied by
    :meth:`clear` between steps), eager stage 3's gathers and joined all-to-alls (a
    :class:`fzero.scratch.ScratchPool`, emptied likewise) and, for compiled stage 3 on one local rank with one
    micro-batch, the unit forwards that regather in backward (``regather``, a
    :class:`fzero.units.CompiledUnits`, installed around the compiled call)."""

    def __init__(self, regather: Optional[CompiledUnits] = None):
        self.pool = BufferPool()
        self.scratch = ScratchPool()
        self.regather = regather

    def clear(self) -> None:
        """Between steps a rank holds its state, not scratch buffers (eager only)."""
        if not torch.compiler.is_compiling():
            self.pool.clear()
            self.scratch.clear()


def loss_grads(
    loss_fn: LossFn,
    state: TrainState,
    batch: Any,
    comm: Communicator,
    *,
    reduce: bool = True,
    prior: Optional[tuple[torch.Tensor, ...]] = None,
    divide: int = 1,
    workspace: Optional[Workspace] = None,
) -> Grads:
    """Each local rank's gradient of its scaled loss (``scale(state.scaler, loss)``) on its
    part of ``batch``, averaged over ranks unless ``reduce=False``.

    ``loss_fn(params, batch_r)``: a 0-d loss for one rank's micro-batch, ``params`` in the
    structure given to :func:`~fzero.state.init_train_state` (stage 3: a
    :func:`fzero.module_loss`, whose module the units are bound into). ``batch``: leaves
    ``[R, ...]``. The forward runs under each rank's generator state (eagerly) on fresh copies
    of the module buffers (BatchNorm updates them: ``Grads.buffers``).

    ``reduce=False`` (stages 1-2: the first micro-batches of a deferred accumulation): no
    collective, each rank's whole flat gradient. ``reduce=True``: the average over ranks of
    ``(prior + gradient) / divide`` (``prior``: the whole flat gradients accumulated so far,
    in the master dtype's arithmetic; ``divide``: the number of micro-batches; given only
    when the accumulation is reduced once, at its last micro-batch), this rank's shard.
    Collectives: stages 1-2, one ``reduce_scatter`` per bucket, or at stage 1 one
    ``all_reduce`` per bucket and a local slice (eagerly started during backward, at most
    two under way; compiled, one for all groups after backward); stage 3, see
    :func:`fzero.units.unit_grads`.
    ``workspace``: the buffers and unit forwards reused between calls (:class:`Workspace`;
    ``None``: a new one)."""
    workspace = workspace if workspace is not None else Workspace()
    if state.stage == 3:
        if not reduce or prior is not None:
            raise ValueError("loss_grads: stage 3 reduces every micro-batch (it never holds whole gradients)")
        return _unit_grads(loss_fn, state, batch, comm, workspace)
    reduce_dtype = state.precision.reduce_dtype
    if torch.compiler.is_compiling() or not reduce:
        out = _rank_grads(loss_fn, state, batch, comm.local_ranks)
        if not reduce:
            return out
        flats = out.grads
        if prior is not None or divide != 1:
            flats = tuple(_accumulated(g, p, f, divide) for g, p, f in
                          zip(state.layout.groups, prior or (None,) * len(flats), flats))
        shards = reduce_scatter_grads(state.shard, flats, comm, reduce_dtype=reduce_dtype,
                                      via_all_reduce=state.stage == 1, flat=True)
        return out._replace(grads=shards)
    prepare = None
    if prior is not None or divide != 1:  # the same operations as the compiled path, bucket by bucket
        prepare = functools.partial(_accumulated_group, prior=prior, divide=divide)
    buckets = buckets_of(state.layout)
    reduction = BucketReduction(
        buckets, comm, reduce_dtype, [(b,) for b in range(len(buckets) - 1, -1, -1)], in_order=True,
        via_all_reduce=state.stage == 1, prepare=prepare, pool=workspace.pool,
        dtype=state.precision.param_dtype, device=state.params[0].device,
    )
    out = _rank_grads(loss_fn, state, batch, comm.local_ranks, reduction)
    shards = reduction.finish(state.params[0].device, state.precision.param_dtype)
    return out._replace(grads=shards)


def _accumulated(g: FlatGroup, prior: Optional[torch.Tensor], flat: torch.Tensor, divide: int) -> torch.Tensor:
    """``(prior + flat) / divide`` in the master dtype's arithmetic: the accumulated gradient of
    a deferred accumulation at its last micro-batch, before it is reduced."""
    total = flat if prior is None else prior.to(g.master_dtype) + flat
    return total / divide if divide != 1 else total


def _accumulated_group(g: FlatGroup, flat: torch.Tensor, *, prior: Optional[tuple[torch.Tensor, ...]],
                       divide: int) -> torch.Tensor:
    return _accumulated(g, None if prior is None else prior[g.index], flat, divide)


def _unit_grads(loss_fn: LossFn, state: TrainState, batch: Any, comm: Communicator, workspace: Workspace) -> Grads:
    """Stage 3: each unit's parameters gathered inside the step (:mod:`fzero.units`)."""
    if not isinstance(loss_fn, ModuleLoss):
        raise TypeError(
            "stage 3 gathers each shard unit's parameters in the unit's forward and needs the module: "
            "give fzero.module_loss(model, ...) (with a state built by init_train_state(model, ..., stage=3))"
        )
    if not state.module.units:
        raise ValueError("stage 3: this state has no shard units; build it with "
                         "init_train_state(model, ..., stage=3, units=...)")
    reduce_dtype, param_dtype = state.precision.reduce_dtype, state.precision.param_dtype
    common = dict(units=state.module.units, buffers=state.buffers, buffer_names=state.module.buffers,
                  scale_loss=lambda loss: scale(state.scaler, loss), param_dtype=param_dtype,
                  reduce_dtype=reduce_dtype)
    if torch.compiler.is_compiling() and workspace.regather is not None:
        # one rank, one micro-batch: each unit gathered in its forward and again in backward,
        # reduced in backward (fzero.units.compiled_unit_grads)
        out = compiled_unit_grads(workspace.regather, loss_fn, state.shard, comm, batch, **common)
    elif torch.compiler.is_compiling():
        # Module hooks and saved-tensor hooks do not trace: in a graph, every bucket is
        # gathered inside the step and inductor keeps it to its last use in backward
        # (FSDP's reshard_after_forward=False); between steps the state holds shards only.
        # One gather and one reduce for all buckets: the graph holds them all anyway.
        gathered = all_gather_params(state.shard, comm, param_dtype, flat=True)
        out = _rank_grads(loss_fn, replace(state, params=gathered), batch, comm.local_ranks)
        shards = reduce_scatter_grads(state.shard, out.grads, comm, reduce_dtype=reduce_dtype, flat=True)
        return out._replace(grads=shards)
    else:
        with scratch.using(workspace.scratch):
            out = unit_grads(loss_fn, state.shard, comm, batch, rng=state.rng[0] if state.rng else None, **common)
    return Grads(out.shards, out.losses, out.buffers, out.rng or state.rng, out.used, out.every)


def _rank_grads(
    loss_fn: LossFn,
    state: TrainState,
    batch: Any,
    rows: int,
    reduction: Optional[BucketReduction] = None,
) -> Grads:
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
    which starts its collective while backward goes on; ``Grads.grads`` is
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
        forward = functools.partial(loss_fn.forward_loss, dtype=dtype) if isinstance(loss_fn, ModuleLoss) \
            else loss_fn
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
    return Grads(
        tuple(stack_rows(f) for f in flat if f),
        torch.stack(losses),
        tuple(stack_rows(b) for b in new_buffers),
        (stack_rows(new_rng),) if swap_rng else state.rng,
        torch.tensor(used, dtype=torch.float64, device=device),
        all(all(row) for row in used),
    )
