"""Pretrained weights as an init source: ``init_train_state(model, ..., init=fzero.pretrained(path))``. ``path``: a
``save_pretrained`` directory, a ``.safetensors`` file or index ``.json``, or a ``torch.save`` state dict, keyed by
``state_dict`` names (any one of a tied tensor's names fills it). Files are untrusted and the model may exceed one rank:
``torch.save`` files load with ``weights_only=True, mmap=True``; safetensors are opened by header and each rank reads
only the rows it owns. Every key is checked before any data are read (:class:`WeightsFileError`). The shards equal, bit
for bit, those of the full model after ``load_state_dict`` of the same file.

Imports: comm, layout, materialize, module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from .comm import Communicator
from .layout import Layout
from .materialize import RESET, InitFn, Materialized, ShardRows, init_buffers_of, init_fn, init_name
from .module import module_spec

__all__ = ["Pretrained", "WeightsFileError", "pretrained"]

INDEX = "model.safetensors.index.json"
SAFETENSORS = "model.safetensors"
TORCH_BIN = "pytorch_model.bin"

_SAFETENSORS_DTYPES = {  # safetensors' dtype codes
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}

_BUFFER_HINT = (
    "files hold no non-persistent buffers: pass fzero.pretrained(path, init=fn) with an fn(module) that computes "
    "it (as the module's __init__ does), or build the model with its buffers off the meta device (they are then "
    "taken as they are)")


class WeightsFileError(ValueError):
    """A weights file that does not fit the model or is not what it claims; names the key and file."""


class _Meta(NamedTuple):  # one tensor of a file, from its header
    file: str
    shape: tuple[int, ...]
    dtype: torch.dtype


class _Files:
    """The open weight files: ``index`` (key -> :class:`_Meta`) and readers of their tensors."""

    def __init__(self) -> None:
        self.index: dict[str, _Meta] = {}
        self._safe: dict[str, Any] = {}  # file -> safe_open handle
        self._torch: dict[str, Mapping[str, torch.Tensor]] = {}  # file -> mmapped state dict
        self.names: list[str] = []  # what error messages name

    def read(self, key: str) -> torch.Tensor:
        """The whole tensor ``key``."""
        m = self.index[key]
        return self._safe[m.file].get_tensor(key) if m.file in self._safe else self._torch[m.file][key]

    def read_flat(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Flat elements ``[start, stop)`` of ``key``, reading only the rows that hold them."""
        m = self.index[key]
        if m.file not in self._safe or len(m.shape) == 0:
            return self.read(key).reshape(-1)[start:stop]
        row = math.prod(m.shape[1:])
        first, last = start // row, -(-stop // row)
        return self._safe[m.file].get_slice(key)[first:last].reshape(-1)[start - first * row : stop - first * row]


def _bad(file: str | Path, what: str) -> WeightsFileError:
    return WeightsFileError(f"{file}: {what}")


def _open_safetensors(files: _Files, file: Path, stack: contextlib.ExitStack) -> list[str]:
    """Open one safetensors file (header only), index its tensors and return its keys."""
    try:
        from safetensors import safe_open
    except ImportError as e:  # pragma: no cover - transformers brings it
        raise ImportError("reading safetensors files needs `pip install safetensors`") from e
    try:
        handle = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
        keys = list(handle.keys())
        metas = {}
        for k in keys:
            sl = handle.get_slice(k)
            code = sl.get_dtype()
            if code not in _SAFETENSORS_DTYPES:
                raise _bad(file, f"tensor {k!r} has dtype {code}, which fzero does not read")
            metas[k] = _Meta(str(file), tuple(sl.get_shape()), _SAFETENSORS_DTYPES[code])
    except WeightsFileError:
        raise
    except Exception as e:  # noqa: BLE001 - the library's errors vary by version; all mean one thing
        raise _bad(file, f"not a readable safetensors file ({type(e).__name__}: {e})") from e
    files._safe[str(file)] = handle
    files.index.update(metas)
    files.names.append(str(file))
    return keys


def _open_torch(files: _Files, file: Path) -> None:
    """Open one ``torch.save`` state dict: ``weights_only`` (no code runs), memory-mapped."""
    try:
        sd = torch.load(str(file), map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - refused pickles, non-zip files, truncation: all unreadable
        raise _bad(file, "not a torch.save state dict that loads with weights_only=True and mmap=True (nothing "
                   f"in it was run): {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    if not isinstance(sd, Mapping):
        raise _bad(file, f"holds a {type(sd).__name__}, not a state dict (a mapping of names to tensors)")
    for k, v in sd.items():
        if not isinstance(k, str) or not isinstance(v, torch.Tensor):
            raise _bad(file, f"entry {k!r} is a {type(v).__name__}, not a tensor under a name")
        files.index[k] = _Meta(str(file), tuple(v.shape), v.dtype)
    files._torch[str(file)] = sd
    files.names.append(str(file))


def _open_index(files: _Files, index: Path, stack: contextlib.ExitStack) -> None:
    """Open every shard an index names; check that each holds the keys the index gives it."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except Exception as e:  # noqa: BLE001 - unreadable or not JSON or no weight_map
        raise _bad(index, f"not a safetensors index with a weight_map ({type(e).__name__}: {e})") from e
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):
        raise _bad(index, "weight_map is not a mapping of tensor names to file names")
    folder = index.parent.resolve()
    shards: dict[str, list[str]] = {}
    for key, shard in weight_map.items():
        shards.setdefault(shard, []).append(key)
    for shard, keys in shards.items():
        file = (folder / shard).resolve()
        if file.parent != folder:
            raise _bad(index, f"names shard {shard!r} (for {keys[0]!r}) outside its directory")
        if not file.is_file():
            raise _bad(index, f"names shard {shard!r} (for {keys[0]!r}), which does not exist")
        held = set(_open_safetensors(files, file, stack))
        if missing := [key for key in keys if key not in held]:
            raise _bad(file, f"has no tensor {missing[0]!r}, which {index.name} says it holds")
    # only what the index lists is the checkpoint (as transformers reads it), and errors name the index
    files.index = {k: files.index[k] for k in weight_map}
    files.names = [str(index)]


def _open(path: Path, stack: contextlib.ExitStack) -> _Files:
    files = _Files()
    if path.is_dir():
        for name in (INDEX, SAFETENSORS, TORCH_BIN):
            if (path / name).is_file():
                return _open(path / name, stack)
        raise WeightsFileError(f"{path}: a directory without {INDEX}, {SAFETENSORS} or {TORCH_BIN}")
    if not path.is_file():
        raise WeightsFileError(f"{path}: no such file or directory")
    if path.suffix == ".json":
        _open_index(files, path, stack)
    elif path.suffix == ".safetensors":
        _open_safetensors(files, path, stack)
    else:
        _open_torch(files, path)
    return files


class _Want(NamedTuple):  # a tensor the module needs: its canonical name, every name it goes by, shape, dtype
    name: str
    names: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype


def _wanted(module: torch.nn.Module, layout: Layout) -> tuple[list[_Want], list[str], set[str]]:
    """What the file must hold, the non-persistent buffers (from the init), and the module's ``state_dict`` keys."""
    spec = module_spec(module)
    also: dict[str, list[str]] = {}
    for alias, canonical in spec.aliases:
        also.setdefault(canonical, []).append(alias)
    wants = [_Want(s.path, (s.path, *also.get(s.path, ())), s.shape, s.dtype) for s in layout.slots]
    bufs = dict(module.named_buffers())
    kept = [n for n, keep in zip(spec.buffers, spec.persistent) if keep]
    wants += [_Want(n, (n, *also.get(n, ())), tuple(bufs[n].shape), bufs[n].dtype) for n in kept]
    transient = [n for n, keep in zip(spec.buffers, spec.persistent) if not keep]
    return wants, transient, set(spec.state_dict_keys)


def _check(files: _Files, wants: Sequence[_Want], keys: set[str], cast: bool) -> dict[str, str]:
    """``{canonical name: file key}``; a :class:`WeightsFileError` for the first key that does not fit."""
    unexpected = sorted(k for k in files.index if k not in keys)
    if unexpected:
        raise WeightsFileError(
            f"{files.index[unexpected[0]].file}: tensor {unexpected[0]!r} is not in the model's state_dict"
            + (f" (and {len(unexpected) - 1} more: {unexpected[1:4]})" if len(unexpected) > 1 else ""))
    chosen = {}
    for w in wants:
        present = [n for n in w.names if n in files.index]
        if not present:
            tied = (f" (nor under its tied name{'s' if len(w.names) > 2 else ''} {list(w.names[1:])})"
                    if len(w.names) > 1 else "")
            raise WeightsFileError(f"{', '.join(files.names)}: no tensor {w.name!r}{tied}, which the model needs")
        for n in present:
            m = files.index[n]
            if m.shape != w.shape:
                raise _bad(m.file, f"tensor {n!r} has shape {m.shape}, the model's is {w.shape}")
            if not (m.dtype == w.dtype or (cast and m.dtype.is_floating_point and w.dtype.is_floating_point)):
                raise _bad(m.file, f"tensor {n!r} is {m.dtype}, the model's is {w.dtype}; build the model in the "
                           "file's dtype, or pass fzero.pretrained(path, cast=True) to convert floating tensors")
        chosen[w.name] = present[0]
    return chosen


@dataclasses.dataclass(frozen=True)
class Pretrained:
    """Weights from files as an :class:`fzero.materialize.InitSource`; made by :func:`pretrained`."""

    path: Path
    init: str | InitFn | None = None
    cast: bool = False

    def materialize(self, module: torch.nn.Module, layout: Layout, comm: Communicator,
                    units: Sequence[str] = (), device: torch.device | str = "cpu") -> Materialized:
        """This process's shards, frozen parameters and buffers from the files, on ``device``: each tensor read on the
        host (a mapped slice) and copied straight into its shard rows there (no collective)."""
        wants, transient, keys = _wanted(module, layout)
        # before the files are opened: their mappings and the buffer init's temporaries apart
        fn, who = self._buffer_init(module)
        computed = init_buffers_of(module, transient, fn, who, _BUFFER_HINT)
        with contextlib.ExitStack() as stack:
            files = _open(self.path, stack)
            chosen = _check(files, wants, keys, self.cast)
            rows = ShardRows(layout, comm.ranks, device)
            frozen = []
            for i, s in enumerate(layout.slots):  # to the parameter's dtype first, as load_state_dict
                key = chosen[s.path]
                if s.group >= 0 or s.frozen_group >= 0:
                    rows.write(i, lambda start, stop, key=key, s=s: files.read_flat(key, start, stop).to(s.dtype))
                else:
                    frozen.append(files.read(key).to(device, s.dtype, copy=True))
            persistent = {w.name: _rows(files.read(chosen[w.name]).to(device, w.dtype), len(comm.ranks))
                          for w in wants[len(layout.slots):]}
            files = None  # the mappings go with it
        buffers = {**persistent, **{n: _rows(b.to(device), len(comm.ranks)) for n, b in computed.items()}}
        return Materialized(rows.rows, rows.frozen or tuple(frozen),
                            tuple(buffers[n] for n, _ in module.named_buffers()))

    def _buffer_init(self, module: torch.nn.Module) -> tuple[InitFn, str]:
        if self.init is not None:
            return init_fn(self.init), f"fzero.pretrained(..., {init_name(self.init)})"
        if callable(hf := getattr(module, "_init_weights", None)):
            return hf, "fzero.pretrained's default buffer init (the model's _init_weights)"
        return init_fn(RESET), "fzero.pretrained's default buffer init (reset_parameters)"


def _rows(t: torch.Tensor, reps: int) -> torch.Tensor:
    return t.unsqueeze(0).repeat(reps, *([1] * t.dim()))


def pretrained(path: str | os.PathLike, *, init: str | InitFn | None = None,
               cast: bool = False) -> Pretrained:
    """An init source reading ``path`` (files: module doc). ``init``: what computes the non-persistent buffers
    (``"reset_parameters"`` or ``fn(module)``, run on their modules; default: the model's ``_init_weights``, else
    ``reset_parameters``). ``cast``: convert floating tensors of another dtype (default: an error). Nothing is opened
    until used."""
    return Pretrained(Path(path), init, cast)
