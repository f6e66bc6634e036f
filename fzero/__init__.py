"""fzero: ZeRO-style sharded data-parallel training as pure functions. The contract a user needs, every name below; the
rest lives in its module (``fzero.optim``, ``fzero.checkpoint``, ``fzero.comm``, ``fzero.dist``, ...).

States (immutable pytrees; ``state.replace(...)`` gives a changed copy): :class:`TrainState` (everything a step carries;
it knows its ZeRO stage), :class:`ShardState` (this rank's slice of the flat layout and its master copy),
:class:`OptState` (moments, step count, hyperparameters as tensors), :class:`ScalerState` (the dynamic loss scale).
Building them: :func:`init_train_state` (from an ``nn.Module`` or a pytree of tensors, stage 1-3), :func:`init_shard`,
:func:`init_scaler`, :func:`static_scaler`.

The pieces of a step, in the order a step calls them: per micro-batch :func:`loss_grads` (forward, the loss
:func:`scale`-d, backward, each bucket handed to :func:`reduce_scatter_grads` as backward completes it) and
:func:`accumulate`; then :func:`unscale_and_check` (one all-reduce agrees on norm, overflow and loss; one pass unscales
and clips), :func:`shard_step` (the update rule on the master shard, skipped by selection on overflow),
:func:`all_gather_params`, :func:`update_scale`. :func:`micro_batch` cuts a batch; :func:`full_params` gives every
parameter in the model's structure.

Composed: :func:`make_train_step` (the pieces composed, with accumulation, clipping, schedules, donation, replica
checks), :func:`bind_step` (a composed step given its communicator and workspace, eager or compiled),
:func:`module_loss` (a loss from a module and a criterion).

Communicators (collectives are their methods, passed in explicitly): :class:`Communicator` (the protocol),
:class:`SimulatedWorld` (N ranks in one process, flat or a mesh); ``fzero.dist.TorchCommunicator`` runs on
``torch.distributed``; ``fzero.quantized.QuantizedCommunicator`` wraps either (ZeRO++'s qwZ and qgZ). Update
rules (:class:`Optimizer` is the protocol): :func:`sgd`, :func:`adam`, :func:`adamw`, :func:`from_torch_optim` (any
per-element ``torch.optim`` class), :func:`muon`, :func:`adafactor`. Mixed precision and schedules:
:class:`MixedPrecision` (compute and reduce dtypes), :mod:`schedules`.

Checkpoints and weights: :func:`save_checkpoint`, :func:`load_checkpoint`, :func:`write_back` (the module gets the
trained values), :func:`pretrained` (weights files loaded straight into the shards). Errors: :class:`CollectiveError` (a
collective that did not complete), :class:`ReplicaDivergenceError` (ranks that should agree do not),
:class:`CheckpointError` (and its kinds in ``fzero.checkpoint``). Memory: :func:`memory_report` (bytes per rank: the
ZeRO formula of the layout and the step's buffers)."""

from . import schedules
from .adafactor_rules import adafactor
from .comm import CollectiveError, Communicator, SimulatedWorld
from .compiled import bind_step
from .grads import accumulate, loss_grads, micro_batch
from .memory import memory_report
from .muon_rules import muon
from .optim import Optimizer, OptState, adam, adamw, sgd
from .precision import MixedPrecision
from .replicas import ReplicaDivergenceError
from .scaler import ScalerState, init_scaler, scale, static_scaler, unscale_and_check, update_scale
from .sharding import ShardState, all_gather_params, full_params, init_shard, reduce_scatter_grads, shard_step
from .state import TrainState, init_train_state
from .step import make_train_step, module_loss
from .torch_optim_rules import from_torch_optim
from .weights import pretrained

__version__ = "0.1.0"

# Checkpointing pulls in torch.distributed.checkpoint (slow to import): loaded on first use.
_CHECKPOINT_API = ("CheckpointError", "load_checkpoint", "save_checkpoint", "write_back")


def __getattr__(name: str):  # noqa: ANN202 - PEP 562 lazy attributes
    if name in _CHECKPOINT_API:
        from . import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module 'fzero' has no attribute {name!r}")


__all__ = [
    "TrainState", "ShardState", "OptState", "ScalerState",  # states
    "init_train_state", "init_shard", "init_scaler", "static_scaler",  # building them
    "scale", "loss_grads", "reduce_scatter_grads", "accumulate", "unscale_and_check", "shard_step",  # the pieces
    "all_gather_params", "update_scale", "micro_batch", "full_params",
    "make_train_step", "bind_step", "module_loss",  # composed
    "Communicator", "SimulatedWorld",  # communicators
    "Optimizer", "sgd", "adam", "adamw", "from_torch_optim", "muon", "adafactor",  # update rules
    "MixedPrecision", "schedules",  # mixed precision, schedules
    *_CHECKPOINT_API[1:], "pretrained",  # checkpoints, weights
    "CollectiveError", "ReplicaDivergenceError", _CHECKPOINT_API[0],  # errors
    "memory_report",  # memory
]
