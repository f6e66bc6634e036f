"""Memory per rank of data-parallel training systems on gloo at W=2: RSS, step time, census.

How to run (each system runs in its own ``torchrun`` launch of 2 ranks, so a
process's peak RSS is that system's alone; one intra-op thread per rank)::

    python benchmarks/bench_memory.py                        # GPT-2 small size, every system
    python benchmarks/bench_memory.py --model hf-gpt2        # transformers GPT-2 (tied embeddings)
    python benchmarks/bench_memory.py --systems ddp,fzero-s2 --d-model 256 --layers 4 \\
        --heads 4 --vocab 8000 --seq 64 --batch 4            # a small model (~7 M parameters)
    python benchmarks/bench_memory.py --long 400 --systems ddp,fzero-s2   # RSS over a long run
    python benchmarks/bench_memory.py --sizes 7M,58M,162M \
        --systems ddp-fused,fzero-s2,fzero-s2d,fzero-s2cd,fzero-s3d,fsdp   # step time per size against DDP

Model: ``--model tiny`` (``benchmarks/models.py``'s TinyGPT, untied head) or
``hf-gpt2`` (a ``transformers`` GPT-2 with tied embeddings), by default of GPT-2
small's size (vocab 50304, d_model 768, 12 layers, 12 heads, sequence 128,
global batch 4: 2 sequences per rank; 162.4 M parameters for the TinyGPT).
Systems are built by ``bench_gloo_step.build_runner`` (AdamW, fp32, the same
init and data for all): ``ddp``, ``ddp-fused``, ``fsdp`` (FSDP2), ``ds-z1``,
``ds-z2``, ``ds-z3`` (DeepSpeed ZeRO, ``DS_ACCELERATOR=cpu``), and fzero
``fzero-s{1,2,3}`` with suffixes ``c`` (compiled) and ``d`` (donating), e.g.
``fzero-s2cd``.

Each launch runs, on both ranks: ``gc.collect()``, then the RSS baseline
(``/proc/self/statm``) and a reset of the peak RSS (``/proc/self/clear_refs``
``5``, which resets ``VmHWM``, the value ``getrusage().ru_maxrss`` reports);
building the system; ``--warmup`` untimed steps (compiled variants compile here);
another reset of the peak; ``--steps`` timed steps; one more step inside the
census. No ``gc.collect()`` from the baseline on. The columns (MiB per rank,
max over the 2 ranks unless said):

* ``init peak``: peak RSS while building the system, minus the baseline;
* ``step peak``: peak RSS during the timed steps (peak reset after warm-up), minus
  the baseline: held state plus what a step needs on top;
* ``held``: RSS after the timed steps minus the baseline, read once every rank has
  finished them and a second has passed (``SETTLE``): what stays between steps (including
  memory the allocator keeps after frees). Why the pause: a backend may let go of a
  collective's buffers a moment after the step returns (measured on a compiled fzero stage-2
  step at 162M: 1950 MiB and a live heap of 1131 right after the step, 1773 and 984 one
  second later, with nothing run in between);
* ``heap``: malloc's live bytes after the timed steps minus the baseline (glibc's
  ``mallinfo2``: ``uordblks + hblkhd``, every arena): what is really allocated between
  steps, tensors, Python objects and gloo alike; ``held - heap`` is freed memory the
  allocator keeps;
* ``ms/step``: median wall time of the timed steps on rank 0 (they run back to back
  after one ``dist.barrier()``; a handful of steps: a rough figure, see
  ``bench_gloo_step.py`` for timings);
* ``kflt/step``: rank 0's minor page faults per timed step (median, thousands): each first
  touch of memory the step got fresh from the kernel, one per 4 KiB page, or per 2 MiB where
  the ranks have huge pages. The table's last lines say whether they do and why
  (:func:`fzero.host_malloc.large_pages`); the ranks inherit the launching environment, so
  ``THP_MEM_ALLOC_ENABLE=1 python benchmarks/bench_memory.py ...`` runs every system with
  PyTorch's huge-page allocation;
* census (rank 0, one step after the timed ones, :class:`fzero.testing.census.Census`:
  CPU allocator bytes of tensor storages live at the step's allocation peak; not Python
  objects, not gloo's internal buffers, not malloc's slack): ``state`` the system's
  persistent training state that existed before the step (fzero: the ``TrainState``'s
  tensors; torch and DeepSpeed: the module's parameters, their ``.grad`` and the
  optimizer state; DeepSpeed also its flat buffers) and still live at the peak;
  ``new st.`` tensors of the state after the step that the step allocated (fzero
  without donation: the new state; torch: the new ``.grad``); ``module`` the model's
  own parameters where they are not the state (fzero keeps the user's module
  untouched); ``other`` everything else the step allocated and holds at the peak
  (activations, gradients, gathered parameters, temporaries); ``total`` their sum;
  ``/peak`` total over ``step peak``. Not in the census: tensors from before the step
  that are not named (DDP's gradient buckets; garbage of earlier steps that Python's
  cycle collector has not freed yet), and everything that is not a tensor storage:
  compare ``heap``. The census's step is not one of the timed
  steps and its profiler runs after every RSS number was read, so its overhead is in
  neither; the census step itself sees the same allocations as any other step.

Where a system's training state is on a CUDA device (:func:`fzero.testing.census.device_of` of its tensors), the
table adds the CUDA caching allocator's columns beside the RSS ones (MiB per rank, max over the ranks, each minus the
allocator's bytes before the system was built, read where the RSS ones are):

* ``cu init``: peak allocated while building the system (``max_memory_allocated``);
* ``cu step``: peak allocated during the timed steps (``reset_peak_memory_stats`` after warm-up);
* ``cu held``: allocated after the timed steps (``memory_allocated``): the device's share of ``held``;
* ``cu resv``: reserved then (``memory_reserved``): what the allocator keeps from the driver, cached blocks included;

and the census counts that device's allocations, with the allocator's own peak beside it in the system's details.
``--long`` adds a ``cuda`` row (allocated). A state on the CPU prints none of these: the table is as before.

A compiled system's note says whether its warm-up found inductor's cache warm (hits and misses
of the FX graph cache): compiling with a cold cache leaves the compiler's own memory in the
process (about 100 MiB more held at 162M parameters, one launch each), so run a compiled system
twice for its memory, or read the note.

``--long N`` runs N steps after warm-up instead (no census, no timing) and prints
RSS and malloc's live heap (``mallinfo2``), minus the baseline, at steps N/4, N/2,
3N/4 and N, and their growth per step between N/4 and N: whether memory keeps
growing over a long run without ``gc.collect()`` (and whether it is live heap or
memory the allocator keeps).

The script prints one plain-text table for the model, then each system's census
breakdown (rank 0: categories, the operators that allocated most of ``other``); on
stderr, each system's rows as soon as its launch ends, so a run stopped half-way keeps
the systems it finished. A
launch that fails or exceeds ``--timeout`` (killed with its ranks) gets a row saying
so. DeepSpeed ZeRO-3 runs on CPU (deepspeed 0.19.8); the first DeepSpeed launch on a
machine JIT-compiles its CPU communication op (minutes; cached afterwards).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from datetime import timedelta

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from fzero.testing.census import AllocatorReading, CudaAllocator, device_of, malloc_in_use  # noqa: E402
from models import LORA_RANK, LORA_TARGETS, GPTConfig, build, random_batch  # noqa: E402

WORLD = 2
MIB = 2.0**20
GPT2_SMALL = GPTConfig(vocab=50304, d_model=768, n_layers=12, n_heads=12, seq_len=128, global_batch=4)
# --sizes: the model sizes a user compares against DDP (issue 42's table), smallest first
SIZES = {
    "7M": GPTConfig(vocab=8000, d_model=256, n_layers=4, n_heads=4, seq_len=64, global_batch=4),
    "58M": GPTConfig(vocab=32000, d_model=512, n_layers=8, n_heads=8, seq_len=128, global_batch=4),
    "162M": GPT2_SMALL,
}
TORCH_KEYS = ("ddp-fused", "ddp", "fsdp")  # DDP at its best (fused AdamW) is the reference row
DS_KEYS = ("ds-z1", "ds-z2", "ds-z3")
FZERO_KEYS = ("fzero-s1", "fzero-s2", "fzero-s3", "fzero-s1c", "fzero-s2c", "fzero-s3c",
              "fzero-s1d", "fzero-s2d", "fzero-s3d", "fzero-s1cd", "fzero-s2cd", "fzero-s3cd")
ALL_KEYS = (*TORCH_KEYS, *DS_KEYS, *FZERO_KEYS)
RESULT = "BENCH_MEMORY_RESULT "  # the line rank 0 prints for the launcher
SETTLE = 1.0  # seconds between the timed steps and the held readings (module doc: ``held``)


# ----------------------------------------------------------------------------- RSS
def rss_bytes() -> int:
    """Current resident set size of this process (``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """Peak resident set size since the last :func:`reset_peak_rss` (``VmHWM``, what
    ``getrusage(RUSAGE_SELF).ru_maxrss`` reports while no thread has exited)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> bool:
    """Set the peak RSS to the current RSS (Linux >= 4.0); False if not possible, and then
    peaks are over the process's whole life."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def cuda_before() -> AllocatorReading:
    """The CUDA caching allocator's counters before a system is built, its peak reset: all zero where CUDA is not
    initialised yet (nothing is allocated on a GPU then, and reading would initialise CUDA, whose context costs RSS a
    CPU run must not pay)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return AllocatorReading(0, 0, 0, 0)
    reader = CudaAllocator(torch.cuda.current_device())
    reader.reset_peak()
    return reader.read()


def cuda_reader(runner) -> CudaAllocator | None:
    """The caching allocator of the device the system's state lives on, or ``None`` for a state on the CPU."""
    device = device_of(runner.tensors().get("state", []))
    return CudaAllocator(device) if device.type == "cuda" else None


# ----------------------------------------------------------------------------- arguments
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", choices=["tiny", "tiny-lora", "hf-gpt2"])
    p.add_argument("--frozen-dtype", choices=["bfloat16", "float16"],
                   help="fzero systems: MixedPrecision(frozen_dtype=...), the frozen parameters held in it")
    p.add_argument("--param-dtype", choices=["bfloat16", "float16"],
                   help="fzero systems: MixedPrecision(param_dtype=...), the compute dtype")
    p.add_argument("--systems", default=",".join(ALL_KEYS), help="comma-separated, from: " + ", ".join(ALL_KEYS))
    p.add_argument("--steps", type=int, default=4, help="timed steps after the warm-up")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (compiled variants compile here)")
    p.add_argument("--long", type=int, default=0, metavar="N", help="run N steps; print RSS and heap at N/4, N/2, 3N/4, N")
    p.add_argument("--timeout", type=float, default=1200.0,
                   help="seconds per launch; then torchrun and its ranks are killed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=GPT2_SMALL.vocab)
    p.add_argument("--d-model", type=int, default=GPT2_SMALL.d_model)
    p.add_argument("--layers", type=int, default=GPT2_SMALL.n_layers)
    p.add_argument("--heads", type=int, default=GPT2_SMALL.n_heads)
    p.add_argument("--seq", type=int, default=GPT2_SMALL.seq_len)
    p.add_argument("--batch", type=int, default=GPT2_SMALL.global_batch, help="global batch (sequences)")
    p.add_argument("--sizes", help="comma-separated, from: " + ", ".join(SIZES) + ": run every system at each size "
                   "(its vocab, d_model, layers, heads, seq and batch replace those flags) and end with ms/step per "
                   "size against ddp-fused")
    p.add_argument("--system", help=argparse.SUPPRESS)  # a worker's one system
    args = p.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in args.systems if s not in ALL_KEYS]
    if bad:
        p.error(f"unknown systems {bad}; choose from {', '.join(ALL_KEYS)}")
    args.sizes = [s.strip() for s in (args.sizes or "").split(",") if s.strip()]
    if [s for s in args.sizes if s not in SIZES]:
        p.error(f"unknown sizes {[s for s in args.sizes if s not in SIZES]}; choose from {', '.join(SIZES)}")
    if args.sizes and args.long:
        p.error("--sizes times steps; --long follows RSS over one run: give one or the other")
    if args.batch % WORLD:
        p.error(f"--batch must be a multiple of {WORLD}")
    if args.steps < 1 or args.warmup < 1 or args.long < 0:
        p.error("--steps and --warmup must be >= 1, --long >= 0")
    return args


def config_of(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(vocab=args.vocab, d_model=args.d_model, n_layers=args.layers,
                     n_heads=args.heads, seq_len=args.seq, global_batch=args.batch)


def model_args(args: argparse.Namespace) -> list[str]:
    """The flags a worker needs to rebuild the same model and run."""
    return ["--model", args.model, "--vocab", str(args.vocab), "--d-model", str(args.d_model),
            "--layers", str(args.layers), "--heads", str(args.heads), "--seq", str(args.seq),
            "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--long", str(args.long), "--seed", str(args.seed)] + \
        (["--frozen-dtype", args.frozen_dtype] if args.frozen_dtype else []) + \
        (["--param-dtype", args.param_dtype] if args.param_dtype else [])


# ----------------------------------------------------------------------------- worker
def minor_faults() -> int:
    """Page faults this process took that needed no disk read (``getrusage().ru_minflt``): each
    first touch of freshly mapped memory, one per page (4 KiB, or 2 MiB for a huge page)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def inductor_cache_use() -> tuple[int, int] | None:
    """``(hits, misses)`` of inductor's FX graph cache in this process so far, or ``None`` where
    nothing was compiled. A compiled system whose warm-up compiled with a cold cache kept about
    100 MiB more RSS at 162M parameters (the compiler's own memory; one launch each), so the
    table says which it was."""
    if "torch._dynamo" not in sys.modules:
        return None
    from torch._dynamo.utils import counters

    hits, misses = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
    return (int(hits), int(misses)) if hits or misses else None


def make_ctx(cfg: GPTConfig, args: argparse.Namespace, total: int, rank: int) -> dict:
    """``bench_gloo_step``'s context: the config, seed, model kind, ``total`` global
    batches and this rank's micro-batches. At most 16 distinct batches (reused in turn),
    so a long run does not grow the data."""
    distinct = [random_batch(cfg, seed=10_000 * (args.seed + 1) + i) for i in range(min(total, 16))]
    global_batches = [distinct[i % len(distinct)] for i in range(total)]
    b = cfg.global_batch // WORLD
    micro = [(x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]) for x, y in global_batches]
    return {"cfg": cfg, "seed": args.seed, "global_batches": global_batches, "micro": micro, "model": args.model,
            "frozen_dtype": getattr(torch, args.frozen_dtype) if args.frozen_dtype else None,
            "param_dtype": getattr(torch, args.param_dtype) if args.param_dtype else None}


def preimport(key: str, model: str) -> None:
    """Import what the system's and the model's code imports, before the RSS baseline:
    libraries cost RSS once per process, whatever the model (``import fzero.dist`` about
    74 MiB, ``torch._inductor`` about 44 MiB on this machine), and that is not training
    memory."""
    import importlib

    import bench_gloo_step  # noqa: F401
    import fzero.testing.census  # noqa: F401 - the census step's own imports

    mods = ["torch.nn.parallel"]
    if key == "fsdp":
        mods += ["torch.distributed.fsdp", "torch.distributed.device_mesh"]
    if key.startswith("fzero-"):
        mods += ["fzero", "fzero.dist", "fzero.step"]
        if "c" in key[len("fzero-"):]:
            mods += ["torch._dynamo", "torch._inductor.compile_fx"]
    if key.startswith("ds-"):
        mods += ["deepspeed"]
    if model == "hf-gpt2":
        mods += ["transformers.models.gpt2.modeling_gpt2"]
    if model == "tiny-lora":
        mods += ["peft"]
    for m in mods:
        importlib.import_module(m)


def build_system(key: str, ctx: dict):
    """A ``bench_gloo_step.Runner`` for ``key``; DeepSpeed ZeRO-3 too."""
    import bench_gloo_step as bgs

    if key == "ds-z3":
        return bgs.make_deepspeed_runner(3, ctx)
    return bgs.build_runner(key, ctx)


def census_step(runner, i: int) -> dict:
    """Run step ``i`` inside a :class:`Census`: bytes at its peak by category."""
    from fzero.testing.census import Census

    # No local may keep the state alive through the step (the census holds no tensors).
    c = Census({"state": runner.tensors().get("state", []),
                "new st.": lambda: runner.tensors().get("state", []),
                "module": runner.tensors().get("module", [])})
    with c:
        runner.step(i)
    cats = c.by_category
    out = {"state": cats.get("state", 0), "new st.": cats.get("new st.", 0), "module": cats.get("module", 0),
           "other": cats.get("other", 0), "total": c.total_at_peak, "end": c.end_bytes,
           "missed": c.missed_frees, "scope_peaks": c.scope_peaks, "predicted": dict(runner.step_buffers),
           "predicted peak": runner.step_peak, "table": c.table(),
           "joint": c.joint_peak(("fzero::gather", "fzero::grad_reduction")),
           "unseen": c.unseen_bytes(at_ns=c.peak_ns)}
    if c.allocator_peak_bytes is not None:  # a state on a GPU: the census counted that device (module doc)
        out["device"], out["allocator peak"] = str(c.device), c.allocator_peak_bytes
    return out


def measure(key: str, ctx: dict, args: argparse.Namespace) -> dict:
    """The numbers of one system on this rank (module doc)."""
    import torch.distributed as dist

    preimport(key, ctx["model"])
    gc.collect()
    dist.barrier()
    can_reset = reset_peak_rss()
    base, heap0 = rss_bytes(), malloc_in_use()
    cuda0 = cuda_before()
    runner = build_system(key, ctx)
    out = {"init_peak": peak_rss_bytes() - base, "peak_reset": can_reset}
    cuda = cuda_reader(runner)  # None: the state is on the CPU, and nothing below reads CUDA
    if cuda is not None:
        out["cuda"] = {"init_peak": cuda.read().peak_allocated - cuda0.allocated}
    for i in range(args.warmup):
        runner.step(i)
    out["inductor_cache"] = inductor_cache_use()
    reset_peak_rss()
    if cuda is not None:
        cuda.reset_peak()
    dist.barrier()
    if args.long:
        marks = sorted({max(1, args.long * k // 4) for k in (1, 2, 3, 4)})
        out["long"] = {}
        for n in range(1, args.long + 1):
            runner.step(args.warmup + n - 1)
            if n in marks:
                heap = malloc_in_use()
                out["long"][n] = [rss_bytes() - base, heap - heap0 if heap is not None and heap0 is not None else None]
                if cuda is not None:
                    out["long"][n].append(cuda.read().allocated - cuda0.allocated)
        out["step_peak"] = peak_rss_bytes() - base
        return out
    times, faults = [], []
    for i in range(args.warmup, args.warmup + args.steps):
        f, t = minor_faults(), time.perf_counter()
        runner.step(i)
        times.append(time.perf_counter() - t)
        faults.append(minor_faults() - f)
    out["step_peak"] = peak_rss_bytes() - base
    dist.barrier()
    time.sleep(SETTLE)
    out["held"] = rss_bytes() - base
    if cuda is not None:
        now = cuda.read()
        out["cuda"].update(step_peak=now.peak_allocated - cuda0.allocated, held=now.allocated - cuda0.allocated,
                           reserved=now.reserved - cuda0.reserved)
    heap = malloc_in_use()
    out["heap"] = heap - heap0 if heap is not None and heap0 is not None else None
    out["ms"] = statistics.median(times) * 1e3
    out["faults"] = statistics.median(faults)
    out["census"] = census_step(runner, args.warmup + args.steps)
    out["note"] = runner.note
    return out


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=max(120, args.timeout)))
    rank = dist.get_rank()
    cfg = config_of(args)
    total = args.warmup + (args.long or args.steps + 1)
    ctx = make_ctx(cfg, args, total, rank)
    try:
        res = measure(args.system, ctx, args)
    except Exception as e:  # noqa: BLE001 - reported as the system's row
        res = {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]}
        traceback.print_exc(limit=4)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, res)
    if rank == 0:
        from fzero.host_malloc import large_pages

        n_params = sum(p.numel() for p in build(args.model, cfg, args.seed).parameters())
        print(RESULT + json.dumps({"ranks": everyone, "n_params": n_params, "large_pages": large_pages()}),
              flush=True)
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- launcher
def launch(key: str, args: argparse.Namespace) -> dict:
    """One system in its own torchrun launch (2 ranks); its ranks' results, or an error."""
    from fzero.testing import run_torchrun

    env_ds = os.environ.get("DS_ACCELERATOR")
    os.environ["DS_ACCELERATOR"] = "cpu"  # read by DeepSpeed at import, in the ranks
    try:
        rc, out = run_torchrun(WORLD, os.path.abspath(__file__), ["--system", key, *model_args(args)],
                               timeout=args.timeout, pythonpath=[HERE, os.path.dirname(HERE)])
    finally:
        if env_ds is None:
            os.environ.pop("DS_ACCELERATOR", None)
        else:
            os.environ["DS_ACCELERATOR"] = env_ds
    for line in out.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    why = f"timed out after {args.timeout:.0f}s (killed)" if rc is None else f"exit code {rc}"
    tail = [ln for ln in out.strip().splitlines() if ln.strip() and not ln.startswith("USDT:")][-3:]
    return {"error": why + (": " + " | ".join(tail) if tail else "")[:400]}


# the CUDA allocator's columns (module doc): header, key of a rank's result["cuda"]
CUDA_COLUMNS = (("cu init", "init_peak"), ("cu step", "step_peak"), ("cu held", "held"), ("cu resv", "reserved"))


def _mib(x: float) -> str:
    return f"{x / MIB:.1f}"


def _failure(res: dict) -> str | None:
    return res.get("error") or next((r["error"] for r in res.get("ranks", []) if "error" in r), None)


def format_table(args: argparse.Namespace, results: dict[str, dict]) -> str:
    """The per-system table (module doc); ``results``: key -> a launch's result."""
    cols = ["init peak", "step peak", "held", "heap", "ms/step", "kflt/step", "state", "new st.", "module", "other",
            "total", "/peak"]
    # the CUDA allocator's columns only where a system's state was on a GPU (module doc): a CPU table is unchanged
    on_cuda = any("cuda" in r for res in results.values() if not _failure(res) for r in res["ranks"])
    if on_cuda:
        cols += [c for c, _ in CUDA_COLUMNS]
    head = f"{'system':<11} " + " ".join(f"{c:>9}" for c in cols) + "  note"
    lines = [head, "-" * len(head)]
    for key, res in results.items():
        err = _failure(res)
        if err:
            lines.append(f"{key:<11} FAILED: {err}")
            continue
        ranks = res["ranks"]
        top = {k: max(r[k] for r in ranks) for k in ("init_peak", "step_peak", "held")}
        heaps = [r["heap"] for r in ranks if r.get("heap") is not None]
        c = ranks[0]["census"]
        cells = [_mib(top["init_peak"]), _mib(top["step_peak"]), _mib(top["held"]),
                 _mib(max(heaps)) if heaps else "-", f"{ranks[0]['ms']:.1f}",
                 f"{ranks[0]['faults'] / 1e3:.1f}" if "faults" in ranks[0] else "-",
                 *(_mib(c[k]) for k in ("state", "new st.", "module", "other", "total")),
                 f"{c['total'] / max(ranks[0]['step_peak'], 1):.2f}"]
        if on_cuda:
            cells += [_mib(max(r["cuda"][k] for r in ranks)) if all("cuda" in r for r in ranks) else "-"
                      for _, k in CUDA_COLUMNS]
        note = ranks[0]["note"] + (f"; census missed {c['missed']} frees" if c["missed"] else "")
        if ranks[0].get("inductor_cache"):
            hits, misses = ranks[0]["inductor_cache"]
            note += f"; inductor cache {'warm' if not misses else 'cold'} ({hits} hits, {misses} misses)"
        if not ranks[0].get("peak_reset", True):
            note += "; peak RSS could not be reset: peaks are since process start"
        lines.append(f"{key:<11} " + " ".join(f"{x:>9}" for x in cells) + f"  {note}")
    lines.append("heap: malloc's live bytes after the timed steps minus the baseline (mallinfo2); "
                 "held - heap: freed memory malloc keeps; kflt/step: rank 0's minor page faults per timed step "
                 "(median, thousands)")
    pages = {tuple(r["large_pages"]) for r in results.values() if "large_pages" in r}
    for on, why in sorted(pages):
        lines.append(f"huge pages {'on' if on else 'off'} in the ranks: {why}")
    return "\n".join(lines)


def format_details(results: dict[str, dict]) -> str:
    """Each system's census table (rank 0): categories, the operators that allocated most of
    the unnamed bytes, totals."""
    out = []
    for key, res in results.items():
        if not _failure(res):
            census = res["ranks"][0]["census"]
            out += [f"census of {key} (rank 0, one step):", census["table"]]
            for scope, want in census.get("predicted", {}).items():
                got = census["scope_peaks"].get(scope, 0)
                out.append(f"memory_report predicts {scope} {want / MIB:.2f} MiB; census: {got / MIB:.2f} MiB")
            stage3 = key.startswith("fzero-s3") and "c" not in key[len("fzero-s3"):]
            if "allocator peak" in census:  # a state on a GPU: the allocator's own count beside the replay's
                out.append(f"{census['device']} caching allocator: {census['allocator peak'] / MIB:.2f} MiB allocated "
                           f"at the step's peak above before it (census of the profiler's events: "
                           f"{census['total'] / MIB:.2f} MiB live at its peak, the state included)")
            if census.get("predicted peak") is not None and stage3:
                # the gathers and the reductions together, against the census's joint peak
                out.append(f"memory_report predicts fzero::gather and fzero::grad_reduction together "
                           f"(step_peak) {census['predicted peak'] / MIB:.2f} MiB; census: "
                           f"{census.get('joint', 0) / MIB:.2f} MiB")
            elif census.get("predicted peak") is not None:
                # at the step's peak (after backward) the step's allocations are its gradient memory
                unseen = census.get("unseen", 0)
                out.append(f"memory_report predicts the step's gradient memory at its peak (step_peak) "
                           f"{census['predicted peak'] / MIB:.2f} MiB; census at the step's peak: "
                           f"other {census['other'] / MIB:.2f} MiB"
                           + (f", of which {unseen / MIB:.2f} MiB freed on gloo's thread (no free seen)"
                              if unseen >= 0.01 * MIB else ""))
            elif stage3:
                out.append("memory_report predicts no stage-3 gathers or reductions here (the communicator "
                           "does not say what they allocate, or the layout is not replayed: fzero.memory)")
            out.append("")
    return "\n".join(out)


def format_long(args: argparse.Namespace, results: dict[str, dict]) -> str:
    """RSS minus baseline at the checkpoints of a ``--long`` run (max over ranks)."""
    lines = []
    for key, res in results.items():
        err = _failure(res)
        if err:
            lines.append(f"{key:<11} FAILED: {err}")
            continue
        ranks = res["ranks"]
        marks = sorted(int(n) for n in ranks[0]["long"])
        if not lines:
            lines.append(f"{'system':<11} {'':<5}" + " ".join(f"{'step ' + str(n):>10}" for n in marks)
                         + f" {'MB/step':>9}   (minus the baseline, MiB, max over ranks)")
        for what, j in (("RSS", 0), ("heap", 1), ("cuda", 2)):  # cuda: a state on a GPU, allocated (module doc)
            vals = [[r["long"][str(n)][j] if len(r["long"][str(n)]) > j else None for r in ranks] for n in marks]
            if any(v is None for vs in vals for v in vs):
                continue
            top = [max(vs) for vs in vals]
            growth = (top[-1] - top[0]) / max(marks[-1] - marks[0], 1) / 1e6
            lines.append(f"{key if j == 0 else '':<11} {what:<5}" + " ".join(f"{v / MIB:>10.1f}" for v in top)
                         + f" {growth:>9.3f}")
    lines.append("RSS: /proc/self/statm; heap: malloc's live bytes (mallinfo2); MB/step: from the first "
                 "checkpoint to the last" + ("; cuda: the caching allocator's bytes allocated" if any(
                     len(v) > 2 for res in results.values() if not _failure(res) for r in res["ranks"]
                     for v in r["long"].values()) else ""))
    return "\n".join(lines)


def header(args: argparse.Namespace, n_params: int | None) -> str:
    cfg = config_of(args)
    name = {"tiny": "TinyGPT", "tiny-lora": f"TinyGPT with LoRA r={LORA_RANK} on {', '.join(LORA_TARGETS)}, the rest "
            "frozen"}.get(args.model, "transformers GPT-2 (tied)")
    size = f"{n_params:,} parameters ({n_params * 4 / MIB:.1f} MiB fp32)" if n_params else "parameters: ?"
    if n_params and args.model == "tiny-lora":
        trainable = sum(p.numel() for p in build(args.model, cfg, args.seed).parameters() if p.requires_grad)
        size += f", {trainable:,} trainable"
    run = f"{args.long} steps after {args.warmup} warm-up" if args.long else \
        f"{args.warmup} warm-up + {args.steps} timed steps + 1 census step"
    return (f"model: {name} vocab={cfg.vocab} d_model={cfg.d_model} layers={cfg.n_layers} heads={cfg.n_heads} "
            f"seq={cfg.seq_len} global batch {cfg.global_batch}; {size}\n"
            f"gloo W={WORLD}, 1 thread/rank, AdamW fp32, torch {torch.__version__}; {run}; one torchrun launch "
            f"per system; MiB per rank (max over ranks)" + ("" if args.long else ", census on rank 0"))


def with_size(args: argparse.Namespace, size: str) -> argparse.Namespace:
    """``args`` with the model flags of :data:`SIZES` ``[size]``."""
    c = SIZES[size]
    return argparse.Namespace(**{**vars(args), "vocab": c.vocab, "d_model": c.d_model, "layers": c.n_layers,
                                 "heads": c.n_heads, "seq": c.seq_len, "batch": c.global_batch, "sizes": []})


def format_sizes(per_size: dict[str, dict[str, dict]]) -> str:
    """ms/step of every system at every size, and its ratio to ddp-fused's at that size (where it ran)."""
    systems = list(dict.fromkeys(k for results in per_size.values() for k in results))
    head = f"{'system':<11} " + " ".join(f"{size:>16}" for size in per_size)
    lines = ["ms/step (median of the timed steps, rank 0) and x ddp-fused, per model size", head, "-" * len(head)]
    for key in systems:
        cells = []
        for results in per_size.values():
            res, ref = results.get(key), results.get("ddp-fused")
            if res is None or _failure(res):
                cells.append(f"{'-':>16}")
                continue
            ms = res["ranks"][0]["ms"]
            ratio = f" ({ms / ref['ranks'][0]['ms']:.2f}x)" if ref is not None and not _failure(ref) else ""
            cells.append(f"{f'{ms:.1f}{ratio}':>16}")
        lines.append(f"{key:<11} " + " ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if "LOCAL_RANK" in os.environ:
        worker(args)
        return 0
    if args.sizes:  # each size as its own run of every system, then the summary
        per_size = {}
        for size in args.sizes:
            print(f"== {size}", file=sys.stderr, flush=True)
            per_size[size] = run_systems(with_size(args, size))
        print(format_sizes(per_size))
        return 0 if not any(_failure(r) for rs in per_size.values() for r in rs.values()) else 1
    results = run_systems(args)
    return 0 if not any(_failure(r) for r in results.values()) else 1


def run_systems(args: argparse.Namespace) -> dict[str, dict]:
    """Every system of ``args`` in its own launch; prints each one's rows as it ends, then the whole table."""
    results = {}
    for key in args.systems:
        t = time.perf_counter()
        results[key] = launch(key, args)
        print(f"  {key}: {time.perf_counter() - t:.0f}s" + (" FAILED" if "error" in results[key] else ""),
              file=sys.stderr, flush=True)
        # each system's rows as soon as its launch ends: a long run stopped half-way keeps them
        one = {key: results[key]}
        print(format_long(args, one) if args.long else format_table(args, one), file=sys.stderr, flush=True)
    n_params = next((r["n_params"] for r in results.values() if "n_params" in r), None)
    print(header(args, n_params))
    if args.long:
        print(format_long(args, results))
    else:
        print(format_table(args, results))
        print()
        print(format_details(results))
    return results


if __name__ == "__main__":
    sys.exit(main())
