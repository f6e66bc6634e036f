"""Profiler scopes that name the buffers a step allocates for itself.

An eager step allocates its own transient buffers inside
``torch.profiler.record_function`` scopes named here, so a memory census
(:class:`fzero.testing.census.Census`, or any ``torch.profiler`` trace with
``profile_memory=True``) can tell them from the model's activations and
autograd's gradients, and :func:`fzero.memory.memory_report`'s prediction of
them can be checked against what was allocated:

``fzero::grad_buckets``
    stages 1-2: the bucket buffers each rank's gradients are copied into
    during backward (:class:`fzero.buckets.BufferPool`).
``fzero::grad_reduction``
    every stage: what the gradient collectives allocate: averaged shards,
    receive buffers, stacked rows; stage 3 on gloo also the joined send and
    receive buffers of a reduction batched with a gather (the gather's rows
    beside the gradient's: ``TorchCommunicator.batched``).
``fzero::gather``
    stage 3 eagerly: the parameters gathered for a unit's forward and again
    for its backward (:mod:`fzero.units`): what is sent (the master shard
    cast, joined), the received buffers and the copies that cut them into
    each flat group's buffer, prefetched gathers included.
``fzero::update``
    after backward: the norm, unscale and clip, the optimizer step and the
    parameter all-gather of stages 1-2 (a pure step's new state is made here).

A traced step enters none (``step_scope(name, traced=True)``: a compiled graph's
allocations are its own). Outside a profiler a scope costs one small dispatcher call.

Imports: torch only.
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
    if traced:
        return contextlib.nullcontext()
    return torch.profiler.record_function(name)
