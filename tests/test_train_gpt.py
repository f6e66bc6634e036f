"""The main job (examples/train_gpt.py) runs, learns and writes its plot: shortened versions.

A smaller GPT than the README's (d_model 64, 2 layers, context 32) for a few
dozen steps, in this process on the simulated world, and once under torchrun
on 2 gloo ranks.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest

from dist_harness import run_torchrun_script

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SMALL = ["--d-model", "64", "--layers", "2", "--heads", "2", "--context", "32", "--batch", "16",
         "--sample-chars", "40"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _train_gpt():
    spec = importlib.util.spec_from_file_location("train_gpt", EXAMPLES / "train_gpt.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _check(out: dict, margin: float) -> None:
    assert out["last_loss"] < out["first_loss"] - margin, {k: out[k] for k in ("first_loss", "last_loss")}
    png = Path(out["plot"])
    assert png.read_bytes()[:8] == PNG_MAGIC, png
    assert out["sample"].startswith("The ") and len(out["sample"]) == 44


@pytest.mark.parametrize("stage", [2, 3])
def test_main_job_learns_and_plots(stage, tmp_path):
    out = _train_gpt().main(["--stage", str(stage), "--steps", "40", "--out", str(tmp_path), *SMALL])
    _check(out, margin=0.8)
    assert out["skipped"] == 0
    assert out["val_loss"] < out["val_loss_start"] - 0.8


def test_main_job_fp16_accumulation(tmp_path):
    out = _train_gpt().main(["--stage", "3", "--dtype", "fp16", "--accum", "2", "--steps", "40",
                             "--out", str(tmp_path), *SMALL])
    _check(out, margin=0.8)


@pytest.mark.distributed
def test_main_job_under_torchrun_gloo(tmp_path):
    text = run_torchrun_script(
        2, str(EXAMPLES / "train_gpt.py"),
        ["--comm", "torch", "--steps", "20", "--out", str(tmp_path), *SMALL], timeout=240,
    )
    m = re.search(r"loss ([\d.]+) -> ([\d.]+)", text)
    assert m, text[-2000:]
    assert float(m.group(2)) < float(m.group(1)) - 0.5, text[-2000:]
    assert "world: TorchCommunicator(rank=0, world_size=2" in text, text[:2000]
    assert text.count("held-out loss") == 1, "only rank 0 prints"
    (png,) = tmp_path.glob("*.png")
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_dtype_auto_follows_the_hardware(monkeypatch):
    import torch

    import fzero

    native, why = fzero.precision.native_bf16(torch.device("cpu"))
    hardware = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    capped = {os.environ.get(k, "").upper() for k in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")}
    kernels = torch.backends.cpu.get_cpu_capability().startswith("AVX512") and \
        not capped & fzero.precision._ONEDNN_WITHOUT_BF16
    assert native == (hardware and kernels), why
    assert why
    mod = _train_gpt()
    monkeypatch.setattr(fzero.precision, "native_bf16", lambda: (False, "the CPU has neither"))
    assert mod.choose_dtype("auto") == ("fp32", "--dtype auto: the CPU has neither")
    monkeypatch.setattr(fzero.precision, "native_bf16", lambda: (True, "the CPU has AMX"))
    assert mod.choose_dtype("auto") == ("bf16", "--dtype auto: the CPU has AMX")
    assert mod.choose_dtype("fp16")[0] == "fp16"
    assert mod.parse_args([]).dtype == "auto"


def test_device_auto_follows_the_hardware_and_each_torchrun_rank_takes_its_gpu(monkeypatch):
    """``--device auto``: the CPU without CUDA (``--device cuda`` then refused), CUDA with it; under torchrun
    ``cuda:LOCAL_RANK``, in a simulated world the current GPU; ``--device cpu`` stays on the CPU."""
    import torch

    mod = _train_gpt()
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert mod.choose_device("auto", "sim") == (torch.device("cpu"), "--device auto: no CUDA device")
    with pytest.raises(SystemExit):
        mod.parse_args(["--device", "cuda"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert mod.parse_args(["--device", "cuda"]).device == "cuda"
    assert mod.choose_device("auto", "sim")[0] == torch.device("cuda", 1)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert mod.choose_device("auto", "torch") == (torch.device("cuda", 3), "--device auto: torch sees a CUDA device, "
                                                                          "LOCAL_RANK 3")
    assert mod.choose_device("cuda", "torch")[0] == torch.device("cuda", 3)
    assert mod.choose_device("cpu", "torch")[0] == torch.device("cpu")


@pytest.mark.parametrize("hardware,capability,onednn,native", [
    (True, "AVX512", None, True), (True, "AVX512", "AVX512_CORE_AMX", True), (False, "AVX512", None, False),
    (True, "AVX2", None, False), (True, "AVX512", "AVX2", False), (True, "AVX512", "avx512_core", False)])
def test_bf16_is_native_only_where_the_kernels_that_run_have_it(monkeypatch, hardware, capability, onednn, native):
    """The hardware probes, ATen's kernels (``ATEN_CPU_CAPABILITY`` caps them: an AVX2-only CPU's, on any CPU) and
    oneDNN's cap (``ONEDNN_MAX_CPU_ISA``) all decide, and the reason names the one that said no."""
    import torch

    import fzero

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: hardware)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    if onednn is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", onednn)
    got, why = fzero.precision.native_bf16(torch.device("cpu"))
    assert got == native, why
    expected = "AVX512-BF16" if native else "neither" if not hardware else capability if capability != "AVX512" \
        else f"ONEDNN_MAX_CPU_ISA={onednn}"
    assert expected in why, why


RESUME = ["--d-model", "32", "--layers", "1", "--heads", "2", "--context", "16", "--batch", "8",
          "--sample-chars", "0", "--dropout", "0.2", "--steps", "9"]
STOP = "5"  # an odd step: the warm-up and cosine schedule, the generators and the data are mid-run


def test_main_job_resumes_exactly(tmp_path):
    """Stopped at an odd step and resumed with --resume: the same losses and the same weights,
    bit for bit, as the uninterrupted run (dropout on: each rank's generator is saved)."""
    mod = _train_gpt()
    out = ["--out", str(tmp_path)]
    full = mod.main([*RESUME, *out])
    ckpt = ["--ckpt", str(tmp_path / "ckpt")]
    first = mod.main([*RESUME, *out, *ckpt, "--save-every", "2", "--stop-at", STOP])
    assert first["stopped_at"] == 5 and first["losses"] == full["losses"][:5]
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step-*")) == [
        "step-00000002", "step-00000004", "step-00000005"]
    resumed = mod.main([*RESUME, *out, *ckpt, "--resume"])
    assert resumed["losses"] == full["losses"]
    assert resumed["params_sha256"] == full["params_sha256"]
    with pytest.raises(SystemExit, match="lr = 0.003, this one has 0.001"):
        mod.main([*RESUME, *out, *ckpt, "--resume", "--lr", "1e-3"])


@pytest.mark.distributed
def test_main_job_resumes_exactly_under_torchrun_gloo(tmp_path):
    """The same on 2 gloo ranks: stopped, resumed, and its weights are those of the
    uninterrupted run (here the simulated world's, which real ranks reproduce bit for bit)."""
    full = _train_gpt().main([*RESUME, "--out", str(tmp_path)])
    args = ["--comm", "torch", *RESUME, "--out", str(tmp_path), "--ckpt", str(tmp_path / "ckpt")]
    text = run_torchrun_script(2, str(EXAMPLES / "train_gpt.py"), [*args, "--stop-at", STOP], timeout=240)
    assert "stopped at step 5 of 9" in text, text[-2000:]
    text = run_torchrun_script(2, str(EXAMPLES / "train_gpt.py"), [*args, "--resume", "--timeout", "120"],
                               timeout=240)
    assert "at step 5" in text and "timeout=120s" in text, text[-2000:]
    assert f"trained parameters: sha256 {full['params_sha256']}" in text, text[-2000:]


def test_main_job_on_a_mesh_with_quantized_collectives(tmp_path, capsys):
    """--mesh R,S: the log names the mesh (and says when it degenerates to flat); --qwz --qgz 4 quantize on a simulated
    2x2 mesh and the job still learns; the quantized comparison script plots both runs together."""
    mod = _train_gpt()
    out = mod.main(["--mesh", "2,2", "--qwz", "--qgz", "4", "--steps", "40", "--out", str(tmp_path), *SMALL])
    _check(out, 0.3)
    log = capsys.readouterr().out
    assert "QuantizedCommunicator(SimulatedWorld(4, mesh=(2, 2)), weights=8, grads=4" in log
    assert "4 ranks x 1 micro-batch(es)" in log and "the state sharded over 2" in log
    mod.main(["--mesh", "1,2", "--steps", "2", "--out", str(tmp_path), *SMALL])
    assert "SimulatedWorld(2, mesh=(1, 2): flat, one shard group)" in capsys.readouterr().out
    mod.main(["--mesh", "2,2", "--hpz", "--stage", "3", "--steps", "2", "--out", str(tmp_path), *SMALL])
    assert "world: SimulatedWorld(4, hpz mesh=(2, 2)), ZeRO stage 3" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"mesh \(2, 2\).*world size 3"):
        mod.main(["--mesh", "2,2", "--world-size", "3", "--steps", "2", "--out", str(tmp_path), *SMALL])
    spec = importlib.util.spec_from_file_location("compare_quantized", EXAMPLES / "compare_quantized.py")
    cmp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cmp)
    result = cmp.main(["--steps", "12", "--out", str(tmp_path), *SMALL])
    assert Path(result["plot"]).read_bytes()[:8] == PNG_MAGIC
    assert abs(result["relative"]) < 0.05, result
