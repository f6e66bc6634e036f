"""Parameters sharded and averaged over groups of their own (``init_train_state(groups=)``, a communicator's
``groups``): the experts of :mod:`param_group_cases` over their rank groups, the rest over the world, against a
plain-torch oracle emulating every rank (float64): stages 1-3, accumulation, clipping that binds, unused experts,
compiled; the bytes each group's collectives move; the memory report; named errors before any collective. Four gloo
ranks against this simulated world bitwise: ``test_param_groups_gloo.py``."""

from __future__ import annotations

import pytest
import torch

import fzero
import param_group_cases as pc
from fzero.comm import CountingCommunicator, SimulatedWorld
from fzero.quantized import QuantizedCommunicator
from helpers import CHEAP_COMPILE

pytestmark = pytest.mark.usefixtures("one_thread")


def _world() -> SimulatedWorld:
    return SimulatedWorld(4, groups=pc.GROUPS)


def _assert_params(got: list[dict], want: list[dict], tol: float = 1e-12) -> None:
    for r, (g, w) in enumerate(zip(got, want)):
        for name, value in w.items():
            err = (g[name] - value).abs().max().item()
            assert err <= tol, f"rank {r} {name}: error {err:.3g} > {tol}"


def _assert_metrics(got: list[float], want: list[float]) -> None:
    # a float64 model's loss and norm metrics are float64
    for a, b in zip(got, want):
        assert abs(a - b) <= 1e-12, (got, want)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("opt,clip,accum", [("adamw", None, 1), ("sgd", 0.05, 2), ("adamw", 0.05, 2)])
def test_groups_train_as_the_oracle(stage, opt, clip, accum):
    """SGD with clipping that binds: the clip factor scales every update, so a norm that missed an element or counted
    one twice would move the parameters far beyond 1e-12."""
    want = pc.run_oracle(4, clip, accum, opt=opt)
    got = pc.run_fzero(_world(), stage, clip, accum, opt=opt)
    _assert_params(got["params"], want["params"])
    _assert_metrics(got["losses"], want["losses"])
    _assert_metrics(got["norms"], want["norms"])
    if clip is not None:
        assert min(want["norms"]) > 10 * clip  # clipping binds at every step
    # the rank groups' experts are their own: training left them apart, each the same within its group
    experts = [n for n in want["params"][0] if pc.in_experts(n)]
    for n in experts:
        assert not torch.equal(got["params"][0][n], got["params"][1][n]), n
        assert torch.equal(got["params"][0][n], got["params"][2][n]), n
        assert torch.equal(got["params"][1][n], got["params"][3][n]), n


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("unused", ["skip", "zeros"])
def test_an_expert_without_tokens_follows_unused(stage, unused):
    """In step 1 no token of rank group 1 reaches its expert 1: ``"skip"`` leaves it (and its moments) as they were
    there and counts the step it sat out for that rank group alone; ``"zeros"`` steps it with a zero gradient."""
    m = pc.LocalExperts()
    h = torch.tanh(m.embed(pc.STARVING))
    assert m.moe.router(h).argmax().item() == 0  # the starving input goes to expert 0
    want = pc.run_oracle(4, None, starve=True, unused=unused)
    got = pc.run_fzero(_world(), stage, None, starve=True, unused=unused)
    _assert_params(got["params"], want["params"])
    state = got["state"]
    lay = state.layout
    missed = state.opt.missed[0].tolist()
    expert1 = [i for i, s in enumerate(lay.slots) if s.path.startswith("moe.experts.1.")]
    index = fzero.layout.trainable_index(lay)
    group1 = fzero.layout.trainable_index(lay, {"experts": 1})
    if unused == "zeros":
        assert set(missed) == {0}
    else:
        assert [missed[group1[i]] for i in expert1] == [2, 2]  # rank group 1: step 1, and one more the router chose
        assert [missed[index[i]] for i in expert1] == [1, 1]  # rank group 0: one step of its own
        assert len(missed) == lay.num_positions == len(lay.trainable_slots) + 4


def test_groups_compiled_equal_eager_and_the_oracle():
    """A compiled simulated world (one graph, experts masked instead of skipped: no host read): the oracle's values
    and eager's bits."""
    want = pc.run_oracle(4, 0.05, masked=True, opt="sgd", steps=2)
    eager = pc.run_fzero(_world(), 2, 0.05, masked=True, opt="sgd", steps=2)
    compiled = pc.run_fzero(_world(), 2, 0.05, masked=True, opt="sgd", steps=2, compile=CHEAP_COMPILE)
    _assert_params(compiled["params"], want["params"])
    for a, b in zip(compiled["params"], eager["params"]):
        assert all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_donating_bf16_steps_equal_pure_ones(stage):
    """bf16 compute and reduction (FSDP's divide factors of the world's size for a group's sum too), donated steps
    (each group gathered into its own buffers) bitwise the pure ones."""
    pure = pc.run_fzero(_world(), stage, 0.05, opt="adamw", bf16=True)
    donated = pc.run_fzero(_world(), stage, 0.05, opt="adamw", bf16=True, donate=True)
    for a, b in zip(pure["params"], donated["params"]):
        assert all(torch.equal(a[n], b[n]) for n in a)
    assert pure["losses"] == donated["losses"]
    want = pc.run_oracle(4, 0.05, opt="adamw")
    for a, b in zip(pure["params"], want["params"]):  # bf16's rounding, not another rule
        assert all((a[n].double() - b[n]).abs().max() < 2e-2 for n in b)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_each_group_moves_its_own_bytes(stage):
    """One step's collectives by axis against the layout: the experts' gradients reduced and their parameters
    gathered only within their rank groups (``"experts"``, 2 ranks), the dense ones over the world (4); the step's one
    all-reduce of norms and flags over the world."""
    counter = CountingCommunicator(_world())
    got = pc.run_fzero(counter.inner, stage, 0.05, counter=counter, steps=1)
    lay = got["state"].layout
    padded = {axis: sum(g.padded_numel for g in lay.groups if g.axis == axis) for axis in ("", "experts")}
    assert padded["experts"] > 0 and padded[""] > 0
    agreement = 2 + lay.num_positions  # norm, loss, every rank group's used flags
    for axis, name, w in (("", "shard", 4), ("experts", "experts", 2)):
        grads = counter.totals(["all_reduce" if stage == 1 else "reduce_scatter"], axis=name)
        agreed = agreement if stage == 1 and not axis else 0  # the world's all-reduce of the agreement beside them
        assert grads["elements"] - agreed == padded[axis]  # float64 gradients, each element once per step
        factor = 2 * (w - 1) / w if stage == 1 else (w - 1) / w
        assert grads["bytes"] - 8 * agreed * factor == pytest.approx(8 * padded[axis] * factor)
        gathers = counter.totals(["all_gather"], axis=name)
        if stage < 3:  # the new parameters, once (float64 compute)
            assert gathers["elements"] == padded[axis] and gathers["bytes"] == pytest.approx(8 * padded[axis] * (w - 1) / w)
        else:  # each unit gathered in forward and again in backward, every simulated rank's run gathering its rows
            assert gathers["elements"] > 0
    agreed = [r for r in counter.records if r.op == "all_reduce" and r.axis == "shard" and r.dtype == torch.float64
              and r.elements == agreement]
    assert len(agreed) == 1  # one world all-reduce


def test_memory_report_shards_the_experts_over_their_group():
    """At stage 3, 16 bytes per parameter with bf16 compute and fp32 master and moments: the experts' over their rank
    group of W / EP = 2 ranks, the dense ones over W = 4 (fp32 master and two moments held; bf16 parameters and
    gradients, 2 + 2, in the step)."""
    model = pc.LocalExperts().float()
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-3), _world(), stage=3, alignment=4,
                                   precision=fzero.MixedPrecision(param_dtype=torch.bfloat16,
                                                                  reduce_dtype=torch.bfloat16),
                                   groups={"experts": pc.in_experts}, units=lambda name, m: name == "moe")
    report = fzero.memory_report(state.layout, state.opt.optimizer, stage=3, precision=state.precision)
    experts = sum(p.numel() for n, p in model.named_parameters() if pc.in_experts(n))
    dense = sum(p.numel() for n, p in model.named_parameters() if not pc.in_experts(n))
    held = report.held["master"] + report.held["moments"]
    padding = 12 * sum(g.padding / state.layout.axis_size(g.axis) for g in state.layout.groups)
    assert held == pytest.approx(12 * experts / 2 + 12 * dense / 4 + padding)
    total = sum(report.held.values()) + sum(report.transient[k] for k in ("params", "grads"))
    assert total == pytest.approx(16 * experts / 2 + 16 * dense / 4 + padding * 16 / 12)
    # what the state's tensors hold, per rank (4 rows in this process): the report's master and moments
    rows = [*state.shard.master, *(m for ms in state.opt.moments for m in ms)]
    assert sum(t.untyped_storage().nbytes() for t in rows) / 4 == held


def test_wrong_groups_are_named_before_any_collective():
    model = pc.LocalExperts()
    opt = fzero.adamw(lr=1e-3)
    cases = [
        (lambda: SimulatedWorld(4, groups={"experts": (3, 2)}), "groups['experts']: mesh (3, 2)"),
        (lambda: SimulatedWorld(4, groups={"experts": [[0, 1], [1, 2]]}), "rank 1 is in two rank groups"),
        (lambda: SimulatedWorld(4, groups={"experts": [[0, 1, 2], [3]]}), "groups of sizes [3, 1]"),
        (lambda: SimulatedWorld(4, mesh=(2, 2), groups=pc.GROUPS), "need a flat world"),
        (lambda: QuantizedCommunicator(_world()), "has parameter groups, whose collectives are not quantized"),
        (lambda: fzero.init_train_state(model, opt, SimulatedWorld(4, groups={**pc.GROUPS, "more": (2, 2)}),
                                        groups={"experts": pc.in_experts, "more": lambda p: "experts.0" in p}),
         "'moe.experts.0.weight' is in parameter groups 'experts' and 'more'"),
        (lambda: fzero.init_train_state(model, opt, _world(), groups={"shared": pc.in_experts}),
         "parameter group 'shared': this communicator"),
        (lambda: fzero.init_train_state(model, opt, _world(), groups={"experts": lambda p: False}),
         "groups['experts'] matches no trainable parameter"),
        (lambda: fzero.init_train_state(model, fzero.adafactor(), _world(), groups={"experts": pc.in_experts}),
         "updates shards by piece"),
        (lambda: fzero.init_train_state(model, opt, _world(), groups={"experts": pc.in_experts},
                                        trainable=lambda p: not pc.in_experts(p)),
         "matches no trainable parameter"),
        (lambda: fzero.init_train_state(model, opt, _world(), groups={"experts": lambda p: p.startswith("moe.")},
                                        trainable=lambda p: not p.startswith("moe.router")),
         "'moe.router.weight' is frozen but in parameter group 'experts'"),
    ]
    for make, text in cases:
        with pytest.raises(ValueError, match=None) as e:
            make()
        assert text in str(e.value), (text, str(e.value))


def test_grouped_checkpoints_load_bitwise_and_torch_optim_dicts_are_refused(tmp_path):
    """A grouped state's checkpoint (each rank group's experts stacked by rank group) loads back bitwise, its
    sat-out counts per rank group included; its torch.optim state dicts and a live export are refused by name."""
    from fzero.checkpoint import export_pretrained, export_torch_optim_state_dict, load_checkpoint, save_checkpoint

    got = pc.run_fzero(_world(), 2, None, starve=True)
    save_checkpoint(got["state"], tmp_path / "ckpt", _world())
    template = fzero.init_train_state(pc.LocalExperts(), fzero.adamw(lr=2e-2, weight_decay=0.1), _world(),
                                      groups={"experts": pc.in_experts}, alignment=4)
    state, _ = load_checkpoint(tmp_path / "ckpt", template, _world())
    for a, b in zip((*state.shard.master, *state.opt.moments[0], state.opt.missed[0]),
                    (*got["state"].shard.master, *got["state"].opt.moments[0], got["state"].opt.missed[0])):
        assert torch.equal(a, b)
    for call in (lambda: export_torch_optim_state_dict(state, _world()),
                 lambda: export_pretrained(state, tmp_path / "out", comm=_world())):
        with pytest.raises(ValueError, match="parameter groups \\('experts'\\), which this does not support yet"):
            call()
    assert not (tmp_path / "out").exists()


def test_one_rank_group_of_every_rank_trains_as_the_flat_world():
    """Groups of every rank (EP = 1): the oracle's flat data parallelism, and the values of the same run without
    groups (within rounding: the experts' flat groups are their own, so vector kernels split them elsewhere)."""
    want = pc.run_oracle(2, 0.05, opt="sgd", steps=2)
    flat = pc.run_fzero(SimulatedWorld(2), 2, 0.05, opt="sgd", steps=2, groups=None)
    one = pc.run_fzero(SimulatedWorld(2, groups={"experts": (1, 2)}), 2, 0.05, opt="sgd", steps=2)
    _assert_params(one["params"], want["params"])
    _assert_params(one["params"], flat["params"])
    assert one["state"].layout.axes == (("experts", 2, 1),)
