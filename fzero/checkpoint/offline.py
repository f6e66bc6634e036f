"""A checkpoint without the training job: its description, the check of every checksum, and
its consolidation into plain ``torch`` state dicts (DeepSpeed's ``zero_to_fp32.py``).

Everything here runs in one process, with no process group and no model code: the
manifest says what the parameters are (path, shape, dtype, optimizer group). Memory is
bounded by the model: DCP reads one saved record at a time into the destination
tensors, and a state dict holds each parameter once (the master, then cast to the
parameter's dtype, the master freed parameter by parameter).

Imports: :mod:`fzero.checkpoint.manifest`, ``.planners``, ``.checksums``, ``.torch_optim``.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from .checksums import CHECKSUMS_FILE, verify_checkpoint_dir
from .errors import IncompleteCheckpointError
from .manifest import PathLike, _read_manifest, checked_metadata
from .planners import dcp_load
from ..module import ModuleSpec
from .saveload import BUFFER_PREFIX
from .torch_optim import module_state_dict, torch_optim_dict, torch_order

__all__ = ["checkpoint_info", "consolidate_model_state_dict", "consolidate_torch_optim_state_dict",
           "consolidate_checkpoint", "verify_checkpoint"]

_DTYPES = {str(t): t for t in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}


def _dtype(name: str) -> torch.dtype:
    return _DTYPES.get(name) or getattr(torch, name.removeprefix("torch."))


def _empty_like_saved(d: Path, metadata: Metadata, key: str) -> torch.Tensor:
    md = metadata.state_dict_metadata.get(key)
    if not isinstance(md, TensorStorageMetadata):
        raise IncompleteCheckpointError(f"incomplete checkpoint {d}: it has no tensor entry {key!r}")
    return torch.empty(md.size, dtype=md.properties.dtype)


def _read(d: Path, metadata: Metadata, keys: list[str]) -> dict[str, torch.Tensor]:
    sd: dict[str, Any] = {k: _empty_like_saved(d, metadata, k) for k in keys}
    if sd:
        dcp_load(sd, d, None)
    return sd


def _open(path: PathLike) -> tuple[Path, Metadata, dict[str, Any]]:
    d, metadata = checked_metadata(path)
    return d, metadata, _read_manifest(d, metadata)


def checkpoint_info(path: PathLike) -> dict[str, Any]:
    """What the checkpoint at ``path`` holds: directory, saved world size and stage, step,
    parameters (count, elements, per-parameter path/shape/dtype/group), optimizer and its
    hyperparameters, bytes per kind of entry and per file, whether it has checksums, and the
    caller's ``extra`` keys. Reads the metadata, the manifest and a few scalars."""
    d, metadata, man = _open(path)
    opt = man["optimizer"]
    hyper_keys = [f"fzero/hyper/{k}/{n}" for k, names in enumerate(opt["hyperparameters"]) for n in names]
    scalars = _read(d, metadata, ["fzero/step", *hyper_keys])
    hyper = [{n: float(scalars[f"fzero/hyper/{k}/{n}"]) for n in names}
             for k, names in enumerate(opt["hyperparameters"])]
    by_kind: dict[str, int] = {}
    for idx, info in metadata.storage_data.items():
        parts = idx.fqn.split("/")
        kind = parts[0] if parts[0] != "fzero" else parts[1]
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
    """Check every record of the checkpoint at ``path`` against its checksum; returns the bytes
    checked. Raises :class:`CheckpointCorruptError` naming the entry and data file."""
    d, metadata = checked_metadata(path)
    return verify_checkpoint_dir(d, metadata)


def consolidate_model_state_dict(path: PathLike) -> dict[str, torch.Tensor]:
    """The full parameters ``{path: tensor}`` of the checkpoint at ``path``, in tree order, as
    :func:`~fzero.checkpoint.export_model_state_dict` gives them from the live state: the
    master cast to each parameter's dtype and shape; frozen parameters as saved."""
    d, metadata, man = _open(path)
    return _model(d, metadata, man)


def _model(d: Path, metadata: Metadata, man: dict[str, Any]) -> dict[str, torch.Tensor]:
    params = man["params"]
    module = man.get("module", {})
    buffers = module.get("buffers", [])
    keys = [f"fzero/master/{p}" if g >= 0 else f"fzero/frozen/{p}" for p, shape, _, g in params if _numel(shape)]
    keys += [f"{BUFFER_PREFIX}{n}" for n, shape, _ in buffers if _numel(shape)]
    flat = _read(d, metadata, keys)
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
    d, metadata, man = _open(path)
    return _optim(d, metadata, man)


def _optim(d: Path, metadata: Metadata, man: dict[str, Any]) -> dict[str, Any]:
    opt = types.SimpleNamespace(**man["optimizer"])
    params = man["params"]
    order = torch_order([p[3] for p in params], opt.num_groups)
    hyper_keys = [f"fzero/hyper/{k}/{n}" for k, names in enumerate(opt.hyperparameters) for n in names]
    scalars = _read(d, metadata, ["fzero/step", *hyper_keys])
    step = int(scalars["fzero/step"])
    hyper = [{n: scalars[f"fzero/hyper/{k}/{n}"] for n in names} for k, names in enumerate(opt.hyperparameters)]
    moments: dict[int, dict[str, torch.Tensor]] = {}
    if step > 0:
        for name in opt.moment_names:
            keys = {i: f"fzero/{name}/{params[i][0]}" for group in order for i in group}
            flat = _read(d, metadata, [k for i, k in keys.items() if _numel(params[i][1])])
            for i, key in keys.items():
                _, shape, dtype, _ = params[i]
                t = flat.pop(key) if _numel(shape) else torch.empty(0)
                moments.setdefault(i, {})[name] = t.reshape(shape).to(_dtype(dtype))
    return torch_optim_dict(opt, order, step, hyper, moments)


def consolidate_checkpoint(path: PathLike, out: PathLike, *, optim: Optional[PathLike] = None) -> Path:
    """Write the checkpoint at ``path`` as a plain model state dict to ``out`` (``torch.save``;
    ``model.load_state_dict(torch.load(out))`` takes it), and its ``torch.optim`` state dict to
    ``optim`` if given. Returns ``out``."""
    d, metadata, man = _open(path)
    out = Path(out)
    torch.save(_model(d, metadata, man), out)
    if optim is not None:
        torch.save(_optim(d, metadata, man), Path(optim))
    return out
