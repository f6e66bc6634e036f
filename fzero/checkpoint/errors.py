"""The checkpoint errors, all ``ValueError`` subclasses (``except Exception:`` sees every failure to read a checkpoint;
DCP's ``CheckpointException``, a ``BaseException``, is converted where DCP is called: :mod:`.planners`).

Imports: none of fzero.
"""

from __future__ import annotations

__all__ = ["CheckpointError", "IncompleteCheckpointError", "CheckpointNotFoundError", "CheckpointMismatchError",
           "CheckpointCorruptError", "CheckpointOutputError"]


class CheckpointError(ValueError):
    """A checkpoint cannot be read or loaded into the given state."""


class IncompleteCheckpointError(CheckpointError):
    """The checkpoint is missing its metadata or data (an interrupted save, a damaged copy)."""


class CheckpointNotFoundError(IncompleteCheckpointError, FileNotFoundError):
    """There is no checkpoint at the path (also a ``FileNotFoundError``)."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint belongs to another model, optimizer, scaler or precision policy."""


class CheckpointCorruptError(CheckpointError):
    """The checkpoint's bytes are damaged (a checksum differs, a record cannot be decoded); the message
    names the checkpoint directory, the data file and the entry."""


class CheckpointOutputError(CheckpointError):
    """A file consolidating a checkpoint cannot be written (the message names it)."""


def corrupt(d: object, what: str) -> CheckpointCorruptError:
    """``CheckpointCorruptError("corrupt checkpoint {d}: {what}")``."""
    return CheckpointCorruptError(f"corrupt checkpoint {d}: {what}")
