"""The step's scratch pool (fzero.scratch): a buffer is given out again only once nothing
refers to it; pooled steps compute the same bits as unpooled ones."""

from __future__ import annotations

import pytest
import torch

import fzero
import fzero.scratch as scratch
from dist_cases import pooled_stage3

MIB = 1 << 20


def ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_a_buffer_is_given_out_again_only_once_nothing_refers_to_it():
    pool = scratch.ScratchPool(min_bytes=0)
    a = pool.empty((256, 64), torch.float32, torch.device("cpu"))
    first = ptr(a)
    view = a[3:]
    del a
    b = pool.empty((64, 256), torch.float32, "cpu")  # same bytes, but a view of the first lives
    assert ptr(b) != first
    b.fill_(2.0)
    view.fill_(1.0)
    assert bool((b == 2.0).all())  # writing one never touches the other
    del view
    c = pool.empty((128, 128), torch.float32, "cpu")
    assert ptr(c) == first and pool.reused == 1 and pool.fresh == 2
    assert c.shape == (128, 128) and c.dtype == torch.float32 and c.is_contiguous() and c._base is None


def test_autograd_saved_tensors_and_other_dtypes_keep_a_buffer_in_use():
    pool = scratch.ScratchPool(min_bytes=0)
    w = pool.empty((32, 32), torch.float32, "cpu").normal_().requires_grad_(True)
    x = torch.randn(4, 32, requires_grad=True)
    y = (x @ w).sum()  # autograd saves w
    held = ptr(w)
    w = None
    other = pool.empty((32, 32), torch.float32, "cpu")
    assert ptr(other) != held
    y.backward()
    other = pool.empty((32, 32), torch.float32, "cpu")
    assert ptr(other) != held  # the graph still holds w (its gradient accumulates into it)
    del y, other
    half = pool.empty((32, 64), torch.bfloat16, "cpu")  # 4096 bytes: a size the pool has, now free
    assert ptr(half) == held and half.dtype == torch.bfloat16


def test_small_blocks_and_no_pool_go_to_the_allocator():
    pool = scratch.ScratchPool()
    small = pool.empty((1000,), torch.float32, "cpu")
    assert pool.fresh == 0 and pool.held_bytes() == 0 and small.numel() == 1000
    assert scratch.current() is None
    t = scratch.empty((4, MIB), torch.uint8, "cpu")  # no current pool: a plain tensor
    assert t.shape == (4, MIB)


def test_cat_and_reshaped_give_torchs_values():
    pool = scratch.ScratchPool(min_bytes=0)
    xs = [torch.randn(3, n) for n in (5, 7, 1)]
    x = torch.randn(4, 6, 5)
    with scratch.using(pool):
        joined = scratch.cat(xs, dim=1)
        cut = scratch.reshaped(x[:, 1:4], (4, 15))
        whole = scratch.reshaped(x, (24, 5))
    assert torch.equal(joined, torch.cat(xs, dim=1))
    assert torch.equal(cut, x[:, 1:4].reshape(4, -1)) and cut.shape == (4, 15)
    assert ptr(whole) == ptr(x)  # contiguous: a view, nothing copied
    assert pool.fresh == 2
    assert scratch.current() is None  # the block restored the previous pool


def test_release_free_drops_what_is_free_and_clear_drops_everything():
    pool = scratch.ScratchPool(min_bytes=0)
    kept = pool.empty((MIB,), torch.uint8, "cpu")
    pool.empty((MIB,), torch.uint8, "cpu")  # free at once
    assert pool.held_bytes() == 2 * MIB
    pool.release_free()
    assert pool.held_bytes() == MIB
    again = pool.empty((MIB,), torch.uint8, "cpu")
    assert ptr(again) != ptr(kept)
    pool.clear()
    assert pool.held_bytes() == 0 and kept.numel() == MIB  # the caller's tensor is still its own


def test_free_buffers_of_sizes_not_asked_for_recently_are_dropped():
    pool = scratch.ScratchPool(per_size=1, recent=2, min_bytes=0)
    for n in (1, 1, 2, 3):  # each freed at once
        pool.empty((n * 1000,), torch.uint8, "cpu")
    # sizes 2 and 3 were the last two asked for: one free buffer each; size 1's are gone
    assert sorted(k[0] for k in pool.bufs) == [2000, 3000]


@pytest.mark.parametrize("world", [1, 2])
def test_a_pooled_stage3_step_equals_an_unpooled_one_bitwise(world):
    """Every gathered and cut buffer of the simulated world's stage-3 step through the pool
    (no minimum size), against the same step with nothing pooled."""
    comm = fzero.SimulatedWorld(world)
    pooled = pooled_stage3(comm, min_bytes=0)
    assert pooled["reused"] > 0 and pooled["held"] == 0  # used, and emptied when the step ended
    plain = pooled_stage3(comm, min_bytes=1 << 62)
    assert plain["reused"] == 0
    assert all(torch.equal(a, b) for a, b in zip(pooled["masters"], plain["masters"]))
