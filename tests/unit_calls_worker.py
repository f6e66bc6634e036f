"""torchrun worker for stage 3 with data-dependent units on gloo: USAGE unit_calls_worker.py OUT_DIR CASE...

``branch``/``experts``/``last``: ranks that call different units must each raise the named error
(under a 20 s collective timeout, so that a hang would end as a CollectiveError, not at the
harness's limit). ``mixtral``: a tiny Mixtral whose decoder layers are the units (the default
wrap policy), trained at stage 3; rank 0 also trains it on the simulated world in the same
process, for a bitwise comparison.
"""

from __future__ import annotations

import sys

import dist_cases as cases
import fzero
import user_models as um
from dist_harness import worker_main
from fzero.dist import TorchCommunicator

STEPS = 3


def case_branch(comm):
    return cases.divergent_units(TorchCommunicator(timeout=20), "branch")


def case_experts(comm):
    return cases.divergent_units(TorchCommunicator(timeout=20), "experts")


def case_last(comm):
    return cases.divergent_units(TorchCommunicator(timeout=20), "last")


def case_experts_agree(comm):
    out = {"gloo": cases.agreeing_experts(comm)}
    if comm.rank == 0:
        out["sim"] = cases.agreeing_experts(fzero.SimulatedWorld(comm.world_size))
    return out


def train_mixtral(comm, steps: int = STEPS) -> dict:
    """Stage 3, default units (the decoder layers), AdamW, the model's own loss."""
    model = um.mixtral()
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-2), comm, stage=3, seed=3)
    step = fzero.make_train_step(fzero.module_loss(model), comm)
    losses = []
    for ids, _ in um.token_batches(steps, comm.world_size * 2, vocab=um.MIXTRAL_VOCAB):
        state, m = step(state, comm.split_batch({"input_ids": ids, "labels": ids}))
        losses.append(m["loss"].item())
    return {"units": state.module.units, "masters": [m.clone() for m in state.shard.master], "losses": losses}


def case_mixtral(comm):
    out = {"gloo": train_mixtral(comm)}
    if comm.rank == 0:
        out["sim"] = train_mixtral(fzero.SimulatedWorld(comm.world_size))
    return out


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}

if __name__ == "__main__":
    worker_main(lambda name, comm: CASES[name](comm), sys.argv[1:])
