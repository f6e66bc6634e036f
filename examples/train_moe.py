"""A tiny Mixtral (``transformers``, built from its config: 4 experts, top-2, its load-balancing loss on) trained on
the main job's character text with expert parallelism: EP = 2 on 4 ranks, each rank holding 2 of every layer's 4
experts (``fzero.moe.expert_parallel``), tokens sent to their experts' ranks by all-to-all, the experts' parameters
sharded over the 2 ranks that hold the same ones and the rest over all 4 (``init_train_state(groups=)``). Then the
same run as plain sharded data parallelism (every expert on every rank), from the same weights and batches: the two
loss curves are one (the same numbers up to float32 rounding), and the expert-parallel ranks hold half the experts.

    python examples/train_moe.py                       # 200 steps each on a simulated world of 4: a few minutes
    python examples/train_moe.py --steps 50 --stage 3 --ep 4
    torchrun --nproc-per-node 4 examples/train_moe.py --comm torch

Prints the final losses of both runs and each run's held training state per rank (``memory_report``), and plots both
loss curves together (``runs/train_moe.png``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fzero  # noqa: E402
import fzero.moe as moe  # noqa: E402
from fzero.dist import choose_comm  # noqa: E402
from gpt import CharText  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--world-size", type=int, default=4, help="simulated ranks (--comm sim)")
    p.add_argument("--ep", type=int, default=2, help="expert-parallel degree: ranks that together hold every expert")
    p.add_argument("--stage", type=int, default=2, choices=[1, 2, 3])
    p.add_argument("--batch", type=int, default=8, help="sequences per rank")
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--comm", default="auto", choices=["auto", "sim", "torch"])
    p.add_argument("--out", default="runs", help="directory for the plot")
    return p.parse_args(argv)


def build(vocab: int, context: int) -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=context, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                        attn_implementation="eager", experts_implementation="eager", output_router_logits=True,
                        router_aux_loss_coef=0.02, use_cache=False)
    model = MixtralForCausalLM(cfg).train()
    model.config.use_cache = False
    return model


def train(args: argparse.Namespace, comm: fzero.Communicator, expert_parallel: bool, talk: bool = True) -> dict:
    text = CharText()
    model = build(text.vocab, args.context)
    groups = {moe.EXPERTS: moe.expert_parallel(model, comm)} if expert_parallel else None
    state = fzero.init_train_state(model, fzero.adamw(lr=args.lr, weight_decay=0.01), comm, stage=args.stage,
                                   groups=groups)
    step = fzero.make_train_step(fzero.module_loss(model), comm, clip_norm=1.0)
    report = fzero.memory_report(state.layout, state.opt.optimizer, stage=args.stage, comm=comm)
    g = torch.Generator().manual_seed(1)
    losses = []
    for k in range(args.steps):
        x, y = text.batch(args.batch * comm.data_world_size, args.context, g)
        state, metrics = step(state, comm.split_batch({"input_ids": x, "labels": x}))
        losses.append(float(metrics["loss"]))
        if talk and (k % 50 == 0 or k == args.steps - 1):
            print(f"{'expert parallel' if expert_parallel else 'data parallel':>15} step {k:4d} loss {losses[-1]:.4f}",
                  flush=True)
    held = sum(report.held.values())
    return {"losses": losses, "held_bytes": held, "state": state}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    kind = choose_comm(args.comm)
    talk = True  # rank 0 prints under torchrun
    if kind == "sim":
        groups = moe.expert_groups(args.world_size, args.ep)
        ep_comm, dp_comm = fzero.SimulatedWorld(args.world_size, groups=groups), fzero.SimulatedWorld(args.world_size)
    else:
        import torch.distributed as dist

        from fzero.dist import TorchCommunicator, start_process_group

        start_process_group("gloo")
        world, talk = dist.get_world_size(), dist.get_rank() == 0
        ep_comm, dp_comm = TorchCommunicator(groups=moe.expert_groups(world, args.ep)), TorchCommunicator()
    ep = train(args, ep_comm, expert_parallel=True, talk=talk)
    dp = train(args, dp_comm, expert_parallel=False, talk=talk)
    tail = lambda run: sum(run["losses"][-10:]) / len(run["losses"][-10:])  # noqa: E731
    out = {"expert_parallel": ep["losses"], "data_parallel": dp["losses"], "first_loss": ep["losses"][0],
           "last_loss": tail(ep), "data_parallel_last_loss": tail(dp),
           "max_difference": max(abs(a - b) for a, b in zip(ep["losses"], dp["losses"])),
           "held_bytes": (ep["held_bytes"], dp["held_bytes"]), "plot": None}
    if not talk:
        return out
    print(f"done: loss {out['first_loss']:.4f} -> {out['last_loss']:.4f} (expert parallel, EP={args.ep}), "
          f"{out['data_parallel_last_loss']:.4f} (data parallel); largest difference between the curves "
          f"{out['max_difference']:.2e}")
    print(f"held training state per rank (memory_report): {ep['held_bytes'] / 2**20:.2f} MiB expert parallel, "
          f"{dp['held_bytes'] / 2**20:.2f} MiB data parallel")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return out
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(range(1, len(dp["losses"]) + 1), dp["losses"], lw=3, alpha=0.4, label="data parallel (every expert)")
    ax.plot(range(1, len(ep["losses"]) + 1), ep["losses"], lw=1, label=f"expert parallel, EP={args.ep}")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (with the load-balancing term)")
    ax.set_title(f"tiny Mixtral, 4 ranks, stage {args.stage}: expert parallel vs data parallel")
    ax.legend()
    path = Path(args.out) / "train_moe.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    out["plot"] = str(path)
    print(f"plot: {path}")
    return out


if __name__ == "__main__":
    main()
