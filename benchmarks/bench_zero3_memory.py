"""Parameters held per rank by stage: what stays between steps and the peak gathered during a step.

    python benchmarks/bench_zero3_memory.py [--layers 12] [--width 512] [--world 4]

An MLP of ``--layers`` blocks (Linear + GELU) of ``--width``, trained one step
on a simulated world of ``--world`` ranks. For each stage it measures, per
rank, with :class:`fzero.testing.GatherTracker` (which follows every
all-gathered buffer until its last reference dies):

* bytes of gathered (full) parameters held between steps, and
* the peak of gathered parameter bytes alive at any moment during the step,

next to the whole model's parameter bytes, one unit's bytes, and the memory
report (training state per rank) for the three stages.
"""

from __future__ import annotations

import argparse

import torch

import fzero
from fzero.testing import GatherTracker


def build(layers: int, width: int) -> torch.nn.Sequential:
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU()) for _ in range(layers)]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(width, 8))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--world", type=int, default=4)
    args = ap.parse_args()
    mse = torch.nn.functional.mse_loss
    model = build(args.layers, args.width)
    units = lambda name, m: "." not in name  # noqa: E731 - a shard unit per child
    mib = 2.0**20
    psi = sum(p.numel() for p in model.parameters())
    print(f"model: {args.layers} blocks of width {args.width} + head, {psi:,} parameters "
          f"({psi * 4 / mib:.1f} MiB fp32); {sum(1 for _ in model.children())} children; SimulatedWorld({args.world})\n")
    print(f"{'stage':>5} {'held between steps':>20} {'peak gathered in step':>22} {'peak / model':>13} {'peak / unit':>12}")
    for stage in (1, 2, 3):
        tracker = GatherTracker(fzero.SimulatedWorld(args.world))
        state = fzero.init_train_state(model, fzero.adamw(), tracker, stage=stage, units=units)
        step = fzero.make_train_step(fzero.module_loss(model, mse), tracker)
        x = torch.randn(args.world * 8, args.width)
        batch = tracker.split_batch((x, torch.randn(args.world * 8, 8)))
        held = tracker.live_bytes
        tracker.reset_peak()
        state, _ = step(state, batch)
        unit = max(
            sum(g.padded_numel * 4 for g in state.layout.groups if g.bucket == b)
            for b in range(1, len(state.module.units) + 1)
        )
        model_bytes = state.layout.num_padded * 4
        print(f"{stage:>5} {held / mib:17.2f} MiB {tracker.peak_bytes / mib:19.2f} MiB "
              f"{tracker.peak_bytes / model_bytes:13.2f} {tracker.peak_bytes / unit:12.2f}")
        del state
    print("\n(stage 1-2 hold the full parameters between steps and gather the new ones while the old")
    print(" are still held; stage 3 holds none and gathers unit by unit, prefetching the next)\n")
    # a new model: the stage-3 state above took this one's parameters (to the meta device)
    layout = fzero.init_train_state(build(args.layers, args.width), fzero.adamw(), fzero.SimulatedWorld(args.world),
                                    stage=3, units=units).layout
    bf16 = fzero.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    reports = [fzero.memory_report(layout, fzero.adamw(), stage=s, precision=bf16) for s in (1, 2, 3)]
    print("training state per rank, bf16 compute and communication, AdamW:")
    print(fzero.memory.format_memory_table(reports))
    for r in reports:
        formula = fzero.memory.zero_paper_bytes(r.num_params, r.stage, r.world_size)
        print(f"  stage {r.stage}: report - padding = {(r.total - r.padding) / mib:.3f} MiB, "
              f"ZeRO paper formula = {formula / mib:.3f} MiB; the state holds {r.held_total / mib:.3f} MiB "
              f"between steps (the module's own parameters {r.module_params / mib:.3f} MiB more), "
              f"{r.transient_total / mib:.3f} MiB of the formula lives only inside a step")


if __name__ == "__main__":
    main()
