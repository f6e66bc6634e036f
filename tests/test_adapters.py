"""Fine-tuning as users bring it: ``peft`` LoRA on a tiny Llama and GPT-2 (attention and MLP projections),
and a GPT-2 whose own ``requires_grad_(False)`` leaves only a new head trainable, at stages 1-3, against the
plain-torch W-rank oracle over the trainable parameters only (``torch.optim.AdamW``), in float64. And what a
state does when a user changes ``requires_grad`` mid-run: a ``ValueError`` naming the parameter, the state
kept, and the recipe the error gives (``write_back``, then a new state) equal to torch doing the same.
"""

from __future__ import annotations

import copy

import pytest
import torch

import fzero
import fzero.checkpoint
import user_models as um
from helpers import CHEAP_COMPILE, max_rel_err, run_steps

pytest.importorskip("transformers")
pytest.importorskip("peft")

STEPS = 4
LR, DECAY = 1e-2, 0.1


def _fzero_adamw():
    return fzero.adamw(lr=LR, weight_decay=DECAY)


def _torch_adamw(m: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=LR, weight_decay=DECAY)


def _assert_equal_to(ref: torch.nn.Module, state, comm, tol: float) -> None:
    full = fzero.full_params(state.shard, comm)
    assert set(full) == {n for n, _ in ref.named_parameters()}
    for name, p in ref.named_parameters():
        for r in range(comm.local_ranks):
            err = max_rel_err(full[name][r].double(), p.detach().double())
            assert err <= tol, f"{name} (requires_grad={p.requires_grad}) rank {r}: relative error {err:.3g}"


def _lora_run(kind, stage, world, *, compile=False, donate=False):
    model = um.lora(kind).double()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    data = um.token_batches(STEPS, world * 2)
    ref, _, ref_losses = um.oracle_run(model, _torch_adamw, data, world, um.oracle_loss("lm"))
    comm = fzero.SimulatedWorld(world)
    state = fzero.init_train_state(model, _fzero_adamw(), comm, stage=stage)
    step = fzero.make_train_step(fzero.module_loss(model, um.lm_criterion), comm, compile=compile, donate=donate)
    state, losses = run_steps(step, state, comm, data)
    return ref, ref_losses, state, comm, losses, frozen


# every (stage, W) pair once per model; W = 4 at every stage with one of the two
LORA_CASES = [(kind, stage, world) for kind in ("llama", "gpt2") for stage in (1, 2, 3) for world in (1, 2, 3, 4)
              if (stage + world + (kind == "gpt2")) % 2 == 0 or world == 4]


@pytest.mark.parametrize("kind,stage,world", LORA_CASES)
def test_lora_equals_torch_float64(kind, stage, world):
    ref, ref_losses, state, comm, losses, frozen = _lora_run(kind, stage, world)
    _assert_equal_to(ref, state, comm, 1e-10)
    # the base model did not move, in the oracle (torch.optim skips it) nor in fzero
    full = fzero.full_params(state.shard, comm)
    assert frozen and all(torch.equal(full[n][r], v) for n, v in frozen.items() for r in range(comm.local_ranks))
    assert losses == pytest.approx(ref_losses, rel=1e-6)  # the loss metric is fp32


@pytest.mark.parametrize("stage", [2, 3])
def test_lora_compiled_equals_torch_float64(stage):
    """One graph, no recompiles, the oracle's numbers (donating, as a user training at scale would)."""
    from torch._dynamo.utils import counters

    counters.clear()
    ref, _, state, comm, _, _ = _lora_run("llama", stage, 2, compile=CHEAP_COMPILE, donate=True)
    _assert_equal_to(ref, state, comm, 1e-10)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["recompiles"], dict(counters["stats"])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_new_head_only_equals_torch_float64(stage):
    """GPT-2 for classification, the model's own loss from ``labels``, the transformer frozen by the user."""
    model = um.new_head().double()
    assert [n for n, p in model.named_parameters() if p.requires_grad] == ["score.weight"]
    world = 2
    data = um.classify_batches(STEPS, world * 2)
    ref, _, _ = um.oracle_run(model, _torch_adamw, data, world, lambda m, b: m(**b).loss)
    comm = fzero.SimulatedWorld(world)
    state = fzero.init_train_state(model, _fzero_adamw(), comm, stage=stage)
    state, _ = run_steps(fzero.make_train_step(fzero.module_loss(model), comm), state, comm, data)
    _assert_equal_to(ref, state, comm, 1e-10)
    assert state.layout.num_params == model.score.weight.numel()


def _unfreeze_top(model: torch.nn.Module, kind: str) -> list[str]:
    """The last block's MLP input weight made trainable, as a user unfreezing the top of the model would."""
    block = model.base_model.model.model.layers[-1].mlp.up_proj if kind == "llama" else \
        model.base_model.model.transformer.h[-1].mlp.c_fc
    weight = block.base_layer.weight
    weight.requires_grad_(True)
    return [n for n, p in model.named_parameters() if p is weight]


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("donate", [False, True])
def test_unfreezing_mid_run_is_a_named_error_and_keeps_the_state(compile, donate):
    model = um.lora("llama").double()
    comm = fzero.SimulatedWorld(2)
    data = um.token_batches(2, 4)
    state = fzero.init_train_state(model, _fzero_adamw(), comm, stage=2)
    step = fzero.make_train_step(fzero.module_loss(model, um.lm_criterion), comm, donate=donate,
                                 compile=CHEAP_COMPILE if compile else False)
    state, _ = step(state, comm.split_batch(data[0]))
    kept = [m.clone() for m in state.shard.master]
    name, = _unfreeze_top(model, "llama")
    with pytest.raises(ValueError, match=rf"'{name}' \(now requires grad\).*write_back.*init_train_state"):
        step(state, comm.split_batch(data[1]))
    # nothing was consumed or changed: the state still steps once the flag is put back
    assert all(torch.equal(a, b) for a, b in zip(kept, state.shard.master))
    model.get_parameter(name).requires_grad_(False)
    state, _ = step(state, comm.split_batch(data[1]))


def test_freezing_mid_run_is_a_named_error():
    model = um.lora("gpt2").double()
    comm = fzero.SimulatedWorld(2)
    state = fzero.init_train_state(model, _fzero_adamw(), comm, stage=3)
    step = fzero.make_train_step(fzero.module_loss(model, um.lm_criterion), comm)
    lora = [n for n, p in model.named_parameters() if p.requires_grad]
    for n in lora[:5]:
        model.get_parameter(n).requires_grad_(False)
    with pytest.raises(ValueError, match=rf"'{lora[0]}' \(no longer requires grad\).* and 2 more"):
        step(state, comm.split_batch(um.token_batches(1, 4)[0]))


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_unfreezing_by_the_errors_recipe_equals_torch(kind, stage):
    """LoRA for 2 steps, then the top MLP weight unfrozen: ``write_back``, a new state and step (fresh AdamW
    moments), 2 more steps; torch does the same with a new ``AdamW`` over the new trainable set."""
    world = 2
    model = um.lora(kind).double()
    data = um.token_batches(4, world * 2)
    ref = copy.deepcopy(model)
    ref, _, _ = um.oracle_run(ref, _torch_adamw, data[:2], world, um.oracle_loss("lm"))
    _unfreeze_top(ref, kind)
    ref, _, _ = um.oracle_run(ref, _torch_adamw, data[2:], world, um.oracle_loss("lm"))

    comm = fzero.SimulatedWorld(world)
    loss = fzero.module_loss(model, um.lm_criterion)
    state = fzero.init_train_state(model, _fzero_adamw(), comm, stage=stage)
    state, _ = run_steps(fzero.make_train_step(loss, comm), state, comm, data[:2])
    _unfreeze_top(model, kind)
    fzero.write_back(state, comm, model)
    state = fzero.init_train_state(model, _fzero_adamw(), comm, stage=stage)
    state, _ = run_steps(fzero.make_train_step(loss, comm), state, comm, data[2:])
    _assert_equal_to(ref, state, comm, 1e-10)


def test_tied_weights_with_the_head_trained_and_the_embedding_frozen():
    """peft ``modules_to_save=["lm_head"]`` on GPT-2 (tied embeddings): the head becomes a trainable copy while the
    embedding it was tied to stays frozen; LoRA on the attention beside it."""
    from peft import LoraConfig, get_peft_model

    def build():
        return get_peft_model(um.gpt2().double(), LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True,
                                                             modules_to_save=["lm_head"]))

    model = build()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("lm_head" in n for n in trainable) and not any("wte" in n for n in trainable)
    data = um.token_batches(STEPS, 4)
    ref, _, _ = um.oracle_run(model, _torch_adamw, data, 2, um.oracle_loss("lm"))
    for stage in (1, 2, 3):
        model, comm = build(), fzero.SimulatedWorld(2)
        state = fzero.init_train_state(model, _fzero_adamw(), comm, stage=stage)
        state, _ = run_steps(fzero.make_train_step(fzero.module_loss(model, um.lm_criterion), comm), state, comm, data)
        _assert_equal_to(ref, state, comm, 1e-10)


def _frozen_bytes(state) -> float:
    """Frozen bytes per rank: the whole parameters (stages 1-2), or one row of each frozen group (stage 3)."""
    rows = state.shard.frozen[0].shape[0] if state.layout.frozen_groups else 1
    return sum(f.numel() * f.element_size() for f in state.shard.frozen) / rows


@pytest.mark.parametrize("stage,compile", [(1, False), (2, False), (3, False), (2, True), (3, True)])
def test_frozen_dtype_holds_the_base_once_in_the_compute_dtype(stage, compile):
    """``MixedPrecision(param_dtype=bf16, frozen_dtype=bf16)``: the frozen base held once, in bf16 (half the bytes,
    the module's frozen parameters the state's copy), and the same bits as casting it in every step."""
    from torch._dynamo.utils import counters

    counters.clear()
    runs = {}
    for frozen_dtype in (None, torch.bfloat16):
        model, comm = um.lora("llama"), fzero.SimulatedWorld(2)
        precision = fzero.MixedPrecision(param_dtype=torch.bfloat16, frozen_dtype=frozen_dtype)
        state = fzero.init_train_state(model, _fzero_adamw(), comm, stage=stage, precision=precision)
        report = fzero.memory_report(state.layout, state.opt.optimizer, stage=stage, precision=precision, comm=comm)
        assert report.held["frozen"] == report.by_kind["frozen"] == _frozen_bytes(state)
        held = {n: p for n, p in model.named_parameters() if not p.requires_grad}
        assert all(f.dtype == (frozen_dtype or torch.float32) for f in state.shard.frozen)
        if stage == 3:  # sharded: the state's rows are the only copy, the module's on meta
            assert all(p.is_meta for p in held.values())
        else:
            frozen = dict(zip([s.path for s in state.layout.frozen_slots], state.shard.frozen))
            assert held.keys() == frozen.keys()
            for n, p in held.items():
                assert p.data_ptr() == frozen[n].data_ptr(), f"{n}: the module and the state hold one copy"
        step = fzero.make_train_step(fzero.module_loss(model, um.lm_criterion), comm,
                                     compile=CHEAP_COMPILE if compile else False)
        state, losses = run_steps(step, state, comm, um.token_batches(STEPS, 4))
        runs[frozen_dtype] = (state, losses)
    if compile:  # one graph per step function, none recompiled
        assert counters["stats"]["unique_graphs"] == 2 and not counters["recompiles"], dict(counters["stats"])
    (plain, plain_losses), (held_once, losses) = runs[None], runs[torch.bfloat16]
    assert 2 * _frozen_bytes(held_once) == _frozen_bytes(plain)
    assert losses == plain_losses
    assert all(torch.equal(a, b) for a, b in zip(held_once.shard.master, plain.shard.master))


def test_frozen_dtype_equals_torch_on_the_rounded_base():
    """float64 compute, the frozen base held in float32: torch training the model whose frozen weights were rounded
    to float32 (``frozen_dtype`` rounds once, then computes in float64)."""
    model = um.lora("gpt2").double()
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for p in rounded.parameters():
            if not p.requires_grad:
                p.copy_(p.float().double())
    data = um.token_batches(STEPS, 4)
    ref, _, _ = um.oracle_run(rounded, _torch_adamw, data, 2, um.oracle_loss("lm"))
    comm = fzero.SimulatedWorld(2)
    state = fzero.init_train_state(model, _fzero_adamw(), comm, stage=3,
                                   precision=fzero.MixedPrecision(frozen_dtype=torch.float32))
    assert {f.dtype for f in state.shard.frozen} == {torch.float32}
    state, _ = run_steps(fzero.make_train_step(fzero.module_loss(model, um.lm_criterion), comm), state, comm, data)
    _assert_equal_to(ref, state, comm, 1e-10)


def test_frozen_dtype_resumes_from_a_checkpoint_bitwise(tmp_path):
    precision = fzero.MixedPrecision(param_dtype=torch.bfloat16, frozen_dtype=torch.bfloat16)
    data = um.token_batches(4, 4)
    comm = fzero.SimulatedWorld(2)

    def fresh():
        model = um.lora("llama")
        state = fzero.init_train_state(model, _fzero_adamw(), comm, stage=3, precision=precision)
        return state, fzero.make_train_step(fzero.module_loss(model, um.lm_criterion), comm)

    state, step = fresh()
    state, _ = run_steps(step, state, comm, data[:2])
    fzero.save_checkpoint(state, tmp_path, comm)
    whole, _ = run_steps(step, state, comm, data[2:])
    template, step = fresh()
    resumed, _ = fzero.load_checkpoint(tmp_path, template, comm)
    assert [f.dtype for f in resumed.shard.frozen] == [torch.bfloat16] * len(resumed.shard.frozen)
    resumed, _ = run_steps(step, resumed, comm, data[2:])
    assert all(torch.equal(a, b) for a, b in zip(whole.shard.master, resumed.shard.master))
    assert all(torch.equal(a, b) for a, b in zip(whole.shard.frozen, resumed.shard.frozen))


def test_frozen_dtype_must_be_floating():
    with pytest.raises(TypeError, match=r"frozen_dtype"):
        fzero.MixedPrecision(frozen_dtype=torch.int8)


@pytest.mark.parametrize("stage", [2, 3])
def test_exported_model_and_adapters_load_in_peft(stage):
    """``export_model_state_dict`` gives the whole peft model (``load_state_dict(strict=True)``), and the adapters
    alone, as peft saves them (``get_peft_model_state_dict``), load into a fresh peft model
    (``set_peft_model_state_dict``) with the trained values."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    model = um.lora("llama").double()
    data = um.token_batches(STEPS, 4)
    ref, _, _ = um.oracle_run(model, _torch_adamw, data, 2, um.oracle_loss("lm"))
    comm = fzero.SimulatedWorld(2)
    state = fzero.init_train_state(model, _fzero_adamw(), comm, stage=stage)
    state, _ = run_steps(fzero.make_train_step(fzero.module_loss(model, um.lm_criterion), comm), state, comm, data)
    exported = fzero.checkpoint.export_model_state_dict(state, comm)
    whole = um.lora("llama").double()
    whole.load_state_dict(exported, strict=True)
    adapters = get_peft_model_state_dict(whole)
    assert adapters and all("lora_" in k for k in adapters)
    fresh = um.lora("llama").double()
    set_peft_model_state_dict(fresh, adapters)
    for name, p in ref.named_parameters():
        got = dict(fresh.named_parameters())[name]
        assert max_rel_err(got.double(), p.detach().double()) <= 1e-10, name


@pytest.mark.parametrize("stage", [2, 3])
def test_a_checkpoint_without_the_frozen_base_resumes_bitwise_from_the_pretrained_source(tmp_path, stage):
    """``save_checkpoint(frozen=False)`` writes the adapters' state and only a CRC-32 of each frozen parameter;
    a template built again from the pretrained model resumes bitwise; one built from other weights is refused,
    naming the parameter; consolidating such a checkpoint says why it cannot."""
    data = um.token_batches(4, 4)
    comm = fzero.SimulatedWorld(2)

    def fresh(seed=0):
        model = um.lora("llama", seed=seed)
        return (fzero.init_train_state(model, _fzero_adamw(), comm, stage=stage),
                fzero.make_train_step(fzero.module_loss(model, um.lm_criterion), comm))

    state, step = fresh()
    state, _ = run_steps(step, state, comm, data[:2])
    whole_dir = fzero.save_checkpoint(state, tmp_path / "whole", comm)
    lean_dir = fzero.save_checkpoint(state, tmp_path / "lean", comm, frozen=False)
    size = lambda d: sum(f.stat().st_size for f in d.iterdir())  # noqa: E731
    base = sum(s.numel for s in state.layout.frozen_slots) * 4
    assert size(whole_dir) - size(lean_dir) >= 0.9 * base  # the base's bytes are not written
    whole, _ = run_steps(step, state, comm, data[2:])

    template, step = fresh()
    resumed, _ = fzero.load_checkpoint(tmp_path / "lean", template, comm)
    resumed, _ = run_steps(step, resumed, comm, data[2:])
    assert all(torch.equal(a, b) for a, b in zip(whole.shard.master, resumed.shard.master))
    assert all(torch.equal(a, b) for a, b in zip(whole.shard.frozen, resumed.shard.frozen))

    other, _ = fresh(seed=1)  # another base: its frozen values differ
    with pytest.raises(fzero.checkpoint.CheckpointMismatchError, match=r"frozen parameter '.*', left out of the "
                                                                         r"checkpoint.*template's"):
        fzero.load_checkpoint(tmp_path / "lean", other, comm)
    with pytest.raises(fzero.checkpoint.CheckpointError, match=r"left its frozen parameters out"):
        fzero.checkpoint.consolidate_model_state_dict(tmp_path / "lean")


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_stage3_shards_the_frozen_base(world):
    """Stage 3 holds 1/W of the frozen base per rank (+ padding), measured on the state's tensors, in one ``[R,
    shard]`` tensor per frozen group (per unit and dtype); the module keeps none (meta). At W = 2 that is half of
    what stage 2 holds whole, a quarter with ``frozen_dtype=bfloat16``; ``memory_report`` says the same."""
    comm = fzero.SimulatedWorld(world)
    per_rank = {}
    for stage, frozen_dtype in ((2, None), (3, None), (3, torch.bfloat16)):
        model = um.lora("llama")
        precision = fzero.MixedPrecision(param_dtype=frozen_dtype, frozen_dtype=frozen_dtype)
        state = fzero.init_train_state(model, _fzero_adamw(), comm, stage=stage, precision=precision)
        per_rank[stage, frozen_dtype] = _frozen_bytes(state)
        report = fzero.memory_report(state.layout, state.opt.optimizer, stage=stage, precision=precision)
        assert report.held["frozen"] == per_rank[stage, frozen_dtype]
        if stage == 3:
            lay = state.layout
            assert [tuple(f.shape) for f in state.shard.frozen] == [(world, g.shard_numel) for g in lay.frozen_groups]
            assert {g.bucket for g in lay.frozen_groups} == set(range(len(state.module.units) + 1))
            assert all(p.is_meta for p in model.parameters())
    base = sum(s.numel for s in lay.frozen_slots)
    padding = sum(g.padding for g in lay.frozen_groups)
    assert 0 <= padding < len(lay.frozen_groups) * world * lay.alignment
    assert per_rank[2, None] == base * 4
    assert per_rank[3, None] * world == (base + padding) * 4
    assert per_rank[3, torch.bfloat16] * 2 == per_rank[3, None]  # so at W=2: half of stage 2's, a quarter in bf16


def test_stage3_frozen_base_checkpoint_moves_between_stages_and_worlds(tmp_path):
    """A stage-3 checkpoint (each rank writes the pieces of the frozen base it holds) loads at stage 2 and at stage 3
    on other worlds, and back, with the same model; a stage-2 one loads at stage 3."""
    data = um.token_batches(2, 4)

    def fresh(stage, world):
        comm = fzero.SimulatedWorld(world)
        return fzero.init_train_state(um.lora("llama").double(), _fzero_adamw(), comm, stage=stage), comm

    comm = fzero.SimulatedWorld(2)
    model = um.lora("llama").double()
    step = fzero.make_train_step(fzero.module_loss(model, um.lm_criterion), comm)
    state = fzero.init_train_state(model, _fzero_adamw(), comm, stage=3)
    state, _ = run_steps(step, state, comm, data)
    want = fzero.checkpoint.export_model_state_dict(state, comm)
    fzero.save_checkpoint(state, tmp_path / "s3", comm)
    for stage, world in ((2, 1), (2, 3), (3, 3), (3, 4), (1, 2)):
        template, comm = fresh(stage, world)
        loaded, _ = fzero.load_checkpoint(tmp_path / "s3", template, comm)
        got = fzero.checkpoint.export_model_state_dict(loaded, comm)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), (stage, world)
        if (stage, world) == (2, 3):
            fzero.save_checkpoint(loaded, tmp_path / "s2", comm)
    template, comm = fresh(3, 2)
    loaded, _ = fzero.load_checkpoint(tmp_path / "s2", template, comm)
    got = fzero.checkpoint.export_model_state_dict(loaded, comm)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_stage3_lora_from_pretrained_streams_into_shards(tmp_path):
    """A meta-device peft LoRA model filled from a safetensors file at stage 3: the frozen base and the adapters go
    straight into this process's shards (census peak within what the state holds + one tensor + the mapped file),
    and the state equals one built from the eager model."""
    from safetensors.torch import save_file

    from fzero.testing import Census

    eager = um.lora("llama")
    path = tmp_path / "model.safetensors"
    save_file({k: v.detach().contiguous() for k, v in eager.state_dict().items()}, str(path))
    tensor = max(t.numel() * t.element_size() for t in eager.state_dict().values())
    comm = fzero.SimulatedWorld(2)
    ref = fzero.init_train_state(eager, _fzero_adamw(), comm, stage=3, seed=None)
    with torch.device("meta"):
        meta = um.lora("llama")
    with Census() as census:
        state = fzero.init_train_state(meta, _fzero_adamw(), comm, stage=3, init=fzero.pretrained(path), seed=None)
    print(f"peak {census.peak_bytes} B, end {census.end_bytes} B, tensor {tensor} B, file {path.stat().st_size} B")
    assert census.peak_bytes <= census.end_bytes + tensor + path.stat().st_size
    assert [tuple(f.shape) for f in state.shard.frozen] == [(2, g.shard_numel) for g in state.layout.frozen_groups]
    assert all(torch.equal(a, b) for a, b in zip(state.shard.frozen, ref.shard.frozen))
    assert all(torch.equal(a, b) for a, b in zip(state.shard.master, ref.shard.master))


@pytest.mark.parametrize("stage", [2, 3])
def test_a_checkpoint_holding_frozen_parameters_in_their_shapes_still_loads(tmp_path, monkeypatch, stage):
    """Checkpoints written before manifest version 3 keep each frozen parameter whole, in its shape: they load at
    stages 2 and 3 on another world (read whole, then cut as the template holds them) with the values saved."""
    from torch.distributed.checkpoint import FileSystemReader

    import fzero.checkpoint.saveload as sl

    comm = fzero.SimulatedWorld(2)
    model = um.lora("llama").double()
    state = fzero.init_train_state(model, _fzero_adamw(), comm, stage=2)
    step = fzero.make_train_step(fzero.module_loss(model, um.lm_criterion), comm)
    state, _ = run_steps(step, state, comm, um.token_batches(2, 4))
    want = fzero.checkpoint.export_model_state_dict(state, comm)
    with monkeypatch.context() as m:  # the earlier writer: each frozen parameter whole, as shaped
        m.setattr(sl, "_frozen", lambda lay, rows, comm: {sl.FROZEN_PREFIX + s.path: f
                                                          for s, f in zip(lay.frozen_slots, rows)})
        saved = fzero.save_checkpoint(state, tmp_path, comm)
    sizes = {k[len(sl.FROZEN_PREFIX):]: tuple(md.size) for k, md in
             FileSystemReader(str(saved)).read_metadata().state_dict_metadata.items() if k.startswith(sl.FROZEN_PREFIX)}
    assert any(len(v) > 1 for v in sizes.values()) and all(sizes[p] == tuple(want[p].shape) for p in sizes)
    other = fzero.SimulatedWorld(3)
    template = fzero.init_train_state(um.lora("llama", seed=1).double(), _fzero_adamw(), other, stage=stage)
    loaded, _ = fzero.load_checkpoint(tmp_path, template, other)
    got = fzero.checkpoint.export_model_state_dict(loaded, other)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
