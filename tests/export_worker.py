"""torchrun worker for the gloo export cases: USAGE export_worker.py OUT_DIR CASE...

A case ``{kind}-s{stage}`` trains a tiny ``transformers`` model on the gloo ranks and on the simulated world of the same
size in the same process (same threads, same kernels), saves the gloo state's checkpoint to ``OUT_DIR/ckpt-{case}``,
exports the live gloo state to ``OUT_DIR/live-{case}`` (collective: every rank gathers, rank 0 writes) and returns
what ``write_back`` gives from both. Case ``busy``: every rank exports to a directory that is not empty.
"""

from __future__ import annotations

import sys
from pathlib import Path

import fzero
import user_models as um
from dist_harness import worker_main
from fzero.checkpoint import CheckpointOutputError, export_pretrained, save_checkpoint, torch_optim
from helpers import run_steps

DEFAULT_PIECE = torch_optim.BROADCAST_ELEMENTS
MODELS = {"gpt2": um.gpt2, "llama": um.llama}


def _trained(kind: str, stage: int, comm: fzero.Communicator) -> fzero.TrainState:
    model = MODELS[kind](seed=0)
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-2), comm, stage=stage)
    step = fzero.make_train_step(fzero.module_loss(model, um.lm_criterion), comm)
    return run_steps(step, state, comm, um.token_batches(2, comm.world_size * 2, seed=1))[0]


def _written_back(kind: str, state: fzero.TrainState, comm: fzero.Communicator) -> dict:
    module = fzero.write_back(state, comm, MODELS[kind](seed=99))
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def busy_output(comm: fzero.Communicator, out: Path) -> dict:
    """Every rank exports to a directory rank 0 finds not empty: each raises (none waits for ever in a gather)."""
    import torch.distributed as dist

    state = _trained("gpt2", 2, comm)
    if comm.rank == 0:
        (out / "busy").mkdir()
        (out / "busy" / "mine.txt").write_text("keep")
    dist.barrier()
    try:
        export_pretrained(state, out / "busy", comm=comm)
    except CheckpointOutputError as e:
        return {"raised": str(e)}
    return {"raised": None}


def run_case(name: str, comm: fzero.Communicator) -> dict:
    out = Path(sys.argv[1])
    if name == "busy":
        return busy_output(comm, out)
    kind, stage = name.split("-s")
    state = _trained(kind, int(stage), comm)
    sim = fzero.SimulatedWorld(comm.world_size)
    simulated = _trained(kind, int(stage), sim)
    save_checkpoint(state, out / f"ckpt-{name}", comm)
    if comm.rank == 0:  # the writer's file (every rank writing it, one would read it half-written)
        MODELS[kind]().config.to_json_file(out / f"config-{name}.json")
    # the Llama case gathers in pieces of 7 elements: every piece boundary a tensor can have, on a tiny model
    torch_optim.BROADCAST_ELEMENTS = 7 if kind == "llama" else DEFAULT_PIECE
    export_pretrained(state, out / f"live-{name}", comm=comm, config=out / f"config-{name}.json")
    return {"gloo": _written_back(kind, state, comm), "simulated": _written_back(kind, simulated, sim)}


if __name__ == "__main__":
    worker_main(run_case, sys.argv[1:])
