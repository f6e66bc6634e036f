"""Testing and measurement utilities (not used by training code).

* :class:`FaultyWorld` (``fzero.testing.faults``): a communicator wrapper that
  injects faults (non-finite gradients, a corrupted collective result, a
  delayed rank) at given steps and records what it did;
* :mod:`fzero.testing.strategies`: hypothesis strategies for property tests
  of training code (needs ``hypothesis``: ``pip install fzero[testing]``;
  ``import fzero.testing`` works without it);
* :class:`GatherTracker` (live gathered bytes), :func:`run_torchrun`;
* :class:`Census` (``fzero.testing.census``): live CPU tensor bytes of a block
  at its peak, by what holds them (the profiler's allocator events, replayed).

Imports: ``fzero.comm``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import weakref
from typing import Any, Optional, Sequence

import torch

from ..comm import Communicator, ReduceOp
from .census import Census
from .faults import CorruptResult, Delay, FaultRecord, FaultyWorld, GradFault

__all__ = [
    "Census",
    "CorruptResult",
    "Delay",
    "FaultRecord",
    "FaultyWorld",
    "GatherTracker",
    "GradFault",
    "run_torchrun",
]


def run_torchrun(
    nproc: int,
    script: str,
    args: Sequence[str],
    *,
    timeout: float,
    pythonpath: Sequence[str] = (),
    capture: bool = True,
) -> tuple[Optional[int], str]:
    """Run ``script`` under PyTorch's launcher (``torch.distributed.run``) on ``nproc``
    local ranks, in a new session, and kill torchrun with every rank on timeout,
    on Ctrl-C, or if it is left running for any reason.

    Returns ``(exit code or None on timeout, output)``; the output is empty
    when ``capture=False`` (it goes to this process's stdout). Ranks get
    ``OMP_NUM_THREADS=1`` unless set, ``pythonpath`` prepended to
    ``PYTHONPATH``, a shared inductor cache, and ``PYTHONFAULTHANDLER=1`` unless
    set (a rank killed by a signal, a crash inside C code, prints every thread's
    Python stack: torchrun alone reports only the signal).
    """
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", "--nnodes", "1", "--nproc-per-node", str(nproc), script, *args,
    ]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join([*pythonpath, env.get("PYTHONPATH", "")])
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "fzero-inductor"))
    env.setdefault("PYTHONFAULTHANDLER", "1")
    with tempfile.TemporaryFile("w+") as log:
        out = log if capture else None
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if capture else None,
                                env=env, start_new_session=True)
        rc: Optional[int] = None
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            if proc.poll() is None:
                # torchrun starts every rank in a session of its own, so killing torchrun's
                # group alone leaves the ranks running: find them (and what they started)
                # while torchrun is still their parent, then kill all of them
                ranks = _descendants(proc.pid)
                for pid in [proc.pid, *ranks]:
                    _kill_group_and_process(pid)
                proc.wait()
        log.seek(0)
        return rc, log.read() if capture else ""


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` in the process tree (Linux ``/proc``; elsewhere none)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
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


def _kill_group_and_process(pid: int) -> None:
    """SIGKILL ``pid``'s process group, when ``pid`` leads it, and ``pid`` itself."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class GatherTracker(Communicator):
    """Wraps a communicator and measures how many all-gathered bytes are alive at once.

    Every ``all_gather`` output is tracked until the last reference to it (or
    to a view of it) is dropped, so ``peak_bytes`` is the true high-water
    mark of gathered parameters in an eager step. Bytes are per local rank.
    """

    def __init__(self, inner: Communicator):
        self.inner = inner
        self.world_size = inner.world_size
        self.local_ranks = inner.local_ranks
        self.ranks = inner.ranks
        self.live_bytes = 0
        self.peak_bytes = 0

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
        # module buffers, not parameters: passed through untouched and uncounted
        return self.inner.broadcast(x, src)

    def check_layout(self, layout: Any) -> None:
        self.inner.check_layout(layout)
