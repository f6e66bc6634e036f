"""Testing and measurement utilities, unused by training code: :class:`FaultyWorld` (``faults``), :class:`Census`
(``census``), :class:`GatherTracker`, :func:`run_torchrun`, hypothesis strategies (``strategies``, not imported here).

Imports: comm, census, faults.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from ..comm import Communicator, ReduceOp
from .census import Census
from .faults import CorruptResult, Delay, FaultRecord, FaultyWorld, GradFault

__all__ = ["Census", "CorruptResult", "Delay", "FaultRecord", "FaultyWorld", "GatherTracker", "GradFault",
           "run_torchrun"]


def run_torchrun(nproc: int, script: str, args: Sequence[str], *, timeout: float, pythonpath: Sequence[str] = (),
                 capture: bool = True) -> tuple[int | None, str]:
    """Run ``script`` under ``torch.distributed.run`` on ``nproc`` local ranks in a new session, killing torchrun and
    every rank on timeout, Ctrl-C or any other exit: ``(exit code or None on timeout, output)`` (``capture=False``:
    printed, not returned). Ranks get ``pythonpath`` prepended to ``PYTHONPATH``, a shared inductor cache, and unless
    set ``OMP_NUM_THREADS=1`` and ``PYTHONFAULTHANDLER=1`` (a crash in C code prints every thread's Python stack)."""
    cmd = [sys.executable, "-m", "torch.distributed.run",
           "--standalone", "--nnodes", "1", "--nproc-per-node", str(nproc), script, *args]
    env = {"OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1",
           "TORCHINDUCTOR_CACHE_DIR": os.path.join(tempfile.gettempdir(), "fzero-inductor"), **os.environ}
    env["PYTHONPATH"] = os.pathsep.join([*pythonpath, env.get("PYTHONPATH", "")])
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log if capture else None, stderr=subprocess.STDOUT if capture else None,
                                env=env, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            if proc.poll() is None:
                # each rank has a session of its own: find them while torchrun is still their parent, then kill all
                for pid in [proc.pid, *_descendants(proc.pid)]:
                    with contextlib.suppress(ProcessLookupError):  # SIGKILL the group pid leads, if any, and pid
                        if os.getpgid(pid) == pid:
                            os.killpg(pid, signal.SIGKILL)
                        os.kill(pid, signal.SIGKILL)
                proc.wait()
        log.seek(0)
        return rc, log.read() if capture else ""


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` in the process tree (Linux ``/proc``; elsewhere none)."""
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []
    children: dict[int, list[int]] = {}
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class GatherTracker(Communicator):
    """Wraps a communicator and measures the all-gathered bytes (per local rank) alive at once: each ``all_gather``
    output counts until its last reference (or a view's) is dropped; ``peak_bytes``: the high-water mark."""

    def __init__(self, inner: Communicator):
        self.wrapping(inner, capabilities=False)
        self.live_bytes = self.peak_bytes = 0

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def _release(self, nbytes: int) -> None:
        self.live_bytes -= nbytes

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner.all_gather(x)
        nbytes = out[0].numel() * out.element_size()
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(out, self._release, nbytes)
        return out

    def all_reduce(self, x: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        return self.inner.all_reduce(x, op)

    def reduce_scatter(self, x: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        return self.inner.reduce_scatter(x, op)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        return self.inner.broadcast(x, src)  # module buffers: untouched and uncounted

    def check_layout(self, layout: Any) -> None:
        self.inner.check_layout(layout)
