"""A checkpoint without the training job: its description, the check of every checksum, and its consolidation into
plain ``torch`` state dicts (DeepSpeed's ``zero_to_fp32.py``). One process, no process group, no model code (the
manifest says what the parameters are); memory bounded by the model (each master freed as it is cast).

Imports: module, optim, checksums, errors, manifest, metadata, planners, saveload, torch_optim.
"""

from __future__ import annotations

import dataclasses
import math
import os
import uuid
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..module import ModuleSpec
from ..optim import vector_spans
from .checksums import CHECKSUMS_FILE, CheckedDir, verify_checkpoint_dir
from .errors import CheckpointError, CheckpointOutputError, IncompleteCheckpointError, corrupt
from .manifest import (
    FROZEN_LEFT_OUT,
    PathLike,
    _read_manifest,
    checked_metadata,
    missed_length,
    missed_table,
    regroup_missed,
)
from .metadata import DTYPES, _first_line
from .planners import dcp_load
from .saveload import _HYPER_PREFIX, BUFFER_PREFIX, EXTRA_PREFIX, MISSED_KEY, SCALAR_PREFIX, VECTOR_PREFIX
from .torch_optim import module_state_dict, rule_from_manifest, torch_optim_dict, torch_order

__all__ = ["checkpoint_info", "consolidate_model_state_dict", "consolidate_torch_optim_state_dict",
           "consolidate_checkpoint", "verify_checkpoint"]


def _read(checked: CheckedDir, keys: list[str], numels: list[int] | None = None) -> dict[str, torch.Tensor]:
    """The saved tensors ``keys``; ``numels``: how many elements the manifest says each holds."""
    sd: dict[str, Any] = {}
    for k in keys:
        md = checked.metadata.state_dict_metadata.get(k)
        if not isinstance(md, TensorStorageMetadata):
            raise IncompleteCheckpointError(f"incomplete checkpoint {checked.dir}: it has no tensor entry {k!r}")
        sd[k] = torch.empty(md.size, dtype=md.properties.dtype)
    for k, n in zip(keys, numels or []):
        if sd[k].numel() != n:
            raise corrupt(checked.dir, f"entry {k!r} holds {sd[k].numel()} elements, its manifest says {n}")
    if sd:
        dcp_load(sd, checked, None)
    return sd


def _open(path: PathLike, follow_symlinks: bool) -> tuple[CheckedDir, dict[str, Any]]:
    checked = checked_metadata(path, follow_symlinks=follow_symlinks)
    return checked, _read_manifest(checked)


def _step_and_hyper(checked: CheckedDir, names: list[list[str]]) -> tuple[int, list[dict[str, torch.Tensor]]]:
    """The saved step and each optimizer group's hyperparameters ``names``."""
    keys = [f"{_HYPER_PREFIX}{k}/{n}" for k, group in enumerate(names) for n in group]
    scalars = _read(checked, ["fzero/step", *keys], [1] * (1 + len(keys)))
    hyper = [{n: scalars[f"{_HYPER_PREFIX}{k}/{n}"] for n in group} for k, group in enumerate(names)]
    return int(scalars["fzero/step"]), hyper


def checkpoint_info(path: PathLike, *, follow_symlinks: bool = False) -> dict[str, Any]:
    """What the checkpoint at ``path`` holds: directory, saved world size and stage, step, parameters (count, elements,
    per-parameter path/shape/dtype/group), optimizer and hyperparameters, bytes per kind of entry and per file, whether
    it has checksums, the caller's ``extra`` keys. Reads the metadata, the manifest and a few scalars.
    ``follow_symlinks``: as :func:`~fzero.checkpoint.load_checkpoint`; every failure a :class:`CheckpointError`."""
    checked, man = _open(path, follow_symlinks)
    d, metadata = checked.dir, checked.metadata
    opt = man["optimizer"]
    step, hyper = _step_and_hyper(checked, opt["hyperparameters"])
    by_kind: dict[str, int] = {}
    for idx, info in metadata.storage_data.items():
        parts = idx.fqn.split("/")
        kind = parts[1] if parts[0] == "fzero" and len(parts) > 1 else parts[0]
        by_kind[kind] = by_kind.get(kind, 0) + info.length
    params = man["params"]
    return {
        "directory": str(d),
        "world_size": man.get("saved_world_size"),
        "stage": man.get("saved_stage", "unknown (saved before fzero recorded it)"),
        "step": step,
        "num_params": len(params),
        "num_elements": sum(math.prod(p[1]) for p in params),
        "trainable_elements": sum(math.prod(p[1]) for p in params if p[3] >= 0),
        "params": [{"path": p[0], "shape": tuple(p[1]), "dtype": p[2], "group": p[3]} for p in params],
        "optimizer": opt["kind"],
        "hyperparameters": [{n: float(v) for n, v in h.items()} for h in hyper],
        "precision": man["precision"],
        "bytes_by_kind": dict(sorted(by_kind.items())),
        "files": {f.name: f.stat().st_size for f in sorted(d.iterdir()) if f.is_file()},
        "checksums": (d / CHECKSUMS_FILE).is_file(),
        "extra": sorted(k[len(EXTRA_PREFIX):] for k in metadata.state_dict_metadata if k.startswith(EXTRA_PREFIX)),
    }


def verify_checkpoint(path: PathLike, *, follow_symlinks: bool = False) -> int:
    """Check the checkpoint at ``path`` as loading would, without a training state: the metadata and its checksum
    binding, every record's checksum and decoding (``weights_only``), the step, the manifest. Returns the bytes checked;
    raises :class:`CheckpointError` (:class:`CheckpointCorruptError` naming the entry and file)."""
    checked = checked_metadata(path, follow_symlinks=follow_symlinks)
    total = verify_checkpoint_dir(checked)
    _read_manifest(checked)
    return total


def consolidate_model_state_dict(path: PathLike, *, follow_symlinks: bool = False) -> dict[str, torch.Tensor]:
    """The full parameters ``{path: tensor}`` of the checkpoint at ``path`` (in tree order), as
    :func:`~fzero.checkpoint.export_model_state_dict` gives them: masters cast to their dtype and shape."""
    return _model(*_open(path, follow_symlinks))


@dataclasses.dataclass(frozen=True)
class ModelTensor:
    """One tensor of a checkpoint's model state dict: its ``name`` (canonical: a tied alias is not listed), ``shape``
    and ``dtype``, and the checkpoint ``entry`` holding it (a master is cast from float32; empty tensors have none)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    entry: str | None


def model_tensors(checked: CheckedDir, man: dict[str, Any]) -> tuple[list[ModelTensor], ModuleSpec]:
    """The model state dict's tensors (in its order: the module's ``state_dict`` order, else parameters then
    buffers), and how to rebuild its tied names; nothing read but the manifest. The frozen parameters of a checkpoint
    that left them out are listed but cannot be read (:func:`check_whole_model`)."""
    module = man.get("module", {})
    spec = ModuleSpec(aliases=tuple(tuple(a) for a in module.get("aliases", [])),
                      state_dict_keys=tuple(module.get("state_dict_keys", [])))
    tensors = {p: ModelTensor(p, tuple(shape), DTYPES[dtype], None if not math.prod(shape) else
                              f"fzero/master/{p}" if g >= 0 else f"fzero/frozen/{p}")
               for p, shape, dtype, g in man["params"]}
    tensors.update({n: ModelTensor(n, tuple(shape), DTYPES[dtype], f"{BUFFER_PREFIX}{n}" if math.prod(shape) else None)
                    for n, shape, dtype in module.get("buffers", [])})
    aliases = {a for a, _ in spec.aliases}
    order = [k for k in spec.state_dict_keys if k in tensors and k not in aliases] or list(tensors)
    return [tensors[k] for k in order], spec


def check_whole_model(checked: CheckedDir, man: dict[str, Any]) -> None:
    """:class:`CheckpointError` if the checkpoint left its frozen parameters out: it holds no whole model."""
    if FROZEN_LEFT_OUT in man:
        raise CheckpointError(f"checkpoint {checked.dir} left its frozen parameters out (save_checkpoint(frozen="
                              "False)): no whole model; load it into a state built from its weights, and export that")


def read_model_tensor(checked: CheckedDir, t: ModelTensor) -> torch.Tensor:
    """The tensor ``t`` read from the checkpoint (one entry: one tensor's memory, plus DCP's one record), in its dtype
    and shape."""
    if t.entry is None:
        return torch.empty(t.shape, dtype=t.dtype)
    flat = _read(checked, [t.entry], [math.prod(t.shape)])[t.entry]
    return flat.reshape(t.shape).to(t.dtype)  # a master freed once cast


def _model(checked: CheckedDir, man: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The model state dict, read one tensor at a time (peak: the state dict plus one tensor)."""
    check_whole_model(checked, man)
    tensors, spec = model_tensors(checked, man)
    return module_state_dict({t.name: read_model_tensor(checked, t) for t in tensors}, {}, spec)


def consolidate_torch_optim_state_dict(path: PathLike, *, follow_symlinks: bool = False) -> dict[str, Any]:
    """The ``torch.optim`` state dict of the checkpoint at ``path``, as
    :func:`~fzero.checkpoint.export_torch_optim_state_dict` gives it from the live state."""
    return _optim(*_open(path, follow_symlinks))


def _optim(checked: CheckedDir, man: dict[str, Any]) -> dict[str, Any]:
    section = man["optimizer"]
    rule = rule_from_manifest(section)
    params = man["params"]
    order = torch_order([p[3] for p in params], section["num_groups"])
    step, hyper = _step_and_hyper(checked, section["hyperparameters"])
    moments: dict[int, dict[str, torch.Tensor]] = {}
    if step > 0:
        for name in section["moment_names"]:
            for i in (i for group in order for i in group):  # one moment read at a time: the dict plus one tensor
                p, shape, dtype, _ = params[i]
                moment = ModelTensor(p, tuple(shape), DTYPES[dtype], f"fzero/{name}/{p}" if math.prod(shape) else None)
                moments.setdefault(i, {})[name] = read_model_tensor(checked, moment)
    own = None
    trainable = [i for i, p in enumerate(params) if p[3] >= 0]
    if MISSED_KEY in checked.metadata.state_dict_metadata:  # each parameter's own step count
        missed = _read(checked, [MISSED_KEY], [missed_length(man)])[MISSED_KEY].tolist()
        # a parameter group's rank groups' counts: one torch.optim parameter, one count (else a named mismatch)
        table = regroup_missed(missed_table(man, missed), {p[0]: p[1] for p in params}, {}, f"checkpoint {checked.dir}")
        own = {i: step - table[params[i][0]][0] for i in trainable}
    keys = [f"{SCALAR_PREFIX}{n}" for n in rule.scalar_names]  # per-parameter scalar state
    vectors = _read(checked, keys, [len(trainable)] * len(keys))
    scalars = {i: {n: vectors[k][j].item() for n, k in zip(rule.scalar_names, keys)} for j, i in enumerate(trainable)}
    shapes = {i: (tuple(p[1]), DTYPES[p[2]]) for i, p in enumerate(params)}
    per_slot_vectors: dict[int, dict[str, torch.Tensor]] = {}
    if rule.vector_names:  # per-parameter vectors, joined in trainable order
        spans = vector_spans(rule, [tuple(params[i][1]) for i in trainable])
        lengths = [s[-1][1] if s else 0 for s in spans]
        keys = [f"{VECTOR_PREFIX}{n}" for n, length in zip(rule.vector_names, lengths) if length]
        read = _read(checked, keys, [length for length in lengths if length])
        for name, span in zip(rule.vector_names, spans):
            for i, (a, b) in zip(trainable, span):
                if b > a:
                    per_slot_vectors.setdefault(i, {})[name] = read[f"{VECTOR_PREFIX}{name}"][a:b]
    return torch_optim_dict(rule, order, step, hyper, moments, own, scalars, shapes=shapes, vectors=per_slot_vectors)


def consolidate_checkpoint(path: PathLike, out: PathLike, *, optim: PathLike | None = None,
                           follow_symlinks: bool = False) -> Path:
    """Write the checkpoint at ``path`` as a plain model state dict to ``out`` (``torch.save``;
    ``model.load_state_dict(torch.load(out))`` takes it), and its ``torch.optim`` state dict to ``optim`` if given.
    Returns ``out``. Each file is written under a hidden temporary name beside it and renamed into place once
    complete (a failed write leaves none). An output that cannot be written (its directory must exist: checked before
    the checkpoint is read) or a failed write (a full disk): :class:`CheckpointOutputError` naming it."""
    outs = [Path(out)] + ([] if optim is None else [Path(optim)])
    for o in outs:
        if not o.parent.is_dir():
            raise CheckpointOutputError(f"cannot write {o}: its directory {o.parent} does not exist")
        if o.is_dir():
            raise CheckpointOutputError(f"cannot write {o}: it is a directory")
    checked, man = _open(path, follow_symlinks)
    for o, build in zip(outs, (_model, _optim)):
        _save_replacing(build(checked, man), o)
    return outs[0]


def _save_replacing(obj: Any, out: Path) -> None:
    """``torch.save(obj)`` to a temporary file beside ``out``, fsynced, then renamed onto ``out``."""
    tmp = out.parent / f".tmp-{out.name}-{uuid.uuid4().hex[:12]}"
    try:
        with open(tmp, "xb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except (OSError, RuntimeError) as e:  # torch.save reports a failed write as a RuntimeError
        tmp.unlink(missing_ok=True)
        raise CheckpointOutputError(f"cannot write {out}: {_first_line(e)}") from e
