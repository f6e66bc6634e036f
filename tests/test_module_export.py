"""Trained models leave fzero whole: tied names, buffers, write-back, checkpoints with buffers."""

from __future__ import annotations

import pytest
import torch

import fzero
import fzero.checkpoint
import user_models as um
from test_user_models import OPTIMIZERS, _data, fzero_run, rel_err

pytest.importorskip("transformers")


def test_export_of_tied_gpt2_loads_strictly_and_equals_the_oracle():
    model = um.gpt2().double()
    data = _data("lm", 2, torch.float64, n=3)
    ref, _, _ = um.oracle_run(model, OPTIMIZERS["sgd"][1], data, 2, um.oracle_loss("lm"))
    state, comm, _ = fzero_run(model, OPTIMIZERS["sgd"][0](), data, 2, "lm", stage=2)
    sd = fzero.checkpoint.export_model_state_dict(state, comm)
    assert list(sd) == list(ref.state_dict())  # every key, tied lm_head.weight included, in torch's order
    assert sd["lm_head.weight"] is sd["transformer.wte.weight"]
    fresh = um.gpt2().double()
    fresh.load_state_dict(sd, strict=True)
    for k, v in ref.state_dict().items():
        assert rel_err(fresh.state_dict()[k], v) <= 1e-10, k


def test_write_back_puts_parameters_and_buffers_into_the_module():
    model = um.resnet().double()
    data = _data("image", 2, torch.float64, n=3)
    ref, replicas, _ = um.oracle_run(model, OPTIMIZERS["sgd"][1], data, 2, um.oracle_loss("image"))
    state, comm, _ = fzero_run(model, OPTIMIZERS["sgd"][0](), data, 2, "image", stage=1)
    target = um.resnet().double()
    assert fzero.write_back(state, comm, target) is target
    for k, v in target.state_dict().items():
        want = dict(replicas[0].named_buffers()).get(k, ref.state_dict()[k])  # buffers: rank 0's
        if v.is_floating_point():
            assert rel_err(v, want) <= 1e-10, k
        else:
            assert torch.equal(v, want), k


def test_llama_write_back_keeps_non_persistent_buffers():
    model = um.llama()
    comm = fzero.SimulatedWorld(1)
    state = fzero.init_train_state(model, fzero.sgd(lr=0.1), comm)
    target = um.llama(seed=5)
    with torch.no_grad():
        target.model.rotary_emb.inv_freq.zero_()
    fzero.write_back(state, comm, target)
    assert torch.equal(target.model.rotary_emb.inv_freq, model.model.rotary_emb.inv_freq)
    assert "model.rotary_emb.inv_freq" not in fzero.checkpoint.export_model_state_dict(state, comm)


def test_checkpoint_keeps_rank0_buffers_across_world_sizes(tmp_path):
    model = um.resnet()
    data = _data("image", 2, torch.float32, n=2)
    state, comm, _ = fzero_run(model, fzero.sgd(lr=0.1, momentum=0.9), data, 2, "image", stage=2)
    assert not torch.equal(state.buffers[0][0], state.buffers[0][1])  # ranks differ after a step
    fzero.save_checkpoint(state, tmp_path, comm)
    world3 = fzero.SimulatedWorld(3)
    template = fzero.init_train_state(um.resnet(seed=9), fzero.sgd(lr=0.1, momentum=0.9), world3)
    loaded, _ = fzero.load_checkpoint(tmp_path, template, world3)
    for name, mine, saved, keep in zip(state.module.buffers, loaded.buffers, state.buffers, state.module.persistent):
        assert keep
        for r in range(3):
            assert torch.equal(mine[r], saved[0]), (name, r)
    exported = fzero.checkpoint.export_model_state_dict(state, comm)
    out = tmp_path / "model.pt"
    fzero.checkpoint.consolidate_checkpoint(tmp_path, out)
    offline = torch.load(out, weights_only=True)
    assert list(offline) == list(exported)
    for k in exported:
        assert torch.equal(offline[k], exported[k]), k


def test_checkpoint_of_a_model_with_other_buffers_is_refused(tmp_path):
    model = um.resnet()
    comm = fzero.SimulatedWorld(1)
    state = fzero.init_train_state(model, fzero.sgd(), comm)
    fzero.save_checkpoint(state, tmp_path, comm)
    other = um.resnet()
    other.register_buffer("extra", torch.zeros(3))
    template = fzero.init_train_state(other, fzero.sgd(), comm)
    with pytest.raises(fzero.checkpoint.CheckpointMismatchError, match=r"buffer 'extra' is not in the checkpoint"):
        fzero.load_checkpoint(tmp_path, template, comm)
