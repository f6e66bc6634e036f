"""Saves checkpoint ``first``, then saves ``second`` (the test kills it with SIGKILL meanwhile).

Usage: ckpt_kill_helper.py ROOT. The state is large (``big_state``: about 24 MB of
master and moments) so that writing ``second`` takes long enough to be killed
in the middle. ``first`` is the state ``big_state`` builds; ``second`` adds 1.
"""

from __future__ import annotations

import sys

import torch

import fzero
from fzero.checkpoint import save_checkpoint
from fzero.pytree import replace

NUMEL = 2_000_000


def big_state(comm: fzero.Communicator) -> fzero.TrainState:
    """Deterministic: init_train_state only copies the seeded values (no arithmetic)."""
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(NUMEL - 3, generator=g), "b": torch.randn(3, generator=g)}
    return fzero.init_train_state(params, fzero.adamw(), comm)


def main() -> None:
    root = sys.argv[1]
    comm = fzero.SimulatedWorld(2)
    state = big_state(comm)
    save_checkpoint(state, root, comm, name="first", extra={"tag": "first"})
    second = replace(state, shard=replace(state.shard, master=tuple(m + 1 for m in state.shard.master)))
    save_checkpoint(second, root, comm, name="second", extra={"tag": "second"})


if __name__ == "__main__":
    main()
