"""A 2x2 mesh on four gloo ranks (``mesh_worker.py``) against the simulated 2x2 world of ``test_mesh.py``: bitwise
the same parameters, buffers, generators, losses and norms at stages 1-3, the same bytes per axis, named errors for a
wrong mesh before any collective, its checkpoint loaded by the simulated world, flat and meshed, and its live export.
"""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as tp

import fzero
import fzero.checkpoint
import test_mesh as tm
from dist_harness import run_torchrun
from fzero.checkpoint import load_checkpoint
from fzero.comm import CountingCommunicator, SimulatedWorld
from fzero.quantized import QuantizedCommunicator

CASES = ["train1", "train2", "train3", "train2_accum", "train2_quantized", "train3_quantized", "train3_hpz", "wrong"]
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def gloo():
    return run_torchrun(4, "mesh_worker.py", CASES, timeout=400)


def _result(gloo, rank: int, case: str) -> dict:
    got = gloo[rank][case]
    assert "exception" not in got, got.get("exception")
    return got


@pytest.mark.parametrize("case", ["train1", "train2", "train3", "train2_accum", "train2_quantized", "train3_quantized"])
def test_gloo_mesh_equals_the_simulated_mesh_bitwise(gloo, case):
    """Also with qwZ (int8) and qgZ (int4) on bf16 parameters: the same codes on the wire, the same bits."""
    stage, accum, quantized = int(case[5]), 4 if case.endswith("_accum") else 1, case.endswith("_quantized")
    comm = CountingCommunicator(SimulatedWorld(4, mesh=(2, 2)))
    inner = QuantizedCommunicator(comm, weights=8, grads=4) if quantized else comm
    state, metrics = tm._train(inner, stage, accum, param_dtype=torch.bfloat16 if quantized else None)
    sim = tm._params(state, comm)
    for rank in range(4):
        got = _result(gloo, rank, case)
        assert "mesh=(2, 2)" in got["repr"]
        for a, b in zip(sim, got["params"]):
            assert torch.equal(a[rank], b), (rank, case)
        assert torch.equal(state.rng[0][rank], got["rng"])
        assert [m["loss"] for m in metrics] == got["loss"]
        assert [m["grad_norm"] for m in metrics] == got["grad_norm"]
        # bytes per axis: what one rank sends, as the simulated world counts it; not stage 3's gathers: there each
        # simulated rank's run gathers every rank's rows (counted once per rank), and a real rank all-gathers its
        # unit-call tags
        axes = ("replica", "world") if stage == 3 else ("shard", "replica", "world")
        per_axis = {ax: sum(b for _, a, _, b in got["records"] if a == ax) for ax in axes}
        assert per_axis == {ax: comm.totals(axis=ax)["bytes"] for ax in axes}


def test_gloo_hpz_equals_the_flat_world_bitwise_and_regathers_within_nodes(gloo):
    """hpZ on four gloo ranks (2 nodes of 2): bitwise the simulated flat world's results; its backward regathers on
    the node axis, as many bytes per rank as the simulated hpZ world counts per rank's run."""
    flat = SimulatedWorld(4)
    state, metrics = tm._train(flat, 3)
    want = tm._params(state, flat)
    sim = CountingCommunicator(SimulatedWorld(4, mesh=(2, 2), hpz=True))
    tm._train(sim, 3)
    sim_node = sum(r.bytes for r in sim.records if r.axis == "node")
    for rank in range(4):
        got = _result(gloo, rank, "train3_hpz")
        assert "hpz mesh=(2, 2)" in got["repr"]
        assert all(torch.equal(a[rank], b) for a, b in zip(want, got["params"]))
        assert [m["loss"] for m in metrics] == got["loss"]
        node = [(op, b) for op, a, _, b in got["records"] if a == "node"]
        assert node and all(op == "all_gather" for op, _ in node)
        assert 4 * sum(b for _, b in node) == sim_node


def test_wrong_mesh_is_a_named_error_on_every_rank(gloo):
    for rank in range(4):
        got = _result(gloo, rank, "wrong")
        assert "multiply to the world size 4, but 3 * 2 = 6" in got["messages"][0]
        assert "rank 1 is in two shard groups (0 and 1)" in got["messages"][1]
        assert "rank 4 in shard group 2 is not a rank of the world (size 4)" in got["messages"][2]
        assert "mesh=(1, 4): flat, one shard group" in got["flat"]
        assert "mesh=(4, 1): replicated only, as DDP" in got["ddp"]


@pytest.mark.parametrize("where", ["flat4", "mesh2x2", "flat2"])
def test_gloo_mesh_checkpoint_loads_on_the_simulated_world(gloo, where):
    """Saved by the four gloo ranks as 2x2 after stage 2's three steps: loaded bitwise as the simulated 2x2 run's state,
    at 2x2, flat W=4 and flat W=2 (each rank's generator too, where the rank exists)."""
    comm = SimulatedWorld(4, mesh=(2, 2))
    saved, _ = tm._train(comm, 2)
    into = {"flat4": SimulatedWorld(4), "mesh2x2": comm, "flat2": SimulatedWorld(2)}[where]
    template = fzero.init_train_state(tm._model(), fzero.adamw(lr=1e-2, weight_decay=0.1), into, stage=2, seed=9)
    loaded, _ = load_checkpoint(_result(gloo, 0, "train2")["ckpt"], template, into)
    want = tp.tree_leaves(fzero.full_params(saved.shard, comm))
    for a, b in zip(want, tp.tree_leaves(fzero.full_params(loaded.shard, into))):
        assert torch.equal(a[0], b[0])
    assert torch.equal(saved.opt.step, loaded.opt.step)
    assert torch.equal(saved.rng[0][:into.data_world_size], loaded.rng[0])


def test_gloo_mesh_live_export_equals_the_simulated_mesh(gloo):
    """Exported live by the four gloo ranks as 2x2 at stage 3 (each piece broadcast from its holder in the shard group,
    in pieces of 5 elements): the safetensors file holds the simulated 2x2 run's parameters, bitwise."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    comm = SimulatedWorld(4, mesh=(2, 2))
    state, _ = tm._train(comm, 3, 1)
    want = fzero.checkpoint.export_model_state_dict(state, comm)
    got = safetensors_torch.load_file(_result(gloo, 0, "train3")["export"] + "/model.safetensors")
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
