"""A checkpoint without the training job: its description, the check of every checksum, and
its consolidation into plain ``torch`` state dicts (DeepSpeed's ``zero_to_fp32.py``).

Everything here runs in one process, with no process group and no model code: the
manifest says what the parameters are (path, shape, dtype, optimizer group). Memory is
bounded by the model: DCP reads one saved record at a time into the destination
tensors, and a state dict holds each parameter once (the master, then cast to the
parameter's dtype, the master freed parameter by parameter).

Imports: :mod:`fzero.checkpoint.manifest`, ``.planners``, ``.checksums``, ``.saveload`` (entry names), ``.torch_optim``.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from .checksums import CHECKSUMS_FILE, CheckedDir, verify_checkpoint_dir
from .errors import CheckpointCorruptError, IncompleteCheckpointError
from .manifest import PathLike, _read_manifest, checked_metadata
from .metadata import DTYPES
from .planners import dcp_load
from ..module import ModuleSpec
from .saveload import BUFFER_PREFIX, MISSED_KEY, SCALAR_PREFIX, VECTOR_PREFIX
from ..optim import vector_spans
from .torch_optim import module_state_dict, rule_from_manifest, torch_optim_dict, torch_order

__all__ = ["checkpoint_info", "consolidate_model_state_dict", "consolidate_torch_optim_state_dict",
           "consolidate_checkpoint", "verify_checkpoint"]

def _dtype(name: str) -> torch.dtype:
    return DTYPES[name]  # the manifest's dtypes were checked when it was read


def _empty_like_saved(d: Path, metadata: Metadata, key: str) -> torch.Tensor:
    md = metadata.state_dict_metadata.get(key)
    if not isinstance(md, TensorStorageMetadata):
        raise IncompleteCheckpointError(f"incomplete checkpoint {d}: it has no tensor entry {key!r}")
    return torch.empty(md.size, dtype=md.properties.dtype)


def _read(checked: CheckedDir, keys: list[str], numels: Optional[list[int]] = None) -> dict[str, torch.Tensor]:
    """The saved tensors ``keys``; ``numels``: how many elements the manifest says each holds."""
    sd: dict[str, Any] = {k: _empty_like_saved(checked.dir, checked.metadata, k) for k in keys}
    for k, n in zip(keys, numels or []):
        if sd[k].numel() != n:
            raise CheckpointCorruptError(
                f"corrupt checkpoint {checked.dir}: entry {k!r} holds {sd[k].numel()} elements, its manifest "
                f"says {n}"
            )
    if sd:
        dcp_load(sd, checked, None)
    return sd


def _open(path: PathLike) -> tuple[CheckedDir, dict[str, Any]]:
    checked = checked_metadata(path)
    return checked, _read_manifest(checked)


def checkpoint_info(path: PathLike) -> dict[str, Any]:
    """What the checkpoint at ``path`` holds: directory, saved world size and stage, step,
    parameters (count, elements, per-parameter path/shape/dtype/group), optimizer and its
    hyperparameters, bytes per kind of entry and per file, whether it has checksums, and the
    caller's ``extra`` keys. Reads the metadata, the manifest and a few scalars."""
    checked, man = _open(path)
    d, metadata = checked.dir, checked.metadata
    opt = man["optimizer"]
    hyper_keys = [f"fzero/hyper/{k}/{n}" for k, names in enumerate(opt["hyperparameters"]) for n in names]
    scalars = _read(checked, ["fzero/step", *hyper_keys], [1] * (1 + len(hyper_keys)))
    hyper = [{n: float(scalars[f"fzero/hyper/{k}/{n}"]) for n in names}
             for k, names in enumerate(opt["hyperparameters"])]
    by_kind: dict[str, int] = {}
    for idx, info in metadata.storage_data.items():
        parts = idx.fqn.split("/")
        kind = parts[1] if parts[0] == "fzero" and len(parts) > 1 else parts[0]
        by_kind[kind] = by_kind.get(kind, 0) + info.length
    files = {f.name: f.stat().st_size for f in sorted(d.iterdir()) if f.is_file()}
    params = man["params"]
    return {
        "directory": str(d),
        "world_size": man.get("saved_world_size"),
        "stage": man.get("saved_stage", "unknown (saved before fzero recorded it)"),
        "step": int(scalars["fzero/step"]),
        "num_params": len(params),
        "num_elements": sum(_numel(p[1]) for p in params),
        "trainable_elements": sum(_numel(p[1]) for p in params if p[3] >= 0),
        "params": [{"path": p[0], "shape": tuple(p[1]), "dtype": p[2], "group": p[3]} for p in params],
        "optimizer": opt["kind"],
        "hyperparameters": hyper,
        "precision": man["precision"],
        "bytes_by_kind": dict(sorted(by_kind.items())),
        "files": files,
        "checksums": (d / CHECKSUMS_FILE).is_file(),
        "extra": sorted(k[len("extra/"):] for k in metadata.state_dict_metadata if k.startswith("extra/")),
    }


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def verify_checkpoint(path: PathLike) -> int:
    """Check the checkpoint at ``path`` as loading it would, without a training state: its
    metadata (read without running code) and its binding to the checksum file, every record
    against its checksum, that every record decodes (``weights_only``) to what the metadata
    says, the step, and the manifest. Returns the bytes checked. Raises
    :class:`CheckpointError` (:class:`CheckpointCorruptError` naming the entry and data file)."""
    checked = checked_metadata(path)
    total = verify_checkpoint_dir(checked)
    _read_manifest(checked)
    return total


def consolidate_model_state_dict(path: PathLike) -> dict[str, torch.Tensor]:
    """The full parameters ``{path: tensor}`` of the checkpoint at ``path``, in tree order, as
    :func:`~fzero.checkpoint.export_model_state_dict` gives them from the live state: the
    master cast to each parameter's dtype and shape; frozen parameters as saved."""
    checked, man = _open(path)
    return _model(checked, man)


def _model(checked: CheckedDir, man: dict[str, Any]) -> dict[str, torch.Tensor]:
    params = man["params"]
    module = man.get("module", {})
    buffers = module.get("buffers", [])
    keys = [f"fzero/master/{p}" if g >= 0 else f"fzero/frozen/{p}" for p, shape, _, g in params if _numel(shape)]
    numels = [_numel(shape) for _, shape, _, _ in params if _numel(shape)]
    keys += [f"{BUFFER_PREFIX}{n}" for n, shape, _ in buffers if _numel(shape)]
    numels += [_numel(shape) for _, shape, _ in buffers if _numel(shape)]
    flat = _read(checked, keys, numels)
    out: dict[str, torch.Tensor] = {}
    for p, shape, dtype, g in params:
        key = f"fzero/master/{p}" if g >= 0 else f"fzero/frozen/{p}"
        t = flat.pop(key) if _numel(shape) else torch.empty(0, dtype=_dtype(dtype))
        out[p] = t.reshape(shape).to(_dtype(dtype))  # the master freed as each parameter is cast
    bufs = {}
    for n, shape, dtype in buffers:
        key = f"{BUFFER_PREFIX}{n}"
        bufs[n] = flat.pop(key).reshape(shape) if _numel(shape) else torch.empty(shape, dtype=_dtype(dtype))
    spec = ModuleSpec(
        aliases=tuple(tuple(a) for a in module.get("aliases", [])),
        state_dict_keys=tuple(module.get("state_dict_keys", [])),
    )
    return module_state_dict(out, bufs, spec)


def consolidate_torch_optim_state_dict(path: PathLike) -> dict[str, Any]:
    """The ``torch.optim`` state dict of the checkpoint at ``path``, as
    :func:`~fzero.checkpoint.export_torch_optim_state_dict` gives it from the live state."""
    checked, man = _open(path)
    return _optim(checked, man)


def _optim(checked: CheckedDir, man: dict[str, Any]) -> dict[str, Any]:
    section = man["optimizer"]
    opt = types.SimpleNamespace(**section)
    rule = rule_from_manifest(section)
    params = man["params"]
    order = torch_order([p[3] for p in params], opt.num_groups)
    hyper_keys = [f"fzero/hyper/{k}/{n}" for k, names in enumerate(opt.hyperparameters) for n in names]
    scalars = _read(checked, ["fzero/step", *hyper_keys], [1] * (1 + len(hyper_keys)))
    step = int(scalars["fzero/step"])
    hyper = [{n: scalars[f"fzero/hyper/{k}/{n}"] for n in names} for k, names in enumerate(opt.hyperparameters)]
    moments: dict[int, dict[str, torch.Tensor]] = {}
    if step > 0:
        for name in opt.moment_names:
            keys = {i: f"fzero/{name}/{params[i][0]}" for group in order for i in group}
            wanted = [i for i in keys if _numel(params[i][1])]
            flat = _read(checked, [keys[i] for i in wanted], [_numel(params[i][1]) for i in wanted])
            for i, key in keys.items():
                _, shape, dtype, _ = params[i]
                t = flat.pop(key) if _numel(shape) else torch.empty(0)
                moments.setdefault(i, {})[name] = t.reshape(shape).to(_dtype(dtype))
    own = None
    trainable = [i for i, p in enumerate(params) if p[3] >= 0]
    if MISSED_KEY in checked.metadata.state_dict_metadata:  # each parameter's own step count
        missed = _read(checked, [MISSED_KEY], [len(trainable)])[MISSED_KEY].tolist()
        own = {i: step - int(m) for i, m in zip(trainable, missed)}
    keys = [f"{SCALAR_PREFIX}{n}" for n in rule.scalar_names]  # per-parameter scalar state
    vectors = _read(checked, keys, [len(trainable)] * len(keys))
    scalars = {i: {n: vectors[k][j].item() for n, k in zip(rule.scalar_names, keys)} for j, i in enumerate(trainable)}
    shapes = {i: (tuple(p[1]), _dtype(p[2])) for i, p in enumerate(params)}
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
    return torch_optim_dict(rule, order, step, hyper, moments, own, scalars, shapes=shapes,
                            vectors=per_slot_vectors)


def consolidate_checkpoint(path: PathLike, out: PathLike, *, optim: Optional[PathLike] = None) -> Path:
    """Write the checkpoint at ``path`` as a plain model state dict to ``out`` (``torch.save``;
    ``model.load_state_dict(torch.load(out))`` takes it), and its ``torch.optim`` state dict to
    ``optim`` if given. Returns ``out``."""
    checked, man = _open(path)
    out = Path(out)
    torch.save(_model(checked, man), out)
    if optim is not None:
        torch.save(_optim(checked, man), Path(optim))
    return out
