"""Training-step time on gloo at W=2: fzero vs DDP vs ZeroRedundancyOptimizer vs FSDP2 vs DeepSpeed.

What it measures: wall time of one full data-parallel training step (forward,
backward, gradient communication, optimizer update, and for the sharded
systems the parameter exchange) of the same small GPT-style transformer
(``benchmarks/models.py``, default ~0.87 M parameters) on 2 CPU processes over
gloo, one intra-op thread per rank. Systems, all with AdamW and the same
hyperparameters, the same initial weights and the same per-rank micro-batches:

* ``local (no comm)``    floor only: the same loop on one rank's micro-batch, no DDP
* ``ddp+adamw``          DDP(model) + torch.optim.AdamW (default implementation;
                         on CPU that is the single-tensor for-loop)
* ``ddp+adamw(fused)``   DDP(model) + torch.optim.AdamW(fused=True)
* ``zero-redundancy``    ZeroRedundancyOptimizer(DDP params, optimizer_class=AdamW)
* ``zero-red.(bucket)``  same with ``parameters_as_bucket_view=True``
* ``fsdp2``              ``fully_shard`` on every block and the root, CPU mesh
* ``fzero s1/s2 eager`` and ``fzero s1/s2 compiled`` (``torch.compile(step,
                         fullgraph=True)``), ``fzero.adamw``, ``TorchCommunicator()``
* ``fzero s3 eager/compiled``  stage 3 with one shard unit per block (as FSDP2)
* ``deepspeed zero-1/2``  (keys ``ds-z1``, ``ds-z2``) a DeepSpeed engine at ZeRO
                         stage 1 / 2 on the script's gloo group (``DS_ACCELERATOR=cpu``),
                         fp32, given a ``torch.optim.AdamW`` (so DeepSpeed builds no
                         C++ CPU Adam), no clipping, reduce and all-gather buckets of
                         25 MiB (DDP's default bucket size; one bucket for this model),
                         ``overlap_comm`` off. Listed only when ``deepspeed`` is
                         installed: ``pip install -c constraints.txt -e ".[bench]"``.
                         The first run on a machine JIT-compiles DeepSpeed's
                         shared-memory CPU all-reduce with the system C++ compiler
                         (1-2 minutes of set-up on 2 cores, then cached in
                         ``~/.cache/torch_extensions``); its training steps do not use it.

``--model hf-gpt2`` runs a ``transformers`` GPT-2 (tied embeddings) of the same
size instead of the TinyGPT, in every system.

DeepSpeed on CPU runs every collective synchronously (the CPU accelerator has
no streams), so ``overlap_comm`` could only split the reduction into more
blocking collectives inside backward; with buckets larger than the model both
stages reduce the whole gradient once after backward (stage 1 and 2 alike as
an all-reduce, DeepSpeed's ``use_multi_rank_bucket_allreduce`` default),
all-reduce the gradient norm (one scalar, computed with clipping off too) and
all-gather the updated parameters once after the optimizer step.

Every system runs ``warmup + steps`` steps from the same init on the same data
(the Markov-chain random tokens of ``models.random_batch``). All systems are
built and warmed up first (warm-up also compiles the compiled variants); then
their ``steps`` timed steps run interleaved in ``--rounds`` chunks (the order
rotates each round), so load from other processes on the machine hits every
system alike. Each chunk starts after a ``dist.barrier()``; each step is
bracketed by ``time.perf_counter`` on rank 0 and includes forward, backward,
communication and the optimizer update (fzero: the whole ``step(state, batch)``
call; metrics are read with ``.item()`` only after the timed steps).
The table gives median and mean ms/step and ratios to DDP and to
ZeroRedundancyOptimizer. Sanity check: the mean training loss of the last step,
the loss on a held-out batch after training and the largest relative parameter
difference to DDP; a system whose loss differs from DDP's by more than 1e-3
relative is flagged. fzero stage 1 and 2 communication per step and rank is
counted once with ``fzero.comm.CountingCommunicator`` (one eager step).

How to run (from the repository root; it launches itself under
``python -m torch.distributed.run --standalone --nproc-per-node 2`` with
``OMP_NUM_THREADS=1`` in a new session and kills the whole process group if it
runs past ``--timeout`` seconds)::

    python benchmarks/bench_gloo_step.py [--steps 80] [--warmup 5]
        [--rounds 16] [--systems ddp,zero,fsdp,fzero-s2c,ds-z2,...] [--timeout 420]

DeepSpeed's systems need the ``bench`` extra; without it the default run skips
them with a note, and naming them in ``--systems`` is an error that says so::

    pip install -c constraints.txt -e ".[bench]"
    python benchmarks/bench_gloo_step.py --systems ddp,ds-z1,ds-z2,fzero-s2

The ``local (no comm)`` row is a floor, not a data-parallel system: forward,
backward and AdamW on the rank's own micro-batch with no communication, timed
in the same interleaved rounds. The header also reports one gloo all-reduce and
all-gather of a parameter-sized buffer and one torch AdamW step.
A full default run takes 2-4 minutes on 2 cores, much of it compiling the
two compiled fzero steps (``TORCHINDUCTOR_CACHE_DIR`` defaults to
``$TMPDIR/fzero-bench-inductor``, so later runs compile faster).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta

import torch

from fzero.testing import run_torchrun

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from models import DEFAULT_CONFIG, build, lm_loss, make_criterion, random_batch  # noqa: E402

# Same hyperparameters for every system.
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.1
WORLD = 2

# name -> (key for --systems, description)
SYSTEMS = [
    ("local", "local (no comm)"),
    ("ddp", "ddp+adamw"),
    ("ddp-fused", "ddp+adamw(fused)"),
    ("zero", "zero-redundancy"),
    ("zero-bucket", "zero-red.(bucket)"),
    ("fsdp", "fsdp2"),
    ("fzero-s1", "fzero s1 eager"),
    ("fzero-s2", "fzero s2 eager"),
    ("fzero-s1c", "fzero s1 compiled"),
    ("fzero-s2c", "fzero s2 compiled"),
    ("fzero-s2d", "fzero s2 eager+donate"),
    ("fzero-s2cd", "fzero s2 comp.+donate"),
    ("fzero-s3", "fzero s3 eager"),
    ("fzero-s3c", "fzero s3 compiled"),
    ("ds-z1", "deepspeed zero-1"),
    ("ds-z2", "deepspeed zero-2"),
]
# Systems that need the optional ``deepspeed`` package (the ``bench`` extra).
DEEPSPEED_KEYS = ("ds-z1", "ds-z2")
INSTALL_BENCH = 'pip install -c constraints.txt -e ".[bench]"'
# DeepSpeed's reduce / all-gather bucket, in elements: DDP's default bucket_cap_mb=25
# of fp32, so both reduce in buckets of one size (one bucket for the default model).
# DeepSpeed's own default, 5e8 elements, would allocate a 2 GB gradient buffer per rank.
DS_BUCKET = 25 * 2**20 // 4


def have_deepspeed() -> bool:
    """Whether ``deepspeed`` is installed; looked up without importing it (slow, and it
    picks its accelerator at import)."""
    return importlib.util.find_spec("deepspeed") is not None


def _bucket_suffix_ok(key: str) -> bool:
    """``fzero-s1...@N`` / ``fzero-s2...@N``: that system with ``bucket_numel=N`` (a sweep)."""
    if "@" not in key:
        return True
    base, n = key.split("@", 1)
    return base.startswith(("fzero-s1", "fzero-s2")) and n.isdigit() and int(n) > 0


def label(key: str) -> str:
    base, _, n = key.partition("@")
    return dict(SYSTEMS)[base] + (f" @{int(n):,}" if n else "")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=80, help="timed steps per system")
    p.add_argument("--warmup", type=int, default=5, help="untimed warm-up steps per system (compiles)")
    p.add_argument("--rounds", type=int, default=16,
                   help="the timed steps of all systems run interleaved in this many rounds")
    p.add_argument("--systems", default=None,
                   help="comma-separated subset of: " + ", ".join(k for k, _ in SYSTEMS)
                   + " (default: all; " + ", ".join(DEEPSPEED_KEYS) + " only if deepspeed is installed); "
                   "fzero stage 1-2 keys take a bucket size in elements as a suffix, e.g. fzero-s2@65536")
    p.add_argument("--seed", type=int, default=0, help="model init seed (data seeds derive from it)")
    p.add_argument("--model", default="tiny", choices=["tiny", "hf-gpt2"],
                   help="TinyGPT, or a transformers GPT-2 (tied embeddings) of the same size")
    p.add_argument("--timeout", type=float, default=420.0, help="kill torchrun and all ranks after this many s")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    keys = [k for k, _ in SYSTEMS]
    ds = have_deepspeed()
    args.skipped_note = ""
    if args.systems is None:
        args.systems = [k for k in keys if ds or k not in DEEPSPEED_KEYS]
        if not ds:
            args.skipped_note = f"{', '.join(DEEPSPEED_KEYS)} skipped: deepspeed is not installed ({INSTALL_BENCH})"
    else:
        args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
        bad = [s for s in args.systems if s.split("@")[0] not in keys or not _bucket_suffix_ok(s)]
        if bad:
            p.error(f"unknown systems {bad}; choose from {keys}")
        wanted = [s for s in args.systems if s in DEEPSPEED_KEYS]
        if wanted and not ds:
            p.error(f"{', '.join(wanted)} need deepspeed, which is not installed; install it with {INSTALL_BENCH}")
    if args.steps < 1 or args.warmup < 1:
        p.error("--steps and --warmup must be >= 1 (compiled variants compile during warm-up)")
    return args


# ----------------------------------------------------------------------------- launcher
def launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Run this file under torchrun (2 ranks, gloo) in a new session; kill the group on timeout."""
    print(f"launching {os.path.basename(__file__)} under torchrun with {WORLD} ranks", flush=True)
    rc, _ = run_torchrun(
        WORLD, os.path.abspath(__file__), ["--worker", *argv],
        timeout=args.timeout, pythonpath=[HERE], capture=False,
    )
    if rc is None:
        print(f"\nbench: exceeded --timeout {args.timeout:.0f}s; torchrun and every rank were killed", flush=True)
    return 124 if rc is None else rc


# ----------------------------------------------------------------------------- systems
class Runner:
    """One system: ``step(i)`` runs training step ``i`` (no host sync beyond what the
    system itself does); ``finish()`` -> (mean loss over ranks of the first and of the
    last step, full parameters). ``finish`` runs collectives: every rank calls it.
    ``tensors()`` (for ``bench_memory.py``'s census; no collectives): the tensors the
    system keeps between steps, ``{"state": [...], "module": [...]}`` (``module``: the
    model's own parameters where they are not the training state)."""

    step: Callable[[int], None]
    finish: Callable[[], tuple[float, float, dict[str, torch.Tensor]]]
    tensors: Callable[[], dict[str, list[torch.Tensor]]] = staticmethod(lambda: {})
    note: str = ""
    step_buffers: dict = {}  # fzero: memory_report's prediction of the step's own buffers
    step_peak: float | None = None  # fzero: ... of them together, at their peak
    # the optimizer's state tensors on this rank (bench_muon.py)
    optimizer_tensors: Callable[[], list[torch.Tensor]] = staticmethod(lambda: [])


def _optimizer_tensors(opt) -> list[torch.Tensor]:
    """Every tensor in a torch optimizer's state (moments, step counters)."""
    return [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


def _torch_state(module: torch.nn.Module, opt) -> Callable[[], dict[str, list[torch.Tensor]]]:
    """Parameters, their ``.grad`` if any, and the optimizer state: what an eager torch
    loop keeps between steps."""
    def tensors() -> dict[str, list[torch.Tensor]]:
        ps = list(module.parameters())
        return {"state": [*ps, *(p.grad for p in ps if p.grad is not None), *_optimizer_tensors(opt)]}
    return tensors


def _torch_adamw(params, **extra):
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, **extra)


def muon_matrices(model: torch.nn.Module):
    """The benchmark models' Muon parameters: the blocks' 2-D matrices (embeddings and the
    output head go to AdamW, as Muon is run)."""
    import fzero

    return fzero.muon_rules.hidden_matrices(model, exclude=("emb", "head", "wte", "wpe", "lm_head"))


class ChainedOptimizers:
    """torch.optim.Muon on the matrices and torch.optim.AdamW on the rest, stepped as one."""

    def __init__(self, *opts: torch.optim.Optimizer):
        self.opts = opts

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.opts:
            o.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for o in self.opts:
            o.step()

    @property
    def state(self) -> dict:
        return {k: v for o in self.opts for k, v in o.state.items()}

    @property
    def defaults(self) -> dict:
        return self.opts[-1].defaults


def torch_muon(model: torch.nn.Module) -> ChainedOptimizers:
    """``torch.optim.Muon`` (lr ``LR``, weight decay ``WEIGHT_DECAY``, torch's other defaults)
    on :func:`muon_matrices`, AdamW on the other parameters."""
    is_matrix = muon_matrices(model)
    named = list(model.named_parameters())
    return ChainedOptimizers(
        torch.optim.Muon([p for n, p in named if is_matrix(n)], lr=LR, weight_decay=WEIGHT_DECAY),
        _torch_adamw([p for n, p in named if not is_matrix(n)]),
    )


def fzero_muon(model: torch.nn.Module):
    """:func:`torch_muon`'s configuration as ``fzero.muon``."""
    import fzero

    return fzero.muon(lr=LR, weight_decay=WEIGHT_DECAY, matrices=muon_matrices(model),
                      adamw=dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY))


def _mean_over_ranks(x: torch.Tensor) -> float:
    import torch.distributed as dist

    t = x.detach().double().clone()
    dist.all_reduce(t)
    return (t / dist.get_world_size()).item()


def make_torch_runner(kind: str, ctx: dict) -> Runner:
    """DDP / ZeroRedundancyOptimizer / FSDP2 with the usual eager loop."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    cfg, micro = ctx["cfg"], ctx["micro"]
    model = build(ctx["model"], cfg, ctx["seed"])
    r = Runner()
    if kind == "local":
        net = model
        opt = _torch_adamw(net.parameters())
        r.note = "floor: fwd+bwd+AdamW on the local micro-batch, no communication; not data-parallel"
        params_of = lambda: {n: p.detach().clone() for n, p in net.named_parameters()}  # noqa: E731
    elif kind == "ddp" and ctx.get("optimizer") == "muon":
        net = DDP(model)
        opt = torch_muon(model)
        r.note = "torch.optim.Muon on the blocks' matrices, AdamW on the rest"
        params_of = lambda: {n: p.detach().clone() for n, p in net.module.named_parameters()}  # noqa: E731
    elif kind in ("ddp", "ddp-fused"):
        net = DDP(model)
        opt = _torch_adamw(net.parameters(), **({"fused": True} if kind == "ddp-fused" else {}))
        r.note = "fused=True" if kind == "ddp-fused" else f"foreach={opt.defaults.get('foreach')} (for-loop on CPU)"
        params_of = lambda: {n: p.detach().clone() for n, p in net.module.named_parameters()}  # noqa: E731
    elif kind in ("zero", "zero-bucket"):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        net = DDP(model)
        bucket = kind == "zero-bucket"
        opt = ZeroRedundancyOptimizer(
            net.parameters(), optimizer_class=torch.optim.AdamW, parameters_as_bucket_view=bucket,
            lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
        )
        r.note = "parameters_as_bucket_view=True" if bucket else "defaults"
        params_of = lambda: {n: p.detach().clone() for n, p in net.module.named_parameters()}  # noqa: E731
    elif kind == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        net = model
        opt = _torch_adamw(model.parameters())
        r.note = "fully_shard(blocks, root)"
        params_of = lambda: {n: p.full_tensor().detach().clone() for n, p in net.named_parameters()}  # noqa: E731
    else:
        raise ValueError(kind)
    if ctx.get("optimizer", "adamw") != "adamw" and not isinstance(opt, ChainedOptimizers):
        raise ValueError(f"{kind}: only AdamW here")
    r.tensors = _torch_state(net, opt)
    r.optimizer_tensors = lambda: _optimizer_tensors(opt)

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(net(x), y)
        loss.backward()
        opt.step()
        return loss

    return _eager_runner(r, train_step, micro, params_of)


def _eager_runner(r: Runner, train_step, micro: list, params_of) -> Runner:
    """Fill ``r`` with an eager loop: ``train_step(x, y) -> loss`` on rank-local micro-batch
    ``i``; losses stay tensors until ``finish`` (no host sync in the timed steps)."""
    losses: dict[str, torch.Tensor] = {}

    def step(i: int) -> None:
        loss = train_step(*micro[i])
        losses.setdefault("first", loss.detach())
        losses["last"] = loss.detach()

    def finish():  # collectives: every rank calls it
        return _mean_over_ranks(losses["first"]), _mean_over_ranks(losses["last"]), params_of()

    r.step, r.finish = step, finish
    return r


def _ds_config(stage: int, micro_batch: int) -> dict:
    """DeepSpeed config: fp32, ZeRO ``stage``, no clipping, one micro-batch per step."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": DS_BUCKET,
            "allgather_bucket_size": DS_BUCKET,
            "contiguous_gradients": True,  # DeepSpeed's default: gradients copied into the bucket
            "reduce_scatter": True,
            # DeepSpeed's default for stages 1-2; on CPU there are no streams to overlap on.
            "overlap_comm": False,
        },
        # ZeRO refuses optimizers it has not tested unless told; torch's AdamW is
        # elementwise, so it steps the flat fp32 partition as it would the parameters.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,  # no progress lines between timed steps
        "wall_clock_breakdown": False,
    }


def _reachable_tensors(obj, depth: int = 4) -> list[torch.Tensor]:
    """Tensors reachable from a DeepSpeed optimizer through containers and DeepSpeed's own
    objects (its flat parameter, master and gradient buffers), not through modules."""
    out, seen = [], set()

    def walk(x, d: int) -> None:
        if id(x) in seen or d < 0:
            return
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v, d - 1)
        elif isinstance(x, (list, tuple, set)):
            for v in x:
                walk(v, d - 1)
        elif type(x).__module__.startswith("deepspeed") and not isinstance(x, torch.nn.Module):
            for v in getattr(x, "__dict__", {}).values():
                walk(v, d - 1)

    walk(obj, depth)
    return out


def make_deepspeed_runner(stage: int, ctx: dict) -> Runner:
    """A DeepSpeed engine (ZeRO ``stage``) over the process group this script made."""
    # The benchmark is gloo on CPU whatever else the machine has; DeepSpeed reads the
    # variable once, when its accelerator is first asked for (at import).
    os.environ["DS_ACCELERATOR"] = "cpu"
    # DeepSpeed's gather calls the name torch 2.13 deprecates; said once per process, not ours.
    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated", category=FutureWarning)
    import deepspeed

    cfg, micro = ctx["cfg"], ctx["micro"]
    model = build(ctx["model"], cfg, ctx["seed"])
    config = _ds_config(stage, micro[0][0].shape[0])
    if ctx.get("optimizer", "adamw") == "muon":
        # DeepSpeed's own Muon (its MuonWithAuxAdam, torch's AdamW for the rest). DeepSpeed tags
        # the Muon parameters by name (2-D, not "embed"/"lm_head"), which would put this
        # model's embeddings and head under Muon; the benchmark tags the same matrices as the
        # other systems instead (`muon_matrices`).
        config["optimizer"] = {"type": "muon", "params": {
            "lr": LR, "momentum": 0.95, "weight_decay": WEIGHT_DECAY, "betas": list(BETAS), "eps": EPS,
            "torch_adam": True}}
        is_matrix = muon_matrices(model)

        def tag(config_class, module):  # noqa: ANN001, ANN202
            for name, p in module.named_parameters():
                p.use_muon = is_matrix(name)

        deepspeed.set_optimizer_flags, optimizer = tag, None
    else:
        optimizer = _torch_adamw(model.parameters())
    engine, opt, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=config, dist_init_required=False,
    )
    if engine.zero_optimization_stage() != stage:
        raise RuntimeError(f"DeepSpeed runs ZeRO stage {engine.zero_optimization_stage()}, asked for {stage}")
    r = Runner()
    r.note = (f"deepspeed {deepspeed.__version__}, stage {stage} ({type(opt).__name__} over "
              f"{type(opt.optimizer).__name__}), buckets {DS_BUCKET / 1e6:.2f}M el.")
    r.optimizer_tensors = lambda: _optimizer_tensors(opt.optimizer)
    r.tensors = lambda: {"state": [*_reachable_tensors(opt), *_torch_state(engine.module, opt.optimizer)()["state"]]}

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()  # the optimizer step, the parameter all-gather and zeroing the gradients
        return loss

    # ZeRO 1-2 keep full fp32 parameters in the module, refreshed by the all-gather in step().
    params_of = lambda: {n: p.detach().clone() for n, p in engine.module.named_parameters()}  # noqa: E731
    return _eager_runner(r, train_step, micro, params_of)


def make_fzero_runner(stage: int, compiled: bool, donate: bool, ctx: dict, bucket_numel: int | None = None) -> Runner:
    import fzero
    from fzero.dist import TorchCommunicator

    cfg = ctx["cfg"]
    from fzero.host_malloc import tune_host_allocator

    tune_host_allocator()  # fzero's documented allocator setting for CPU training
    comm = TorchCommunicator()
    model = build(ctx["model"], cfg, ctx["seed"])
    if ctx.get("optimizer", "adamw") == "muon":
        opt = fzero_muon(model)
    else:
        opt = fzero.adamw(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    units = (type(model.blocks[0]),) if stage == 3 else None  # as FSDP2: one unit per block
    precision = fzero.MixedPrecision(param_dtype=ctx.get("param_dtype"), frozen_dtype=ctx.get("frozen_dtype"))
    holder = {"state": fzero.init_train_state(model, opt, comm, stage=stage, units=units, bucket_numel=bucket_numel,
                                              precision=precision)}
    step_fn = fzero.make_train_step(
        fzero.module_loss(model, make_criterion(cfg.vocab)), comm, donate=donate, compile=compiled
    )
    batches = [comm.split_batch(b) for b in ctx["global_batches"]]  # [1, B/W, T] views
    r = Runner()
    r.note = f"stage {stage}" + (", units: blocks" if units else "") + (", fullgraph" if compiled else "") \
        + (", donating" if donate else "") \
        + (f", {len({g.bucket for g in holder['state'].layout.groups})} buckets" if stage < 3 else "") \
        + (f", compute in {precision.param_dtype}" if precision.param_dtype else "") \
        + (f", frozen in {precision.frozen_dtype}" if precision.frozen_dtype else "")
    # the report states an eager step's buffers (a compiled graph's are inductor's)
    report = fzero.memory_report(holder["state"].layout, opt, stage=stage, comm=comm, precision=precision)
    r.step_buffers, r.step_peak = ({}, None) if compiled else (report.step_buffers, report.step_peak)

    def step(i: int) -> None:
        holder["state"], holder["metrics"] = step_fn(holder["state"], batches[i])
        holder.setdefault("first", holder["metrics"])

    r.tensors = lambda: {"state": torch.utils._pytree.tree_leaves(holder["state"]),
                         "module": list(model.parameters())}
    r.optimizer_tensors = lambda: _fzero_state_in_use(holder["state"])

    def finish():
        # .item() only here, after the timed loop; metric "loss" is already the mean over ranks.
        first, last = holder["first"]["loss"].item(), holder["metrics"]["loss"].item()
        full = fzero.full_params(holder["state"].shard, comm)
        return first, last, {k: v[0].detach().clone() for k, v in full.items()}

    r.step, r.finish = step, finish
    return r


def _fzero_state_in_use(state) -> list[torch.Tensor]:  # noqa: ANN001
    """The optimizer moments of a fzero state that its groups use: ``fzero.muon`` keeps every
    moment for every flat group (Muon's momentum, AdamW's two) and writes only its own group's
    (the others stay zero and, from 1 MiB on, uncommitted pages on the CPU)."""
    opt = state.opt.optimizer
    if not hasattr(opt, "is_muon_group"):
        return [t for m in state.opt.moments for t in m]
    out = []
    for g, moments in zip(state.layout.groups, state.opt.moments):
        out += list(moments[:1] if opt.is_muon_group(g.opt_group) else moments[1:])
    return out


def build_runner(key: str, ctx: dict) -> Runner:
    if key in DEEPSPEED_KEYS:
        return make_deepspeed_runner(int(key[-1]), ctx)
    if key.startswith("fzero-"):
        base, _, n = key.partition("@")
        tag = base[len("fzero-"):]
        return make_fzero_runner(int(tag[1]), "c" in tag, "d" in tag, ctx, int(n) if n else None)
    return make_torch_runner(key, ctx)


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _agree_error(err: str | None) -> str | None:
    """Every rank learns whether any rank failed (so all drop the system together)."""
    import torch.distributed as dist

    errs: list = [None] * dist.get_world_size()
    dist.all_gather_object(errs, err)
    return next((e for e in errs if e), None)


def _describe(e: BaseException) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}"[:300]


def setup_and_warm_up(key: str, ctx: dict, warmup: int, log) -> dict:
    """Build one system and run its ``warmup`` untimed steps (0..warmup-1; compiles)."""
    import torch.distributed as dist

    gc.collect()
    dist.barrier()
    t0 = time.perf_counter()
    g0 = _graphs()
    runner = build_runner(key, ctx)
    for i in range(warmup):
        runner.step(i)
    t_warm = time.perf_counter() - t0
    g1 = _graphs()
    note = runner.note
    if key.endswith("c"):
        note += f"; setup+compile+warm-up {t_warm:.1f}s, {g1 - g0} graph(s)"
    log(f"  {key}: set up and warmed up in {t_warm:.1f}s")
    return {"runner": runner, "note": note, "times": [], "recompiles": 0}


def timed_rounds(live: dict, order: list[str], warmup: int, steps: int, rounds: int, log) -> dict:
    """Time ``steps`` steps of every live system in ``rounds`` interleaved chunks, in a
    shuffled order each round (same seed on every rank), so background load and position
    effects hit every system alike. Each chunk starts after a ``dist.barrier()``; each
    step is bracketed by ``perf_counter``."""
    import random

    import torch.distributed as dist

    failed: dict[str, str] = {}
    bounds = [warmup + steps * k // rounds for k in range(rounds + 1)]
    for rnd in range(rounds):
        rot = list(order)
        random.Random(rnd).shuffle(rot)
        for key in rot:
            if key not in live:
                continue
            rec = live[key]
            err = None
            try:
                g0 = _graphs()
                dist.barrier()
                for i in range(bounds[rnd], bounds[rnd + 1]):
                    t = time.perf_counter()
                    rec["runner"].step(i)
                    rec["times"].append(time.perf_counter() - t)
                rec["recompiles"] += _graphs() - g0
            except Exception as e:  # noqa: BLE001
                err = _describe(e)
            err = _agree_error(err)
            if err:
                failed[key] = f"timed step failed: {err}"
                del live[key]
        log(f"  round {rnd + 1}/{rounds} done")
    return failed


def reference_timings(ctx: dict, n_params: int, reps: int = 15) -> dict:
    """Reference costs for reading the table: gloo all_reduce / all_gather of a
    parameter-sized fp32 buffer and one torch AdamW (for-loop) step of the full model."""
    import torch.distributed as dist

    cfg, micro = ctx["cfg"], ctx["micro"]
    model = build(ctx["model"], cfg, ctx["seed"])
    world, rank = dist.get_world_size(), dist.get_rank()
    out = {}

    def timeit(fn) -> float:
        fn()
        dist.barrier()
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts) * 1e3

    x, y = micro[0]
    lm_loss(model(x), y).backward()  # gradients for the AdamW timing
    n = -(-n_params // (16 * world)) * 16 * world
    buf = torch.randn(n)
    out["all_reduce"] = timeit(lambda: dist.all_reduce(buf))
    shard, full = buf[rank * (n // world):(rank + 1) * (n // world)].clone(), torch.empty(n)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    out["all_gather"] = timeit(lambda: gather(full, shard))
    opt = _torch_adamw(model.parameters())
    out["torch AdamW step (full model)"] = timeit(opt.step)
    return out


def count_fzero_volume(ctx: dict) -> dict:
    """Collectives of one eager fzero step at stage 1 and 2 (CountingCommunicator)."""
    import fzero
    from fzero.dist import TorchCommunicator

    cfg = ctx["cfg"]
    out = {}
    for stage in (1, 2):
        counting = fzero.comm.CountingCommunicator(TorchCommunicator())
        model = build(ctx["model"], cfg, ctx["seed"])
        state = fzero.init_train_state(model, fzero.adamw(lr=LR, weight_decay=WEIGHT_DECAY), counting, stage=stage)
        step = fzero.make_train_step(fzero.module_loss(model, make_criterion(cfg.vocab)), counting)
        counting.reset()
        step(state, counting.split_batch(ctx["global_batches"][0]))
        out[stage] = {
            "totals": counting.totals(),
            "ops": [(r.op, str(r.dtype).replace("torch.", ""), r.elements, r.bytes) for r in counting.records],
            "psi": state.layout.num_padded,
        }
    return out


# ----------------------------------------------------------------------------- worker
def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    lead = rank == 0

    def log(msg: str) -> None:
        if lead:
            print(msg, flush=True)

    cfg = DEFAULT_CONFIG
    assert cfg.global_batch % world == 0
    b = cfg.global_batch // world
    total = args.warmup + args.steps
    global_batches = [random_batch(cfg, seed=10_000 * (args.seed + 1) + i) for i in range(total)]
    micro = [(x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]) for x, y in global_batches]
    ctx = {"cfg": cfg, "seed": args.seed, "global_batches": global_batches, "micro": micro, "model": args.model}
    n_params = sum(p.numel() for p in build(args.model, cfg, args.seed).parameters())
    rounds = max(1, min(args.rounds, args.steps))
    log(f"torch {torch.__version__}, gloo, world {world}, {torch.get_num_threads()} thread/rank; "
        f"{args.warmup} warm-up + {args.steps} timed steps per system, timed in {rounds} interleaved rounds")

    volume = None
    try:
        volume = count_fzero_volume(ctx)
    except Exception:  # noqa: BLE001 - reported, the timings still run
        log("CountingCommunicator measurement failed:\n" + traceback.format_exc())

    results: dict[str, dict] = {}
    live: dict[str, dict] = {}
    log("setting up and warming up every system (compiled variants compile here) ...")
    for key in args.systems:
        err, rec = None, None
        try:
            rec = setup_and_warm_up(key, ctx, args.warmup, log)
        except Exception as e:  # noqa: BLE001 - one failing system must not hide the others
            err = _describe(e)
            if lead:
                traceback.print_exc(limit=3)
        err = _agree_error(err)
        if err:
            results[key] = {"error": err}
            log(f"  {key}: FAILED: {err}")
        else:
            live[key] = rec
    log("timing ...")
    for key, why in timed_rounds(live, [k for k in args.systems if k in live], args.warmup,
                                 args.steps, rounds, log).items():
        results[key] = {"error": why}
    for key in list(live):
        err = None
        try:
            first, last, params = live[key]["runner"].finish()
        except Exception as e:  # noqa: BLE001
            err = _describe(e)
        err = _agree_error(err)
        rec = live.pop(key)
        if err:
            results[key] = {"error": f"finish failed: {err}"}
            continue
        note = rec["note"] + (f"; {rec['recompiles']} RECOMPILE(S) IN TIMED LOOP" if rec["recompiles"] else "")
        results[key] = {"times": rec["times"], "first": first, "loss": last, "params": params, "note": note}
        del rec
        gc.collect()
    try:
        refs = reference_timings(ctx, n_params)
    except Exception as e:  # noqa: BLE001 - the table matters more than the floors
        refs = {"reference timings failed": float("nan")}
        log(f"reference timings failed: {_describe(e)}")

    if lead:
        report(args, cfg, n_params, {k: results[k] for k in args.systems}, volume, refs)
    dist.barrier()
    dist.destroy_process_group()


def report(args, cfg, n_params: int, results: dict, volume: dict | None, refs: dict) -> None:
    ok = {k: v for k, v in results.items() if "error" not in v}
    trained = {k: v for k, v in ok.items() if k != "local"}  # the floor trains on local data only
    med = {k: statistics.median(v["times"]) * 1e3 for k, v in ok.items()}
    mean = {k: statistics.fmean(v["times"]) * 1e3 for k, v in ok.items()}
    # the reference is DDP at its best (fused AdamW) when it ran, else DDP with torch's default AdamW
    ref = "ddp-fused" if "ddp-fused" in med else "ddp"
    ddp_ms, zero_ms = med.get(ref), med.get("zero")

    print()
    print(f"model: {'TinyGPT' if args.model == 'tiny' else 'transformers GPT-2 (tied)'} vocab={cfg.vocab} d_model={cfg.d_model} n_layers={cfg.n_layers} "
          f"n_heads={cfg.n_heads} seq_len={cfg.seq_len}; global batch {cfg.global_batch} "
          f"({cfg.global_batch // WORLD} sequences/rank); {n_params:,} parameters "
          f"({n_params * 4 / 1e6:.2f} MB fp32)")
    print(f"AdamW lr={LR} betas={BETAS} eps={EPS} weight_decay={WEIGHT_DECAY} (all params) for every system; "
          f"gloo, W={WORLD}, 1 thread/rank; {args.warmup} warm-up + {args.steps} timed steps "
          f"(interleaved in {max(1, min(args.rounds, args.steps))} rounds); times on rank 0")
    from fzero.host_malloc import large_pages

    on, why = large_pages()
    print(f"huge pages {'on' if on else 'off'} in the ranks (every system alike): {why}")
    if volume:
        for stage in (1, 2):
            v = volume[stage]
            t = v["totals"]
            ops = ", ".join(f"{op}({dt}, {el:,})" for op, dt, el, _ in v["ops"])
            print(f"fzero stage {stage} comm/step/rank (CountingCommunicator, eager, one step): "
                  f"{t['bytes'] / 1e6:.3f} MB in {t['calls']} collectives: {ops}")
        ddp_bytes = 2 * n_params * (WORLD - 1) / WORLD * 4
        print(f"  for reference, DDP's ring all-reduce of fp32 gradients: {ddp_bytes / 1e6:.3f} MB/step/rank")
    print("reference medians on rank 0 after the timed rounds (ms): "
          + ", ".join(f"{k} {v:.1f}" for k, v in refs.items())
          + "  [collectives: one parameter-sized fp32 buffer]")

    print()
    head = (f"{'system':<20} | {'median ms/step':>14} | {'mean ms/step':>12} | {'x ' + ref + ' (med.)':>14} "
            f"| {'x ZeRO':>6} | note")
    print(head)
    print("-" * len(head))
    for key in args.systems:
        r = results[key]
        if "error" in r:
            print(f"{label(key):<20} | {'-':>14} | {'-':>12} | {'-':>14} | {'-':>6} | FAILED: {r['error']}")
            continue
        rd = f"{med[key] / ddp_ms:.2f}" if ddp_ms else "-"
        rz = f"{med[key] / zero_ms:.2f}" if zero_ms else "-"
        print(f"{label(key):<20} | {med[key]:>14.1f} | {mean[key]:>12.1f} | {rd:>14} | {rz:>6} | {r['note']}")
    if args.skipped_note:
        print(args.skipped_note)

    if ddp_ms and zero_ms:
        print()
        print(f"goal: fzero <= 1.0x {ref} and <= 0.8x ZeroRedundancyOptimizer (median; ZeRO = default settings)")
        for key in args.systems:
            if key.startswith("fzero") and key in ok:
                a, z = med[key] / ddp_ms, med[key] / zero_ms
                verdict = "MET" if a <= 1.0 and z <= 0.8 else "not met"
                print(f"  {label(key):<20} {a:.2f}x {ref}, {z:.2f}x ZeRO: {verdict}")

    pairs = [(s3, s2, how) for s3, s2, how in (("fzero-s3", "fzero-s2", "eager"), ("fzero-s3c", "fzero-s2c", "compiled"))
             if s3 in ok and s2 in ok]
    if pairs:
        print()
        print("goal: fzero stage 3 <= 1.2x stage 2 (median, one run)")
        for s3, s2, how in pairs:
            r = med[s3] / med[s2]
            print(f"  {how:<9} {med[s3]:.1f} / {med[s2]:.1f} ms = {r:.2f}x: {'MET' if r <= 1.2 else 'not met'}")

    # Sanity: every system trained the same thing.
    print()
    print(f"sanity (every system ran {args.warmup + args.steps} steps from the same init on the same data; "
          "losses are means over ranks):")
    ref_key = next((k for k in ("ddp-fused", "ddp") if k in trained), next(iter(trained), None))
    if ref_key is None:
        return
    model = build(args.model, cfg, args.seed)
    ex, ey = random_batch(cfg, seed=999_983)
    evals = {}
    with torch.no_grad():
        for k, v in trained.items():
            evals[k] = lm_loss(torch.func.functional_call(model, v["params"], (ex,)), ey).item()
    ref = ok[ref_key]
    print(f"{'system':<20} | {'first-step loss':>15} | {'last-step loss':>14} | {'held-out loss':>13} "
          f"| {'rel. diff last / held-out':>25} | {'max param rel. diff':>19} | flag  (vs {label(ref_key)})")
    for k, v in trained.items():
        dl = abs(v["loss"] - ref["loss"]) / abs(ref["loss"])
        de = abs(evals[k] - evals[ref_key]) / abs(evals[ref_key])
        dp = max(
            ((v["params"][n] - p).abs().max() / p.abs().max().clamp_min(1e-30)).item()
            for n, p in ref["params"].items()
        )
        flag = "DISAGREES (>1e-3)" if max(dl, de) > 1e-3 else "ok"
        print(f"{label(k):<20} | {v['first']:>15.6f} | {v['loss']:>14.6f} | {evals[k]:>13.6f} "
              f"| {f'{dl:.1e} / {de:.1e}':>25} | {dp:>19.1e} | {flag}")
    print("(max param rel. diff: max over tensors of max|p - p_ref| / max|p_ref|)")


def main() -> None:
    argv = sys.argv[1:]
    args = parse_args(argv)
    if args.worker or "LOCAL_RANK" in os.environ:
        worker(args)
        return
    sys.exit(launch(args, [a for a in argv if a != "--worker"]))


if __name__ == "__main__":
    main()
