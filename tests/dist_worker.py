"""Worker run by torchrun in the multi-process tests: runs named cases, saves per-case results.

Usage: dist_worker.py OUT_DIR CASE [CASE ...], where a CASE may be ``name=arg,arg`` (its
results are saved under that whole string). A case that raises records the
error text instead of a result, so one failure does not hide the others.
"""

from __future__ import annotations

import copy
import sys

import torch

import dist_cases as cases
import fzero
from fzero.dist import TorchCommunicator
from helpers import CHEAP_COMPILE, batches, mlp

mse = torch.nn.functional.mse_loss


def _my_chunk(batch, comm):
    x, y = comm.split_batch(batch)
    return x[0], y[0]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _fzero_full_params(state, comm) -> dict:
    return {k: v[0] for k, v in fzero.full_params(state.shard, comm).items()}


def case_ddp_adamw(comm):
    steps = 20
    model = mlp(torch.float32)
    ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.1)
    for batch in batches(steps, comm.world_size, 2, torch.float32):
        x, y = _my_chunk(batch, comm)
        opt.zero_grad()
        mse(ddp(x), y).backward()
        opt.step()
    state, _, _ = cases.train(comm, steps=steps, stage=2, optimizer=fzero.adamw(lr=1e-2, weight_decay=0.1))
    mine = _fzero_full_params(state, comm)
    return {n: _rel(mine[n], p.detach()) for n, p in ddp.module.named_parameters()}


def _zero(comm, torch_cls, torch_kw, ours):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    steps = 20
    ddp = torch.nn.parallel.DistributedDataParallel(mlp(torch.float32))
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch_cls, **torch_kw)
    for batch in batches(steps, comm.world_size, 2, torch.float32):
        x, y = _my_chunk(batch, comm)
        opt.zero_grad()
        mse(ddp(x), y).backward()
        opt.step()
    state, _, _ = cases.train(comm, steps=steps, stage=1, optimizer=ours)
    mine = _fzero_full_params(state, comm)
    return {n: _rel(mine[n], p.detach()) for n, p in ddp.module.named_parameters()}


def case_zero_sgd(comm):
    return _zero(comm, torch.optim.SGD, dict(lr=0.05, momentum=0.9), fzero.sgd(lr=0.05, momentum=0.9))


def case_zero_adam(comm):
    return _zero(comm, torch.optim.Adam, dict(lr=1e-2), fzero.adam(lr=1e-2))


def _fsdp_mlp(comm, **shard_kw):
    """The test MLP under FSDP2: every Linear and the root wrapped with fully_shard."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (comm.world_size,))
    model = mlp(torch.float32)
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh, **shard_kw)
    fully_shard(model, mesh=mesh, **shard_kw)
    return model


def case_fsdp(comm):
    """FSDP2 (fully_shard) on CPU/gloo with torch.amp.GradScaler vs fzero stage 2 with a dynamic scaler."""
    steps = 20
    kw = dict(init_scale=2.0**8, growth_interval=4)
    model = _fsdp_mlp(comm)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gs = torch.amp.GradScaler("cpu", **kw)
    scales = []
    for batch in batches(steps, comm.world_size, 2, torch.float32):
        x, y = _my_chunk(batch, comm)
        opt.zero_grad()
        gs.scale(mse(model(x), y)).backward()
        gs.step(opt)
        gs.update()
        scales.append(gs.get_scale())
    state, hist, _ = cases.train(comm, steps=steps, stage=2, optimizer=fzero.adamw(lr=1e-2), scaler=fzero.init_scaler(**kw))
    mine = _fzero_full_params(state, comm)
    errs = {n: _rel(mine[n], p.full_tensor().detach()) for n, p in model.named_parameters()}
    return {"errors": errs, "torch_scales": scales, "fzero_scales": [h["scale"] for h in hist]}


def case_fsdp_full_vs_stage3(comm):
    """FSDP2 full sharding (fully_shard, reshard after forward) vs fzero stage 3, 20 steps."""
    steps = 20
    model = _fsdp_mlp(comm, reshard_after_forward=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for batch in batches(steps, comm.world_size, 2, torch.float32):
        x, y = _my_chunk(batch, comm)
        opt.zero_grad()
        mse(model(x), y).backward()
        opt.step()
    state, _, _ = cases.train(comm, steps=steps, stage=3, optimizer=fzero.adamw(lr=1e-2))
    mine = _fzero_full_params(state, comm)
    return {n: _rel(mine[n], p.full_tensor().detach()) for n, p in model.named_parameters()}


def case_eager_s3(comm):
    return _sim_compare(comm, stage=3)


def case_eager_s3_pooled(comm):
    return cases.pooled_stage3(comm)


def case_gather_ways(comm):
    return cases.gather_ways(comm)


def case_compiled_s2_donating(comm):
    return _sim_compare(comm, stage=2, compiled=True, donate=True)


def case_compiled_s3(comm):
    return _compiled_compare(comm, stage=3)


def _sim_compare(comm, **kw):
    state, hist, changed = cases.train(comm, **kw)
    return {"masters": cases.masters(state), "history": hist, "changed": changed, "threads": torch.get_num_threads()}


def case_eager_s2(comm):
    return _sim_compare(comm, stage=2)


def case_torch_nadam(comm):
    return _sim_compare(comm, stage=2, optimizer=cases.torch_nadam())


def case_muon(comm):
    """Muon at stage 2; and how many matrices this rank orthogonalized (its owned ones)."""
    counts = cases.counting_newton_schulz()
    out = _sim_compare(comm, stage=2, optimizer=cases.muon())
    return {**out, "ns_calls": counts["calls"]}


def case_adafactor(comm):
    """Adafactor at stage 2 and stage 3 (the statistics and update norms all-reduced)."""
    s2 = _sim_compare(comm, stage=2, optimizer=cases.adafactor())
    s3 = _sim_compare(comm, stage=3, optimizer=cases.adafactor())
    return {**s2, "stage3": s3}


def case_eager_s1(comm):
    return _sim_compare(comm, stage=1)


def case_compiled_s1(comm):
    return _compiled_compare(comm, stage=1)


def case_compiled_s2(comm):
    return _compiled_compare(comm, stage=2)


def case_compiled_s2_cheap(comm):
    """Compiled by ``helpers.CHEAP_COMPILE``: dynamo's graph with gloo's traced operators (the rank-order all-reduce
    beyond 2 ranks), run by eager kernels; inductor's at 2 ranks: ``compiled_s2``."""
    return _compiled_compare(comm, stage=2, compiled=CHEAP_COMPILE)


def _compiled_compare(comm, stage, compiled=True):
    """The compiled run's results, with dynamo's graph, graph-break and recompile counts."""
    from torch._dynamo.utils import counters

    counters.clear()
    out = _sim_compare(comm, stage=stage, compiled=compiled)
    out["graph_breaks"] = sum(counters["graph_break"].values())
    out["unique_graphs"] = counters["stats"]["unique_graphs"]
    out["recompiles"] = sum(counters["recompiles"].values())
    return out


def case_inf_even(comm):
    scaler = fzero.init_scaler(2.0**10, growth_interval=1000)
    return _sim_compare(comm, steps=10, stage=2, scaler=scaler, poison=lambda i, r: r == 0 and i % 2 == 0)


def case_volume(comm):
    native = TorchCommunicator(reduce_scatter_via="reduce_scatter")
    return {
        "s1": cases.one_step_volume(comm, 1),
        "s2": cases.one_step_volume(comm, 2),
        "s2_native": cases.one_step_volume(native, 2),
        "s2_all_reduce": cases.one_step_volume(TorchCommunicator(reduce_scatter_via="all_reduce"), 2),
        "s2_bf16": cases.one_step_volume(
            native, 2, fzero.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        ),
    }


def case_reduce_scatter_ways(comm):
    """This rank's reduce-scatter of its row of ``cases.reduce_scatter_inputs``, computed each
    way ``TorchCommunicator`` can, started and waited (as buckets do) and at once."""
    from fzero.dist import REDUCE_SCATTER_PATHS

    out = {}
    for way in REDUCE_SCATTER_PATHS:
        c = TorchCommunicator(reduce_scatter_via=way)
        for dtype in (torch.float32, torch.bfloat16):
            x = cases.reduce_scatter_inputs(comm.world_size, dtype)[comm.rank : comm.rank + 1]
            for op in ("sum", "avg"):
                out[f"{way} {dtype} {op}"] = (c.reduce_scatter(x, op), c.reduce_scatter_start(x, op)())
    return out


def case_all_reduce_ways(comm):
    """This rank's all-reduce of its row of ``cases.reduce_scatter_inputs`` (an odd length: padded point to point),
    computed each way ``TorchCommunicator`` can, at once, started, and traced (a compiled graph: gloo's operator)."""
    from fzero.dist import ALL_REDUCE_PATHS

    out = {}
    for way in ALL_REDUCE_PATHS:
        c = TorchCommunicator(all_reduce_via=way)
        traced = c.tracing()
        for dtype in (torch.float64, torch.float32, torch.bfloat16):
            x = cases.reduce_scatter_inputs(comm.world_size, dtype)[comm.rank : comm.rank + 1, :-1]
            for op in ("sum", "avg", "max"):
                torch._dynamo.reset()
                compiled = torch.compile(lambda y, _op=op, _c=traced: _c.all_reduce(y, _op), fullgraph=True,
                                         backend="aot_eager")
                out[f"{way} {dtype} {op}"] = (c.all_reduce(x, op), c.all_reduce_start(x, op)(), compiled(x))
    return out


def case_stage3_calls(comm):
    return cases.stage3_c10d_calls(comm)


def case_mismatch(comm):
    return cases.mismatched_models(comm)


def case_padding_only(comm):
    return cases.padding_only_rank(comm)


def case_fp16_40000(comm):
    return cases.fp16_40000(comm)


def case_overlap(comm):
    # every way of reducing starts during backward
    native = TorchCommunicator(reduce_scatter_via="reduce_scatter")
    via_all_reduce = TorchCommunicator(reduce_scatter_via="all_reduce")
    return {"s1": cases.overlap_order(comm, 1), "s2": cases.overlap_order(comm, 2),
            "s2_native": cases.overlap_order(native, 2), "s2_all_reduce": cases.overlap_order(via_all_reduce, 2)}


def case_reduction_buffers(comm):
    out = {}
    for via in ("all_to_all", "reduce_scatter", "all_reduce"):
        c = TorchCommunicator(reduce_scatter_via=via)
        for stage in (1, 2):
            for precision in cases.REDUCTION_PRECISIONS:
                for two in (False, True):
                    out[f"{via} s{stage} {precision}{' 2 groups' if two else ''}"] = cases.reduction_buffers(
                        c, stage, precision, two)
    return out


def case_live_tensors(comm):
    return {f"s{stage}": cases.live_tensors(comm, stage) for stage in (1, 2, 3)}


MEMORY_KEYS = ("s1", "s2", "s3", "s1c", "s2c", "s3c")  # stage 1-3, eager; then compiled ("c")


def _by_key(run, comm, keys):
    """``run(comm, stage, compiled)`` for each key of ``MEMORY_KEYS`` asked for, in that order."""
    if unknown := set(keys) - set(MEMORY_KEYS):
        raise ValueError(f"unknown keys {sorted(unknown)}: not in {MEMORY_KEYS}")
    return {k: run(comm, int(k[1]), k.endswith("c")) for k in MEMORY_KEYS if k in keys}


def case_memory_growth(comm, *keys):
    return _by_key(cases.memory_growth, comm, keys or MEMORY_KEYS)


def case_branchy(comm):
    return {"s1": cases.branchy(comm, 1), "s2": cases.branchy(comm, 2)}


def case_stage3_memory_compiled(comm):
    return cases.stage3_step_memory(comm, compiled=True)


def case_stage3_gather_schedule(comm):
    return cases.stage3_gather_schedule(comm)


def case_compiled_reduction_census(comm, sizes, stage="2"):
    return cases.compiled_reduction_census(comm, tuple(int(n) for n in sizes.split("x")), int(stage))


def case_stage3_memory_eager(comm):
    return cases.stage3_step_memory(comm, compiled=False)


def case_unused(comm):
    """Unused parameters against DDP(find_unused_parameters=True) with torch.optim, stages 1-3,
    eagerly (a data-dependent branch) and compiled (a static branch; ``aux`` unused)."""
    import unused_cases as uc

    out = {}
    for opt in ("adamw", "sgd"):
        out[f"ddp_{opt}"] = uc.run_ddp(comm, opt)
        out[f"ddp_static_{opt}"] = uc.run_ddp(comm, opt, branch=True)
        for stage in (1, 2, 3):
            out[f"s{stage}_{opt}"] = uc.run_fzero(comm, opt, stage)
    for stage in (1, 2, 3):
        # inductor at stage 2 (the masked update, gloo's traced collectives); stages 1 and 3:
        # helpers.CHEAP_COMPILE (aot_eager in CI)
        how = True if stage == 2 else CHEAP_COMPILE
        out[f"s{stage}c_adamw"] = uc.run_fzero(comm, "adamw", stage, compile=how, branch=True)
    return out


if __name__ == "__main__":
    from dist_harness import worker_main

    def run_case(name, comm):
        # "case" or "case=a,b": the latter passes the arguments a and b (the keys of a case that
        # runs several configurations, so that two launches can share them)
        case, _, args = name.partition("=")
        return globals()[f"case_{case}"](comm, *(args.split(",") if args else ()))

    worker_main(run_case, sys.argv[1:])
