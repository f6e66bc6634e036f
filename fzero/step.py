"""The training step: :func:`make_train_step`, fzero's public pieces composed (:func:`train_step`, as
``examples/compose_by_hand.py`` writes it out), and its wrappers, which change no numbers:
:func:`fzero.compiled.bind_step`, :func:`checking_replicas`, :func:`donating`, :func:`naming_step`.

Imports: comm, compiled, grads, module, replicas, scaler, schedules, sharding, state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.utils._pytree as tp

from .comm import CollectiveError, Communicator
from .compiled import Compile, ComposedStep, StepFn, bind_step
from .grads import Grads, LossFn, Workspace, accumulate, loss_grads, micro_batch
from .module import ModuleLoss, module_loss
from .replicas import ReplicaDivergenceError, check_replicas, digest_parts, parts_differ
from .scaler import scale, unscale_and_check, update_scale
from .schedules import Schedule, apply_schedules
from .sharding import all_gather_params, check_world, reduce_scatter_grads, shard_step
from .state import TrainState, consume, ensure_live

__all__ = ["make_train_step", "train_step", "module_loss", "check_batch", "check_state", "checking_replicas",
           "donating", "naming_step", "LossFn", "StepFn"]

UNUSED = ("skip", "zeros")  # make_train_step(unused=...): what a parameter without a gradient does


def _check_leaf(path: Any, x: Any, what: str, rows: int, accum_steps: int, device: torch.device | None) -> None:
    if not isinstance(x, torch.Tensor):
        return
    if device is not None and x.device != device:
        # before any collective: a mixed op would raise mid-step on some ranks, the others waiting for them
        raise ValueError(f"{what}: batch{tp.keystr(path)} is on {x.device}, the state on {device}: move the batch to "
                         f"the state's device first (batch.to({str(device)!r}))")
    many = accum_steps > 1
    need = 2 if many else 1
    if x.dim() < need or x.shape[0] != rows or (accum_steps != 1 and x.shape[1] != accum_steps):
        want = f"[{rows}, {accum_steps}, ...] (local ranks, micro-batches)" if many else f"[{rows}, ...] (local ranks)"
        fix = f"comm.split_batch(batch, micro_batches={accum_steps})" if many else "comm.split_batch(batch)"
        raise ValueError(f"{what}: batch{tp.keystr(path)} has shape {tuple(x.shape)}, but every batch leaf must be "
                         f"{want}: split the global batch with {fix}")
    if x.dim() > need and x.shape[need] == 0:
        # an empty batch's loss is NaN, which is not an overflow, and weight decay would still apply
        per = "per rank and micro-batch" if many else "per rank"
        raise ValueError(f"{what}: batch{tp.keystr(path)} is empty: shape {tuple(x.shape)}, 0 examples {per} "
                         f"(dim {need}); every rank needs at least one example")


def check_batch(batch: Any, rows: int, accum_steps: int = 1, what: str = "train step",
                device: torch.device | None = None) -> None:
    """Raise ``ValueError`` unless every tensor leaf of ``batch`` is ``[R, ...]`` (``[R, K, ...]`` with
    ``accum_steps=K``), not empty and (``device`` given) on ``device``, naming the leaf, its shape or device and the fix
    (free under compile)."""
    tp.tree_map_with_path(lambda p, x: _check_leaf(p, x, what, rows, accum_steps, device), batch)


def check_state(state: TrainState, comm: Communicator, stage: int | None = None) -> None:
    """Raise ``ValueError`` if ``state`` was built for another world than ``comm``'s or another ``stage``."""
    check_world(state.shard, comm)
    if stage is not None and stage != state.stage:
        raise ValueError(f"make_train_step(stage={stage}): this state was built for stage {state.stage} "
                         f"(init_train_state(..., stage={state.stage})); the state says the stage, "
                         "so make_train_step does not need it")


def make_train_step(loss_fn: LossFn, comm: Communicator, *, stage: int | None = None,
                    clip_norm: float | None = None, accum_steps: int = 1, defer_reduce: bool = False,
                    schedules: Mapping[str, Schedule] | None = None, donate: bool = False, compile: Compile = False,
                    broadcast_buffers: bool = True, check_replicas_every: int = 0, replica_check: str = "raise",
                    unused: str = "skip") -> StepFn:
    """A step ``(state, batch) -> (state, metrics)`` for the state's ZeRO stage. ``loss_fn(params, batch)``: a 0-d loss
    for one rank's micro-batch, ``params`` structured as given to :func:`~fzero.state.init_train_state` (stage 3: a
    :func:`fzero.module_loss`). ``batch``: leaves ``[R, ...]`` (``comm.split_batch``); with ``accum_steps=K``, ``[R, K,
    ...]``: the K micro-batches' gradients averaged, one optimizer step (stage 1, and 2 with ``defer_reduce``, reduce
    once). ``stage``: optional, checked against the state's. ``clip_norm``: the global norm clipped as
    ``clip_grad_norm_`` does. ``schedules``: ``{hyperparameter: schedule(step)}``, evaluated inside the step (other
    groups get the value times their ratio to the default). ``donate=True``: shards and moments updated in place, the
    given state consumed (reuse raises ``ValueError``). ``compile``: ``True`` or torch.compile's
    ``backend``/``mode``/``options``. ``broadcast_buffers`` (DDP's default): every rank's forward starts from rank 0's
    module buffers. ``check_replicas_every=N``: a digest of what ranks must hold alike rides on the step's all-reduce
    (``metrics["replicas_differ"]``); ``replica_check="raise"`` reads it every N-th call and raises
    :class:`fzero.ReplicaDivergenceError`, ``"flag"`` only reports. ``unused`` (a parameter no loss reached): ``"skip"``
    (as DDP) leaves it and its step count, ``"zeros"`` gives a zero gradient. Bad options raise ``ValueError``; a failed
    collective :class:`fzero.CollectiveError`. Metrics (0-d float64): ``loss`` (the mean over ranks, unscaled),
    ``found_inf``, ``scale`` (this step's), ``grad_norm`` (unscaled, before clipping), ``lr`` (the default group's)."""
    if stage not in (None, 1, 2, 3):
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
        raise TypeError("make_train_step: stage 3 gathers each shard unit's parameters in the unit's forward and "
                        "needs the module: give fzero.module_loss(model, ...) (with a state built by "
                        "init_train_state(model, ..., stage=3, units=...))")
    step = train_step(loss_fn, stage=stage, clip_norm=clip_norm, accum_steps=accum_steps, defer_reduce=defer_reduce,
                      schedules=schedules, donate=donate, broadcast_buffers=broadcast_buffers,
                      check_replicas=bool(check_replicas_every), unused=unused)
    core = bind_step(step, loss_fn, comm, accum_steps=accum_steps, compile=compile,
                     check=lambda state, batch: (check_state(state, comm, stage),
                                                 check_batch(batch, comm.local_ranks, accum_steps,
                                                             device=state.device)))
    if check_replicas_every:
        core = checking_replicas(core, comm, check_replicas_every, replica_check)
    core = naming_step(core)
    return donating(core) if donate else core


def train_step(loss_fn: LossFn, *, stage: int | None = None, clip_norm: float | None = None, accum_steps: int = 1,
               defer_reduce: bool = False, schedules: Mapping[str, Schedule] | None = None, donate: bool = False,
               broadcast_buffers: bool = True, check_replicas: bool = False, unused: str = "skip") -> ComposedStep:
    """The composition :func:`make_train_step` runs, ``(state, batch, comm, workspace) -> (state, metrics)``, for
    :func:`fzero.bind_step`; options as there (``check_replicas``: ``metrics["replicas_differ"]``)."""
    schedules, K = dict(schedules or {}), accum_steps

    def step(state: TrainState, batch: Any, comm: Communicator, workspace: Workspace) -> tuple[TrainState, dict]:
        check_state(state, comm, stage)
        check_batch(batch, comm.local_ranks, K, device=state.device)
        if defer_reduce and state.stage == 3:
            raise ValueError("make_train_step: stage 3 reduces every micro-step (defer_reduce needs full gradients)")
        defer = state.stage == 1 or defer_reduce  # one reduction, at the last micro-batch
        digest = digest_parts(state, comm) if check_replicas else None
        buffers_in = state.buffers  # what a skipped step keeps
        state = state.replace(opt=apply_schedules(state.opt, schedules))
        total: Grads | None = None
        for k in range(K):
            earlier = total.grads if defer and total is not None else None

            # (reduce and scaled run inside this iteration; state's shard, stage, precision and scaler are the same
            # in every micro-batch's: only its buffers and generators change)
            def reduce(grads, earlier=earlier):  # each bucket, as backward completes it
                return reduce_scatter_grads(state.shard, accumulate(earlier, grads), comm,  # noqa: B023
                                            via_all_reduce=state.stage == 1,  # noqa: B023
                                            reduce_dtype=state.precision.reduce_dtype)  # noqa: B023

            g = loss_grads(loss_fn, state, micro_batch(batch, k, K), comm, workspace,
                           scaled=lambda loss: scale(state.scaler, loss),  # noqa: B023
                           broadcast_buffers=broadcast_buffers,
                           on_ready=reduce if k == K - 1 or not defer else None)
            state = state.replace(buffers=g.buffers, rng=g.rng)  # BatchNorm statistics, generators
            total = accumulate(total, g)
        workspace.clear()
        grads, losses = (total.grads, total.losses) if K == 1 else (tuple(s / K for s in total.grads), total.losses / K)
        checked = unscale_and_check(state.scaler, grads, comm, clip_norm=clip_norm, losses=losses, in_place=True,
                                    used=total.used if unused == "skip" else None, riders=digest)
        used = None if unused == "zeros" or total.every else checked.used
        shard, opt = shard_step(state.shard, state.opt, checked.grads, checked.found_inf, used=used, comm=comm,
                                donate=donate)
        # a donating step gathers into the parameters it was given: the module's parameters view them
        params = all_gather_params(shard, comm, state.precision.param_dtype, into=state.params if donate else None) \
            if state.params else ()
        skip = checked.found_inf.to(torch.bool)  # a skipped step keeps the buffers it was given
        buffers = tuple(torch.where(skip.to(new.device), old, new) for old, new in zip(buffers_in, state.buffers))
        new_state = state.replace(shard=shard, opt=opt, params=params, buffers=buffers,
                                  scaler=update_scale(state.scaler, checked.found_inf),
                                  calls=tuple(c + 1 for c in state.calls))
        # every metric 0-d float64: the agreement's loss and norm as computed (a float64 model's oracles compare at
        # 1e-10), the rest alike, so they stack and log together
        metrics = {"loss": checked.loss, "found_inf": checked.found_inf.double(),
                   "scale": state.scaler.scale.double(), "grad_norm": checked.grad_norm}
        if "lr" in state.opt.hyper[0]:  # a user's rule may have no learning rate
            metrics["lr"] = state.opt.hyper[0]["lr"].to(torch.float64, copy=True)
        if digest is not None:
            metrics["replicas_differ"] = parts_differ(checked.riders, comm.data_world_size).double()
        return new_state, metrics

    return step


def naming_step(step: StepFn) -> StepFn:
    """``step`` whose :class:`~fzero.comm.CollectiveError` names the step it happened in."""
    def named(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, torch.Tensor]]:
        try:
            return step(state, batch)
        except CollectiveError as e:
            if e.step is not None:
                raise
            raise e.at_step(int(state.opt.step) + 1) from e

    return named


def checking_replicas(step: StepFn, comm: Communicator, every: int, mode: str = "raise") -> StepFn:
    """``step`` (built with ``check_replicas_every``) that every ``every``-th call (``state.calls``) reads
    ``replicas_differ`` (a host sync) and, if set, raises naming what differs (``ValueError``: bad arguments)."""
    if not (isinstance(every, int) and every >= 1):
        raise ValueError(f"make_train_step: check_replicas_every must be a positive int, got {every!r}")
    if mode not in ("raise", "flag"):
        raise ValueError(f"make_train_step: replica_check must be 'raise' or 'flag', got {mode!r}")
    if mode == "flag":
        return step

    def run(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, torch.Tensor]]:
        calls = int(state.calls[0]) + 1 if state.calls else 0  # a CPU counter: no device sync
        new_state, metrics = step(state, batch)
        if calls % every == 0 and bool(metrics["replicas_differ"]):
            # the digest was of the state given (donating changed only shards and moments, never compared)
            check_replicas(state, comm)
            raise ReplicaDivergenceError("replicas disagreed at the start of this step (the digest carried by its "
                                         "all-reduce), but a second look found no difference", [])
        return new_state, metrics

    return run


def donating(step: StepFn) -> StepFn:
    """``step`` (built with ``donate=True``) that refuses a consumed state and consumes the one given."""
    def run(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, torch.Tensor]]:
        ensure_live(state)
        new_state, metrics = step(state, batch)
        return consume(state, new_state), metrics

    return run
