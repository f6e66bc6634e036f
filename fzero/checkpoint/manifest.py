"""The manifest (what must agree between a checkpoint and the state it loads into), and the
checks of a checkpoint directory before any data are read.

``fzero/manifest`` is a JSON object entry: per parameter (tree order) path, shape, dtype
and optimizer group; the optimizer's kind, flags, moments and groups; the scaler's
configuration; the precision policy; and, for information only, the world size, the
stage kind and the tree structure. Loading compares it with the template state before
reading anything else and names the first difference (:class:`CheckpointMismatchError`).
DCP writes ``.metadata`` last; :func:`checked_metadata` requires it, every data file it
names, each long enough, and fails with :class:`IncompleteCheckpointError` otherwise.

Imports: :mod:`fzero.step` (the state), :mod:`fzero.checkpoint.planners`,
:mod:`fzero.checkpoint.publish`, :mod:`fzero.checkpoint.errors`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from ..comm import Communicator
from ..step import TrainState
from .errors import CheckpointMismatchError, CheckpointNotFoundError, IncompleteCheckpointError
from .planners import _Pieces, dcp_load
from .publish import LATEST, _read_latest

FORMAT = "fzero-checkpoint"
VERSION = 1
MANIFEST_KEY = "fzero/manifest"

PathLike = Union[str, os.PathLike]

def _dtype_name(dtype: Optional[torch.dtype]) -> Optional[str]:
    return None if dtype is None else str(dtype)


def _manifest(state: TrainState, comm: Communicator) -> dict[str, Any]:
    """What must agree between a checkpoint and the state it loads into, as JSON values.

    Per parameter (tree order): path, shape, dtype, optimizer group (-1: frozen).
    Not the flat groups, buckets, alignment or world size: they only decide where
    the data sit in the buffers, and checkpoints are keyed by parameter. Then the
    optimizer's kind, flags, moments and groups; the scaler's configuration; the
    precision policy. ``saved_world_size`` and ``structure`` are information only.
    """
    lay, opt, sc, prec = state.layout, state.opt.optimizer, state.scaler, state.precision
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "params": [
            [s.path, list(s.shape), str(s.dtype), lay.groups[s.group].opt_group if s.group >= 0 else -1]
            for s in lay.slots
        ],
        "optimizer": {
            "kind": opt.kind,
            "nesterov": opt.nesterov,
            "maximize": opt.maximize,
            "amsgrad": opt.amsgrad,
            "momentum_buffer": opt.momentum_buffer,
            "moment_names": list(opt.moment_names),
            "num_groups": opt.num_groups,
            "hyperparameters": [sorted(h) for h in state.opt.hyper],
        },
        "scaler": {
            "dynamic": sc.dynamic,
            "growth_factor": sc.growth_factor,
            "backoff_factor": sc.backoff_factor,
            "growth_interval": sc.growth_interval,
            "min_scale": sc.min_scale,
            "hysteresis": sc.hysteresis,
        },
        "precision": {
            "param_dtype": _dtype_name(prec.param_dtype),
            "reduce_dtype": _dtype_name(prec.reduce_dtype),
        },
        # the module's persistent buffers (rank 0's are saved) and how to rebuild its
        # state_dict (tied names, key order): what the offline tools need
        "module": {
            "buffers": [
                [n, list(b.shape[1:]), str(b.dtype)]
                for n, b, keep in zip(state.module.buffers, state.buffers, state.module.persistent) if keep
            ],
            "aliases": [list(a) for a in state.module.aliases],
            "state_dict_keys": list(state.module.state_dict_keys),
        },
        "structure": str(lay.spec),
        "saved_world_size": comm.world_size,
        # Stage 3 keeps no gathered parameters between steps; stages 1 and 2 hold the same state.
        "saved_stage": "3" if not len(state.params) else "1 or 2",
    }
    return json.loads(json.dumps(manifest))  # tuples become lists, as they are read back


def _params_difference(saved: Sequence[Sequence[Any]], mine: Sequence[Sequence[Any]]) -> Optional[str]:
    for i, (a, b) in enumerate(zip(saved, mine)):
        if a[0] != b[0]:
            return f"parameter #{i} is {a[0]!r} vs {b[0]!r}"
        for field, u, v in zip(("shape", "dtype", "optimizer group (-1: frozen)"), a[1:], b[1:]):
            if u != v:
                u, v = (tuple(u), tuple(v)) if field == "shape" else (u, v)
                return f"parameter {a[0]!r}: {field} {u} vs {v}"
    if len(saved) != len(mine):
        longer = saved if len(saved) > len(mine) else mine
        first_extra = longer[min(len(saved), len(mine))][0]
        return f"parameter count {len(saved)} vs {len(mine)}; first extra: {first_extra!r}"
    return None


def _manifest_difference(saved: Mapping[str, Any], mine: Mapping[str, Any]) -> Optional[str]:
    """The first difference between a checkpoint's manifest and a state's, or None.

    Order: format, model (parameters in order: path, shape, dtype, optimizer
    group), optimizer, scaler, precision. Values read "checkpoint vs this state".
    """
    if saved.get("format") != FORMAT:
        return f"not an fzero checkpoint (format {saved.get('format')!r})"
    if saved.get("version", 0) > VERSION:
        return f"written by a newer fzero (format version {saved['version']}; this one reads {VERSION})"
    diff = _params_difference(saved["params"], mine["params"])
    if diff is not None:
        return f"model: {diff}"
    theirs = {b[0]: b for b in saved.get("module", {}).get("buffers", [])}
    for b in mine["module"]["buffers"]:
        if b[0] not in theirs:
            return f"model: buffer {b[0]!r} is not in the checkpoint"
        if theirs[b[0]] != b:
            return f"model: buffer {b[0]!r}: {theirs[b[0]][1:]} vs {b[1:]}"
    for section in ("optimizer", "scaler", "precision"):
        for key, value in mine[section].items():  # in _manifest's order: kind before details
            if saved[section].get(key) != value:
                return f"{section} {key}: {saved[section].get(key)!r} vs {value!r}"
    return None


def resolve_checkpoint(path: PathLike) -> Path:
    """The checkpoint directory ``path`` designates: ``path/LATEST``'s target when
    ``path`` is a root, else ``path`` itself. Raises :class:`IncompleteCheckpointError`
    when it has no DCP ``.metadata`` (written last, so its absence means the save
    did not finish) and :class:`CheckpointNotFoundError` (a ``FileNotFoundError`` too)
    when ``path`` does not exist."""
    p = Path(path)
    if not p.exists():
        raise CheckpointNotFoundError(f"no checkpoint at {p}: the path does not exist")
    name = _read_latest(p) if p.is_dir() else None
    d = p / name if name is not None else p
    if name is not None and not d.is_dir():
        raise IncompleteCheckpointError(f"{p / LATEST} names {name!r}, but {d} does not exist")
    if not (d / ".metadata").is_file():
        if name is None and not any(d.glob("*.distcp")):
            raise IncompleteCheckpointError(
                f"no checkpoint at {d}: neither a {LATEST} file nor a DCP .metadata file"
            )
        raise IncompleteCheckpointError(
            f"incomplete checkpoint {d}: no .metadata file (DCP writes it last: the save did not finish)"
        )
    return d


def _read_metadata(d: Path) -> Metadata:
    try:
        return dcp.FileSystemReader(d).read_metadata()
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the same thing
        raise IncompleteCheckpointError(f"incomplete checkpoint {d}: unreadable .metadata ({e})") from e


def _check_data_files(d: Path, metadata: Metadata) -> None:
    """Every data file the metadata names exists and holds every byte range it lists."""
    need: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for rel, size in sorted(need.items()):
        f = d / rel
        if not f.is_file():
            raise IncompleteCheckpointError(f"incomplete checkpoint {d}: data file {rel} is missing")
        have = f.stat().st_size
        if have < size:
            raise IncompleteCheckpointError(
                f"incomplete checkpoint {d}: data file {rel} is truncated ({have} bytes, the metadata "
                f"needs {size})"
            )


def read_manifest(path: PathLike) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path`` (a root or a checkpoint directory).

    Reads only the metadata and the manifest entry, in this process (no collective).
    Raises :class:`IncompleteCheckpointError` for an incomplete checkpoint and
    :class:`CheckpointMismatchError` for a DCP checkpoint that fzero did not write.
    """
    d, metadata = checked_metadata(path)
    return _read_manifest(d, metadata)


def checked_metadata(path: PathLike) -> tuple[Path, Metadata]:
    """The checkpoint directory ``path`` designates and its DCP metadata, once ``.metadata``
    and every data file it names are there, each long enough."""
    d = resolve_checkpoint(path)
    metadata = _read_metadata(d)
    _check_data_files(d, metadata)
    return d, metadata


def _read_manifest(d: Path, metadata: Metadata) -> dict[str, Any]:
    if not isinstance(metadata.state_dict_metadata.get(MANIFEST_KEY), BytesStorageMetadata):
        raise CheckpointMismatchError(f"{d} is a DCP checkpoint without a manifest: not an fzero checkpoint")
    box: dict[str, Any] = {MANIFEST_KEY: None}
    dcp_load(box, d, None)  # this process only: every rank validates on its own, no collective
    return json.loads(box[MANIFEST_KEY])


def _check_entries(d: Path, metadata: Metadata, wanted: Mapping[str, Any]) -> None:
    """Every entry ``wanted`` reads is in the checkpoint, with its size and dtype."""
    saved = metadata.state_dict_metadata
    for key, obj in wanted.items():
        md = saved.get(key)
        if md is None:
            raise IncompleteCheckpointError(f"incomplete checkpoint {d}: it has no entry {key!r}")
        if isinstance(obj, (torch.Tensor, _Pieces)):
            if not isinstance(md, TensorStorageMetadata):
                raise CheckpointMismatchError(f"checkpoint {d}: entry {key!r} is not a tensor")
            if tuple(md.size) != tuple(obj.size()) or md.properties.dtype != obj.dtype:
                raise CheckpointMismatchError(
                    f"checkpoint {d}: entry {key!r} is {md.properties.dtype}{list(md.size)}, this "
                    f"state needs {obj.dtype}{list(obj.size())}"
                )
