"""The README's API screen runs as written (a transformers model trained with fzero, then at stage 3)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

README = Path(__file__).resolve().parent.parent / "README.md"


def _run_snippets(heading: str, count: int = 1) -> dict:
    """Run the first ``count`` python blocks after ``heading`` in one scope; return the scope."""
    text = README.read_text()
    section = text[text.index(heading):]
    scope: dict = {}
    for code in re.findall(r"```python\n(.*?)```", section, re.S)[:count]:
        exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - our own documentation
    return scope


def test_api_screen_runs():
    scope = _run_snippets("## The API in one screen")
    model, state, comm = scope["model"], scope["state"], scope["comm"]
    import fzero.checkpoint

    exported = fzero.checkpoint.export_model_state_dict(state, comm)
    for k, v in model.state_dict().items():
        assert torch.equal(v, exported[k]), k
    assert torch.isfinite(scope["metrics"]["loss"])


def test_stage3_snippet_runs():
    """The API section's second block (stage 3 with GPT-2 blocks as units), after the first."""
    scope = _run_snippets("## The API in one screen", count=2)
    state = scope["state"]
    assert state.params == () and len(state.module.units) == 2
    assert torch.isfinite(scope["metrics"]["loss"])
    assert int(state.opt.step) == 1


def test_models_larger_than_one_rank_snippet_runs():
    """The meta-device snippet: a Llama built on meta, filled unit by unit, one stage-3 step."""
    scope = _run_snippets("## Models larger than one rank")
    state, model = scope["state"], scope["model"]
    assert all(p.is_meta for p in model.parameters())
    assert torch.isfinite(scope["metrics"]["loss"]) and int(state.opt.step) == 1
    # inv_freq computed by the model's own init, not left as garbage
    inv = dict(zip(state.module.buffers, state.buffers))["model.rotary_emb.inv_freq"]
    dim = 64 // 4
    assert torch.allclose(inv[0], 1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim)))


def test_moe_snippet_runs():
    """The mixture-of-experts block, given a tiny Mixtral as ``model``: its state steps."""
    import fzero
    import moe_cases as mc

    text = README.read_text()
    section = text[text.index("## Mixture of experts"):]
    code = re.findall(r"```python\n(.*?)```", section, re.S)[0]
    scope: dict = {"model": mc.model("mixtral"), "fzero": fzero}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - our own documentation
    state, comm = scope["state"], scope["comm"]
    _, metrics = scope["step"](state, comm.split_batch(mc.batches(1, 4)[0]))
    assert torch.isfinite(metrics["loss"]) and state.layout.axes == (("experts", 2, 2),)
