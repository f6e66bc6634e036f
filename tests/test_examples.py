"""The examples run and learn (shortened versions of the README's main job)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from dist_harness import run_torchrun_script

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("flags", [["--stage", "2"], ["--stage", "1", "--world-size", "3", "--dtype", "bf16"]])
def test_train_example_learns_on_simulated_world(flags):
    out = _load("train").main(["--steps", "80", "--width", "64", *flags])
    assert out["last_loss"] < 0.5 * out["first_loss"], out


def test_train_example_fp16_dynamic_scaling():
    out = _load("train").main(["--steps", "80", "--width", "64", "--dtype", "fp16"])
    assert out["last_loss"] < 0.5 * out["first_loss"], out


def test_finetune_lora_example_learns_and_resumes_without_the_base():
    pytest.importorskip("peft")
    out = _load("finetune_lora").main(["--comm", "sim", "--steps", "30"])
    assert out["last_loss"] < 0.2 * out["first_loss"], out
    assert out["resumed_bitwise"] and out["adapters"] > 0, out


def test_train_moe_example_learns_and_equals_data_parallel(tmp_path):
    """EP = 2 on a simulated world of 4 against the same run with every expert on every rank: one curve."""
    pytest.importorskip("transformers")
    out = _load("train_moe").main(["--steps", "20", "--out", str(tmp_path)])
    assert out["last_loss"] < 0.8 * out["first_loss"], out
    assert out["max_difference"] < 1e-4 * out["first_loss"], out
    ep, dp = out["held_bytes"]
    assert ep < dp  # each rank holds half the experts


@pytest.mark.distributed
def test_train_moe_example_under_torchrun_gloo(tmp_path):
    """Four gloo ranks, EP = 2: each rank its own experts, tokens by all-to-all; the data-parallel run's curve."""
    pytest.importorskip("transformers")
    text = run_torchrun_script(4, str(EXAMPLES / "train_moe.py"),
                               ["--comm", "torch", "--steps", "10", "--out", str(tmp_path)], timeout=240)
    m = re.search(r"done: loss ([\d.]+) -> ([\d.]+) \(expert parallel, EP=2\), ([\d.]+) \(data parallel\); "
                  r"largest difference between the curves ([\d.e+-]+)", text)
    assert m, text[-2000:]
    assert float(m.group(2)) < 0.9 * float(m.group(1)) and float(m.group(4)) < 1e-4, text[-2000:]
    assert text.count("done: loss") == 1  # rank 0 alone reports


def test_compose_by_hand_example_learns():
    losses = _load("compose_by_hand").main(steps=40)
    assert losses[-1] < 0.2 * losses[0]


@pytest.mark.distributed
def test_train_example_under_torchrun_gloo():
    text = run_torchrun_script(2, str(EXAMPLES / "train.py"), ["--comm", "torch", "--steps", "60", "--width", "64"], timeout=240)
    m = re.search(r"done: loss ([\d.]+) -> ([\d.]+)", text)
    assert m, text[-2000:]
    assert float(m.group(2)) < 0.5 * float(m.group(1)), text[-2000:]


@pytest.mark.distributed
def test_finetune_lora_example_under_torchrun_gloo():
    pytest.importorskip("peft")
    text = run_torchrun_script(2, str(EXAMPLES / "finetune_lora.py"), ["--comm", "torch", "--steps", "30"], timeout=240)
    assert "bitwise equal to going on: True" in text, text[-2000:]
    losses = [float(x) for x in re.findall(r"step +\d+ +loss ([\d.]+)", text)]
    assert len(losses) >= 2 and losses[-1] < 0.2 * losses[0], text[-2000:]
