"""Worker run by torchrun for tests/test_mesh_gloo.py: four gloo ranks as a 2x2 mesh (HSDP).

Usage: mesh_worker.py OUT_DIR CASE [CASE ...] (see dist_harness.worker_main).
"""

from __future__ import annotations

import os
import sys

import torch

from fzero.checkpoint import export_pretrained, save_checkpoint, torch_optim
from fzero.comm import CountingCommunicator
from fzero.dist import TorchCommunicator
from fzero.quantized import QuantizedCommunicator
from test_mesh import _params, _train


def _trained(stage: int, accum: int = 1, quantized: bool = False, hpz: bool = False) -> dict:
    comm = CountingCommunicator(TorchCommunicator(mesh=(2, 2), hpz=hpz))
    inner = QuantizedCommunicator(comm, weights=8, grads=4) if quantized else comm
    state, metrics = _train(inner, stage, accum, param_dtype=torch.bfloat16 if quantized else None)
    return {"params": [p[0] for p in _params(state, comm)], "loss": [m["loss"] for m in metrics],
            "grad_norm": [m["grad_norm"] for m in metrics], "rng": state.rng[0][0], "repr": repr(comm.inner),
            "records": [(r.op, r.axis, r.elements, r.bytes) for r in comm.records], "state": state}


def run_case(name: str, _flat) -> dict:
    if name.startswith("train"):  # train{stage}[_accum|_quantized|_hpz]
        out = _trained(int(name[5]), 4 if name.endswith("_accum") else 1, name.endswith("_quantized"),
                       name.endswith("_hpz"))
        if name == "train2":
            out["ckpt"] = os.path.join(sys.argv[1], "ckpt")
            save_checkpoint(out["state"], out["ckpt"], TorchCommunicator(mesh=(2, 2)))
        if name == "train3":  # the live export on the mesh: each piece from its holder in this shard group
            out["export"] = os.path.join(sys.argv[1], "export3")
            torch_optim.BROADCAST_ELEMENTS = 5  # pieces that cut every tensor of the small model
            export_pretrained(out["state"], out["export"], comm=TorchCommunicator(mesh=(2, 2)))
        del out["state"]
        return out
    if name == "wrong":  # named errors before any collective: a hang would time the test out
        messages = []
        for mesh in [(3, 2), [[0, 1], [1, 2]], [[0, 1], [2, 3], [4, 5]]]:
            try:
                TorchCommunicator(mesh=mesh)
                messages.append(None)
            except ValueError as e:
                messages.append(str(e))
        return {"messages": messages, "flat": repr(TorchCommunicator(mesh=(1, 4))),
                "ddp": repr(TorchCommunicator(mesh=(4, 1)))}
    raise ValueError(f"unknown case {name}")


if __name__ == "__main__":
    from dist_harness import worker_main

    worker_main(run_case, sys.argv[1:])
