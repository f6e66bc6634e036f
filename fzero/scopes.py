"""``record_function`` scopes an eager step allocates its buffers in, so a memory census (:class:`fzero.testing.Census`,
any ``profile_memory=True`` trace) tells them from activations and checks :func:`fzero.memory.memory_report`.
``fzero::grad_buckets`` (stages 1-2): backward's gradient buckets; ``fzero::grad_reduction``: the gradient collectives'
buffers; ``fzero::gather`` (stage 3): a unit's gather, prefetches included; ``fzero::update``: norm, unscale, clip, the
optimizer step and stages 1-2's all-gather. A traced step enters none.

Imports: none of fzero.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["GRAD_BUCKETS", "GRAD_REDUCTION", "GATHER", "UPDATE", "SCOPES", "step_scope"]

GRAD_BUCKETS = "fzero::grad_buckets"
GRAD_REDUCTION = "fzero::grad_reduction"
GATHER = "fzero::gather"
UPDATE = "fzero::update"
SCOPES = (GRAD_BUCKETS, GRAD_REDUCTION, GATHER, UPDATE)


def step_scope(name: str, traced: bool = False) -> contextlib.AbstractContextManager[None]:
    """``record_function(name)``; nothing in a traced step (``traced``)."""
    return contextlib.nullcontext() if traced else torch.profiler.record_function(name)
