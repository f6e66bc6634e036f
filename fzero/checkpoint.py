"""Checkpoints of a :class:`~fzero.step.TrainState` with ``torch.distributed.checkpoint``
(DCP), and interchange with ``torch.optim`` state dicts.

What a checkpoint holds (DCP keys):

* ``fzero/master/{path}`` and ``fzero/{moment}/{path}`` (``exp_avg``...): each
  trainable parameter's fp32 master and optimizer moments, flattened to one
  logical 1-D tensor of the parameter's ``numel``. Every rank writes only the
  part of it that lies in the flat-buffer range it owns (nothing if it owns
  only padding). Keys are per parameter, not per flat buffer, so the data do
  not depend on the world size, the alignment, the padding or how parameters
  are grouped into flat buffers and ZeRO-3 buckets: loading into another
  layout reads, for each of its rows, exactly the parameter slices the new
  layout assigns to it (DCP reads the overlapping parts of the saved chunks)
  and zero-fills the new padding.
* ``fzero/step``, ``fzero/hyper/{opt group}/{name}``, ``fzero/scaler/{leaf}``,
  ``fzero/frozen/{path}``: replicated tensors; DCP writes each once.
* ``extra/{key}/{key}...``: what the caller passes along (data-loader position,
  RNG state...): tensors as tensors, other values through DCP's object entries.
* ``fzero/manifest``: a JSON object entry describing what must agree
  (parameters: path, shape, dtype, optimizer group; optimizer kind, flags and
  moments; scaler configuration; precision). Loading compares it with the
  template state before reading anything else and names the first difference.
  ``TrainState.params`` (the gathered compute-dtype parameters) is derived
  data: not saved, rebuilt with one ``all_gather`` per flat group on load
  (kept empty when the template's is empty, as ZeRO stage 3 keeps it). So
  checkpoints move freely between stages 1, 2 and 3.

Uneven shards. DTensor describes only ``torch.chunk``-style even shards, and
``ShardedTensor`` (which can describe arbitrary offsets) needs an initialised
process group, so it cannot serve the simulated world (W ranks in one process,
no process group). Instead each parameter is given to DCP as a small
:class:`_Pieces` object that implements DCP's checkpointable protocol
(``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``):
a list of ``(offset, 1-D view)`` pieces of one global tensor. DCP's own
planning, deduplication, validation (saved chunks must tile the tensor) and
resharding reads do the rest; the planners below only teach the lookup of a
piece by its offset (DCP's default lookup honours the protocol on
``torch.Tensor`` subclasses only). On a real rank a parameter has at most one
piece per process; on the simulated world one per simulated rank, all written
by the one process (``no_dist=True``). The files are the same DCP format
either way, so a checkpoint saved on gloo loads on the simulated world and
vice versa.

Atomic publication. ``save_checkpoint(state, root, comm, name=...)`` writes
into ``root/.tmp-{name}``; after every rank has finished (DCP's final
collective, then a barrier) the coordinator renames it to ``root/{name}``
and then atomically replaces ``root/LATEST`` (temporary file, fsync,
``os.replace``). A save killed at any point leaves ``LATEST`` naming the
previous, complete checkpoint. DCP writes ``.metadata`` last; loading checks
it exists, that every data file it names exists and is long enough, and only
then reads: an incomplete checkpoint raises :class:`IncompleteCheckpointError`,
a checkpoint of another model or optimizer :class:`CheckpointMismatchError`.

Memory: nothing is gathered to save or load. The exports gather one flat
buffer at a time (one ``all_gather``); each exported tensor is a view of that
buffer, so the result is the only full copy.

Imports: ``fzero.step`` and what it imports, and ``fzero.dist``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import (
    DefaultSavePlanner,
    create_default_local_load_plan,
)
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from .comm import Communicator, CountingCommunicator
from .dist import TorchCommunicator
from .layout import Layout, flat_shard, group_views
from .optim import Optimizer
from .pytree import replace
from .sharding import check_world, gather_flat_params
from .step import TrainState, ensure_live

__all__ = [
    "CheckpointError",
    "IncompleteCheckpointError",
    "CheckpointMismatchError",
    "save_checkpoint",
    "load_checkpoint",
    "resolve_checkpoint",
    "read_manifest",
    "export_model_state_dict",
    "export_torch_optim_state_dict",
    "import_torch_optim_state_dict",
]

FORMAT = "fzero-checkpoint"
VERSION = 1
LATEST = "LATEST"
MANIFEST_KEY = "fzero/manifest"
EXTRA_PREFIX = "extra/"
_TMP_PREFIX = ".tmp-"
_OLD_PREFIX = ".old-"

PathLike = Union[str, os.PathLike]


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded into the given state."""


class IncompleteCheckpointError(CheckpointError):
    """The checkpoint is missing its metadata or data (an interrupted save, a damaged copy)."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint belongs to another model, optimizer, scaler or precision policy."""


# -- uneven 1-D shards for DCP ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Pieces:
    """Pieces ``(global offset, 1-D tensor)`` of a global 1-D tensor of ``numel`` elements
    held by this process, in DCP's checkpointable protocol.

    Saving: each piece becomes one DCP chunk. Loading: each piece is a view into
    the destination buffer that DCP fills from the saved chunks overlapping it.
    """

    numel: int
    dtype: torch.dtype
    pieces: tuple[tuple[int, torch.Tensor], ...]

    def size(self) -> torch.Size:
        # DCP compares this with the saved size of the key before planning reads.
        return torch.Size([self.numel])

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size([off])),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size([off]), sizes=t.size()),
                    properties=TensorProperties.create_from_tensor(t),
                    size=self.size(),
                ),
            )
            for off, t in self.pieces
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size([off]), sizes=t.size()) for off, t in self.pieces]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for off, t in self.pieces:
            if index.offset is not None and tuple(index.offset) == (off,):
                return t
        raise ValueError(f"{index.fqn}: this process holds no piece at offset {index.offset}")


def _param_pieces(layout: Layout, rows: Sequence[torch.Tensor], ranks: Sequence[int]) -> dict[str, _Pieces]:
    """Each trainable parameter's elements held in ``rows`` (one ``[R, shard_numel]`` buffer
    per flat group, row ``i`` owned by rank ``ranks[i]``), as pieces of the parameter
    flattened to 1-D: the intersection of each row's range with the parameter's.

    Views, no copy. Padding belongs to no parameter, so it is never included; a
    rank that owns only padding contributes no piece.
    """
    out: dict[str, _Pieces] = {}
    for g in layout.groups:
        n, buf = g.shard_numel, rows[g.index]
        for i in g.slots:
            s = layout.slots[i]
            if s.numel == 0:
                continue  # nothing to save; DCP would record no chunk for it
            pieces = []
            for row, r in enumerate(ranks):
                lo, hi = max(r * n, s.offset), min((r + 1) * n, s.offset + s.numel)
                if lo < hi:
                    pieces.append((lo - s.offset, buf[row, lo - r * n : hi - r * n]))
            out[s.path] = _Pieces(s.numel, buf.dtype, tuple(pieces))
    return out


class _SavePlanner(DefaultSavePlanner):
    """DCP's default save planner on an already flat state dict, plus lookup of
    :class:`_Pieces` chunks by offset (the default accepts the checkpointable
    protocol only on tensor subclasses)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, _Pieces):
            return obj.__get_tensor_shard__(index)
        return super().lookup_object(index)


class _LoadPlanner(LoadPlanner):
    """Reads into the tensors and :class:`_Pieces` of a flat state dict, in place.

    Plans with DCP's default ``create_default_local_load_plan`` (one read per
    overlap of a wanted chunk with a saved chunk: the resharding). Object
    entries are unpickled with ``weights_only=True`` (primitives, containers,
    tensors), as ``torch.load`` does by default.
    """

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Optional[Metadata] = None, is_coordinator: bool = False
    ) -> None:
        self.state_dict = state_dict
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        return create_default_local_load_plan(self.state_dict, self.metadata, True)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        obj = self.state_dict[read_item.dest_index.fqn]
        target = obj.__get_tensor_shard__(read_item.dest_index) if isinstance(obj, _Pieces) else obj
        return _narrow(target, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # resolve_tensor handed out a view of the destination: already in place


def _narrow(t: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    """The view of ``t`` starting at ``offsets`` with ``lengths`` elements along each dimension."""
    for dim, (o, n) in enumerate(zip(offsets, lengths)):
        t = t.narrow(dim, o, n)
    return t


_SINGLE_PROCESS_NOTICE = ".*assuming the intent is to (save|load) in a single process.*"


def _dcp_save(state_dict: dict[str, Any], path: Path, pg: Optional[dist.ProcessGroup]) -> None:
    with warnings.catch_warnings():
        # DCP warns when it runs in one process (no_dist): here that is intended.
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_NOTICE)
        dcp.save(
            state_dict,
            storage_writer=dcp.FileSystemWriter(path, sync_files=True),
            planner=_SavePlanner(),
            process_group=pg,
            no_dist=pg is None,
        )


def _dcp_load(state_dict: dict[str, Any], path: Path, pg: Optional[dist.ProcessGroup]) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_NOTICE)
        dcp.load(
            state_dict,
            storage_reader=dcp.FileSystemReader(path),
            planner=_LoadPlanner(),
            process_group=pg,
            no_dist=pg is None,
        )


# -- process group and coordination ------------------------------------------------------


def _process_group(comm: Communicator) -> Optional[dist.ProcessGroup]:
    """The process group of ``comm``; None when one process holds every rank (the simulated world)."""
    inner = comm
    while isinstance(inner, CountingCommunicator):
        inner = inner.inner
    if isinstance(inner, TorchCommunicator):
        return inner.group
    if comm.local_ranks == comm.world_size:
        return None
    raise TypeError(
        f"checkpoints need a communicator that holds every rank in one process or a "
        f"TorchCommunicator; got {comm!r}"
    )


def _is_coordinator(pg: Optional[dist.ProcessGroup]) -> bool:
    return pg is None or dist.get_rank(pg) == 0


def _on_coordinator(pg: Optional[dist.ProcessGroup], what: str, fn: Callable[[], None]) -> None:
    """Run ``fn`` on the coordinator (rank 0 of ``pg``); every rank returns after it, or raises
    if it failed. Collective: one ``broadcast_object_list`` of the outcome (none in one process)."""
    error: Optional[BaseException] = None
    if _is_coordinator(pg):
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - every rank must learn of it, then it is re-raised
            error = e
    if pg is not None:
        box = [None if error is None else f"{type(error).__name__}: {error}"]
        dist.broadcast_object_list(box, group_src=0, group=pg)
        if error is None and box[0] is not None:
            raise RuntimeError(f"{what} failed on the coordinator rank: {box[0]}")
    if error is not None:
        raise error


# -- the manifest ------------------------------------------------------------------------


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
        "structure": str(lay.spec),
        "saved_world_size": comm.world_size,
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
    for section in ("optimizer", "scaler", "precision"):
        for key, value in mine[section].items():  # in _manifest's order: kind before details
            if saved[section].get(key) != value:
                return f"{section} {key}: {saved[section].get(key)!r} vs {value!r}"
    return None


# -- state <-> flat DCP state dict ---------------------------------------------------------


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
    if extra:
        sd.update(_flatten_extra(extra))
    return sd


def _replicated(state: TrainState) -> dict[str, torch.Tensor]:
    """Tensors every rank holds whole: step, hyperparameters, scaler leaves, frozen parameters."""
    sd = {"fzero/step": state.opt.step}
    for k, h in enumerate(state.opt.hyper):
        for name, v in h.items():
            sd[f"fzero/hyper/{k}/{name}"] = v
    sc = state.scaler
    sd.update({
        "fzero/scaler/scale": sc.scale,
        "fzero/scaler/growth_tracker": sc.growth_tracker,
        "fzero/scaler/hysteresis_left": sc.hysteresis_left,
    })
    for s, f in zip(state.layout.frozen_slots, state.shard.frozen):
        sd[f"fzero/frozen/{s.path}"] = f
    return sd


# -- saving ------------------------------------------------------------------------------


def _check_name(name: str) -> None:
    if (
        not isinstance(name, str) or not name or name != os.path.basename(name)
        or name.startswith(".") or name == LATEST
    ):
        raise ValueError(
            f"checkpoint name must be a plain directory name (no '/', not starting with '.', "
            f"not {LATEST!r}), got {name!r}"
        )


def _read_latest(root: Path) -> Optional[str]:
    try:
        name = (root / LATEST).read_text().strip()
    except FileNotFoundError:
        return None
    try:
        _check_name(name)
    except ValueError:
        raise IncompleteCheckpointError(f"{root / LATEST} holds {name!r}: not a checkpoint name") from None
    return name


def _fsync_dir(path: Path) -> None:
    # A rename is durable only once its directory is synced.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_latest(root: Path, name: str) -> None:
    """Point ``root/LATEST`` at ``name`` atomically: temporary file, fsync, ``os.replace``."""
    tmp = root / f".{LATEST}.{uuid.uuid4().hex}"
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    _fsync_dir(root)


def _prepare_tmp(root: Path, tmp: Path) -> None:
    """A fresh empty ``tmp``; leftovers of interrupted saves in ``root`` are removed
    (a root belongs to one run: one save at a time)."""
    root.mkdir(parents=True, exist_ok=True)
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith((_TMP_PREFIX, _OLD_PREFIX)):
            shutil.rmtree(p)
        elif p.is_file() and p.name.startswith(f".{LATEST}."):
            p.unlink()
    tmp.mkdir()


def _publish(root: Path, tmp: Path, name: str) -> None:
    """Rename the finished ``tmp`` to ``root/name``, then point ``LATEST`` at it.

    A stale directory of that name (not the one ``LATEST`` names: that was
    refused earlier) is moved aside first and removed last.
    """
    _fsync_dir(tmp)
    final = root / name
    aside = None
    if final.exists():
        aside = root / f"{_OLD_PREFIX}{name}-{uuid.uuid4().hex}"
        os.replace(final, aside)
    os.replace(tmp, final)
    _fsync_dir(root)
    _write_latest(root, name)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


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
    _dcp_save(state_dict, tmp, pg)
    if pg is not None:
        dist.barrier(group=pg)  # every rank's files are complete before the rename
    _on_coordinator(pg, "publishing the checkpoint", lambda: _publish(root, tmp, name))
    return root / name


# -- loading -----------------------------------------------------------------------------


def resolve_checkpoint(path: PathLike) -> Path:
    """The checkpoint directory ``path`` designates: ``path/LATEST``'s target when
    ``path`` is a root, else ``path`` itself. Raises :class:`IncompleteCheckpointError`
    when it has no DCP ``.metadata`` (written last, so its absence means the save
    did not finish) and ``FileNotFoundError`` when ``path`` does not exist."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"no checkpoint at {p}: the path does not exist")
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
    d = resolve_checkpoint(path)
    metadata = _read_metadata(d)
    _check_data_files(d, metadata)
    return _read_manifest(d, metadata)


def _read_manifest(d: Path, metadata: Metadata) -> dict[str, Any]:
    if not isinstance(metadata.state_dict_metadata.get(MANIFEST_KEY), BytesStorageMetadata):
        raise CheckpointMismatchError(f"{d} is a DCP checkpoint without a manifest: not an fzero checkpoint")
    box: dict[str, Any] = {MANIFEST_KEY: None}
    _dcp_load(box, d, None)  # this process only: every rank validates on its own, no collective
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


def _fresh_rows(template: torch.Tensor) -> torch.Tensor:
    # Zeros: the padding the new layout adds must be zero (update rules keep it so).
    return torch.zeros_like(template)


def load_checkpoint(
    path: PathLike, template: TrainState, comm: Communicator
) -> tuple[TrainState, dict[str, Any]]:
    """Load a checkpoint into a state shaped like ``template``; returns ``(state, extra)``.

    ``path``: a root written by :func:`save_checkpoint` (its ``LATEST`` is loaded) or
    one checkpoint directory. ``template``: built for *this* world with
    :func:`fzero.init_train_state` (same model, optimizer, scaler configuration and
    precision as the saved run; any world size and alignment). Its values are not
    used and not modified. Each rank reads only the slices its new shards own;
    padding is zero. ``params`` is rebuilt (one ``all_gather`` per flat group),
    or kept empty if the template's is empty (ZeRO stage 3).

    Checks first, on every rank alike: :class:`IncompleteCheckpointError` if
    ``.metadata`` or a data file is missing or truncated; :class:`CheckpointMismatchError`
    naming the first difference for another model/optimizer/scaler/precision.
    Collectives: DCP's load (plans scatter, a final gather), then the gathers.
    """
    ensure_live(template)
    check_world(template.shard, comm)
    pg = _process_group(comm)
    d, metadata = _validated(path, template, comm)
    masters = tuple(_fresh_rows(m) for m in template.shard.master)
    moments = tuple(tuple(_fresh_rows(m) for m in ms) for ms in template.opt.moments)
    replicated = {k: torch.empty_like(v) for k, v in _replicated(template).items()}
    sd: dict[str, Any] = {**_sharded(template, comm, masters, moments), **replicated}
    _check_entries(d, metadata, sd)
    extra = _extra_destinations(metadata)
    sd.update(extra)
    try:
        _dcp_load(sd, d, pg)
    except Exception as e:  # noqa: BLE001 - reported with the checkpoint named
        raise CheckpointError(f"reading checkpoint {d} failed: {e}") from e
    state = _assemble(template, comm, masters, moments, replicated)
    return state, _unflatten_extra({k: sd[k] for k in extra})


def _validated(path: PathLike, template: TrainState, comm: Communicator) -> tuple[Path, Metadata]:
    """The checkpoint directory and its DCP metadata, once complete and matching ``template``."""
    d = resolve_checkpoint(path)
    metadata = _read_metadata(d)
    _check_data_files(d, metadata)
    diff = _manifest_difference(_read_manifest(d, metadata), _manifest(template, comm))
    if diff is not None:
        raise CheckpointMismatchError(
            f"checkpoint {d} does not match this training state: {diff} (checkpoint vs this state)"
        )
    return d, metadata


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
) -> TrainState:
    """``template`` with the loaded leaves, and ``params`` regathered (one ``all_gather``
    per flat group) unless the template keeps none (stage 3)."""
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
    params = gather_flat_params(shard, comm, template.precision.param_dtype) if len(template.params) else ()
    return replace(
        template,
        shard=shard,
        opt=replace(opt, step=replicated["fzero/step"], hyper=hyper, moments=moments),
        scaler=scaler,
        params=params,
    )


# -- torch.optim interchange ----------------------------------------------------------------


def _full_flat(rows: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """The full padded flat buffer ``[W * shard_numel]`` from this process's ``[R, shard_numel]`` rows.

    One ``all_gather`` on a process group; in one process holding every rank the
    rows already are the buffer (copied, so exports never alias the state).
    """
    if comm.local_ranks == comm.world_size:
        return rows.reshape(-1).clone()
    if comm.local_ranks != 1:
        raise TypeError(f"export: unsupported communicator: {comm.local_ranks} of {comm.world_size} ranks here")
    return comm.all_gather(rows)[0]


def _torch_order(layout: Layout, optimizer: Optimizer) -> list[list[int]]:
    """Per optimizer group, the indices into ``layout.slots`` of its parameters in tree order:
    the order of the ``params`` of a torch optimizer built group by group from the model's
    parameters. torch numbers parameters consecutively in that order."""
    order: list[list[int]] = [[] for _ in range(optimizer.num_groups)]
    for i, s in enumerate(layout.slots):
        if s.group >= 0:
            order[layout.groups[s.group].opt_group].append(i)
    return order


_TORCH_CLASSES = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def _torch_kwargs(optimizer: Optimizer, hyper: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    h = {k: float(v) for k, v in hyper.items()}
    if optimizer.kind == "sgd":
        return dict(
            lr=h["lr"], momentum=h["momentum"], dampening=h["dampening"], weight_decay=h["weight_decay"],
            nesterov=optimizer.nesterov, maximize=optimizer.maximize,
        )
    return dict(
        lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"], weight_decay=h["weight_decay"],
        amsgrad=optimizer.amsgrad, maximize=optimizer.maximize,
    )


def _torch_param_group(optimizer: Optimizer, hyper: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The param group (without ``params``) torch's optimizer class keeps for these
    hyperparameters: the class itself fills in every key of this torch version."""
    cls = _TORCH_CLASSES[optimizer.kind]
    probe = cls([torch.zeros(1, requires_grad=True)], **_torch_kwargs(optimizer, hyper))
    group = dict(probe.param_groups[0])
    del group["params"]
    return group


def export_model_state_dict(state: TrainState, comm: Communicator) -> dict[str, torch.Tensor]:
    """The full parameters ``{path: tensor}`` in tree order, as ``module.state_dict()``
    holds them (parameters only; a module's buffers are not part of fzero's state).

    Values are the fp32 master's, cast to each parameter's own dtype and shape;
    frozen parameters are copied. Collectives: one ``all_gather`` per flat group,
    one at a time; every exported trainable tensor is a view of its group's
    gathered buffer, so at most one full copy of the parameters exists.
    """
    ensure_live(state)
    check_world(state.shard, comm)
    lay = state.layout
    out: dict[str, torch.Tensor] = {}
    for g in lay.groups:
        full = _full_flat(state.shard.master[g.index], comm)
        for i, v in zip(g.slots, group_views(lay, g, full)):
            out[lay.slots[i].path] = v.to(lay.slots[i].dtype)
    for s, f in zip(lay.frozen_slots, state.shard.frozen):
        out[s.path] = f.detach().clone()
    return {s.path: out[s.path] for s in lay.slots}


def export_torch_optim_state_dict(state: TrainState, comm: Communicator) -> dict[str, Any]:
    """The ``state_dict()`` of the ``torch.optim`` optimizer (SGD, Adam or AdamW) that
    would have trained the same model the same way; ``load_state_dict`` takes it as it is.

    Parameters are numbered as torch numbers them for an optimizer built from the
    model's trainable parameters group by group (optimizer group 0 first), each group
    in tree order: with one group, the model's parameter order. Per parameter:
    ``step`` (Adam/AdamW; a float32 0-d tensor, torch's non-capturable default) and
    the moments in the parameter's dtype; empty before the first applied step, as in
    torch. ``param_groups``: torch's keys for this torch version, the hyperparameters
    from the state. Collectives: one ``all_gather`` per flat group and moment, one at
    a time; exported moments are views of the gathered buffers.
    """
    ensure_live(state)
    check_world(state.shard, comm)
    lay, opt = state.layout, state.opt.optimizer
    order = _torch_order(lay, opt)
    index = {slot: n for n, slot in enumerate(i for group in order for i in group)}
    step = int(state.opt.step)
    per_param: dict[int, dict[str, Any]] = {}
    if step > 0 and opt.moment_names:
        for slot in index:
            per_param[index[slot]] = (
                {} if opt.kind == "sgd" else {"step": torch.tensor(float(step), dtype=torch.float32)}
            )
        for g in lay.groups:
            for name, rows in zip(opt.moment_names, state.opt.moments[g.index]):
                full = _full_flat(rows, comm)
                for i, v in zip(g.slots, group_views(lay, g, full)):
                    per_param[index[i]][name] = v.to(lay.slots[i].dtype)
    groups = []
    for k, slots in enumerate(order):
        group = _torch_param_group(opt, state.opt.hyper[k])
        group["params"] = [index[i] for i in slots]
        groups.append(group)
    return {"state": dict(sorted(per_param.items())), "param_groups": groups}


def _torch_group_hyper(
    optimizer: Optimizer, k: int, group: Mapping[str, Any], template: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """fzero's hyperparameters of optimizer group ``k`` from a torch param group;
    ``CheckpointMismatchError`` naming what differs when it belongs to another kind
    of optimizer or to other static flags."""
    if "betas" in group:
        # torch >= 2.6 tells Adam from AdamW by this key; without it either reads the other's state.
        known = "decoupled_weight_decay" in group
        kind = "adamw" if group.get("decoupled_weight_decay") else "adam"
    elif "momentum" in group:
        known, kind = True, "sgd"
    else:
        raise CheckpointMismatchError(f"torch param group {k}: neither SGD's 'momentum' nor Adam's 'betas'")
    is_sgd = kind == "sgd"
    if kind != optimizer.kind and (known or is_sgd or optimizer.kind == "sgd"):
        raise CheckpointMismatchError(
            f"torch param group {k} belongs to {kind}, this state's optimizer is {optimizer.kind}"
        )
    flags = {"maximize": optimizer.maximize}
    if is_sgd:
        flags["nesterov"] = optimizer.nesterov
        if (float(group["momentum"]) != 0) != optimizer.momentum_buffer:
            raise CheckpointMismatchError(
                f"torch param group {k}: momentum {group['momentum']} but this state's SGD "
                f"{'has' if optimizer.momentum_buffer else 'has no'} momentum buffer"
            )
    else:
        flags["amsgrad"] = optimizer.amsgrad
    for flag, mine in flags.items():
        if bool(group.get(flag, False)) != mine:
            raise CheckpointMismatchError(f"torch param group {k}: {flag} {group.get(flag)}, here {mine}")
    values = dict(group)
    if not is_sgd:
        values["beta1"], values["beta2"] = group["betas"]
    out = {}
    for name, t in template.items():
        if name not in values:
            raise CheckpointMismatchError(f"torch param group {k} has no {name!r}")
        out[name] = torch.tensor(float(values[name]), dtype=t.dtype, device=t.device)
    return out


def _torch_step(optimizer: Optimizer, states: Sequence[Mapping[str, Any]]) -> int:
    """fzero's single step count from torch's per-parameter state."""
    if optimizer.kind == "sgd":
        # torch's SGD keeps no count; a momentum buffer exists only after the first step.
        return int(any(s.get("momentum_buffer") is not None for s in states))
    steps = {int(float(s["step"])) for s in states if "step" in s}
    if len(steps) > 1:
        raise CheckpointMismatchError(
            f"torch optimizer state has parameters at different steps {sorted(steps)}; fzero keeps one count"
        )
    return steps.pop() if steps else 0


def import_torch_optim_state_dict(
    template: TrainState,
    model_state_dict: Mapping[str, torch.Tensor],
    optim_state_dict: Mapping[str, Any],
    comm: Communicator,
) -> TrainState:
    """A state for ``template``'s model, optimizer and world holding a ``torch.optim`` run's
    parameters and optimizer state, to continue a run trained without fzero.

    ``model_state_dict``: ``{path: tensor}`` (``module.state_dict()``; extra keys such
    as buffers are ignored). ``optim_state_dict``: a ``torch.optim.SGD/Adam/AdamW``
    ``state_dict()`` of an optimizer built group by group like fzero's groups (see
    :func:`export_torch_optim_state_dict`); parameters are matched by position within
    each group. Hyperparameters come from its param groups; scaler and precision
    from ``template``. Each rank slices out only its own shards: no collective but
    the ``all_gather`` that rebuilds ``params`` (skipped when the template's is empty).
    Raises :class:`CheckpointMismatchError` naming what differs (missing parameter,
    shape, group sizes, optimizer kind or flags).
    """
    ensure_live(template)
    check_world(template.shard, comm)
    lay, opt = template.layout, template.opt.optimizer
    params = _torch_params(lay, model_state_dict)
    hyper, per_slot = _torch_groups(template, optim_state_dict)
    dev = template.shard.master[0].device
    master = _own_rows(lay, params, comm, dev)
    per_moment = []
    for name in opt.moment_names:
        leaves: list[Optional[torch.Tensor]] = [None] * len(lay.slots)
        for i, st in per_slot.items():
            leaves[i] = _moment_or_zeros(st, name, lay.slots[i].shape)
        per_moment.append(_own_rows(lay, leaves, comm, dev))
    moments = tuple(tuple(m[g.index] for m in per_moment) for g in lay.groups)
    frozen_slots = [i for i, s in enumerate(lay.slots) if s.group < 0]
    frozen = tuple(
        params[i].to(device=f.device, dtype=lay.slots[i].dtype).clone()
        for i, f in zip(frozen_slots, template.shard.frozen)
    )
    step = template.opt.step.new_tensor(_torch_step(opt, list(per_slot.values())))
    shard = replace(template.shard, master=master, frozen=frozen)
    new_opt = replace(template.opt, step=step, hyper=hyper, moments=moments)
    gathered = gather_flat_params(shard, comm, template.precision.param_dtype) if len(template.params) else ()
    return replace(template, shard=shard, opt=new_opt, params=gathered)


def _own_rows(
    layout: Layout, leaves: Sequence[Optional[torch.Tensor]], comm: Communicator, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """This process's ``[R, shard_numel]`` rows of every flat group, from full per-slot
    ``leaves`` (None for slots outside the groups): each rank copies only its own slice."""
    return tuple(
        torch.stack([flat_shard(layout, g, leaves, r) for r in comm.ranks]).to(device) for g in layout.groups
    )


def _torch_params(layout: Layout, model_state_dict: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """Every parameter of ``layout`` from a model state dict, in slot order, shapes checked."""
    params = []
    for s in layout.slots:
        t = model_state_dict.get(s.path)
        if t is None:
            raise CheckpointMismatchError(f"model state dict has no parameter {s.path!r}")
        if tuple(t.shape) != s.shape:
            raise CheckpointMismatchError(
                f"model state dict: {s.path!r} has shape {tuple(t.shape)}, this model {s.shape}"
            )
        params.append(t.detach())
    return params


def _torch_groups(
    template: TrainState, optim_state_dict: Mapping[str, Any]
) -> tuple[tuple[dict[str, torch.Tensor], ...], dict[int, Mapping[str, Any]]]:
    """fzero's hyperparameters per optimizer group, and torch's per-parameter state by
    slot index (``{}`` for a parameter torch has not stepped): torch's parameters are
    matched by position within each param group to the group's slots in tree order."""
    lay, opt = template.layout, template.opt.optimizer
    groups = optim_state_dict["param_groups"]
    if len(groups) != opt.num_groups:
        raise CheckpointMismatchError(
            f"torch optimizer has {len(groups)} param groups, this state's optimizer {opt.num_groups}"
        )
    torch_state = optim_state_dict.get("state", {})
    per_slot: dict[int, Mapping[str, Any]] = {}
    hyper = []
    for k, (group, slots) in enumerate(zip(groups, _torch_order(lay, opt))):
        if len(group["params"]) != len(slots):
            raise CheckpointMismatchError(
                f"torch param group {k} has {len(group['params'])} parameters, this state's {len(slots)}"
            )
        hyper.append(_torch_group_hyper(opt, k, group, template.opt.hyper[k]))
        for pid, i in zip(group["params"], slots):
            per_slot[i] = torch_state.get(pid, {})
    return tuple(hyper), per_slot


def _moment_or_zeros(state: Mapping[str, Any], name: str, shape: tuple[int, ...]) -> torch.Tensor:
    # A parameter torch has not stepped yet has no state: its moments are zero.
    t = state.get(name)
    if t is None:
        return torch.zeros(shape)
    if tuple(t.shape) != shape:
        raise CheckpointMismatchError(
            f"torch optimizer state {name!r} has shape {tuple(t.shape)}, expected {shape}"
        )
    return t.detach()
