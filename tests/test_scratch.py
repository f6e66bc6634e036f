"""The torch.distributed communicator's buffer reuse (fzero.dist.gloo.ScratchPool): a buffer is
given out again only once nothing refers to it; pooled steps compute the same bits as unpooled
ones (tests/test_distributed.py, on gloo)."""

from __future__ import annotations

import torch

from fzero.dist import gloo

MIB = 1 << 20


def ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _pool(monkeypatch) -> gloo.ScratchPool:
    monkeypatch.setattr(gloo, "MIN_BYTES", 0)
    return gloo.ScratchPool()


def test_a_buffer_is_given_out_again_only_once_nothing_refers_to_it(monkeypatch):
    pool = _pool(monkeypatch)
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


def test_autograd_saved_tensors_and_other_dtypes_keep_a_buffer_in_use(monkeypatch):
    pool = _pool(monkeypatch)
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


def test_small_blocks_go_to_the_allocator():
    pool = gloo.ScratchPool()
    small = pool.empty((1000,), torch.float32, "cpu")
    assert pool.fresh == 0 and pool.held_bytes() == 0 and small.numel() == 1000


def test_free_buffers_beyond_per_size_are_dropped_and_clear_drops_everything(monkeypatch):
    monkeypatch.setattr(gloo, "MIN_BYTES", 0)
    pool = gloo.ScratchPool(per_size=1)
    kept = pool.empty((MIB,), torch.uint8, "cpu")
    held = [pool.empty((MIB,), torch.uint8, "cpu") for _ in range(3)]
    assert pool.held_bytes() == 4 * MIB and pool.fresh == 4
    del held
    again = pool.empty((MIB,), torch.uint8, "cpu")  # one free buffer reused, one more kept free
    assert pool.reused == 1 and pool.held_bytes() == 3 * MIB
    pool.clear()
    assert pool.held_bytes() == 0 and kept.numel() == MIB and again.numel() == MIB
