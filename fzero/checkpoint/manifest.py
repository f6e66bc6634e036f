"""The manifest (what must agree between a checkpoint and the state it loads into), and the checks of a
checkpoint directory before any data are read.

``fzero/manifest`` is a JSON entry: per parameter (tree order) path, shape, dtype and optimizer group; the
optimizer, scaler and precision configuration; the module's persistent buffers and ``state_dict`` keys; for
information only, the world size, stage and tree structure. Loading names its first difference from the
template state (:class:`CheckpointMismatchError`).

Imports: comm, sharding, state, checksums, errors, files, metadata, planners, publish.
"""

from __future__ import annotations

import errno
import json
import math
import os
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata

from ..comm import Communicator
from ..sharding import frozen_params
from ..state import TrainState
from .checksums import CheckedDir, open_checked
from .errors import CheckpointMismatchError, CheckpointNotFoundError, IncompleteCheckpointError, corrupt, shown
from .files import Files
from .metadata import DTYPES, MAX_DIMS, MAX_EXTENT, METADATA_FILE, _first_line, _is_int, _is_name
from .planners import _Pieces, dcp_load
from .publish import LATEST, _read_latest

FORMAT = "fzero-checkpoint"
VERSION = 3  # 2: the frozen parameters may be left out (FROZEN_LEFT_OUT); 3: they are saved 1-D (stage 3: sharded)
MANIFEST_KEY = "fzero/manifest"
FROZEN_PREFIX = "fzero/frozen/"
FROZEN_LEFT_OUT = "frozen_left_out"  # the manifest's {path: "dtype:crc32"} of frozen parameters not saved

# bytes of a data file's records that may lie in holes (not on disk): a record is read whole into memory, and a file
# extended sparsely would make a forged metadata's claim of 10**12 bytes look consistent. Genuine files are written
# through; a file system that stores zero blocks as holes (ZFS with compression) keeps up to this much of zeros so.
HOLE_LIMIT = 64 << 20

PathLike = str | os.PathLike


def _manifest(state: TrainState, comm: Communicator) -> dict[str, Any]:
    """What must agree between a checkpoint and ``state``, as JSON values (see the module doc). Not the flat
    groups, buckets, alignment or world size: they only place the data in the buffers."""
    lay, opt, sc, prec = state.layout, state.opt.optimizer, state.scaler, state.precision
    manifest = {
        "format": FORMAT,
        "version": VERSION if lay.frozen_slots else 1,  # 1: read by every fzero
        # a parameter group's parameters in their saved shape: every rank group's values (every expert, in order)
        "params": [[s.path, list(lay.saved_shape(s)), str(s.dtype),
                    lay.groups[s.group].opt_group if s.group >= 0 else -1] for s in lay.slots],
        "optimizer": {
            **opt.manifest(),  # kind (the rule's name) first, then its static configuration
            "moment_names": list(opt.moment_names),
            **({"scalar_names": list(opt.scalar_names)} if opt.scalar_names else {}),
            **({"vector_names": list(opt.vector_names)} if opt.vector_names else {}),
            "num_groups": opt.num_groups,
            "hyperparameters": [sorted(h) for h in state.opt.hyper],
        },
        "scaler": {k: getattr(sc, k) for k in ("dynamic", "growth_factor", "backoff_factor", "growth_interval",
                                                "min_scale", "hysteresis")},
        "precision": {k: None if getattr(prec, k) is None else str(getattr(prec, k))
                      for k in ("param_dtype", "reduce_dtype")},
        # the persistent buffers (rank 0's are saved) and how to rebuild the module's state_dict
        "module": {"buffers": [[n, list(b.shape[1:]), str(b.dtype)] for n, b in persistent_buffers(state)],
                   "aliases": [list(a) for a in state.module.aliases],
                   "state_dict_keys": list(state.module.state_dict_keys)},
        "structure": str(lay.spec),
        "saved_world_size": comm.world_size,
        # Stage 3 keeps no gathered parameters between steps; stages 1 and 2 hold the same state.
        "saved_stage": "3" if not len(state.params) else "1 or 2",
    }
    if lay.axes:  # for information (a load may hold them in other rank groups) and for OptState.missed's positions
        manifest["param_groups"] = [[name, parts, [s.path for s in lay.trainable_slots if s.axis == name]]
                                    for name, _, parts in lay.axes]
    return json.loads(json.dumps(manifest))  # tuples become lists, as they are read back


def frozen_crcs(state: TrainState, comm: Communicator) -> dict[str, str]:
    """``{path: "dtype:crc32"}`` of each frozen parameter's bytes: what a checkpoint that leaves them out keeps.
    Stage 3: gathered (:func:`fzero.sharding.frozen_params`)."""
    return {s.path: f"{f.dtype}:{zlib.crc32(f.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()):08x}"
            for s, f in frozen_params(state.shard, comm)}


def persistent_buffers(state: TrainState) -> list[tuple[str, torch.Tensor]]:
    """``[(name, [R, ...])]``: the module buffers a ``state_dict`` holds (rank rows)."""
    spec = state.module
    return [(n, b) for n, b, keep in zip(spec.buffers, state.buffers, spec.persistent) if keep]


def _params_difference(saved: Sequence[Sequence[Any]], mine: Sequence[Sequence[Any]]) -> str | None:
    for i, (a, b) in enumerate(zip(saved, mine)):
        if a[0] != b[0]:
            return f"parameter #{i} is {shown(a[0])} vs {shown(b[0])}"
        for field, u, v in zip(("shape", "dtype", "optimizer group (-1: frozen)"), a[1:], b[1:]):
            if u != v:
                u, v = (tuple(u), tuple(v)) if field == "shape" else (u, v)
                return f"parameter {shown(a[0])}: {field} {shown(u)} vs {shown(v)}"
    if len(saved) != len(mine):
        longer = saved if len(saved) > len(mine) else mine
        return f"parameter count {len(saved)} vs {len(mine)}; first extra: {shown(longer[min(len(saved), len(mine))][0])}"
    return None


def missed_table(man: Mapping[str, Any], missed: Sequence[int]) -> dict[str, list[int]]:
    """``OptState.missed`` as ``{trainable path: [steps sat out, per rank group]}`` (one for a parameter without a
    group), read by a (checked) manifest's parameters and ``param_groups``: the positions
    :func:`fzero.layout.positions` gives (every trainable parameter in order for rank group 0, then each group's
    parameters for rank groups 1, 2, ...). ``CheckpointCorruptError``-worthy lengths are the caller's to check."""
    trainable = [p[0] for p in man["params"] if p[3] >= 0]
    table = {path: [int(missed[k])] for k, path in enumerate(trainable)}
    k = len(trainable)
    for _, parts, paths in man.get("param_groups", []):
        for _q in range(1, parts):
            for path in paths:
                table[path].append(int(missed[k]))
                k += 1
    return table


def missed_length(man: Mapping[str, Any]) -> int:
    """The length of ``OptState.missed`` a (checked) manifest's state had."""
    return sum(1 for p in man["params"] if p[3] >= 0) + sum((parts - 1) * len(paths)
                                                            for _, parts, paths in man.get("param_groups", []))


def regroup_missed(saved: Mapping[str, list[int]], shapes: Mapping[str, Sequence[int]], parts: Mapping[str, int],
                   where: str) -> dict[str, list[int]]:
    """A :func:`missed_table` for other rank groups: ``parts[path]`` rank groups (1: none) each take the count of the
    saved rank groups whose rows (of the saved shape's first dimension, ``shapes[path]``) they hold. A new rank group
    holding rows of saved ones that sat out different steps has no one count: ``CheckpointMismatchError`` naming the
    parameter (load it into rank groups as fine as the saved ones)."""
    out = {}
    for path, counts in saved.items():
        new = parts.get(path, 1)
        rows = shapes[path][0] if shapes[path] else 1
        out[path] = []
        for j in range(new):
            lo, hi = j * rows // new, (j + 1) * rows // new
            held = {counts[q] for q in range(len(counts))
                    if q * rows // len(counts) < hi and lo < (q + 1) * rows // len(counts)}
            if len(held) != 1:
                raise CheckpointMismatchError(f"{where}: parameter {shown(path)}: its saved rank groups sat out "
                                              f"different numbers of steps ({sorted(held)}), which one rank group of "
                                              f"this state would hold together; load it into {len(counts)} rank "
                                              "groups or more")
            out[path].append(held.pop())
    return out


def _manifest_difference(saved: Mapping[str, Any], mine: Mapping[str, Any]) -> str | None:
    """The first difference between a checkpoint's manifest and a state's, or None. Order: format, model
    (parameters, buffers), optimizer, scaler, precision. Values read "checkpoint vs this state"."""
    if saved.get("format") != FORMAT:
        return f"not an fzero checkpoint (format {shown(saved.get('format'))})"
    if saved.get("version", 0) > VERSION:
        return f"written by a newer fzero (format version {saved['version']}; this one reads {VERSION})"
    diff = _params_difference(saved["params"], mine["params"])
    if diff is not None:
        return f"model: {diff}"
    theirs = {b[0]: b for b in saved.get("module", {}).get("buffers", [])}
    for b in mine["module"]["buffers"]:
        if b[0] not in theirs:
            return f"model: buffer {shown(b[0])} is not in the checkpoint"
        if theirs[b[0]] != b:
            return f"model: buffer {shown(b[0])}: {shown(theirs[b[0]][1:])} vs {shown(b[1:])}"
    for section in ("optimizer", "scaler", "precision"):
        for key, value in mine[section].items():  # in _manifest's order: kind before details
            if saved[section].get(key) != value:
                return f"{section} {key}: {shown(saved[section].get(key))} vs {shown(value)}"
    return None


def resolve_checkpoint(path: PathLike, *, follow_symlinks: bool = False) -> Path:
    """The checkpoint directory ``path`` designates: ``path/LATEST``'s target when ``path`` is a root, else ``path``
    itself. Raises :class:`IncompleteCheckpointError` when it has no DCP ``.metadata`` (written last: the save did not
    finish), :class:`CheckpointNotFoundError` (also a ``FileNotFoundError``) when ``path`` does not exist, and
    :class:`CheckpointCorruptError` when ``LATEST`` is not a regular file holding one name, or names a directory that
    resolves outside ``path`` (unless ``follow_symlinks``: :class:`~.files.Files`)."""
    return _resolve(Files.of(path, follow_symlinks), path)[0]


def _resolve(files: Files, path: PathLike) -> tuple[Path, str | None]:
    """The checkpoint directory, and the name ``LATEST`` gave it (None: ``path`` is the directory)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointNotFoundError(f"no checkpoint at {p}: the path does not exist")
    name = _read_latest(p, files) if p.is_dir() else None
    d = p / name if name is not None else p
    if name is not None and not d.is_dir():
        raise IncompleteCheckpointError(f"{p / LATEST} names {shown(name)}, but {d} does not exist")
    files.check_inside(d)
    if not (d / METADATA_FILE).is_file():
        if name is None and not any(d.glob("*.distcp")):
            raise IncompleteCheckpointError(f"no checkpoint at {d}: neither a {LATEST} file nor a DCP .metadata file")
        raise IncompleteCheckpointError(f"incomplete checkpoint {d}: no .metadata file (DCP writes it last: "
                                        "the save did not finish)")
    return d, name


def _check_data_files(d: Path, metadata: Metadata, files: Files) -> None:
    """Every data file the metadata names is a regular file inside the root (``files``) and holds every byte range it
    lists, on disk: the records are read whole, so what they claim is bounded by the bytes there before anything is
    allocated (a sparse file's holes count for nothing beyond :data:`HOLE_LIMIT`)."""
    need: dict[str, int] = {}
    for info in metadata.storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for rel, size in sorted(need.items()):
        try:
            with files.open(d / rel) as f:
                have = os.fstat(f.fileno()).st_size
                holes = _hole_bytes(f.fileno(), min(size, have), HOLE_LIMIT)
        except FileNotFoundError:
            raise IncompleteCheckpointError(f"incomplete checkpoint {d}: data file {rel} is missing") from None
        if have < size:
            raise IncompleteCheckpointError(f"incomplete checkpoint {d}: data file {rel} is truncated ({have} "
                                            f"bytes, the metadata needs {size})")
        if holes > HOLE_LIMIT:
            raise corrupt(d, f"data file {rel} is sparse: more than {HOLE_LIMIT} of the {size} bytes its records "
                             "claim are holes, not on disk (a checkpoint's files are written whole)")


def _hole_bytes(fd: int, end: int, limit: int) -> int:
    """How many bytes of ``[0, end)`` of the open file ``fd`` lie in holes, counted until more than ``limit``
    (``SEEK_HOLE``/``SEEK_DATA``; 0 where the system or file system cannot tell)."""
    if not hasattr(os, "SEEK_HOLE"):
        return 0
    total, pos = 0, 0
    while pos < end and total <= limit:
        try:
            hole = os.lseek(fd, pos, os.SEEK_HOLE)  # the end of the file where the data run to it
        except OSError:
            return total
        if hole >= end:
            break
        try:
            data = os.lseek(fd, hole, os.SEEK_DATA)
        except OSError as e:
            if e.errno != errno.ENXIO:
                return total
            data = end  # a hole to the end of the file
        total += min(data, end) - hole
        pos = data
    return total


def read_manifest(path: PathLike, *, follow_symlinks: bool = False) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path`` (a root or a checkpoint directory), read in this process (no
    collective). Raises :class:`IncompleteCheckpointError` for an incomplete checkpoint, :class:`CheckpointCorruptError`
    for a damaged one and :class:`CheckpointMismatchError` for a DCP checkpoint that fzero did not write."""
    return _read_manifest(checked_metadata(path, follow_symlinks=follow_symlinks))


def checked_metadata(path: PathLike, *, follow_symlinks: bool = False) -> CheckedDir:
    """The checkpoint directory ``path`` designates, opened with :func:`~.checksums.open_checked`, once every
    data file it names is there and long enough. Through a root, the checkpoint must be the one saved under
    the name ``LATEST`` gives (not another checkpoint's files copied there)."""
    files = Files.of(path, follow_symlinks)
    d, latest = _resolve(files, path)
    checked = open_checked(d, files)
    sums = checked.checksums
    if latest is not None and sums is not None and sums.name is not None and sums.name != latest:
        raise corrupt(d, f"{LATEST} names it {shown(latest)}, but it was saved as {shown(sums.name)} (step {sums.step}): "
                         "another checkpoint's files are in its place")
    _check_data_files(d, checked.metadata, files)
    return checked


def _read_manifest(checked: CheckedDir) -> dict[str, Any]:
    d, metadata = checked.dir, checked.metadata
    if not isinstance(metadata.state_dict_metadata.get(MANIFEST_KEY), BytesStorageMetadata):
        raise CheckpointMismatchError(f"{d} is a DCP checkpoint without a manifest: not an fzero checkpoint")
    box: dict[str, Any] = {MANIFEST_KEY: None}
    dcp_load(box, checked, None)  # this process only: every rank validates on its own, no collective
    file = metadata.storage_data[MetadataIndex(MANIFEST_KEY)].relative_path
    try:
        manifest = json.loads(box[MANIFEST_KEY])
    except (TypeError, ValueError, RecursionError) as e:
        raise corrupt(d, f"entry {MANIFEST_KEY!r} in data file {file} is not JSON ({_first_line(e)})") from e
    problem = _manifest_problem(manifest)
    if problem is not None:
        raise corrupt(d, f"entry {MANIFEST_KEY!r} in data file {file}: {problem}")
    if manifest.get("format") == FORMAT:
        _check_param_entries(d, metadata, manifest["params"])
    return manifest


def _check_param_entries(d: Path, metadata: Metadata, params: Sequence[Sequence[Any]]) -> None:
    """Each parameter's saved entry (its master, or the frozen value) holds the elements its manifest shape has: the
    manifest and the entries were written together (an entry left out is found where it is read)."""
    entries = metadata.state_dict_metadata
    for path, shape, _, group in params:
        key = f"fzero/master/{path}" if group >= 0 else f"{FROZEN_PREFIX}{path}"
        md = entries.get(key)
        if md is not None and (not isinstance(md, TensorStorageMetadata) or math.prod(md.size) != math.prod(shape)):
            got = f"{math.prod(md.size)} elements" if isinstance(md, TensorStorageMetadata) else "bytes"
            raise corrupt(d, f"entry {shown(key)} holds {got}, the manifest's shape {shown(shape)} has "
                             f"{math.prod(shape)}: {METADATA_FILE} or the manifest is damaged")


def _is_strs(x: Any) -> bool:
    return isinstance(x, list) and all(_is_name(v) for v in x)


def _is_shape(x: Any) -> bool:
    """A list of at most :data:`~.metadata.MAX_DIMS` non-negative ints holding fewer than 2**63 elements."""
    return isinstance(x, list) and len(x) <= MAX_DIMS and all(_is_int(v) for v in x) and math.prod(x) < MAX_EXTENT


def _manifest_problem(m: Any) -> str | None:
    """What is malformed in a manifest, or None: everything the checks and offline tools read has its type
    (an old or foreign manifest fails as corrupt, never with a ``KeyError`` deep in a tool)."""
    if not isinstance(m, dict):
        return "it is not a JSON object"
    if m.get("format") != FORMAT:
        return None  # not fzero's: _manifest_difference says so
    if not _is_int(m.get("version", 1), 1):
        return f"format version {shown(m.get('version'))} is not a version"
    params = m.get("params")
    if not isinstance(params, list):
        return "it has no parameter list"
    seen: set[str] = set()
    for p in params:
        if not (isinstance(p, list) and len(p) == 4 and _is_name(p[0]) and _is_shape(p[1])
                and isinstance(p[2], str) and p[2] in DTYPES and _is_int(p[3], -1)):
            return f"parameter {shown(p)} is not [path, shape, dtype, group]"
        if p[0] in seen:
            return f"parameter {shown(p[0])} is listed twice"
        seen.add(p[0])
    opt = m.get("optimizer")
    if not (isinstance(opt, dict) and isinstance(opt.get("kind"), str) and _is_strs(opt.get("moment_names"))
            and _is_int(opt.get("num_groups"), 1) and isinstance(opt.get("hyperparameters"), list)
            and all(_is_strs(h) for h in opt["hyperparameters"])
            and len(opt["hyperparameters"]) == opt["num_groups"]):
        return "its optimizer section is malformed"
    if any(not _is_int(p[3], -1) or p[3] >= opt["num_groups"] for p in params):
        return "a parameter's optimizer group is not one of the optimizer's"
    for section in ("scaler", "precision"):
        if not isinstance(m.get(section), dict):
            return f"its {section} section is malformed"
    if any(v is not None and (not isinstance(v, str) or v not in DTYPES) for v in m["precision"].values()):
        return "its precision names an unknown dtype"
    groups = m.get("param_groups", [])
    trainable = {p[0]: p for p in params if p[3] >= 0}
    if not (isinstance(groups, list) and len(groups) <= len(trainable)
            and all(isinstance(g, list) and len(g) == 3 and _is_name(g[0]) and _is_int(g[1], 1)
                    and g[1] <= MAX_EXTENT and _is_strs(g[2]) for g in groups)):
        return "its param_groups section is malformed"
    named = [path for g in groups for path in g[2]]
    if len(set(named)) != len(named) or any(path not in trainable for path in named) \
            or any(trainable[path][1] == [] or trainable[path][1][0] % g[1] for g in groups for path in g[2]):
        return "its param_groups name a parameter twice, one that is not trained, or one its rank groups do not divide"
    module = m.get("module", {})
    if not (isinstance(module, dict)
            and isinstance(module.get("buffers", []), list) and isinstance(module.get("aliases", []), list)
            and all(isinstance(b, list) and len(b) == 3 and _is_name(b[0]) and _is_shape(b[1])
                    and isinstance(b[2], str) and b[2] in DTYPES for b in module.get("buffers", []))
            and all(_is_strs(a) for a in module.get("aliases", []))
            and _is_strs(module.get("state_dict_keys", []))):
        return "its module section is malformed"
    return None


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
                raise CheckpointMismatchError(f"checkpoint {d}: entry {key!r} is {md.properties.dtype}"
                                              f"{list(md.size)}, this state needs {obj.dtype}{list(obj.size())}")
