"""Atomic publication of a checkpoint directory: a save writes into ``root/.tmp-{name}``; once every rank has finished
(DCP's final collective) the coordinator renames it to ``root/{name}``, then replaces ``root/LATEST`` atomically. A save
killed at any point leaves ``LATEST`` naming the previous, complete checkpoint.

Imports: comm, dist, errors, files.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from ..comm import Communicator, CountingCommunicator
from ..dist import TorchCommunicator
from .errors import CheckpointCorruptError
from .files import LATEST_LIMIT, NAME_MAX, Files

LATEST = "LATEST"
_TMP_PREFIX = ".tmp-"
_OLD_PREFIX = ".old-"


def _process_group(comm: Communicator) -> dist.ProcessGroup | None:
    """The process group of ``comm``; None when one process holds every rank (the simulated world)."""
    inner = comm
    while isinstance(inner, CountingCommunicator):
        inner = inner.inner
    if isinstance(inner, TorchCommunicator):
        return inner.group if inner.replica is None else dist.group.WORLD  # a mesh: every rank of the job
    if comm.local_ranks == comm.data_world_size:
        return None
    raise TypeError(f"checkpoints need a communicator that holds every rank in one process or a "
                    f"TorchCommunicator; got {comm!r}")


def _on_coordinator(pg: dist.ProcessGroup | None, what: str, fn: Callable[[], None]) -> None:
    """Run ``fn`` on the coordinator (rank 0 of ``pg``); every rank returns after it, or raises if it failed.
    Collective: one ``broadcast_object_list`` of the outcome (none in one process)."""
    error: BaseException | None = None
    if pg is None or dist.get_rank(pg) == 0:
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


def _check_name(name: str) -> None:
    """A plain directory name: at most :data:`~.files.NAME_MAX` bytes, no separator or control character, not
    starting with '.', not ``LATEST`` (checked before any path is built from it)."""
    if not isinstance(name, str) or not name or name != os.path.basename(name) or name.startswith(".") \
            or name == LATEST or len(name.encode("utf-8", "surrogatepass")) > NAME_MAX \
            or any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise ValueError(f"checkpoint name must be a plain directory name (at most {NAME_MAX} bytes, no '/' or "
                         f"control characters, not starting with '.', not {LATEST!r}), got {_shown(name)}")


def _shown(name: object) -> str:
    """``repr(name)``, cut to 80 characters (a damaged ``LATEST`` may hold megabytes)."""
    return repr(name) if not isinstance(name, str) or len(name) <= 80 else f"{name[:80]!r}... ({len(name)} characters)"


def _read_latest(root: Path, files: Files | None = None) -> str | None:
    """The name ``root/LATEST`` holds (read as ``files`` allows); None without one; damaged: a
    :class:`CheckpointCorruptError` naming it."""
    files = Files.of(root) if files is None else files
    try:
        raw = files.read(root / LATEST, LATEST_LIMIT)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CheckpointCorruptError(f"{root / LATEST} cannot be read ({e})") from e
    try:
        name = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CheckpointCorruptError(f"{root / LATEST} is damaged: it is not text ({raw[:40]!r})") from None
    try:
        _check_name(name)
    except ValueError:
        raise CheckpointCorruptError(f"{root / LATEST} is damaged: {_shown(name)} is not a checkpoint name") from None
    return name


def _fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable."""
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
    """A fresh empty ``tmp``; leftovers of interrupted saves in ``root`` are removed (one save at a time)."""
    root.mkdir(parents=True, exist_ok=True)
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith((_TMP_PREFIX, _OLD_PREFIX)):
            shutil.rmtree(p)
        elif p.is_file() and p.name.startswith(f".{LATEST}."):
            p.unlink()
    tmp.mkdir()


def _publish(root: Path, tmp: Path, name: str) -> None:
    """Rename the finished ``tmp`` to ``root/name``, then point ``LATEST`` at it. A stale directory of that
    name (not the one ``LATEST`` names: refused earlier) is moved aside first and removed last."""
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
