"""Checkpoints of a :class:`~fzero.state.TrainState` with ``torch.distributed.checkpoint``
(DCP), their verification and consolidation without the training job, and interchange
with ``torch.optim`` state dicts.

One module per concept:

* :mod:`.saveload`: :func:`save_checkpoint`, :func:`load_checkpoint`; the state as a flat
  DCP state dict (per-parameter keys, so a checkpoint moves between world sizes and
  stages 1, 2 and 3; replicated entries; the caller's ``extra``).
* :mod:`.planners`: DCP planners for uneven 1-D pieces, the calls into DCP, and the
  conversion of DCP's ``BaseException`` into :class:`CheckpointError`.
* :mod:`.metadata`: DCP's ``.metadata`` read without running code (an allow-list of its
  types) and checked before anything trusts it.
* :mod:`.checksums`: a CRC-32 of every record, taken while writing, checked while reading;
  ``checksums.json`` binds the records, the step, the name and the metadata's digest.
* :mod:`.manifest`: what must agree between a checkpoint and a state; the checks of a
  checkpoint directory; :func:`resolve_checkpoint`, :func:`read_manifest`.
* :mod:`.publish`: atomic publication (``.tmp-{name}``, rename, ``LATEST``) and the
  coordination of ranks around it.
* :mod:`.torch_optim`: :func:`export_model_state_dict`, :func:`export_torch_optim_state_dict`,
  :func:`import_torch_optim_state_dict`.
* :mod:`.offline`: :func:`checkpoint_info`, :func:`verify_checkpoint`,
  :func:`consolidate_checkpoint` and the state dicts it writes, in one process with no
  process group; the command line ``python -m fzero.checkpoint {info,verify,consolidate}``.

Errors: every failure to read a checkpoint is a :class:`CheckpointError` (a ``ValueError``)
naming the file and the entry:
:class:`IncompleteCheckpointError` (and :class:`CheckpointNotFoundError`, also a
``FileNotFoundError``), :class:`CheckpointMismatchError`, :class:`CheckpointCorruptError`.
"""

from .errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
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
from .saveload import load_checkpoint, save_checkpoint
from .torch_optim import (
    export_model_state_dict,
    export_torch_optim_state_dict,
    import_torch_optim_state_dict,
    write_back,
)
from . import publish  # noqa: F401 - tests patch its functions

__all__ = [
    "write_back",
    "CheckpointError",
    "IncompleteCheckpointError",
    "CheckpointNotFoundError",
    "CheckpointMismatchError",
    "CheckpointCorruptError",
    "save_checkpoint",
    "load_checkpoint",
    "resolve_checkpoint",
    "read_manifest",
    "checkpoint_info",
    "verify_checkpoint",
    "consolidate_checkpoint",
    "consolidate_model_state_dict",
    "consolidate_torch_optim_state_dict",
    "export_model_state_dict",
    "export_torch_optim_state_dict",
    "import_torch_optim_state_dict",
]
