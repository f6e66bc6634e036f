"""torchrun worker for tests/test_bf16_batchnorm.py: USAGE bf16_bn_worker.py OUT_DIR CASE...

The bf16 BatchNorm CNN (BatchNorm kept in float32) on gloo; rank 0 also runs the simulated
world in the same process (same threads, same kernels) for the bitwise comparison.
"""

from __future__ import annotations

import sys

import fzero
import test_bf16_batchnorm as t
from dist_harness import worker_main

STEPS = 3


def _rows(state, losses):
    return {"masters": [m.clone() for m in state.shard.master], "params": [p.clone() for p in state.params],
            "buffers": [b.clone() for b in state.buffers], "losses": losses}


def _gloo_vs_simulated(comm, stage, compile=False):
    data = t.MODELS["cnn"][1](STEPS)
    kw = dict(stage=stage, units=t.CNN_UNITS if stage == 3 else None, compile=compile)
    state, _, losses = t.run(t.convnet(), fzero.adamw(lr=1e-2), data, comm=comm, **kw)
    out = {"gloo": _rows(state, losses)}
    if comm.rank == 0:
        sim, _, sim_losses = t.run(t.convnet(), fzero.adamw(lr=1e-2), data, **kw)
        out["sim"] = _rows(sim, sim_losses)
    return out


def case_stage2(comm):
    return _gloo_vs_simulated(comm, 2)


def case_stage3(comm):
    return _gloo_vs_simulated(comm, 3)


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}

if __name__ == "__main__":
    worker_main(lambda name, comm: CASES[name](comm), sys.argv[1:])
