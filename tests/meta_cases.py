"""Models built on the meta device and their eager twins, and short stage-3 runs that run
unchanged on the simulated world and on gloo ranks (``meta_init_worker.py``).

The rule the comparisons rest on (README, "Models larger than one rank"): the init draws
from the global generator in ``model.apply``'s order, so a meta model filled by ``init``
equals the eager model initialised the same way from the same generator state.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F

import fzero
import user_models as um

STEPS = 2


class Block(torch.nn.Module):
    """Linear, BatchNorm (persistent buffers, reset by reset_parameters), tanh, Linear."""

    def __init__(self, d: int):
        super().__init__()
        self.inp = torch.nn.Linear(d, 2 * d)
        self.bn = torch.nn.BatchNorm1d(2 * d)
        self.out = torch.nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.tanh(self.bn(self.inp(x))))


def chain(d: int = 8, depth: int = 3, classes: int = 3) -> torch.nn.Sequential:
    """A plain module: a stem, ``depth`` blocks, a head (units: the blocks)."""
    return torch.nn.Sequential(torch.nn.Linear(4, d), *[Block(d) for _ in range(depth)], torch.nn.Linear(d, classes))


def chain_units(name: str, module: torch.nn.Module) -> bool:
    return isinstance(module, Block)


def hf_units(kind: str) -> tuple[type, ...]:
    if kind == "gpt2":
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        return (GPT2Block,)
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return (LlamaDecoderLayer,)


def build(kind: str, seed: int = 0) -> torch.nn.Module:
    """The model ``kind`` built eagerly from ``seed`` (on the meta device under ``torch.device("meta")``)."""
    if kind == "chain":
        torch.manual_seed(seed)
        return chain()
    return um.gpt2(seed=seed) if kind == "gpt2" else um.llama(seed=seed)


def units_of(kind: str) -> Any:
    return chain_units if kind == "chain" else hf_units(kind)


def init_of(kind: str, model: torch.nn.Module) -> Any:
    """The init used for ``kind``: torch's own reset_parameters, or transformers' _init_weights."""
    return "reset_parameters" if kind == "chain" else model._init_weights


INIT_SEED = 11


def eager_model(kind: str) -> torch.nn.Module:
    """The eager twin: built, then initialised as the meta model will be, from ``INIT_SEED``.

    The chain is just built from ``INIT_SEED`` (construction runs reset_parameters in
    ``apply`` order); the transformers models are built from another seed and then given
    ``model.apply(model._init_weights)`` from ``INIT_SEED``."""
    if kind == "chain":
        return build(kind, INIT_SEED)
    model = build(kind, seed=1)
    torch.manual_seed(INIT_SEED)
    model.apply(model._init_weights)
    return model


def meta_model(kind: str) -> torch.nn.Module:
    with torch.device("meta"):
        return build(kind)


def data(kind: str, world: int) -> list:
    if kind == "chain":
        g = torch.Generator().manual_seed(4)
        return [(torch.randn(2 * world, 4, generator=g), torch.randint(0, 3, (2 * world,), generator=g))
                for _ in range(STEPS)]
    return [um.as_labels_batch(b) for b in um.token_batches(STEPS, 2 * world)]


def loss_of(kind: str, model: torch.nn.Module) -> fzero.grads.LossFn:
    return fzero.module_loss(model, F.cross_entropy) if kind == "chain" else fzero.module_loss(model)


def train(kind: str, model: torch.nn.Module, comm: fzero.Communicator, init: Any = None, stage: int = 3,
          steps: int = STEPS) -> tuple[fzero.TrainState, list[float]]:
    """``init_train_state`` (the init drawn from ``INIT_SEED`` when it is random) and ``steps`` steps."""
    torch.manual_seed(INIT_SEED)
    state = fzero.init_train_state(model, fzero.adamw(lr=1e-2), comm, stage=stage,
                                   units=units_of(kind) if stage == 3 else None, init=init)
    step = fzero.make_train_step(loss_of(kind, model), comm)
    losses = []
    for batch in data(kind, comm.world_size)[:steps]:
        state, m = step(state, comm.split_batch(batch))
        losses.append(float(m["loss"]))
    return state, losses


def meta_run(kind: str, comm: fzero.Communicator) -> dict:
    model = meta_model(kind)
    state, losses = train(kind, model, comm, init=init_of(kind, model))
    return {"masters": [m.clone() for m in state.shard.master], "buffers": [b.clone() for b in state.buffers],
            "losses": losses, "meta": all(p.is_meta for p in model.parameters())}


def saved_checkpoint(kind: str, how: str, folder: str) -> str:
    """Save the model ``kind`` built from seed 3 into ``folder``: ``save_pretrained`` (one file or,
    ``"sharded"``, several and an index) or ``torch.save(model.state_dict())``. Returns the path."""
    src = build(kind, seed=3)
    if how == "torch":
        path = os.path.join(folder, "model.pt")
        torch.save(src.state_dict(), path)
        return path
    if kind == "chain":
        from safetensors.torch import save_file

        path = os.path.join(folder, "model.safetensors")
        save_file(src.state_dict(), path)
        return path
    src.save_pretrained(folder, max_shard_size="8KB" if how == "sharded" else "1GB")
    return folder


def loaded_full_model(kind: str, path: str) -> torch.nn.Module:
    """The reference: an eager model of another seed given the checkpoint by ``load_state_dict``."""
    model = build(kind, seed=9)
    sd = torch.load(path, weights_only=True) if path.endswith(".pt") else _read_safetensors(path)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    # save_pretrained leaves out tied names (GPT-2's lm_head.weight); load_state_dict fills
    # them through the tie
    assert not unexpected and set(missing) <= {a for a, _ in _aliases(model)}, (missing, unexpected)
    return model


def _aliases(model: torch.nn.Module) -> list[tuple[str, str]]:
    from fzero.module import module_spec

    return list(module_spec(model).aliases)


def _read_safetensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if os.path.isfile(path):
        return load_file(path)
    out: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, name)))
    return out


def pretrained_run(kind: str, comm: fzero.Communicator, path: str) -> dict:
    """Load the checkpoint at ``path`` into a meta model and train a few steps."""
    model = meta_model(kind)
    state, losses = train(kind, model, comm, init=fzero.pretrained(path))
    return {"masters": [m.clone() for m in state.shard.master], "buffers": [b.clone() for b in state.buffers],
            "losses": losses}


def different_seeds(comm: fzero.Communicator) -> str:
    """Ranks that seeded their generators differently: the random init must refuse (every rank)."""
    model = meta_model("chain")
    torch.manual_seed(100 + comm.rank)
    try:
        fzero.init_train_state(model, fzero.adamw(lr=1e-2), comm, stage=3, units=chain_units,
                               init="reset_parameters")
    except ValueError as e:
        return str(e)
    return ""


def one_rank_fails(comm: fzero.Communicator, folder: str) -> str:
    """Rank 0 has the file, rank 1 does not: every rank raises (no rank waits in a collective)."""
    path = saved_checkpoint("chain", "torch", folder) if comm.rank == 0 else os.path.join(folder, "missing.pt")
    try:
        fzero.init_train_state(meta_model("chain"), fzero.adamw(lr=1e-2), comm, stage=3, units=chain_units,
                               init=fzero.pretrained(path))
    except ValueError as e:
        return str(e)
    return ""
