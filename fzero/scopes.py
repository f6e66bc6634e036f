"""Profiler scopes that name the buffers a step allocates for itself: an eager step allocates its transient buffers
inside ``torch.profiler.record_function`` scopes named here, so a memory census (:class:`fzero.testing.census.Census`,
or any trace with ``profile_memory=True``) tells them from activations and autograd's gradients and checks
:func:`fzero.memory.memory_report`'s prediction. ``fzero::grad_buckets`` (stages 1-2): the buckets gradients are
copied into in backward; ``fzero::grad_reduction``: the gradient collectives' buffers (averaged shards, receive
buffers, stacked rows); ``fzero::gather`` (stage 3): what is sent, received and copied to gather a unit's parameters
for its forward and backward, prefetches included; ``fzero::update``: norm, unscale, clip, the optimizer step and
stages 1-2's parameter all-gather. A traced step enters none (a compiled graph's allocations are its own).

Imports: none of fzero.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch

__all__ = ["GRAD_BUCKETS", "GRAD_REDUCTION", "GATHER", "UPDATE", "SCOPES", "step_scope"]

GRAD_BUCKETS = "fzero::grad_buckets"
GRAD_REDUCTION = "fzero::grad_reduction"
GATHER = "fzero::gather"
UPDATE = "fzero::update"
SCOPES = (GRAD_BUCKETS, GRAD_REDUCTION, GATHER, UPDATE)


def step_scope(name: str, traced: bool = False) -> ContextManager[None]:
    """``record_function(name)``; nothing in a traced step (``traced``)."""
    return contextlib.nullcontext() if traced else torch.profiler.record_function(name)
