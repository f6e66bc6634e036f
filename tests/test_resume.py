"""A run stopped at an odd step, checkpointed and resumed with a new step function equals the
run that never stopped: the state, every metric, and the replica check's schedule (the calls
are counted by the state, ``TrainState.calls``, not by the step function).
"""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as tp

import fzero
import user_models as um
from fzero.pytree import replace

pytest.importorskip("transformers")

WORLD, ACCUM, EVERY = 2, 2, 2
STEPS, STOP = 7, 3  # stop after an odd number of steps: the replica schedule is mid-period


def _state(model: torch.nn.Module, comm: fzero.Communicator) -> fzero.TrainState:
    return fzero.init_train_state(model, fzero.adamw(lr=1e-2, weight_decay=0.1), comm, stage=2,
                                  scaler=fzero.init_scaler(2.0**10, growth_interval=3))


def _step(model: torch.nn.Module, comm: fzero.Communicator):
    return fzero.make_train_step(
        fzero.module_loss(model, torch.nn.functional.cross_entropy), comm, accum_steps=ACCUM, clip_norm=1.0,
        check_replicas_every=EVERY, schedules={"lr": fzero.schedules.warmup_cosine(1e-2, 2, STEPS)},
    )


def _batches():
    data = um.image_batches(STEPS, WORLD * ACCUM * 2, torch.float32)
    x, y = data[4]
    x = x.clone()
    x[0, 0, 0, 0] = float("inf")  # one skipped step after the resume: calls and opt.step part ways
    data[4] = (x, y)
    return data


def _run(comm, batches, start_state, step, first: int):
    state, metrics = start_state, []
    for batch in batches:
        state, m = step(state, comm.split_batch(batch, micro_batches=ACCUM))
        metrics.append(m)
    return state, metrics


def test_resumed_run_equals_the_run_that_never_stopped(tmp_path):
    comm = fzero.SimulatedWorld(WORLD)
    data = _batches()
    model = um.resnet()
    whole, whole_metrics = _run(comm, data, _state(model, comm), _step(model, comm), 0)

    model = um.resnet()
    first, first_metrics = _run(comm, data[:STOP], _state(model, comm), _step(model, comm), 0)
    assert int(first.calls[0]) == STOP
    fzero.save_checkpoint(first, tmp_path, comm)
    del first

    model = um.resnet(seed=5)  # another initialisation: everything comes from the checkpoint
    template = _state(model, comm)
    resumed, _ = fzero.load_checkpoint(tmp_path, template, comm)
    assert int(resumed.calls[0]) == STOP
    last, last_metrics = _run(comm, data[STOP:], resumed, _step(model, comm), STOP)

    assert [m["found_inf"].item() for m in whole_metrics].count(1.0) == 1
    assert int(last.calls[0]) == STEPS and int(last.opt.step) == STEPS - 1
    for i, (a, b) in enumerate(zip(whole_metrics, first_metrics + last_metrics)):
        assert sorted(a) == sorted(b)
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, equal_nan=True, msg=f"step {i} {k}")
    la, sa = tp.tree_flatten(whole)
    lb, sb = tp.tree_flatten(last)
    assert sa == sb
    for i, (x, y) in enumerate(zip(la, lb)):
        torch.testing.assert_close(x, y, rtol=0, atol=0, msg=f"state leaf {i}")


def _diverged(state: fzero.TrainState) -> fzero.TrainState:
    """Rank 1's gathered parameters nudged: the replicas no longer agree."""
    params = state.params[0].clone()
    params[1, 0] += 1.0
    return replace(state, params=(params,) + state.params[1:])


def _call_that_raises(comm, data, state, step, first: int) -> int:
    for i, batch in enumerate(data, start=first):
        try:
            state, _ = step(_diverged(state), comm.split_batch(batch, micro_batches=ACCUM))
        except fzero.ReplicaDivergenceError:
            return i + 1  # the call, counted from 1
    return -1


def test_replica_check_keeps_its_schedule_across_a_resume(tmp_path):
    """Diverged from the first call after the stop (call STOP + 1 = 4, a checked call): the run
    that never stopped and the resumed one both raise there. A step function counting its own
    calls would have read the digest first at its second call (call 5)."""
    comm = fzero.SimulatedWorld(WORLD)
    data = _batches()
    model = um.resnet()
    state, _ = _run(comm, data[:STOP], _state(model, comm), _step(model, comm), 0)
    step = _step(model, comm)
    assert _call_that_raises(comm, data[STOP:], state, step, STOP) == STOP + 1
    fzero.save_checkpoint(state, tmp_path, comm)

    model = um.resnet()
    resumed, _ = fzero.load_checkpoint(tmp_path, _state(model, comm), comm)
    assert _call_that_raises(comm, data[STOP:], resumed, _step(model, comm), STOP) == STOP + 1


def test_a_checkpoint_without_the_call_count_resumes_counting_from_its_step(tmp_path, monkeypatch):
    """Checkpoints written before the state counted its calls have no ``fzero/calls``: the
    loaded state counts on from the applied steps, the best count the checkpoint holds."""
    from fzero.checkpoint import saveload

    comm = fzero.SimulatedWorld(WORLD)
    model = um.resnet()
    state, _ = _run(comm, _batches()[:STOP], _state(model, comm), _step(model, comm), 0)
    state = replace(state, calls=(torch.tensor(11, dtype=torch.int64),))
    real = saveload._replicated
    monkeypatch.setattr(saveload, "_replicated",
                        lambda s: {k: v for k, v in real(s).items() if k != saveload.CALLS_KEY})
    fzero.save_checkpoint(state, tmp_path, comm)
    monkeypatch.setattr(saveload, "_replicated", real)
    loaded, _ = fzero.load_checkpoint(tmp_path, _state(um.resnet(), comm), comm)
    assert int(loaded.calls[0]) == int(state.opt.step) == STOP
