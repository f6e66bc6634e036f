"""fzero: ZeRO-style sharded data-parallel training as pure functions.

States (immutable pytrees): :class:`ScalerState`, :class:`ShardState`,
:class:`OptState`, :class:`TrainState`. Pure functions: :func:`scale`,
:func:`unscale_and_check`, :func:`update_scale`, :func:`reduce_scatter_grads`,
:func:`shard_step`, :func:`all_gather_params`, composed by
:func:`make_train_step`. Update rules follow one protocol, :class:`Optimizer`
(built-ins :func:`sgd`, :func:`adam`, :func:`adamw`; a user's rule is a subclass;
:func:`from_torch_optim` runs any per-element ``torch.optim`` class on the shards;
:func:`muon` runs ``torch.optim.Muon`` on the matrices and AdamW on the rest;
:func:`adafactor` runs ``torch.optim.Adafactor``).
Collectives are methods of a communicator passed in
explicitly: :class:`SimulatedWorld` (N ranks in one process) or
:class:`fzero.dist.TorchCommunicator` (``torch.distributed``).
"""

from .comm import (
    CollectiveError,
    CollectiveRecord,
    Communicator,
    CountingCommunicator,
    SimulatedWorld,
    gradient_divide_factors,
)
from .layout import FlatGroup, Layout, ParamSlot, build_layout
from .memory import MemoryReport, format_memory_table, memory_report, zero_paper_bytes
from .optim import (
    Adam,
    OptState,
    Optimizer,
    ParamGroup,
    Piece,
    SGD,
    adam,
    adamw,
    init_opt_state,
    no_weight_decay,
    no_weight_decay_for,
    hyper_scalars,
    set_hyperparams,
    sgd,
)
from .torch_optim_rules import TorchOptimRule, from_torch_optim
from .muon_rules import Muon, hidden_matrices, muon, muon_owners
from .adafactor_rules import Adafactor, adafactor
from .precision import MixedPrecision, native_bf16
from .pytree import NAMESPACE, tree_map
from .scaler import ScalerState, init_scaler, scale, static_scaler, unscale_and_check, update_scale
from .sharding import (
    ShardState,
    all_gather_params,
    gather_flat_params,
    global_norm,
    init_shard,
    reduce_scatter_grads,
    shard_step,
)
from . import schedules
from .module import ModuleSpec, model_output
from .replicas import ReplicaDivergenceError, check_replicas, replicas_differ
from .rng import rank_seed
from .weights import Pretrained, WeightsFileError, pretrained
from .units import UnitCallError
from .step import (
    TrainState,
    check_batch,
    consume,
    ensure_live,
    init_train_state,
    make_train_step,
    module_loss,
)

__version__ = "0.1.0"

# Checkpointing pulls in torch.distributed.checkpoint (slow to import): loaded on first use.
_CHECKPOINT_API = (
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "IncompleteCheckpointError",
    "checkpoint_info",
    "consolidate_checkpoint",
    "consolidate_model_state_dict",
    "consolidate_torch_optim_state_dict",
    "export_model_state_dict",
    "export_torch_optim_state_dict",
    "import_torch_optim_state_dict",
    "load_checkpoint",
    "read_manifest",
    "resolve_checkpoint",
    "save_checkpoint",
    "verify_checkpoint",
    "write_back",
)


def __getattr__(name: str):  # noqa: ANN202 - PEP 562 lazy attributes
    if name in _CHECKPOINT_API:
        from . import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module 'fzero' has no attribute {name!r}")

__all__ = [
    *_CHECKPOINT_API,
    "NAMESPACE",
    "CollectiveError",
    "CollectiveRecord",
    "Communicator",
    "CountingCommunicator",
    "FlatGroup",
    "Layout",
    "MemoryReport",
    "MixedPrecision",
    "ModuleSpec",
    "OptState",
    "ReplicaDivergenceError",
    "UnitCallError",
    "Optimizer",
    "Adam",
    "SGD",
    "Piece",
    "TorchOptimRule",
    "from_torch_optim",
    "Adafactor",
    "adafactor",
    "Muon",
    "muon",
    "muon_owners",
    "hidden_matrices",
    "hyper_scalars",
    "ParamGroup",
    "ParamSlot",
    "Pretrained",
    "WeightsFileError",
    "ScalerState",
    "ShardState",
    "SimulatedWorld",
    "TrainState",
    "check_batch",
    "consume",
    "model_output",
    "rank_seed",
    "ensure_live",
    "adam",
    "adamw",
    "all_gather_params",
    "build_layout",
    "check_replicas",
    "format_memory_table",
    "gather_flat_params",
    "global_norm",
    "gradient_divide_factors",
    "init_opt_state",
    "init_scaler",
    "init_shard",
    "init_train_state",
    "make_train_step",
    "memory_report",
    "module_loss",
    "native_bf16",
    "no_weight_decay",
    "no_weight_decay_for",
    "pretrained",
    "reduce_scatter_grads",
    "replicas_differ",
    "scale",
    "schedules",
    "set_hyperparams",
    "sgd",
    "shard_step",
    "static_scaler",
    "tree_map",
    "unscale_and_check",
    "update_scale",
    "zero_paper_bytes",
]
