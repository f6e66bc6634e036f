"""The README as a new user reads it: the extras cover what each command imports, the
examples take the flags the README lists, a launcher is detected, fp16 on a CPU warns, and
the parity claim states the conditions its tests run under."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import re
import sys
from pathlib import Path

import pytest
import tomllib
import torch

from fzero.dist import choose_comm, launcher_world_size

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
FIRST_PARTY = {"fzero", "torch", "optree"}  # the package and its dependencies


def _third_party_imports(code: str) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(code)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
        out.update(n.split(".")[0] for n in names)
    local = {p.stem for p in (ROOT / "examples").glob("*.py")}  # the examples import each other
    return {n for n in out if n not in sys.stdlib_module_names and n not in FIRST_PARTY | local}


def _extra(name: str) -> set[str]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"][name]
    return {re.split(r"[<>=\[ ]", d)[0] for d in deps}


def test_examples_extra_covers_the_readme_commands():
    """``pip install -e ".[examples]"`` is enough for the README's snippets, the main job
    and the example scripts (the API screen's GPT-2 needs transformers, the property test
    hypothesis, the plot matplotlib)."""
    code = "\n".join(re.findall(r"```python\n(.*?)```", README, re.S))
    for script in ("train_gpt.py", "train.py", "property_test.py", "compose_by_hand.py", "gpt.py"):
        code += "\n" + (ROOT / "examples" / script).read_text()
    needed = _third_party_imports(code)
    assert {"transformers", "hypothesis", "matplotlib"} <= needed, needed  # the check sees them
    assert needed <= _extra("examples"), f"missing from the examples extra: {needed - _extra('examples')}"


def test_readme_recommends_the_current_checkpointing_name():
    pytest.importorskip("transformers")
    from transformers import PreTrainedModel

    named = re.findall(r"model\.(\w+_checkpointing_enable)\(", README)
    assert named and all(hasattr(PreTrainedModel, n) for n in named), named
    current = [n for n in named if "deprecated" not in (getattr(PreTrainedModel, n).__doc__ or "").lower()]
    assert current == named, f"the README recommends a deprecated name: {named}"


def test_parity_claim_states_its_conditions_and_the_tests_meet_them():
    """The README's "same numbers, bit for bit" names the intra-op thread count and the rank-order sums that make it
    hold at every world size; the gloo tests behind it run every process with that one thread count, and with the
    communicator's default (rank order) at 4 ranks too."""
    claim = README[:README.index("## Quick start")]
    assert "bit for bit" in claim and "intra-op" in claim and "set_num_threads" in claim
    assert "every world size" in claim and 'all_reduce_via="rank_order"' in claim
    import dist_harness
    import test_distributed

    assert test_distributed.SIM_THREADS == 1
    assert "torch.set_num_threads(1)" in inspect.getsource(dist_harness.worker_main)
    assert "TorchCommunicator()" in inspect.getsource(dist_harness.worker_main)
    assert "eager_s2" in test_distributed.W4_CASES


def test_ci_runs_the_readme_test_command():
    """``.ci/run`` calls exactly the README's test command, which lints before it tests."""
    (command,) = [line for line in re.findall(r"```bash\n(.*?)```", README, re.S)
                  if "pytest" in line and ".[dev]" in line]
    command = command.strip()
    assert command in (ROOT / ".ci" / "run").read_text().splitlines()
    assert command.index("ruff check") < command.index("pytest")


def test_launcher_is_detected():
    torchrun = {"WORLD_SIZE": "2", "LOCAL_RANK": "0", "RANK": "0"}
    assert launcher_world_size({}) is None and launcher_world_size(torchrun) == 2
    assert choose_comm("auto", {}) == "sim" and choose_comm("auto", torchrun) == "torch"
    assert choose_comm("sim", {}) == "sim" and choose_comm("torch", torchrun) == "torch"
    assert choose_comm("sim", {"WORLD_SIZE": "1", "LOCAL_RANK": "0"}) == "sim"  # one rank: no clash
    with pytest.raises(ValueError, match=r"--comm sim under a launcher of 2 ranks \(WORLD_SIZE=2\).*--comm torch"):
        choose_comm("sim", torchrun)


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("script", ["train", "train_gpt"])
def test_examples_refuse_a_simulated_world_under_torchrun(script, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(SystemExit) as info:
        _load(script).main(["--comm", "sim", "--steps", "1"])
    assert info.value.code == 2
    assert "--comm sim under a launcher of 2 ranks" in capsys.readouterr().err


def test_train_example_takes_stage_3_and_dtype_auto():
    out = _load("train").main(["--steps", "30", "--width", "16", "--stage", "3", "--dtype", "auto"])
    assert out["last_loss"] < out["first_loss"], out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the warning is about CPUs")
@pytest.mark.parametrize("script", ["train", "train_gpt"])
def test_fp16_on_a_cpu_warns(script):
    mod = _load(script)
    with pytest.warns(RuntimeWarning, match="fp16 on a CPU: slower than fp32.*--dtype auto"):
        mod.choose_dtype("fp16")
