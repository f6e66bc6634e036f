"""Mixture of experts: what expert parallelism saves per rank, and what it sends.

Part 1, memory (no data, nothing allocated: the model is built on the meta device). A Mixtral-like causal LM
(``--hidden`` 768, 8 experts of ``--intermediate`` 1536, top-2, ``--layers`` 8, vocab 32000: about 0.3 B
parameters, three quarters of them experts) laid out on ``--world`` 8 ranks as plain sharded data parallelism (every
expert on every rank) and with expert parallelism EP = 2, 4, 8 (``fzero.moe.expert_parallel``, the experts on their
groups); ``fzero.memory_report`` per rank at stages 2 and 3 with bf16 compute and reduction, fp32 master and AdamW
moments: the state held between steps, and the expert part against its formula (16 bytes per expert parameter this
rank holds / (W / EP) at stage 3; at stage 2, 2 bytes per expert parameter held whole + 12 / (W / EP)).

Part 2, a measured step (``--steps`` 10): the tiny Mixtral of ``examples/train_moe.py`` at EP = 2 on a simulated world
of 4 (one process: the rows run in lockstep threads, one at a time) against the same model as plain data parallelism:
median step time, and the bytes a step sends by axis (``CountingCommunicator``: tokens on ``expert_parallel``, expert
gradients and parameters on ``experts``, the rest on the world).

    python benchmarks/bench_moe.py
    python benchmarks/bench_moe.py --world 16 --layers 16 --steps 20
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import fzero  # noqa: E402
import fzero.moe as moe  # noqa: E402
from fzero.comm import CountingCommunicator, SimulatedWorld  # noqa: E402
from fzero.sharding import shard_layout  # noqa: E402

MIB = 2.0**20
BF16 = fzero.MixedPrecision(torch.bfloat16, torch.bfloat16)


def meta_mixtral(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.intermediate,
                        num_hidden_layers=args.layers, num_attention_heads=12, num_key_value_heads=4,
                        num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=1024)
    with torch.device("meta"):
        return MixtralForCausalLM(cfg)


def memory_rows(args: argparse.Namespace) -> list[tuple]:
    """Per layout and stage: parameters, expert parameters this rank holds, the report's held state and its held
    state plus the step's gradients, and ZeRO's formula for the latter (padding aside)."""
    rows = []
    for ep in (None, 2, 4, 8):
        model = meta_mixtral(args)
        comm = SimulatedWorld(args.world, groups=moe.expert_groups(args.world, ep)) if ep else SimulatedWorld(args.world)
        experts = moe.expert_parallel(model, comm) if ep else None
        named = dict(model.named_parameters())
        mine = sum(p.numel() for n, p in named.items() if ".experts." in n)  # E / EP experts a block, or all E
        dense = sum(p.numel() for n, p in named.items() if ".experts." not in n)
        over = args.world // (ep or 1)  # the ranks an expert is sharded over
        for stage in (2, 3):
            layout = shard_layout(model, comm, optimizer=fzero.adamw(), shard_frozen=stage == 3,
                                  axis_of=(lambda p, e=experts: moe.EXPERTS if e(p) else "") if ep else None)
            rep = fzero.memory_report(layout, fzero.adamw(), stage=stage, precision=BF16)
            with_grads = sum(rep.held.values()) + rep.transient["grads"] + (rep.transient["params"] if stage == 3 else 0)
            sharded = mine / over + dense / args.world
            formula = 2 * (mine + dense) + 14 * sharded if stage == 2 else 16 * sharded
            rows.append((f"EP={ep}" if ep else "data parallel", stage, (mine * (ep or 1) + dense) / 1e6, mine / 1e6,
                         sum(rep.held.values()) / MIB, with_grads / MIB, formula / MIB))
    return rows


def measured(args: argparse.Namespace) -> list[tuple]:
    import train_moe
    from gpt import CharText

    text = CharText()
    out = []
    for ep in (2, None):
        inner = SimulatedWorld(4, groups=moe.expert_groups(4, ep)) if ep else SimulatedWorld(4)
        comm = CountingCommunicator(inner)
        model = train_moe.build(text.vocab, 32)
        groups = {moe.EXPERTS: moe.expert_parallel(model, comm)} if ep else None
        state = fzero.init_train_state(model, fzero.adamw(lr=3e-3), inner, stage=2, groups=groups)
        step = fzero.make_train_step(fzero.module_loss(model), comm, clip_norm=1.0)
        g = torch.Generator().manual_seed(1)
        times = []
        for k in range(args.steps + 2):
            x, _ = text.batch(8 * 4, 32, g)
            batch = inner.split_batch({"input_ids": x, "labels": x})
            comm.reset()
            t0 = time.perf_counter()
            state, metrics = step(state, batch)
            float(metrics["loss"])
            if k >= 2:
                times.append(time.perf_counter() - t0)
        by_axis = {axis: comm.totals(axis=axis)["bytes"] / 4 for axis in ("shard", moe.EXPERTS, moe.EXPERT_PARALLEL)}
        out.append((f"EP={ep}" if ep else "data parallel", 1e3 * statistics.median(times),
                    by_axis["shard"] / 1024, by_axis[moe.EXPERTS] / 1024, by_axis[moe.EXPERT_PARALLEL] / 1024))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print(f"## memory per rank, W={args.world}, bf16 compute and reduction, fp32 master and AdamW moments (MiB)\n")
    print("| layout | stage | params (M) | expert params a rank holds (M) | held | held + step's gradients | formula |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for layout, stage, total, mine, held, with_grads, formula in memory_rows(args):
        print(f"| {layout} | {stage} | {total:.1f} | {mine:.1f} | {held:.1f} | {with_grads:.1f} | {formula:.1f} |")
    print("\n## a step of the tiny Mixtral, simulated world of 4 (one process), stage 2\n")
    print("| layout | ms/step (median) | world KiB/rank | experts KiB/rank | tokens KiB/rank |")
    print("| --- | --- | --- | --- | --- |")
    for layout, ms, world, experts, tokens in measured(args):
        print(f"| {layout} | {ms:.1f} | {world:.1f} | {experts:.1f} | {tokens:.1f} |")


if __name__ == "__main__":
    main()
