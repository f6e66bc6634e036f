"""The training step: :func:`make_train_step`, a composition of fzero's public pieces.

A step, for every local rank (one on a real rank, W in the simulated world), reads as the
calls in :func:`make_train_step`'s ``step``:

1. :func:`fzero.schedules.apply_schedules`: scheduled hyperparameters from the step count;
2. per micro-batch: module buffers broadcast from rank 0
   (:func:`fzero.module.broadcast_buffers`), then :func:`fzero.grads.loss_grads`: forward and
   backward of the scaled loss, averaged over ranks while backward runs (stages 2-3 every
   micro-batch; stage 1 and ``defer_reduce`` once, at the last one);
3. :func:`fzero.scaler.unscale_and_clip`: one ``all_reduce(sum)`` agrees on the global norm,
   the overflow flag and the mean loss (the used flags and the replica digest ride along);
   one pass unscales and clips;
4. :func:`fzero.sharding.shard_step` (skipped bitwise by selection on overflow),
   :func:`fzero.scaler.update_scale`, and at stages 1-2 :func:`fzero.sharding.all_gather_params`
   of the new parameters in the compute dtype for the next step.

``examples/compose_by_hand.py`` writes the same calls out, and is tested bitwise equal to it.

What wraps that composition without changing its numbers is a wrapper of its own, applied by
:func:`make_train_step`'s options and usable on a hand-composed step: :func:`compiled_step`
(``compile=True``), :func:`checking_replicas` (``check_replicas_every``), :func:`donating`
(``donate=True``), :func:`naming_step` (always). The rule: an option that changes what the step
computes is an argument of the composition; one that only surrounds it is a wrapper.

Imports: comm, compiled, grads, module, optim, precision, pytree, replicas, schedules,
scaler, scopes, sharding, state, units.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
import torch.utils._pytree as tp

from .comm import CollectiveError, Communicator
from .compiled import Compile, StepFn, compile_arguments, compiled_step
from .grads import Grads, LossFn, Workspace, loss_grads
from .module import ModuleLoss, broadcast_buffers as broadcast_module_buffers, module_loss
from .optim import check_compilable
from .pytree import replace
from .replicas import ReplicaDivergenceError, check_replicas, digest_parts, parts_differ
from .scaler import unscale_and_clip, update_scale
from .schedules import Schedule, apply_schedules
from .scopes import UPDATE, step_scope
from .sharding import all_gather_params, check_world, shard_step
from .state import TrainState, consume, ensure_live
from .units import CompiledUnits

__all__ = [
    "make_train_step",
    "module_loss",
    "check_batch",
    "check_state",
    "micro_batch",
    "accumulate",
    "checking_replicas",
    "donating",
    "naming_step",
    "LossFn",
    "StepFn",
]

UNUSED = ("skip", "zeros")  # make_train_step(unused=...): what a parameter without a gradient does


def _check_leaf(path: Any, x: Any, what: str, rows: int, accum_steps: int) -> None:
    if not isinstance(x, torch.Tensor):
        return
    need = 2 if accum_steps > 1 else 1
    if x.dim() >= need and x.shape[0] == rows and (accum_steps == 1 or x.shape[1] == accum_steps):
        if x.dim() > need and x.shape[need] == 0:
            # an empty batch's mean loss is NaN, which is not an overflow (found_inf stays 0),
            # and the optimizer would still decay every parameter: refuse it before any collective
            per = "per rank and micro-batch" if accum_steps > 1 else "per rank"
            raise ValueError(
                f"{what}: batch{tp.keystr(path)} is empty: shape {tuple(x.shape)}, 0 examples {per} "
                f"(dim {need}); every rank needs at least one example"
            )
        return
    if accum_steps > 1:
        want, fix = f"[{rows}, {accum_steps}, ...] (local ranks, micro-batches)", \
            f"comm.split_batch(batch, micro_batches={accum_steps})"
    else:
        want, fix = f"[{rows}, ...] (local ranks)", "comm.split_batch(batch)"
    raise ValueError(
        f"{what}: batch{tp.keystr(path)} has shape {tuple(x.shape)}, but every batch leaf must be "
        f"{want}: split the global batch with {fix}"
    )


def check_batch(batch: Any, rows: int, accum_steps: int = 1, what: str = "train step") -> None:
    """Raise ``ValueError`` unless every tensor leaf of ``batch`` is ``[R, ...]``
    (``[R, K, ...]`` with ``accum_steps=K``), naming the leaf, its shape and the fix,
    or if a leaf's batch dimension (the one after those axes) is empty.
    Shapes are static: free under compile."""
    tp.tree_map_with_path(lambda p, x: _check_leaf(p, x, what, rows, accum_steps), batch)


def check_state(state: TrainState, comm: Communicator, stage: Optional[int] = None) -> None:
    """Raise ``ValueError`` if ``state`` was built for another world than ``comm``'s, or for
    another stage than ``stage`` (when a step names one), naming both."""
    check_world(state.shard, comm)
    if stage is not None and stage != state.stage:
        raise ValueError(f"make_train_step(stage={stage}): this state was built for stage {state.stage} "
                         f"(init_train_state(..., stage={state.stage})); the state says the stage, "
                         "so make_train_step does not need it")


def micro_batch(batch: Any, k: int, accum_steps: int) -> Any:
    """Micro-batch ``k`` of a batch whose leaves are ``[R, K, ...]`` (``accum_steps=K > 1``):
    leaves ``[R, ...]``; with one micro-batch, the batch itself."""
    if accum_steps == 1:
        return batch
    return tp.tree_map(lambda x: x[:, k] if isinstance(x, torch.Tensor) else x, batch)


def accumulate(total: Optional[Grads], g: Grads, *, reduced_total: bool = False) -> Grads:
    """``total + g`` over micro-batches: the gradients summed in the master dtype's arithmetic
    (fp32 whatever the gradients' dtype), the losses and used flags summed; the buffers and
    generators are ``g``'s (the latest forward's). ``reduced_total``: ``g``'s gradients already
    are the reduced total (the last micro-batch of a deferred accumulation, :func:`loss_grads`
    with ``prior=total.grads``), so only its losses and flags are added."""
    if total is None:
        return g
    grads = g.grads if reduced_total else tuple(
        a.to(torch.promote_types(a.dtype, torch.float32)) + p for a, p in zip(total.grads, g.grads))
    return g._replace(grads=grads, losses=total.losses + g.losses, used=total.used + g.used,
                      every=total.every and g.every)


def make_train_step(
    loss_fn: LossFn,
    comm: Communicator,
    *,
    stage: Optional[int] = None,
    clip_norm: Optional[float] = None,
    accum_steps: int = 1,
    defer_reduce: bool = False,
    schedules: Optional[Mapping[str, Schedule]] = None,
    donate: bool = False,
    compile: Compile = False,
    broadcast_buffers: bool = True,
    check_replicas_every: int = 0,
    replica_check: str = "raise",
    unused: str = "skip",
) -> StepFn:
    """A step ``(state, batch) -> (state, metrics)`` for the ZeRO stage the state was built for.

    ``loss_fn(params, batch)``: a 0-d loss for one rank's micro-batch, where
    ``params`` has the structure of the parameters given to
    :func:`~fzero.state.init_train_state`; at stage 3 a :func:`fzero.module_loss` (the step
    binds each unit's gathered parameters into the module). ``batch``: any tree whose
    leaves carry the local-rank axis ``[R, ...]`` (see ``comm.split_batch``).
    ``stage``: optional; the state says its stage (``init_train_state(stage=...)``), and a
    step given another one raises ``ValueError``.

    ``clip_norm``: clip the global gradient norm as
    ``torch.nn.utils.clip_grad_norm_`` does, fused with unscaling (one pass).
    ``accum_steps=K``: batch leaves are ``[R, K, ...]``; the gradients of the K
    micro-batches (mean loss each) are averaged, then the optimizer runs once:
    equal to one step on the K-times larger batch. Stage 2 and 3 reduce every
    micro-step into fp32 shard accumulators; stage 1 accumulates full local
    gradients and reduces once, and so does stage 2 with ``defer_reduce=True``
    (no gradient communication on the first K-1 micro-steps, full-size
    accumulators). Stage 3 cannot defer (it never holds full gradients).
    ``schedules``: ``{hyperparameter: schedule(step) -> value}``, evaluated
    inside the step at the optimizer's step count; the default group gets the
    value, other groups the value scaled by their base ratio to the default.

    Metrics (0-d): ``loss`` (mean over ranks, unscaled), ``found_inf``,
    ``scale`` (the scale used in this step), ``grad_norm`` (unscaled, before
    clipping), ``lr`` (the default group's). Runs eagerly or under
    ``torch.compile(fullgraph=True)``; nothing recompiles as values change.

    ``donate=False``: pure; the input state is untouched and stays valid.
    ``donate=True`` (JAX's ``donate_argnums``): the step updates the master
    shards and optimizer moments in place and the returned state owns those
    buffers; the input state is *consumed*: its tensors are emptied, and
    passing it to a step or to fzero's functions raises ``ValueError``.
    ``compile=True``: the step is ``torch.compile(fullgraph=True)``-ed inside
    that bookkeeping (compile a donating step this way, not from outside);
    ``compile={"backend": ..., "mode": ..., "options": ...}`` passes those on to
    ``torch.compile`` (``{"backend": "aot_eager"}``: traced and partitioned as with
    inductor, run by torch's eager kernels).
    Donated and pure steps give bitwise the same numbers.

    ``broadcast_buffers=True`` (DDP's default): before every forward, each
    rank's module buffers are replaced by rank 0's (one ``broadcast`` per
    buffer dtype); each rank's forward then updates its own copy (BatchNorm
    statistics of its own batch). ``False``: every rank keeps its own buffers.

    ``check_replicas_every=N``: every step digests what every rank must hold
    alike (scaler, step, hyperparameters, gathered parameters, frozen
    parameters) in the state it is given, and the digest rides on the step's
    one scalar ``all_reduce`` (no collective of its own; compile-safe):
    ``metrics["replicas_differ"]``. ``replica_check="raise"`` reads it on every
    N-th call counted by the state (``state.calls``, so a resumed run keeps the
    schedule; the only host sync) and raises :class:`fzero.ReplicaDivergenceError`
    naming the item and the ranks; ``"flag"`` only reports it.

    The batch is checked at trace time: every tensor leaf must be ``[R, ...]``
    (``[R, K, ...]`` with ``accum_steps=K``), else a ``ValueError`` names it.
    A collective that fails (a ``TorchCommunicator(timeout=...)`` that a stalled peer
    outlasted, or a dead peer) raises :class:`fzero.CollectiveError` naming it and the step.

    ``unused``: a parameter that no rank's loss reached in a step (no gradient on any rank,
    over every micro-batch). ``"skip"`` (default, DDP with ``find_unused_parameters=True``
    and ``torch.optim``): it is not updated, no weight decay, no moment change, and its own
    step count (``state.opt.step - state.opt.missed``) does not advance; a parameter used on
    one rank only takes that rank's gradient averaged over all ranks, as in DDP. Which
    parameters had a gradient rides on the step's one scalar ``all_reduce`` (``T`` more
    float64 values, ``T`` trainable parameters; no collective of its own).
    ``"zeros"``: no gradient is a zero gradient and every parameter takes every step
    (DeepSpeed's flat buffers): weight decay and momentum still move an unused parameter.
    """
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
        raise TypeError(
            "make_train_step: stage 3 gathers each shard unit's parameters in the unit's forward and "
            "needs the module: give fzero.module_loss(model, ...) (with a state built by "
            "init_train_state(model, ..., stage=3, units=...))"
        )
    schedules = dict(schedules or {})
    K = accum_steps
    # compiled stage 3 with one backward per graph (one local rank, one micro-batch): the units
    # regather in backward (fzero.units.CompiledUnits); otherwise every bucket is gathered at once
    one_backward = comm.local_ranks * K == 1 and isinstance(loss_fn, ModuleLoss)
    compiling = compile_arguments(compile) is not None
    workspace = Workspace(CompiledUnits(loss_fn.module) if compiling and one_backward else None)

    def step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, torch.Tensor]]:
        check_state(state, comm, stage)
        check_batch(batch, comm.local_ranks, K)
        if defer_reduce and state.stage == 3:
            raise ValueError("make_train_step: stage 3 reduces every micro-step (defer_reduce needs full gradients)")
        defer = state.stage == 1 or defer_reduce  # one reduction, at the last micro-batch
        digest = digest_parts(state, comm) if check_replicas_every else None
        buffers_in = state.buffers  # what a skipped step keeps (before any broadcast or forward)
        state = replace(state, opt=apply_schedules(state.opt, schedules))
        total: Optional[Grads] = None
        for k in range(K):
            last = k == K - 1
            if broadcast_buffers:
                state = replace(state, buffers=broadcast_module_buffers(state.buffers, comm))
            g = loss_grads(loss_fn, state, micro_batch(batch, k, K), comm, workspace=workspace,
                           reduce=last or not defer,
                           prior=total.grads if defer and last and total is not None else None,
                           divide=K if defer and last else 1)
            state = replace(state, buffers=g.buffers, rng=g.rng)
            total = accumulate(total, g, reduced_total=defer and last)
        workspace.clear()
        shards, losses = total.grads, total.losses
        if K > 1:
            losses = losses / K
            if not defer:
                shards = tuple(s / K for s in shards)
        with step_scope(UPDATE):
            agreed = unscale_and_clip(state.scaler, shards, comm, losses=losses, clip_norm=clip_norm,
                                      used=total.used if unused == "skip" else None, riders=digest,
                                      in_place=True)
            new_shard, new_opt = shard_step(state.shard, state.opt, agreed.grads, agreed.found_inf, donate=donate,
                                            used=agreed.used, ranks=comm.ranks, comm=comm,
                                            uniform=total.every)
            # A donating step gathers into the parameters it was given: the next forward reads
            # the buffers it read, which the module's parameters view.
            params = all_gather_params(new_shard, comm, state.precision.param_dtype, flat=True,
                                       into=state.params if donate else None) if state.params else ()
            # a skipped step keeps the buffers it was given (NaN BatchNorm statistics of an
            # overflowing forward are not kept): selected branch-free
            skip = agreed.found_inf.to(torch.bool)
            buffers = tuple(torch.where(skip.to(new.device), old, new) for old, new in zip(buffers_in, state.buffers))
            new_state = replace(state, shard=new_shard, opt=new_opt, params=params, buffers=buffers,
                                scaler=update_scale(state.scaler, agreed.found_inf),
                                calls=tuple(c + 1 for c in state.calls))
        metrics = {"loss": agreed.loss, "found_inf": agreed.found_inf, "scale": state.scaler.scale,
                   "grad_norm": agreed.grad_norm.float()}
        if "lr" in state.opt.hyper[0]:  # a user's rule may have no learning rate
            metrics["lr"] = state.opt.hyper[0]["lr"].float()
        if digest is not None:
            metrics["replicas_differ"] = parts_differ(agreed.riders, comm.world_size).float()
        return new_state, metrics

    core: StepFn = step
    if compiling:
        compiled = compiled_step(step, comm.local_ranks * K, workspace, compile)

        def checked_compiled(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, torch.Tensor]]:
            # before the graph: a bad shape raises our error, not a recompile that fails inside
            check_state(state, comm, stage)
            check_batch(batch, comm.local_ranks, K)
            check_compilable(state.opt.optimizer)
            return compiled(state, batch)

        core = checked_compiled
    if check_replicas_every:
        core = checking_replicas(core, comm, check_replicas_every, replica_check)
    core = naming_step(core)
    return donating(core) if donate else core


def naming_step(step: StepFn) -> StepFn:
    """``step`` whose :class:`~fzero.comm.CollectiveError` (a peer stalled past the
    communicator's timeout, or died) names the step it happened in, ``opt.step + 1``."""

    def named(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, torch.Tensor]]:
        try:
            return step(state, batch)
        except CollectiveError as e:
            if e.step is not None:
                raise
            raise e.at_step(int(state.opt.step) + 1) from e

    return named


def checking_replicas(step: StepFn, comm: Communicator, every: int, mode: str = "raise") -> StepFn:
    """``step`` (built with ``check_replicas_every``: its metrics carry ``replicas_differ``)
    that, on every ``every``-th call as the state counts them (``state.calls``), reads
    ``replicas_differ`` (a host sync; none on the other calls) and, if set, names what differs
    with :func:`fzero.check_replicas`. ``mode="flag"``: ``step`` unchanged."""
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
            # the digest was of the state this step was given: name what differs there (a
            # donating step has updated only master shards and moments in place, which are
            # never compared, and consumes the state after this wrapper returns)
            check_replicas(state, comm)
            raise ReplicaDivergenceError(
                "replicas disagreed at the start of this step (the digest carried by its all-reduce), "
                "but a second look found no difference", []
            )
        return new_state, metrics

    return run


def donating(step: StepFn) -> StepFn:
    """``step`` (built with ``donate=True``: it updates the state's buffers in place) that
    refuses a consumed state and consumes the one it is given (:func:`fzero.state.consume`)."""

    def run(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, torch.Tensor]]:
        ensure_live(state)
        new_state, metrics = step(state, batch)
        return consume(state, new_state), metrics

    return run
