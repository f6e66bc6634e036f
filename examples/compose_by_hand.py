"""The pieces of a ZeRO stage-2 mixed-precision step, composed by hand.

    python examples/compose_by_hand.py

What ``fzero.make_train_step`` does, written out: gather bf16 parameters,
per-rank forward/backward of the scaled loss, reduce-scatter to fp32 shards,
unscale and agree on overflow, optimizer step on the fp32 master shard (skipped
by selection on overflow), loss-scale update.
"""

from __future__ import annotations

import torch
from torch.func import functional_call, grad

import fzero


def main(steps: int = 60) -> list[float]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    comm = fzero.SimulatedWorld(4)

    shard = fzero.init_shard(model, comm, alignment=16)
    opt_state = fzero.init_opt_state(fzero.adam(lr=1e-2), shard.master)
    scaler = fzero.init_scaler(init_scale=2.0**12, growth_interval=20)
    true_w = torch.randn(8, 1)

    losses = []
    for i in range(steps):
        x = torch.randn(4 * 16, 8)
        y = x @ true_w + 0.01 * torch.randn(4 * 16, 1)
        xs, ys = comm.split_batch((x, y))                               # [R, 16, ...]

        params = fzero.all_gather_params(shard, comm, torch.bfloat16)   # all_gather, bf16
        def scaled_loss(p, xb, yb):
            out = functional_call(model, p, (xb.bfloat16(),)).float()
            return fzero.scale(scaler, torch.nn.functional.mse_loss(out, yb))
        grads = {k: [] for k in params}
        for r in range(comm.local_ranks):                               # each rank's backward
            g = grad(scaled_loss)({k: v[r] for k, v in params.items()}, xs[r], ys[r])
            for k in grads:
                grads[k].append(g[k])
        grads = {k: torch.stack(v) for k, v in grads.items()}           # [R, *shape], bf16

        g_shards = fzero.reduce_scatter_grads(shard, grads, comm)       # reduce_scatter -> fp32
        g_shards, found_inf = fzero.unscale_and_check(scaler, g_shards, comm)  # all_reduce(max)
        shard, opt_state = fzero.shard_step(shard, opt_state, g_shards, found_inf)
        scaler = fzero.update_scale(scaler, found_inf)

        with torch.no_grad():
            full = {k: v[0] for k, v in fzero.all_gather_params(shard, comm).items()}
            losses.append(torch.nn.functional.mse_loss(functional_call(model, full, (x,)), y).item())
        if i % 10 == 0 or i == steps - 1:
            print(f"step {i:3d}  loss {losses[-1]:.5f}  scale {scaler.scale.item():g}  skipped {found_inf.item():g}")
    return losses


if __name__ == "__main__":
    main()
