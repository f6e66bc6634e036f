"""Saving and loading a :class:`~fzero.state.TrainState`: the state as a flat DCP state dict.

Keys: ``fzero/master/{path}`` and ``fzero/{moment}/{path}`` (each trainable parameter's
master and moments as a logical 1-D tensor of its ``numel``; each rank writes the pieces
inside the flat range it owns, never padding); the replicated tensors listed by
:func:`_replicated` (step, hyperparameters, per-parameter step counts and scalars
``fzero/scalar/{name}``, per-parameter vectors ``fzero/vector/{name}``, scaler leaves, frozen
parameters), written
once; ``fzero/rng/{rank}`` (each rank's generator state, written by its process);
``extra/...`` (the caller's); ``fzero/manifest``.

Imports: :mod:`fzero.state` and below, the other modules of this package.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ..comm import Communicator
from ..pytree import replace
from ..sharding import all_gather_params, check_world
from ..state import TrainState, consume, ensure_live
from .checksums import CheckedDir
from .errors import CheckpointMismatchError
from .manifest import (
    MANIFEST_KEY,
    PathLike,
    _check_entries,
    _manifest,
    _manifest_difference,
    _read_manifest,
    checked_metadata,
)
from .planners import _param_pieces, _Pieces, dcp_load, dcp_save
from .publish import (
    _TMP_PREFIX,
    LATEST,
    _check_name,
    _on_coordinator,
    _prepare_tmp,
    _process_group,
    _publish,
    _read_latest,
)

EXTRA_PREFIX = "extra/"
HYPERPARAMS = ("checkpoint", "template")
_HYPER_PREFIX = "fzero/hyper/"


MISSED_KEY = "fzero/missed"  # OptState.missed: [T] int64, replicated
SCALAR_PREFIX = "fzero/scalar/"  # OptState.scalars: [T] float64 each, replicated
VECTOR_PREFIX = "fzero/vector/"  # OptState.vectors: one 1-D tensor each, replicated
CALLS_KEY = "fzero/calls"  # TrainState.calls: 0-d int64, the step calls (skipped ones too)

def _sharded(state: TrainState, comm: Communicator, master: Sequence[torch.Tensor],
             moments: Sequence[Sequence[torch.Tensor]]) -> dict[str, _Pieces]:
    """``fzero/master/{path}`` and ``fzero/{moment}/{path}`` for every trainable parameter."""
    lay, names = state.layout, state.opt.optimizer.moment_names
    sd = {f"fzero/master/{p}": v for p, v in _param_pieces(lay, master, comm.ranks).items()}
    for j, name in enumerate(names):
        rows = [ms[j] for ms in moments]
        sd.update({f"fzero/{name}/{p}": v for p, v in _param_pieces(lay, rows, comm.ranks).items()})
    return sd


def _flatten_extra(extra: Mapping[str, Any], prefix: str = EXTRA_PREFIX) -> dict[str, Any]:
    """``{"extra/a/b": leaf}`` for a nested dict; checks that ``torch.load(weights_only=True)``
    will read every non-tensor value back (primitives and lists/tuples/dicts of them)."""
    out: dict[str, Any] = {}
    for k, v in extra.items():
        if not isinstance(k, str) or not k or "/" in k:
            raise ValueError(f"extra: keys must be non-empty strings without '/', got {k!r} under {prefix!r}")
        key = prefix + k
        if isinstance(v, Mapping) and v:
            out.update(_flatten_extra(v, key + "/"))
        else:
            _check_loadable(key, v)
            out[key] = v.detach() if isinstance(v, torch.Tensor) else v
    return out


_PRIMITIVES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


def _check_loadable(key: str, v: Any) -> None:
    if isinstance(v, (torch.Tensor, *_PRIMITIVES)):
        return
    if isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            _check_loadable(f"{key}[{i}]", x)
        return
    if isinstance(v, dict):
        for k, x in v.items():
            _check_loadable(f"{key}[{k!r}]", k)
            _check_loadable(f"{key}[{k!r}]", x)
        return
    raise TypeError(
        f"{key}: {type(v).__name__} cannot be checkpointed; extra values must be tensors, python "
        "scalars/strings/None, or lists/tuples/dicts of them (store other objects' state, e.g. "
        "numpy arrays as tensors)"
    )


def _unflatten_extra(flat: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in sorted(flat):
        parts = key[len(EXTRA_PREFIX):].split("/")
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = flat[key]
    return out


def _save_state_dict(
    state: TrainState, comm: Communicator, extra: Optional[Mapping[str, Any]]
) -> dict[str, Any]:
    """The flat DCP state dict of ``state``: views of its tensors, no copy."""
    sd: dict[str, Any] = {MANIFEST_KEY: json.dumps(_manifest(state, comm), sort_keys=True)}
    sd.update(_sharded(state, comm, state.shard.master, state.opt.moments))
    sd.update(_replicated(state))
    sd.update(_rng_entries(state, comm))
    if extra:
        sd.update(_flatten_extra(extra))
    return sd


BUFFER_PREFIX = "fzero/buffer/"
RNG_PREFIX = "fzero/rng/"


def _rng_entries(state: TrainState, comm: Communicator) -> dict[str, torch.Tensor]:
    """``fzero/rng/{rank}``: each rank's generator state (see :mod:`fzero.rng`), written by
    the process that holds the rank (none when the state keeps no generators)."""
    if not state.rng:
        return {}
    return {f"{RNG_PREFIX}{r}": state.rng[0][i] for i, r in enumerate(comm.ranks)}


def _rng_destinations(template: TrainState, comm: Communicator, metadata: Metadata) -> dict[str, torch.Tensor]:
    """Where the saved generators of this process's ranks are read to: rank ``r`` reads
    ``fzero/rng/{r}`` when the checkpoint has it; the others keep the template's (the
    resharding rule: see :func:`load_checkpoint`)."""
    if not template.rng:
        return {}
    rows = {}
    for i, r in enumerate(comm.ranks):
        key, mine = f"{RNG_PREFIX}{r}", template.rng[0][i]
        md = metadata.state_dict_metadata.get(key)
        if md is None:
            continue
        if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != tuple(mine.shape) \
                or md.properties.dtype != mine.dtype:
            # another device type's generator (CPU vs CUDA states differ in size): not loadable here
            warnings.warn(f"checkpoint entry {key!r} is not a generator state of this device; rank {r} "
                          "keeps the template's generator (the run will not repeat the saved one exactly)",
                          stacklevel=3)
            continue
        rows[key] = torch.empty_like(mine)
    return rows


def persistent_buffers(state: TrainState) -> list[tuple[str, torch.Tensor]]:
    """``[(name, [R, ...])]``: the module buffers a ``state_dict`` holds (rank rows)."""
    spec = state.module
    return [(n, b) for n, b, keep in zip(spec.buffers, state.buffers, spec.persistent) if keep]


def _replicated(state: TrainState) -> dict[str, torch.Tensor]:
    """Tensors every rank holds whole: step, hyperparameters, scaler leaves, frozen parameters.

    The one list of replicated entries: saving writes them, loading reads into tensors
    shaped like them. A new replicated leaf of the state is one line here and one in
    :func:`_assemble`, which puts the loaded values back."""
    sd = {"fzero/step": state.opt.step}
    if state.calls:  # the step calls so far: host-side schedules resume where they stopped
        sd[CALLS_KEY] = state.calls[0]
    if state.opt.missed:  # each parameter's steps sat out without a gradient (its own count)
        sd[MISSED_KEY] = state.opt.missed[0]
    for name, v in zip(state.opt.optimizer.scalar_names, state.opt.scalars):  # per-parameter [T]
        sd[f"{SCALAR_PREFIX}{name}"] = v
    for name, v in zip(state.opt.optimizer.vector_names, state.opt.vectors):  # per-parameter vectors, joined
        if v.numel():  # empty when no parameter has one: nothing to write
            sd[f"{VECTOR_PREFIX}{name}"] = v
    for k, h in enumerate(state.opt.hyper):
        for name, v in h.items():
            sd[f"{_HYPER_PREFIX}{k}/{name}"] = v
    sc = state.scaler
    sd.update({
        "fzero/scaler/scale": sc.scale,
        "fzero/scaler/growth_tracker": sc.growth_tracker,
        "fzero/scaler/hysteresis_left": sc.hysteresis_left,
    })
    for s, f in zip(state.layout.frozen_slots, state.shard.frozen):
        sd[f"fzero/frozen/{s.path}"] = f
    for name, b in persistent_buffers(state):
        sd[f"{BUFFER_PREFIX}{name}"] = b[0]  # rank 0's (DCP writes a replicated key once)
    return sd


def save_checkpoint(
    state: TrainState,
    root: PathLike,
    comm: Communicator,
    *,
    name: Optional[str] = None,
    extra: Optional[Mapping[str, Any]] = None,
) -> Path:
    """Save ``state`` (and ``extra``) as ``root/name`` and point ``root/LATEST`` at it.

    Every rank calls it. Each rank writes only what its own shards hold of each
    parameter's master and moments (never padding); replicated tensors (step,
    hyperparameters, scaler, frozen parameters, ``extra``) are written once, by
    one rank. Nothing is gathered.
    ``name`` defaults to ``step-{opt.step:08d}``. ``extra``: a nested dict (string
    keys without ``/``) of tensors, python scalars, strings, None and lists/tuples/
    dicts of them; it is taken as replicated: give per-rank values distinct keys.

    Each rank's generator state (``state.rng``) is saved as ``fzero/rng/{rank}``, so that a
    resumed run draws the same dropout masks as the uninterrupted one.
    Every record gets a CRC-32, checked when it is read (see :mod:`.checksums`).
    Atomic: the checkpoint is written to ``root/.tmp-{name}`` and renamed once every
    rank has finished, then ``LATEST`` is replaced atomically; until then the
    previous checkpoint stays the latest and intact. Saving over the checkpoint
    ``LATEST`` names is refused (``FileExistsError``): it could not stay intact.

    Collectives (on a process group): DCP's save (a gather and scatter of plans,
    a gather of write results), one barrier, and two ``broadcast_object_list``
    of the coordinator's outcome. Returns the checkpoint's directory.
    """
    ensure_live(state)
    check_world(state.shard, comm)
    pg = _process_group(comm)
    root = Path(root)
    if name is None:
        name = f"step-{int(state.opt.step):08d}"
    _check_name(name)
    # Every rank decides alike (same files), before any collective: no rank is left waiting.
    if _read_latest(root) == name:
        raise FileExistsError(
            f"{root / name} is the latest checkpoint ({root / LATEST}); saving over it would leave "
            "no complete checkpoint while it is rewritten: choose another name"
        )
    tmp = root / f"{_TMP_PREFIX}{name}"
    state_dict = _save_state_dict(state, comm, extra)
    _on_coordinator(pg, "preparing the checkpoint directory", lambda: _prepare_tmp(root, tmp))
    dcp_save(state_dict, tmp, pg, bind={"step": int(state.opt.step), "name": name})
    if pg is not None:
        dist.barrier(group=pg)  # every rank's files are complete before the rename
    _on_coordinator(pg, "publishing the checkpoint", lambda: _publish(root, tmp, name))
    return root / name


def _destination(t: torch.Tensor, donate: bool) -> torch.Tensor:
    """Where a sharded buffer is loaded: the template's own (donated) or a fresh one; zeros
    either way, since the padding the new layout adds must be zero (update rules keep it so)."""
    return t.zero_() if donate else torch.zeros_like(t)


def load_checkpoint(
    path: PathLike,
    template: TrainState,
    comm: Communicator,
    *,
    hyperparams: str = "checkpoint",
    donate: bool = False,
) -> tuple[TrainState, dict[str, Any]]:
    """Load a checkpoint into a state shaped like ``template``; returns ``(state, extra)``.

    ``path``: a root written by :func:`save_checkpoint` (its ``LATEST`` is loaded) or
    one checkpoint directory. ``template``: built for *this* world with
    :func:`fzero.init_train_state` (same model, optimizer, scaler configuration and
    precision as the saved run; any world size and alignment). Each rank reads only
    the slices its new shards own; padding is zero. ``params`` is rebuilt (one
    ``all_gather`` per flat group), or kept empty if the template's is empty (ZeRO stage 3).

    ``hyperparams``: ``"checkpoint"`` (default, as ``torch.optim``'s ``load_state_dict``)
    restores the saved hyperparameters (learning rate, betas, weight decay...);
    ``"template"`` keeps the template's, e.g. to fine-tune with a new learning rate.
    Schedules set hyperparameters from the step count either way.

    ``donate``: False (default) leaves the template untouched, and loading holds the
    template's buffers and the loaded ones at once (twice the state). True loads into
    the template's own master and moment buffers and frees its gathered parameters
    before regathering, so the peak is one state plus one saved chunk; the template is
    then consumed (fzero functions given it raise ``ValueError``), as a donated state is.

    Generators (``state.rng``, :mod:`fzero.rng`): rank ``r`` continues from the generator
    state rank ``r`` saved, so a resumed run draws what the uninterrupted run would have
    drawn. Resharding, the rule is by rank number: a rank the saved run did not have (a
    larger world) keeps the template's generator (``init_train_state``'s ``seed``), and
    the generators of saved ranks beyond this world are not loaded. A checkpoint without
    generators (saved with ``seed=None``, or before fzero saved them) leaves every rank the
    template's; a template with ``seed=None`` keeps none.

    Nothing in the checkpoint runs: ``.metadata`` is read with an allow-list of DCP's
    metadata types, object entries with ``weights_only=True`` (see :mod:`.metadata`).
    Checks first, on every rank alike: :class:`CheckpointCorruptError` if the metadata is
    damaged, not the one the checksum file was written for, or lacks a checksum file it was
    saved with, or if (through a root) ``LATEST`` names a checkpoint saved under another
    name; :class:`IncompleteCheckpointError` if ``.metadata`` or a data file is missing or
    truncated; :class:`CheckpointMismatchError` naming the first difference for another
    model/optimizer/scaler/precision. While
    reading, every record's checksum (and the step against the checksum file's):
    :class:`CheckpointCorruptError` naming the entry and the data file. Every failure is a
    :class:`CheckpointError` (an ``Exception``).
    Collectives: DCP's load (plans scatter, a final gather), then the gathers.
    """
    if hyperparams not in HYPERPARAMS:
        raise ValueError(f"load_checkpoint: hyperparams must be one of {HYPERPARAMS}, got {hyperparams!r}")
    ensure_live(template)
    check_world(template.shard, comm)
    pg = _process_group(comm)
    checked = _validated(path, template, comm)
    d, metadata = checked.dir, checked.metadata
    replicated = {k: torch.empty_like(v) for k, v in _replicated(template).items()}
    if hyperparams == "template":
        replicated = {k: v for k, v in replicated.items() if not k.startswith(_HYPER_PREFIX)}
    if MISSED_KEY in replicated and MISSED_KEY not in metadata.state_dict_metadata:
        # saved before per-parameter step counts: every parameter took every step
        replicated[MISSED_KEY] = torch.zeros_like(replicated[MISSED_KEY])
        no_missed = {MISSED_KEY: replicated.pop(MISSED_KEY)}
    else:
        no_missed = {}
    if CALLS_KEY in replicated and CALLS_KEY not in metadata.state_dict_metadata:
        # saved before the state counted its calls: the applied steps are the best count known
        replicated.pop(CALLS_KEY)
        no_calls = True
    else:
        no_calls = False
    shapes = _sharded(template, comm, template.shard.master, template.opt.moments)
    _check_entries(d, metadata, {**shapes, **replicated})
    masters = tuple(_destination(m, donate) for m in template.shard.master)
    moments = tuple(tuple(_destination(m, donate) for m in ms) for ms in template.opt.moments)
    sd: dict[str, Any] = {**_sharded(template, comm, masters, moments), **replicated}
    extra = _extra_destinations(metadata)
    sd.update(extra)
    sd.update(_rng_destinations(template, comm, metadata))
    dcp_load(sd, checked, pg)  # raises CheckpointError naming the entry and file
    if hyperparams == "template":
        replicated.update({k: v.clone() for k, v in _replicated(template).items() if k.startswith(_HYPER_PREFIX)})
    replicated.update(no_missed)
    if no_calls:
        replicated[CALLS_KEY] = replicated["fzero/step"].to("cpu", torch.int64).clone()
    # donating, the parameters are regathered into the template's own buffers (which a stage
    # 1-2 module views): nothing of their size is allocated
    state = _assemble(template, comm, masters, moments, replicated, into=template.params if donate else None)
    if template.rng:
        rows = [sd.get(f"{RNG_PREFIX}{r}", template.rng[0][i].clone()) for i, r in enumerate(comm.ranks)]
        state = replace(state, rng=(torch.stack(rows),))
    if donate:
        state = consume(template, state)
    return state, _unflatten_extra({k: sd[k] for k in extra})


def _validated(path: PathLike, template: TrainState, comm: Communicator) -> CheckedDir:
    """The checked checkpoint directory (metadata read without running code, bound to its
    checksums), once complete and matching ``template``."""
    checked = checked_metadata(path)
    diff = _manifest_difference(_read_manifest(checked), _manifest(template, comm))
    if diff is not None:
        raise CheckpointMismatchError(
            f"checkpoint {checked.dir} does not match this training state: {diff} (checkpoint vs this state)"
        )
    return checked


def _extra_destinations(metadata: Metadata) -> dict[str, Any]:
    """Where the caller's entries are read to: a tensor of the saved size and dtype, or
    a placeholder that DCP replaces by the unpickled object."""
    out: dict[str, Any] = {}
    for k, md in sorted(metadata.state_dict_metadata.items()):
        if k.startswith(EXTRA_PREFIX):
            is_tensor = isinstance(md, TensorStorageMetadata)
            out[k] = torch.empty(md.size, dtype=md.properties.dtype) if is_tensor else None
    return out


def _assemble(
    template: TrainState,
    comm: Communicator,
    masters: tuple[torch.Tensor, ...],
    moments: tuple[tuple[torch.Tensor, ...], ...],
    replicated: Mapping[str, torch.Tensor],
    into: Optional[Sequence[torch.Tensor]] = None,
) -> TrainState:
    """``template`` with the loaded leaves, and ``params`` regathered (one ``all_gather``
    per flat group; ``into``: into those buffers) unless the template keeps none (stage 3)."""
    lay, opt = template.layout, template.opt
    hyper = tuple(
        {name: replicated[f"fzero/hyper/{k}/{name}"] for name in h} for k, h in enumerate(opt.hyper)
    )
    frozen = tuple(replicated[f"fzero/frozen/{s.path}"] for s in lay.frozen_slots)
    shard = replace(template.shard, master=masters, frozen=frozen)
    scaler = replace(
        template.scaler,
        scale=replicated["fzero/scaler/scale"],
        growth_tracker=replicated["fzero/scaler/growth_tracker"],
        hysteresis_left=replicated["fzero/scaler/hysteresis_left"],
    )
    params = ()
    if len(template.params):
        dtype = template.precision.param_dtype
        params = all_gather_params(shard, comm, dtype, into=into or None)
    saved = dict(persistent_buffers(template))
    buffers = tuple(
        replicated[f"{BUFFER_PREFIX}{n}"].unsqueeze(0).expand_as(b).clone() if n in saved else b
        for n, b in zip(template.module.buffers, template.buffers)
    )
    return replace(
        template,
        shard=shard,
        opt=replace(opt, step=replicated["fzero/step"], hyper=hyper, moments=moments,
                    missed=(replicated[MISSED_KEY],) if MISSED_KEY in replicated else opt.missed,
                    scalars=tuple(replicated[f"{SCALAR_PREFIX}{n}"] for n in opt.optimizer.scalar_names)
                    if opt.scalars else opt.scalars,
                    vectors=tuple(replicated.get(f"{VECTOR_PREFIX}{n}", v)
                                  for n, v in zip(opt.optimizer.vector_names, opt.vectors))),
        scaler=scaler,
        params=params,
        buffers=buffers,
        calls=(replicated[CALLS_KEY],) if CALLS_KEY in replicated else template.calls,
    )
