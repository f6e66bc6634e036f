"""Checkpoints that verify themselves: checksums, DCP failures as Exceptions, the offline
command line (info, verify, consolidate), load options (hyperparams, donate)."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

import fzero
import fzero.checkpoint as ckpt
import fzero.pytree
from ckpt_worker import fresh, train
from fzero.checkpoint import (
    CheckpointCorruptError,
    CheckpointError,
    export_model_state_dict,
    export_torch_optim_state_dict,
    load_checkpoint,
    save_checkpoint,
)
from fzero.checkpoint.__main__ import main as cli
from fzero.checkpoint.metadata import read_metadata

ROOT = Path(__file__).resolve().parent.parent


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture
def saved(tmp_path) -> tuple[Path, fzero.Communicator, fzero.TrainState]:
    comm = fzero.SimulatedWorld(2)
    state = train(fresh(comm), comm, range(2))
    path = save_checkpoint(state, tmp_path / "root", comm, name="c", extra={"tag": "x"})
    return path, comm, state


def record(path: Path, key: str) -> tuple[str, int, int]:
    """(data file, byte offset, length) of the first saved chunk of ``key``."""
    md, _ = read_metadata(path)
    for idx, info in sorted(md.storage_data.items(), key=lambda kv: tuple(kv[0].offset or ())):
        if idx.fqn == key:
            return info.relative_path, info.offset, info.length
    raise KeyError(key)


def as_saved_without_checksums(path: Path) -> None:
    """Make ``path`` a checkpoint as fzero wrote them before checksums existed: no checksum
    file, and no mark in the metadata saying it was saved with one."""
    md, _ = read_metadata(path)
    md.planner_data = None
    (path / ".metadata").write_bytes(pickle.dumps(md))
    (path / ckpt.checksums.CHECKSUMS_FILE).unlink()


def overwrite(path: Path, file: str, offset: int, data: bytes) -> None:
    size = (path / file).stat().st_size
    with open(path / file, "r+b") as f:
        f.seek(offset)
        f.write(data)
    assert (path / file).stat().st_size == size  # the damage keeps every size


def flip(path: Path, file: str, offset: int) -> None:
    with open(path / file, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


KEY = "fzero/master/2.weight"


def test_zero_filled_record_raises_corruption_error_naming_entry_and_file(saved):
    path, comm, _ = saved
    file, offset, length = record(path, KEY)
    overwrite(path, file, offset, bytes(length))  # a torn write: zeros of the right size
    with pytest.raises(CheckpointCorruptError, match=rf"entry '{KEY}' in data file {file} .*crc32"):
        load_checkpoint(path, fresh(comm, seed=7), comm)
    try:
        load_checkpoint(path, fresh(comm, seed=7), comm)
    except Exception as e:  # noqa: BLE001 - the point: recovery code sees it
        assert isinstance(e, CheckpointError) and str(path) in str(e)
    with pytest.raises(CheckpointCorruptError, match=rf"entry '{KEY}' in data file {file}"):
        ckpt.verify_checkpoint(path.parent)


def test_flipped_byte_keeping_size_raises_corruption_error(saved):
    path, comm, state = saved
    file, offset, length = record(path, KEY)
    with open(path / file, "rb") as f:
        f.seek(offset)
        blob = f.read(length)
    import io

    values = torch.load(io.BytesIO(blob), weights_only=True).numpy().tobytes()
    inside = blob.index(values) + len(values) // 2  # a byte of the tensor's values
    flip(path, file, offset + inside)
    try:
        load_checkpoint(path, fresh(comm, seed=7), comm)
    except Exception as e:  # noqa: BLE001
        assert isinstance(e, CheckpointCorruptError), e
        assert KEY in str(e) and file in str(e) and str(path) in str(e)
    else:
        pytest.fail("a flipped byte loaded silently")
    assert cli(["verify", str(path)]) == 1
    # Deleting the checksum file does not turn the checks off: the checkpoint is corrupt.
    sums = (path / ckpt.checksums.CHECKSUMS_FILE).read_bytes()
    (path / ckpt.checksums.CHECKSUMS_FILE).unlink()
    with pytest.raises(CheckpointCorruptError, match="saved with checksums and file checksums.json is missing"):
        load_checkpoint(path, fresh(comm, seed=7), comm)
    assert cli(["verify", str(path)]) == 1
    (path / ckpt.checksums.CHECKSUMS_FILE).write_bytes(sums)
    # Saved before checksums existed, the same damage loads silently as other values: why they exist.
    as_saved_without_checksums(path)
    damaged, _ = load_checkpoint(path, fresh(comm, seed=7), comm)
    assert not all(torch.equal(a, b) for a, b in zip(damaged.shard.master, state.shard.master))


def test_damage_without_checksums_is_still_an_exception_naming_the_file(saved):
    """A checkpoint saved before checksums existed: DCP's BaseException becomes a CheckpointError."""
    path, comm, _ = saved
    as_saved_without_checksums(path)
    file, offset, length = record(path, KEY)
    overwrite(path, file, offset, bytes(length))
    with pytest.raises(CheckpointCorruptError, match=rf"entry '{KEY}' in data file {file} cannot be decoded"):
        load_checkpoint(path, fresh(comm, seed=7), comm)
    with pytest.raises(CheckpointCorruptError, match="saved without checksums"):
        ckpt.verify_checkpoint(path)


def test_damaged_checksum_file(saved):
    path, comm, _ = saved
    f = path / ckpt.checksums.CHECKSUMS_FILE
    f.write_text(f.read_text().replace('"crc32"', '"crc33"'))
    with pytest.raises(CheckpointCorruptError, match="checksums.json is damaged"):
        load_checkpoint(path, fresh(comm, seed=7), comm)


def test_keyboard_interrupt_passes_through(saved, monkeypatch):
    path, comm, _ = saved

    def interrupted(self, file, sinfo):
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt.checksums.VerifyingReader, "_slice_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        load_checkpoint(path, fresh(comm, seed=7), comm)


def test_intact_checkpoint_verifies(saved):
    path, comm, state = saved
    n = ckpt.verify_checkpoint(path.parent)
    assert n == sum(f.stat().st_size for f in path.glob("*.distcp"))
    loaded, extra = load_checkpoint(path, fresh(comm, seed=7), comm)
    assert extra == {"tag": "x"}
    assert all(torch.equal(a, b) for a, b in zip(loaded.shard.master, state.shard.master))


def test_every_read_failure_is_a_checkpoint_error(saved, tmp_path):
    path, comm, _ = saved
    with pytest.raises(ckpt.CheckpointNotFoundError, match="nowhere"):
        load_checkpoint(tmp_path / "nowhere", fresh(comm), comm)
    assert issubclass(ckpt.CheckpointNotFoundError, FileNotFoundError)
    assert issubclass(ckpt.CheckpointNotFoundError, CheckpointError)
    (path / ".metadata").write_bytes(bytes((path / ".metadata").stat().st_size))  # zero-filled
    with pytest.raises(CheckpointCorruptError, match=r"file .metadata is not the one checksums.json was written for"):
        ckpt.read_manifest(path)
    (path / ckpt.checksums.CHECKSUMS_FILE).unlink()
    with pytest.raises(CheckpointCorruptError, match=r"file .metadata cannot be read as checkpoint metadata"):
        ckpt.read_manifest(path)


def test_public_helpers_reachable_from_fzero_checkpoint():
    # the top level keeps saving, loading, write_back and the base error; the rest is fzero.checkpoint's
    for name in ("save_checkpoint", "load_checkpoint", "write_back", "CheckpointError"):
        assert getattr(fzero, name) is getattr(ckpt, name)
    for name in ("read_manifest", "resolve_checkpoint", "verify_checkpoint", "consolidate_checkpoint",
                 "checkpoint_info", "CheckpointCorruptError"):
        assert getattr(fzero.checkpoint, name) is getattr(ckpt, name)
        assert name not in fzero.__all__


# -- the command line ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_w3(tmp_path_factory):
    """Stage 3 at W=3 (shards of uneven length, padding), a frozen parameter, 5 steps."""
    root = tmp_path_factory.mktemp("w3")
    comm = fzero.SimulatedWorld(3)
    state = fresh(comm, stage=3, trainable=lambda p: p != "0.bias")
    state = train(state, comm, range(5), stage=3)
    save_checkpoint(state, root, comm)
    return root, comm, state


def test_consolidate_equals_export_model_state_dict(saved_w3, tmp_path):
    root, comm, state = saved_w3
    assert cli(["consolidate", str(root), str(tmp_path / "model.pt"), "--optim", str(tmp_path / "optim.pt")]) == 0
    got = torch.load(tmp_path / "model.pt", weights_only=True)
    want = export_model_state_dict(state, comm)
    assert list(got) == list(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    got_opt = torch.load(tmp_path / "optim.pt", weights_only=True)
    want_opt = export_torch_optim_state_dict(state, comm)
    assert got_opt["param_groups"] == want_opt["param_groups"]
    assert list(got_opt["state"]) == list(want_opt["state"])
    for i, st in want_opt["state"].items():
        assert list(got_opt["state"][i]) == list(st)
        for name, v in st.items():
            assert torch.equal(got_opt["state"][i][name], v), (i, name)
    # a torch model and optimizer take them as they are
    from ckpt_worker import mlp, torch_optimizer

    model = mlp()
    model.load_state_dict(got)
    opt = torch_optimizer("adamw", model)
    # the frozen bias is not in fzero's optimizer: torch's twin would not hold it either
    opt.param_groups[1]["params"] = [p for n, p in model.named_parameters()
                                     if fzero.optim.no_weight_decay_for(model)(n) and n != "0.bias"]
    opt.load_state_dict(got_opt)


def test_info_names_world_stage_step_parameters(saved_w3, capsys):
    root, comm, state = saved_w3
    info = ckpt.checkpoint_info(root)
    assert (info["world_size"], info["stage"], info["step"]) == (3, "3", 5)
    assert info["num_params"] == len(state.layout.slots) and info["checksums"]
    assert info["hyperparameters"][0]["lr"] == pytest.approx(1e-2)
    assert cli(["info", str(root)]) == 0
    out = capsys.readouterr().out
    assert "world size 3, stage 3, step 5" in out and "0.weight" in out and "frozen" in out


def test_command_line_runs_without_a_training_job(saved_w3):
    """``python -m fzero.checkpoint verify``: a fresh process, no process group."""
    root, _, _ = saved_w3
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "fzero.checkpoint", "verify", str(root)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "every checksum" in run.stdout
    bad = subprocess.run([sys.executable, "-m", "fzero.checkpoint", "info", str(root / "nowhere")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 1 and "nowhere" in bad.stderr


# -- load options --------------------------------------------------------------------------------


def test_hyperparams_from_checkpoint_or_template(saved):
    path, comm, state = saved
    template = fresh(comm, seed=7)
    template = fzero.pytree.replace(template, opt=fzero.optim.set_hyperparams(template.opt, lr=0.5))
    from_ckpt, _ = load_checkpoint(path, template, comm)
    assert float(from_ckpt.opt.hyper[0]["lr"]) == pytest.approx(1e-2)  # as torch's load_state_dict
    from_template, _ = load_checkpoint(path, template, comm, hyperparams="template")
    assert [float(h["lr"]) for h in from_template.opt.hyper] == [0.5, 0.5]
    assert all(torch.equal(a, b) for a, b in zip(from_template.shard.master, from_ckpt.shard.master))
    assert int(from_template.opt.step) == int(state.opt.step)
    with pytest.raises(ValueError, match="hyperparams must be one of"):
        load_checkpoint(path, template, comm, hyperparams="mine")


def test_donated_template_is_loaded_in_place(saved):
    path, comm, _ = saved
    pure, _ = load_checkpoint(path, fresh(comm, seed=7), comm)
    template = fresh(comm, seed=7)
    ptrs = [t.data_ptr() for t in (*template.shard.master, *(m for ms in template.opt.moments for m in ms))]
    state, _ = load_checkpoint(path, template, comm, donate=True)
    got = [t.data_ptr() for t in (*state.shard.master, *(m for ms in state.opt.moments for m in ms))]
    assert got == ptrs  # no second copy of the sharded state
    leaves = torch.utils._pytree.tree_leaves
    assert all(torch.equal(a, b) for a, b in zip(leaves(state), leaves(pure)))
    with pytest.raises(ValueError, match="consumed"):
        load_checkpoint(path, template, comm)


def test_checkpoint_with_first_version_checksums_still_loads_checked(saved):
    """Saved before the checksum file bound the metadata (version 1: records only, no mark in
    the metadata): it loads, and its records are still checked."""
    path, comm, state = saved
    md, _ = read_metadata(path)
    md.planner_data = None
    (path / ".metadata").write_bytes(pickle.dumps(md))
    f = path / ckpt.checksums.CHECKSUMS_FILE
    doc = json.loads(f.read_text())
    records = [r[:6] for r in doc["records"]]
    body = json.dumps(records, separators=(",", ":"))
    f.write_text(json.dumps({"algorithm": "crc32", "records": records, "self": zlib.crc32(body.encode())}))
    loaded, _ = load_checkpoint(path, fresh(comm, seed=7), comm)
    assert all(torch.equal(a, b) for a, b in zip(loaded.shard.master, state.shard.master))
    assert ckpt.verify_checkpoint(path) > 0
    file, offset, length = record(path, KEY)
    overwrite(path, file, offset, bytes(length))
    with pytest.raises(CheckpointCorruptError, match=rf"entry '{KEY}' in data file {file} .*crc32"):
        load_checkpoint(path, fresh(comm, seed=7), comm)


def test_latest_that_is_not_text_or_names_another_checkpoint(saved):
    path, comm, _ = saved
    root = path.parent
    (root / "LATEST").write_bytes(b"\xff\xfe\x00c\n")
    with pytest.raises(CheckpointCorruptError, match="LATEST is damaged: it is not text"):
        load_checkpoint(root, fresh(comm, seed=7), comm)
    assert cli(["info", str(root)]) == 1
    (root / "LATEST").write_text("c\n")
    other = save_checkpoint(fresh(comm), root, comm, name="d")  # LATEST now names "d"
    for f in other.iterdir():  # "c"'s files in "d"'s place: a consistent checkpoint, of another name
        f.unlink()
    for f in path.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    with pytest.raises(CheckpointCorruptError, match="LATEST names it 'd', but it was saved as 'c'"):
        load_checkpoint(root, fresh(comm, seed=7), comm)
    load_checkpoint(other, fresh(comm, seed=7), comm)  # named directly, it is the checkpoint it holds
