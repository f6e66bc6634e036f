"""The live-tensor census: exact bytes on known allocations, peak vs end, categories,
autograd's backward, and a real fzero step against ``memory_report``."""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as tp

import fzero
from fzero.scopes import GATHER, GRAD_BUCKETS, GRAD_REDUCTION
from fzero.testing import Census
from fzero.testing.census import _replay, storages_of
from helpers import mlp

MIB = 2.0**20


def test_exact_bytes_peak_and_end():
    with Census() as c:
        a = torch.empty(1000)                       # 4000 bytes
        b = torch.empty(500, dtype=torch.float64)   # 4000
        del a
        big = torch.empty(10_000)                   # 40000: the peak is b + big
        view = big[5:]                              # a view allocates nothing
        big.zero_()                                 # nor does an in-place op
        del big, view
        d = torch.empty(3, dtype=torch.int8)        # 3
    assert c.peak_bytes == 4000 + 40000
    assert c.end_bytes == 4000 + 3
    assert [a.nbytes for a in c.allocations] == [4000, 4000, 40000, 3]
    assert [a.end_ns is None for a in c.allocations] == [False, True, False, True]
    assert c.by_category == {"other": 44000} and c.total_at_peak == 44000
    assert c.missed_frees == 0
    del b, d


def test_empty_block():
    with Census() as c:
        pass
    assert (c.peak_bytes, c.end_bytes, c.by_category) == (0, 0, {})
    assert "live at the peak" in c.table()


def test_baseline_frees_are_ordered_against_the_block():
    """Known tensors from before the block are its baseline; one freed before the peak is
    not live at the peak, one freed after is."""
    early, late = torch.empty(1000), torch.empty(2000)      # 4000, 8000 bytes
    keep = torch.empty(10)                                  # 40, stays
    with Census(known={"held": [early, late, late[3:], keep]}) as c:
        del early
        x = torch.empty(5000)                               # 20000: the peak
        del x
        del late
    assert c.baseline == {"held": 4000 + 8000 + 40}         # views share one storage
    assert c.peak_bytes == 20000 and c.end_bytes == 0
    assert c.baseline_by_category == {"held": 8000 + 40}
    assert c.by_category == {"held": 8040, "other": 20000}
    assert c.total_at_peak == 28040
    del keep


def test_known_after_the_block_names_in_block_allocations():
    """A callable is read at exit: allocations the block made and the result holds are
    named, views and slices included; a known storage that existed before is baseline."""
    before = torch.empty(100)                               # 400, existed before
    out = {}
    with Census(known={"result": lambda: [out["a"][2:], out["b"], before]}) as c:
        out["a"] = torch.empty(256)                         # 1024
        tmp = torch.empty(1024)                             # 4096, freed
        out["b"] = torch.empty(64, dtype=torch.float64)     # 512
        del tmp
    assert c.peak_bytes == 1024 + 4096 + 512
    assert c.in_block_by_category == {"result": 1536, "other": 4096}
    assert c.baseline == {"result": 400}
    assert c.by_category == {"result": 1936, "other": 4096}
    c.attribute({"later": [out["a"]]})                      # already named: first wins
    assert "later" not in c.by_category
    assert c.by_op()  # the operators that allocated the unnamed bytes
    del before


def test_census_holds_no_reference_to_known_tensors():
    t = torch.empty(1000)
    with Census(known={"held": [t]}) as c:
        del t                                               # frees it: nothing else holds it
        torch.empty(10)
    assert c.baseline_by_category == {}
    assert c.by_category == {"other": 40}


def test_allocations_inside_autograd_backward_are_seen():
    """Gradients are allocated by autograd's engine during backward (the calling thread on
    CPU): the census sees them, to the byte."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 32))
    x = torch.randn(16, 64)
    with Census(known={"grads": lambda: [p.grad for p in model.parameters()]}) as c:
        model(x).square().mean().backward()
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert c.end_by_category["grads"] == grad_bytes       # every gradient, exactly
    assert c.in_block_by_category.get("grads", 0) <= grad_bytes
    assert c.peak_bytes > grad_bytes                       # activations were live too


def test_replay_pairs_by_address_and_counts_missed_frees():
    events = [
        (1, 0x100, 64, "op", ""), (2, 0x200, 32, "op", ""),
        (3, 0x900, -128, "", ""),             # a free of an older buffer: ignored
        (4, 0x100, 16, "op", ""),             # reuse without a seen free: the 64 ends here
        (5, 0x200, -32, "", ""),
    ]
    allocs, missed = _replay(events, {})
    assert missed == 1
    assert sorted((a.ptr, a.nbytes, a.start_ns, a.end_ns) for a in allocs) == [
        (0x100, 16, 4, None), (0x100, 64, 1, 4), (0x200, 32, 2, 5)]


def test_allocations_are_named_by_their_innermost_census_scope():
    """Bytes allocated inside ``record_function("fzero::...")`` carry that scope (the innermost
    one, through nested operators); other scopes do not count; each scope's own peak is the
    most its allocations held at once, wherever the block's peak was."""
    from torch.profiler import record_function

    with Census() as c:
        with record_function("fzero::outer"):
            a = torch.empty(256)                            # 1024 outer
            with record_function("fzero::inner"):
                b = torch.empty(128)                        # 512 inner
            with record_function("not ours"):
                d = torch.empty(64)                         # 256 outer: "not ours" is no census scope
        del a
        e = torch.empty(1024)                               # 4096 unscoped: the block's peak
    assert c.scope_peaks == {"fzero::outer": 1024 + 256, "fzero::inner": 512}
    assert c.by_scope == {"fzero::inner": 512, "fzero::outer": 256, "": 4096}
    assert b.numel() + d.numel() + e.numel() == 1216


def test_storages_of_deduplicates_and_skips_empty():
    t = torch.empty(10)
    got = storages_of([t, t[2:], t.view(2, 5), torch.empty(0), "not a tensor"])
    assert [s.nbytes() for s in got] == [40]


def _state_tensors(state: fzero.TrainState) -> list[torch.Tensor]:
    return tp.tree_leaves(state)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("donate", [False, True])
def test_fzero_step_against_memory_report(stage, donate):
    """A real step on SimulatedWorld(2): the state's tensors (counted as "held" before the
    step) are ``memory_report(...).held_total`` per rank within 1% (the rest: the per-rank
    generator states and 0-d scalars). The step allocates at least the report's transient
    bytes (it also holds activations and, in stages 1-2, full local gradients); without
    donation it allocates a whole new state, with it the state's buffers are reused."""
    torch.manual_seed(0)
    model = mlp(sizes=(64, 256, 256, 16))
    comm = fzero.SimulatedWorld(2)
    units = (lambda name, m: name in ("0", "3", "5")) if stage == 3 else None
    # stages 1-2 in buckets of unequal sizes (one parameter alone, two together, ...)
    state = fzero.init_train_state(model, fzero.adamw(), comm, stage=stage, units=units,
                                   bucket_numel=None if units else 20_000)
    step = fzero.make_train_step(fzero.module_loss(model, torch.nn.functional.mse_loss), comm, donate=donate)
    assert stage == 3 or len({g.bucket for g in state.layout.groups}) >= 3
    batch = comm.split_batch((torch.randn(8, 64), torch.randn(8, 16)))
    state, _ = step(state, batch)                          # warm-up: lazily built pieces
    rep = fzero.memory_report(state.layout, state.opt.optimizer, stage=stage)
    held = {"s": state}
    del state
    census = Census(known={"held": _state_tensors(held["s"]), "module": list(model.parameters()),
                           "new state": lambda: _state_tensors(held["s"])})
    with census:
        held["s"], _ = step(held["s"], batch)
    R = comm.local_ranks
    print(f"\nstage {stage} donate {donate}: memory_report per rank: held {rep.held_total / MIB:.3f} MiB, "
          f"transient {rep.transient_total / MIB:.3f} MiB; census (both simulated ranks):\n{census.table()}")
    assert census.baseline["held"] == pytest.approx(R * rep.held_total, rel=0.01)
    assert census.baseline["held"] >= R * rep.held_total
    # The module holds no parameter memory of its own: at stage 3 its parameters are on the meta
    # device; at stages 1-2 they view the gathered buffers they were given at init, which a
    # donating step refills in place and a pure step replaces (the module then keeps the old ones).
    if stage == 3:
        assert census.baseline.get("module", 0) == 0
    elif donate:
        assert {p.untyped_storage().data_ptr() for p in model.parameters()} <= {
            t.untyped_storage().data_ptr() for t in held["s"].params}
    else:
        assert census.baseline["module"] == R * rep.held["params"]
    assert census.peak_bytes >= R * rep.transient_total
    # the step's own buffers, by their profiler scope: the buckets as predicted to the byte,
    # the reductions within the 0-d scalars their averages allocate
    buffers = fzero.memory_report(held["s"].layout, held["s"].opt.optimizer, stage=stage, comm=comm).step_buffers
    assert set(buffers) == ({GRAD_BUCKETS, GRAD_REDUCTION} if stage < 3 else {GATHER, GRAD_REDUCTION})
    if stage < 3:
        assert buffers[GRAD_BUCKETS] * R == census.scope_peaks[GRAD_BUCKETS]
        assert 0 <= census.scope_peaks[GRAD_REDUCTION] - buffers[GRAD_REDUCTION] * R <= 256
        # together (simulated ranks share their buckets: no lone-parameter gradient here)
        together = fzero.memory_report(held["s"].layout, held["s"].opt.optimizer, stage=stage, comm=comm).step_peak
        assert 0 <= census.joint_peak((GRAD_BUCKETS, GRAD_REDUCTION)) - together * R <= 256
    else:  # the gathers and reductions of the unit schedule (tests/test_census_stage3.py)
        assert 0 <= census.scope_peaks[GATHER] - buffers[GATHER] * R <= 256
        assert 0 <= census.scope_peaks[GRAD_REDUCTION] - buffers[GRAD_REDUCTION] * R <= 256
    new = census.in_block_by_category.get("new state", 0)
    made = census.end_by_category.get("new state", 0)
    if donate:
        # master and moments are updated in place; stages 1-2 gather into the parameters
        reused = R * (rep.held["master"] + rep.held["moments"])
        assert made <= R * rep.held_total - reused + 0.01 * R * rep.held_total
    else:
        assert made == pytest.approx(R * rep.held_total, rel=0.01)
    assert new <= made
