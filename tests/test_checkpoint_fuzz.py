"""Damaged and hostile checkpoints, generated: nothing loads wrong, nothing runs, every failure
is a CheckpointError, and ``verify`` refuses whatever loading refuses.

One checkpoint (stage 2, W=2, simulated world) is damaged in every way below, each case on a
fresh copy: single-byte flips at seeded random offsets of every file (``LATEST``,
``.metadata``, ``checksums.json``, the data file), truncations, deletions, files swapped in
from another step's checkpoint (each alone, the data and checksums together, all of them),
and pickle payloads in every pickled file (``.metadata`` as it is, with the checksum file
gone, and with the checksum file re-signed for it; an object record of a data file written
with valid checksums). A payload would create a marker file.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import fzero
import fzero.checkpoint as ckpt
from ckpt_worker import fresh, train
from fzero.checkpoint import CheckpointError, load_checkpoint, save_checkpoint, verify_checkpoint
from fzero.checkpoint.__main__ import main as cli
from fzero.checkpoint.checksums import CHECKSUMS_FILE, _doc_crc
from fzero.checkpoint.metadata import read_metadata

SEED = 20261125
FLIPS = {"LATEST": 16, ".metadata": 120, CHECKSUMS_FILE: 80, "__0_0.distcp": 240}
OLD_FORMAT_FLIPS = 200
TRUNCATIONS = 4
EXTRA = {"loader": {"position": 3}, "note": "fuzz", "table": torch.arange(5)}


class Payload:
    """Unpickled, it creates ``marker``: proof that loading ran code."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return (open, (self.marker, "w"))


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("fuzz")
    comm = fzero.SimulatedWorld(2)
    early = train(fresh(comm), comm, range(2))
    save_checkpoint(early, base / "other", comm, extra=EXTRA)
    state = train(early, comm, range(2, 3))
    path = save_checkpoint(state, base / "pristine", comm, extra=EXTRA)
    return {"base": base, "comm": comm, "state": state, "name": path.name,
            "other": base / "other" / "step-00000002", "template": fresh(comm, seed=7)}


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _same_state(x: fzero.TrainState, y: fzero.TrainState) -> bool:
    leaves = torch.utils._pytree.tree_leaves
    return all(_equal(a, b) for a, b in zip(leaves(x), leaves(y), strict=True))


class Outcomes:
    """What every case did; the test asserts on the totals and names the first offenders."""

    def __init__(self) -> None:
        self.silent_wrong: list[str] = []
        self.foreign: list[str] = []
        self.verify_passed: list[str] = []
        self.refused = 0
        self.loaded_intact = 0

    def attempt(self, case: str, name: str, call: Callable[[], Any]) -> tuple[bool, Any] | None:
        """``(refused, result)`` of ``call()``: refused is a ``CheckpointError``. Anything else
        that escapes is recorded as foreign and gives ``None``."""
        try:
            return False, call()
        except CheckpointError:
            return True, None
        except Exception as e:  # noqa: BLE001 - the point: none may escape as another type
            self.foreign.append(f"{case}: {name} raised {type(e).__name__}: {e}")
            return None

    def run_offline(self, root: Path, case: str) -> None:
        """The tools without a training state: a CheckpointError or a result, nothing else."""
        for name, call in [("read_manifest", ckpt.read_manifest), ("checkpoint_info", ckpt.checkpoint_info),
                           ("consolidate_model_state_dict", ckpt.consolidate_model_state_dict)]:
            self.attempt(case, name, lambda call=call: call(root))

    def run(self, world: dict[str, Any], root: Path, case: str) -> None:
        loaded = self.attempt(case, "load", lambda: load_checkpoint(root, world["template"], world["comm"]))
        if loaded is None:
            return
        refused, result = loaded
        if refused:
            self.refused += 1
        elif _same_state(result[0], world["state"]) and _equal(result[1], EXTRA):
            self.loaded_intact += 1
        else:
            self.silent_wrong.append(case)
        verified = self.attempt(case, "verify", lambda: verify_checkpoint(root))
        if refused and verified is not None and not verified[0]:
            self.verify_passed.append(case)


def _fresh_copy(world: dict[str, Any], tag: str) -> tuple[Path, Path]:
    root = world["base"] / "cases" / tag
    if root.exists():
        shutil.rmtree(root)
    shutil.copytree(world["base"] / "pristine", root)
    return root, root / world["name"]


def _files(d: Path) -> list[str]:
    return sorted(f.name for f in d.iterdir() if f.is_file())


def test_damaged_checkpoints_never_load_wrong(world):
    rng = random.Random(SEED)
    out = Outcomes()
    root, d = _fresh_copy(world, "probe")
    assert set(_files(d)) | {"LATEST"} == set(FLIPS), _files(d)  # every file of the checkpoint is fuzzed
    out.run(world, root, "intact")
    assert out.loaded_intact == 1
    for name, count in FLIPS.items():
        for _ in range(count):
            root, d = _fresh_copy(world, "flip")
            f = root / name if name == "LATEST" else d / name
            data = bytearray(f.read_bytes())
            at = rng.randrange(len(data))
            data[at] ^= rng.randrange(1, 256)
            f.write_bytes(bytes(data))
            out.run(world, root, f"flip {name}@{at}")
        for k in range(TRUNCATIONS):
            root, d = _fresh_copy(world, "trunc")
            f = root / name if name == "LATEST" else d / name
            size = f.stat().st_size
            keep = 0 if k == 0 else rng.randrange(size)
            with open(f, "r+b") as fh:
                fh.truncate(keep)
            out.run(world, root, f"truncate {name} to {keep}")
        root, d = _fresh_copy(world, "delete")
        (root / name if name == "LATEST" else d / name).unlink()
        out.run(world, root, f"delete {name}")
    other = world["other"]
    swaps = [[f] for f in _files(other)] + [["__0_0.distcp", CHECKSUMS_FILE], _files(other)]
    for group in swaps:
        root, d = _fresh_copy(world, "swap")
        for f in group:
            shutil.copyfile(other / f, d / f)
        out.run(world, root, f"swap in step 2's {group}")
    cases = sum(FLIPS.values()) + (TRUNCATIONS + 1) * len(FLIPS) + len(swaps) + 1
    assert out.refused + out.loaded_intact == cases - len(out.silent_wrong) - len(out.foreign)
    assert not out.silent_wrong, f"{len(out.silent_wrong)} silent wrong loads: {out.silent_wrong[:5]}"
    assert not out.foreign, f"{len(out.foreign)} exceptions outside CheckpointError: {out.foreign[:3]}"
    assert not out.verify_passed, f"verify passed what load refused: {out.verify_passed[:5]}"
    assert out.refused > 0.9 * cases  # nearly every damage is refused (a flip of LATEST's newline is not damage)


def test_damaged_metadata_without_checksums_fails_as_checkpoint_error(world):
    """A checkpoint saved before checksums existed cannot tell every damage from data, but a
    damaged ``.metadata`` still fails as a CheckpointError (never an AttributeError, TypeError
    or KeyError from DCP), and never reads outside its directory."""
    rng = random.Random(SEED + 1)
    out = Outcomes()
    _, d = _fresh_copy(world, "old-format")
    md, _ = read_metadata(d)
    md.planner_data = None
    (d / CHECKSUMS_FILE).unlink()
    (d / ".metadata").write_bytes(pickle.dumps(md))
    old = world["base"] / "old-format"
    shutil.rmtree(old, ignore_errors=True)
    shutil.copytree(d.parent, old)
    for _ in range(OLD_FORMAT_FLIPS):
        root = world["base"] / "cases" / "old-flip"
        shutil.rmtree(root, ignore_errors=True)
        shutil.copytree(old, root)
        f = root / world["name"] / ".metadata"
        data = bytearray(f.read_bytes())
        at = rng.randrange(len(data))
        data[at] ^= rng.randrange(1, 256)
        f.write_bytes(bytes(data))
        out.run(world, root, f"flip .metadata@{at} (no checksums)")
        out.run_offline(root, f"flip .metadata@{at} (no checksums)")
    assert not out.foreign, f"{len(out.foreign)} exceptions outside CheckpointError: {out.foreign[:3]}"
    assert out.refused > 0.8 * OLD_FORMAT_FLIPS


def _entry_points(root: Path, tmp: Path) -> list[tuple[str, Callable[[], Any]]]:
    return [
        ("read_manifest", lambda: ckpt.read_manifest(root)),
        ("checkpoint_info", lambda: ckpt.checkpoint_info(root)),
        ("verify_checkpoint", lambda: ckpt.verify_checkpoint(root)),
        ("consolidate_model_state_dict", lambda: ckpt.consolidate_model_state_dict(root)),
        ("consolidate_torch_optim_state_dict", lambda: ckpt.consolidate_torch_optim_state_dict(root)),
        ("consolidate_checkpoint", lambda: ckpt.consolidate_checkpoint(root, tmp / "m.pt", optim=tmp / "o.pt")),
    ]


def _no_code_runs(world: dict[str, Any], root: Path, marker: Path, case: str, capsys: Any,
                  everywhere: bool = True) -> CheckpointError:
    """Load and verify refuse the checkpoint; so does every other entry point (``everywhere``;
    else those that never read the hostile record may succeed); none runs the payload."""
    comm = world["comm"]
    with pytest.raises(ckpt.CheckpointCorruptError) as caught:
        load_checkpoint(root, world["template"], comm)
    assert not marker.exists(), f"{case}: load ran the payload"
    for name, call in _entry_points(root, marker.parent):
        try:
            call()
        except ckpt.CheckpointCorruptError:
            pass
        else:
            assert not everywhere and name != "verify_checkpoint", f"{case}: {name} accepted it"
        assert not marker.exists(), f"{case}: {name} ran the payload"
    for command in (["info", str(root)], ["verify", str(root)],
                    ["consolidate", str(root), str(marker.parent / "m.pt")]):
        code = cli(command)
        captured = capsys.readouterr()
        assert code == 1 or (not everywhere and command[0] != "verify"), (case, command)
        if code == 1:
            err = captured.err
            assert err.count("\n") == 1 and err.startswith("error: CheckpointCorruptError"), err
        assert not marker.exists(), f"{case}: the command line ({command[0]}) ran the payload"
    return caught.value


def test_pickle_payloads_never_run(world, tmp_path, capsys):
    marker = tmp_path / "payload-ran"
    # .metadata: a bare payload, and a payload inside otherwise valid metadata
    good, _ = read_metadata(world["base"] / "pristine" / world["name"])
    nested = pickle.loads(pickle.dumps(good))
    nested.storage_meta.checkpoint_id = Payload(marker)
    for label, blob in [("bare", pickle.dumps(Payload(marker))), ("nested", pickle.dumps(nested))]:
        root, d = _fresh_copy(world, f"payload-{label}")
        (d / ".metadata").write_bytes(blob)
        e = _no_code_runs(world, root, marker, f".metadata {label}", capsys)
        assert ".metadata" in str(e) and "digest differs" in str(e)  # refused before unpickling
        # re-signed: the checksum file made to vouch for the payload; the allow-list refuses it
        sums = json.loads((d / CHECKSUMS_FILE).read_text())
        sums["metadata"]["sha256"] = hashlib.sha256(blob).hexdigest()
        sums["self"] = _doc_crc(sums)
        (d / CHECKSUMS_FILE).write_text(json.dumps(sums))
        e = _no_code_runs(world, root, marker, f".metadata {label}, re-signed", capsys)
        assert "file .metadata cannot be read as checkpoint metadata" in str(e)
        assert "open, which is not part of checkpoint metadata" in str(e)
        (d / CHECKSUMS_FILE).unlink()
        _no_code_runs(world, root, marker, f".metadata {label}, no checksums", capsys)


def test_object_record_payload_with_valid_checksums_never_runs(world, tmp_path, monkeypatch, capsys):
    """A data file's object record holding a payload, every checksum valid (as a checkpoint
    written to harm would be): ``weights_only`` refuses it, at load and at verify."""
    marker = tmp_path / "payload-ran"
    monkeypatch.setattr(ckpt.saveload, "_check_loadable", lambda key, v: None)
    comm = world["comm"]
    root = tmp_path / "hostile"
    save_checkpoint(world["state"], root, comm, extra={"evil": Payload(marker)})
    assert not marker.exists()
    e = _no_code_runs(world, root, marker, "object record", capsys, everywhere=False)
    assert "extra/evil" in str(e) and "__0_0.distcp" in str(e)
