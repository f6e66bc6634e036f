"""The checkpoint errors, all ``ValueError`` subclasses (``except Exception:`` sees every failure to read a checkpoint;
DCP's ``CheckpointException``, a ``BaseException``, is converted where DCP is called: :mod:`.planners`).

Imports: none of fzero.
"""

from __future__ import annotations

import itertools
from typing import Any

__all__ = ["CheckpointError", "IncompleteCheckpointError", "CheckpointNotFoundError", "CheckpointMismatchError",
           "CheckpointCorruptError", "CheckpointOutputError", "shown", "SHOWN_LIMIT", "refuse_param_groups"]

# characters of a value an error message shows: a checkpoint's values are untrusted, and a message that printed one in
# full could be megabytes long (a name of ten million characters) or never finish (a structure of shared references)
SHOWN_LIMIT = 200


class CheckpointError(ValueError):
    """A checkpoint cannot be read or loaded into the given state."""


def refuse_param_groups(layout: Any, what: str) -> None:
    """``ValueError`` if ``layout`` has parameter groups (``init_train_state(groups=)``): what ``what`` writes or
    reads (a ``torch.optim`` state dict, a live export piece by piece) names parameters by their paths alone, which
    for a group's parameters differ in meaning between rank groups; checkpoints hold them by their saved shape."""
    axes = getattr(layout, "axes", ())
    if axes:
        raise ValueError(f"{what}: this state has parameter groups ({', '.join(repr(a[0]) for a in axes)}), which "
                         "this does not support yet; save a checkpoint (save_checkpoint) and consolidate or export "
                         "it, or take export_model_state_dict's whole model")


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


def shown(value: Any, limit: int = SHOWN_LIMIT) -> str:
    """A ``repr`` of ``value`` cut to about ``limit`` characters, in time bounded by ``limit`` whatever ``value`` is:
    strings and bytes are cut before they are quoted, containers show their first items to a depth of two, integers
    too long to print are shown by their size, anything else by its type name (its ``repr`` is not called)."""
    text = _shown(value, 2, limit + 1)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_ITEMS = 4  # a container shows its first few items and how many there are


def _shown(value: Any, depth: int, budget: int) -> str:
    if value is None or isinstance(value, (bool, float)):
        return repr(value)
    if isinstance(value, int):
        return repr(value) if value.bit_length() <= 256 else f"<an int of {value.bit_length()} bits>"
    if isinstance(value, (str, bytes)):
        return repr(value[:budget]) + ("..." if len(value) > budget else "")
    if isinstance(value, (list, tuple, dict)):
        kind = type(value).__name__
        if depth == 0 or not value:
            return f"<a {kind} of {len(value)} items>" if value else ("()" if kind == "tuple" else repr(type(value)()))
        items = list(itertools.islice(value.items() if isinstance(value, dict) else value, _ITEMS))
        if isinstance(value, dict):
            parts = [f"{_shown(k, depth - 1, budget)}: {_shown(v, depth - 1, budget)}" for k, v in items]
        else:
            parts = [_shown(v, depth - 1, budget) for v in items]
        more = f", ... ({len(value)} items)" if len(value) > _ITEMS else ""
        opening, closing = {"list": "[]", "dict": "{}"}.get(kind, "()")
        return f"{opening}{', '.join(parts)}{more}{closing}"[: budget + 1]
    return f"<a {type(value).__name__}>"
