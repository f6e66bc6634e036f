"""Export to a Hugging Face model directory (``fzero.checkpoint.export_pretrained``, ``python -m fzero.checkpoint
export``): ``transformers``' ``from_pretrained`` of the export of a tiny GPT-2 (tied) and Llama, from checkpoints saved
at stages 1-3 and W=2-3 and from the live state, equals ``fzero.write_back`` bit for bit in the saved dtype; ``--dtype
bf16`` equals the bf16 cast; a sharded export is cut as ``huggingface_hub``'s splitter cuts the same state dict and
loads the same; a ``peft`` LoRA export is what ``get_peft_model_state_dict`` gives and loads with
``PeftModel.from_pretrained``. Bad output: a named ``CheckpointOutputError`` and nothing left that looks complete.
On 3 gloo ranks (tests/export_worker.py): the live export and the offline export of their checkpoint equal
``write_back`` and the simulated world; an output error raises on every rank. ``consolidate`` (now streamed) is
covered by the checkpoint tests; memory: benchmarks/bench_export.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fzero
import fzero.checkpoint
import user_models as um
from fzero.checkpoint import CheckpointError, CheckpointOutputError, export_pretrained, save_checkpoint
from fzero.checkpoint.__main__ import main as cli
from helpers import run_steps

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

MODELS = {"gpt2": um.gpt2, "llama": um.llama}
STEPS = 2


def _trained(kind: str, stage: int, world: int, seed: int = 0):
    model = MODELS[kind](seed=seed)
    comm = fzero.SimulatedWorld(world)
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-2), comm, stage=stage)
    step = fzero.make_train_step(fzero.module_loss(model, um.lm_criterion), comm)
    state, _ = run_steps(step, state, comm, um.token_batches(STEPS, world * 2, seed=seed + 1))
    return state, comm, model


def _written_back(kind: str, state, comm) -> dict[str, torch.Tensor]:
    """What ``fzero.write_back`` gives: the reference every export is compared with, bit for bit."""
    module = fzero.write_back(state, comm, MODELS[kind](seed=99))
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _loaded(path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def _assert_same(got: torch.nn.Module, want: dict[str, torch.Tensor], cast: torch.dtype | None = None) -> None:
    sd = got.state_dict()
    assert set(sd) == set(want)
    for k, v in want.items():
        v = v if cast is None or not v.is_floating_point() else v.to(cast)
        assert sd[k].dtype == v.dtype and torch.equal(sd[k], v), k


def _config(model: torch.nn.Module, path: Path) -> Path:
    model.config.to_json_file(path)
    return path


CASES = [(kind, stage, world) for kind in MODELS for stage in (1, 2, 3) for world in (2, 3)]


@pytest.mark.parametrize("kind,stage,world", CASES)
def test_from_pretrained_of_an_export_equals_write_back(tmp_path, kind, stage, world):
    """From the checkpoint (offline) and from the live state: the same parameters as ``write_back``, every bit; tied
    weights written once (the embedding's name) and tied again by ``from_pretrained``."""
    state, comm, model = _trained(kind, stage, world)
    want = _written_back(kind, state, comm)
    save_checkpoint(state, tmp_path / "ckpt", comm)
    config = _config(model, tmp_path / "config.json")
    offline = export_pretrained(tmp_path / "ckpt", tmp_path / "offline", config=config)
    live = export_pretrained(state, tmp_path / "live", comm=comm, config=config)
    for out in (offline, live):
        assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
        got = _loaded(out)
        _assert_same(got, want)
        written = safetensors_torch.load_file(out / "model.safetensors")
        if kind == "gpt2":  # tied: once, under the name the module keeps; from_pretrained ties it again
            assert "transformer.wte.weight" in written and "lm_head.weight" not in written
            assert got.lm_head.weight.data_ptr() == got.transformer.wte.weight.data_ptr()
        assert set(written) == set(want) - ({"lm_head.weight"} if kind == "gpt2" else set())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_bf16_export_equals_the_bf16_cast(tmp_path):
    """``--dtype bf16`` (the CLI): every floating tensor is the bf16 cast of write_back's, and the config says bf16."""
    state, comm, model = _trained("llama", 2, 2)
    want = _written_back("llama", state, comm)
    save_checkpoint(state, tmp_path / "ckpt", comm)
    config = _config(model, tmp_path / "config.json")
    assert cli(["export", str(tmp_path / "ckpt"), str(tmp_path / "bf16"), "--dtype", "bf16",
                "--config", str(config)]) == 0
    written = safetensors_torch.load_file(tmp_path / "bf16" / "model.safetensors")
    assert {v.dtype for v in written.values()} == {torch.bfloat16}
    for k, v in written.items():
        assert torch.equal(v, want[k].to(torch.bfloat16)), k
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    _assert_same(_loaded(tmp_path / "bf16", torch.bfloat16), want, cast=torch.bfloat16)


@pytest.mark.parametrize("max_shard_size", ["3KB", 2500])
def test_a_sharded_export_is_cut_as_huggingface_hub_cuts_it_and_loads_the_same(tmp_path, max_shard_size):
    """Small ``max_shard_size``: the files and index are those ``huggingface_hub.split_torch_state_dict_into_shards``
    (what ``save_pretrained`` calls) gives for the same state dict, and ``from_pretrained`` loads the same values."""
    hub = pytest.importorskip("huggingface_hub")
    state, comm, model = _trained("gpt2", 3, 2)
    want = _written_back("gpt2", state, comm)
    save_checkpoint(state, tmp_path / "ckpt", comm)
    out = export_pretrained(tmp_path / "ckpt", tmp_path / "sharded", max_shard_size=max_shard_size,
                            config=_config(model, tmp_path / "config.json"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    untied = {k: v.clone() for k, v in want.items() if k != "lm_head.weight"}  # one storage each, as HF sees them
    split = hub.split_torch_state_dict_into_shards(untied, max_shard_size=max_shard_size)
    assert split.is_sharded and len(split.filename_to_tensors) > 3
    assert sorted(os.listdir(out)) == sorted([*split.filename_to_tensors, "model.safetensors.index.json",
                                              "config.json"])
    assert index["weight_map"] == split.tensor_to_filename
    assert index["metadata"]["total_size"] == split.metadata["total_size"]
    assert index["metadata"]["total_parameters"] == sum(v.numel() for v in untied.values())
    for file, names in split.filename_to_tensors.items():
        assert sorted(safetensors_torch.load_file(out / file)) == sorted(names)
    _assert_same(_loaded(out), want)


@pytest.mark.parametrize("stage", [1, 3])
def test_a_lora_export_is_peft_s_and_loads_with_peft_model_from_pretrained(tmp_path, stage):
    """A peft LoRA state exports its adapters: the keys and values ``get_peft_model_state_dict`` gives of the trained
    model, in ``adapter_model.safetensors``; ``PeftModel.from_pretrained`` on the base gives the trained adapters. From
    a checkpoint without the frozen base too (the adapters need none)."""
    peft = pytest.importorskip("peft")
    model = um.lora("llama")
    comm = fzero.SimulatedWorld(2)
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-2), comm, stage=stage)
    step = fzero.make_train_step(fzero.module_loss(model, um.lm_criterion), comm)
    state, _ = run_steps(step, state, comm, um.token_batches(STEPS, 4))
    trained = fzero.write_back(state, comm, um.lora("llama"))
    want = {k: v.detach().clone() for k, v in peft.get_peft_model_state_dict(trained).items()}
    assert want and all("lora_" in k for k in want)
    save_checkpoint(state, tmp_path / "lean", comm, frozen=False)
    trained.peft_config["default"].save_pretrained(tmp_path / "cfg")  # writes adapter_config.json
    config = tmp_path / "cfg" / "adapter_config.json"
    outs = [export_pretrained(tmp_path / "lean", tmp_path / "offline", config=config),
            export_pretrained(state, tmp_path / "live", comm=comm, config=config)]
    for out in outs:
        assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]
        written = safetensors_torch.load_file(out / "adapter_model.safetensors")
        assert set(written) == set(want)
        assert all(torch.equal(written[k], want[k]) for k in want)
        loaded = peft.PeftModel.from_pretrained(um.llama(seed=0), out)
        got = dict(loaded.named_parameters())
        for name, p in trained.named_parameters():
            if "lora_" in name:
                assert torch.equal(got[name], p), name
    with pytest.raises(CheckpointError, match="left its frozen parameters out"):
        export_pretrained(tmp_path / "lean", tmp_path / "whole", adapter=False)
    # the whole peft model (the frozen base sharded too at stage 3), live and from a full checkpoint
    save_checkpoint(state, tmp_path / "full", comm)
    whole = fzero.checkpoint.export_model_state_dict(state, comm)
    for out in (export_pretrained(state, tmp_path / "whole-live", comm=comm, adapter=False),
                export_pretrained(tmp_path / "full", tmp_path / "whole-offline", adapter=False)):
        written = safetensors_torch.load_file(out / "model.safetensors")
        assert set(written) == set(whole) and all(torch.equal(written[k], whole[k]) for k in whole)
    with pytest.raises(ValueError, match="no adapter 'other'"):
        export_pretrained(state, tmp_path / "other", comm=comm, adapter="other")


def test_bad_output_is_a_named_error_leaving_nothing_that_looks_complete(tmp_path):
    """An existing non-empty directory, a directory that cannot be created (its parent a file), a bad option: named
    errors before anything is written, the output untouched, no temporary directory left."""
    state, comm, model = _trained("gpt2", 2, 2)
    save_checkpoint(state, tmp_path / "ckpt", comm)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "mine.txt").write_text("keep")
    with pytest.raises(CheckpointOutputError, match="busy: it exists and is not empty"):
        export_pretrained(tmp_path / "ckpt", busy)
    assert os.listdir(busy) == ["mine.txt"]
    (tmp_path / "a_file").write_text("")
    with pytest.raises(CheckpointOutputError, match="a_file"):
        export_pretrained(state, tmp_path / "a_file" / "out", comm=comm)
    assert cli(["export", str(tmp_path / "ckpt"), str(busy)]) == 1
    with pytest.raises(ValueError, match="max_shard_size"):
        export_pretrained(tmp_path / "ckpt", tmp_path / "x", max_shard_size="5 parsecs")
    (tmp_path / "bad.json").write_text("[1, 2")
    with pytest.raises(ValueError, match="bad.json is not a JSON object"):
        export_pretrained(tmp_path / "ckpt", tmp_path / "x", config=tmp_path / "bad.json")
    empty = tmp_path / "empty"
    empty.mkdir()  # an empty directory is taken, as save_pretrained takes it
    assert export_pretrained(tmp_path / "ckpt", empty) == empty and (empty / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "bad.json", "busy", "ckpt", "empty"]


_FULL_DISK = """
import resource, signal, sys
import fzero.checkpoint as ckpt
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[3]), int(sys.argv[3])))
try:
    if sys.argv[4] == "export":
        ckpt.export_pretrained(sys.argv[1], sys.argv[2], max_shard_size="4KB")
    else:
        ckpt.consolidate_checkpoint(sys.argv[1], sys.argv[2])
except ckpt.CheckpointOutputError as e:
    print("ERROR", e)
"""


@pytest.mark.parametrize("job", ["export", "consolidate"])
def test_a_write_error_part_way_is_named_and_leaves_nothing(tmp_path, job):
    """A write that fails part way (the file-size limit stands in for a full disk: the same ``OSError`` from
    ``write``): a ``CheckpointOutputError`` naming the file, and nothing left at the output or beside it (an export's
    partial directory and a consolidation's partial file are removed)."""
    state, comm, _ = _trained("gpt2", 2, 2)
    save_checkpoint(state, tmp_path / "ckpt", comm)
    out = tmp_path / ("out" if job == "export" else "model.pt")
    run = subprocess.run([sys.executable, "-c", _FULL_DISK, str(tmp_path / "ckpt"), str(out), "3000", job],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "ERROR cannot write" in run.stdout, run.stdout
    assert (".safetensors" if job == "export" else "model.pt") in run.stdout, run.stdout
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_holder_is_the_lowest_data_rank_with_the_shard_on_every_world():
    """``Communicator.holder``, the source a live export broadcasts each piece from: the shard rank without replicas,
    the lowest data rank holding that shard on a mesh (rows are data ranks), a wrapper's inner's answer."""
    from fzero.comm import CountingCommunicator

    assert [fzero.SimulatedWorld(3).holder(r) for r in range(3)] == [0, 1, 2]
    mesh = fzero.SimulatedWorld(4, mesh=(2, 2))
    for r in range(mesh.world_size):
        h = CountingCommunicator(mesh).holder(r)
        assert mesh.ranks[h] == r and all(mesh.ranks[d] != r for d in range(h))
    with pytest.raises(ValueError, match="shard rank must be in"):
        mesh.holder(2)


GLOO_CASES = ["gpt2-s1", "gpt2-s3", "llama-s2"]


@pytest.fixture(scope="module")
def gloo_exports():
    """Three gloo ranks (tests/export_worker.py): each case's checkpoint, its live export, and write_back of the gloo
    and of the simulated state; then the case where every rank exports to a directory that is not empty."""
    import tempfile

    from dist_harness import HERE, run_torchrun_script

    out = Path(tempfile.mkdtemp(prefix="fzero-export3-"))
    run_torchrun_script(3, str(HERE / "export_worker.py"), [str(out), *GLOO_CASES, "busy"], timeout=300)
    results = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(3)]
    for case in [*GLOO_CASES, "busy"]:
        for r in results:
            assert "exception" not in r[case], r[case]["exception"]
    return out, results


@pytest.mark.parametrize("case", GLOO_CASES)
def test_gloo_exports_equal_write_back_and_the_simulated_world(gloo_exports, case):
    """On 3 gloo ranks: the live export (each tensor gathered in turn, rank 0 writes; the Llama case in pieces of 7
    elements) and the offline export of the checkpoint the ranks saved load as ``write_back`` gives, bit for bit, and
    as the simulated world's does."""
    out, results = gloo_exports
    want = results[0][case]["gloo"]
    for k, v in results[0][case]["simulated"].items():
        assert torch.equal(v, want[k]), k
    offline = export_pretrained(out / f"ckpt-{case}", out / f"offline-{case}", config=out / f"config-{case}.json")
    for d in (out / f"live-{case}", offline):
        _assert_same(_loaded(d), want)


def test_gloo_export_to_a_busy_directory_raises_on_every_rank(gloo_exports):
    """Rank 0 finds the output not empty: it raises naming it, and the other ranks raise too (no gather waits)."""
    out, results = gloo_exports
    raised = [r["busy"]["raised"] for r in results]
    assert "busy: it exists and is not empty" in raised[0]
    assert all("failed on rank 0" in r for r in raised[1:]), raised
    assert os.listdir(out / "busy") == ["mine.txt"]
