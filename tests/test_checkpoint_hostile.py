"""Reading a hostile checkpoint is bounded: every read of ``LATEST``, ``checksums.json`` and ``.metadata`` ends
quickly, allocates no more than a genuine read, and every failure is a ``CheckpointError`` naming the file (the CLI:
one line, exit status 1). One row per input a new user tried (issue 44), then a hypothesis fuzz of ``LATEST`` and
``checksums.json``: their contents and the kind of file they are (regular, named pipe, device, directory, symlink out
of the root, dangling symlink).

Each read runs on a thread joined within :data:`BOUND` seconds; one that does not return fails the test (a named pipe
it blocks on is then opened for writing, which lets it go).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fzero
import fzero.checkpoint as ckpt
from ckpt_worker import fresh, train
from fzero.checkpoint import CheckpointError, CheckpointOutputError, load_checkpoint, save_checkpoint
from fzero.checkpoint.__main__ import main as cli
from fzero.checkpoint.checksums import CHECKSUMS_FILE

BOUND = 20.0  # seconds a read may take before the test calls it a hang
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("hostile")
    comm = fzero.SimulatedWorld(2)
    state = train(fresh(comm), comm, range(2))
    path = save_checkpoint(state, base / "root", comm)
    return {"root": base / "root", "name": path.name, "comm": comm, "state": state}


def _copy(saved: dict[str, Any], where: Path) -> Path:
    root = where / "root"
    shutil.copytree(saved["root"], root, symlinks=True)
    return root


def _readers(saved: dict[str, Any], root: Path, **kw: Any) -> dict[str, Callable[[], Any]]:
    comm = saved["comm"]
    return {"load_checkpoint": lambda: load_checkpoint(root, fresh(comm, seed=3), comm, **kw),
            "verify_checkpoint": lambda: ckpt.verify_checkpoint(root, **kw),
            "checkpoint_info": lambda: ckpt.checkpoint_info(root, **kw),
            "read_manifest": lambda: ckpt.read_manifest(root, **kw),
            "consolidate_model_state_dict": lambda: ckpt.consolidate_model_state_dict(root, **kw)}


def _bounded(fn: Callable[[], Any], pipes: tuple[Path, ...] = ()) -> tuple[str, Any]:
    """``("ok", value)`` or ``("raised", exception)``; fails the test if ``fn`` is still running after BOUND s."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["ok"] = fn()
        except BaseException as e:  # noqa: BLE001 - the test looks at what it was
            out["raised"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(BOUND)
    if t.is_alive():
        for p in pipes:  # let the reader go: a writer that closes at once
            try:
                os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        t.join(BOUND)
        pytest.fail(f"{fn} did not return within {BOUND} s (a hang)")
    return ("ok", out["ok"]) if "ok" in out else ("raised", out["raised"])


def _refused(saved: dict[str, Any], root: Path, names: str, pipes: tuple[Path, ...] = (), **kw: Any) -> None:
    """Every reader raises a CheckpointError whose message names ``names``, within BOUND seconds."""
    for what, fn in _readers(saved, root, **kw).items():
        kind, value = _bounded(fn, pipes)
        assert kind == "raised", f"{what} read a hostile checkpoint: {value!r}"
        assert isinstance(value, CheckpointError), f"{what}: {type(value).__name__}: {value}"
        assert names in str(value), f"{what}: {value}"


def _peak_rss(fn: Callable[[], Any]) -> int:
    """This process's peak resident bytes while ``fn`` runs (peak reset first: ``/proc/self/clear_refs``): a hostile
    read's must stay under twice a genuine one's (on main before issue 44: 5.5 GB for ``/dev/zero``)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    _bounded(fn)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


@pytest.mark.parametrize("target", ["LATEST", CHECKSUMS_FILE])
@pytest.mark.parametrize("follow", [False, True])
def test_a_file_linked_to_dev_zero_is_refused_without_reading_it(saved, tmp_path, target, follow):
    root = _copy(saved, tmp_path)
    f = root / target if target == "LATEST" else root / saved["name"] / target
    genuine = _peak_rss(lambda: ckpt.verify_checkpoint(root))
    f.unlink()
    f.symlink_to("/dev/zero")
    # not followed: it leads out of the root; followed: a character device is not a regular file
    _refused(saved, root, str(f), follow_symlinks=follow)
    assert _peak_rss(lambda: ckpt.verify_checkpoint(root, follow_symlinks=follow)) < 2 * genuine


@pytest.mark.parametrize("target", ["LATEST", CHECKSUMS_FILE])
def test_a_named_pipe_without_writer_is_refused_not_waited_on(saved, tmp_path, target):
    root = _copy(saved, tmp_path)
    f = root / target if target == "LATEST" else root / saved["name"] / target
    f.unlink()
    os.mkfifo(f)
    _refused(saved, root, str(f), pipes=(f,))
    _refused(saved, root, "named pipe", pipes=(f,), follow_symlinks=True)


def test_latest_holding_a_long_name_or_megabytes_is_refused_without_reading_it(saved, tmp_path):
    root = _copy(saved, tmp_path)
    genuine = _peak_rss(lambda: ckpt.verify_checkpoint(root))
    (root / "LATEST").write_text("s" * 300)
    _refused(saved, root, "LATEST")
    (root / "LATEST").write_bytes(b"step-" * (20 << 20))  # 100 MiB of text
    _refused(saved, root, "LATEST")
    hostile = _peak_rss(lambda: ckpt.verify_checkpoint(root))
    assert hostile < 2 * genuine and hostile < genuine + (16 << 20)  # the 100 MiB are never read


def test_latest_naming_a_link_out_of_the_root_is_refused_unless_followed(saved, tmp_path):
    elsewhere = _copy(saved, tmp_path / "elsewhere")
    root = tmp_path / "mine"
    root.mkdir()
    (root / saved["name"]).symlink_to(elsewhere / saved["name"], target_is_directory=True)
    (root / "LATEST").write_text(saved["name"] + "\n")
    _refused(saved, root, "outside the checkpoint root")
    state, _ = load_checkpoint(root, fresh(saved["comm"], seed=3), saved["comm"], follow_symlinks=True)
    leaves = torch.utils._pytree.tree_leaves
    assert all(torch.equal(a, b) for a, b in zip(leaves(state.shard), leaves(saved["state"].shard), strict=True))


def test_a_checkpoints_own_file_linked_out_of_the_root_is_refused_unless_followed(saved, tmp_path):
    root = _copy(saved, tmp_path)
    data = root / saved["name"] / "__0_0.distcp"
    outside = tmp_path / "moved.distcp"
    shutil.move(data, outside)
    data.symlink_to(outside)
    _refused(saved, root, "__0_0.distcp")
    assert ckpt.verify_checkpoint(root, follow_symlinks=True) > 0


def test_consolidating_into_a_missing_directory_names_it_on_one_line(saved, tmp_path, capsys):
    out = tmp_path / "missing" / "model.pt"
    with pytest.raises(CheckpointOutputError, match="missing"):
        ckpt.consolidate_checkpoint(saved["root"], out)
    with pytest.raises(CheckpointOutputError, match="missing"):
        ckpt.consolidate_checkpoint(saved["root"], tmp_path / "model.pt", optim=out)
    assert not (tmp_path / "model.pt").exists()  # refused before anything was written
    capsys.readouterr()
    assert cli(["consolidate", str(saved["root"]), str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "CheckpointOutputError" in err and str(out.parent) in err
    (tmp_path / "a_dir.pt").mkdir()  # torch.save cannot open a directory
    assert cli(["consolidate", str(saved["root"]), str(tmp_path / "a_dir.pt")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a_dir.pt" in err


@pytest.mark.parametrize("command", ["info", "verify"])
def test_the_cli_says_one_line_for_a_hostile_checkpoint(saved, tmp_path, capsys, command):
    root = _copy(saved, tmp_path)
    (root / "LATEST").unlink()
    (root / "LATEST").symlink_to("/dev/zero")
    assert cli([command, str(root)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: CheckpointCorruptError") and "LATEST" in err
    assert cli([command, str(root), "--follow-symlinks"]) == 1
    assert "character device" in capsys.readouterr().err


def test_checkpoint_names_are_checked_before_a_path_is_built(saved, tmp_path):
    for bad in ("s" * 256, "a\nb", "a\x00b", "\x7f", "a/b", ".hidden", "LATEST", ""):
        with pytest.raises(ValueError, match="plain directory name"):
            save_checkpoint(saved["state"], tmp_path / "r", saved["comm"], name=bad)


KINDS = ("regular", "fifo", "dev_zero", "directory", "outside", "dangling")


def _make(path: Path, kind: str, content: bytes, outside: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    if kind == "regular":
        path.write_bytes(content)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev_zero":
        path.symlink_to("/dev/zero")
    elif kind == "directory":
        path.mkdir()
    elif kind == "outside":
        outside.write_bytes(content)
        path.symlink_to(outside)
    else:
        path.symlink_to(path.parent / "no-such-file")


@given(target=st.sampled_from(["LATEST", CHECKSUMS_FILE]), kind=st.sampled_from(KINDS),
       content=st.one_of(st.binary(max_size=512), st.text(max_size=300).map(str.encode),
                         st.sampled_from([b"step-00000002", b"step-00000002\n", b" step-00000002 ", b"{}", b"[]",
                                          b'{"algorithm": "crc32", "version": 2}', b"\xff" * 70000])),
       reader=st.sampled_from(["load_checkpoint", "verify_checkpoint", "checkpoint_info", "read_manifest"]))
def test_fuzzed_latest_and_checksums_end_as_checkpoint_errors_or_the_saved_values(saved, target, kind, content, reader):
    with tempfile.TemporaryDirectory() as tmp:
        root = _copy(saved, Path(tmp))
        path = root / target if target == "LATEST" else root / saved["name"] / target
        _make(path, kind, content, Path(tmp) / "outside")
        kind_of, value = _bounded(_readers(saved, root)[reader], pipes=(path,) if kind == "fifo" else ())
        if kind_of == "raised":
            assert isinstance(value, CheckpointError), f"{type(value).__name__}: {value}"
            return
        # read: only a regular LATEST naming the checkpoint, and what it read is what was saved
        assert kind == "regular" and target == "LATEST" and content.decode().strip() == saved["name"]
        if reader == "load_checkpoint":
            leaves = torch.utils._pytree.tree_leaves
            assert all(torch.equal(a, b) for a, b in zip(leaves(value[0].shard), leaves(saved["state"].shard),
                                                          strict=True))
