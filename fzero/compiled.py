"""A step under ``torch.compile(fullgraph=True)``: :func:`compiled_step`, the bookkeeping a
compiled fzero step needs around the graph (dynamo and functorch flags, each rank's generator,
a code object of its own). :func:`fzero.make_train_step` ``(compile=True)`` uses it; a step
composed by hand is compiled with it the same way.

Imports: grads, optim, pytree, rng, sharding, state.
"""

from __future__ import annotations

import contextlib
import logging
import types
import warnings
from typing import Any, Callable, Mapping, Optional, Union

import torch

from .grads import Workspace
from .optim import OptState
from .pytree import replace
from .rng import rank_rng
from .sharding import plain_update_known
from .state import TrainState

__all__ = ["compiled_step", "compile_arguments", "no_missed_steps", "StepFn", "Compile"]

StepFn = Callable[[TrainState, Any], tuple[TrainState, dict[str, torch.Tensor]]]

# make_train_step's ``compile=``: False (eager), True (torch.compile's defaults: inductor), or
# torch.compile's own keyword arguments among TORCH_COMPILE_KEYS
Compile = Union[bool, Mapping[str, Any]]
TORCH_COMPILE_KEYS = ("backend", "mode", "options")


def compile_arguments(compile: Compile) -> Optional[dict[str, Any]]:
    """``compile=`` as ``torch.compile`` keyword arguments, or ``None`` for an eager step.

    ``True`` is ``{}`` (inductor, default mode); a mapping is checked and copied: ``backend``
    (e.g. ``"aot_eager"``: dynamo and AOTAutograd without inductor's code generation, for
    debugging or a cheap compile), ``mode``, ``options``. ``fullgraph`` and ``dynamic`` are
    fzero's own (:func:`compiled_step`) and are refused, as is any other key, with a
    ``ValueError`` that names it."""
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


def compiled_step(step: StepFn, backward_regions: int = 1, workspace: Optional[Workspace] = None,
                  compile: Compile = True) -> StepFn:
    """``torch.compile(step, fullgraph=True)`` with what fzero's step needs around it.

    ``compile``: ``True``, or ``torch.compile``'s ``backend``/``mode``/``options``
    (:func:`compile_arguments`).

    * ``torch._dynamo.config.trace_autograd_ops=True`` while tracing: torch
      2.13's dynamo graph-breaks on ``torch.autograd.grad`` otherwise (it
      is off by default). The flag is set only for this function's calls;
      compiling a step from outside needs it set by the caller.
    * Activation checkpointing: inductor rematerialises checkpointed regions of
      a forward-loss-backward graph only if the graph has one backward region.
      ``backward_regions`` (local ranks x micro-batches) > 1 turns that pass
      off (``torch._functorch.config.remat_using_tags_for_fwd_loss_bwd_graph``):
      the results are the same, inductor chooses what to keep. torch also
      refuses random ops (dropout) inside a rematerialised region.
    * Each rank's generator (:mod:`fzero.rng`): dynamo cannot swap generator
      states inside a graph, so row 0's state is installed around the
      compiled call and the state the call leaves is stored back. With one
      row (a real rank) the stream is carried exactly; with several rows
      (a compiled simulated world) every row draws from row 0's stream, and a
      warning says so the first time the step consumed randomness.
    * ``dynamic=False``: the graph specialises on shapes. Otherwise a step compiled after
      another step function of the same code in the process (another state, another stage)
      would be compiled with dynamic shapes, and round differently from the same step
      compiled first: the simulated world and gloo would no longer agree bitwise.
    * The plain update: before each call, whether no parameter has ever sat out a step
      (:func:`no_missed_steps`, read on the host without a device sync) is handed to
      :func:`fzero.sharding.shard_step` as a constant of the trace
      (:func:`fzero.sharding.plain_update_known`); dynamo guards on it, so the one time it
      turns False the step compiles once more.
    * ``workspace`` with a ``regather`` (:class:`fzero.grads.Workspace`; stage 3, one local rank,
      one micro-batch): the units' regathering forwards are installed around each call of a
      stage-3 state, dynamo applies the side effects of a checkpointed region once
      (``skip_fwd_side_effects_in_bwd_under_checkpoint``; the units bind their gathered
      parameters inside one), and torch's warning about in-place ops in checkpointed regions
      with a ``context_fn`` is dropped (those regions recompute only the gather and views).
      States of another stage are compiled without them (a graph per stage).
    """
    by_regather: dict[bool, Any] = {}
    warned: list[bool] = []
    arguments = compile_arguments(compile)
    if arguments is None:
        raise ValueError("compiled_step: compile=False; call the step itself for an eager step")

    def compiled_for(regather: bool) -> Any:
        if regather not in by_regather:
            dynamo_flags = {"trace_autograd_ops": True}
            if regather:
                # compiled stage 3's units bind their gathered parameters inside a checkpointed
                # region (fzero.units.CompiledUnits): a side effect that must not replay in
                # backward, where the remat pass recomputes only the gather
                dynamo_flags["skip_fwd_side_effects_in_bwd_under_checkpoint"] = True
            functorch_flags = {"remat_using_tags_for_fwd_loss_bwd_graph": backward_regions == 1}
            # Inductor's two reordering passes undo the regathering schedule (measured on a GPT's
            # blocks): its peak-memory reordering moves every unit's gathers, the forward's and
            # backward's, ahead of the forward's compute (its estimate does not see what a gather
            # allocates), and its locality reordering moves each unit's gradient reduction next
            # to the optimizer, keeping every unit's whole gradient and received buffer to the
            # end. Without them the graph runs in the order it was traced: a unit is gathered
            # just before its forward and again before its backward, and reduced right after.
            # Made once and re-entered on every call: each config patch object owns a ContextVar,
            # and a context keeps every variable ever set in it, so a new patch per call grew the
            # heap by about 0.4 kB a step for the life of the process.
            in_order = _inductor_config().patch(reorder_for_peak_memory=False, reorder_for_locality=False) \
                if regather else contextlib.nullcontext()
            patches = (torch._dynamo.config.patch(**dynamo_flags), torch._functorch.config.patch(**functorch_flags),
                       in_order)
            by_regather[regather] = (torch.compile(_with_own_code(step), fullgraph=True, dynamic=False, **arguments),
                                    patches)
        return by_regather[regather]

    def run(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, torch.Tensor]]:
        units = workspace.regather if workspace is not None and state.stage == 3 else None
        compiled, patches = compiled_for(units is not None)
        device = state.params[0].device if state.params else state.shard.master[0].device
        installed = units.installed(state.module.units) if units is not None else contextlib.nullcontext()
        with patches[0], patches[1], patches[2], _quiet_regather_warning(units is not None), installed, \
                plain_update_known(no_missed_steps(state.opt)):
            if not state.rng:
                return compiled(state, batch)
            left: list[torch.Tensor] = []
            with rank_rng(state.rng[0][0], device, left):
                new_state, metrics = compiled(state, batch)
        rng = state.rng[0]
        if not torch.equal(left[0], rng[0]):
            if rng.shape[0] > 1 and not warned:
                warned.append(True)
                warnings.warn(
                    "fzero: a compiled step on a simulated world of several ranks drew random numbers: "
                    "every rank drew from one generator (rank 0's), unlike real ranks; run it eagerly "
                    "for per-rank randomness", RuntimeWarning, stacklevel=2)
            rng = torch.cat([left[0].unsqueeze(0), rng[1:]])
        return replace(new_state, rng=(rng,)), metrics

    return run


def _inductor_config() -> Any:
    import torch._inductor.config as inductor_config  # imported when a step is compiled, not with fzero

    return inductor_config


def no_missed_steps(opt: OptState) -> bool:
    """Whether it is known without a device sync that no parameter ever sat out a step
    (``opt.missed`` absent, or a CPU vector of zeros)."""
    if not opt.missed:
        return True
    missed = opt.missed[0]
    return missed.device.type == "cpu" and not bool(missed.any())


def _with_own_code(fn: StepFn) -> StepFn:
    """``fn`` with a code object of its own. Dynamo keeps compiled graphs on the code object,
    and every step ``make_train_step`` builds shares one: without a copy, each new step (another
    model, stage or option in the same process) adds a guarded entry there, a later one
    recompiles inside its first steps, and the ninth hits dynamo's recompile limit, which
    ``fullgraph=True`` makes a hard error."""
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    own.__kwdefaults__, own.__qualname__, own.__doc__ = fn.__kwdefaults__, fn.__qualname__, fn.__doc__
    return own


class _RegatherWarningFilter(logging.Filter):
    """Drops torch's warning that a checkpoint under compile with a ``context_fn`` must not
    contain in-place ops: stage 3's regions (fzero.units.CompiledUnits) recompute only the
    gather and views, never an in-place op of the unit's own."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "context_fn is passed to torch.utils.checkpoint" not in record.getMessage()


@contextlib.contextmanager
def _quiet_regather_warning(on: bool) -> Any:
    if not on:
        yield
        return
    log, quiet = logging.getLogger("torch._higher_order_ops.wrap"), _RegatherWarningFilter()
    log.addFilter(quiet)
    try:
        yield
    finally:
        log.removeFilter(quiet)
