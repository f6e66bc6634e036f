"""Checkpoints of a :class:`~fzero.state.TrainState` with ``torch.distributed.checkpoint`` (DCP). Modules:
:mod:`.saveload` (save, load), :mod:`.planners` (DCP planners, the calls into DCP), :mod:`.metadata` (``.metadata`` read
without running code, checked), :mod:`.checksums` (a CRC-32 per record), :mod:`.manifest` (what a checkpoint and a
state must agree on), :mod:`.publish` (atomic publication, ``LATEST``), :mod:`.background` (saves that do not stop
training: snapshot, writer thread), :mod:`.files` (regular files only, size limits, symlinks inside the root),
:mod:`.torch_optim` (``torch.optim`` interchange), :mod:`.offline` (info, verify, consolidate; ``python -m
fzero.checkpoint``), :mod:`.pretrained` (a ``save_pretrained`` directory, written by :mod:`.safetensors_out`). Every
failure to read a checkpoint is a :class:`CheckpointError` (a ``ValueError``) naming the file and entry.

Imports: background, errors, manifest, offline, pretrained, saveload, torch_optim, publish.
"""

from . import publish  # noqa: F401 - tests patch its functions
from .background import BackgroundSave
from .errors import (
                     CheckpointCorruptError,
                     CheckpointError,
                     CheckpointMismatchError,
                     CheckpointNotFoundError,
                     CheckpointOutputError,
                     IncompleteCheckpointError,
)
from .manifest import read_manifest, resolve_checkpoint
from .offline import (
                     checkpoint_info,
                     consolidate_checkpoint,
                     consolidate_model_state_dict,
                     consolidate_torch_optim_state_dict,
                     verify_checkpoint,
)
from .pretrained import export_pretrained
from .saveload import load_checkpoint, save_checkpoint
from .torch_optim import (
                     export_model_state_dict,
                     export_torch_optim_state_dict,
                     import_torch_optim_state_dict,
                     write_back,
)

__all__ = [
    "write_back", "CheckpointError", "IncompleteCheckpointError", "CheckpointNotFoundError",
    "CheckpointMismatchError", "CheckpointCorruptError", "CheckpointOutputError", "save_checkpoint", "load_checkpoint",
    "resolve_checkpoint", "read_manifest", "checkpoint_info", "verify_checkpoint", "consolidate_checkpoint",
    "consolidate_model_state_dict", "consolidate_torch_optim_state_dict", "export_model_state_dict",
    "export_torch_optim_state_dict", "import_torch_optim_state_dict", "export_pretrained",
    "BackgroundSave",
]
