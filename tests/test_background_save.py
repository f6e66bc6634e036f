"""Saves that do not stop training: ``save_checkpoint(blocking=False)``.

A background save writes the files a blocking save of the same state writes, though donating
steps overwrite the state meanwhile (the snapshot is taken before the call returns); ``LATEST``
moves only once it is complete, so a process killed during the write leaves the previous
checkpoint; a failed write raises at ``wait()``, else at the next save (any root), else is warned
of at exit; one save is in flight at a time. On the simulated world and on 2 gloo ranks
(``bg_save_worker.py``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import fzero
import fzero.checkpoint.background as background
import fzero.checkpoint.checksums as checksums
import fzero.checkpoint.saveload as saveload
from bg_save_worker import donating_train, held
from ckpt_worker import HALF, STEPS, extra_at, fresh, summary
from dist_harness import run_torchrun
from fzero.checkpoint import BackgroundSave, CheckpointError, load_checkpoint, save_checkpoint
from fzero.testing import _descendants

HERE = Path(__file__).resolve().parent

# DCP's one-process notice an error: a writer thread must not emit it (planners.dcp_save), which with warnings
# made errors would fail the write
pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("error:.*assuming the intent is to save in a single process")]


def assert_bitwise(got: Any, ref: Any, where: str = "") -> None:
    """Equal trees: the same dict keys (in any order), every tensor bitwise (dtype, shape, bits), every other
    leaf ``==``."""
    if isinstance(ref, dict):
        assert isinstance(got, dict) and got.keys() == ref.keys(), where
        for k in ref:
            assert_bitwise(got[k], ref[k], f"{where}/{k}")
    elif isinstance(ref, (list, tuple)):
        assert type(got) is type(ref) and len(got) == len(ref), where
        for i, (a, b) in enumerate(zip(got, ref)):
            assert_bitwise(a, b, f"{where}[{i}]")
    elif isinstance(ref, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == ref.dtype and torch.equal(got, ref), where
    else:
        assert got == ref, where


def records(d: Path) -> list[list[Any]]:
    """The records ``checksums.json`` lists (file, offset, length, CRC-32, entry, chunk): the bytes written."""
    return json.loads((d / checksums.CHECKSUMS_FILE).read_text())["records"]


def assert_same_files(bg: Path, blk: Path) -> None:
    assert sorted(p.name for p in bg.iterdir()) == sorted(p.name for p in blk.iterdir())
    assert records(bg) == records(blk)


def failing_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checksum file of every save cannot be written (a full disk at the end of the write)."""

    def full_disk(path: Path, data: bytes) -> None:
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(checksums, "_write_synced", full_disk)


@pytest.fixture(autouse=True)
def nothing_in_flight():
    """Each test starts and ends with no background save in flight (nor a failure left unraised)."""
    background.settle()
    yield
    try:
        background.settle()
    except CheckpointError:
        pass


# -- the same files as a blocking save, while the state trains ---------------------------------------


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_background_save_equals_blocking_save_while_steps_run(tmp_path, monkeypatch, stage):
    """W=2: a blocking save and a background save of one state; the writer is held until 4 donating steps have
    overwritten the state's master and moments in place; the background checkpoint holds the same records
    and loads bitwise equal to the blocking one and to the state as it was."""
    comm = fzero.SimulatedWorld(2)
    state = donating_train(fresh(comm, stage=stage), comm, range(HALF))
    before = summary(state, comm)
    master = state.shard.master[0]
    saved_master = master.clone()
    save_checkpoint(state, tmp_path, comm, name="blk", extra=extra_at(HALF))
    gate = threading.Event()
    monkeypatch.setattr(saveload, "_prepare_tmp", held(saveload._prepare_tmp, gate))
    handle = save_checkpoint(state, tmp_path, comm, name="bg", extra=extra_at(HALF), blocking=False)
    assert isinstance(handle, BackgroundSave) and not handle.done()
    assert (tmp_path / "LATEST").read_text().strip() == "blk"
    donating_train(state, comm, range(HALF, HALF + 4))
    assert not torch.equal(master, saved_master)  # donated: the saved buffers now hold step 12's values
    gate.set()
    assert handle.wait(timeout=60) == tmp_path / "bg" and handle.done()
    assert (tmp_path / "LATEST").read_text().strip() == "bg"
    assert_same_files(tmp_path / "bg", tmp_path / "blk")
    loaded = {}
    for name in ("blk", "bg"):
        state, extra = load_checkpoint(tmp_path / name, fresh(comm, seed=7, stage=stage), comm)
        loaded[name] = summary(state, comm)
        assert_bitwise(extra, extra_at(HALF))
    assert_bitwise(loaded["bg"], loaded["blk"])
    assert_bitwise(loaded["bg"], before)


def test_snapshot_buffers_are_reused_by_a_save_of_the_same_shapes(tmp_path):
    """The second background save of a state of the same shapes copies into the first one's host buffer."""
    comm = fzero.SimulatedWorld(2)
    state = fresh(comm)
    save_checkpoint(state, tmp_path, comm, name="a", blocking=False).wait()
    first = list(background._buffers._held)
    state = donating_train(state, comm, range(1))
    save_checkpoint(state, tmp_path, comm, name="b", blocking=False).wait()
    again = background._buffers._held
    assert len(again) == len(first) > 0 and all(a is b for a, b in zip(again, first))


# -- killed during the write ---------------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE.parent), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return env


def _writing(tmp: Path) -> bool:
    """Some data file of the save in ``tmp`` has its first bytes."""
    try:
        return any(f.stat().st_size > 0 for f in tmp.glob("*.distcp"))
    except FileNotFoundError:
        return False


def kill_during_write(cmd: list[str], root: Path, timeout: float) -> None:
    """Run ``cmd`` in a new session and SIGKILL it and every process below it once the background save of
    ``second`` into ``root`` has written its first bytes; bounded by ``timeout`` seconds."""
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        while not _writing(root / ".tmp-second"):
            if proc.poll() is not None:
                pytest.fail(f"{cmd[-1]} ended (exit {proc.returncode}) before it was killed:\n"
                            f"{proc.stderr.read().decode()[-4000:]}")
            assert time.monotonic() < deadline, "the background save of 'second' never started writing"
            time.sleep(0.0005)
    finally:
        for pid in [proc.pid, *_descendants(proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL


def check_previous_checkpoint_resumes(root: Path, uninterrupted: dict[str, Any]) -> None:
    """``LATEST`` still names ``first`` and ``second`` is unpublished; ``first`` resumes (W=2, the remaining
    8 steps) to the uninterrupted run bitwise; the next save cleans up and publishes."""
    assert (root / "LATEST").read_text().strip() == "first"
    assert not (root / "second").exists() and (root / ".tmp-second").is_dir()
    comm = fzero.SimulatedWorld(2)
    state, extra = load_checkpoint(root, fresh(comm, seed=7), comm)
    assert extra["loader"]["position"] == HALF
    resumed = donating_train(state, comm, range(HALF, STEPS))
    assert_bitwise(summary(resumed, comm), uninterrupted)
    save_checkpoint(resumed, root, comm, name="third", blocking=False).wait()
    assert (root / "LATEST").read_text().strip() == "third"
    assert not any(p.name.startswith(".") for p in root.iterdir())


def test_killed_during_background_write_leaves_previous_checkpoint(tmp_path):
    root = tmp_path / "root"
    kill_during_write([sys.executable, str(HERE / "bg_save_worker.py"), "--sim", str(root)], root, timeout=90)
    comm = fzero.SimulatedWorld(2)
    uninterrupted = summary(donating_train(fresh(comm), comm, range(STEPS)), comm)
    assert_bitwise(torch.load(root / "uninterrupted-0.pt", weights_only=False), uninterrupted)
    check_previous_checkpoint_resumes(root, uninterrupted)


@pytest.mark.distributed
def test_gloo_killed_during_background_write_leaves_previous_checkpoint(tmp_path):
    """2 gloo ranks killed (torchrun and both ranks, SIGKILL) while their background save is written."""
    root = tmp_path / "kill"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "2",
           str(HERE / "bg_save_worker.py"), str(tmp_path), str(tmp_path), "kill"]
    kill_during_write(cmd, root, timeout=120)
    ranks = [torch.load(root / f"uninterrupted-{r}.pt", weights_only=False) for r in range(2)]
    assert_bitwise(ranks[1], ranks[0])
    check_previous_checkpoint_resumes(root, ranks[0])


# -- failures and the one-in-flight rule ----------------------------------------------------------------


def test_failed_background_write_raises_at_wait_naming_the_checkpoint(tmp_path, monkeypatch):
    comm = fzero.SimulatedWorld(2)
    state = fresh(comm)
    save_checkpoint(state, tmp_path, comm, name="a")
    failing_write(monkeypatch)
    handle = save_checkpoint(state, tmp_path, comm, name="b", blocking=False)
    for _ in range(2):  # every wait() raises it
        with pytest.raises(CheckpointError, match=f"{tmp_path / 'b'}.*No space left on device") as info:
            handle.wait(timeout=60)
    assert isinstance(info.value.__cause__, CheckpointError)  # the write's own error, naming the directory
    assert "failed" in repr(handle)
    assert (tmp_path / "LATEST").read_text().strip() == "a" and not (tmp_path / "b").exists()
    monkeypatch.undo()
    # wait() raised it: the next save goes ahead
    assert save_checkpoint(state, tmp_path, comm, name="b", blocking=False).wait(timeout=60) == tmp_path / "b"
    assert (tmp_path / "LATEST").read_text().strip() == "b"


def test_unwaited_failure_raises_at_the_next_save_to_any_root(tmp_path, monkeypatch):
    comm = fzero.SimulatedWorld(2)
    state = fresh(comm)
    failing_write(monkeypatch)
    lost = save_checkpoint(state, tmp_path / "one", comm, name="lost", blocking=False)
    deadline = time.monotonic() + 60
    while not lost.done():  # the write fails while the disk is "full"; nothing waits for it
        assert time.monotonic() < deadline
        time.sleep(0.01)
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'one' / 'lost'}.*No space left on device"):
        save_checkpoint(state, tmp_path / "two", comm, name="next")  # blocking, another root
    assert not (tmp_path / "two").exists()  # raised before it started
    assert save_checkpoint(state, tmp_path / "two", comm, name="next") == tmp_path / "two" / "next"


def test_unwaited_failure_is_warned_of_at_exit(tmp_path):
    out = subprocess.run([sys.executable, str(HERE / "bg_save_worker.py"), "--fail-unwaited", str(tmp_path)],
                         env=_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "RuntimeWarning" in out.stderr and f"{tmp_path / 'unwaited'} in the background failed" in out.stderr
    assert "No space left on device" in out.stderr


def test_one_save_in_flight_the_next_waits_for_it(tmp_path, monkeypatch):
    """A second background save (or a blocking one) returns only once the save in flight has been published;
    saving again under the name that one published is refused."""
    comm = fzero.SimulatedWorld(2)
    state = fresh(comm)
    gate = threading.Event()
    monkeypatch.setattr(saveload, "_prepare_tmp", held(saveload._prepare_tmp, gate))
    first = save_checkpoint(state, tmp_path, comm, name="a", blocking=False)
    assert not first.done()
    threading.Timer(0.3, gate.set).start()
    t0 = time.monotonic()
    second = save_checkpoint(state, tmp_path, comm, name="b", blocking=False)
    assert first.done() and time.monotonic() - t0 >= 0.25
    assert first.wait() == tmp_path / "a"
    assert save_checkpoint(state, tmp_path, comm, name="c") == tmp_path / "c"  # blocking: waits for "b"
    assert second.done() and second.wait() == tmp_path / "b"
    assert (tmp_path / "LATEST").read_text().strip() == "c"
    with pytest.raises(FileExistsError, match="latest checkpoint"):
        save_checkpoint(state, tmp_path, comm, name="c", blocking=False)
    for name in "abc":
        assert_bitwise(summary(load_checkpoint(tmp_path / name, fresh(comm, seed=7), comm)[0], comm),
                       summary(state, comm))


# -- gloo -------------------------------------------------------------------------------------------------


@pytest.mark.distributed
def test_gloo_background_save_while_steps_run_equals_blocking_save(tmp_path):
    """2 gloo ranks: a background save (its writer held until 8 donating steps ran, its collectives on a gloo
    group of its own) loads, on gloo and on the simulated world, bitwise equal to the blocking save of the same
    state and to the state as it was."""
    results = run_torchrun(2, "bg_save_worker.py", [str(tmp_path), "compare"], timeout=180)
    for out in results:
        case = out["compare"]
        assert "exception" not in case, case.get("exception")
        assert case["writing"] and case["own_group"]
        assert_bitwise(case["loaded"], case["at_half"])
        assert_bitwise(case["extra"], extra_at(HALF))
    assert_bitwise(results[1]["compare"]["at_half"], results[0]["compare"]["at_half"])
    root = tmp_path / "gloo"
    assert_same_files(root / "bg", root / "blk")
    comm = fzero.SimulatedWorld(2)
    loaded = [summary(load_checkpoint(root / n, fresh(comm, seed=7), comm)[0], comm) for n in ("bg", "blk")]
    assert_bitwise(loaded[0], loaded[1])
    assert_bitwise(loaded[0], results[0]["compare"]["at_half"])

