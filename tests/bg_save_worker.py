"""Background saves (``save_checkpoint(blocking=False)``) while a donating step trains, for
tests/test_background_save.py.

As a torchrun worker: ``bg_save_worker.py OUT_DIR ROOT CASE [CASE ...]`` (:func:`dist_harness.worker_main`).
Cases: ``compare`` trains 8 steps, saves that state blocking (``ROOT/gloo/blk``) and in the background
(``ROOT/gloo/bg``; its writer held until 8 more steps have run), waits, and loads ``bg`` back; ``kill``
is :func:`until_killed` in ``ROOT/kill``.

As a plain process: ``bg_save_worker.py --sim ROOT`` runs :func:`until_killed` on ``SimulatedWorld(2)``;
``--fail-unwaited ROOT`` starts a background save whose write fails and exits without waiting for it.

Every step donates the state's buffers (``donate=True``): its master and moments are overwritten in
place, so only a copy taken before ``save_checkpoint`` returned can hold the saved values.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import torch

import fzero
import fzero.checkpoint.saveload as saveload
from ckpt_worker import DATA, HALF, STEPS, extra_at, fresh, mlp, summary
from fzero.checkpoint import load_checkpoint, save_checkpoint

mse = torch.nn.functional.mse_loss
PAD_NUMEL = 16_000_000  # 64 MB of extra: writing it takes long enough to be killed in the middle


def donating_train(state: fzero.TrainState, comm: fzero.Communicator, steps: range) -> fzero.TrainState:
    """``ckpt_worker.train`` with a donating step: each step consumes the state it is given."""
    step = fzero.make_train_step(fzero.module_loss(mlp(), mse), comm, donate=True)
    for i in steps:
        state, _ = step(state, comm.split_batch(DATA[i]))
    return state


def held(prepare: Any, gate: threading.Event) -> Any:
    """``prepare`` (``saveload._prepare_tmp``, the coordinator's first act in a save) waiting for ``gate`` first:
    patched in, the steps run before the gate is set surely run before a byte of the save is written."""

    def prepare_when_released(root: Path, tmp: Path) -> None:
        if not gate.wait(timeout=120):
            raise TimeoutError("the writer was never released")
        prepare(root, tmp)

    return prepare_when_released


def case_compare(comm: fzero.Communicator, root: Path) -> dict[str, Any]:
    state = donating_train(fresh(comm), comm, range(HALF))
    at_half = summary(state, comm)
    save_checkpoint(state, root, comm, name="blk", extra=extra_at(HALF))
    gate = threading.Event()
    prepare = saveload._prepare_tmp
    saveload._prepare_tmp = held(prepare, gate)
    try:
        handle = save_checkpoint(state, root, comm, name="bg", extra=extra_at(HALF), blocking=False)
        writing = not handle.done()
        state = donating_train(state, comm, range(HALF, STEPS))
        gate.set()
        path = handle.wait()
    finally:
        saveload._prepare_tmp = prepare
    loaded, extra = load_checkpoint(path, fresh(comm, seed=7), comm)
    group = fzero.checkpoint.background._groups.get(saveload._process_group(comm))
    return {"at_half": at_half, "loaded": summary(loaded, comm), "extra": extra, "writing": writing,
            "path": str(path), "own_group": group is not None and group is not saveload._process_group(comm)}


def until_killed(comm: fzero.Communicator, root: Path) -> None:
    """8 steps saved (blocking) as ``first``; the uninterrupted run's summary at 16 steps written to
    ``root/uninterrupted-{rank}.pt``; then that state saved in the background as ``second`` with 64 MB of
    extra, steps running meanwhile, and waited for: the test kills the process in the middle."""
    state = donating_train(fresh(comm), comm, range(HALF))
    save_checkpoint(state, root, comm, name="first", extra=extra_at(HALF))
    state = donating_train(state, comm, range(HALF, STEPS))
    rank = comm.data_ranks[0]
    torch.save(summary(state, comm), root / f"uninterrupted-{rank}.pt")
    handle = save_checkpoint(state, root, comm, name="second", extra={"pad": torch.ones(PAD_NUMEL)},
                             blocking=False)
    state = donating_train(state, comm, range(STEPS))
    handle.wait()


def fail_unwaited(root: Path) -> None:
    """A background save whose checksum file cannot be written; the process ends without waiting."""
    import fzero.checkpoint.checksums as checksums

    def full_disk(path: Path, data: bytes) -> None:
        raise OSError(28, "No space left on device", str(path))

    checksums._write_synced = full_disk
    comm = fzero.SimulatedWorld(2)
    save_checkpoint(fresh(comm), root, comm, name="unwaited", blocking=False)


def run_case(name: str, comm: Any, root: Path) -> Any:
    if name == "compare":
        return case_compare(comm, root / "gloo")
    if name == "kill":
        return until_killed(comm, root / "kill")
    raise ValueError(f"unknown case {name!r}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1] == "--sim":
        until_killed(fzero.SimulatedWorld(2), Path(sys.argv[2]))
    elif sys.argv[1] == "--fail-unwaited":
        fail_unwaited(Path(sys.argv[2]))
    else:
        from dist_harness import worker_main

        out_dir, root, names = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
        worker_main(lambda name, comm: run_case(name, comm, root), [out_dir, *names])
