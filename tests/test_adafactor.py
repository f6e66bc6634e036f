"""``fzero.adafactor``: torch.optim.Adafactor on flat shards, equal to torch.optim.Adafactor on the
unsharded model (float64, 1e-10) at every W and stage, with matrices and a 3-D parameter
straddling shard boundaries; the factored statistics from two small all_reduces (no gather);
its replicated vector state checkpoints, reshards and exchanges with torch.optim; clear errors.
The gloo run equal to the simulated world is in ``test_distributed.py`` (``adafactor``)."""

from __future__ import annotations

import collections

import pytest
import torch

import dist_cases as cases
import fzero
import fzero.adafactor_rules as ada
import fzero.replicas
import unused_cases as uc
import user_models as um
from fzero.checkpoint import export_torch_optim_state_dict, import_torch_optim_state_dict
from fzero.checkpoint.offline import consolidate_torch_optim_state_dict
from fzero.pytree import replace
from helpers import assert_params_close, batches, children, max_rel_err, mlp, straddles, train_sharded

STEPS = 5
TOL = 1e-10
SIZES = (7, 9, 5, 3)  # odd: the matrices straddle shard boundaries at every W
# weight decay on; a non-default beta2_decay; maximize; an explicit eps1 and a clipping threshold d
CONFIGS = {
    "decay": dict(lr=0.05, weight_decay=0.1, beta2_decay=-0.7),
    "maximize": dict(lr=0.03, weight_decay=0.05, maximize=True),
    "eps1": dict(lr=0.04, weight_decay=0.1, eps=(1e-4, 1e-3), d=1.2),
}
mse = torch.nn.functional.mse_loss
pytestmark = pytest.mark.usefixtures("one_thread")


class Mix(torch.nn.Module):
    """A 3-D weight: ``out[b, j] = sum_k tanh(h @ weight[k])[b, j]``."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.weight = torch.nn.Parameter(torch.randn(2, 3, 5, generator=g, dtype=torch.float64) * 0.3)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bi,kij->bkj", h, self.weight).tanh().sum(1)


class Net(torch.nn.Module):
    """The test MLP (odd sizes, a LayerNorm), a 3-D parameter (torch factors its last two
    dimensions) and a 0-d one (elementwise ``variance``)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = mlp(torch.float64, sizes=SIZES)
        self.head = Mix()
        self.gain = torch.nn.Parameter(torch.tensor(1.5, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        z = self.head(h)
        return self.gain * h + z[:, :3]


def torch_adafactor(params, cfg):  # noqa: ANN001, ANN201
    return torch.optim.Adafactor(params, **cfg)  # on the CPU torch runs its single-tensor code


def oracle(cfg, data, world, model=None, loss=mse):  # noqa: ANN001, ANN201
    """torch.optim.Adafactor on the unsharded model, the gradient averaged over W micro-batches;
    returns (model, optimizer)."""
    model = Net() if model is None else model
    opt = torch_adafactor(model.parameters(), cfg)
    _oracle_steps(model, opt, data, world, loss)
    return model, opt


def _oracle_steps(model, opt, data, world, loss=mse) -> None:  # noqa: ANN001
    for x, y in data:
        opt.zero_grad()
        (sum(loss(model(xr), yr) for xr, yr in zip(x.chunk(world), y.chunk(world))) / world).backward()
        opt.step()


def _train(model, cfg, data, world, stage, criterion=mse, state=None, comm=None, donate=False):  # noqa: ANN001
    rule = fzero.adafactor(**cfg) if state is None else None
    return train_sharded(model, rule, data, world, stage, criterion, state, comm, donate)


def _assert_params(state, comm, ref: torch.nn.Module, where=()) -> None:  # noqa: ANN001
    assert_params_close(state, comm, ref, TOL, where)


def _straddles(state) -> bool:  # noqa: ANN001
    """Whether some factored parameter lies on more than one rank's shard."""
    return straddles(state, lambda shape: len(shape) > 1)


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_equals_torch_adafactor_at_every_world_and_stage(config):
    cfg = CONFIGS[config]
    for world in (1, 2, 3, 4):
        data = batches(STEPS, world, 2, torch.float64, d_in=SIZES[0])
        ref, _ = oracle(cfg, data, world)
        moved = max(max_rel_err(p.detach(), q.detach()) for p, q in zip(ref.parameters(), Net().parameters()))
        assert moved > 1e-3  # the oracle trained
        for stage in (1, 2, 3):
            # donating (the shards updated in place) at even W
            state, comm = _train(Net(), cfg, data, world, stage, donate=world % 2 == 0)
            assert world == 1 or _straddles(state)
            assert int(state.opt.step) == STEPS
            _assert_params(state, comm, ref, where=(config, world, stage))


@pytest.mark.parametrize("world,stage", [(2, 1), (3, 2), (4, 3)])
def test_llama_equals_torch_adafactor(world, stage):
    pytest.importorskip("transformers")
    cfg = CONFIGS["decay"]
    data = um.token_batches(STEPS, world * 2)
    model = um.llama().double()
    ref, _, _ = um.oracle_run(model, lambda m: torch_adafactor(m.parameters(), cfg), data, world,
                              um.oracle_loss("lm"))
    state, comm = _train(um.llama().double(), cfg, data, world, stage, um.lm_criterion)
    _assert_params(state, comm, ref, where=(world, stage))


def test_vector_state_is_replicated_and_world_size_independent():
    """``row_var``/``col_var`` of every factored parameter joined in trainable order, the same
    length at any W, equal to torch's (flattened); rules without vector state keep ``()``."""
    cfg = CONFIGS["decay"]
    data = batches(3, 6, 1, torch.float64, d_in=SIZES[0])
    _, opt = oracle(cfg, data, 6)
    named = dict(zip([n for n, _ in Net().named_parameters()], opt.param_groups[0]["params"]))
    for world in (2, 3):
        state, _ = _train(Net(), cfg, data, world, 2, comm=fzero.SimulatedWorld(world))
        slots = state.layout.trainable_slots
        expect = [torch.cat([opt.state[named[s.path]][k].reshape(-1) for s in slots if len(s.shape) > 1])
                  for k in ("row_var", "col_var")]
        assert len(state.opt.vectors) == 2
        for got, want in zip(state.opt.vectors, expect):
            assert got.shape == want.shape and got.dtype == torch.float64
            assert max_rel_err(got, want) <= TOL
        # digested by the replica checks, as every replicated leaf
        names = [n for n, _, _ in fzero.replicas.replica_items(state)]
        assert "opt.vectors['row_var']" in names and "opt.vectors['col_var']" in names
    plain = fzero.init_train_state(mlp(torch.float64, sizes=SIZES), fzero.adamw(), fzero.SimulatedWorld(2))
    assert plain.opt.vectors == ()


def test_checkpoint_reshards_to_another_world_and_stage(tmp_path):
    """Saved at W=2 stage 2 after two steps, loaded at W=3 stage 3 and at W=1 stage 1: the
    replicated vectors (``fzero/vector/...``) and the ``variance`` moment reshard, and the
    resumed runs equal torch.optim's uninterrupted one."""
    cfg = CONFIGS["eps1"]
    data = batches(4, 6, 1, torch.float64, d_in=SIZES[0])
    ref, _ = oracle(cfg, data, 6)
    state, comm2 = _train(Net(), cfg, data[:2], 6, 2, comm=fzero.SimulatedWorld(2))
    fzero.save_checkpoint(state, tmp_path, comm2)
    for world, stage in ((3, 3), (1, 1)):
        comm = fzero.SimulatedWorld(world)
        model = Net()
        units = {"units": children} if stage == 3 else {}
        template = fzero.init_train_state(model, fzero.adafactor(**cfg), comm, stage=stage, alignment=4, **units)
        loaded, _ = fzero.load_checkpoint(tmp_path, template, comm)
        for a, b in zip(loaded.opt.vectors, state.opt.vectors):
            assert torch.equal(a, b)
        resumed, _ = _train(model, None, data[2:], world, stage, state=loaded, comm=comm)
        _assert_params(resumed, comm, ref, where=(world, stage))
    comm3 = fzero.SimulatedWorld(3)
    # eps1 None is another configuration than a number: named by the manifest
    other = fzero.init_train_state(Net(), fzero.adafactor(lr=0.04), comm3)
    with pytest.raises(fzero.checkpoint.CheckpointMismatchError, match="hyperparameters"):
        fzero.load_checkpoint(tmp_path, other, comm3)


def test_checkpoint_vectors_that_do_not_match_the_layout_are_named(tmp_path, monkeypatch):
    cfg = CONFIGS["decay"]
    comm = fzero.SimulatedWorld(2)
    state, _ = _train(Net(), cfg, batches(1, 2, 1, torch.float64, d_in=SIZES[0]), 2, 2, comm=comm)
    fzero.save_checkpoint(state, tmp_path, comm)
    monkeypatch.setattr(ada.Adafactor, "vector_lengths", lambda self, shape: (1, 1) if len(shape) > 1 else (0, 0))
    template = fzero.init_train_state(Net(), fzero.adafactor(**cfg), comm)
    with pytest.raises(fzero.checkpoint.CheckpointMismatchError, match=r"entry 'fzero/vector/row_var' is torch.float64\[\d+\], "
                                                            r"this state needs torch.float64\[4\]"):
        fzero.load_checkpoint(tmp_path, template, comm)


def test_torch_optim_state_dict_equals_torch_and_round_trips(tmp_path):
    """Export after 3 steps equals ``torch.optim.Adafactor(...).state_dict()`` of the oracle
    (keys, shapes, dtypes, values; param_groups); offline consolidation gives the same; the
    imported state (another W and stage) continues as torch does; torch loads the export."""
    cfg = CONFIGS["eps1"]
    data = batches(5, 6, 1, torch.float64, d_in=SIZES[0])
    ref_model, ref_opt = oracle(cfg, data[:3], 6)
    state, comm = _train(Net(), cfg, data[:3], 6, 2, comm=fzero.SimulatedWorld(2))
    exported = export_torch_optim_state_dict(state, comm)
    want = ref_opt.state_dict()
    _assert_same_optim_dict(exported, want)
    fzero.save_checkpoint(state, tmp_path, comm)
    _assert_same_optim_dict(consolidate_torch_optim_state_dict(tmp_path), want)
    # torch takes it as its own
    model = Net()
    model.load_state_dict(ref_model.state_dict())
    opt = torch_adafactor(model.parameters(), cfg)
    opt.load_state_dict(exported)
    # import at W=3 stage 3, continue two steps: equal to torch continuing
    comm3 = fzero.SimulatedWorld(3)
    m3 = Net()
    template = fzero.init_train_state(m3, fzero.adafactor(**cfg), comm3, stage=3, units=children, alignment=4)
    imported = import_torch_optim_state_dict(template, ref_model.state_dict(), want, comm3)
    for a, b in zip(imported.opt.vectors, state.opt.vectors):
        assert max_rel_err(a, b) <= TOL
    _oracle_steps(ref_model, ref_opt, data[3:], 6)
    resumed, _ = _train(m3, None, data[3:], 3, 3, state=imported, comm=comm3)
    _assert_params(resumed, comm3, ref_model)
    _assert_same_optim_dict(export_torch_optim_state_dict(resumed, comm3), ref_opt.state_dict())
    # a matrix's torch state of the wrong size is named
    assert [n for n, _ in Net().named_parameters()][1] == "body.0.weight"
    bad = {**want, "state": {**want["state"], 1: {**want["state"][1], "row_var": torch.zeros(2, 1)}}}
    with pytest.raises(fzero.checkpoint.CheckpointMismatchError, match=r"'row_var' of 'body.0.weight' has 2 elements"):
        import_torch_optim_state_dict(template, ref_model.state_dict(), bad, comm3)
    # another optimizer's state dict is named
    adam = torch.optim.Adam(Net().parameters()).state_dict()
    with pytest.raises(fzero.checkpoint.CheckpointMismatchError, match="another optimizer than adafactor"):
        import_torch_optim_state_dict(template, ref_model.state_dict(), adam, comm3)


def _assert_same_optim_dict(got, want) -> None:  # noqa: ANN001
    assert got["param_groups"] == want["param_groups"]
    assert sorted(got["state"]) == sorted(want["state"])
    for pid, st in want["state"].items():
        mine = got["state"][pid]
        assert sorted(mine) == sorted(st), pid
        for k, v in st.items():
            assert mine[k].shape == v.shape and mine[k].dtype == v.dtype, (pid, k)
            assert max_rel_err(mine[k], v) <= TOL, (pid, k)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_unused_parameters_are_skipped_as_torch_skips_them(stage, monkeypatch):
    """A parameter no rank used in a step keeps its value and statistics and its own step
    count does not advance, as torch.optim.Adafactor skips a parameter whose gradient is None."""
    cfg = dict(lr=0.05, weight_decay=0.1)
    monkeypatch.setitem(uc.OPTIMIZERS, "adafactor", (lambda: fzero.adafactor(**cfg),
                                                     lambda ps: torch_adafactor(ps, cfg)))
    want = uc.run_oracle(2, "adafactor")
    got = uc.run_fzero(fzero.SimulatedWorld(2), "adafactor", stage)
    for k, v in want.items():
        assert max_rel_err(got["params"][k], v) <= 1e-12, (k, stage)
    assert got["steps"]["branch.weight"] == 4 and got["steps"]["aux.weight"] == 0
    assert not torch.equal(want["branch.weight"], uc.Gated().branch.weight.detach())


def _adafactor_sizes(state) -> tuple[int, int]:  # noqa: ANN001
    """Elements of Adafactor's two all_reduces: the statistics and the update norms."""
    T = len(state.layout.trainable_slots)
    return T + sum(v.numel() for v in state.opt.vectors), T


@pytest.mark.parametrize("world,stage", [(2, 2), (3, 3)])
def test_traffic_is_two_small_all_reduces_and_no_gather(world, stage):
    """What Adafactor adds to a step, as design.md states it: two all_reduces, of T + sum(B*R +
    B*C) and of T elements, in the master dtype; the rest of the step's collectives are those
    of the same step with AdamW."""
    records = {}
    for name, rule in (("adamw", fzero.adamw(lr=1e-2)), ("adafactor", fzero.adafactor(**CONFIGS["decay"]))):
        model = Net()
        counting = fzero.comm.CountingCommunicator(fzero.SimulatedWorld(world))
        units = {"units": children} if stage == 3 else {}
        state = fzero.init_train_state(model, rule, counting, stage=stage, alignment=4, **units)
        step = fzero.make_train_step(fzero.module_loss(model, mse), counting)
        batch = counting.split_batch(batches(1, world, 2, torch.float64, d_in=SIZES[0])[0])
        counting.reset()
        step(state, batch)
        records[name] = collections.Counter((r.op, r.dtype, r.elements) for r in counting.records)
        if name == "adafactor":
            stats, norms = _adafactor_sizes(state)
    added = records["adafactor"] - records["adamw"]
    assert not records["adamw"] - records["adafactor"]
    assert added == collections.Counter({("all_reduce", torch.float64, stats): 1,
                                         ("all_reduce", torch.float64, norms): 1})
    # small: the statistics are a few percent of this tiny model's parameters (R + C per R x C)
    numel = sum(s.numel for s in state.layout.trainable_slots)
    assert stats < numel / 2


def test_an_overflowing_step_is_skipped_on_every_rank_alike():
    """A non-finite gradient on one rank: no rank updates or calls Adafactor's all_reduces, the
    state (vectors included) stays bitwise, and training goes on."""
    comm = fzero.comm.CountingCommunicator(fzero.SimulatedWorld(2))
    state, history, changed = cases.train(comm, steps=3, optimizer=cases.adafactor(),
                                          poison=lambda s, r: s == 1 and r == 1)
    assert changed == [True, False, True]
    assert [h["found_inf"] for h in history] == [0.0, 1.0, 0.0]
    assert int(state.opt.step) == 2
    stats, norms = _adafactor_sizes(state)
    ours = [r for r in comm.records if r.op == "all_reduce" and r.elements in (stats, norms)]
    assert len(ours) == 4  # two applied steps, two all_reduces each


def test_errors_name_the_argument_and_the_rule():
    for kwargs, what in [(dict(beta2_decay=0.5), "beta2_decay 0.5"), (dict(d=0.5), "d 0.5"),
                         (dict(eps=(-1.0, 1e-3)), "eps1 -1.0"), (dict(eps=(None, -1.0)), "eps2 -1.0"),
                         (dict(lr=-1.0), "lr -1.0"), (dict(weight_decay=-0.1), "weight_decay -0.1")]:
        with pytest.raises(ValueError, match=f"adafactor: invalid {what} \\(torch.optim.Adafactor requires"):
            fzero.adafactor(**kwargs)
        with pytest.raises(ValueError):  # torch refuses the same values
            torch.optim.Adafactor([torch.zeros(2, requires_grad=True)], **kwargs)
    with pytest.raises(ValueError, match=r"param group 1: invalid d 0.9"):
        fzero.adafactor(groups=[(lambda n: True, {"d": 0.9})])
    with pytest.raises(ValueError, match=r"unknown hyperparameter 'eps1'"):
        fzero.adafactor(groups=[(lambda n: True, {"eps1": 1e-30})])  # eps1 None: no such hyperparameter
    model = Net()
    comm = fzero.SimulatedWorld(2)
    batch = comm.split_batch(batches(1, 2, 2, torch.float64, d_in=SIZES[0])[0])
    state = fzero.init_train_state(model, fzero.adafactor(), comm)
    compiled = fzero.make_train_step(fzero.module_loss(model, mse), comm, compile=True)
    with pytest.raises(ValueError, match=r"optimizer adafactor cannot run in a compiled step: its statistics"):
        compiled(state, batch)
    with pytest.raises(ValueError, match="pass comm="):
        fzero.shard_step(state.shard, state.opt, tuple(torch.zeros_like(m) for m in state.shard.master))
    with pytest.raises(TypeError, match=r"parameter 'w': expected a floating-point tensor, got torch.complex64"):
        fzero.init_train_state({"w": torch.zeros(3, 4, dtype=torch.complex64)}, fzero.adafactor(), comm)


def test_from_torch_optim_returns_the_rule():
    rule = fzero.from_torch_optim(torch.optim.Adafactor, lr=0.05, eps=(1e-4, 1e-3), weight_decay=0.1, foreach=False)
    assert rule == fzero.adafactor(lr=0.05, eps=(1e-4, 1e-3), weight_decay=0.1)
    assert isinstance(rule, fzero.adafactor_rules.Adafactor) and rule.signature == fzero.adafactor(
        lr=0.05, eps=(1e-4, 1e-3), weight_decay=0.1).signature


def test_hyperparameters_are_scheduled_per_group_as_torch_param_groups():
    """A second group (the LayerNorm and biases, another ``d`` and no weight decay); the
    learning rate changed between steps as torch's would be."""
    world = 3
    data = batches(4, world, 2, torch.float64, d_in=SIZES[0])
    cfg = CONFIGS["decay"]
    ref = Net()
    special = {n for n, p in ref.named_parameters() if p.dim() <= 1}
    named = dict(ref.named_parameters())
    opt = torch.optim.Adafactor([{"params": [p for n, p in named.items() if n not in special]},
                                 {"params": [named[n] for n in named if n in special], "weight_decay": 0.0,
                                  "d": 1.5}], **cfg)
    comm = fzero.SimulatedWorld(world)
    m2 = Net()
    rule = fzero.adafactor(groups=[(special.__contains__, {"weight_decay": 0.0, "d": 1.5})], **cfg)
    state = fzero.init_train_state(m2, rule, comm, alignment=4)
    step = fzero.make_train_step(fzero.module_loss(m2, mse), comm)
    for i, (x, y) in enumerate(data):
        if i == 2:
            for g in opt.param_groups:
                g["lr"] = 0.01
            state = replace(state, opt=fzero.optim.set_hyperparams(state.opt, lr=0.01))
        _oracle_steps(ref, opt, [(x, y)], world)
        state, _ = step(state, comm.split_batch((x, y)))
    _assert_params(state, comm, ref)
    _assert_same_optim_dict(export_torch_optim_state_dict(state, comm), opt.state_dict())
