"""One micro-batch's forward and backward: :func:`loss_grads`, and what it reuses (:class:`Workspace`). For every local
rank: the forward of the step's loss, the loss scaled (``scaled``: the step's :func:`fzero.scale`), backward, and each
bucket's gradient handed to ``on_ready`` (the step's :func:`fzero.reduce_scatter_grads`) as soon as backward completes
it, which is where overlap comes from. Eagerly, stages 1-2 hook each parameter (:mod:`fzero.buckets`) and stage 3 goes
unit by unit (:func:`fzero.units.unit_grads`); traced (hooks do not trace), the whole backward, then ``on_ready`` of
every flat group (stage 3 with a single backward regathers each unit in it: :class:`fzero.units.CompiledUnits`).

Imports: buckets, comm, layout, module, rng, sharding, state, units.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as tp

from .buckets import BucketReduction, BucketWatcher, BufferPool, Runner, buckets_of, used_flags
from .comm import Communicator
from .layout import FlatGrads, compute_dtype, flatten_one, group_views, stack_rows
from .module import ModuleLoss, check_loss, row_of, run_rows
from .module import broadcast_buffers as broadcast_module_buffers
from .rng import rank_rng
from .sharding import all_gather_params, frozen_params, used_positions
from .state import TrainState
from .units import CompiledUnits, compiled_unit_grads, unit_grads

__all__ = ["Grads", "Workspace", "loss_grads", "accumulate", "micro_batch", "LossFn", "OnReady"]

LossFn = Callable[[Any, Any], torch.Tensor]
OnReady = Callable[[FlatGrads], Sequence[torch.Tensor]]


class Grads(NamedTuple):
    """One micro-batch's gradients, losses and what the forward left, per local rank. ``grads``: what ``on_ready`` gave
    (each rank's averaged shards ``[R, shard_numel]``, one per flat group), or without ``on_ready`` each rank's whole
    gradient (a :class:`~fzero.layout.FlatGrads` of every flat group). ``losses``: ``[R]``, unscaled, in at least fp32
    (a float64 model's in float64). ``buffers``:
    the module buffers the forward left; ``rng``: the generator states it left. ``used``: ``[R, T]`` float64, 1 where
    the rank's loss reached trainable parameter ``t`` (with parameter groups ``[R, Layout.num_positions]``: each at its
    rank group's position, :func:`fzero.sharding.used_positions`); ``every``: all of ``used`` is 1 (known in Python; traced: when
    tracing)."""

    grads: tuple[torch.Tensor, ...]
    losses: torch.Tensor
    buffers: tuple[torch.Tensor, ...]
    rng: tuple[torch.Tensor, ...]
    used: torch.Tensor
    every: bool = False


class Workspace:
    """What one step function reuses from call to call: the bucket buffers of eager stages 1-2 (emptied by :meth:`clear`
    between steps), the :class:`~fzero.buckets.Runner` its collectives go through, and for a compiled stage-3 step with
    one backward (one local rank, one micro-batch) the unit forwards that regather in backward."""

    def __init__(self, loss_fn: LossFn | None = None, micro_batches: int = 1):
        self.pool = BufferPool()
        self.runner = Runner()
        self.micro_batches = micro_batches
        self.units = CompiledUnits(loss_fn.module) if isinstance(loss_fn, ModuleLoss) else None

    def regather(self, comm: Communicator) -> CompiledUnits | None:
        """The regathering unit forwards, where a compiled step has one backward region."""
        return self.units if comm.local_ranks * self.micro_batches == 1 else None

    def clear(self) -> None:
        """Between steps a rank holds its state, not scratch buffers."""
        self.pool.clear()


def micro_batch(batch: Any, k: int, accum_steps: int) -> Any:
    """Micro-batch ``k`` (leaves ``[R, ...]``) of a batch with leaves ``[R, K, ...]``; ``K == 1``: the batch itself."""
    if accum_steps == 1:
        return batch
    return tp.tree_map(lambda x: x[:, k] if isinstance(x, torch.Tensor) else x, batch)


def accumulate(total: Grads | FlatGrads | None, new: Grads | FlatGrads) -> Grads | FlatGrads:
    """``total + new`` over micro-batches, in at least fp32. Of two :class:`Grads`: gradients, losses and used flags
    summed; buffers and generators ``new``'s. Of whole gradients (:class:`~fzero.layout.FlatGrads`): each of ``new``'s
    flat groups plus ``total``'s. ``total`` None: ``new``. Reduced shards after whole gradients (a deferred
    accumulation's last micro-batch, whose ``on_ready`` added the earlier ones) are the total."""
    if total is None:
        return new
    if isinstance(new, FlatGrads):
        return FlatGrads(new.groups, [_sum(total.of(g), f) for g, f in zip(new.groups, new)])
    grads = new.grads
    if isinstance(total.grads, FlatGrads) == isinstance(new.grads, FlatGrads):
        grads = accumulate(total.grads, new.grads) if isinstance(new.grads, FlatGrads) else \
            tuple(_sum(a, b) for a, b in zip(total.grads, new.grads))
    return new._replace(grads=grads, losses=total.losses + new.losses, used=total.used + new.used,
                        every=total.every and new.every)


def _sum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.to(torch.promote_types(a.dtype, torch.float32)) + b


def loss_grads(loss_fn: LossFn, state: TrainState, batch: Any, comm: Communicator, workspace: Workspace, *,
               scaled: Callable[[torch.Tensor], torch.Tensor], on_ready: OnReady | None = None,
               broadcast_buffers: bool = True) -> Grads:
    """Each local rank's gradient of ``scaled(loss)`` on its part of ``batch``, handed to ``on_ready`` bucket by bucket
    as backward completes it. ``loss_fn(params, batch_r)``: a 0-d loss for one rank's micro-batch, ``params`` in the
    structure given to :func:`~fzero.state.init_train_state` (stage 3: a :func:`fzero.module_loss`). ``batch``: leaves
    ``[R, ...]``. The forward runs under each rank's generator state on fresh copies of the module buffers.
    ``on_ready(FlatGrads) -> shards``: the step's reduction of one bucket (stages 1-2) or unit (stage 3), through
    ``workspace.runner``; ``None`` (stages 1-2 only, else ``ValueError``): no collective, each rank's whole gradient.
    Stage 3 also gathers the units. ``broadcast_buffers`` (DDP's default): every rank's forward starts from rank 0's
    module buffers (one ``broadcast`` per buffer dtype); otherwise from its own."""
    if isinstance(loss_fn, ModuleLoss) and not comm.traced:  # traced: checked on the host (fzero.compiled)
        loss_fn.check_trainable(state.module)
    if broadcast_buffers and state.buffers:
        state = state.replace(buffers=broadcast_module_buffers(state.buffers, comm))
    # a graph's collectives are the graph's; eagerly, every one handed to the runner has run when it ends
    with contextlib.nullcontext() if comm.traced else workspace.runner:
        out = _grads(loss_fn, state, batch, comm, workspace, scaled, on_ready)
    if not state.layout.axes:
        return out
    # a parameter group's flags at its rank group's positions, so the world's sum keeps rank groups apart; and
    # `every` off: this process using each of its parameters says nothing of another rank group's (the agreed flags
    # decide, so every rank counts every rank group's sat-out steps alike)
    return out._replace(used=used_positions(state.layout, out.used, comm), every=False)


def _grads(loss_fn: LossFn, state: TrainState, batch: Any, comm: Communicator, workspace: Workspace,
           scaled: Callable[[torch.Tensor], torch.Tensor], on_ready: OnReady | None) -> Grads:
    params = state.params
    if state.stage == 3:  # each unit's parameters gathered inside the step (fzero.units)
        if on_ready is None:
            raise ValueError("loss_grads: stage 3 reduces every micro-batch (it never holds whole gradients)")
        if not isinstance(loss_fn, ModuleLoss):
            raise TypeError("stage 3 gathers each shard unit's parameters in the unit's forward and needs the module: "
                            "give fzero.module_loss(model, ...) (with a state built by init_train_state(model, ..., "
                            "stage=3))")
        if not state.module.units:
            raise ValueError("stage 3: this state has no shard units; build it with "
                             "init_train_state(model, ..., stage=3, units=...)")
        if not comm.traced:
            return Grads(*unit_grads(loss_fn, state, comm, batch, scaled, on_ready, workspace.runner))
        regather = workspace.regather(comm)
        if regather is not None:  # one rank, one micro-batch: each unit gathered in forward, again in backward
            return Grads(*compiled_unit_grads(regather, loss_fn, state, comm, batch, scaled, on_ready))
        # every unit gathered in the graph and kept for backward (FSDP's reshard_after_forward=False)
        params = all_gather_params(state.shard, comm, state.precision.param_dtype)
    elif not comm.traced and on_ready is not None:  # each bucket reduced as backward completes it
        buckets = buckets_of(state.layout)
        dtype, device = state.precision.param_dtype, state.params[0].device
        reduction = BucketReduction(buckets, on_ready, workspace.runner, comm.overlaps, comm.local_ranks,
                                    [(b,) for b in range(len(buckets) - 1, -1, -1)], in_order=True,
                                    pool=workspace.pool, dtype=dtype, device=device)
        out = _rank_grads(loss_fn, state, params, batch, comm, scaled, reduction)
        return out._replace(grads=reduction.finish(device, dtype))
    out = _rank_grads(loss_fn, state, params, batch, comm, scaled)
    return out if on_ready is None else out._replace(grads=tuple(on_ready(out.grads)))


def _rank_grads(loss_fn: LossFn, state: TrainState, params: Sequence[torch.Tensor], batch: Any,
                comm: Communicator, scaled: Callable[[torch.Tensor], torch.Tensor],
                reduction: BucketReduction | None = None) -> Grads:
    """Each local rank's gradient of its scaled loss, its loss, buffers and generator. Rank ``r``'s parameters are leaf
    tensors viewing row ``r`` of ``params``, one per parameter (one flat leaf would be zero-filled once per slice). A
    :class:`ModuleLoss` stays bound until backward ends (checkpointing recomputes with the same tensors). ``reduction``
    (eager): each bucket goes to it as backward completes it (``Grads.grads`` then empty)."""
    lay, traced, dtype, device = state.layout, comm.traced, state.precision.param_dtype, params[0].device
    names, train_slots = state.module.buffers, lay.trainable_slots
    swap_rng = bool(state.rng) and not traced
    frozen = {s.path: f.to(compute_dtype(s, dtype)) for s, f in frozen_params(state.shard, comm)}
    train_index = [i for i, s in enumerate(lay.slots) if s.group >= 0]
    module = isinstance(loss_fn, ModuleLoss)

    def one(r: int) -> tuple[torch.Tensor, list[torch.Tensor] | None, list[float], list[torch.Tensor],
                             list[torch.Tensor]]:
        """Row ``r``'s loss, its flat gradients (none when they went to ``reduction``), used flags, buffers and the
        generator state its forward and backward left."""
        views = {lay.slots[i].path: v for g in lay.groups
                 for i, v in zip(g.slots, group_views(lay, g, params[g.index][r]))}
        leaves = [views[s.path].detach().requires_grad_(True) for s in train_slots]
        by_path = {**frozen, **{s.path: v for s, v in zip(train_slots, leaves)}}
        tensors = tp.tree_unflatten([by_path[s.path] for s in lay.slots], lay.spec)
        bufs = [b[r].clone() for b in state.buffers]
        if bufs:
            tensors = {**tensors, **dict(zip(names, bufs))}
        watcher = None
        if reduction is not None:
            watcher = BucketWatcher(lay, reduction.groups, r, reduction.buffers,
                                    lambda b, grads, r=r: reduction.add(b, r, grads), comm.local_ranks)
            watcher.watch(leaves)
        bound = loss_fn.bound(tensors, traced) if module else contextlib.nullcontext()
        forward = functools.partial(loss_fn.forward_loss, dtype=dtype) if module else loss_fn
        left: list[torch.Tensor] = []
        try:
            with rank_rng(state.rng[0][r] if swap_rng else None, device, left), torch.enable_grad(), bound:
                loss = forward(tensors, row_of(batch, r))
                check_loss(loss)
                loss = loss.to(torch.promote_types(loss.dtype, torch.float32))  # a float64 model's: float64
                if watcher is not None:  # gradients go into the bucket buffers as backward completes them
                    torch.autograd.backward(scaled(loss), inputs=leaves)
                else:
                    grads = torch.autograd.grad(scaled(loss), leaves, allow_unused=True)
        finally:
            if watcher is not None:
                watcher.close()
        flats = None
        if watcher is not None:
            watcher.finish()
            used = [float(i in watcher.used) for i in train_index]
        else:  # which parameters the loss reached is known when tracing: a constant of the graph
            used = [float(g is not None) for g in grads]
            got = {s.path: g if g is not None else torch.zeros(s.shape, dtype=v.dtype, device=device)
                   for s, v, g in zip(train_slots, leaves, grads)}
            slot_grads = [got.get(s.path) for s in lay.slots]
            flats = [flatten_one(lay, g, slot_grads) for g in lay.groups]
        return loss.detach(), flats, used, bufs, left

    rows = run_rows(one, loss_fn, comm.local_ranks, device if swap_rng else None, traced)
    losses, flat, used, new_buffers, new_rng = (
        [row[0] for row in rows], [[row[1][g.index] for row in rows] for g in lay.groups] if reduction is None else [],
        [row[2] for row in rows], [[row[3][i] for row in rows] for i in range(len(names))],
        [row[4][0] for row in rows if row[4]])
    return Grads(FlatGrads(lay.groups, [stack_rows(f) for f in flat]) if reduction is None else (),
                 torch.stack(losses), tuple(stack_rows(b) for b in new_buffers),
                 (stack_rows(new_rng),) if swap_rng else state.rng,
                 used_flags(used, device), all(all(row) for row in used))
