"""Checkpoint cases shared by the simulated-world tests and the torchrun worker.

As a torchrun worker: ``ckpt_worker.py OUT_DIR ROOT CASE [CASE ...]`` runs each case
on gloo and saves every case's result (or the error text) to ``OUT_DIR/rank{r}.pt``.
Cases: ``save`` trains 8 steps from the initial state and saves ``ROOT/gloo{W}``;
``dropout`` compares a run with dropout resumed from an odd step with the uninterrupted run;
``resume:NAME`` loads ``ROOT/NAME`` (saved by any world, simulated or gloo) into a
state built for this world and trains the remaining 8 steps; ``mismatch:NAME`` loads
it into a state with another optimizer; ``torch_import`` imports a torch.optim run.

Every run trains on the same global batches (``GLOBAL_BATCH`` samples per step,
split evenly over the ranks; mean loss), so the averaged gradient, and hence the
training, does not depend on the world size beyond rounding.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import torch

import fzero
from fzero.checkpoint import (
    export_model_state_dict,
    export_torch_optim_state_dict,
    import_torch_optim_state_dict,
    load_checkpoint,
    save_checkpoint,
)
from helpers import batches, children, mlp

mse = torch.nn.functional.mse_loss

GLOBAL_BATCH = 24  # divisible by 1, 2, 3, 4, 8: equal micro-batches at every tested world size
STEPS = 16
HALF = 8
DATA = batches(STEPS, 1, GLOBAL_BATCH, torch.float32)


def optimizer(kind: str = "adamw") -> fzero.Optimizer:
    """Two optimizer groups (no weight decay on biases and LayerNorm), as is usual."""
    no_decay = [(fzero.optim.no_weight_decay_for(mlp()), {"weight_decay": 0.0})]
    if kind == "sgd":
        return fzero.sgd(lr=0.05, momentum=0.9, weight_decay=0.01, groups=no_decay)
    if kind == "adam":
        return fzero.adam(lr=1e-2, weight_decay=0.01, groups=no_decay)
    return fzero.adamw(lr=1e-2, weight_decay=0.1, groups=no_decay)


def scaler() -> fzero.ScalerState:
    # A dynamic scale that grows every 3 steps: its tracker is mid-interval at step 8.
    return fzero.init_scaler(2.0**8, growth_interval=3)


def fresh(
    comm: fzero.Communicator,
    *,
    seed: int = 0,
    stage: int = 2,
    kind: str = "adamw",
    sizes: tuple[int, ...] = (6, 9, 5, 3),
    **kw: Any,
) -> fzero.TrainState:
    """The initial state (``seed`` 0), or a template to load into (other seeds: its values must not matter)."""
    units = children if stage == 3 else None
    return fzero.init_train_state(
        mlp(seed=seed, sizes=sizes), optimizer(kind), comm, scaler=scaler(), stage=stage, units=units, **kw
    )


def train(state: fzero.TrainState, comm: fzero.Communicator, steps: range, stage: int = 2) -> fzero.TrainState:
    """Steps ``steps`` of the global batches, each split evenly over the ranks."""
    loss = fzero.module_loss(mlp(), mse)
    step = fzero.make_train_step(loss, comm)
    for i in steps:
        state, _ = step(state, comm.split_batch(DATA[i]))
    return state


def summary(state: fzero.TrainState, comm: fzero.Communicator) -> dict[str, Any]:
    """What must match between runs: full parameters, torch-form optimizer state, scaler, step."""
    return {
        "params": {k: v.clone() for k, v in export_model_state_dict(state, comm).items()},
        "optim": export_torch_optim_state_dict(state, comm),
        "scaler": [float(state.scaler.scale), int(state.scaler.growth_tracker), int(state.scaler.hysteresis_left)],
        "step": int(state.opt.step),
    }


def extra_at(step: int) -> dict[str, Any]:
    """What a training loop passes along: data-loader position, an RNG state, a tag."""
    return {"loader": {"position": step, "epoch": 0}, "rng": torch.arange(4) * step, "run": "ckpt-test"}


TORCH = {
    "sgd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
    "adam": (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.01)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
}


def torch_optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The torch twin of ``optimizer(kind)``: the same two groups, each in tree order."""
    cls, kw = TORCH[kind]
    no_decay = fzero.optim.no_weight_decay_for(model)
    named = list(model.named_parameters())
    return cls(
        [
            {"params": [p for n, p in named if not no_decay(n)]},
            {"params": [p for n, p in named if no_decay(n)], "weight_decay": 0.0},
        ],
        **kw,
    )


def torch_train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    """Plain torch training on the whole global batch (the mean loss fzero's ranks average)."""
    for i in steps:
        x, y = DATA[i]
        opt.zero_grad()
        mse(model(x), y).backward()
        opt.step()


def torch_summary(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"params": {k: v.detach().clone() for k, v in model.state_dict().items()}, "optim": opt.state_dict()}


def case_torch_import(comm: fzero.Communicator) -> dict[str, Any]:
    """A torch.optim AdamW run (3 steps) imported into this world; the state dicts exported
    back; then one more step of each."""
    model = mlp()
    opt = torch_optimizer("adamw", model)
    torch_train(model, opt, range(3))
    state = import_torch_optim_state_dict(fresh(comm, seed=7), model.state_dict(), opt.state_dict(), comm)
    out: dict[str, Any] = {"torch_at_3": copy.deepcopy(opt.state_dict()), "fzero_at_3": summary(state, comm)}
    torch_train(model, opt, range(3, 4))
    out["torch_at_4"] = torch_summary(model, opt)
    out["fzero_at_4"] = summary(train(state, comm, range(3, 4)), comm)
    return out


def case_save(comm: fzero.Communicator, root: Path) -> dict[str, Any]:
    state = train(fresh(comm), comm, range(HALF))
    save_checkpoint(state, root / f"gloo{comm.world_size}", comm, name="step-8", extra=extra_at(HALF))
    return summary(state, comm)


def case_resume(comm: fzero.Communicator, root: Path, name: str) -> dict[str, Any]:
    state, extra = load_checkpoint(root / name, fresh(comm, seed=7), comm)
    state = train(state, comm, range(extra["loader"]["position"], STEPS))
    return {"summary": summary(state, comm), "extra": extra}


def case_mismatch(comm: fzero.Communicator, root: Path, name: str) -> str:
    """Loading into another optimizer: every rank must raise the clear error (no hang)."""
    try:
        load_checkpoint(root / name, fresh(comm, kind="sgd"), comm)
    except ValueError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


DROPOUT_STEPS, DROPOUT_STOP = 9, 5  # an odd stop step: the generators are mid-run


def dropout_state(comm: fzero.Communicator, *, seed: int = 0, rng_seed: int = 0) -> fzero.TrainState:
    """The MLP followed by dropout: every step draws masks from each rank's generator."""
    model = torch.nn.Sequential(mlp(seed=seed), torch.nn.Dropout(0.3))
    return fzero.init_train_state(model, fzero.adamw(lr=1e-2), comm, scaler=scaler(), seed=rng_seed)


def train_dropout(state: fzero.TrainState, comm: fzero.Communicator, steps: range) -> fzero.TrainState:
    model = torch.nn.Sequential(mlp(), torch.nn.Dropout(0.3))
    step = fzero.make_train_step(fzero.module_loss(model, mse), comm)
    for i in steps:
        state, _ = step(state, comm.split_batch(DATA[i]))
    return state


def case_dropout(comm: fzero.Communicator, root: Path) -> dict[str, Any]:
    """Uninterrupted, and stopped at an odd step, saved, loaded into a template with other
    weights and other generators, resumed; and resumed with the template's generators (what
    a checkpoint without them would give)."""
    full = train_dropout(dropout_state(comm), comm, range(DROPOUT_STEPS))
    part = train_dropout(dropout_state(comm), comm, range(DROPOUT_STOP))
    path = save_checkpoint(part, root / f"dropout{comm.world_size}", comm)
    template = dropout_state(comm, seed=7, rng_seed=99)
    state, _ = load_checkpoint(path, template, comm)
    loaded_rng = torch.equal(state.rng[0], part.rng[0])
    resumed = train_dropout(state, comm, range(DROPOUT_STOP, DROPOUT_STEPS))
    other_rng = fzero.pytree.replace(state, rng=template.rng)
    diverged = train_dropout(other_rng, comm, range(DROPOUT_STOP, DROPOUT_STEPS))
    return {"full": summary(full, comm), "resumed": summary(resumed, comm), "loaded_rng": loaded_rng,
            "rng": (full.rng[0].clone(), resumed.rng[0].clone()), "without_rng": summary(diverged, comm)}


def run_case(name: str, comm: Any, root: Path) -> Any:
    """Run one named case (the worker's dispatch)."""
    if name == "save":
        return case_save(comm, root)
    elif name == "dropout":
        return case_dropout(comm, root)
    elif name == "torch_import":
        return case_torch_import(comm)
    elif name.startswith("mismatch:"):
        return case_mismatch(comm, root, name.split(":", 1)[1])
    elif name.startswith("resume:"):
        return case_resume(comm, root, name.split(":", 1)[1])
    else:
        raise ValueError(f"unknown case {name!r}")


if __name__ == "__main__":
    from dist_harness import worker_main

    out_dir, root, names = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    worker_main(lambda name, comm: run_case(name, comm, root), [out_dir, *names])
