"""Train a small classifier with fzero's ZeRO step.

On a simulated world of N ranks in this process (default, 2 ranks):

    python examples/train.py --world-size 2 --stage 2

On real processes with torch.distributed (gloo on CPU, NCCL on GPU):

    torchrun --nproc-per-node 2 examples/train.py

(``--comm auto``, the default, picks ``torch`` under a launcher; ``--comm sim`` under
torchrun is refused: every process would train its own simulated world.)

Every rank gets its own micro-batch of a synthetic spiral data set (3 classes);
the loss printed is the mean over ranks.
"""

from __future__ import annotations

import argparse
import math
import time
import warnings

import torch

import fzero
from fzero.dist import choose_comm

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def choose_dtype(requested: str) -> str:
    """``auto``: bf16 where the hardware computes it natively, else fp32 (as train_gpt.py).
    fp16 on a CPU warns: it runs slower than fp32 there."""
    if requested == "auto":
        return "bf16" if fzero.precision.native_bf16()[0] else "fp32"
    if requested == "fp16" and not torch.cuda.is_available():
        warnings.warn(FP16_ON_CPU, RuntimeWarning, stacklevel=2)
    return requested


FP16_ON_CPU = ("--dtype fp16 on a CPU: slower than fp32 (the main job measured 1.6x slower on a CPU "
               "with AVX512-FP16, and about 14x was reported on one without); fp16 with loss scaling "
               "is for GPUs: use --dtype auto (bf16 where native, else fp32)")


def spiral(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Three interleaved spirals in 2-D: a classic non-linear toy classification set."""
    labels = torch.randint(0, 3, (n,), generator=generator)
    t = torch.rand(n, generator=generator) * 3.0 + 0.3
    angle = t * 2.2 + labels * (2 * math.pi / 3)
    x = torch.stack([t * torch.cos(angle), t * torch.sin(angle)], dim=1)
    return x + 0.08 * torch.randn(n, 2, generator=generator), labels


def make_model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)  # every rank builds the same initial model
    return torch.nn.Sequential(
        torch.nn.Linear(2, width), torch.nn.GELU(),
        torch.nn.LayerNorm(width),
        torch.nn.Linear(width, width), torch.nn.GELU(),
        torch.nn.Linear(width, 3),
    )


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--comm", choices=["auto", "sim", "torch"], default="auto",
                   help="simulated world or torch.distributed (auto: torch under torchrun, else sim)")
    p.add_argument("--world-size", type=int, default=2, help="ranks of the simulated world")
    p.add_argument("--stage", type=int, choices=[1, 2, 3], default=2,
                   help="ZeRO stage (3: each Linear is a shard unit)")
    p.add_argument("--dtype", choices=["auto", *sorted(DTYPES)], default="auto",
                   help="compute dtype (master stays fp32); auto: bf16 where native, else fp32")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=256, help="global batch (all ranks)")
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--compile", action="store_true", help="torch.compile(fullgraph=True) the step")
    args = p.parse_args(argv)
    try:
        args.comm = choose_comm(args.comm)
    except ValueError as e:
        p.error(str(e))
    args.dtype = choose_dtype(args.dtype)

    if args.comm == "torch":
        import torch.distributed as dist

        from fzero.dist import TorchCommunicator

        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        comm: fzero.Communicator = TorchCommunicator()
    else:
        comm = fzero.SimulatedWorld(args.world_size)
    lead = comm.ranks[0] == 0

    model = make_model(args.width)
    optimizer = fzero.adamw(
        lr=args.lr, weight_decay=0.05, groups=[(fzero.optim.no_weight_decay_for(model), {"weight_decay": 0.0})]
    )
    precision = fzero.MixedPrecision(param_dtype=DTYPES[args.dtype])
    units = (torch.nn.Linear,) if args.stage == 3 else None
    state = fzero.init_train_state(model, optimizer, comm, precision=precision, stage=args.stage, units=units)
    step = fzero.make_train_step(
        fzero.module_loss(model, torch.nn.functional.cross_entropy), comm, clip_norm=1.0,
        compile=args.compile,
    )
    if lead:
        lay = state.layout
        print(
            f"fzero: {comm!r}, ZeRO stage {args.stage}, compute {args.dtype}, "
            f"{lay.num_params:,} parameters in {len(lay.groups)} flat groups "
            f"({lay.num_padded:,} padded, {lay.groups[0].shard_numel:,} per shard in group 0)"
        )

    global_batch = max(1, args.batch // comm.world_size) * comm.world_size  # equal micro-batches
    data = torch.Generator().manual_seed(1234)
    first = last = None
    t0 = time.perf_counter()
    for i in range(args.steps):
        batch = spiral(global_batch, data)
        state, m = step(state, comm.split_batch(batch))
        if i % 25 == 0 or i == args.steps - 1:
            loss = m["loss"].item()
            first = loss if first is None else first
            last = loss
            if lead:
                print(
                    f"step {i:4d}  loss {loss:.4f}  grad-norm {m['grad_norm'].item():.3f}  "
                    f"scale {m['scale'].item():g}  skipped {m['found_inf'].item():g}"
                )
    elapsed = time.perf_counter() - t0

    x, y = spiral(2048, torch.Generator().manual_seed(99))
    params = {k: v[0] for k, v in fzero.full_params(state.shard, comm).items()}
    with torch.no_grad():
        accuracy = (torch.func.functional_call(model, params, (x,)).argmax(1) == y).float().mean().item()
    if lead:
        print(
            f"done: loss {first:.4f} -> {last:.4f}, held-out accuracy {accuracy:.1%}, "
            f"{args.steps / elapsed:.1f} steps/s"
        )
    if args.comm == "torch":
        torch.distributed.destroy_process_group()
    return {"first_loss": first, "last_loss": last, "accuracy": accuracy}


if __name__ == "__main__":
    main()
