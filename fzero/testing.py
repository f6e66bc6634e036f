"""Testing and measurement utilities (not used by training code).

Imports: ``fzero.comm``.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .comm import Communicator, ReduceOp

__all__ = ["GatherTracker"]


class GatherTracker(Communicator):
    """Wraps a communicator and measures how many all-gathered bytes are alive at once.

    Every ``all_gather`` output is tracked until the last reference to it (or
    to a view of it) is dropped, so ``peak_bytes`` is the true high-water
    mark of gathered parameters in an eager step. Bytes are per local rank.
    """

    def __init__(self, inner: Communicator):
        self.inner = inner
        self.world_size = inner.world_size
        self.local_ranks = inner.local_ranks
        self.ranks = inner.ranks
        self.live_bytes = 0
        self.peak_bytes = 0

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def _release(self, nbytes: int) -> None:
        self.live_bytes -= nbytes

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner.all_gather(x)
        nbytes = out[0].numel() * out.element_size()
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(out, self._release, nbytes)
        return out

    def all_reduce(self, x: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        return self.inner.all_reduce(x, op)

    def reduce_scatter(self, x: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        return self.inner.reduce_scatter(x, op)

    def check_layout(self, layout: Any) -> None:
        self.inner.check_layout(layout)
