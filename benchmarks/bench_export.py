"""Peak memory of handing the weights on: ``export_pretrained`` and ``consolidate`` of a checkpoint (offline, one
process each) and the live export (collective, 2 gloo ranks), against the bound they are built to: the largest output
file plus one tensor over the process's base.

    python benchmarks/bench_export.py [--size 162M|7M] [--timeout 900]

1. One torchrun launch of 2 gloo ranks trains the TinyGPT (``benchmarks/models.py``; 162M: GPT-2-small size, untied
   head) one step at stage 2, saves its checkpoint, then exports the live state (every tensor gathered in turn, rank 0
   writes); each rank reports its RSS just before the export (the base: the state and the model live) and its peak
   during it (``VmHWM``, reset just before through ``/proc/self/clear_refs``).
2. Each offline job in a fresh process: ``export`` (default 5GB files: one file), ``export --max-shard-size 200MB``,
   ``export --dtype bf16`` and ``consolidate`` (one ``torch.save`` file of the whole model: its bound is the model).
   Base: the RSS after the imports, just before the call; peak: ``VmHWM`` during it.

Columns: base and peak RSS (MiB), peak - base, the bound (largest output file + largest tensor written), and
(peak - base) / bound. Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import torch  # noqa: E402

from bench_memory import SIZES, peak_rss_bytes, reset_peak_rss, rss_bytes  # noqa: E402

RESULT = "BENCH_EXPORT_RESULT "
MIB = 2.0**20


def _largest_file(out: Path) -> int:
    return max(f.stat().st_size for f in out.iterdir() if f.is_file())


def _largest_tensor(root: Path, dtype: torch.dtype | None) -> int:
    """Bytes of the largest tensor written (in the output dtype) of the checkpoint at ``root``."""
    from fzero.checkpoint import read_manifest
    from fzero.checkpoint.metadata import DTYPES

    params = read_manifest(root)["params"]
    item = (lambda d: torch.empty((), dtype=dtype or DTYPES[d]).element_size())
    return max(torch.Size(shape).numel() * item(d) for _, shape, d, _ in params)


def ranks(args: argparse.Namespace) -> None:
    """Phase 1, in each gloo rank: train one step, save, export the live state; print this rank's readings."""
    import torch.distributed as dist

    import fzero
    from fzero.checkpoint import export_pretrained, save_checkpoint
    from fzero.dist import TorchCommunicator
    from models import build_model, make_criterion, random_batch

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    comm = TorchCommunicator()
    cfg = SIZES[args.size]
    model = build_model(cfg)
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-4), comm, stage=2)
    step = fzero.make_train_step(fzero.module_loss(model, make_criterion(cfg.vocab)), comm, donate=True)
    state, _ = step(state, comm.split_batch(random_batch(cfg, 0)))
    t0 = time.perf_counter()
    save_checkpoint(state, Path(args.root) / "ckpt", comm, name="trained")
    saved = time.perf_counter() - t0
    out = Path(args.root) / "live"
    dist.barrier()
    base = rss_bytes()
    reset_peak_rss()
    t0 = time.perf_counter()
    export_pretrained(state, out, comm=comm)
    took = time.perf_counter() - t0
    peak = peak_rss_bytes()
    readings = {"rank": comm.rank, "base": base, "peak": peak, "seconds": took, "save_seconds": saved,
                "params": sum(p.numel() for p in model.parameters())}
    box = [None] * comm.world_size
    dist.all_gather_object(box, readings)
    if comm.rank == 0:
        print(RESULT + json.dumps({"ranks": box, "largest_file": _largest_file(out)}), flush=True)
    dist.destroy_process_group()


def offline(args: argparse.Namespace) -> None:
    """Phase 2, in a fresh process: one offline job; print its readings."""
    from fzero.checkpoint import consolidate_checkpoint, export_pretrained

    root, job = Path(args.root), args.job
    out = root / f"out-{job}"
    kwargs = {"export-5GB": {}, "export-200MB": {"max_shard_size": "200MB"},
              "export-bf16": {"dtype": "bf16"}}.get(job)
    base = rss_bytes()
    reset_peak_rss()
    t0 = time.perf_counter()
    if kwargs is None:
        out.mkdir()
        consolidate_checkpoint(root / "ckpt", out / "model.pt")
    else:
        export_pretrained(root / "ckpt", out, **kwargs)
    took = time.perf_counter() - t0
    peak = peak_rss_bytes()
    dtype = torch.bfloat16 if job == "export-bf16" else None
    print(RESULT + json.dumps({"base": base, "peak": peak, "seconds": took, "largest_file": _largest_file(out),
                               "largest_tensor": _largest_tensor(root / "ckpt", dtype),
                               "files": len(list(out.iterdir()))}), flush=True)


def _result(text: str) -> dict:
    for line in text.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    raise RuntimeError("no result:\n" + text[-3000:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="162M")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per launch; then it is killed")
    p.add_argument("--phase", choices=["ranks", "offline"], help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    p.add_argument("--job", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.phase == "ranks":
        ranks(args)
        return 0
    if args.phase == "offline":
        offline(args)
        return 0
    from fzero.testing import run_torchrun

    root = tempfile.mkdtemp(prefix="fzero-bench-export-")
    rc, text = run_torchrun(2, os.path.abspath(__file__), ["--phase", "ranks", "--root", root, "--size", args.size],
                            timeout=args.timeout, pythonpath=[HERE, os.path.dirname(HERE)])
    live = _result(text)
    rows = []
    first = live["ranks"][0]
    tensor = _largest_tensor(Path(root) / "ckpt", None)
    for r in live["ranks"]:
        rows.append((f"live export, gloo rank {r['rank']}", r["base"], r["peak"], r["seconds"],
                     (live["largest_file"] if r["rank"] == 0 else 0) + tensor, 1))
    for job in ("export-5GB", "export-200MB", "export-bf16", "consolidate"):
        run = subprocess.run([sys.executable, os.path.abspath(__file__), "--phase", "offline", "--root", root,
                              "--job", job], capture_output=True, text=True, timeout=args.timeout,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        res = _result(run.stdout + run.stderr)
        rows.append((f"offline {job}", res["base"], res["peak"], res["seconds"],
                     res["largest_file"] + res["largest_tensor"], res["files"]))
    print(f"{first['params'] / 1e6:.1f}M parameters (TinyGPT {args.size}), checkpoint saved by 2 gloo ranks at "
          f"stage 2 in {first['save_seconds']:.1f} s; torch {torch.__version__}; RSS in MiB")
    print(f"{'job':<28} {'files':>5} {'base':>8} {'peak':>8} {'peak-base':>10} {'bound':>8} {'ratio':>6} {'s':>6}")
    for name, base, peak, secs, bound, files in rows:
        print(f"{name:<28} {files:>5} {base / MIB:>8.0f} {peak / MIB:>8.0f} {(peak - base) / MIB:>10.0f} "
              f"{bound / MIB:>8.0f} {(peak - base) / bound:>6.2f} {secs:>6.1f}")
    print("bound: the largest output file + the largest tensor (live ranks other than 0 write nothing: one tensor)")
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
