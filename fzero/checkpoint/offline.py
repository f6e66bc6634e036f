"""A checkpoint without the training job: its description, the check of every checksum, and its consolidation into
plain ``torch`` state dicts (DeepSpeed's ``zero_to_fp32.py``). One process, no process group, no model code (the
manifest says what the parameters are); memory bounded by the model (each master freed as it is cast).

Imports: module, optim, checksums, errors, manifest, metadata, planners, saveload, torch_optim.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..module import ModuleSpec
from ..optim import vector_spans
from .checksums import CHECKSUMS_FILE, CheckedDir, verify_checkpoint_dir
from .errors import CheckpointError, CheckpointOutputError, IncompleteCheckpointError, corrupt
from .manifest import FROZEN_LEFT_OUT, PathLike, _read_manifest, checked_metadata
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


def _model(checked: CheckedDir, man: dict[str, Any]) -> dict[str, torch.Tensor]:
    if FROZEN_LEFT_OUT in man:
        raise CheckpointError(f"checkpoint {checked.dir} left its frozen parameters out (save_checkpoint(frozen="
                              "False)): no whole model; load it into a state built from its weights, and export that")
    params = man["params"]
    module = man.get("module", {})
    buffers = module.get("buffers", [])
    key = {p: f"fzero/master/{p}" if g >= 0 else f"fzero/frozen/{p}" for p, _, _, g in params}
    wanted = [(key[p], math.prod(shape)) for p, shape, _, _ in params if math.prod(shape)]
    wanted += [(f"{BUFFER_PREFIX}{n}", math.prod(shape)) for n, shape, _ in buffers if math.prod(shape)]
    flat = _read(checked, [k for k, _ in wanted], [n for _, n in wanted])
    out: dict[str, torch.Tensor] = {}
    for p, shape, dtype, _ in params:
        t = flat.pop(key[p]) if math.prod(shape) else torch.empty(0, dtype=DTYPES[dtype])
        out[p] = t.reshape(shape).to(DTYPES[dtype])  # the master freed as each parameter is cast
    bufs = {n: flat.pop(f"{BUFFER_PREFIX}{n}").reshape(shape) if math.prod(shape)
            else torch.empty(shape, dtype=DTYPES[dtype]) for n, shape, dtype in buffers}
    spec = ModuleSpec(aliases=tuple(tuple(a) for a in module.get("aliases", [])),
                      state_dict_keys=tuple(module.get("state_dict_keys", [])))
    return module_state_dict(out, bufs, spec)


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
            keys = {i: f"fzero/{name}/{params[i][0]}" for group in order for i in group}
            wanted = [i for i in keys if math.prod(params[i][1])]
            flat = _read(checked, [keys[i] for i in wanted], [math.prod(params[i][1]) for i in wanted])
            for i, key in keys.items():
                _, shape, dtype, _ = params[i]
                t = flat.pop(key) if math.prod(shape) else torch.empty(0)
                moments.setdefault(i, {})[name] = t.reshape(shape).to(DTYPES[dtype])
    own = None
    trainable = [i for i, p in enumerate(params) if p[3] >= 0]
    if MISSED_KEY in checked.metadata.state_dict_metadata:  # each parameter's own step count
        missed = _read(checked, [MISSED_KEY], [len(trainable)])[MISSED_KEY].tolist()
        own = {i: step - int(m) for i, m in zip(trainable, missed)}
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
    Returns ``out``. An output that cannot be written (checked before the checkpoint is read: its directory must
    exist): :class:`CheckpointOutputError` naming it."""
    outs = [Path(out)] + ([] if optim is None else [Path(optim)])
    for o in outs:
        if not o.parent.is_dir():
            raise CheckpointOutputError(f"cannot write {o}: its directory {o.parent} does not exist")
    checked, man = _open(path, follow_symlinks)
    for o, build in zip(outs, (_model, _optim)):
        try:
            torch.save(build(checked, man), o)
        except (OSError, RuntimeError) as e:  # torch.save reports a file it cannot open as a RuntimeError
            raise CheckpointOutputError(f"cannot write {o}: {_first_line(e)}") from e
    return outs[0]
