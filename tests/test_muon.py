"""``fzero.muon``: torch.optim.Muon on the matrices and torch.optim.AdamW on the rest, on flat
shards, equal to the two torch.optim classes on the unsharded model (float64, 1e-10) at every
W and stage, with matrices straddling shard boundaries; each matrix orthogonalized once in
the world; its state checkpoints and reshards; clear errors. The gloo run equal to the
simulated world is in ``test_distributed.py`` (``muon``)."""

from __future__ import annotations

import collections
import copy

import pytest
import torch

import dist_cases as cases
import fzero
import fzero.checkpoint
import fzero.muon_rules as muon_rules
import unused_cases as uc
import user_models as um
from fzero.pytree import replace
from helpers import assert_params_close, batches, children, max_rel_err, mlp, reference_run, straddles, train_sharded

STEPS = 5
TOL = 1e-10
SIZES = (7, 9, 5, 3)  # odd: the matrices straddle shard boundaries at every W
MUON_KW = dict(lr=0.02, weight_decay=0.1, momentum=0.9, eps=1e-7, adjust_lr_fn="match_rms_adamw")
ADAMW_KW = dict(lr=0.01, betas=(0.8, 0.99), eps=1e-8, weight_decay=0.01)
mse = torch.nn.functional.mse_loss
# one intra-op thread: Newton-Schulz's tiny bfloat16 products are 40x slower with two
# contending threads on a shared 2-core machine
pytestmark = pytest.mark.usefixtures("one_thread")


def is_matrix_of(model: torch.nn.Module):  # noqa: ANN201
    """The MLP's matrices: every 2-D parameter (weights of the three Linear layers)."""
    return frozenset(n for n, p in model.named_parameters() if p.dim() == 2).__contains__


class MuonAdamW:
    """The oracle: torch.optim.Muon on the matrices, torch.optim.AdamW on the rest, as users run them."""

    def __init__(self, model: torch.nn.Module, matrices, nesterov: bool = True):  # noqa: ANN001
        named = list(model.named_parameters())
        self.muon = torch.optim.Muon([p for n, p in named if matrices(n)], nesterov=nesterov, **MUON_KW)
        self.adamw = torch.optim.AdamW([p for n, p in named if not matrices(n)], **ADAMW_KW)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)

    def step(self) -> None:
        self.muon.step()
        self.adamw.step()


def rule(matrices, nesterov: bool = True) -> fzero.muon_rules.Muon:  # noqa: ANN001
    return fzero.muon(matrices=matrices, nesterov=nesterov, adamw=ADAMW_KW, **MUON_KW)


def _train(model, opt, data, world, stage, criterion=mse, state=None, comm=None, donate=False):  # noqa: ANN001
    return train_sharded(model, opt, data, world, stage, criterion, state, comm, donate)


def _assert_params(state, comm, ref: torch.nn.Module, where=()) -> None:  # noqa: ANN001
    assert_params_close(state, comm, ref, TOL, where)


def _straddles(state) -> bool:  # noqa: ANN001
    """Whether some matrix of the layout lies on more than one rank's shard."""
    return straddles(state, lambda shape: len(shape) == 2)


def test_mlp_equals_torch_muon_and_adamw_at_every_world_and_stage():
    for world in (1, 2, 3, 4):
        data = batches(STEPS, world, 2, torch.float64, d_in=SIZES[0])
        model = mlp(torch.float64, sizes=SIZES)
        matrices = is_matrix_of(model)
        ref = reference_run(model, lambda m, matrices=matrices: MuonAdamW(m, matrices), data, world)
        moved = max(max_rel_err(p.detach(), q.detach()) for p, q in zip(ref.parameters(), model.parameters()))
        assert moved > 1e-3  # the oracle trained
        for stage in (1, 2, 3):
            # donating (the shards updated in place) at even W
            state, comm = _train(mlp(torch.float64, sizes=SIZES), rule(matrices), data, world, stage,
                                 donate=world % 2 == 0)
            assert world == 1 or _straddles(state)
            assert int(state.opt.step) == STEPS
            _assert_params(state, comm, ref, where=(world, stage))


def test_without_nesterov():
    world = 3
    data = batches(STEPS, world, 2, torch.float64, d_in=SIZES[0])
    model = mlp(torch.float64, sizes=SIZES)
    matrices = is_matrix_of(model)
    ref = reference_run(model, lambda m: MuonAdamW(m, matrices, nesterov=False), data, world)
    state, comm = _train(mlp(torch.float64, sizes=SIZES), rule(matrices, nesterov=False), data, world, 2)
    _assert_params(state, comm, ref)


@pytest.mark.parametrize("world,stage", [(2, 1), (3, 2), (4, 3)])
def test_llama_equals_torch_muon_and_adamw(world, stage):
    pytest.importorskip("transformers")
    data = um.token_batches(STEPS, world * 2)
    model = um.llama().double()
    matrices = fzero.muon_rules.hidden_matrices(model)
    assert any(matrices(n) for n, _ in model.named_parameters())
    assert not matrices("model.embed_tokens.weight") and not matrices("lm_head.weight")
    ref, _, _ = um.oracle_run(model, lambda m: MuonAdamW(m, matrices), data, world, um.oracle_loss("lm"))
    state, comm = _train(um.llama().double(), rule(matrices), data, world, stage, um.lm_criterion)
    _assert_params(state, comm, ref, where=(world, stage))


def test_each_matrix_is_orthogonalized_once_in_the_world(monkeypatch):
    """Counted calls of Newton-Schulz: one per matrix per step in the whole (simulated) world,
    each by its owner row, and the owners spread the work over the ranks."""
    world = 4
    model = um.llama().double() if _has_transformers() else mlp(torch.float64, sizes=SIZES)
    matrices = fzero.muon_rules.hidden_matrices(model) if _has_transformers() else is_matrix_of(model)
    n_matrices = sum(1 for n, _ in model.named_parameters() if matrices(n))
    calls: collections.Counter = collections.Counter()
    by_rank: collections.Counter = collections.Counter()
    inner_ns, inner_owned = muon_rules.newton_schulz, muon_rules.Muon._orthogonalize_owned

    def counting_ns(matrix, *args):  # noqa: ANN001, ANN202
        calls[tuple(matrix.shape)] += 1
        return inner_ns(matrix, *args)

    def counting_owned(self, layout, groups, gathered, results, owners, rank, take, where, w, hyper):  # noqa: ANN001, ANN202
        before = sum(calls.values())
        inner_owned(self, layout, groups, gathered, results, owners, rank, take, where, w, hyper)
        by_rank[rank] += sum(calls.values()) - before

    monkeypatch.setattr(muon_rules, "newton_schulz", counting_ns)
    monkeypatch.setattr(muon_rules.Muon, "_orthogonalize_owned", counting_owned)
    if _has_transformers():
        data, crit = um.token_batches(2, world * 2), um.lm_criterion
    else:
        data, crit = batches(2, world, 2, torch.float64, d_in=SIZES[0]), mse
    state, _ = _train(model, rule(matrices), data, world, 2, crit)
    assert sum(calls.values()) == 2 * n_matrices
    assert sorted(by_rank) == list(range(world))
    owners = fzero.muon_rules.muon_owners(state.shard.layout, world)
    assert len(owners) == n_matrices
    per_rank = collections.Counter(owners.values())
    for r in range(world):
        assert by_rank[r] == 2 * per_rank[r] > 0
    # the NS cost is balanced: no rank does more than its share plus one largest matrix
    cost = collections.Counter()
    lay = state.shard.layout
    for slot_index, k in fzero.sharding.trainable_index(lay).items():
        if k in owners:
            cost[owners[k]] += muon_rules._ns_cost(lay.slots[slot_index].shape)
    largest = max(muon_rules._ns_cost(lay.slots[i].shape) for i, k in fzero.sharding.trainable_index(lay).items()
                  if k in owners)
    assert max(cost.values()) <= sum(cost.values()) / world + largest


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def test_owners_are_deterministic_and_balanced():
    lay = fzero.init_train_state(mlp(torch.float64, sizes=(8, 64, 64, 64, 64, 8)), fzero.muon(matrices=lambda n: n.endswith("weight") and not n.startswith("2.")),
                                 fzero.SimulatedWorld(2), alignment=4).shard.layout
    a, b = fzero.muon_rules.muon_owners(lay, 3), fzero.muon_rules.muon_owners(lay, 3)
    assert a == b and set(a.values()) == {0, 1, 2}


def test_checkpoint_reshards_to_another_world_and_stage(tmp_path):
    """Saved at W=2 stage 2 after two steps, loaded at W=3 stage 3: the momentum buffers and
    AdamW's moments reshard as flat moments, and the resumed run equals torch.optim's
    uninterrupted one."""
    model = mlp(torch.float64, sizes=SIZES)
    matrices = is_matrix_of(model)
    data = batches(4, 6, 1, torch.float64, d_in=SIZES[0])
    ref = reference_run(model, lambda m: MuonAdamW(m, matrices), data, 6)
    state, comm2 = _train(mlp(torch.float64, sizes=SIZES), rule(matrices), data[:2], 6, 2,
                          comm=fzero.SimulatedWorld(2))
    assert all(m.shape == (2, g.shard_numel) for g, ms in zip(state.shard.layout.groups, state.opt.moments)
               for m in ms)
    fzero.save_checkpoint(state, tmp_path, comm2)
    comm3 = fzero.SimulatedWorld(3)
    model3 = mlp(torch.float64, sizes=SIZES)
    template = fzero.init_train_state(model3, rule(matrices), comm3, stage=3, units=children, alignment=4)
    loaded, _ = fzero.load_checkpoint(tmp_path, template, comm3)
    resumed, _ = _train(model3, None, data[2:], 3, 3, state=loaded, comm=comm3)
    _assert_params(resumed, comm3, ref)
    with pytest.raises(fzero.checkpoint.CheckpointMismatchError, match="optimizer nesterov: True vs False"):
        fzero.load_checkpoint(tmp_path, fzero.init_train_state(mlp(torch.float64, sizes=SIZES),
                                                               rule(matrices, nesterov=False), comm3), comm3)


def test_errors_name_the_parameter_and_the_rule():
    model = mlp(torch.float64, sizes=SIZES)
    comm = fzero.SimulatedWorld(2)
    batch = comm.split_batch(batches(1, 2, 2, torch.float64, d_in=SIZES[0])[0])
    # a bias among the matrices: named at the first step, before any collective
    state = fzero.init_train_state(model, rule(lambda n: n in ("0.weight", "0.bias")), comm)
    step = fzero.make_train_step(fzero.module_loss(model, mse), comm)
    with pytest.raises(ValueError, match=r"muon: parameter 0\.bias has shape \(9,\); Muon updates 2-D"):
        step(state, batch)
    state = fzero.init_train_state(model, rule(is_matrix_of(model)), comm)
    compiled = fzero.make_train_step(fzero.module_loss(model, mse), comm, compile=True)
    with pytest.raises(ValueError, match=r"optimizer muon cannot run in a compiled step: its Newton-Schulz"):
        compiled(state, batch)
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        fzero.muon(matrices=is_matrix_of(model), adjust_lr_fn="other")
    with pytest.raises(ValueError, match=r"adamw takes .*\['betas2'\]"):
        fzero.muon(matrices=is_matrix_of(model), adamw=dict(betas2=0.9))
    from fzero.checkpoint import export_torch_optim_state_dict
    with pytest.raises(fzero.checkpoint.CheckpointMismatchError, match="optimizer muon has no torch.optim equivalent"):
        export_torch_optim_state_dict(state, comm)
    with pytest.raises(ValueError, match="pass comm="):
        fzero.shard_step(state.shard, state.opt, tuple(torch.zeros_like(m) for m in state.shard.master))


class _SplitByDim(MuonAdamW):
    """The oracle given a parameter list (``unused_cases``): Muon on the 2-D ones."""

    def __init__(self, params) -> None:  # noqa: ANN001
        params = list(params)
        self.muon = torch.optim.Muon([p for p in params if p.dim() == 2], **MUON_KW)
        self.adamw = torch.optim.AdamW([p for p in params if p.dim() != 2], **ADAMW_KW)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_unused_parameters_are_skipped_as_torch_skips_them(stage, monkeypatch):
    """A matrix (``branch``) no rank used in a step is not orthogonalized and keeps its momentum,
    as torch.optim.Muon skips a parameter whose gradient is None; ``aux`` never steps; AdamW's
    parameters keep their own step counts."""
    monkeypatch.setitem(uc.OPTIMIZERS, "muon", (lambda: rule(lambda n: n.endswith("weight")), _SplitByDim))
    want = uc.run_oracle(2, "muon")
    got = uc.run_fzero(fzero.SimulatedWorld(2), "muon", stage)
    for k, v in want.items():
        assert max_rel_err(got["params"][k], v) <= 1e-12, (k, stage)
    assert got["steps"]["branch.weight"] == 4 and got["steps"]["aux.weight"] == 0
    assert not torch.equal(want["branch.weight"], uc.Gated().branch.weight.detach())


@pytest.mark.parametrize("world", [2, 3])
def test_traffic_is_one_bf16_all_gather_and_reduce_scatter_of_the_matrices(world):
    """What Muon adds to a step, as design.md states it: one all-gather and one
    reduce-scatter(sum) in bfloat16 of the Muon groups' padded elements, and nothing else."""
    model = mlp(torch.float64, sizes=SIZES)
    counting = fzero.comm.CountingCommunicator(fzero.SimulatedWorld(world))
    state = fzero.init_train_state(model, rule(is_matrix_of(model)), counting, stage=2, alignment=4)
    step = fzero.make_train_step(fzero.module_loss(model, mse), counting)
    batch = counting.split_batch(batches(1, world, 2, torch.float64, d_in=SIZES[0])[0])
    counting.reset()
    step(state, batch)
    extra = [(r.op, r.elements) for r in counting.records if r.dtype == torch.bfloat16]
    muon_numel = sum(g.padded_numel for g in state.shard.layout.groups if g.opt_group != 1)
    assert extra == [("all_gather", muon_numel), ("reduce_scatter", muon_numel)]
    assert all(r.dtype == torch.float64 for r in counting.records if r.dtype != torch.bfloat16)


def test_an_overflowing_step_is_skipped_on_every_rank_alike():
    """A non-finite gradient on one rank: no rank updates or calls Muon's collectives, the
    state stays bitwise, and training goes on."""
    comm = fzero.comm.CountingCommunicator(fzero.SimulatedWorld(2))
    state, history, changed = cases.train(comm, steps=3, optimizer=cases.muon(), poison=lambda s, r: s == 1 and r == 1)
    assert changed == [True, False, True]
    assert [h["found_inf"] for h in history] == [0.0, 1.0, 0.0]
    assert int(state.opt.step) == 2
    assert sum(r.dtype == torch.bfloat16 for r in comm.records) == 4  # two applied steps, two collectives each


def test_a_further_muon_group_and_the_adamw_group_follow_torch_param_groups():
    """``groups`` are further Muon groups among the matrices (torch: a second Muon param
    group); the AdamW group's learning rate is changed between steps as torch's would be."""
    world = 3
    data = batches(4, world, 2, torch.float64, d_in=SIZES[0])
    model = mlp(torch.float64, sizes=SIZES)
    matrices = is_matrix_of(model)
    special = "3.weight"

    def torch_pair(m):  # noqa: ANN001, ANN202
        pair = MuonAdamW(m, matrices)
        named = dict(m.named_parameters())
        pair.muon = torch.optim.Muon([{"params": [p for n, p in named.items() if matrices(n) and n != special]},
                                      {"params": [named[special]], "lr": 0.05, "momentum": 0.5}], **MUON_KW)
        return pair

    ref = copy.deepcopy(model)
    opt = torch_pair(ref)
    comm = fzero.SimulatedWorld(world)
    fz = fzero.muon(matrices=matrices, adamw=ADAMW_KW, groups=[(lambda n: n == special, {"lr": 0.05, "momentum": 0.5})],
                    **MUON_KW)
    m2 = mlp(torch.float64, sizes=SIZES)
    state = fzero.init_train_state(m2, fz, comm, alignment=4)
    assert state.shard.layout.groups and {g.opt_group for g in state.shard.layout.groups} == {0, 1, 2}
    step = fzero.make_train_step(fzero.module_loss(m2, mse), comm)
    for i, (x, y) in enumerate(data):
        if i == 2:
            opt.adamw.param_groups[0]["lr"] = 0.002
            state = replace(state, opt=fzero.optim.set_hyperparams(state.opt, group=1, lr=0.002))
        opt.zero_grad()
        (sum(mse(ref(xr), yr) for xr, yr in zip(x.chunk(world), y.chunk(world))) / world).backward()
        opt.step()
        state, _ = step(state, comm.split_batch((x, y)))
    _assert_params(state, comm, ref)
