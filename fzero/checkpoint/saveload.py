"""Saving and loading a :class:`~fzero.state.TrainState` as a flat DCP state dict.

Keys: ``fzero/master/{path}`` and ``fzero/{moment}/{path}`` (each trainable parameter's master and moments
as a logical 1-D tensor; each rank writes the pieces inside the flat range it owns, never padding);
``fzero/frozen/{path}`` (each frozen parameter as a logical 1-D tensor: stage 3's pieces, or whole); the
replicated tensors of :func:`_replicated`, written once; ``fzero/rng/{rank}`` (each rank's generator state);
``extra/...`` (the caller's); ``fzero/manifest``.

Imports: comm, layout, pytree, sharding, state, background, checksums, errors, manifest, planners, publish.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ..comm import Communicator
from ..layout import Layout, positions, trainable_index
from ..pytree import replace
from ..sharding import all_gather_params, check_world, frozen_rows
from ..state import TrainState, consume, ensure_live
from .background import BackgroundSave, checkpoint_group, settle, start
from .checksums import CheckedDir
from .errors import CheckpointMismatchError
from .manifest import (
    FROZEN_LEFT_OUT,
    FROZEN_PREFIX,
    MANIFEST_KEY,
    VERSION,
    PathLike,
    _check_entries,
    _manifest,
    _manifest_difference,
    _read_manifest,
    checked_metadata,
    frozen_crcs,
    missed_length,
    missed_table,
    persistent_buffers,
    regroup_missed,
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
BUFFER_PREFIX = "fzero/buffer/"
RNG_PREFIX = "fzero/rng/"
_PRIMITIVES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


def _sharded(state: TrainState, comm: Communicator, master: Sequence[torch.Tensor],
             moments: Sequence[Sequence[torch.Tensor]]) -> dict[str, _Pieces]:
    """``fzero/master/{path}`` and ``fzero/{moment}/{path}`` for every trainable parameter."""
    lay, names = state.layout, state.opt.optimizer.moment_names
    # a parameter group's rows: their ranks within their rank groups, and which rank group (its values' place)
    places = {name: (comm.param_group(name).ranks, comm.param_group(name).part) for name, _, _ in lay.axes}
    sd = {f"fzero/master/{p}": v for p, v in _param_pieces(lay, master, comm.ranks, places=places).items()}
    for j, name in enumerate(names):
        rows = [ms[j] for ms in moments]
        sd.update({f"fzero/{name}/{p}": v for p, v in _param_pieces(lay, rows, comm.ranks, places=places).items()})
    return sd


def _frozen(layout: Layout, rows: Sequence[torch.Tensor], comm: Communicator) -> dict[str, Any]:
    """``fzero/frozen/{path}`` of every non-empty frozen parameter of ``rows`` (``ShardState.frozen``'s form): 1-D
    views, as pieces at stage 3."""
    if layout.frozen_groups:
        return {FROZEN_PREFIX + p: v for p, v in _param_pieces(layout, rows, comm.ranks, layout.frozen_groups).items()}
    return {FROZEN_PREFIX + s.path: f.view(-1) for s, f in zip(layout.frozen_slots, rows) if s.numel}


def _flatten_extra(extra: Mapping[str, Any], prefix: str = EXTRA_PREFIX) -> dict[str, Any]:
    """``{"extra/a/b": leaf}`` for a nested dict, once ``torch.load(weights_only=True)`` will read every
    non-tensor value back (primitives and lists/tuples/dicts of them)."""
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
    raise TypeError(f"{key}: {type(v).__name__} cannot be checkpointed; extra values must be tensors, python "
                    "scalars/strings/None, or lists/tuples/dicts of them (store other objects' state, e.g. "
                    "numpy arrays as tensors)")


def _unflatten_extra(flat: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in sorted(flat):
        *parents, leaf = key[len(EXTRA_PREFIX):].split("/")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = flat[key]
    return out


def _rng_destinations(template: TrainState, comm: Communicator, metadata: Metadata) -> dict[str, torch.Tensor]:
    """Where the saved generators of this process's ranks are read to: rank ``r`` reads ``fzero/rng/{r}``
    when the checkpoint has it; the others keep the template's (see :func:`load_checkpoint`)."""
    if not template.rng:
        return {}
    rows = {}
    for i, r in enumerate(comm.data_ranks):
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


def _replicated(state: TrainState) -> dict[str, torch.Tensor]:
    """Tensors every rank holds whole: step, step calls, per-parameter step counts, scalars and vectors,
    hyperparameters, scaler leaves, rank 0's persistent buffers. Saving writes them;
    loading reads into tensors shaped like them and :func:`_assemble` puts them back."""
    sd = {"fzero/step": state.opt.step}
    if state.calls:
        sd[CALLS_KEY] = state.calls[0]
    if state.opt.missed:
        sd[MISSED_KEY] = state.opt.missed[0]
    for name, v in zip(state.opt.optimizer.scalar_names, state.opt.scalars):
        sd[f"{SCALAR_PREFIX}{name}"] = v
    for name, v in zip(state.opt.optimizer.vector_names, state.opt.vectors):
        if v.numel():  # empty when no parameter has one: nothing to write
            sd[f"{VECTOR_PREFIX}{name}"] = v
    for k, h in enumerate(state.opt.hyper):
        for name, v in h.items():
            sd[f"{_HYPER_PREFIX}{k}/{name}"] = v
    sc = state.scaler
    sd.update({"fzero/scaler/scale": sc.scale, "fzero/scaler/growth_tracker": sc.growth_tracker,
               "fzero/scaler/hysteresis_left": sc.hysteresis_left})
    for name, b in persistent_buffers(state):
        sd[f"{BUFFER_PREFIX}{name}"] = b[0]  # rank 0's (DCP writes a replicated key once)
    return sd


def _state_dict(state: TrainState, comm: Communicator, extra: Mapping[str, Any] | None,
                frozen: bool) -> dict[str, Any]:
    """The flat state dict a save writes (see the module doc): views of ``state``'s tensors, nothing copied.
    Collectives: none, but stage 3's gather of the frozen parameters for their CRC-32s when ``frozen`` is False."""
    manifest = _manifest(state, comm)
    if not frozen:
        manifest.update({"version": VERSION, FROZEN_LEFT_OUT: frozen_crcs(state, comm)})
    state_dict: dict[str, Any] = {MANIFEST_KEY: json.dumps(manifest, sort_keys=True)}
    state_dict.update(_sharded(state, comm, state.shard.master, state.opt.moments))
    state_dict.update({**_replicated(state), **(_frozen(state.layout, state.shard.frozen, comm) if frozen else {})})
    if state.rng:
        state_dict.update({f"{RNG_PREFIX}{r}": state.rng[0][i] for i, r in enumerate(comm.data_ranks)})
    if extra:
        state_dict.update(_flatten_extra(extra))
    return state_dict


def _write_and_publish(state_dict: dict[str, Any], root: Path, name: str, bind: Mapping[str, Any],
                       pg: dist.ProcessGroup | None, *, in_process: bool = False, direct: bool = False) -> None:
    """Write ``state_dict`` into ``root/.tmp-{name}`` with its checksums (``bind``: the step and name they bind), then
    publish it as ``root/name`` and point ``LATEST`` at it (:mod:`.publish`). Collectives on ``pg``: a
    ``broadcast_object_list`` (the directory prepared), DCP's save (a gather and scatter of plans, a gather of write
    results), a barrier, a ``broadcast_object_list`` (published). ``in_process``: DCP's save runs in DCP's writer
    process (:func:`~.planners.dcp_save`), its collectives on that process's own group. ``direct``: the data files
    written around the page cache (:mod:`.direct`)."""
    tmp = root / f"{_TMP_PREFIX}{name}"
    _on_coordinator(pg, "preparing the checkpoint directory", lambda: _prepare_tmp(root, tmp))
    dcp_save(state_dict, tmp, pg, bind=bind, in_process=in_process, direct=direct)
    if pg is not None:
        dist.barrier(group=pg)  # every rank's files are complete before the rename
    _on_coordinator(pg, "publishing the checkpoint", lambda: _publish(root, tmp, name))


def save_checkpoint(state: TrainState, root: PathLike, comm: Communicator, *, name: str | None = None,
                    extra: Mapping[str, Any] | None = None, frozen: bool = True,
                    blocking: bool = True) -> Path | BackgroundSave:
    """Save ``state`` (and ``extra``) as ``root/name`` and point ``root/LATEST`` at it; returns the directory, or with
    ``blocking=False`` a :class:`~.background.BackgroundSave` handle.

    Every rank calls it. Each rank writes only what its shards hold of each parameter's master and moments (never
    padding), and its generator state; replicated tensors and ``extra`` are written once; nothing is gathered. ``name``
    defaults to ``step-{opt.step:08d}``. ``extra``: a nested dict (string keys without ``/``) of tensors, python
    scalars, strings, None and lists/tuples/dicts of them, taken as replicated. Every record gets a CRC-32
    (:mod:`.checksums`). Atomic: written to ``root/.tmp-{name}``, renamed once every rank has finished, then ``LATEST``
    replaced. Saving over the checkpoint ``LATEST`` names raises ``FileExistsError``. ``frozen=False``: the frozen
    parameters are left out (the user keeps them, e.g. as pretrained weights), only their CRC-32s written; loading
    then takes them from the template and checks them against those.

    ``blocking=False``: this rank's part of the state dict (``extra`` too) is copied into host buffers kept for the
    next such save (pinned when the state is on CUDA), and the call returns: the state may be stepped at once
    (donating its buffers). A writer thread (on real ranks through DCP's writer process, :func:`~.planners.dcp_save`)
writes, checksums and publishes the same files a blocking save would;
    ``LATEST`` moves once they are complete. ``handle.wait()`` returns the directory, or raises a
    :class:`CheckpointError` naming the checkpoint if the write failed. One save in flight per process: any save
    (either kind, any root) first waits for the one in flight and raises its failure unless its ``wait()`` already
    did; a failure nothing was told of is warned of at exit. Wait before ``destroy_process_group``.

    Collectives (on a process group): those of :func:`_write_and_publish`, on this call's group when blocking; in the
    writer thread, on a host group of the same ranks made on the first background save (``new_group``, a collective
    of those ranks), when not."""
    ensure_live(state)
    check_world(state.shard, comm)
    pg = _process_group(comm)
    root = Path(root)
    if name is None:
        name = f"step-{int(state.opt.step):08d}"
    _check_name(name)
    settle()  # the save in flight finishes first (or its failure is raised): one save at a time
    # Every rank decides alike (same files), before any collective: no rank is left waiting.
    if _read_latest(root) == name:
        raise FileExistsError(f"{root / name} is the latest checkpoint ({root / LATEST}); saving over it would leave "
                              "no complete checkpoint while it is rewritten: choose another name")
    state_dict = _state_dict(state, comm, extra, frozen)
    bind = {"step": int(state.opt.step), "name": name}
    if blocking:
        _write_and_publish(state_dict, root, name, bind, pg)
        return root / name
    group = checkpoint_group(pg)
    # Real ranks write in DCP's writer process (the training keeps its GIL: measured, a writer thread slows the steps
    # it overlaps 1.3-2x); one process (the simulated world) in the writer thread.
    in_process = group is not None
    # Written around the page cache: through it, the kernel's copy and writeback of the shards (its threads at
    # normal priority, whatever the writer's) slow the steps they overlap by more than the writer itself does.
    return start(root / name, state_dict, lambda held: _write_and_publish(held, root, name, bind, group,
                                                                          in_process=in_process, direct=True),
                 shared=in_process)


def load_checkpoint(path: PathLike, template: TrainState, comm: Communicator, *, hyperparams: str = "checkpoint",
                    donate: bool = False, follow_symlinks: bool = False) -> tuple[TrainState, dict[str, Any]]:
    """Load a checkpoint into a state shaped like ``template``; returns ``(state, extra)``.

    ``path``: a root written by :func:`save_checkpoint` (its ``LATEST`` is loaded) or one checkpoint directory.
    ``template``: built for *this* world by :func:`fzero.init_train_state` (same model, optimizer, scaler configuration
    and precision; any world size and alignment). Each rank reads only the slices its new shards own; padding is zero.
    ``params`` is regathered (one ``all_gather`` per flat group), or kept empty if the template's is (stage 3).

    ``hyperparams``: ``"checkpoint"`` (default, as ``torch.optim``'s ``load_state_dict``) restores the saved
    hyperparameters; ``"template"`` keeps the template's (e.g. a new learning rate to fine-tune). ``donate``: False
    leaves the template untouched (the peak holds two states); True loads into the template's own master, moment and
    parameter buffers (peak: one state plus one saved chunk) and consumes the template (fzero functions given it raise
    ``ValueError``).

    Generators: rank ``r`` continues from the state rank ``r`` saved, so a resumed run draws what the uninterrupted one
    would have. A rank the saved run did not have, or every rank for a checkpoint saved without generators, keeps the
    template's; a template with ``seed=None`` keeps none.

    Nothing in the checkpoint runs (:mod:`.metadata`); only regular files within their limits are read, inside ``path``
    unless ``follow_symlinks`` (:class:`~.files.Files`). Raises (checked first, on every rank alike)
    :class:`CheckpointCorruptError` for damaged metadata, checksums or files (or ``LATEST`` naming another checkpoint's
    files), :class:`IncompleteCheckpointError` for a missing or truncated file, :class:`CheckpointMismatchError` naming
    the first difference of model/optimizer/scaler/precision; while reading, :class:`CheckpointCorruptError` naming the
    entry and data file of a record failing its checksum. Collectives: DCP's load (plans scatter, a final gather), then
    the gathers."""
    if hyperparams not in HYPERPARAMS:
        raise ValueError(f"load_checkpoint: hyperparams must be one of {HYPERPARAMS}, got {hyperparams!r}")
    ensure_live(template)
    check_world(template.shard, comm)
    pg = _process_group(comm)
    checked, left_out, man = _validated(path, template, comm, follow_symlinks)
    d, metadata = checked.dir, checked.metadata
    saved = metadata.state_dict_metadata
    replicated = {k: torch.empty_like(v) for k, v in _replicated(template).items()}
    if MISSED_KEY in replicated and MISSED_KEY in saved:  # as long as the saved rank groups made it
        replicated[MISSED_KEY] = replicated[MISSED_KEY].new_empty(missed_length(man))
    frozen, frozen_sd, whole = _frozen_destinations(template, comm, saved, left_out)
    if hyperparams == "template":
        replicated = {k: v for k, v in replicated.items() if not k.startswith(_HYPER_PREFIX)}
    no_missed: dict[str, torch.Tensor] = {}
    if MISSED_KEY in replicated and MISSED_KEY not in saved:  # saved before per-parameter step counts
        no_missed[MISSED_KEY] = torch.zeros_like(replicated.pop(MISSED_KEY))
    no_calls = CALLS_KEY in replicated and CALLS_KEY not in saved  # saved before the state counted its calls
    if no_calls:
        replicated.pop(CALLS_KEY)
    _check_entries(d, metadata, {**_sharded(template, comm, template.shard.master, template.opt.moments), **frozen_sd,
                                 **replicated})
    # zeros: the padding the new layout adds must be zero (update rules keep it so)
    masters = tuple(m.zero_() if donate else torch.zeros_like(m) for m in template.shard.master)
    moments = tuple(tuple(m.zero_() if donate else torch.zeros_like(m) for m in ms) for ms in template.opt.moments)
    extra = {k: torch.empty(md.size, dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None
             for k, md in sorted(saved.items()) if k.startswith(EXTRA_PREFIX)}  # DCP replaces None by the object
    sd: dict[str, Any] = {**_sharded(template, comm, masters, moments), **frozen_sd, **replicated, **extra}
    sd.update(_rng_destinations(template, comm, metadata))
    dcp_load(sd, checked, pg)
    first = [comm.ranks.index(r) for r in comm.ranks]  # a simulated mesh reads each shard once: the copies follow
    if first != list(range(len(first))):
        held = frozen if template.layout.frozen_groups and left_out is None and whole is None else ()
        for rows in (*masters, *(m for ms in moments for m in ms), *held):
            rows.copy_(rows[first])
    if whole is not None:  # saved whole in their shapes: cut as the template holds them
        frozen = frozen_rows(template.layout, whole, comm.ranks, lambda t: t,
                             lambda g: template.shard.frozen[g.index].dtype)
    if hyperparams == "template":
        replicated.update({k: v.clone() for k, v in _replicated(template).items() if k.startswith(_HYPER_PREFIX)})
    replicated.update(no_missed)
    if MISSED_KEY in replicated and MISSED_KEY not in no_missed:  # the saved rank groups' counts, in this state's
        replicated[MISSED_KEY] = _regrouped_missed(template.layout, man, replicated[MISSED_KEY], d)
    if no_calls:  # the applied steps are the best count known
        replicated[CALLS_KEY] = replicated["fzero/step"].to("cpu", torch.int64).clone()
    # donating, the parameters are regathered into the template's own buffers: nothing of their size allocated
    state = _assemble(template, comm, masters, moments, frozen, replicated, into=template.params if donate else None)
    if template.rng:
        rows = [sd.get(f"{RNG_PREFIX}{r}", template.rng[0][i].clone()) for i, r in enumerate(comm.data_ranks)]
        state = replace(state, rng=(torch.stack(rows),))
    if donate:
        state = consume(template, state)
    return state, _unflatten_extra({k: sd[k] for k in extra})


def _frozen_destinations(template: TrainState, comm: Communicator, saved: Mapping[str, Any],
                         left_out: dict | None) -> tuple[Any, dict[str, Any], list | None]:
    """Where the frozen parameters are read to: ``(ShardState.frozen, entries, whole)``. Left out: the template's own
    (checked against the saved CRC-32s in :func:`_validated`). A checkpoint written before manifest version 3 keeps
    each one in its shape: ``whole`` (layout order, None for trainable ones) is read, then cut."""
    lay = template.layout
    if left_out is not None:
        return template.shard.frozen, {}, None
    if all(getattr(saved.get(FROZEN_PREFIX + s.path), "size", None) in (None, torch.Size([s.numel]))
           for s in lay.frozen_slots):
        frozen = tuple(map(torch.zeros_like, template.shard.frozen))
        return frozen, _frozen(lay, frozen, comm), None
    frozen = template.shard.frozen  # stage 3: one per frozen group, else one per frozen parameter
    held = {s.path: frozen[s.frozen_group].dtype for s in lay.frozen_slots} if lay.frozen_groups else \
        {s.path: f.dtype for s, f in zip(lay.frozen_slots, frozen)}
    whole = [None if s.group >= 0 else torch.empty(s.shape, dtype=held[s.path]) for s in lay.slots]
    return None, {FROZEN_PREFIX + s.path: w for s, w in zip(lay.slots, whole) if w is not None and s.numel}, whole


def _regrouped_missed(layout: Layout, man: Mapping[str, Any], missed: torch.Tensor, d: Path) -> torch.Tensor:
    """``OptState.missed`` of a checkpoint (its manifest ``man``'s rank groups) in ``layout``'s positions: each rank
    group's count from the saved rank groups whose experts it holds (:func:`~.manifest.regroup_missed`)."""
    shapes = {p[0]: p[1] for p in man["params"]}
    parts = {s.path: layout.parts(s.axis) for s in layout.trainable_slots}
    table = regroup_missed(missed_table(man, missed.tolist()), shapes, parts, f"checkpoint {d}")
    out = [0] * layout.num_positions
    index, moved = trainable_index(layout), positions(layout)
    for i, k in index.items():
        out[k] = table[layout.slots[i].path][0]
    for (i, q), k in moved.items():
        out[k] = table[layout.slots[i].path][q]
    return torch.tensor(out, dtype=missed.dtype, device=missed.device)


def _validated(path: PathLike, template: TrainState, comm: Communicator,
               follow_symlinks: bool) -> tuple[CheckedDir, dict | None, dict[str, Any]]:
    """The checked checkpoint directory, once complete and matching ``template``, the CRC-32s of the frozen
    parameters it left out (None: it holds them), which the template's match, and its manifest."""
    checked = checked_metadata(path, follow_symlinks=follow_symlinks)
    saved = _read_manifest(checked)
    diff = _manifest_difference(saved, _manifest(template, comm))
    left_out = saved.get(FROZEN_LEFT_OUT)
    if diff is None and left_out is not None:
        mine = frozen_crcs(template, comm)
        diff = next((f"frozen parameter {p!r}, left out of the checkpoint: {crc} vs the template's {mine.get(p)}; "
                     "build the template from the weights it was saved with" for p, crc in left_out.items()
                     if mine.get(p) != crc), None)
    if diff is not None:
        raise CheckpointMismatchError(f"checkpoint {checked.dir} does not match this training state: {diff} "
                                      "(checkpoint vs this state)")
    return checked, left_out, saved


def _assemble(template: TrainState, comm: Communicator, masters: tuple[torch.Tensor, ...],
              moments: tuple[tuple[torch.Tensor, ...], ...], frozen: tuple[torch.Tensor, ...],
              replicated: Mapping[str, torch.Tensor],
              into: Sequence[torch.Tensor] | None = None) -> TrainState:
    """``template`` with the loaded leaves, and ``params`` regathered (one ``all_gather`` per flat group;
    ``into``: into those buffers) unless the template keeps none (stage 3)."""
    opt = template.opt
    hyper = tuple({name: replicated[f"{_HYPER_PREFIX}{k}/{name}"] for name in h} for k, h in enumerate(opt.hyper))
    shard = replace(template.shard, master=masters, frozen=frozen)
    scaler = replace(template.scaler, scale=replicated["fzero/scaler/scale"],
                     growth_tracker=replicated["fzero/scaler/growth_tracker"],
                     hysteresis_left=replicated["fzero/scaler/hysteresis_left"])
    params = ()
    if len(template.params):
        params = all_gather_params(shard, comm, template.precision.param_dtype, into=into or None)
    saved = dict(persistent_buffers(template))
    buffers = tuple(replicated[f"{BUFFER_PREFIX}{n}"].unsqueeze(0).expand_as(b).clone() if n in saved else b
                    for n, b in zip(template.module.buffers, template.buffers))
    missed = (replicated[MISSED_KEY],) if MISSED_KEY in replicated else opt.missed
    # read once here, so that the step knows on the host whether any parameter sat out a step (no read in a step)
    all_stepped = not any(bool(m.any()) for m in missed)
    return replace(
        template, shard=shard,
        opt=replace(opt, step=replicated["fzero/step"], hyper=hyper, moments=moments, missed=missed,
                    all_stepped=all_stepped,
                    scalars=tuple(replicated[f"{SCALAR_PREFIX}{n}"] for n in opt.optimizer.scalar_names)
                    if opt.scalars else opt.scalars,
                    vectors=tuple(replicated.get(f"{VECTOR_PREFIX}{n}", v)
                                  for n, v in zip(opt.optimizer.vector_names, opt.vectors))),
        scaler=scaler, params=params, buffers=buffers,
        calls=(replicated[CALLS_KEY],) if CALLS_KEY in replicated else template.calls,
    )
