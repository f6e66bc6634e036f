"""A ZeRO training step composed by hand from fzero's pieces.

    python examples/compose_by_hand.py

``hand_step`` is what ``fzero.make_train_step`` runs, written out call by call, so it gives
bitwise the same numbers, eagerly and compiled, at every stage (``tests/test_compose_by_hand.py``
checks it). Read it as the transcript of one step of one rank:

* per micro-batch, ``loss_grads``: the forward, the loss ``scale``-d, backward, and each
  gradient bucket handed to ``reduce_scatter_grads`` as soon as backward completes it (at
  stage 3 each unit); stage 1 reduces once, at the last micro-batch, with the earlier ones'
  whole gradients added (``accumulate``); ``accumulate`` sums the micro-batches;
* ``unscale_and_check``: one ``all_reduce(sum)`` of (squared gradient norm, loss, which
  parameters had a gradient), then one pass that unscales and clips;
* ``shard_step``: AdamW on this rank's fp32 master shard, skipped by selection when a gradient
  was not finite; ``all_gather_params`` (stages 1-2): the new parameters in the compute dtype;
  ``update_scale``: the dynamic loss scale.

``fzero.bind_step`` gives the step its communicator and what it reuses between calls, and
compiles it with ``compile=True``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import fzero


def hand_step(loss_fn: Any, comm: fzero.Communicator, *, clip_norm: float | None = None, accum_steps: int = 1,
              compile: Any = False) -> Callable:
    """``make_train_step(loss_fn, comm, clip_norm=..., accum_steps=..., compile=...)``, by hand."""
    K = accum_steps

    def step(state, batch, comm, workspace):
        defer = state.stage == 1  # stage 1: every micro-batch local, one reduction at the last
        buffers_in = state.buffers  # what a skipped step keeps
        total = None
        for k in range(K):
            earlier = total.grads if defer and total is not None else None

            # (reduce and scaled run inside this iteration; state's shard, stage, precision and scaler are the same
            # in every micro-batch's: only its buffers and generators change)
            def reduce(grads, earlier=earlier):  # each bucket, as backward completes it
                return fzero.reduce_scatter_grads(state.shard, fzero.accumulate(earlier, grads), comm,  # noqa: B023
                                                  via_all_reduce=state.stage == 1,  # noqa: B023
                                                  reduce_dtype=state.precision.reduce_dtype)  # noqa: B023

            g = fzero.loss_grads(loss_fn, state, fzero.micro_batch(batch, k, K), comm, workspace,
                                 scaled=lambda loss: fzero.scale(state.scaler, loss),  # noqa: B023
                                 on_ready=reduce if k == K - 1 or not defer else None)
            state = state.replace(buffers=g.buffers, rng=g.rng)  # BatchNorm statistics, generators
            total = fzero.accumulate(total, g)
        workspace.clear()
        grads, losses = (total.grads, total.losses) if K == 1 else (tuple(s / K for s in total.grads), total.losses / K)
        checked = fzero.unscale_and_check(state.scaler, grads, comm, clip_norm=clip_norm, losses=losses,
                                          used=total.used, in_place=True)
        used = None if total.every else checked.used
        shard, opt = fzero.shard_step(state.shard, state.opt, checked.grads, checked.found_inf, used=used, comm=comm)
        params = fzero.all_gather_params(shard, comm, state.precision.param_dtype) if state.params else ()
        skip = checked.found_inf.to(torch.bool)
        buffers = tuple(torch.where(skip, old, new) for old, new in zip(buffers_in, state.buffers))
        new_state = state.replace(shard=shard, opt=opt, params=params, buffers=buffers,
                                  scaler=fzero.update_scale(state.scaler, checked.found_inf),
                                  calls=tuple(c + 1 for c in state.calls))
        metrics = {"loss": checked.loss, "found_inf": checked.found_inf.double(), "scale": state.scaler.scale.double(),
                   "grad_norm": checked.grad_norm, "lr": state.opt.hyper[0]["lr"].to(torch.float64, copy=True)}
        return new_state, metrics

    return fzero.bind_step(step, loss_fn, comm, accum_steps=K, compile=compile)


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
