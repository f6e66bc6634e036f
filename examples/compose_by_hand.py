"""A ZeRO training step composed by hand from fzero's public pieces.

    python examples/compose_by_hand.py

``hand_step`` below is what ``fzero.make_train_step`` runs, written out call by call:
the same pieces in the same order, so it gives bitwise the same numbers, eagerly and
compiled, at every stage (``tests/test_compose_by_hand.py`` checks it). Read it as the
transcript of one step of one rank:

* ``loss_grads``: forward and backward of the scaled loss; eagerly each gradient bucket's
  ``reduce_scatter`` (stage 1: ``all_reduce``) starts as soon as backward completes it,
  and at stage 3 each unit's parameters are all-gathered inside its forward and backward;
* ``unscale_and_clip``: one ``all_reduce(sum)`` of (sum of squared gradient shards, loss,
  which parameters had a gradient), then one pass that unscales and clips;
* ``shard_step``: AdamW on this rank's fp32 master shard, skipped by selection when a
  gradient was not finite; ``update_scale``: the dynamic loss scale;
* ``all_gather_params`` (stages 1-2): the new parameters in the compute dtype.

The stage is the state's (``init_train_state(stage=...)``): stage 3 keeps no gathered
parameters, so the last gather is skipped, and stage 1 reduces once per step, after the
last micro-batch, instead of after each.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

import fzero
from fzero.compiled import Compile, compile_arguments, compiled_step
from fzero.grads import Workspace
from fzero.module import broadcast_buffers
from fzero.pytree import replace
from fzero.step import accumulate, micro_batch
from fzero.units import CompiledUnits


def hand_step(loss_fn: Any, comm: fzero.Communicator, *, clip_norm: Optional[float] = None,
              accum_steps: int = 1, compile: Compile = False) -> Callable:
    """``make_train_step(loss_fn, comm, clip_norm=..., accum_steps=..., compile=...)``,
    composed by hand."""
    K = accum_steps
    # reused from call to call: gradient bucket buffers; compiled stage 3 on one rank with one
    # micro-batch, the unit forwards that gather again in backward
    compiling = compile_arguments(compile) is not None  # True, or torch.compile's backend, mode, options
    regather = CompiledUnits(loss_fn.module) if compiling and comm.local_ranks * K == 1 else None
    workspace = Workspace(regather)

    def step(state: fzero.TrainState, batch: Any) -> tuple[fzero.TrainState, dict[str, torch.Tensor]]:
        defer = state.stage == 1  # stage 1: every micro-batch local, one reduction at the last
        buffers_in = state.buffers  # what a skipped step keeps
        total = None
        for k in range(K):
            last = k == K - 1
            state = replace(state, buffers=broadcast_buffers(state.buffers, comm))  # rank 0's buffers
            g = fzero.loss_grads(loss_fn, state, micro_batch(batch, k, K), comm, workspace=workspace,
                                 reduce=last or not defer,
                                 prior=total.grads if defer and last and total is not None else None,
                                 divide=K if defer and last else 1)
            state = replace(state, buffers=g.buffers, rng=g.rng)  # BatchNorm statistics, generators
            total = accumulate(total, g, reduced_total=defer and last)
        workspace.clear()
        shards, losses = total.grads, total.losses
        if K > 1:
            losses = losses / K
            if not defer:
                shards = tuple(s / K for s in shards)
        agreed = fzero.unscale_and_clip(state.scaler, shards, comm, losses=losses, clip_norm=clip_norm,
                                        used=total.used, in_place=True)
        shard, opt = fzero.shard_step(state.shard, state.opt, agreed.grads, agreed.found_inf,
                                      used=agreed.used, ranks=comm.ranks, comm=comm, uniform=total.every)
        params = fzero.all_gather_params(shard, comm, state.precision.param_dtype, flat=True) \
            if state.params else ()
        skip = agreed.found_inf.to(torch.bool)
        buffers = tuple(torch.where(skip, old, new) for old, new in zip(buffers_in, state.buffers))
        new_state = replace(state, shard=shard, opt=opt, params=params, buffers=buffers,
                            scaler=fzero.update_scale(state.scaler, agreed.found_inf),
                            calls=tuple(c + 1 for c in state.calls))
        metrics = {"loss": agreed.loss, "found_inf": agreed.found_inf, "scale": state.scaler.scale,
                   "grad_norm": agreed.grad_norm.float(), "lr": state.opt.hyper[0]["lr"].float()}
        return new_state, metrics

    return compiled_step(step, comm.local_ranks * K, workspace, compile) if compiling else step


def main(steps: int = 30, stage: int = 2) -> list[float]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.BatchNorm1d(32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 1))
    comm = fzero.SimulatedWorld(4)
    state = fzero.init_train_state(
        model, fzero.adamw(lr=1e-2), comm, stage=stage, units=(torch.nn.Linear,) if stage == 3 else None,
        scaler=fzero.init_scaler(init_scale=2.0**12, growth_interval=10),
    )
    step = hand_step(fzero.module_loss(model, torch.nn.functional.mse_loss), comm, clip_norm=1.0, accum_steps=2)
    true_w = torch.randn(8, 1)
    losses = []
    for i in range(steps):
        x = torch.randn(4 * 2 * 8, 8)
        y = x @ true_w + 0.01 * torch.randn(x.shape[0], 1)
        state, m = step(state, comm.split_batch((x, y), micro_batches=2))  # [R, K, 8, ...]
        losses.append(m["loss"].item())
        if i % 10 == 0 or i == steps - 1:
            print(f"step {i:3d}  loss {losses[-1]:.5f}  scale {m['scale'].item():g}  "
                  f"skipped {m['found_inf'].item():g}  grad norm {m['grad_norm'].item():.4f}")
    return losses


if __name__ == "__main__":
    main()
