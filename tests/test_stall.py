"""A stalled peer under ``TorchCommunicator(timeout=...)``: the waiting rank fails with a
:class:`fzero.CollectiveError` naming the collective and the step, within the timeout + 10 s,
eagerly and in a compiled step (whose gloo collectives are fzero's operators, waited for inside
the graph within the timeout).

Two gloo processes on localhost, started here (not by torchrun) in their own sessions, so
that the test owns them: both are killed whatever happens (a stopped rank never exits).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import fzero
import fzero.dist
from stall_worker import STALL_AT

HERE = Path(__file__).resolve().parent
TIMEOUT = 4.0
STARTUP = 90.0  # importing torch and joining the group, on a shared 2-core machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # SIGKILL ends a stopped process too
        except ProcessLookupError:
            pass
    proc.wait()


def _stall_pair(tmp_path: Path, argv: list[str], wait: float, out: Path) -> None:
    """Start ``argv`` as ranks 0 and 1 of a gloo group, in sessions of their own; rank 0 must exit with status 3
    (its error written to ``out``) within ``wait`` s while rank 1 is still stalled; both are killed in the end."""
    port = _free_port()
    procs = []
    try:
        for rank in (0, 1):
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
                   "RANK": str(rank), "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1",
                   "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
            procs.append(subprocess.Popen(argv, env=env, stdout=open(tmp_path / f"rank{rank}.log", "w"),
                                          stderr=subprocess.STDOUT, start_new_session=True))
        try:
            code = procs[0].wait(timeout=wait)
        except subprocess.TimeoutExpired:
            pytest.fail("rank 0 was still blocked: " + (tmp_path / "rank0.log").read_text()[-2000:])
        logs = "\n".join((tmp_path / f"rank{r}.log").read_text()[-2000:] for r in (0, 1))
        assert code == 3 and out.exists(), logs
        assert procs[1].poll() is None  # the stalled rank is still there: rank 0 did not wait for it
    finally:
        for p in procs:
            _kill(p)


@pytest.mark.distributed
@pytest.mark.parametrize("mode,compiled", [("sigstop", False), ("sleep", False), ("sleep", True)])
def test_stalled_peer_fails_with_a_named_error_within_the_timeout(mode, compiled, tmp_path):
    out = tmp_path / "error.json"
    _stall_pair(tmp_path, [sys.executable, str(HERE / "stall_worker.py"), mode, str(TIMEOUT), str(out),
                           *(["compiled"] if compiled else [])], STARTUP + TIMEOUT + 10, out)
    got = json.loads(out.read_text())
    assert got["waited"] < TIMEOUT + 10, got
    assert got["step"] == STALL_AT, got
    assert got["collective"] and got["collective"] in got["error"], got
    assert f"during step {STALL_AT}" in got["error"] and f"within {TIMEOUT:g} s" in got["error"], got
    assert got["error"].startswith("rank 0: collective "), got


DEFAULT_WORKER = """
import datetime, json, os, sys, time
import torch
import torch.distributed as dist
import fzero
import fzero.dist
from fzero.dist import TorchCommunicator

out, lowered, stall = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))  # far longer: the communicator's acts
got = {"default": TorchCommunicator().timeout, "unbounded": TorchCommunicator(timeout=float("inf")).timeout}
fzero.dist.DEFAULT_TIMEOUT = lowered
comm = TorchCommunicator()  # no timeout given: the module's default, read now
got["timeout"] = comm.timeout
if comm.rank == 1:
    print("rank 1 stalls", flush=True)
    time.sleep(stall)
    os._exit(0)
started = time.monotonic()
try:
    comm.all_reduce(torch.ones(1, 4))
except fzero.CollectiveError as e:
    got.update(error=str(e), waited=time.monotonic() - started)
    with open(out, "w") as f:
        json.dump(got, f)
    os._exit(3)
os._exit(0)
"""


@pytest.mark.distributed
def test_default_timeout_bounds_a_stalled_peer(tmp_path):
    """``TorchCommunicator()`` without a timeout is bounded by ``fzero.dist.DEFAULT_TIMEOUT`` (read when it is
    built): lowered to 3 s in the workers, rank 0's all-reduce fails with a CollectiveError long before rank 1's
    60 s stall ends."""
    lowered, stall = 3.0, 60.0
    script, out = tmp_path / "default_worker.py", tmp_path / "error.json"
    script.write_text(DEFAULT_WORKER)
    _stall_pair(tmp_path, [sys.executable, str(script), str(out), str(lowered), str(stall)], STARTUP + lowered + 10,
                out)
    got = json.loads(out.read_text())
    assert got["default"] == fzero.dist.DEFAULT_TIMEOUT == 600.0, got
    assert got["unbounded"] is None and got["timeout"] == lowered, got
    assert got["waited"] < lowered + 10 < stall, got
    assert f"within {lowered:g} s" in got["error"] and got["error"].startswith("rank 0: collective all_reduce"), got


def test_collective_error_names_collective_and_step():
    e = fzero.CollectiveError("all_gather of 64 torch.float32", 1, 5.0, "Operation timed out!")
    assert "step" not in str(e) and "within 5 s" in str(e)
    at = e.at_step(7)
    assert at.step == 7 and "collective all_gather of 64 torch.float32 during step 7" in str(at)
    import pickle

    assert str(pickle.loads(pickle.dumps(at))) == str(at)
