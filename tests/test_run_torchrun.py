"""``fzero.testing.run_torchrun`` bounds a launch: on timeout torchrun and every rank it started
are killed. torchrun starts each rank in a session of its own, so killing torchrun's process
group alone left the ranks running (found when a timed-out benchmark launch kept its two ranks
busy for twenty minutes after its row said "killed")."""

from __future__ import annotations

import os
import time

import pytest

from fzero.testing import run_torchrun

# Each rank writes its pid and sleeps far longer than the launch's timeout.
_RANK = """
import os, sys, time
with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.pid"), "w") as f:
    f.write(str(os.getpid()))
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process tree from /proc")
def test_a_timed_out_launch_kills_every_rank(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text(_RANK)
    # torchrun imports torch (2-5 s on a loaded 2-core machine) and starts two ranks that do not
    # import it; the launch waits for the whole deadline, so it is kept short
    deadline = 15.0
    rc, _ = run_torchrun(2, str(script), [str(tmp_path)], timeout=deadline)
    assert rc is None  # timed out
    pids = [int((tmp_path / f"rank{r}.pid").read_text()) for r in range(2) if (tmp_path / f"rank{r}.pid").exists()]
    assert len(pids) == 2, "the ranks did not start within the launch's timeout"
    end = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)], "ranks survived their launch's timeout"


_ABORTING_RANK = """
import os


def crash_inside_c_code():
    os.abort()  # as glibc aborts on a corrupted heap


crash_inside_c_code()
"""


def test_a_rank_killed_by_a_signal_prints_its_python_stack(tmp_path):
    """torchrun reports only "Signal 6 (SIGABRT)"; the rank's Python stack says where it was."""
    script = tmp_path / "aborter.py"
    script.write_text(_ABORTING_RANK)
    rc, text = run_torchrun(1, str(script), [], timeout=60)
    assert rc not in (None, 0), text
    assert "Fatal Python error: Aborted" in text, text
    assert "crash_inside_c_code" in text, text



def test_a_failed_launch_reports_the_crashed_ranks_stack_before_the_tail():
    """A rank of a compiled step imports one extension module per kernel: the faulthandler's list
    of them and torchrun's report once filled the 6000-character tail a failed launch reports,
    and the stack of a rank that segfaulted was lost. The harness puts the stacks first."""
    from dist_harness import crash_stacks

    stack = ("Fatal Python error: Segmentation fault\n\nThread 0x0001 (most recent call first):\n"
             '  File "/w/dist_cases.py", line 344 in memory_growth\n'
             '  File "/w/dist_harness.py", line 43 in worker_main\n\n')
    modules = "Extension modules: " + ", ".join(f"c{i:050d}.kernel" for i in range(200)) + " (total: 200)\n"
    text = "[rank1]: waiting at the barrier\n" + stack + modules + "torchrun's report\n" * 100
    assert "memory_growth" not in text[-6000:]
    got = crash_stacks(text)
    assert "Segmentation fault" in got and "line 344 in memory_growth" in got and "worker_main" in got
    assert "Extension modules" not in got and "barrier" not in got
    assert crash_stacks("torchrun's report\n" * 3) == ""
