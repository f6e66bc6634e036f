"""Saves that do not stop training (``save_checkpoint(blocking=False)``): the state dict a save writes is copied into
reusable host buffers (:func:`snapshot`: the step is held only for this copy), then a writer thread writes, checksums
and publishes it (:func:`start`) while the training goes on: on real ranks the write itself in DCP's writer process
(:func:`~.planners.dcp_save` ``in_process``, the buffers in shared memory), the thread and that process at Linux's idle
priority (:func:`_yield_to_training`).

Rules. One background save in flight per process: every save first calls :func:`settle`, which waits for the one in
flight and raises its failure unless :meth:`BackgroundSave.wait` already has (so a failure is never silent: raised by
``wait()``, else by the next save to any root, else warned of at exit). On a process group the writer's collectives
run on a host group of their own (:func:`checkpoint_group`), never interleaved with the training's. The functions here
are called from the training thread only; the writer thread touches nothing but its handle.

Imports: dist, errors, metadata, planners.
"""

from __future__ import annotations

import atexit
import copy
import dataclasses
import os
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..dist import host_group
from .errors import CheckpointError
from .metadata import _first_line
from .planners import _Pieces

__all__ = ["BackgroundSave", "HostBuffers", "snapshot", "settle", "start", "checkpoint_group"]


class HostBuffers:
    """The host tensors snapshots are copied into, kept for the next snapshot: a save of the same shapes allocates
    nothing. Each is shaped and strided as ``clone()`` would make it, with a storage of its own: DCP writes it as
    it is (a view it would clone first), and the files hold the bytes a blocking save writes. Pinned when the state
    is on CUDA, so that the copies to them run asynchronously."""

    def __init__(self) -> None:
        self._held: list[torch.Tensor] = []
        self._kind = (False, False)

    def take(self, sources: list[torch.Tensor], pinned: bool, shared: bool = False) -> list[torch.Tensor]:
        """One host tensor for each of ``sources``: the previous call's at that place where shape, dtype and strides
        agree, else a new one. ``shared``: in shared memory (a writer process maps it; not pinned then)."""
        pinned = pinned and not shared
        if (pinned, shared) != self._kind:
            self._held, self._kind = [], (pinned, shared)
        held = self._held
        self._held = []  # an old tensor no longer wanted is freed as soon as its place is taken
        for i, t in enumerate(sources):
            old = held[i] if i < len(held) else None
            if old is not None and old.shape == t.shape and old.dtype == t.dtype and old.stride() == t.stride():
                self._held.append(old)
            else:
                new = torch.empty_like(t, device="cpu")
                self._held.append(new.share_memory_() if shared else new.pin_memory() if pinned else new)
            if i < len(held):
                held[i] = None
        return list(self._held)


def _tensors_of(value: Any) -> list[torch.Tensor]:
    """The tensors a state-dict value writes: itself, or a :class:`_Pieces`' pieces; none for an object."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, _Pieces):
        return [t for _, t in value.pieces]
    return []


def _host_copies(sources: list[torch.Tensor], buffers: HostBuffers, shared: bool) -> list[torch.Tensor]:
    """A host copy of each of ``sources`` in ``buffers``' tensors, complete when this returns. CUDA sources are copied
    asynchronously, then one stream sync each device."""
    copies = [dst.copy_(t, non_blocking=t.is_cuda)
              for dst, t in zip(buffers.take(sources, any(t.is_cuda for t in sources), shared), sources)]
    for device in {t.device for t in sources if t.is_cuda}:
        torch.cuda.current_stream(device).synchronize()
    return copies


def _rebuilt(value: Any, copies: Iterator[torch.Tensor]) -> Any:
    """``value`` with its tensors taken from ``copies`` (in :func:`_tensors_of`'s order); an object deep-copied."""
    if isinstance(value, torch.Tensor):
        return next(copies)
    if isinstance(value, _Pieces):
        return dataclasses.replace(value, pieces=tuple((off, next(copies)) for off, _ in value.pieces))
    return copy.deepcopy(value)  # e.g. a caller's lists in ``extra``, which it may append to meanwhile


def snapshot(state_dict: Mapping[str, Any], buffers: HostBuffers, shared: bool = False) -> dict[str, Any]:
    """A copy of ``state_dict`` that owns its data: every tensor (and piece) copied into ``buffers`` (``shared``: in
    shared memory), every other value deep-copied. The state can be stepped (its buffers donated) as soon as this
    returns. No collectives."""
    sources = [t for v in state_dict.values() for t in _tensors_of(v)]
    copies = iter(_host_copies(sources, buffers, shared))
    return {k: _rebuilt(v, copies) for k, v in state_dict.items()}


class BackgroundSave:
    """A checkpoint being written by a writer thread: ``path`` is where it is published (``root/name``),
    :meth:`done` says whether the writer finished, :meth:`wait` waits for it and raises its failure."""

    def __init__(self, path: Path, write: Callable[[], None]) -> None:
        self.path = path
        self._error: BaseException | None = None
        self._raised = False
        # Not a daemon: a program that ends without waiting still finishes (and publishes) its checkpoint.
        self._thread = threading.Thread(target=self._run, args=(write, torch.get_num_threads()),
                                        name=f"fzero-save-{path.name}")

    def _run(self, write: Callable[[], None], threads: int) -> None:
        # OpenMP's thread count is per thread: the writer uses the training thread's, not the machine's
        torch.set_num_threads(threads)
        _yield_to_training()
        try:
            write()
        except BaseException as e:  # noqa: BLE001 - kept for wait() and the next save, which raise it
            self._error = e

    def done(self) -> bool:
        """Whether the writer has finished (published, or failed)."""
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> Path:
        """Wait for the write; returns ``path`` once published (``LATEST`` names it). A failed write raises a
        :class:`CheckpointError` naming the checkpoint (its cause chained), every time it is called; ``timeout``
        seconds passed first: ``TimeoutError``. No collectives (the writer's run on the checkpoint group)."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"checkpoint {self.path} is still being written after {timeout}s")
        if self._error is not None:
            self._raised = True
            raise self._failure()
        return self.path

    def _failure(self) -> CheckpointError:
        e = self._error
        err = CheckpointError(f"saving checkpoint {self.path} in the background failed: "
                              f"{type(e).__name__}: {_first_line(e)}")
        err.__cause__ = e
        return err

    def __repr__(self) -> str:
        state = "writing" if not self.done() else "failed" if self._error is not None else "published"
        return f"BackgroundSave({str(self.path)!r}, {state})"


def _yield_to_training() -> None:
    """The calling thread (the writer) runs only when a core would otherwise idle (Linux ``SCHED_IDLE``, a
    per-thread policy): the training's threads and processes keep the cores; elsewhere nothing changes."""
    if hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
        except OSError:  # not permitted here: the writer keeps the training's priority
            pass


_in_flight: BackgroundSave | None = None
_buffers = HostBuffers()
_groups: dict[dist.ProcessGroup, dist.ProcessGroup] = {}


def settle() -> None:
    """Wait for the background save in flight, if any; raise its failure (a :class:`CheckpointError` naming it)
    unless its ``wait()`` already has. Every save calls it first: one background save in flight per process, so one
    snapshot held and one save's collectives on the checkpoint group at a time. No collectives."""
    global _in_flight
    pending, _in_flight = _in_flight, None
    if pending is None:
        return
    pending._thread.join()
    if pending._error is not None and not pending._raised:
        pending._raised = True
        raise pending._failure()


def start(path: Path, state_dict: Mapping[str, Any], write: Callable[[dict[str, Any]], None],
          shared: bool = False) -> BackgroundSave:
    """Snapshot ``state_dict`` (:func:`snapshot`, into the process's reused host buffers; ``shared``: in shared
    memory, for ``write`` to hand to a writer process), then run ``write(snapshot)`` in a writer thread; returns its
    handle. Call :func:`settle` first (the buffers are the previous save's). No collectives here (``write``'s run in
    the thread)."""
    global _in_flight
    if _in_flight is not None:
        raise RuntimeError("a background save is in flight: settle() first")
    held = snapshot(state_dict, _buffers, shared)
    handle = BackgroundSave(path, lambda: write(held))
    handle._thread.start()
    _in_flight = handle
    return handle


def checkpoint_group(pg: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The process group background saves over ``pg``'s ranks run their collectives on (torch's advice for
    ``async_save``: the writer's collectives never interleave with the training's on ``pg``); None for None. Made on
    the first call for ``pg`` by :func:`fzero.dist.host_group` (a collective of ``pg``'s ranks: every rank makes
    the same save), then kept."""
    if pg is None:
        return None
    group = _groups.get(pg)
    if group is None:
        group = host_group(pg)
        _groups[pg] = group
    return group


@atexit.register
def _warn_unseen_failure() -> None:
    """At exit (after the writer thread ended: Python joins it first), a failed save nobody was told of is reported."""
    if _in_flight is not None and _in_flight.done() and _in_flight._error is not None and not _in_flight._raised:
        warnings.warn(f"{_in_flight._failure()}; nothing waited for it (BackgroundSave.wait())", RuntimeWarning,
                      stacklevel=1)
