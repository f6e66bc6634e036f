"""The main job: train a small character-level GPT with fzero's ZeRO step.

The text is English prose from the Python documentation, shipped in
``examples/data/`` (see its README). The model is an ``nn.Sequential`` of an
embedding, transformer blocks and a head (``examples/gpt.py``), so every ZeRO
stage runs it, stage 3 gathering one block at a time.

On a simulated world of N ranks in this process (default: 2 ranks, stage 2):

    python examples/train_gpt.py
    python examples/train_gpt.py --stage 3 --dtype fp16 --accum 2

On real processes with torch.distributed (gloo on CPU, NCCL on GPU):

    torchrun --nproc-per-node 2 examples/train_gpt.py
    torchrun --nproc-per-node 8 examples/train_gpt.py --device cuda   # one GPU per rank: cuda:LOCAL_RANK, NCCL

``--device auto`` (the default) trains on CUDA when torch sees a GPU, else on the CPU: the model
and every batch go to that device, the training state follows the model's, and under torchrun
each rank takes ``cuda:LOCAL_RANK`` (``torch.cuda.set_device``) and the process group is NCCL
(gloo with ``--device cpu``).

(``--comm auto``, the default, is ``torch`` under a launcher; ``--comm sim`` under
torchrun is refused: each process would train its own simulated world and write the
same files.)

Checkpoints: ``--ckpt DIR`` saves the run there when it ends (and every ``--save-every N``
steps, written in the background while the next steps run); ``--resume`` continues from the
latest one with the same options, and gives the run the uninterrupted one would have given,
bit for bit (the weights, the optimizer, each
rank's dropout generator and the data order are all saved):

    python examples/train_gpt.py --dropout 0.1 --ckpt runs/ckpt --save-every 100
    python examples/train_gpt.py --dropout 0.1 --ckpt runs/ckpt --resume

It prints a progress line (tokens/s, loss, learning rate, loss scale, skipped
steps, gradient norm), then the loss over the run, the training-state memory
per rank of ZeRO stages 1, 2 and 3 at this world size, the path of a plot
(loss, loss scale, gradient norm) and a text sampled from the trained model.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import sys
import time
import warnings
from pathlib import Path

import torch

import fzero
import fzero.checkpoint
import fzero.host_malloc
from fzero.dist import choose_comm
from fzero.schedules import warmup_cosine

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:  # gpt.py lies next to this script
    sys.path.insert(0, HERE)
from gpt import Block, CharText, GPTConfig, build_gpt, generate, make_criterion  # noqa: E402

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--comm", choices=["auto", "sim", "torch"], default="auto",
                   help="simulated world in this process, or torch.distributed under torchrun "
                        "(auto: torch when a launcher started this process, else sim)")
    p.add_argument("--world-size", type=int, default=0, help="ranks of the simulated world (default 2, or the mesh's)")
    p.add_argument("--mesh", type=lambda s: tuple(int(x) for x in s.split(",")), metavar="R,S",
                   help="HSDP: shard the state over groups of S ranks, replicated R times (R*S ranks)")
    p.add_argument("--hpz", action="store_true", help="with --mesh: ZeRO++ hpZ instead (shard over all ranks, stage 3 "
                   "regathers for backward within each group of S)")
    p.add_argument("--device", default="auto",
                   help="auto (cuda when torch sees a GPU, else cpu), cpu or cuda; under torchrun each rank takes "
                        "cuda:LOCAL_RANK and the process group is NCCL on CUDA, gloo on the CPU")
    p.add_argument("--stage", type=int, choices=[1, 2, 3], default=2, help="ZeRO stage")
    p.add_argument("--dtype", choices=["auto", *sorted(DTYPES)], default="auto",
                   help="compute dtype (the master copy stays fp32; fp16 uses dynamic loss scaling); "
                        "auto: bf16 where the hardware computes it natively, else fp32")
    p.add_argument("--accum", type=int, default=1, help="micro-batches accumulated per optimizer step")
    p.add_argument("--clip", type=float, default=1.0, help="clip the global gradient norm (0: off)")
    p.add_argument("--compile", action="store_true", help="torch.compile(fullgraph=True) the step")
    p.add_argument("--steps", type=int, default=400, help="optimizer steps")
    p.add_argument("--batch", type=int, default=32,
                   help="global batch per optimizer step, in sequences (all ranks and micro-batches)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (warm-up, then cosine)")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=64, help="characters per sequence")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads per process (0: torch's default)")
    p.add_argument("--out", default="runs", help="directory for the plot")
    p.add_argument("--sample-chars", type=int, default=400, help="characters to sample at the end (0: none)")
    p.add_argument("--seed", type=int, default=0,
                   help="model init, data order and each rank's dropout generator: one seed, one run")
    p.add_argument("--dropout", type=float, default=0.0, help="dropout on the residual branches")
    p.add_argument("--ckpt", metavar="DIR", help="checkpoint root: save there (every --save-every steps, "
                   "and when the run ends or stops); --resume continues from its latest checkpoint")
    p.add_argument("--save-every", type=int, default=0, metavar="N", help="save every N steps (0: only at the end)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run saved in --ckpt: the same steps, losses and weights as if uninterrupted")
    p.add_argument("--stop-at", type=int, default=0, metavar="STEP",
                   help="stop once STEP steps are done (saving a checkpoint), as a job with a time limit would")
    p.add_argument("--timeout", type=float, default=0, metavar="SECONDS",
                   help="--comm torch: a rank waits at most this long for a peer in a collective "
                        "(0: fzero.dist.DEFAULT_TIMEOUT, 10 minutes, in a step; torch's 30 minutes outside it)")
    p.add_argument("--qwz", action="store_true", help="ZeRO++ qwZ: parameter all-gathers as int8 (eager only)")
    p.add_argument("--qgz", type=int, choices=[4, 8], help="ZeRO++ qgZ: gradient reduce-scatters as int4 or int8")
    args = p.parse_args(argv)
    if (args.qwz or args.qgz or args.hpz) and args.compile:
        p.error("--qwz, --qgz and --hpz run eagerly: drop --compile")
    if args.hpz and not args.mesh:
        p.error("--hpz needs --mesh R,S (its groups of S ranks are the nodes)")
    if args.accum < 1 or args.steps < 1 or args.clip < 0:
        p.error("--accum and --steps must be >= 1 and --clip >= 0")
    if (args.resume or args.save_every) and not args.ckpt:
        p.error("--resume and --save-every need --ckpt DIR")
    if args.save_every < 0 or args.stop_at < 0 or args.timeout < 0 or not 0 <= args.dropout < 1:
        p.error("--save-every, --stop-at and --timeout must be >= 0, --dropout in [0, 1)")
    try:
        args.comm = choose_comm(args.comm)
    except ValueError as e:
        p.error(str(e))
    if args.device not in ("auto", "cpu", "cuda"):
        p.error(f"--device must be auto, cpu or cuda, got {args.device!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error(f"--device cuda: torch {torch.__version__} sees no CUDA device")
    return args


def choose_device(requested: str, comm: str) -> tuple[torch.device, str]:
    """The device to train on and why: ``auto`` is CUDA when torch sees a GPU, else the CPU; on CUDA a rank that
    torchrun started takes ``cuda:LOCAL_RANK`` (one GPU per rank), a simulated world the current GPU."""
    if requested == "auto":
        cuda = torch.cuda.is_available()
        why = "--device auto: " + ("torch sees a CUDA device" if cuda else "no CUDA device")
    else:
        cuda, why = requested == "cuda", "as requested (--device)"
    if not cuda:
        return torch.device("cpu"), why
    local = os.environ.get("LOCAL_RANK", "") if comm == "torch" else ""
    index = int(local) if local else torch.cuda.current_device()
    return torch.device("cuda", index), why + (f", LOCAL_RANK {local}" if local else "")


class Progress:
    """One status line, rewritten in place on a terminal; plain periodic lines otherwise."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled = total, enabled
        self.tty = enabled and sys.stdout.isatty()
        self.every = max(1, total // 20)

    def update(self, i: int, text: str) -> None:
        if not self.enabled:
            return
        line = f"step {i + 1:>{len(str(self.total))}}/{self.total}  {text}"
        if self.tty:
            print("\r" + line + "\033[K", end="", flush=True)
        elif i == 0 or (i + 1) % self.every == 0 or i + 1 == self.total:
            print(line, flush=True)

    def close(self) -> None:
        if self.tty:
            print()


def plot(history: dict[str, list[float]], path: Path, title: str, clip: float) -> Path | None:
    """Three panels: loss, loss scale (log), gradient norm; skipped steps marked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib): no plot")
        return None
    steps = list(range(1, len(history["loss"]) + 1))
    skipped = [s for s, f in zip(steps, history["found_inf"]) if f]
    fig, axes = plt.subplots(3, 1, figsize=(8, 8.5), sharex=True)
    ax = axes[0]
    ax.plot(steps, history["loss"], lw=0.8, alpha=0.5, label="loss (mean over ranks)")
    k = 10
    if len(steps) >= k:
        smooth = [sum(history["loss"][i - k + 1 : i + 1]) / k for i in range(k - 1, len(steps))]
        ax.plot(steps[k - 1 :], smooth, lw=1.8, label=f"moving average ({k} steps)")
    ax.axhline(math.log(history["vocab"]), color="grey", ls=":", lw=1, label="ln(vocab): uniform guess")
    ax.set_ylabel("loss (nats/char)")
    ax.legend(loc="lower left", fontsize=8)
    lr_ax = ax.twinx()
    lr_ax.plot(steps, history["lr"], color="tab:green", lw=0.8, alpha=0.6)
    lr_ax.set_ylabel("learning rate", color="tab:green", fontsize=8)
    lr_ax.tick_params(axis="y", labelcolor="tab:green", labelsize=7)
    ax = axes[1]
    ax.step(steps, history["scale"], where="post")
    ax.set_yscale("log")
    ax.set_ylabel("loss scale")
    if len(set(history["scale"])) == 1:
        ax.text(0.5, 0.6, "static scale: dynamic loss scaling is for --dtype fp16",
                transform=ax.transAxes, ha="center", fontsize=9, color="grey")
    if skipped:
        ys = [history["scale"][s - 1] for s in skipped]
        ax.plot(skipped, ys, "rx", label=f"skipped step (overflow): {len(skipped)}")
        ax.legend(loc="upper right", fontsize=8)
    ax = axes[2]
    ax.plot(steps, history["grad_norm"], lw=0.8)
    ax.set_yscale("log")
    if clip:
        ax.axhline(clip, color="grey", ls=":", lw=1, label=f"clip at {clip:g}")
        ax.legend(loc="upper right", fontsize=8)
    ax.set_ylabel("gradient norm\n(before clipping)")
    ax.set_xlabel("optimizer step")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


@torch.no_grad()
def held_out_loss(model, params, text: CharText, criterion, context: int, batches: int = 8) -> float:
    """The mean loss of ``params`` on ``batches`` fixed batches of the held-out text, on the parameters' device."""
    g = torch.Generator().manual_seed(4321)
    device = next(iter(params.values())).device
    losses = []
    for _ in range(batches):
        x, y = (t.to(device) for t in text.batch(32, context, g, split="val"))
        losses.append(criterion(torch.func.functional_call(model, params, (x,)), y).item())
    return sum(losses) / len(losses)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return run(args)
    finally:
        torch.set_num_threads(threads)  # main() may run inside another program (the tests)


FP16_ON_CPU = ("--dtype fp16 on a CPU: slower than fp32 (the main job measured 1.6x slower on a CPU "
               "with AVX512-FP16, and about 14x was reported on one without); fp16 with loss scaling "
               "is for GPUs: use --dtype auto (bf16 where native, else fp32)")


def choose_dtype(requested: str, device: torch.device | None = None) -> tuple[str, str]:
    """The compute dtype to use on ``device`` (default: CUDA if available, else the CPU) and why:
    ``auto`` picks bf16 where it is native (CUDA with bf16, a CPU with AVX512-BF16 or AMX) and fp32
    elsewhere, where bf16 is emulated and slower."""
    on_cpu = device.type == "cpu" if device is not None else not torch.cuda.is_available()
    if requested == "fp16" and on_cpu:
        warnings.warn(FP16_ON_CPU, RuntimeWarning, stacklevel=2)
    if requested != "auto":
        return requested, "as requested (--dtype)"
    native, why = fzero.precision.native_bf16() if device is None else fzero.precision.native_bf16(device)
    return ("bf16" if native else "fp32"), f"--dtype auto: {why}"


def run_config(args: argparse.Namespace, global_batch: int) -> dict:
    """What decides the run beyond the model and optimizer (which the checkpoint's manifest
    checks): a resumed run must be given the same, or it would not be the same run."""
    return {"steps": args.steps, "global_batch": global_batch, "lr": args.lr, "clip": args.clip,
            "accum": args.accum, "seed": args.seed, "dropout": args.dropout}


def resume(args: argparse.Namespace, state: fzero.TrainState, comm: fzero.Communicator, config: dict,
           data: torch.Generator, hist: dict) -> tuple[fzero.TrainState, int, int]:
    """The state, next step and skipped-step count of the run saved in ``args.ckpt``; the data
    generator and the history continue where it stopped."""
    state, extra = fzero.load_checkpoint(args.ckpt, state, comm, donate=True)
    if extra.get("config") != config:
        saved = extra.get("config", {})
        diff = next((k for k in config if saved.get(k) != config[k]), "config")
        raise SystemExit(f"--resume: the checkpoint in {args.ckpt} was saved by a run with {diff} = "
                         f"{saved.get(diff)!r}, this one has {config.get(diff)!r}: give the same options")
    data.set_state(extra["data_rng"])
    for k, v in extra["history"].items():
        hist[k] = list(v)
    return state, int(extra["next_step"]), int(extra["skipped"])


def save(args: argparse.Namespace, state: fzero.TrainState, comm: fzero.Communicator, config: dict,
         data: torch.Generator, hist: dict, done: int, skipped: int,
         blocking: bool = True) -> Path | fzero.checkpoint.BackgroundSave:
    """A checkpoint of the run after ``done`` steps: the state (generators included) and what
    the loop needs to continue exactly (data generator, next step, history). ``blocking=False``:
    written in the background (the handle returned), the training going on meanwhile."""
    history = {k: v for k, v in hist.items() if k != "vocab"}
    extra = {"config": config, "data_rng": data.get_state(), "next_step": done, "skipped": skipped,
             "history": history}
    return fzero.save_checkpoint(state, args.ckpt, comm, name=f"step-{done:08d}", extra=extra, blocking=blocking)


def params_digest(full: dict[str, torch.Tensor]) -> str:
    """SHA-256 of the trained fp32 parameters (names and bytes): equal digests, equal weights."""
    h = hashlib.sha256()
    for name in sorted(full):
        h.update(name.encode())
        h.update(full[name].detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def run(args: argparse.Namespace) -> dict:
    device, device_why = choose_device(args.device, args.comm)
    if args.comm == "torch":
        from fzero.dist import TorchCommunicator, start_process_group

        # NCCL on CUDA: cuda:LOCAL_RANK made current and the group bound to it; without --timeout torch's own bound
        start_process_group("nccl" if device.type == "cuda" else "gloo", timeout=args.timeout or float("inf"))
        comm: fzero.Communicator = TorchCommunicator(timeout=args.timeout or None, mesh=args.mesh, hpz=args.hpz)
    else:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        world_size = args.world_size or (args.mesh[0] * args.mesh[1] if args.mesh else 2)
        comm = fzero.SimulatedWorld(world_size, mesh=args.mesh, hpz=args.hpz, device=device)
    if args.qwz or args.qgz:
        from fzero.quantized import QuantizedCommunicator

        comm = QuantizedCommunicator(comm, weights=8 if args.qwz else None, grads=args.qgz)
    if device.type == "cpu":
        fzero.host_malloc.tune_host_allocator()  # a CPU training program's allocator setting (README)
    world, shards = comm.data_world_size, comm.world_size  # ranks, and the ranks one copy of the state is sharded over
    lead = comm.data_ranks[0] == 0
    say = print if lead else (lambda *a, **k: None)
    t_start = time.perf_counter()
    say(f"device: {device} ({device_why})")
    args.dtype, why = choose_dtype(args.dtype, device)
    say(f"compute dtype: {args.dtype} ({why})")

    text = CharText()
    cfg = GPTConfig(vocab=text.vocab, d_model=args.d_model, n_layers=args.layers,
                    n_heads=args.heads, context=args.context, dropout=args.dropout)
    # every rank builds the same initial model (drawn on the CPU), then moves it: the state follows its device
    model = build_gpt(cfg, seed=args.seed).to(device)
    criterion = make_criterion(cfg.vocab)
    optimizer = fzero.adamw(
        lr=args.lr, betas=(0.9, 0.99), weight_decay=0.1,
        groups=[(fzero.optim.no_weight_decay_for(model), {"weight_decay": 0.0})],
    )
    precision = fzero.MixedPrecision(param_dtype=DTYPES[args.dtype])
    state = fzero.init_train_state(model, optimizer, comm, stage=args.stage, precision=precision, seed=args.seed,
                                   units=(Block,))  # one stage-3 unit per block, at every stage: one layout
    warmup = min(50, args.steps // 5)
    step = fzero.make_train_step(
        fzero.module_loss(model, criterion), comm, clip_norm=args.clip or None, accum_steps=args.accum,
        schedules={"lr": warmup_cosine(peak=args.lr, warmup_steps=warmup, total_steps=args.steps,
                                       final=args.lr / 10, start=args.lr / max(warmup, 1))},
        compile=args.compile,
    )

    per_step = world * args.accum
    global_batch = max(1, args.batch // per_step) * per_step  # equal micro-batches everywhere
    lay = state.layout
    say(f"fzero main job: char-level GPT on {text.num_chars:,} characters of Python documentation "
        f"(vocab {text.vocab})")
    say(f"model: {len(model)} children (Embed, {cfg.n_layers} x Block, Head), d_model {cfg.d_model}, "
        f"{cfg.n_heads} heads, context {cfg.context}; {lay.num_params:,} parameters")
    say(f"world: {comm!r}, ZeRO stage {args.stage}, compute {args.dtype} (master fp32), "
        f"{lay.num_padded:,} padded elements in {len(lay.groups)} flat groups, "
        f"{sum(g.shard_numel for g in lay.groups):,} per rank's shard")
    say(f"batch: {global_batch} sequences x {cfg.context} chars per step = "
        f"{world} ranks x {args.accum} micro-batch(es) of {global_batch // per_step}; "
        f"AdamW lr {args.lr:g} (warm-up {warmup}, cosine to {args.lr / 10:g}), "
        f"clip {args.clip or 'off'}, compile {'on' if args.compile else 'off'}, "
        f"{torch.get_num_threads()} thread(s)")

    data = torch.Generator().manual_seed(1234 + args.seed)  # same global batches on every rank
    hist: dict[str, list] = {"loss": [], "scale": [], "grad_norm": [], "found_inf": [], "lr": [],
                             "vocab": text.vocab}
    config = run_config(args, global_batch)
    start, skipped = 0, 0
    if args.resume:
        state, start, skipped = resume(args, state, comm, config, data, hist)
        say(f"resumed from {fzero.checkpoint.resolve_checkpoint(args.ckpt)} at step {start}")
    end = min(args.steps, args.stop_at) if args.stop_at else args.steps
    bar = Progress(args.steps, lead)
    tokens_per_step = global_batch * cfg.context
    t0 = time.perf_counter()
    window = [(start, t0)]
    saved_at, pending = start, None
    logged = ("loss", "scale", "grad_norm", "found_inf", "lr")
    for i in range(start, end):
        batch = tuple(t.to(device) for t in text.batch(global_batch, cfg.context, data))
        state, m = step(state, comm.split_batch(batch, micro_batches=args.accum))
        # one host read for the five (each .item() on a GPU waits for the step); float64 holds each value exactly
        vals = dict(zip(logged, torch.stack([m[k].double() for k in logged]).tolist()))
        for k, v in vals.items():
            hist[k].append(v)
        skipped += int(vals["found_inf"])
        now = time.perf_counter()
        window = (window + [(i + 1, now)])[-21:]  # rate over the last 20 steps
        rate = (window[-1][0] - window[0][0]) * tokens_per_step / max(window[-1][1] - window[0][1], 1e-9)
        bar.update(i, f"{rate:7,.0f} tok/s  loss {vals['loss']:.3f}  lr {vals['lr']:.2e}  "
                      f"scale {vals['scale']:g}  skipped {skipped}  gnorm {vals['grad_norm']:.2f}")
        if args.ckpt and args.save_every and (i + 1) % args.save_every == 0:
            # the step waits only for a copy of the state: the files are written while the next steps run
            pending = save(args, state, comm, config, data, hist, i + 1, skipped, blocking=False)
            saved_at = i + 1
    bar.close()
    elapsed = time.perf_counter() - t0
    if pending is not None:
        pending.wait()  # the last periodic checkpoint is complete (or its failure raised) before the run goes on
    if args.ckpt and saved_at != end:
        path = save(args, state, comm, config, data, hist, end, skipped)
        say(f"checkpoint: {path}")
    if end < args.steps:
        say(f"stopped at step {end} of {args.steps} (--stop-at); continue with --resume")
        if args.comm == "torch":
            torch.distributed.destroy_process_group()
        return {"stopped_at": end, "losses": hist["loss"], "skipped": skipped}
    done = args.steps - start

    k = max(1, min(10, args.steps // 3))
    first = sum(hist["loss"][:k]) / k
    last = sum(hist["loss"][-k:]) / k
    say(f"\nloss {first:.3f} -> {last:.3f} (mean of the first and last {k} steps; "
        f"uniform guess ln {text.vocab} = {math.log(text.vocab):.3f}), {skipped} skipped steps, "
        f"{done} steps in {elapsed:.1f} s ({done * tokens_per_step / max(elapsed, 1e-9):,.0f} tok/s)")

    reports = [fzero.memory_report(lay, optimizer, stage=s, precision=precision, world_size=shards)
               for s in (1, 2, 3)]
    say(f"\ntraining-state memory per rank, {world} ranks (the state sharded over {shards}), compute {args.dtype}, "
        "AdamW "
        f"(this run: stage {args.stage}); held: kept between steps, in-step: only inside a step:")
    say(fzero.memory.format_memory_table(reports))

    # The full fp32 parameters, gathered from the shards (a collective: every rank joins).
    full = {name: p[0] for name, p in fzero.full_params(state.shard, comm).items()}
    result = {"first_loss": first, "last_loss": last, "skipped": skipped, "seconds": elapsed,
              "losses": hist["loss"], "plot": None, "sample": "", "params_sha256": params_digest(full)}
    say(f"trained parameters: sha256 {result['params_sha256']}")
    model.eval()  # no dropout from here: evaluation and sampling
    if lead:
        init = {n: p.detach().to(device) for n, p in build_gpt(cfg, seed=args.seed).named_parameters()}
        result["val_loss_start"] = held_out_loss(model, init, text, criterion, cfg.context)
        result["val_loss"] = held_out_loss(model, full, text, criterion, cfg.context)
        print(f"held-out loss (last 10% of the text): {result['val_loss_start']:.3f} at init -> "
              f"{result['val_loss']:.3f} trained")
        name = f"train_gpt_stage{args.stage}_{args.dtype}_w{world}.png"
        title = (f"char-level GPT, {lay.num_params:,} params, ZeRO stage {args.stage}, {world} ranks "
                 f"({args.comm}), {args.dtype}, accum {args.accum}")
        path = plot(hist, Path(args.out) / name, title, args.clip)
        if path is not None:
            result["plot"] = str(path)
            print(f"plot: {path}")
        if args.sample_chars:
            prompt = "The "
            # on the CPU: generate draws from a CPU generator, so every device samples the same text
            ids = generate(model, {k: v.cpu() for k, v in full.items()}, text.encode(prompt), args.sample_chars,
                           cfg.context, temperature=0.8, seed=args.seed)
            result["sample"] = prompt + text.decode(ids)
            print(f"\nsample (temperature 0.8, {args.sample_chars} characters):\n")
            print(result["sample"].rstrip())
        print(f"\ndone in {time.perf_counter() - t_start:.1f} s")
    if args.comm == "torch":
        torch.distributed.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
