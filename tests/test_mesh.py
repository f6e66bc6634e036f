"""A world with a shape (HSDP): the state sharded over each shard group and replicated over the replica axis.

On the simulated world a mesh ``(R, S)`` must train exactly as the flat world of ``R * S`` ranks (within float64
rounding: only the order of the gradient sums differs), carry on its replica axis one all-reduce of each gradient
shard per step (also under accumulation), and move checkpoints between shapes bitwise. ``test_mesh_gloo.py`` runs
the same on four gloo ranks against this simulated world.
"""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as tp
from hypothesis import given, settings
from hypothesis import strategies as st

import fzero
from fzero.checkpoint import load_checkpoint, save_checkpoint
from fzero.comm import CountingCommunicator, SimulatedWorld, mesh_groups
from helpers import CHEAP_COMPILE, examples


class Block(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.lin, self.norm, self.bn = torch.nn.Linear(d, d), torch.nn.LayerNorm(d), torch.nn.BatchNorm1d(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.tanh(self.bn(torch.tanh(self.lin(x)))))


class Net(torch.nn.Module):
    """Four shard units (stage 3 regathers all but the last two in backward), BatchNorm buffers (broadcast from rank
    0), dropout (each rank's own stream)."""

    def __init__(self, d: int = 6, dropout: float = 0.2):
        super().__init__()
        self.blocks = torch.nn.Sequential(*(Block(d) for _ in range(4)))
        self.head, self.drop = torch.nn.Linear(d, 3), torch.nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.blocks(x)))


def _model(dropout: float = 0.2, dtype: torch.dtype = torch.float64) -> Net:
    torch.manual_seed(0)
    return Net(dropout=dropout).to(dtype)


def _batches(steps: int, rows: int, dtype: torch.dtype = torch.float64) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 6, generator=g, dtype=dtype), torch.randn(rows, 3, generator=g, dtype=dtype))
            for _ in range(steps)]


def _train(comm: fzero.Communicator, stage: int, accum: int = 1, steps: int = 3, compile=False, state=None,
           clip_norm: float | None = 0.5, defer_reduce: bool = False, dropout: float = 0.2, param_dtype=None):
    model = _model(dropout, torch.float64 if param_dtype is None else torch.float32)  # 16-bit compute: float32 master
    if state is None:
        state = fzero.init_train_state(model, fzero.adamw(lr=1e-2, weight_decay=0.1), comm, stage=stage,
                                       units=(Block,) if stage == 3 else None, seed=5,
                                       precision=fzero.MixedPrecision(param_dtype=param_dtype))
    step = fzero.make_train_step(fzero.module_loss(model, torch.nn.functional.mse_loss), comm, accum_steps=accum,
                                 clip_norm=clip_norm, compile=compile, defer_reduce=defer_reduce)
    metrics = []
    for x, y in _batches(steps, 12 * accum, model.head.weight.dtype):
        state, m = step(state, comm.split_batch((x, y), micro_batches=accum))
        metrics.append(m)
    return state, metrics


def _params(state, comm) -> list[torch.Tensor]:
    """Every rank's whole parameters and buffers, ``[ranks, ...]`` each, in tree order."""
    return tp.tree_leaves(fzero.full_params(state.shard, comm)) + list(state.buffers)


def _close(a: list[torch.Tensor], b: list[torch.Tensor], tol: float) -> float:
    worst = max((x - y).abs().max().item() for x, y in zip(a, b))
    assert worst <= tol, worst
    return worst


@settings(deadline=None, max_examples=examples(8))
@given(shape=st.sampled_from([(2, 2), (4, 1), (1, 4), (2, 3), (3, 2)]), stage=st.sampled_from([1, 2, 3]),
       accum=st.sampled_from([1, 3]))
def test_mesh_trains_as_the_flat_world(shape, stage, accum):
    """Stages 1-3, with and without accumulation: a mesh of R*S ranks gives the flat world's parameters, buffers,
    losses and norms within 1e-12 (float64), and every copy of a shard ends bitwise alike."""
    world = shape[0] * shape[1]
    flat, flat_metrics = _train(SimulatedWorld(world), stage, accum)
    mesh_comm = SimulatedWorld(world, mesh=shape)
    mesh, mesh_metrics = _train(mesh_comm, stage, accum)
    assert mesh_comm.world_size == shape[1] and mesh_comm.replicas == shape[0]
    assert mesh.shard.layout.world_size == shape[1]
    _close(_params(flat, SimulatedWorld(world)), _params(mesh, mesh_comm), 1e-12)
    for a, b in zip(flat_metrics, mesh_metrics):
        assert abs(a["loss"].item() - b["loss"].item()) <= 2**-23 * abs(a["loss"].item())  # float32: one rounding
        assert abs(a["grad_norm"].item() - b["grad_norm"].item()) <= 1e-12
    for g, rows in zip(mesh.shard.layout.groups, mesh.shard.master):  # each copy of shard j: the same bits
        for j in range(shape[1]):
            holders = [i for i, r in enumerate(mesh_comm.ranks) if r == j]
            assert all(torch.equal(rows[holders[0]], rows[i]) for i in holders), (g.index, j)


@pytest.mark.parametrize("stage,defer", [(1, False), (2, False), (2, True), (3, False)])
def test_replica_axis_carries_one_gradient_all_reduce_per_step(stage, defer):
    """Counted bytes per rank and step on the replica axis: 2 * Psi * b * (R-1) / (R * S) for the gradients (Psi: the
    padded flat parameters, b: the master dtype's bytes), the same at K=4 as at K=1; and the rest of the step's
    collectives stay inside the shard groups."""
    r, s, steps = 2, 2, 2
    per_step = {}
    for accum in (1, 4):
        comm = CountingCommunicator(SimulatedWorld(r * s, mesh=(r, s)))
        state, _ = _train(comm, stage, accum, steps=steps, defer_reduce=defer)
        groups = state.shard.layout.groups
        psi = sum(g.padded_numel for g in groups)
        replica = [rec for rec in comm.records if rec.axis == "replica"]
        # each step: one all-reduce per flat group's gradient shard, then the agreement's (loss, used flags)
        assert len(replica) == steps * (len(groups) + 1)
        grads = [rec for i, rec in enumerate(replica) if i % (len(groups) + 1) < len(groups)]
        assert [rec.elements for rec in grads] == [g.shard_numel for g in groups] * steps
        per_step[accum] = sum(rec.bytes for rec in grads) / steps
        assert per_step[accum] == 2 * psi * 8 * (r - 1) / (r * s)
        assert all(rec.op == "all_reduce" for rec in replica)
        assert all(rec.op == "broadcast" for rec in comm.records if rec.axis == "world")  # BatchNorm's buffers
    assert per_step[1] == per_step[4]


def test_compiled_mesh_step_equals_eager():
    """Without dropout: a compiled simulated world's ranks share one generator (``fzero.rng``)."""
    comm = SimulatedWorld(4, mesh=(2, 2))
    eager, _ = _train(comm, 2, dropout=0.0)
    compiled, _ = _train(comm, 2, compile=CHEAP_COMPILE, dropout=0.0)
    _close(_params(eager, comm), _params(compiled, comm), 1e-12)


@pytest.mark.parametrize("mesh,message", [
    ((3, 2), r"mesh \(3, 2\): .* multiply to the world size 4, but 3 \* 2 = 6"),
    ([[0, 1], [1, 2]], r"rank 1 is in two shard groups \(0 and 1\)"),
    ([[0, 1], [2, 7]], r"rank 7 in shard group 1 is not a rank of the world \(size 4\)"),
    ([[0, 1, 2], [3]], r"groups of sizes \[3, 1\]"),
    ([[0], [1], [2]], r"ranks \[3\] are in no shard group"),
])
def test_wrong_mesh_is_a_named_error(mesh, message):
    with pytest.raises(ValueError, match=message):
        SimulatedWorld(4, mesh=mesh)


def test_mesh_repr_says_what_it_is():
    assert repr(SimulatedWorld(4, mesh=(2, 2))) == "SimulatedWorld(4, mesh=(2, 2))"
    assert "flat, one shard group" in repr(SimulatedWorld(4, mesh=(1, 4)))
    assert "replicated only, as DDP" in repr(SimulatedWorld(4, mesh=(4, 1)))
    assert mesh_groups([[3, 1], [2, 0]], 4) == ((0, 2), (1, 3))  # as torch numbers a group's ranks
    comm = SimulatedWorld(4, mesh=[[0, 2], [1, 3]])
    assert comm.ranks == (0, 0, 1, 1) and comm.data_ranks == (0, 1, 2, 3)


@pytest.mark.parametrize("stage", [2, 3])
def test_checkpoints_move_between_shapes(tmp_path, stage):
    """Saved at 2x2, loaded at flat W=4, W=2 and 1x4 and saved again, loaded back at 2x2: bitwise equal to the
    state that was saved, and training on from the loaded state equals training on from the saved one."""
    comm = SimulatedWorld(4, mesh=(2, 2))
    saved, _ = _train(comm, stage)
    save_checkpoint(saved, tmp_path / "a", comm)
    for i, other in enumerate([SimulatedWorld(4), SimulatedWorld(2), SimulatedWorld(4, mesh=(1, 4))]):
        template = fzero.init_train_state(_model(), fzero.adamw(lr=1e-2, weight_decay=0.1), other, stage=stage,
                                          units=(Block,) if stage == 3 else None, seed=9)
        moved, _ = load_checkpoint(tmp_path / "a", template, other)
        save_checkpoint(moved, tmp_path / f"b{i}", other)
        template = fzero.init_train_state(_model(), fzero.adamw(lr=1e-2, weight_decay=0.1), comm, stage=stage,
                                          units=(Block,) if stage == 3 else None, seed=9)
        back, _ = load_checkpoint(tmp_path / f"b{i}", template, comm)
        for a, b in zip(tp.tree_leaves((saved.shard.master, saved.opt.moments, saved.opt.step)),
                        tp.tree_leaves((back.shard.master, back.opt.moments, back.opt.step))):
            assert torch.equal(a, b)
        if other.data_world_size == 4:  # the same ranks: each one's generator comes back too
            assert torch.equal(saved.rng[0], back.rng[0])
    on, _ = _train(comm, stage, state=saved, steps=2)
    resumed, _ = _train(comm, stage, state=back, steps=2)
    _close(_params(on, comm), _params(resumed, comm), 0.0)


def _gathers(comm: CountingCommunicator, axis: str) -> tuple[int, float]:
    rows = [r for r in comm.records if r.op == "all_gather" and r.axis == axis]
    return len(rows), sum(r.bytes for r in rows)


@pytest.mark.parametrize("shape", [(2, 2), (2, 3)])
def test_hpz_regathers_within_the_node_and_changes_no_bit(shape):
    """hpZ: the state sharded over all R*S ranks; each unit's backward regather reads the secondary slices held within
    its node (a shard group of the mesh). Bitwise the flat world's results; every backward gather on the "node" axis
    (none crosses nodes), moving the same elements as the flat world's backward gathers, (S-1)/S of each buffer."""
    world = shape[0] * shape[1]
    flat_comm = CountingCommunicator(SimulatedWorld(world))
    flat, flat_metrics = _train(flat_comm, 3)
    comm = CountingCommunicator(SimulatedWorld(world, mesh=shape, hpz=True))
    hpz, hpz_metrics = _train(comm, 3)
    assert repr(comm.inner) == f"SimulatedWorld({world}, hpz mesh={shape})"
    assert comm.world_size == world and comm.replicas == 1 and comm.node.world_size == shape[1]
    _close(_params(flat, flat_comm), _params(hpz, comm), 0.0)
    assert [m["loss"].item() for m in flat_metrics] == [m["loss"].item() for m in hpz_metrics]
    flat_n, flat_bytes = _gathers(flat_comm, "shard")
    fwd_n, fwd_bytes = _gathers(comm, "shard")
    node_n, node_bytes = _gathers(comm, "node")
    assert node_n > 0 and fwd_n + node_n == flat_n
    w, s = world, shape[1]
    assert node_bytes == pytest.approx((flat_bytes - fwd_bytes) * (s - 1) / s * w / (w - 1))


def test_hpz_secondary_memory_is_reported_and_eager_only():
    """memory_report's gather buffers grow by the secondary slices (the units' gathered bytes / S, per rank); a
    compiled step is refused by name; hpZ needs a mesh."""
    plain, hpz = SimulatedWorld(4), SimulatedWorld(4, mesh=(2, 2), hpz=True)
    state = fzero.init_train_state(_model(), fzero.adamw(lr=1e-2), plain, stage=3, units=(Block,))
    lay = state.shard.layout
    a = fzero.memory_report(lay, fzero.adamw(lr=1e-2), stage=3, comm=plain).step_buffers["fzero::gather"]
    b = fzero.memory_report(lay, fzero.adamw(lr=1e-2), stage=3, comm=hpz).step_buffers["fzero::gather"]
    units = sum(g.padded_numel * 8 for g in lay.groups if g.bucket > 0)
    assert b - a == pytest.approx(4 * units / 2 / 4)  # every row's slices, per local rank
    with pytest.raises(NotImplementedError, match="hpZ keeps secondary shards in eager stage-3 steps"):
        fzero.make_train_step(fzero.module_loss(_model(), torch.nn.functional.mse_loss), hpz, compile=True)
    with pytest.raises(ValueError, match="hpz=True.* needs a mesh"):
        SimulatedWorld(4, hpz=True)
