"""Run a worker script under torchrun (gloo, localhost) with a hard time limit.

The launcher is PyTorch's own (``python -m torch.distributed.run``), started in
a new session so that on timeout or failure the whole process group (torchrun
and every rank) is killed. Each rank saves its results to ``out_dir/rank{r}.pt``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from fzero.testing import run_torchrun as run_torchrun_bounded

HERE = Path(__file__).resolve().parent


def worker_main(run_case: Any, args: list[str]) -> None:
    """The body of a torchrun worker: ``args = [OUT_DIR, CASE, ...]``.

    Joins the gloo process group, runs ``run_case(name, comm)`` for each case
    (an exception is recorded as ``{"exception": traceback}`` so that one
    failure does not hide the others; a barrier keeps ranks in step), and
    saves the results to ``OUT_DIR/rank{r}.pt``.
    """
    import traceback

    import torch.distributed as dist

    from fzero.dist import TorchCommunicator

    out_dir, names = args[0], args[1:]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    comm = TorchCommunicator()
    results: dict[str, Any] = {}
    for name in names:
        try:
            results[name] = run_case(name, comm)
        except Exception:  # noqa: BLE001 - recorded and reported by the test
            results[name] = {"exception": traceback.format_exc()}
        dist.barrier()
    torch.save(results, os.path.join(out_dir, f"rank{comm.rank}.pt"))
    dist.destroy_process_group()


def run_torchrun_script(nproc: int, script: str, args: list[str], timeout: float = 300.0) -> str:
    """Run ``script`` under torchrun on ``nproc`` local ranks; return its output.

    Raises ``TimeoutError`` (after torchrun and every rank were killed) past
    ``timeout`` seconds, ``RuntimeError`` with the output on a non-zero exit.
    """
    rc, text = run_torchrun_bounded(nproc, script, args, timeout=timeout, pythonpath=[str(HERE), str(HERE.parent)])
    if rc is None:
        raise TimeoutError(f"torchrun with {nproc} ranks exceeded {timeout}s and was killed:\n{text[-4000:]}")
    if rc != 0:
        raise RuntimeError(f"torchrun with {nproc} ranks failed (exit {rc}):\n{crash_stacks(text)}{text[-6000:]}")
    return text


def crash_stacks(text: str) -> str:
    """The Python stacks a rank killed by a signal printed (``PYTHONFAULTHANDLER``), each up to
    its list of extension modules: a long list (one module per compiled kernel) and torchrun's
    report would push them out of the output's tail."""
    out, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Fatal Python error"):
            end = next((j for j in range(i, len(lines)) if lines[j].startswith("Extension modules")), len(lines))
            out += lines[i:min(end, i + 200)]
    return "\n".join(out) + "\n...\n" if out else ""


def run_torchrun(nproc: int, script: str, args: list[str], timeout: float = 300.0) -> list[dict[str, Any]]:
    """Run a worker from this folder that saves ``OUT_DIR/rank{r}.pt``; return every rank's results."""
    out_dir = tempfile.mkdtemp(prefix=f"fzero-dist{nproc}-")
    run_torchrun_script(nproc, str(HERE / script), [out_dir, *args], timeout)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(nproc)]
