"""fzero: ZeRO-style sharded data-parallel training as pure functions.

The contract a user needs, every name below; the rest lives in its module
(``fzero.optim``, ``fzero.checkpoint``, ``fzero.comm``, ``fzero.dist``, ...).

States (immutable pytrees):
    :class:`TrainState` (everything a step carries; it knows its ZeRO stage),
    :class:`ShardState` (this rank's slice of the flat layout and its master copy),
    :class:`OptState` (moments, step count, hyperparameters as tensors),
    :class:`ScalerState` (the dynamic loss scale).
Building them:
    :func:`init_train_state` (from an ``nn.Module`` or a pytree of tensors, stage 1-3),
    :func:`init_shard`, :func:`init_opt_state`, :func:`init_scaler`, :func:`static_scaler`.
The pure pieces of a step, in the order a step calls them:
    :func:`loss_grads` (each rank's gradient of its scaled loss, reduced over ranks while
    backward runs), :func:`reduce_scatter_grads` (average over ranks, keep this rank's
    shard), :func:`unscale_and_clip` (one all-reduce agrees on norm, overflow and loss; one
    pass unscales and clips), :func:`shard_step` (the update rule on the master shard,
    skipped by selection on overflow), :func:`update_scale`, :func:`all_gather_params`;
    and for trees of gradients, :func:`scale` and :func:`unscale_and_check`.
Composed:
    :func:`make_train_step` (the pieces composed, eager or compiled, with accumulation,
    clipping, schedules, donation, replica checks), :func:`module_loss` (a loss from a
    module, its output and a criterion).
Communicators (collectives are their methods, passed in explicitly):
    :class:`Communicator` (the protocol), :class:`SimulatedWorld` (N ranks in one process);
    ``fzero.dist.TorchCommunicator`` runs on ``torch.distributed``.
Update rules (:class:`Optimizer` is the protocol):
    :func:`sgd`, :func:`adam`, :func:`adamw`, :func:`from_torch_optim` (any per-element
    ``torch.optim`` class), :func:`muon` with :func:`hidden_matrices`, :func:`adafactor`.
Mixed precision and schedules:
    :class:`MixedPrecision` (compute and reduce dtypes), :mod:`schedules`.
Checkpoints and weights:
    :func:`save_checkpoint`, :func:`load_checkpoint`, :func:`write_back` (the module gets
    the trained values), :func:`pretrained` (weights files loaded straight into the shards).
Errors:
    :class:`CollectiveError` (a collective that did not complete), :class:`ReplicaDivergenceError`
    (ranks that should agree do not), :class:`CheckpointError` (and its kinds in
    ``fzero.checkpoint``).
Memory:
    :func:`memory_report` (bytes per rank by kind, held and transient).
"""

from .comm import CollectiveError, Communicator, SimulatedWorld
from .memory import memory_report
from .optim import OptState, Optimizer, adam, adamw, init_opt_state, sgd
from .torch_optim_rules import from_torch_optim
from .muon_rules import hidden_matrices, muon
from .adafactor_rules import adafactor
from .precision import MixedPrecision
from .scaler import ScalerState, init_scaler, scale, static_scaler, unscale_and_check, unscale_and_clip, update_scale
from .sharding import ShardState, all_gather_params, init_shard, reduce_scatter_grads, shard_step
from . import schedules
from .replicas import ReplicaDivergenceError
from .weights import pretrained
from .state import TrainState, init_train_state
from .grads import loss_grads
from .step import make_train_step, module_loss

__version__ = "0.1.0"

# Checkpointing pulls in torch.distributed.checkpoint (slow to import): loaded on first use.
_CHECKPOINT_API = ("CheckpointError", "load_checkpoint", "save_checkpoint", "write_back")


def __getattr__(name: str):  # noqa: ANN202 - PEP 562 lazy attributes
    if name in _CHECKPOINT_API:
        from . import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module 'fzero' has no attribute {name!r}")


__all__ = [
    # states
    "TrainState",
    "ShardState",
    "OptState",
    "ScalerState",
    # building them
    "init_train_state",
    "init_shard",
    "init_opt_state",
    "init_scaler",
    "static_scaler",
    # the pure pieces of a step
    "loss_grads",
    "reduce_scatter_grads",
    "unscale_and_clip",
    "shard_step",
    "update_scale",
    "all_gather_params",
    "scale",
    "unscale_and_check",
    # composed
    "make_train_step",
    "module_loss",
    # communicators
    "Communicator",
    "SimulatedWorld",
    # update rules
    "Optimizer",
    "sgd",
    "adam",
    "adamw",
    "from_torch_optim",
    "muon",
    "hidden_matrices",
    "adafactor",
    # mixed precision, schedules
    "MixedPrecision",
    "schedules",
    # checkpoints, weights
    *_CHECKPOINT_API[1:],
    "pretrained",
    # errors
    "CollectiveError",
    "ReplicaDivergenceError",
    _CHECKPOINT_API[0],
    # memory
    "memory_report",
]
