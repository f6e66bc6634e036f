"""Randomness as state: one generator state per rank, derived from one user seed.

The contract (what reproduces a run):

* ``init_train_state(..., seed=s)`` gives rank ``r`` the generator state of
  ``torch.Generator().manual_seed(rank_seed(s, r))`` (on the parameters'
  device), carried in ``TrainState.rng`` as ``[R, n]`` uint8.
* Eagerly, the step installs rank ``r``'s state in the default generator of
  that device for rank ``r``'s forward and backward (dropout, random
  augmentation in the model, activation checkpointing's recompute), stores
  the state it leaves, and restores the caller's generator afterwards. So a
  rank's masks depend only on ``(s, r)`` and the number of random draws
  before them: the simulated world and real ranks draw the same masks, and a
  plain torch run that seeds rank ``r`` with ``torch.manual_seed(rank_seed(s, r))``
  and draws nothing else draws them too.
* Under ``torch.compile`` the generator cannot be swapped inside the graph
  (dynamo does not trace ``get_rng_state``/``set_rng_state``).
  ``make_train_step(compile=True)`` installs row 0's state around the compiled
  call, so on a real rank (one row) the stream is carried exactly as eagerly,
  though inductor draws its own masks from it (not bitwise those of eager).
  In a compiled simulated world every rank draws from that one stream; fzero
  warns once when a compiled step consumed randomness with more than one row.

Imports: torch only.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Iterator, Optional, Sequence

import torch

__all__ = ["rank_seed", "init_rng", "rank_rng", "get_rng_state", "set_rng_state"]


def rank_seed(seed: int, rank: int) -> int:
    """The seed of rank ``rank``'s generator for the user seed ``seed`` (a 63-bit int).

    Seed a plain torch process with ``torch.manual_seed(rank_seed(seed, rank))``
    to draw what fzero's rank ``rank`` draws.
    """
    if not (isinstance(seed, int) and isinstance(rank, int) and rank >= 0):
        raise ValueError(f"rank_seed: seed must be an int and rank a non-negative int, got {seed!r}, {rank!r}")
    digest = hashlib.sha256(f"fzero:{seed}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def get_rng_state(device: torch.device) -> torch.Tensor:
    """The default generator's state for ``device`` (uint8, on the CPU)."""
    return torch.cuda.get_rng_state(device) if _is_cuda(device) else torch.get_rng_state()


def set_rng_state(state: torch.Tensor, device: torch.device) -> None:
    """Install ``state`` in ``device``'s default generator."""
    # a fresh CPU tensor: torch reads the state from the start of the storage, and a
    # row of the [R, n] state is a view into the middle of it (it crashed the process)
    state = state.detach().to("cpu", copy=True)
    if _is_cuda(device):
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def init_rng(seed: int, ranks: Sequence[int], device: torch.device) -> torch.Tensor:
    """``[R, n]`` uint8: the generator state of each of ``ranks`` for ``seed`` on ``device``."""
    states = []
    for r in ranks:
        g = torch.Generator(device=device)
        g.manual_seed(rank_seed(seed, r))
        states.append(g.get_state())
    return torch.stack(states)


@contextlib.contextmanager
def rank_rng(state: Optional[torch.Tensor], device: torch.device, out: list) -> Iterator[None]:
    """Install ``state`` (one rank's row) in ``device``'s default generator for the block;
    append the state the block leaves to ``out``; restore the caller's generator after.

    ``state=None``: nothing is installed (the block draws from the caller's generator).
    """
    if state is None:
        yield
        return
    saved = get_rng_state(device)
    set_rng_state(state, device)
    try:
        yield
        out.append(get_rng_state(device))
    finally:
        set_rng_state(saved, device)
