"""Worker run by torchrun for tests/test_replicas.py: replica checks on real gloo ranks.

Usage: replica_worker.py OUT_DIR CASE [CASE ...] (see dist_harness.worker_main).
"""

from __future__ import annotations

import dataclasses
import sys
import time

import torch

import fzero
from fzero.pytree import replace
from fzero.testing import CorruptResult, FaultyWorld
from helpers import batches, children, mlp

mse = torch.nn.functional.mse_loss


def _state(comm, stage=2):
    model = mlp(torch.float32)
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-2), comm, stage=stage, alignment=4)
    return model, state


def _outcome(state, comm, **kw):
    """Did check_replicas raise (and what), and what did replicas_differ say."""
    differ = bool(fzero.replicas.replicas_differ(state, comm, **kw))
    try:
        fzero.replicas.check_replicas(state, comm, **kw)
        return {"raised": False, "differ": differ}
    except fzero.ReplicaDivergenceError as e:
        return {
            "raised": True, "differ": differ, "message": str(e),
            "items": [(d.item, d.agree, d.differ, d.located) for d in e.differences],
        }


def case_corrupt_gather(comm):
    """One element of rank 1's all_gather result flipped in step 1: caught after that step."""
    model, state = _state(comm)
    faulty = FaultyWorld(comm, [CorruptResult(step=1, rank=1, op="all_gather", index=7)])
    step = faulty.wrap(fzero.make_train_step(fzero.module_loss(model, mse), faulty))
    out = {}
    for i, batch in enumerate(batches(2, comm.world_size, 2, torch.float32)):
        state, _ = step(state, faulty.split_batch(batch))
        t0 = time.perf_counter()
        out[f"after_step{i}"] = _outcome(state, comm)
        out[f"seconds{i}"] = time.perf_counter() - t0
    out["records"] = [(r.step, r.rank, r.op, r.index) for r in faulty.records]
    return out


def case_grad_and_delay(comm):
    """An inf in rank 2's gradient at step 1 and rank 0 delayed 0.3 s at step 2, seen by every rank."""
    from fzero.testing import Delay, GradFault

    model, state = _state(comm)
    faulty = FaultyWorld(comm, [GradFault(step=1, rank=2), Delay(step=2, rank=0, seconds=0.3)])
    step = faulty.wrap(fzero.make_train_step(fzero.module_loss(model, mse), faulty))
    found, unchanged, seconds = [], [], []
    for batch in batches(3, comm.world_size, 2, torch.float32):
        before = state
        t0 = time.perf_counter()
        state, m = step(state, faulty.split_batch(batch))
        seconds.append(time.perf_counter() - t0)
        found.append(m["found_inf"].item())
        unchanged.append(all(torch.equal(a, b) for a, b in zip(before.shard.master, state.shard.master)))
    return {"found_inf": found, "unchanged": unchanged, "seconds": seconds,
            "records": [(r.kind, r.step, r.rank) for r in faulty.records]}


def case_scalars(comm):
    """Each replicated scalar changed on one rank: the scale on rank 0, lr on rank 2, step on rank 1."""
    _, state = _state(comm)
    out = {"clean": _outcome(state, comm)}
    if comm.rank == 0:
        s = replace(state, scaler=replace(state.scaler, scale=state.scaler.scale * 2))
    else:
        s = state
    out["scale"] = _outcome(s, comm)
    lr = 0.5 if comm.rank == 2 else 1e-2
    out["lr"] = _outcome(replace(state, opt=fzero.optim.set_hyperparams(state.opt, lr=lr)), comm)
    step = state.opt.step + (1 if comm.rank == 1 else 0)
    out["step"] = _outcome(replace(state, opt=replace(state.opt, step=step)), comm)
    return out


def case_buffers(comm):
    """A module buffer differing on rank 2: an error when buffers must agree, fine when local."""
    _, state = _state(comm)
    buf = torch.full((1, 3), 1.0 + (comm.rank == 2))
    state = dataclasses.replace(
        state, buffers=(buf,), module=fzero.module.ModuleSpec(buffers=("bn.running_mean",), persistent=(True,))
    )
    return {"broadcast": _outcome(state, comm, buffers="broadcast"), "local": _outcome(state, comm, buffers="local")}


def case_stage3(comm):
    """Stage 3 keeps no gathered parameters: the scalars are still compared, after a step too."""
    model = mlp(torch.float32)
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-2), comm, stage=3, units=children, alignment=4)
    state, _ = fzero.make_train_step(fzero.module_loss(model, mse), comm)(state, comm.split_batch(batches(1, comm.world_size, 2, torch.float32)[0]))
    return {"clean": _outcome(state, comm)}


if __name__ == "__main__":
    from dist_harness import worker_main

    worker_main(lambda name, comm: globals()[f"case_{name}"](comm), sys.argv[1:])
