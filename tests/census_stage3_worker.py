"""torchrun worker: one eager stage-3 step under the census on each real rank, against
``memory_report``'s prediction. USAGE census_stage3_worker.py OUT_DIR CASE...

Cases: ``mlp fp32``, ``mlp bf16``, ``mlp bf16 compute`` (an MLP whose units hold 16640,
65792 and 4128 elements around a 512-element root; bf16 compute and reduction: a unit's
reduction and a gather travel joined; bf16 compute and an fp32 reduction: each alone in its
dtype) and ``gpt2`` (a tiny transformers
GPT-2 of five blocks, its default units). Each gives, per scope and for both together, the
census's peak, the prediction, and the bytes whose free the census did not see (a buffer
whose last reference gloo's worker thread dropped: live in the census to the end).
"""

from __future__ import annotations

import sys

import torch

import fzero
from dist_harness import worker_main
from fzero.scopes import GATHER, GRAD_REDUCTION
from fzero.testing import Census
from helpers import mlp

SCOPES = (GATHER, GRAD_REDUCTION)


def _model(name: str, world: int):
    """(model, loss, batch of the whole world, units, precision) of a case."""
    if name.startswith("mlp"):
        model = mlp(sizes=(64, 256, 256, 16))
        torch.manual_seed(1)
        batch = (torch.randn(4 * world, 64), torch.randn(4 * world, 16))
        precision = {"mlp fp32": fzero.MixedPrecision(),
                     "mlp bf16": fzero.MixedPrecision(torch.bfloat16, torch.bfloat16),
                     "mlp bf16 compute": fzero.MixedPrecision(torch.bfloat16)}[name]
        loss = fzero.module_loss(model, torch.nn.functional.mse_loss)
        return model, loss, batch, (lambda n, m: n in ("0", "3", "5")), precision
    from transformers import GPT2Config, GPT2LMHeadModel

    import user_models as um

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(
        vocab_size=um.VOCAB, n_positions=um.SEQ, n_embd=16, n_layer=5, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, attn_implementation="eager",
        use_cache=False)).train()
    return model, fzero.module_loss(model, um.lm_criterion), um.token_batches(1, 2 * world)[0], None, \
        fzero.MixedPrecision()


def run_case(name: str, comm: fzero.Communicator) -> dict:
    model, loss, batch, units, precision = _model(name, comm.world_size)
    state = fzero.init_train_state(model, fzero.adamw(), comm, stage=3, units=units, precision=precision)
    step = fzero.make_train_step(loss, comm, stage=3)
    batch = comm.split_batch(batch)
    state, _ = step(state, batch)  # warm-up: lazily built pieces
    with Census() as census:
        state, _ = step(state, batch)
    rep = fzero.memory_report(state.layout, state.opt.optimizer, stage=3, comm=comm, precision=state.precision)
    unseen = {k: census.unseen_bytes(k) for k in SCOPES}
    return {
        "census": {**{k: census.scope_peaks.get(k, 0) for k in SCOPES}, "together": census.joint_peak(SCOPES),
                   "seen": census.joint_peak(SCOPES, seen_only=True)},
        "predicted": {**{k: rep.step_buffers.get(k) for k in SCOPES}, "together": rep.step_peak},
        "unseen": {**unseen, "together": sum(unseen.values())},
    }


if __name__ == "__main__":
    worker_main(run_case, sys.argv[1:])
