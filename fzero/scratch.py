"""Scratch buffers an eager step reuses once nothing refers to them any more.

A stage-3 step allocates, for every unit, in forward and again in backward, buffers of the
same few sizes: what a gather sends and receives, the gathered flat buffers cut out of it,
and backward's joined sends and receives (a unit's reduction beside the next gather). At
GPT-2-small size these are 14-80 MB each. glibc serves every block above its mmap threshold
(:mod:`fzero.host_malloc`) with a mapping of its own that ``free`` unmaps, so each of these
buffers comes fresh from the kernel and faults in one page at a time on first touch: measured
at 162M parameters on gloo W=2, 47 gather buffers (1.8 GB) and 22 joined sends and receives
(1.7 GB) a step, most of the 5.2 GB an eager stage-3 step faults in.

A :class:`ScratchPool` keeps the buffers it handed out and gives one out again, for a request
that fits (its size, up to :data:`SLACK` times), once no tensor, view, autograd node or collective refers to its storage any
more (the storage's reference count: nothing is ever reused while anything can still read or
write it, so reuse cannot change a value). It is scratch memory of one step function, never
part of the state: :meth:`ScratchPool.clear` drops every buffer when the step ends, and
:meth:`ScratchPool.release_free` drops those no longer in use where the step changes phase
(forward to backward, backward to the update), so buffers of a finished phase do not stay
alive on top of the next phase's peak. Between two requests, a free buffer is kept only while
its size is among the sizes asked for recently, at most :data:`PER_SIZE` of each.

Only host memory is pooled, in blocks of at least :data:`MIN_BYTES` (smaller ones come from
glibc's heap, which keeps freed memory mapped; a GPU's caching allocator already reuses its
blocks). The pool is made current with :func:`using` (by :func:`fzero.grads.loss_grads`
around an eager stage-3 gradient computation); :func:`empty`, :func:`cat` and :func:`reshaped`
allocate from the current pool, or from the allocator as usual where there is none (and
always while dynamo traces: a compiled graph's buffers are its own). The collectives
(:mod:`fzero.dist`, the simulated world's gather) and the gathers (:mod:`fzero.sharding`,
:mod:`fzero.units`) call them for the buffers they own. Stages 1-2 do not make it current:
there it saved little and raised the step's peak (design.md, "Fresh memory").

Imports: torch only.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections import OrderedDict
from typing import Iterator, Optional, Sequence

import torch

__all__ = ["ScratchPool", "using", "current", "empty", "cat", "reshaped", "release_free", "MIN_BYTES", "SLACK",
           "PER_SIZE"]

# Smaller blocks come from the heap, which keeps freed memory mapped (fzero.host_malloc)
MIN_BYTES = 1 << 20

# A request may take a free buffer up to this many times its size
SLACK = 1.25

# The most free buffers of one size kept between requests (fzero.memory replays the same rule)
PER_SIZE = 2

_LOCAL = threading.local()


# The storage's reference count (a private torch function: where a torch lacks it, nothing is
# pooled and every request goes to the allocator)
_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def _storage_refs(t: torch.Tensor) -> int:
    """How many references the storage of ``t`` has, besides the temporary handle this
    function takes: tensors and views sharing it, autograd's saved tensors, collectives."""
    return int(_USE_COUNT(t.untyped_storage()._cdata)) - 1  # type: ignore[misc]


class ScratchPool:
    """Buffers of one step function's eager steps, reused by size (see the module doc).

    ``per_size``: the most free buffers of one size kept between requests (default
    :data:`PER_SIZE`); ``recent``: a free
    buffer is kept only while its size is among the last ``recent`` distinct sizes requested;
    ``min_bytes``: smaller requests go to the allocator (default :data:`MIN_BYTES`, read when
    the pool is made). Not thread-safe (one step at a time, like the step itself)."""

    def __init__(self, per_size: int = PER_SIZE, recent: int = 4, min_bytes: Optional[int] = None):
        self.per_size, self.recent = per_size, recent
        self.min_bytes = MIN_BYTES if min_bytes is None else min_bytes
        # (nbytes, device) -> the buffers of that size handed out (1-D uint8 bases), oldest first
        self.bufs: dict[tuple[int, torch.device], list[torch.Tensor]] = {}
        self.sizes: OrderedDict[tuple[int, torch.device], None] = OrderedDict()  # most recent last
        self.reused = 0  # requests served by a buffer already mapped (for tests and benchmarks)
        self.fresh = 0

    def _free(self, base: torch.Tensor) -> bool:
        return _storage_refs(base) <= 1  # the pool's own base only

    def empty(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised contiguous tensor of ``shape`` and ``dtype``: a free buffer that fits
        (:meth:`_fitting`) if the pool has one, else a new one the pool keeps."""
        nbytes = math.prod(int(s) for s in shape) * dtype.itemsize
        device = torch.device(device)
        if nbytes < self.min_bytes or device.type != "cpu" or _USE_COUNT is None:
            # other devices' allocators cache blocks themselves
            return torch.empty(tuple(shape), dtype=dtype, device=device)
        base = self._fitting(nbytes, device)
        if base is None:
            base = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self.bufs.setdefault((nbytes, device), []).append(base)
            self._asked((nbytes, device))
            self.fresh += 1
        else:
            self.reused += 1
        self._trim()
        return torch.empty(0, dtype=dtype, device=device).set_(base.untyped_storage(), 0, tuple(shape))

    def _fitting(self, nbytes: int, device: torch.device) -> Optional[torch.Tensor]:
        """The smallest free buffer of at least ``nbytes`` and at most :data:`SLACK` times that
        (measured at 162M, stage 3: with exact sizes only, the gathers' peak in the census was
        416.8 MiB, against 389.8 with the slack)."""
        sizes = sorted(k[0] for k in self.bufs if k[1] == device and nbytes <= k[0] <= nbytes * SLACK)
        for size in sizes:
            base = next((b for b in self.bufs[(size, device)] if self._free(b)), None)
            if base is not None:
                self._asked((size, device))
                return base
        return None

    def _asked(self, key: tuple[int, torch.device]) -> None:
        """``key``'s size served a request: the most recent."""
        self.sizes.pop(key, None)
        self.sizes[key] = None
        while len(self.sizes) > self.recent:
            self.sizes.popitem(last=False)

    def _trim(self) -> None:
        """Drop free buffers beyond :attr:`per_size` of a size, and all of a size not asked for
        recently."""
        for key in list(self.bufs):
            keep = self.per_size if key in self.sizes else 0
            kept = []
            for b in self.bufs[key]:
                if not self._free(b):
                    kept.append(b)
                elif keep:
                    kept.append(b)
                    keep -= 1
            self.bufs[key] = kept
            if not kept:
                del self.bufs[key]

    def release_free(self) -> None:
        """Drop every buffer nothing refers to (their memory goes back to the allocator); the
        ones still in use stay, and are reused once free."""
        self.sizes.clear()
        self._trim()

    def clear(self) -> None:
        """Drop every buffer (between steps a rank holds its state, not scratch)."""
        self.bufs.clear()
        self.sizes.clear()

    def held_bytes(self) -> int:
        """Bytes of the buffers the pool keeps (in use or free)."""
        return sum(k[0] * len(v) for k, v in self.bufs.items())


@contextlib.contextmanager
def using(pool: Optional[ScratchPool]) -> Iterator[None]:
    """Make ``pool`` the current pool of this thread inside the block (``None``: none)."""
    prev = getattr(_LOCAL, "pool", None)
    _LOCAL.pool = pool
    try:
        yield
    finally:
        _LOCAL.pool = prev


def current() -> Optional[ScratchPool]:
    """The current pool, or ``None`` (none made current, or dynamo tracing)."""
    if torch.compiler.is_compiling():
        return None
    return getattr(_LOCAL, "pool", None)


def empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty(shape, dtype, device)``, from the current pool if there is one."""
    pool = current()
    if pool is None:
        return torch.empty(tuple(shape), dtype=dtype, device=device)
    return pool.empty(shape, dtype, device)


def cat(tensors: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """``torch.cat(tensors, dim)`` of tensors of one dtype and device, into a buffer of the
    current pool if there is one."""
    pool = current()
    if pool is None or not tensors:
        return torch.cat(list(tensors), dim)
    first = tensors[0]
    shape = list(first.shape)
    d = dim % first.dim()
    shape[d] = sum(int(t.shape[d]) for t in tensors)
    out = pool.empty(shape, first.dtype, first.device)
    return torch.cat(list(tensors), dim, out=out)


def reshaped(x: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """``x.reshape(shape)`` (``shape`` given in full): a view where ``x`` is contiguous, else a
    copy into a buffer of the current pool if there is one."""
    if x.is_contiguous():
        return x.view(tuple(shape))
    out = empty(shape, x.dtype, x.device)
    out.view(x.shape).copy_(x)
    return out


def release_free() -> None:
    """:meth:`ScratchPool.release_free` of the current pool, if there is one."""
    pool = current()
    if pool is not None:
        pool.release_free()
