"""Fine-tune a model with LoRA adapters (``peft``) under fzero's ZeRO stage 3.

A tiny Llama built from its config (no download) stands in for a pretrained model: its weights are
saved once as the "pretrained" base, then ``peft`` wraps its attention and MLP projections with
LoRA adapters and freezes the rest. fzero trains only the adapters (master copies, moments and
gradient reductions for them alone); the frozen base is sharded with its unit like the adapters
(each rank holds 1/W of it), in the compute dtype when ``--dtype bf16``
(``MixedPrecision(frozen_dtype=...)``). The task: predict each token's successor
in a cyclic sequence, which the adapters and a new head (peft ``modules_to_save``) learn on top of
the frozen base.

Half-way, the run saves a checkpoint *without* the frozen base (``save_checkpoint(frozen=False)``:
the base is already on disk as pretrained weights), builds the state again from the base, loads the
checkpoint into it and goes on; the resumed run equals the uninterrupted one bit for bit. At the end
the adapters alone are exported as ``peft`` saves them.

    python examples/finetune_lora.py                      # a simulated world of 2 ranks
    torchrun --nproc-per-node 2 examples/finetune_lora.py # real ranks on gloo
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

import fzero
import fzero.checkpoint
from fzero.dist import choose_comm

VOCAB, SEQ = 64, 16


def base_model() -> torch.nn.Module:
    """The "pretrained" model: a tiny Llama, the same weights on every rank."""
    from transformers import LlamaConfig, LlamaForCausalLM

    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                      attn_implementation="eager", use_cache=False)
    return LlamaForCausalLM(cfg).train()


def with_adapters(model: torch.nn.Module, base_weights: Path) -> torch.nn.Module:
    """``model`` given the saved base weights, then LoRA r=8 on every projection and a trainable copy of the head
    (peft freezes the rest)."""
    from peft import LoraConfig, get_peft_model

    model.load_state_dict(torch.load(base_weights, weights_only=True))
    torch.manual_seed(1)  # the adapters' own init, the same on every rank
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=targets,
                                            modules_to_save=["lm_head"]))  # a new head trains in full


def batches(n: int, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Cyclic sequences ``s, s+1, s+2, ...`` (mod VOCAB): each token's successor is the next."""
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(n):
        start = torch.randint(0, VOCAB, (size, 1), generator=g)
        ids = (start + torch.arange(SEQ + 1)) % VOCAB
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


@contextlib.contextmanager
def shared_dir(distributed: bool) -> Iterator[Path]:
    """A temporary directory every rank uses (rank 0's, named to the others), removed at the end."""
    if not distributed:
        with tempfile.TemporaryDirectory() as tmp:
            yield Path(tmp)
        return
    import torch.distributed as dist

    rank0 = tempfile.mkdtemp() if dist.get_rank() == 0 else None
    name = [rank0]
    dist.broadcast_object_list(name, src=0)
    try:
        yield Path(name[0])
    finally:
        dist.barrier()
        if rank0 is not None:
            shutil.rmtree(rank0, ignore_errors=True)


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--comm", choices=["auto", "sim", "torch"], default="auto")
    p.add_argument("--world-size", type=int, default=2, help="ranks of the simulated world")
    p.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto",
                   help="compute dtype, and the frozen base's (auto: bf16 where native, else fp32)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=16, help="global batch (all ranks)")
    args = p.parse_args(argv)
    try:
        args.comm = choose_comm(args.comm)
    except ValueError as e:
        p.error(str(e))
    if args.comm == "torch":
        import torch.distributed as dist

        from fzero.dist import TorchCommunicator

        dist.init_process_group("gloo")
        comm: fzero.Communicator = TorchCommunicator()
    else:
        comm = fzero.SimulatedWorld(args.world_size)
    lead = comm.ranks[0] == 0
    bf16 = args.dtype == "bf16" or (args.dtype == "auto" and fzero.precision.native_bf16()[0])
    dtype = torch.bfloat16 if bf16 else None
    precision = fzero.MixedPrecision(param_dtype=dtype, frozen_dtype=dtype)  # the base held once, as it computes
    data = batches(args.steps, args.batch)
    half = args.steps // 2

    with shared_dir(args.comm == "torch") as tmp:
        weights, ckpt = tmp / "base.pt", tmp / "ckpt"
        if lead:
            torch.save(base_model().state_dict(), weights)
        if args.comm == "torch":
            torch.distributed.barrier()  # the base is on disk before any rank reads it

        def fresh() -> tuple[fzero.TrainState, fzero.step.StepFn, torch.nn.Module]:
            model = with_adapters(base_model(), weights)
            state = fzero.init_train_state(model, fzero.adamw(lr=1e-2, weight_decay=0.0), comm, stage=3,
                                           precision=precision)
            return state, fzero.make_train_step(fzero.module_loss(model, lm_loss), comm), model

        state, step, model = fresh()
        if lead:
            lay = state.layout
            frozen = sum(f.numel() * f.element_size() for f in state.shard.frozen)
            print(f"fzero: {comm!r}, stage 3, {lay.num_params:,} trainable of "
                  f"{lay.num_params + sum(s.numel for s in lay.frozen_slots):,} parameters; "
                  f"frozen base held here {frozen / 2**20:.2f} MiB in {state.shard.frozen[0].dtype} "
                  f"({comm.local_ranks} of {comm.world_size} shards)")
        losses = []
        for i, batch in enumerate(data):
            if i == half:  # a checkpoint without the base, and a restart from the base plus the checkpoint
                fzero.save_checkpoint(state, ckpt, comm, frozen=False)
                going_on, _ = step(state, comm.split_batch(batch))
                state, step, model = fresh()
                state, _ = fzero.load_checkpoint(ckpt, state, comm)
            state, m = step(state, comm.split_batch(batch))
            if i == half:
                resumed_bitwise = all(torch.equal(a, b) for a, b in zip(going_on.shard.master, state.shard.master))
            losses.append(m["loss"].item())
            if lead and (i % 10 == 0 or i == args.steps - 1):
                print(f"step {i:3d}  loss {losses[-1]:.4f}")

        fzero.write_back(state, comm, model)  # the module gets the trained adapters
        from peft import get_peft_model_state_dict

        adapters = get_peft_model_state_dict(model)
    if lead:
        print(f"resumed from the checkpoint without the base: bitwise equal to going on: {resumed_bitwise}; "
              f"adapters exported: {len(adapters)} tensors, {sum(t.numel() for t in adapters.values()):,} elements")
    return {"first_loss": losses[0], "last_loss": losses[-1], "resumed_bitwise": resumed_bitwise,
            "adapters": len(adapters)}


if __name__ == "__main__":
    main()
