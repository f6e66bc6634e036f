"""How a composed step is run: :func:`bind_step` gives it its communicator and workspace and, if asked, compiles it
(``torch.compile(fullgraph=True)``, traced under ``comm.tracing()``: pieces read ``comm.traced``, never dynamo).

Imports: comm, grads, module, optim, rng, state.
"""

from __future__ import annotations

import contextlib
import logging
import types
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .comm import Communicator
from .grads import LossFn, Workspace
from .module import ModuleLoss
from .optim import OptState, check_compilable
from .rng import rank_rng
from .state import TrainState

__all__ = ["bind_step", "compile_arguments", "no_missed_steps", "StepFn", "Compile"]

StepFn = Callable[[TrainState, Any], tuple[TrainState, dict[str, torch.Tensor]]]
ComposedStep = Callable[[TrainState, Any, Communicator, Workspace], tuple[TrainState, dict[str, torch.Tensor]]]
Compile = bool | Mapping[str, Any]  # make_train_step's ``compile=`` (:func:`compile_arguments`)
TORCH_COMPILE_KEYS = ("backend", "mode", "options")


def compile_arguments(compile: Compile) -> dict[str, Any] | None:
    """``compile=`` as ``torch.compile`` arguments (``None``: eager): ``True`` is ``{}``; a mapping gives ``backend``,
    ``mode``, ``options``; other keys (``fullgraph``, ``dynamic``: fzero's) raise ``ValueError``."""
    if compile is False or compile is None:
        return None
    if compile is True:
        return {}
    if not isinstance(compile, Mapping):
        raise TypeError(f"compile= takes True, False or a dict of torch.compile arguments "
                        f"{TORCH_COMPILE_KEYS}, not {type(compile).__name__}")
    fixed = sorted(set(compile) & {"fullgraph", "dynamic"})
    if fixed:
        raise ValueError(f"compile={dict(compile)!r}: {fixed} are fzero's own (fullgraph=True, dynamic=False: "
                         "a step is one graph and specialises on shapes); give only "
                         f"{TORCH_COMPILE_KEYS}")
    unknown = sorted(set(compile) - set(TORCH_COMPILE_KEYS))
    if unknown:
        raise ValueError(f"compile={dict(compile)!r}: unknown torch.compile arguments {unknown}; "
                         f"fzero passes on {TORCH_COMPILE_KEYS}")
    return dict(compile)


def bind_step(step: ComposedStep, loss_fn: LossFn, comm: Communicator, *, accum_steps: int = 1,
              compile: Compile = False, check: Callable[[TrainState, Any], None] | None = None) -> StepFn:
    """``(state, batch) -> step(state, batch, comm, workspace)``: a composed step given its communicator and a
    :class:`~fzero.grads.Workspace` kept between calls (``loss_fn``, ``accum_steps`` micro-batches), run eagerly or,
    with ``compile=`` (:func:`compile_arguments`), as ``torch.compile(fullgraph=True, dynamic=False)`` (dynamic shapes
    round differently). ``check`` runs on the host before the graph (a bad shape raises, not recompiles). Around a
    compiled call: ``trace_autograd_ops`` (for ``torch.autograd.grad``); the remat pass only with one backward region
    (local ranks x micro-batches == 1: torch refuses random ops in a rematerialised one); row 0's generator state
    installed and stored back (several rows warn once); ``OptState.all_stepped`` read on the host; the hyperparameters
    handed in as ``[1]`` views (:func:`_hyper_as_vectors`: dynamo traces once, not twice); stage 3: the units'
    regathering forwards installed, inductor's reordering passes off (they hoist the gathers)."""
    workspace = Workspace(loss_fn, accum_steps)
    arguments = compile_arguments(compile)
    if arguments is None:
        def eager(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, torch.Tensor]]:
            return step(state, batch, comm, workspace)

        return eager
    traced = comm.tracing()
    by_regather: dict[bool, Any] = {}
    warned: list[bool] = []

    def compiled_for(regather: bool) -> Any:
        if regather not in by_regather:
            dynamo_flags = {"trace_autograd_ops": True}
            if regather:  # the units bind their gathered parameters inside a checkpointed region
                dynamo_flags["skip_fwd_side_effects_in_bwd_under_checkpoint"] = True
            functorch_flags = {"remat_using_tags_for_fwd_loss_bwd_graph": comm.local_ranks * accum_steps == 1}
            # made once: a context keeps every ContextVar ever set in it (a patch per call grew the heap 0.4 kB/step)
            in_order = contextlib.nullcontext()
            if regather:
                import torch._inductor.config as inductor_config  # imported when a step is compiled, not with fzero
                in_order = inductor_config.patch(reorder_for_peak_memory=False, reorder_for_locality=False)
            patches = (torch._dynamo.config.patch(**dynamo_flags), torch._functorch.config.patch(**functorch_flags),
                       in_order)
            by_regather[regather] = (torch.compile(_with_own_code(_scalars_inside(step)), fullgraph=True,
                                                   dynamic=False, **arguments), patches)
        return by_regather[regather]

    def run(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, torch.Tensor]]:
        if check is not None:
            check(state, batch)
        if isinstance(loss_fn, ModuleLoss):
            loss_fn.check_trainable(state.module)
        check_compilable(state.opt.optimizer)
        units = workspace.regather(comm) if state.stage == 3 else None
        compiled, patches = compiled_for(units is not None)
        stepped = no_missed_steps(state.opt)
        if stepped != state.opt.all_stepped:
            state = state.replace(opt=state.opt.replace(all_stepped=stepped))
        device = state.params[0].device if state.params else state.shard.master[0].device
        installed = units.installed(state.module.units) if units is not None else contextlib.nullcontext()
        state = _hyper_as_vectors(state)
        with patches[0], patches[1], patches[2], _quiet_regather_warning(units is not None), installed:
            if not state.rng:
                return compiled(state, batch, traced, workspace)
            left: list[torch.Tensor] = []
            with rank_rng(state.rng[0][0], device, left):
                new_state, metrics = compiled(state, batch, traced, workspace)
        rng = state.rng[0]
        if not torch.equal(left[0], rng[0]):
            if rng.shape[0] > 1 and not warned:
                warned.append(True)
                warnings.warn("fzero: a compiled step on a simulated world of several ranks drew random numbers: "
                              "every rank drew from one generator (rank 0's), unlike real ranks; run it eagerly "
                              "for per-rank randomness", RuntimeWarning, stacklevel=2)
            rng = torch.cat([left[0].unsqueeze(0), rng[1:]])
        return new_state.replace(rng=(rng,)), metrics

    return run


def no_missed_steps(opt: OptState) -> bool:
    """Whether no parameter ever sat out a step, known without a device sync: ``opt.missed`` absent or CPU zeros; on
    another device what the state knows on the host (``OptState.all_stepped``, kept by every step and load)."""
    if not opt.missed:
        return True
    missed = opt.missed[0]
    if missed.device.type != "cpu":
        return opt.all_stepped
    return not bool(missed.any())


def _hyper_as_vectors(state: TrainState) -> TrainState:
    """The state with each hyperparameter (0-d float64 on the CPU) as a ``[1]`` view of itself, to enter a compiled
    graph: dynamo gives every 0-d float64 CPU input a symbolic float and, finding it used only as a tensor, traces the
    whole step a second time without it (a GPT-2 step: 19 s of compile, 9 of them the second trace)."""
    hyper = tuple({k: v.reshape(1) for k, v in group.items()} for group in state.opt.hyper)
    return state.replace(opt=state.opt.replace(hyper=hyper))


def _scalars_inside(step: ComposedStep) -> ComposedStep:
    """``step`` taking a state from :func:`_hyper_as_vectors`: its hyperparameters 0-d again, as views, in the graph."""

    def vectors_in(state: TrainState, batch: Any, comm: Communicator, workspace: Workspace) -> Any:
        hyper = tuple({k: v.reshape(()) for k, v in group.items()} for group in state.opt.hyper)
        return step(state.replace(opt=state.opt.replace(hyper=hyper)), batch, comm, workspace)

    return vectors_in


def _with_own_code(fn: StepFn) -> StepFn:
    """``fn`` with its own code object: dynamo keeps graphs per code object, so shared code hits the recompile limit."""
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    own.__kwdefaults__, own.__qualname__, own.__doc__ = fn.__kwdefaults__, fn.__qualname__, fn.__doc__
    return own


@contextlib.contextmanager
def _quiet_regather_warning(on: bool) -> Any:
    """Drops torch's warning that a checkpoint under compile with a ``context_fn`` must not contain in-place ops:
    stage 3's regions (fzero.units.CompiledUnits) recompute only the gather and views, never an in-place op."""
    log = logging.getLogger("torch._higher_order_ops.wrap")
    quiet = lambda record: "context_fn is passed to torch.utils.checkpoint" not in record.getMessage()  # noqa: E731
    if on:
        log.addFilter(quiet)
    try:
        yield
    finally:
        log.removeFilter(quiet)  # a no-op when not added
