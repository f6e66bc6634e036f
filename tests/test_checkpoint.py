"""Checkpoints (torch.distributed.checkpoint): resuming in other world sizes on the
simulated world and on gloo, torch.optim state-dict interchange, interrupted saves,
incomplete and foreign checkpoints, stage interchange.

Every resumed run is compared with an uninterrupted run on the same global batches
(``ckpt_worker.DATA``, split evenly over the ranks), so world sizes differ only by
rounding (≤ 1e-6 relative in fp32).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import fzero
import fzero.checkpoint as ckpt
from ckpt_kill_helper import NUMEL, big_state
from ckpt_worker import (
    DATA,
    HALF,
    STEPS,
    case_dropout,
    dropout_state,
    extra_at,
    fresh,
    mlp,
    optimizer,
    scaler,
    summary,
    torch_optimizer,
    torch_summary,
    torch_train,
    train,
    train_dropout,
)
from dist_harness import run_torchrun
from fzero.checkpoint import (
    CheckpointMismatchError,
    IncompleteCheckpointError,
    export_model_state_dict,
    export_torch_optim_state_dict,
    import_torch_optim_state_dict,
    load_checkpoint,
    save_checkpoint,
)
from helpers import max_rel_err

HERE = Path(__file__).resolve().parent
mse = torch.nn.functional.mse_loss
TOL = 1e-6


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def assert_same_run(got: dict[str, Any], ref: dict[str, Any], tol: float = TOL) -> None:
    """Equal step, scaler, hyperparameters; parameters and moments within ``tol`` relative."""
    assert got["step"] == ref["step"]
    assert got["scaler"] == ref["scaler"]
    assert got["params"].keys() == ref["params"].keys()
    for k, v in ref["params"].items():
        assert got["params"][k].dtype == v.dtype and got["params"][k].shape == v.shape, k
        assert max_rel_err(got["params"][k], v) <= tol, (k, max_rel_err(got["params"][k], v))
    assert_same_optim(got["optim"], ref["optim"], tol)


def assert_same_optim(got: dict[str, Any], ref: dict[str, Any], tol: float) -> None:
    assert got["param_groups"] == ref["param_groups"]
    assert got["state"].keys() == ref["state"].keys()
    for i, st in ref["state"].items():
        assert list(got["state"][i]) == list(st), i
        for name, v in st.items():
            mine = got["state"][i][name]
            assert mine.dtype == v.dtype and mine.shape == v.shape, (i, name)
            if name == "step":
                assert torch.equal(mine, v), (i, mine, v)
            else:
                assert max_rel_err(mine, v) <= tol, (i, name, max_rel_err(mine, v))


def states_equal(a: fzero.TrainState, b: fzero.TrainState) -> bool:
    """Bitwise: masters, moments, step, hyperparameters, scaler, frozen, gathered params."""
    la = torch.utils._pytree.tree_leaves(a)
    lb = torch.utils._pytree.tree_leaves(b)
    return len(la) == len(lb) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(la, lb))


# -- resuming in another world size: simulated world ---------------------------------------


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    """The uninterrupted run: 16 steps at W=4."""
    comm = fzero.SimulatedWorld(4)
    return summary(train(fresh(comm), comm, range(STEPS)), comm)


@pytest.fixture(scope="module")
def saved_w4(tmp_path_factory) -> Path:
    """8 steps at W=4, saved."""
    root = tmp_path_factory.mktemp("w4")
    comm = fzero.SimulatedWorld(4)
    state = train(fresh(comm), comm, range(HALF))
    path = save_checkpoint(state, root, comm, extra=extra_at(HALF))
    assert path == root / "step-00000008" and (root / "LATEST").read_text().strip() == path.name
    return root


@pytest.mark.parametrize("world", [2, 3, 8])
def test_resume_in_other_world_size_equals_uninterrupted_run(saved_w4, reference, world):
    """Flat groups of 114 and 35 elements (two optimizer groups): padded at every W; at
    W=8 ranks 3-7 own only padding of the second."""
    comm = fzero.SimulatedWorld(world)
    template = fresh(comm, seed=7)
    assert [g.numel for g in template.layout.groups] == [114, 35]
    assert all(g.padding > 0 for g in template.layout.groups)
    state, extra = load_checkpoint(saved_w4, template, comm)
    assert torch.equal(extra.pop("rng"), extra_at(HALF)["rng"])
    assert extra == {k: v for k, v in extra_at(HALF).items() if k != "rng"}
    for g, m in zip(state.layout.groups, state.shard.master):
        flat = m.reshape(-1)
        assert torch.count_nonzero(flat[g.numel :]) == 0, "padding must be zero"
    assert int(state.opt.step) == HALF
    state = train(state, comm, range(HALF, STEPS))
    assert_same_run(summary(state, comm), reference)


def test_load_is_pure_and_gathers_params(saved_w4):
    comm = fzero.SimulatedWorld(3)
    template = fresh(comm, seed=7)
    before = [x.clone() for x in torch.utils._pytree.tree_leaves(template)]
    state, _ = load_checkpoint(saved_w4, template, comm)
    assert all(torch.equal(x, y) for x, y in zip(before, torch.utils._pytree.tree_leaves(template)))
    assert all(torch.equal(p, q) for p, q in zip(state.params, fzero.all_gather_params(state.shard, comm)))
    again, _ = load_checkpoint(saved_w4 / "step-00000008", template, comm)  # the directory itself
    assert states_equal(state, again)


# -- gloo ---------------------------------------------------------------------------------------


def _case(results: list[dict[str, Any]], name: str) -> dict[str, Any]:
    for r, res in enumerate(results):
        if isinstance(res[name], dict) and "exception" in res[name]:
            pytest.fail(f"rank {r} raised in case {name!r}:\n{res[name]['exception']}")
    return results[0][name]


@pytest.fixture(scope="module")
def gloo(tmp_path_factory) -> dict[str, Any]:
    """Three torchrun runs: 4 ranks save and resume the simulated world's (W=3) checkpoint;
    2 ranks save and resume the 4 ranks' checkpoint; 4 ranks resume the 2 ranks'."""
    root = tmp_path_factory.mktemp("gloo")
    comm = fzero.SimulatedWorld(3)
    state = train(fresh(comm), comm, range(HALF))
    save_checkpoint(state, root / "sim", comm, name="step-8", extra=extra_at(HALF))
    w4 = run_torchrun(4, "ckpt_worker.py", [str(root), "save", "resume:sim"], timeout=120)
    w2 = run_torchrun(2, "ckpt_worker.py", [str(root), "save", "resume:gloo4", "dropout"], timeout=150)
    w4b = run_torchrun(4, "ckpt_worker.py", [str(root), "resume:gloo2", "torch_import", "mismatch:gloo2"], timeout=120)
    return {"root": root, "w4": w4, "w2": w2, "w4b": w4b}


def _check_resumed(out: dict[str, Any], reference: dict[str, Any]) -> None:
    assert out["extra"]["loader"] == {"position": HALF, "epoch": 0} and out["extra"]["run"] == "ckpt-test"
    assert torch.equal(out["extra"]["rng"], extra_at(HALF)["rng"])
    assert_same_run(out["summary"], reference)


@pytest.mark.distributed
def test_gloo_save_2_ranks_load_4(gloo, reference):
    _check_resumed(_case(gloo["w4b"], "resume:gloo2"), reference)


@pytest.mark.distributed
def test_gloo_save_4_ranks_load_2(gloo, reference):
    _check_resumed(_case(gloo["w2"], "resume:gloo4"), reference)


@pytest.mark.distributed
def test_simulated_world_checkpoint_loads_on_gloo(gloo, reference):
    _check_resumed(_case(gloo["w4"], "resume:sim"), reference)


@pytest.mark.distributed
@pytest.mark.parametrize("saved_by", ["gloo2", "gloo4"])
def test_gloo_checkpoint_loads_on_simulated_world(gloo, reference, saved_by):
    comm = fzero.SimulatedWorld(3)
    state, extra = load_checkpoint(gloo["root"] / saved_by, fresh(comm, seed=7), comm)
    state = train(state, comm, range(HALF, STEPS))
    _check_resumed({"extra": extra, "summary": summary(state, comm)}, reference)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_gloo_each_rank_writes_only_its_shard(gloo, world):
    """One data file per rank, each holding its own part of the sharded entries; the
    gathered state at step 8 equals what the workers had before saving."""
    d = ckpt.resolve_checkpoint(gloo["root"] / f"gloo{world}")
    md = dcp.FileSystemReader(d).read_metadata()
    sharded = {}
    for index, info in md.storage_data.items():
        if index.fqn.startswith(("fzero/master/", "fzero/exp_avg")):
            sharded[info.relative_path] = sharded.get(info.relative_path, 0) + info.length
    assert sorted(sharded) == [f"__{r}_0.distcp" for r in range(world)]
    total = sum(sharded.values())
    assert all(v < total * 0.75 for v in sharded.values()), sharded
    comm = fzero.SimulatedWorld(world)
    state, _ = load_checkpoint(d, fresh(comm, seed=7), comm)
    saved = _case(gloo["w4" if world == 4 else "w2"], "save")
    assert_same_run(summary(state, comm), saved, tol=0.0)


@pytest.mark.distributed
def test_gloo_import_from_torch_optim_and_continue(gloo):
    out = _case(gloo["w4b"], "torch_import")
    assert_same_optim(out["fzero_at_3"]["optim"], out["torch_at_3"], tol=0.0)
    assert out["fzero_at_3"]["step"] == 3
    for k, v in out["torch_at_4"]["params"].items():
        assert max_rel_err(out["fzero_at_4"]["params"][k], v) <= TOL, k
    assert_same_optim(out["fzero_at_4"]["optim"], out["torch_at_4"]["optim"], TOL)


@pytest.mark.distributed
def test_gloo_mismatch_raises_on_every_rank(gloo):
    for res in gloo["w4b"]:
        assert res["mismatch:gloo2"].startswith("CheckpointMismatchError: "), res["mismatch:gloo2"]
        assert "optimizer kind: 'adamw' vs 'sgd'" in res["mismatch:gloo2"]


# -- stages -------------------------------------------------------------------------------------


def test_stage1_checkpoint_continues_with_stage2(tmp_path):
    comm4 = fzero.SimulatedWorld(4)
    ref = train(train(fresh(comm4), comm4, range(HALF), stage=1), comm4, range(HALF, STEPS), stage=2)
    state = train(fresh(comm4), comm4, range(HALF), stage=1)
    save_checkpoint(state, tmp_path, comm4)
    comm2 = fzero.SimulatedWorld(2)
    resumed, _ = load_checkpoint(tmp_path, fresh(comm2, seed=7), comm2)
    resumed = train(resumed, comm2, range(HALF, STEPS), stage=2)
    assert_same_run(summary(resumed, comm2), summary(ref, comm4))


def test_stage2_and_stage3_checkpoints_interchange(tmp_path, reference):
    """Stage 3 lays parameters out in one bucket per link (other flat groups) and keeps
    no gathered parameters; checkpoints are keyed by parameter, so they move both ways."""
    comm4 = fzero.SimulatedWorld(4)
    save_checkpoint(train(fresh(comm4), comm4, range(HALF)), tmp_path / "s2", comm4)
    comm3 = fzero.SimulatedWorld(3)
    template3 = fresh(comm3, seed=7, stage=3)
    assert len(template3.layout.groups) > len(fresh(comm3).layout.groups)
    s3, _ = load_checkpoint(tmp_path / "s2", template3, comm3)
    assert s3.params == ()
    s3 = train(s3, comm3, range(HALF, STEPS), stage=3)
    assert_same_run(summary(s3, comm3), reference)
    save_checkpoint(s3, tmp_path / "s3", comm3)
    comm2 = fzero.SimulatedWorld(2)
    s2, _ = load_checkpoint(tmp_path / "s3", fresh(comm2, seed=7), comm2)
    assert len(s2.params) == len(s2.layout.groups)
    assert_same_run(summary(s2, comm2), summary(s3, comm3), tol=0.0)


# -- torch.optim interchange ------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
def test_export_to_torch_optim_and_continue(kind):
    """fzero → state dicts torch loads as they are → one torch step equals fzero's next step;
    the export is what torch's own optimizer holds after the same training."""
    comm = fzero.SimulatedWorld(3)
    state = train(fresh(comm, kind=kind), comm, range(3))
    model_sd, optim_sd = export_model_state_dict(state, comm), export_torch_optim_state_dict(state, comm)

    twin = mlp()
    twin_opt = torch_optimizer(kind, twin)
    torch_train(twin, twin_opt, range(3))
    assert_same_optim(optim_sd, twin_opt.state_dict(), tol=1e-5)  # 3 independent steps: parity tolerance

    model = mlp(seed=7)
    model.load_state_dict(model_sd)
    opt = torch_optimizer(kind, model)
    opt.load_state_dict(optim_sd)
    torch_train(model, opt, range(3, 4))
    state = train(state, comm, range(3, 4))
    got = torch_summary(model, opt)
    for k, v in export_model_state_dict(state, comm).items():
        assert max_rel_err(got["params"][k], v) <= TOL, (k, max_rel_err(got["params"][k], v))
    assert_same_optim(got["optim"], export_torch_optim_state_dict(state, comm), TOL)


@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
def test_import_from_torch_optim_and_continue(kind):
    """A run trained with torch.optim → fzero (W=3) → one fzero step equals one more torch step."""
    model = mlp()
    opt = torch_optimizer(kind, model)
    torch_train(model, opt, range(3))
    comm = fzero.SimulatedWorld(3)
    template = fresh(comm, seed=7, kind=kind)
    state = import_torch_optim_state_dict(template, model.state_dict(), opt.state_dict(), comm)
    # Exact round trip of the imported values.
    assert_same_optim(export_torch_optim_state_dict(state, comm), opt.state_dict(), tol=0.0)
    exported = export_model_state_dict(state, comm)
    assert all(torch.equal(exported[k], v) for k, v in model.state_dict().items())
    torch_train(model, opt, range(3, 4))
    state = train(state, comm, range(3, 4))
    for k, v in export_model_state_dict(state, comm).items():
        assert max_rel_err(v, model.state_dict()[k]) <= TOL, k
    assert_same_optim(export_torch_optim_state_dict(state, comm), opt.state_dict(), TOL)


def test_import_rejects_another_optimizer():
    model = mlp()
    opt = torch_optimizer("adam", model)
    torch_train(model, opt, range(1))
    comm = fzero.SimulatedWorld(2)
    with pytest.raises(CheckpointMismatchError, match="group 0 belongs to adam, this state's optimizer is adamw"):
        import_torch_optim_state_dict(fresh(comm), model.state_dict(), opt.state_dict(), comm)
    with pytest.raises(CheckpointMismatchError, match="sgd"):
        import_torch_optim_state_dict(fresh(comm, kind="sgd"), model.state_dict(), opt.state_dict(), comm)
    other = mlp(sizes=(6, 9, 4, 3))
    with pytest.raises(CheckpointMismatchError, match=r"'3.weight' has shape \(4, 9\), this model \(5, 9\)"):
        import_torch_optim_state_dict(fresh(comm, kind="adam"), other.state_dict(), opt.state_dict(), comm)


# -- interrupted saves ---------------------------------------------------------------------------


def _helper_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE.parent), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return env


def _reached(tmp: Path, moment: str) -> bool:
    if moment == "tmp_dir":
        return tmp.is_dir()
    try:
        return any(f.stat().st_size > 0 for f in tmp.glob("*.distcp"))
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("moment", ["tmp_dir", "data_file"])
def test_save_killed_midway_leaves_previous_checkpoint(tmp_path, moment):
    """A process saving a 24 MB state is SIGKILLed as soon as its temporary directory
    appears, or as soon as its data file has its first bytes: the previous checkpoint
    stays the latest and loads bitwise; the next save cleans up and publishes."""
    root = tmp_path / "root"
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "ckpt_kill_helper.py"), str(root)],
        env=_helper_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )
    tmp = root / ".tmp-second"
    deadline = time.monotonic() + 60
    try:
        while not _reached(tmp, moment):
            if proc.poll() is not None:
                err = proc.stderr.read().decode()
                pytest.fail(f"the helper ended (exit {proc.returncode}) before it was killed:\n{err}")
            assert time.monotonic() < deadline, "the helper never started the second save"
            time.sleep(0.0005)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    assert (root / "LATEST").read_text().strip() == "first"
    assert not (root / "second").exists() and tmp.is_dir()

    comm = fzero.SimulatedWorld(2)
    expected = big_state(comm)
    loaded, extra = load_checkpoint(root, fresh_big(comm), comm)
    assert extra == {"tag": "first"} and states_equal(loaded, expected)

    save_checkpoint(loaded, root, comm, name="third")
    assert (root / "LATEST").read_text().strip() == "third"
    assert not any(p.name.startswith(".") for p in root.iterdir())


def fresh_big(comm: fzero.Communicator) -> fzero.TrainState:
    """A template shaped like ``big_state`` with other values."""
    params = {"w": torch.zeros(NUMEL - 3), "b": torch.zeros(3)}
    return fzero.init_train_state(params, fzero.adamw(), comm)


def test_crash_between_rename_and_latest(tmp_path, monkeypatch):
    """A save that dies after renaming its directory but before updating LATEST: the
    previous checkpoint stays the latest; saving under that name again replaces the orphan."""
    comm = fzero.SimulatedWorld(2)
    first = fresh(comm)
    save_checkpoint(first, tmp_path, comm, name="a")
    second = train(first, comm, range(1))

    def crash(root: Path, name: str) -> None:
        raise RuntimeError("killed before LATEST was written")

    monkeypatch.setattr(ckpt.publish, "_write_latest", crash)
    with pytest.raises(RuntimeError, match="killed before LATEST"):
        save_checkpoint(second, tmp_path, comm, name="b")
    monkeypatch.undo()
    assert (tmp_path / "LATEST").read_text().strip() == "a" and (tmp_path / "b").is_dir()
    assert states_equal(load_checkpoint(tmp_path, fresh(comm, seed=7), comm)[0], first)

    save_checkpoint(second, tmp_path, comm, name="b")
    assert states_equal(load_checkpoint(tmp_path, fresh(comm, seed=7), comm)[0], second)
    with pytest.raises(FileExistsError, match="latest checkpoint"):
        save_checkpoint(second, tmp_path, comm, name="b")


# -- incomplete and foreign checkpoints ----------------------------------------------------------


@pytest.fixture
def saved(tmp_path) -> tuple[Path, fzero.Communicator]:
    comm = fzero.SimulatedWorld(2)
    path = save_checkpoint(train(fresh(comm), comm, range(2)), tmp_path / "root", comm, name="c")
    return path, comm


def test_truncated_data_file(saved):
    path, comm = saved
    data = path / "__0_0.distcp"
    size = data.stat().st_size
    with open(data, "r+b") as f:
        f.truncate(size // 2)
    message = rf"__0_0.distcp is truncated \({size // 2} bytes, the metadata needs {size}\)"
    with pytest.raises(IncompleteCheckpointError, match=message):
        load_checkpoint(path.parent, fresh(comm), comm)


def test_missing_metadata_or_data_file(saved):
    path, comm = saved
    (path / "__0_0.distcp").unlink()
    with pytest.raises(IncompleteCheckpointError, match="data file __0_0.distcp is missing"):
        load_checkpoint(path, fresh(comm), comm)
    (path / ".metadata").unlink()
    with pytest.raises(IncompleteCheckpointError, match="no .metadata"):
        load_checkpoint(path.parent, fresh(comm), comm)
    with pytest.raises(FileNotFoundError):
        load_checkpoint(path.parent / "nowhere", fresh(comm), comm)


@pytest.mark.parametrize(
    "template,message",
    [
        (lambda c: fresh(c, sizes=(6, 9, 4, 3)),
         r"model: parameter '3.weight': shape \(5, 9\) vs \(4, 9\)"),
        (lambda c: fresh(c, kind="sgd"), r"optimizer kind: 'adamw' vs 'sgd'"),
        (lambda c: fresh(c, kind="adam"), r"optimizer kind: 'adamw' vs 'adam'"),
        (lambda c: fzero.init_train_state(mlp(), fzero.adamw(), c, scaler=scaler()),
         r"model: parameter '0.bias': optimizer group \(-1: frozen\) 1 vs 0"),
        (lambda c: fzero.init_train_state(mlp(), optimizer(), c), r"scaler dynamic: True vs False"),
        (lambda c: fresh(c, trainable=lambda p: not p.startswith("0.")),
         r"parameter '0.weight': optimizer group \(-1: frozen\) 0 vs -1"),
        (lambda c: fresh(c, precision=fzero.MixedPrecision(param_dtype=torch.bfloat16)),
         r"precision param_dtype: None vs 'torch.bfloat16'"),
    ],
    ids=["other-model", "sgd", "adam", "other-groups", "other-scaler", "frozen", "precision"],
)
def test_mismatched_checkpoint_names_the_difference(saved, template, message):
    path, comm = saved
    with pytest.raises(CheckpointMismatchError, match=message):
        load_checkpoint(path, template(comm), comm)


def test_not_an_fzero_checkpoint(tmp_path):
    dcp.save({"x": torch.ones(3)}, checkpoint_id=tmp_path, no_dist=True)
    comm = fzero.SimulatedWorld(2)
    with pytest.raises(CheckpointMismatchError, match="not an fzero checkpoint"):
        load_checkpoint(tmp_path, fresh(comm), comm)


# -- what the caller passes along; misuse ---------------------------------------------------


def test_extra_round_trip_and_validation(tmp_path):
    comm = fzero.SimulatedWorld(2)
    state = fresh(comm)
    extra = {
        "loader": {"position": 123, "epoch": 2, "order": [3, 1, 2], "shuffle": True},
        "rng": torch.get_rng_state(),
        "schedule": {"warmup": 0.1, "name": "cosine", "milestones": (10, 20), "last": None},
        "empty": {},
    }
    save_checkpoint(state, tmp_path, comm, name="x", extra=extra)
    _, got = load_checkpoint(tmp_path, fresh(comm, seed=7), comm)
    assert torch.equal(got.pop("rng"), extra["rng"])
    assert got == {k: v for k, v in extra.items() if k != "rng"}

    with pytest.raises(TypeError, match=r"extra/loader/sampler: object cannot be checkpointed"):
        save_checkpoint(state, tmp_path, comm, name="y", extra={"loader": {"sampler": object()}})
    with pytest.raises(ValueError, match="keys must be non-empty strings without '/'"):
        save_checkpoint(state, tmp_path, comm, name="y", extra={"a/b": 1})
    with pytest.raises(ValueError, match="plain directory name"):
        save_checkpoint(state, tmp_path, comm, name="../y")
    assert (tmp_path / "LATEST").read_text().strip() == "x"


def test_donated_state_cannot_be_saved(tmp_path):
    comm = fzero.SimulatedWorld(2)
    state = fresh(comm)
    step = fzero.make_train_step(fzero.module_loss(mlp(), mse), comm, donate=True)
    new, _ = step(state, comm.split_batch(DATA[0]))
    with pytest.raises(ValueError, match="donated"):
        save_checkpoint(state, tmp_path, comm)
    save_checkpoint(new, tmp_path, comm)
    loaded, _ = load_checkpoint(tmp_path, fresh(comm, seed=7), comm)
    assert states_equal(loaded, new)


# -- generators: resumed exactly; the resharding rule ----------------------------------------------


def _check_dropout_resume(out: dict[str, Any]) -> None:
    """The resumed run equals the uninterrupted one bitwise; with the template's generators
    it would not (the test sees dropout)."""
    assert out["loaded_rng"]
    assert torch.equal(*out["rng"])
    assert_same_run(out["resumed"], out["full"], tol=0.0)
    with pytest.raises(AssertionError):
        assert_same_run(out["without_rng"], out["full"], tol=0.0)


def test_resume_with_dropout_at_an_odd_step_is_exact(tmp_path):
    _check_dropout_resume(case_dropout(fzero.SimulatedWorld(2), tmp_path))


@pytest.mark.distributed
def test_gloo_resume_with_dropout_at_an_odd_step_is_exact(gloo):
    _case(gloo["w2"], "dropout")  # no rank raised
    for res in gloo["w2"]:  # every rank: its own generator and shards
        _check_dropout_resume(res["dropout"])


def test_generators_reshard_by_rank_number(tmp_path):
    """Rank r continues from rank r's saved generator; a rank the saved run did not have keeps
    the template's; saved ranks beyond the new world are dropped; seed=None keeps none."""
    comm = fzero.SimulatedWorld(2)
    saved = train_dropout(dropout_state(comm), comm, range(3))
    path = save_checkpoint(saved, tmp_path, comm)
    rows = saved.rng[0]
    assert not torch.equal(rows[0], rows[1])
    w3 = fzero.SimulatedWorld(3)
    template = dropout_state(w3, seed=7, rng_seed=99)
    state, _ = load_checkpoint(path, template, w3)
    assert torch.equal(state.rng[0][:2], rows) and torch.equal(state.rng[0][2], template.rng[0][2])
    w1 = fzero.SimulatedWorld(1)
    state, _ = load_checkpoint(path, dropout_state(w1, seed=7, rng_seed=99), w1)
    assert torch.equal(state.rng[0], rows[:1])
    none = fzero.init_train_state(torch.nn.Sequential(mlp(), torch.nn.Dropout(0.3)), fzero.adamw(lr=1e-2),
                                  w1, scaler=scaler(), seed=None)
    assert load_checkpoint(path, none, w1)[0].rng == ()
