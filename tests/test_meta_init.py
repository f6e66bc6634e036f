"""Models larger than one rank: ``init_train_state`` on a model built on the meta device,
materialised piece by piece (``fzero.materialize``), or filled from weight files
(``fzero.pretrained``).

* stage 3 from a meta model equals the eager model initialised the same way, bit for bit,
  before and after a few steps (a plain torch chain with BatchNorm, HF GPT-2 with tied
  embeddings, HF Llama with its rotary ``inv_freq``); stages 1-2 too;
* checkpoints written by ``save_pretrained`` (one file and sharded) and by
  ``torch.save(model.state_dict())`` load into shards at W = 1, 2, 3 equal to loading them
  into the full model;
* an allocator census: the live bytes never exceed the shards + one piece + one tensor;
* errors: a meta model without an init, a file that does not fit (the key and file named),
  a hostile pickle refused without running it, inits that leave tensors unwritten;
* gloo W=2: stage 3 from a meta model (random init and pretrained) equals the simulated world.
"""

from __future__ import annotations

import os
import pickle
import types
from pathlib import Path

import pytest
import torch

import fzero
import meta_cases as mc
from dist_harness import run_torchrun
from fzero.materialize import piece_of
from fzero.testing import Census

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

KINDS = ["chain", "gpt2", "llama"]


def assert_same(a: fzero.TrainState, b: fzero.TrainState) -> None:
    assert len(a.shard.master) == len(b.shard.master)
    for g, (x, y) in enumerate(zip(a.shard.master, b.shard.master)):
        assert torch.equal(x, y), f"flat group {g} differs"
    for n, x, y in zip(a.module.buffers, a.buffers, b.buffers):
        assert torch.equal(x, y), f"buffer {n} differs"
    for x, y in zip(a.shard.frozen, b.shard.frozen):
        assert torch.equal(x, y)


# ----------------------------------------------------------------------------- same numbers


@pytest.mark.parametrize("kind", KINDS)
def test_stage3_from_meta_equals_eager_bitwise(kind):
    comm = fzero.SimulatedWorld(2)
    meta = mc.meta_model(kind)
    eager = mc.eager_model(kind)
    sm, _ = mc.train(kind, meta, comm, init=mc.init_of(kind, meta), steps=0)
    se, _ = mc.train(kind, eager, comm, steps=0)
    assert_same(sm, se)
    step_m = fzero.make_train_step(mc.loss_of(kind, meta), comm)
    step_e = fzero.make_train_step(mc.loss_of(kind, eager), comm)
    for batch in mc.data(kind, 2)[:2]:
        sm, m1 = step_m(sm, comm.split_batch(batch))
        se, m2 = step_e(se, comm.split_batch(batch))
        assert torch.equal(m1["loss"], m2["loss"])
    assert_same(sm, se)
    # the module stays on the meta device: the state owns the weights
    assert all(t.is_meta for t in (*meta.parameters(), *meta.buffers()))


@pytest.mark.parametrize("kind", ["chain", "gpt2"])
def test_init_draws_what_the_eager_init_draws(kind):
    """The global generator advances as ``model.apply(init)`` (or construction) advances it."""
    meta = mc.meta_model(kind)
    torch.manual_seed(mc.INIT_SEED)
    fzero.init_train_state(meta, fzero.adamw(lr=1e-2), fzero.SimulatedWorld(2), stage=3,
                           units=mc.units_of(kind), init=mc.init_of(kind, meta))
    after_meta = torch.get_rng_state()
    if kind == "chain":
        torch.manual_seed(mc.INIT_SEED)
        mc.chain()
    else:
        eager = mc.build(kind, seed=1)
        torch.manual_seed(mc.INIT_SEED)
        eager.apply(eager._init_weights)
    assert torch.equal(after_meta, torch.get_rng_state())


@pytest.mark.parametrize("stage", [1, 2])
def test_stages_1_2_from_meta_with_an_init(stage):
    comm = fzero.SimulatedWorld(2)
    meta = mc.meta_model("gpt2")
    sm, lm = mc.train("gpt2", meta, comm, init=meta._init_weights, stage=stage, steps=1)
    se, le = mc.train("gpt2", mc.eager_model("gpt2"), comm, stage=stage, steps=1)
    assert lm == le
    assert_same(sm, se)
    for x, y in zip(sm.params, se.params):
        assert torch.equal(x, y)


def test_write_back_into_a_meta_module():
    """write_back gives the meta module CPU tensors (tied names still tied) holding the
    trained weights; the same as write_back into the eager model."""
    comm = fzero.SimulatedWorld(2)
    meta, eager = mc.meta_model("gpt2"), mc.eager_model("gpt2")
    sm, _ = mc.train("gpt2", meta, comm, init=meta._init_weights, steps=1)
    se, _ = mc.train("gpt2", eager, comm, steps=1)
    fzero.write_back(sm, comm, meta)
    fzero.write_back(se, comm, eager)
    assert meta.lm_head.weight is meta.transformer.wte.weight
    got, want = meta.state_dict(), eager.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


# ----------------------------------------------------------------------------- pretrained


@pytest.mark.parametrize("kind,how", [
    ("gpt2", "safetensors"), ("gpt2", "torch"), ("llama", "sharded"), ("llama", "torch"), ("chain", "safetensors"),
])
def test_pretrained_loads_into_shards_equal_to_the_full_model(kind, how, tmp_path):
    path = mc.saved_checkpoint(kind, how, str(tmp_path))
    if how == "sharded":
        assert (tmp_path / "model.safetensors.index.json").is_file()
        assert len(list(tmp_path.glob("*.safetensors"))) > 1
    for world in (1, 2, 3):  # the shards at every W; training (one step, W=2) follows from them
        comm = fzero.SimulatedWorld(world)
        steps = 1 if world == 2 else 0
        meta = mc.meta_model(kind)
        sm, lm = mc.train(kind, meta, comm, init=fzero.pretrained(path), steps=steps)
        se, le = mc.train(kind, mc.loaded_full_model(kind, path), comm, steps=steps)
        assert lm == le, world
        assert_same(sm, se)


def test_llama_rotary_buffers_come_from_the_model_init(tmp_path):
    """inv_freq is not in the file (non-persistent) and garbage on meta: the model's own
    _init_weights computes it, as transformers does after loading."""
    path = mc.saved_checkpoint("llama", "safetensors", str(tmp_path))
    meta = mc.meta_model("llama")
    state = fzero.init_train_state(meta, fzero.adamw(lr=1e-2), fzero.SimulatedWorld(2), stage=3,
                                   units=mc.units_of("llama"), init=fzero.pretrained(path))
    want = dict(mc.build("llama").named_buffers())
    for n, b in zip(state.module.buffers, state.buffers):
        assert torch.equal(b[0], want[n]) and torch.equal(b[1], want[n]), n
    with pytest.raises(ValueError, match="inv_freq"):
        fzero.init_train_state(meta, fzero.adamw(lr=1e-2), fzero.SimulatedWorld(2), stage=3,
                               units=mc.units_of("llama"), init=fzero.pretrained(path, init="reset_parameters"))


# ----------------------------------------------------------------------------- memory


def _pieces(model: torch.nn.Module, units) -> tuple[int, int]:
    """(bytes of the largest piece, bytes of the largest tensor) of an eager model."""
    from fzero.units import select_units

    names = select_units(model, units)
    per: dict[str, int] = {}
    seen: set[int] = set()
    largest = 0
    for prefix, m in model.named_modules():
        for t in [*m._parameters.values(), *m._buffers.values()]:
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            nbytes = t.numel() * t.element_size()
            largest = max(largest, nbytes)
            top = piece_of(prefix, names)
            per[top] = per.get(top, 0) + nbytes
    return max(per.values()), largest


def _census_of(fn):
    with Census() as census:
        out = fn()
    return census, out


def _file_bytes(path: str) -> int:
    p = Path(path)
    files = [f for f in p.iterdir() if f.suffix in (".safetensors", ".bin", ".pt")] if p.is_dir() else [p]
    return sum(f.stat().st_size for f in files)


@pytest.mark.parametrize("kind,source", [("chain", "init"), ("gpt2", "init"), ("llama", "init"),
                                         ("gpt2", "safetensors"), ("llama", "sharded"), ("llama", "torch")])
def test_live_bytes_stay_within_shards_one_piece_one_tensor(kind, source, tmp_path):
    """Allocator census (fzero.testing.Census) of the materialisation, and of the whole
    init_train_state: peak <= what they return (shards, buffers; and moments) + one piece +
    one tensor (from files: no piece is built, each rank's slices go to its shards).

    Weight files are memory-mapped (safe_open, torch.load(mmap=True)); the census sees each
    mapping as one allocation of the file's size, though the kernel reads only the pages a
    rank touches (its slices), so the files' sizes are added to the bound. The chain is
    deep enough that a whole model would not fit in the bound."""
    from fzero.materialize import materialized_shard
    from fzero.units import select_units, unit_buckets

    comm = fzero.SimulatedWorld(2)
    builder = (lambda: mc.chain(d=64, depth=6)) if kind == "chain" else (lambda: mc.build(kind))
    eager = builder()
    piece, tensor = _pieces(eager, mc.units_of(kind))
    model_bytes = sum(t.numel() * t.element_size() for t in (*eager.parameters(), *eager.buffers()))
    with torch.device("meta"):
        meta = builder()
    if source == "init":
        init, bound = mc.init_of(kind, meta), piece + tensor
    else:
        path = mc.saved_checkpoint(kind, source, str(tmp_path))
        init, bound = fzero.pretrained(path), tensor + _file_bytes(path)
    names = select_units(meta, mc.units_of(kind))
    torch.manual_seed(0)
    walk, (shard, buffers) = _census_of(lambda: materialized_shard(
        meta, comm, init, names, optimizer=fzero.adamw(lr=1e-2), bucket_of=unit_buckets(meta, names).__getitem__))
    held = sum(t.numel() * t.element_size() for t in (*shard.master, *shard.frozen, *buffers))
    assert walk.end_bytes == held
    print(f"{kind}/{source}: peak {walk.peak_bytes} B = shards {held} B + {walk.peak_bytes - held} B; "
          f"bound: one piece {piece} B, one tensor {tensor} B, mapped files {bound - piece - tensor if source == 'init' else bound - tensor} B; "
          f"model {model_bytes} B")
    assert walk.peak_bytes <= walk.end_bytes + bound
    # the whole init_train_state (seed=None: the generator states' stacking is no part of this)
    torch.manual_seed(0)
    whole, state = _census_of(lambda: fzero.init_train_state(
        meta, fzero.adamw(lr=1e-2), comm, stage=3, units=mc.units_of(kind), init=init, seed=None))
    assert whole.peak_bytes <= whole.end_bytes + bound
    if kind == "chain":
        assert walk.peak_bytes > walk.end_bytes  # pieces were built, and the census saw them
        assert piece + tensor < model_bytes / 3  # the bound is far below a whole model


def test_a_rank_reads_only_the_slices_it_owns(tmp_path, monkeypatch):
    """Rank 1 of 2 alone (one local rank, as on a real process group) reads, per parameter, the
    rows holding its flat range: about half the file's parameter elements."""
    import fzero.weights as fp
    from fzero.sharding import shard_layout

    path = mc.saved_checkpoint("chain", "safetensors", str(tmp_path))
    read = []
    plain = fp._Files.read_flat
    monkeypatch.setattr(fp._Files, "read_flat", lambda self, k, a, b: read.append(plain(self, k, a, b)) or read[-1])

    comm = types.SimpleNamespace(world_size=2, local_ranks=1, ranks=(1,))  # all materialize reads
    meta = mc.meta_model("chain")
    layout = shard_layout(meta, fzero.SimulatedWorld(2), optimizer=fzero.adamw(lr=1e-2))
    made = fzero.pretrained(path).materialize(meta, layout, comm)
    total = sum(s.numel for s in layout.slots)
    got = sum(t.numel() for t in read)
    assert made.master[0].shape == (1, layout.groups[0].shard_numel)
    assert got < 0.6 * total, (got, total)
    ref = fzero.init_train_state(mc.build("chain", seed=3), fzero.adamw(lr=1e-2), fzero.SimulatedWorld(2))
    assert torch.equal(made.master[0][0], ref.shard.master[0][1])


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_meta_model_without_init_is_a_clear_error(stage):
    meta = mc.meta_model("chain")
    with pytest.raises(ValueError, match=r"meta device.*init='reset_parameters'.*fzero\.pretrained"):
        fzero.init_train_state(meta, fzero.adamw(lr=1e-2), fzero.SimulatedWorld(2), stage=stage,
                               units=mc.chain_units if stage == 3 else None)


def _load_chain(path, **kw):
    return fzero.init_train_state(mc.meta_model("chain"), fzero.adamw(lr=1e-2), fzero.SimulatedWorld(2),
                                  stage=3, units=mc.chain_units, init=fzero.pretrained(path, **kw))


def _saved(tmp_path: Path, edit, fmt="torch") -> str:
    sd = mc.build("chain", seed=3).state_dict()
    edit(sd)
    if fmt == "torch":
        path = str(tmp_path / "model.pt")
        torch.save(sd, path)
    else:
        from safetensors.torch import save_file

        path = str(tmp_path / "model.safetensors")
        save_file(sd, path)
    return path


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_file_errors_name_the_key_and_the_file(tmp_path, fmt):
    def shape(sd):
        sd["1.inp.weight"] = torch.zeros(3, 3)

    def missing(sd):
        del sd["2.bn.running_var"]

    def unexpected(sd):
        sd["2.extra"] = torch.zeros(2)

    def dtype(sd):
        sd["3.out.bias"] = sd["3.out.bias"].double()

    for edit, key, words in [(shape, "1.inp.weight", "shape"), (missing, "2.bn.running_var", "no tensor"),
                             (unexpected, "2.extra", "not in the model"), (dtype, "3.out.bias", "float64")]:
        folder = tmp_path / edit.__name__
        folder.mkdir()
        path = _saved(folder, edit, fmt)
        with pytest.raises(fzero.weights.WeightsFileError) as err:
            _load_chain(path)
        msg = str(err.value)
        assert key in msg and path in msg and words in msg, msg
    # cast=True converts the float64 tensor, as load_state_dict would
    state = _load_chain(_saved(tmp_path, dtype, fmt), cast=True)
    ref = mc.build("chain", seed=3)
    assert_same(state, fzero.init_train_state(ref, fzero.adamw(lr=1e-2), fzero.SimulatedWorld(2), stage=3,
                                              units=mc.chain_units))


class _Payload:
    """Pickles as a call that creates a file: what a hostile checkpoint would run."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_hostile_pickle_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "pwned"
    sd = dict(mc.build("chain", seed=3).state_dict())
    sd["0.weight"] = _Payload(str(marker))
    path = str(tmp_path / "model.pt")
    torch.save(sd, path)
    with pytest.raises(fzero.weights.WeightsFileError, match=r"weights_only=True") as err:
        _load_chain(path)
    assert path in str(err.value)
    assert not marker.exists()
    # a plain pickle, not a torch.save zip, is refused too
    with open(tmp_path / "plain.pt", "wb") as f:
        pickle.dump({"0.weight": _Payload(str(marker))}, f)
    with pytest.raises(fzero.weights.WeightsFileError):
        _load_chain(str(tmp_path / "plain.pt"))
    assert not marker.exists()


def test_files_that_are_not_what_they_claim(tmp_path):
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    with pytest.raises(fzero.weights.WeightsFileError, match="not a readable safetensors file") as err:
        _load_chain(str(tmp_path))
    assert str(bad) in str(err.value)
    (tmp_path / "good").mkdir()
    good = mc.saved_checkpoint("chain", "safetensors", str(tmp_path / "good"))
    (tmp_path / "trunc").mkdir()
    data = Path(good).read_bytes()
    (tmp_path / "trunc" / "model.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(fzero.weights.WeightsFileError, match="trunc"):
        _load_chain(str(tmp_path / "trunc"))
    # an index naming a shard outside its folder, or a shard without the key it lists
    idx = tmp_path / "idx"
    idx.mkdir()
    (idx / "model.safetensors.index.json").write_text('{"weight_map": {"0.weight": "../good/model.safetensors"}}')
    with pytest.raises(fzero.weights.WeightsFileError, match="outside its directory"):
        _load_chain(str(idx))
    os.replace(good, idx / "shard.safetensors")
    (idx / "model.safetensors.index.json").write_text('{"weight_map": {"9.weight": "shard.safetensors"}}')
    with pytest.raises(fzero.weights.WeightsFileError, match=r"no tensor '9.weight'.*says it holds"):
        _load_chain(str(idx))
    (tmp_path / "empty").mkdir()
    with pytest.raises(fzero.weights.WeightsFileError, match="without model.safetensors.index.json"):
        _load_chain(str(tmp_path / "empty"))
    with pytest.raises(fzero.weights.WeightsFileError, match="no such file"):
        _load_chain(str(tmp_path / "nowhere.pt"))


class Scaled(torch.nn.Module):
    """A parameter of its own and no reset_parameters."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.gain = torch.nn.Parameter(torch.ones(3))

    def forward(self, x):
        return self.lin(x) * self.gain


def test_init_that_leaves_a_meta_tensor_unwritten_names_it():
    with torch.device("meta"):
        model = torch.nn.Sequential(Scaled(), Scaled())
    with pytest.raises(ValueError, match=r"did not write parameter '0.gain' \(of module '0', a Scaled\)"):
        fzero.init_train_state(model, fzero.adamw(lr=1e-2), fzero.SimulatedWorld(2), stage=3,
                               units=(Scaled,), init="reset_parameters")
    assert all(p.is_meta for p in model.parameters())  # left as it was

    def late(m):  # the root's init reaching into a finished unit
        if isinstance(m, Scaled):
            torch.nn.init.ones_(m.gain)
        if isinstance(m, torch.nn.Sequential):
            torch.nn.init.zeros_(m[0].lin.bias)

    def init(m):
        if isinstance(m, torch.nn.Linear):
            m.reset_parameters()
        late(m)

    with pytest.raises(ValueError, match=r"module '<root>' wrote '0.lin.bias' after fzero had cut it"):
        fzero.init_train_state(model, fzero.adamw(lr=1e-2), fzero.SimulatedWorld(2), stage=3,
                               units=(Scaled,), init=init)


# ----------------------------------------------------------------------------- gloo

GLOO_CASES = ["meta_chain", "meta_gpt2", "pretrained_llama", "different_seeds", "one_rank_fails"]


@pytest.mark.distributed
def test_gloo_meta_stage3_equals_the_simulated_world(tmp_path):
    ranks = run_torchrun(2, "meta_init_worker.py", GLOO_CASES, timeout=240)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers' count (dist_harness.worker_main)
    try:
        sims = {
            "meta_chain": mc.meta_run("chain", fzero.SimulatedWorld(2)),
            "meta_gpt2": mc.meta_run("gpt2", fzero.SimulatedWorld(2)),
            "pretrained_llama": mc.pretrained_run(
                "llama", fzero.SimulatedWorld(2), mc.saved_checkpoint("llama", "safetensors", str(tmp_path))),
        }
    finally:
        torch.set_num_threads(threads)
    for case, sim in sims.items():
        for r, res in enumerate(ranks):
            got = res[case]
            assert "exception" not in got, got.get("exception")
            assert got["losses"] == sim["losses"], (case, r)
            for g, (mine, theirs) in enumerate(zip(got["masters"], sim["masters"])):
                assert torch.equal(mine[0], theirs[r]), (case, r, g)
            for mine, theirs in zip(got["buffers"], sim["buffers"]):
                assert torch.equal(mine[0], theirs[r]), (case, r)
    for r, res in enumerate(ranks):
        assert "generators differ" in res["different_seeds"]["error"], (r, res["different_seeds"])
    assert "missing.pt: no such file" in ranks[1]["one_rank_fails"]["error"], ranks[1]["one_rank_fails"]
    assert "another rank failed" in ranks[0]["one_rank_fails"]["error"], ranks[0]["one_rank_fails"]
