"""Randomness as state: ``init_train_state(..., seed=s)`` gives rank ``r`` the state of
``torch.Generator().manual_seed(rank_seed(s, r))`` on the parameters' device, in ``TrainState.rng`` (``[R, n]`` uint8,
on the host where torch keeps generator states, CUDA's included).
Eagerly the step installs rank ``r``'s state for its forward and backward and keeps what it leaves: a rank's masks
depend only on ``(s, r)`` and the draws before them, alike in a simulated world, on real ranks and in plain torch.
Dynamo cannot trace ``set_rng_state``: a compiled step installs row 0's state around the call (exact on a real rank; a
compiled simulated world's ranks all draw from that stream, with a warning).

Imports: none of fzero.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Sequence

import torch

__all__ = ["rank_seed", "init_rng", "rank_rng", "get_rng_state", "set_rng_state"]


def rank_seed(seed: int, rank: int) -> int:
    """Rank ``rank``'s generator seed (63 bits) for the user seed ``seed``, as ``torch.manual_seed`` takes it."""
    if not (isinstance(seed, int) and isinstance(rank, int) and rank >= 0):
        raise ValueError(f"rank_seed: seed must be an int and rank a non-negative int, got {seed!r}, {rank!r}")
    digest = hashlib.sha256(f"fzero:{seed}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def get_rng_state(device: torch.device) -> torch.Tensor:
    """The default generator's state for ``device`` (uint8, on the CPU)."""
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def set_rng_state(state: torch.Tensor, device: torch.device) -> None:
    """Install ``state`` in ``device``'s default generator."""
    # a fresh CPU tensor: torch reads the state from its storage's start, a row of [R, n] is a view mid-storage
    state = state.detach().to("cpu", copy=True)
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def init_rng(seed: int, ranks: Sequence[int], device: torch.device) -> torch.Tensor:
    """``[R, n]`` uint8 on the CPU: the generator state of each of ``ranks`` for ``seed`` on ``device`` (a CUDA
    generator's state is host bytes, its seed and offset, as torch gives and takes it: kept there, installing it
    before a forward copies nothing from the device; a device without generators, such as meta, takes the CPU's)."""
    device = torch.device(device)
    kind = device if device.type == "cuda" else torch.device("cpu")
    return torch.stack([torch.Generator(device=kind).manual_seed(rank_seed(seed, r)).get_state() for r in ranks])


@contextlib.contextmanager
def rank_rng(state: torch.Tensor | None, device: torch.device, out: list) -> Iterator[None]:
    """Install ``state`` (one rank's row) in ``device``'s default generator for the block, append the
    state the block leaves to ``out``, restore the caller's generator after. ``None``: install nothing."""
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
