"""Export to a Hugging Face model directory: what ``save_pretrained`` writes and ``from_pretrained`` reads, from a
checkpoint (offline, any world size and stage it was saved at, no process group) or from a live state (collective).

The files are named and sharded as ``save_pretrained`` names them: ``model.safetensors``, or
``model-00001-of-0000N.safetensors`` and ``model.safetensors.index.json`` once the tensors exceed ``max_shard_size``
(greedy in state-dict order, a tensor larger than it alone in its file); tied names written once, under the name the
module keeps (``transformer.wte.weight``, not ``lm_head.weight``); ``config.json`` copied when given. A ``peft`` LoRA
state exports its adapters as ``peft``'s ``save_pretrained`` does: ``adapter_model.safetensors`` with the adapter name
taken out of each key, and ``adapter_config.json``. Streamed: one tensor is read (or gathered) and written at a time
(:mod:`.safetensors_out`), so the peak is one tensor, not the model. The directory is written under a hidden temporary
name beside it and renamed into place once complete: a failed or killed export leaves no directory that looks complete.

Imports: comm, state, errors, manifest, offline, safetensors_out, torch_optim.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..comm import Communicator
from ..state import TrainState
from .errors import CheckpointOutputError
from .manifest import PathLike, _read_manifest, checked_metadata
from .offline import check_whole_model, model_tensors, read_model_tensor
from .safetensors_out import SafetensorsWriter, TensorHeader, parse_size
from .torch_optim import gathered_tensors, state_dict_tensors

__all__ = ["export_pretrained", "EXPORT_DTYPES", "WEIGHTS_NAME", "ADAPTER_WEIGHTS_NAME", "INDEX_NAME"]

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
CONFIG_NAME, ADAPTER_CONFIG_NAME = "config.json", "adapter_config.json"
CONFIG_LIMIT = 16 << 20  # a config file is a few kB; a larger one is not one
EXPORT_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
                 "fp16": torch.float16, "float16": torch.float16, "fp64": torch.float64, "float64": torch.float64}
# the module names peft gives an adapter's tensors: "...{part}.{adapter name}..."
ADAPTER_PARTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector",
                 "modules_to_save")


@dataclasses.dataclass(frozen=True)
class _Export:
    """What is written: each source tensor (``source``: its name in the state dict) under its ``header`` (the name in
    the files, shape, written dtype), and the files ``[(name, [index into tensors])]``."""

    source: tuple[str, ...]
    headers: tuple[TensorHeader, ...]
    files: tuple[tuple[str, tuple[int, ...]], ...]
    adapter: str | None


def _export_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.lower() in EXPORT_DTYPES:
        return EXPORT_DTYPES[dtype.lower()]
    raise ValueError(f"export_pretrained: dtype must be a torch.dtype or one of {sorted(EXPORT_DTYPES)}, got {dtype!r}")


def _adapter_of(name: str) -> str | None:
    """The peft adapter name of a state-dict key (the part after ``lora_A``, ``modules_to_save``...), or None."""
    parts = name.split(".")
    return next((parts[i + 1] for i, p in enumerate(parts[:-1]) if p in ADAPTER_PARTS), None)


def _chosen_adapter(names: Sequence[str], adapter: str | bool | None) -> str | None:
    """The adapter to export (None: the whole model). ``adapter``: None exports the adapter when the state has
    exactly one (the whole model when it has none), True requires one, a name picks it, False the whole model."""
    found = sorted({a for a in map(_adapter_of, names) if a is not None})
    if adapter is False or (adapter is None and not found):
        return None
    if isinstance(adapter, str):
        if adapter not in found:
            raise ValueError(f"export_pretrained: the state has no adapter {adapter!r} (it has {found or 'none'})")
        return adapter
    if len(found) != 1:
        raise ValueError(f"export_pretrained: the state has {'no peft adapter' if not found else f'adapters {found}'}"
                         "; pass adapter=NAME to choose one, or adapter=False for the whole model")
    return found[0]


def _peft_key(name: str, adapter: str) -> str:
    """The key peft's ``save_pretrained`` writes for an adapter tensor: ``modules_to_save.`` and ``.{adapter}``
    taken out."""
    return name.replace("modules_to_save.", "").replace(f".{adapter}", "")


def _plan(tensors: Sequence[tuple[str, tuple[int, ...], torch.dtype]], dtype: torch.dtype | None,
          max_shard_size: int, adapter: str | None) -> _Export:
    """The files of an export: the tensors (an adapter's alone, renamed), cast to ``dtype`` where floating, cut into
    files as ``save_pretrained`` cuts them."""
    if adapter is not None:
        tensors = [t for t in tensors if _adapter_of(t[0]) == adapter]
    headers = tuple(TensorHeader(_peft_key(n, adapter) if adapter else n, tuple(shape),
                                 dtype if dtype is not None and d.is_floating_point else d) for n, shape, d in tensors)
    if adapter is not None:
        return _Export(tuple(t[0] for t in tensors), headers, ((ADAPTER_WEIGHTS_NAME, tuple(range(len(headers)))),),
                       adapter)
    shards: list[list[int]] = []  # save_pretrained's split: greedy; an oversized tensor alone, in a file of its own
    current: list[int] = []
    size = 0
    for i, h in enumerate(headers):
        if h.nbytes > max_shard_size:
            shards.append([i])
            continue
        if current and size + h.nbytes > max_shard_size:
            shards.append(current)
            current, size = [], 0
        current.append(i)
        size += h.nbytes
    if current or not shards:
        shards.append(current)
    n = len(shards)
    names = [WEIGHTS_NAME] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    return _Export(tuple(t[0] for t in tensors), headers, tuple(zip(names, map(tuple, shards))), None)


def _index(export: _Export) -> dict[str, Any]:
    """``model.safetensors.index.json`` as ``save_pretrained`` writes it."""
    weight_map = {export.headers[i].name: file for file, members in export.files for i in members}
    return {"metadata": {"total_parameters": sum(math.prod(h.shape) for h in export.headers),
                         "total_size": sum(h.nbytes for h in export.headers)},
            "weight_map": dict(sorted(weight_map.items()))}


def _config_text(config: PathLike | Mapping[str, Any], dtype: torch.dtype | None) -> str:
    """The config as JSON: a file's (bounded, a JSON object) or a mapping's; its dtype fields (``dtype``, and
    ``torch_dtype`` if it has one) set to ``dtype`` when given, as ``save_pretrained`` records the dtype it wrote
    (``from_pretrained(dtype="auto")`` reads it)."""
    if isinstance(config, Mapping):
        doc = dict(config)
    else:
        path = Path(config)
        try:
            with open(path, "rb") as f:
                blob = f.read(CONFIG_LIMIT + 1)
        except OSError as e:
            raise ValueError(f"export_pretrained: config {path} cannot be read ({e.strerror or e})") from e
        try:
            doc = json.loads(blob.decode("utf-8")) if len(blob) <= CONFIG_LIMIT else None
        except (UnicodeDecodeError, ValueError):
            doc = None
        if not isinstance(doc, dict):
            raise ValueError(f"export_pretrained: config {path} is not a JSON object of at most {CONFIG_LIMIT} bytes")
    if dtype is not None:  # "dtype" (transformers >= 4.56), and "torch_dtype" where the config has it
        for key in ("dtype", *(["torch_dtype"] if "torch_dtype" in doc else [])):
            doc[key] = str(dtype).removeprefix("torch.")
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def _sources(source: PathLike | TrainState, comm: Communicator | None, follow_symlinks: bool
             ) -> tuple[list[tuple[str, tuple[int, ...], torch.dtype]], Any, bool]:
    """``(tensors, read, writes)``: the source's state-dict tensors ``(name, shape, dtype)``, ``read(names, whole)``
    iterating those named in turn (``whole``: the whole model is wanted, which a checkpoint without its frozen
    parameters does not hold), and whether this process writes (a live state: data rank 0)."""
    if isinstance(source, TrainState):
        if comm is None:
            raise TypeError("export_pretrained: a live state needs its communicator (comm=...)")
        return (state_dict_tensors(source), lambda names, whole: gathered_tensors(source, comm, names),
                comm.data_ranks[0] == 0)
    if comm is not None:
        raise TypeError("export_pretrained: a checkpoint is exported offline, without a communicator")
    checked = checked_metadata(source, follow_symlinks=follow_symlinks)
    man = _read_manifest(checked)
    entries, _ = model_tensors(checked, man)
    by_name = {t.name: t for t in entries}

    def read(names: Sequence[str], whole: bool) -> Iterator[torch.Tensor]:
        if whole:
            check_whole_model(checked, man)
        return (read_model_tensor(checked, by_name[n]) for n in names)

    return [(t.name, t.shape, t.dtype) for t in entries], read, True


def export_pretrained(source: PathLike | TrainState, out_dir: PathLike, *, comm: Communicator | None = None,
                      dtype: torch.dtype | str | None = None, max_shard_size: int | str = "5GB",
                      config: PathLike | Mapping[str, Any] | None = None, adapter: str | bool | None = None,
                      follow_symlinks: bool = False) -> Path:
    """Write ``source`` as a ``save_pretrained`` directory ``out_dir`` (which must not exist, or be empty); returns it.

    ``source``: a checkpoint root or directory (read offline as :func:`~fzero.checkpoint.consolidate_checkpoint` reads
    it, whatever world size and stage it was saved at; ``follow_symlinks`` as there), or a live :class:`TrainState`
    with its ``comm`` (every rank calls it; rank 0 writes). Values: each parameter's master cast to its dtype (what
    :func:`fzero.write_back` gives), then to ``dtype`` if given (``"bf16"``, ``torch.float16``...: floating tensors
    only); rank 0's persistent buffers. ``max_shard_size``: bytes or ``"5GB"``-style (decimal units, as
    ``save_pretrained``). ``config``: a ``config.json`` file (read by the rank that writes) or a mapping, written as
    ``config.json`` (its ``dtype``, and ``torch_dtype`` if it has one, set to ``dtype`` when given). ``adapter``: None
    exports a ``peft`` state's one adapter (names ``lora_A.{name}``...) as ``adapter_model.safetensors`` (+
    ``adapter_config.json`` from ``config``) and any other state as the whole model; a name picks one adapter, False
    the whole model.

    Streamed: one tensor in memory at a time (a live state: each gathered in turn). Failures: the checkpoint as every
    reader (:class:`CheckpointError`); an existing non-empty ``out_dir``, a directory that cannot be created or a write
    error (a full disk) is a :class:`CheckpointOutputError` naming the file, and nothing is left at ``out_dir``.
    Collectives (a live state, one rank per process): a ``broadcast`` of rank 0's outcome before the first gather and
    after the last, and those of :func:`~fzero.checkpoint.torch_optim.gathered_tensors`."""
    out = Path(out_dir)
    dtype = _export_dtype(dtype)
    limit = parse_size(max_shard_size)
    tensors, read, writes = _sources(source, comm, follow_symlinks)
    chosen = _chosen_adapter([t[0] for t in tensors], adapter)
    export = _plan(tensors, dtype, limit, chosen)
    peers = comm if isinstance(source, TrainState) else None
    error: Exception | None = None
    tmp, text = None, None
    if writes:  # the config is the writer's file: read there, its failure agreed like the output's
        try:
            text = None if config is None else _config_text(config, dtype)
            tmp = _prepare(out)
        except (CheckpointOutputError, ValueError) as e:
            error = e
    _agree(peers, error, out)
    try:
        error = _write_files(tmp, export, read(export.source, chosen is None), writes, collective=peers is not None)
        if error is None and writes:
            error = _finish(tmp, out, export, text)
    except BaseException:  # a checkpoint that fails to read, an interrupt: no partial directory stays
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if error is not None and tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    _agree(peers, error, out)
    return out


def _prepare(out: Path) -> Path:
    """A fresh hidden directory beside ``out`` to write into, once ``out`` is absent or an empty directory."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise CheckpointOutputError(f"cannot export to {out}: it exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        raise CheckpointOutputError(f"cannot export to {out}: it exists and is not empty (an export never mixes "
                                    "its files with others')")
    tmp = out.parent / f".tmp-{out.name}-{uuid.uuid4().hex[:12]}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as e:
        raise CheckpointOutputError(f"cannot export to {out}: cannot create {tmp} ({e.strerror or e})") from e
    return tmp


def _write_files(tmp: Path | None, export: _Export, tensors: Iterator[torch.Tensor], writes: bool, *,
                 collective: bool) -> CheckpointOutputError | None:
    """Write every file of ``export`` from ``tensors`` (in order) into ``tmp``, each file open from its first tensor
    to its last (an oversized tensor's file opens and closes between two others'). ``collective`` (a live state's
    gathers): a rank that does not write, or that failed, still takes every tensor. The first write error, or None."""
    file_of = {i: k for k, (_, members) in enumerate(export.files) for i in members}
    open_files: dict[int, SafetensorsWriter] = {}
    error: CheckpointOutputError | None = None
    path = Path()  # the file being written (named by an error)
    try:
        if writes and tmp is not None:
            for file, members in export.files:
                if not members:  # an empty model's one file: its header alone
                    path = tmp / file
                    SafetensorsWriter(path, []).close()
        for i in range(len(export.headers)):
            t = next(tensors)
            if not writes or tmp is None:
                continue  # still taken: a live state's next gather is a collective
            k = file_of[i]
            file, members = export.files[k]
            path = tmp / file
            if k not in open_files:
                open_files[k] = SafetensorsWriter(path, [export.headers[j] for j in members])
            open_files[k].write(t.to(export.headers[i].dtype))
            if members[-1] == i:
                open_files.pop(k).close()
    except OSError as e:
        error = _output_error(path, e)
        if collective:
            for _ in tensors:  # the remaining gathers, taken without writing
                pass
    finally:
        for w in open_files.values():  # left open by an error
            w.file.close()
    return error


def _output_error(path: Path, e: OSError) -> CheckpointOutputError:
    return CheckpointOutputError(f"cannot write {path}: {e.strerror or e}")


def _finish(tmp: Path, out: Path, export: _Export, config: str | None) -> CheckpointOutputError | None:
    """The index and config written, then ``tmp`` renamed to ``out``; the error naming the file, or None."""
    extra = {}
    if export.adapter is None and len(export.files) > 1:
        extra[INDEX_NAME] = json.dumps(_index(export), indent=2, sort_keys=True) + "\n"
    if config is not None:
        extra[ADAPTER_CONFIG_NAME if export.adapter else CONFIG_NAME] = config
    for name, text in extra.items():
        try:
            with open(tmp / name, "x", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            return _output_error(tmp / name, e)
    try:
        os.replace(tmp, out)  # onto an absent or empty directory: atomic
    except OSError as e:
        return CheckpointOutputError(f"cannot export to {out}: renaming {tmp} into place failed ({e.strerror or e})")
    return None


def _agree(comm: Communicator | None, error: Exception | None, out: Path) -> None:
    """Raise ``error`` here, and on every other rank (a live state's communicator, one rank per process) an error
    saying rank 0 failed: one ``broadcast`` of rank 0's outcome."""
    if comm is not None and comm.local_ranks == 1:
        failed = torch.tensor([[float(error is not None)]], device=comm.device)
        if bool(comm.broadcast(failed, 0)[0, 0]) and error is None:
            raise CheckpointOutputError(f"exporting to {out} failed on rank 0, which writes it (its error names the "
                                        "file)")
    if error is not None:
        raise error
