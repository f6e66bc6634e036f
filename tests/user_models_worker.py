"""torchrun worker for the user-model cases on gloo: USAGE user_models_worker.py OUT_DIR CASE...

Each case also runs, where it compares with the simulated world, that world in
the same process (same threads, same kernels), so the comparison needs no
assumption about the parent process.
"""

from __future__ import annotations

import copy
import sys

import torch
from torch._dynamo.utils import counters

import fzero
import user_models as um
from dist_harness import worker_main
from helpers import CHEAP_COMPILE

STEPS = 4


def _train(model, comm, data, *, compile=False, opt=None, loss="lm", seed=7, stage=2, units=None):
    state = fzero.init_train_state(model, opt or fzero.adamw(lr=1e-2), comm, seed=seed, stage=stage, units=units)
    crit = um.lm_criterion if loss == "lm" else torch.nn.functional.cross_entropy
    step = fzero.make_train_step(fzero.module_loss(model, crit), comm, compile=compile)
    losses = []
    for batch in data:
        state, m = step(state, comm.split_batch(batch))
        losses.append(m["loss"].item())
    return state, losses


def _rows(state):
    return {
        "masters": [m.clone() for m in state.shard.master],
        "buffers": [b.clone() for b in state.buffers],
        "rng": [g.clone() for g in state.rng],
    }


def _dropout_vs_simulated(comm, build=lambda: um.gpt2(dropout=0.1), **kw):
    """GPT-2 with dropout (or ``build()``'s model) on gloo; rank 0 also runs the simulated world in the same
    process."""
    data = um.token_batches(STEPS, comm.world_size * 2)
    state, losses = _train(build(), comm, data, **kw)
    out = {"gloo": _rows(state), "losses": losses}
    if comm.rank == 0:
        sim_state, sim_losses = _train(build(), fzero.SimulatedWorld(comm.world_size), data, **kw)
        out["sim"] = _rows(sim_state)
        out["sim_losses"] = sim_losses
    return out


def case_dropout_gpt2(comm):
    return _dropout_vs_simulated(comm)


def case_bn_vs_ddp(comm):
    """BatchNorm ResNet: fzero on gloo against DDP (broadcast_buffers=True) on gloo."""
    model = um.resnet()
    data = um.image_batches(STEPS, comm.world_size * 2, torch.float32)
    state, _ = _train(model, comm, data, opt=fzero.sgd(lr=0.1, momentum=0.9), loss="image")
    ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for batch in data:
        x, y = comm.split_batch(batch)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x[0]), y[0]).backward()
        opt.step()
    full = {k: v[0] for k, v in fzero.full_params(state.shard, comm).items()}
    ref = dict(ddp.module.named_parameters())
    p_err = max(((full[k] - p).abs().max() / p.abs().max()).item() for k, p in ref.items())
    bufs = dict(ddp.module.named_buffers())
    b_err = 0.0
    for name, b in zip(state.module.buffers, state.buffers):
        r = bufs[name]
        b_err = max(b_err, ((b[0].double() - r.double()).abs().max() / r.double().abs().max().clamp_min(1)).item())
    return {"param_err": p_err, "buffer_err": b_err}


def _compiled_vs_eager(comm, **kw):
    """A compiled GPT-2 run against the eager one, with dynamo's counters of the compiled run: dynamo's side
    (``helpers.CHEAP_COMPILE``; inductor on gloo: ``test_distributed.py``'s compiled cases, ``test_compiled_memory.py``'s
    transformers GPT-2)."""
    data = um.token_batches(STEPS, comm.world_size * 2)
    opt = fzero.sgd(lr=0.1, momentum=0.9)
    torch._dynamo.reset()
    counters.clear()
    compiled, lc = _train(um.gpt2(), comm, data, compile=CHEAP_COMPILE, opt=opt, **kw)
    graphs = counters["stats"]["unique_graphs"]
    breaks = sum(counters["graph_break"].values())
    recompiles = sum(counters["recompiles"].values())
    eager, le = _train(um.gpt2(), comm, data, opt=opt, **kw)
    err = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(compiled.shard.master, eager.shard.master))
    return {"graphs": graphs, "breaks": breaks, "recompiles": recompiles, "err": err, "lc": lc, "le": le}


def case_stage3_lora_llama(comm):
    """peft LoRA on a Llama at stage 3 (its decoder layers the units: base weights frozen inside them)."""
    return _dropout_vs_simulated(comm, build=lambda: um.lora("llama"), stage=3)


def case_compiled_gpt2(comm):
    return _compiled_vs_eager(comm)


def _gpt2_block():
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    return GPT2Block


def case_stage3_dropout_gpt2(comm):
    """Stage 3 with GPT-2 blocks as units on gloo, against the simulated world (bitwise)."""
    return _dropout_vs_simulated(comm, stage=3, units=(_gpt2_block(),))


def case_stage3_compiled_gpt2(comm):
    return _compiled_vs_eager(comm, stage=3, units=(_gpt2_block(),))


def case_stage3_vs_fsdp2_gpt2(comm):
    """FSDP2 (fully_shard on every GPT-2 block and on the root, which holds the tied embedding)
    with torch's SGD (momentum) against fzero stage 3 with the blocks as units, in float64.
    Relative error per parameter."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    data = um.token_batches(STEPS, comm.world_size * 2)
    model = um.gpt2().double()
    mesh = init_device_mesh("cpu", (comm.world_size,))
    ref = copy.deepcopy(model)
    for block in ref.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(ref, mesh=mesh)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for batch in data:
        x, y = comm.split_batch(batch)
        opt.zero_grad()
        um.lm_criterion(ref(x[0]).logits, y[0]).backward()
        opt.step()
    state, _ = _train(model, comm, data, opt=fzero.sgd(lr=0.1, momentum=0.9), stage=3,
                      units=(_gpt2_block(),))
    mine = {k: v[0] for k, v in fzero.full_params(state.shard, comm).items()}
    return {n: ((mine[n] - p.full_tensor()).abs().max() / p.full_tensor().abs().max()).item()
            for n, p in ref.named_parameters()}


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}

if __name__ == "__main__":
    worker_main(lambda name, comm: CASES[name](comm), sys.argv[1:])
