"""Worker run by torchrun for tests/test_moe_gloo.py: four gloo ranks, each converting its own copy of the tiny MoE
model at EP = 2 (``fzero.moe.expert_parallel``: its slice of the experts) and training it with the experts on their
groups (``TorchCommunicator(groups=fzero.moe.expert_groups(4, 2))``).

Usage: moe_worker.py OUT_DIR CASE [CASE ...] (see dist_harness.worker_main).
"""

from __future__ import annotations

import os
import sys

import fzero.moe as moe
import moe_cases as mc
from fzero.checkpoint import export_model_state_dict, save_checkpoint
from fzero.comm import CountingCommunicator
from fzero.dist import TorchCommunicator

# case name -> (kind, stage, clip, accum, optimizer)
CASES = {"mixtral1": ("mixtral", 1, 0.05, 2, "sgd"), "mixtral2": ("mixtral", 2, 0.05, 2, "sgd"),
         "mixtral3": ("mixtral", 3, 0.05, 2, "sgd"), "qwen2": ("qwen2_moe", 2, None, 1, "adamw"),
         "qwen2_3": ("qwen2_moe", 3, 0.05, 2, "sgd")}


def run_case(name: str, _flat) -> dict:
    if name == "disagree":  # rank 0 asks for EP = 2, the others for EP = 4: named on every rank, no hang
        try:
            TorchCommunicator(groups=moe.expert_groups(mc.W, 2 if _flat.rank == 0 else 4))
        except ValueError as e:
            return {"message": str(e)}
        return {"message": None}
    if name == "ckpt":  # saved on real ranks, loaded by the simulated world at another degree; the live export
        comm = TorchCommunicator(groups=moe.expert_groups(mc.W, mc.EP))
        got = mc.run_fzero("mixtral", comm, 3, 0.05, opt="sgd", steps=2)
        path = os.path.join(sys.argv[1], "ckpt")
        save_checkpoint(got["state"], path, comm)
        return {"path": path, "whole": export_model_state_dict(got["state"], comm)}
    kind, stage, clip, accum, opt = CASES[name]
    counter = CountingCommunicator(TorchCommunicator(groups=moe.expert_groups(mc.W, mc.EP)))
    got = mc.run_fzero(kind, counter.inner, stage, clip, accum, opt=opt, counter=counter)
    return {"params": got["params"][0], "losses": got["losses"], "norms": got["norms"],
            "missed": got["state"].opt.missed[0],
            "all_to_all": counter.totals(["all_to_all"], axis=moe.EXPERT_PARALLEL)["bytes"]}


if __name__ == "__main__":
    from dist_harness import worker_main

    worker_main(run_case, sys.argv[1:])
