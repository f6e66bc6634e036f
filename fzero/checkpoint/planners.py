"""DCP planners for fzero's flat state dicts, and the calls into DCP. Each parameter goes to DCP as a :class:`_Pieces`
(``(offset, 1-D view)`` pieces of one global tensor: DTensor describes only even shards, ``ShardedTensor`` needs a
process group); DCP plans, validates and reshards. The files are the same on a process group and on the simulated
world. :func:`dcp_save` and :func:`dcp_load` convert every failure but ``KeyboardInterrupt``/``SystemExit`` to a
:class:`CheckpointError` naming the directory (reading: the entry and data file); fzero's own pass through.

Imports: layout, checksums, errors, metadata.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner, create_default_local_load_plan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, _save_state_dict

from ..layout import FlatGroup, Layout
from .checksums import CheckedDir, ChecksumWriter, VerifyingReader
from .errors import CheckpointCorruptError, CheckpointError
from .metadata import _first_line


@dataclasses.dataclass(frozen=True)
class _Pieces:
    """Pieces ``(global offset, 1-D tensor)`` of a global 1-D tensor of ``numel`` elements held by this
    process, in DCP's checkpointable protocol. Saving: each piece is one DCP chunk. Loading: each piece is a
    view into the destination buffer that DCP fills from the saved chunks overlapping it."""

    numel: int
    dtype: torch.dtype
    pieces: tuple[tuple[int, torch.Tensor], ...]

    def size(self) -> torch.Size:
        return torch.Size([self.numel])  # DCP compares it with the saved size before planning reads

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, torch.Size([off])), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size([off]), t.size()),
                                                      properties=TensorProperties.create_from_tensor(t),
                                                      size=self.size()))
                for off, t in self.pieces]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size([off]), sizes=t.size()) for off, t in self.pieces]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for off, t in self.pieces:
            if index.offset is not None and tuple(index.offset) == (off,):
                return t
        raise ValueError(f"{index.fqn}: this process holds no piece at offset {index.offset}")


def _param_pieces(layout: Layout, rows: Sequence[torch.Tensor], ranks: Sequence[int],
                  groups: Sequence[FlatGroup] | None = None,
                  places: Mapping[str, tuple[Sequence[int], Sequence[int]]] | None = None) -> dict[str, _Pieces]:
    """Each trainable parameter's (``groups``: those groups' parameters') elements held in ``rows`` (one ``[R,
    shard_numel]`` buffer per group, row ``i`` owned by rank ``ranks[i]``) as pieces of the parameter flattened to 1-D:
    views, never padding (a rank that owns only padding contributes no piece). A parameter group's (``places[axis]``:
    each row's rank within its rank group, and its rank group ``q``) as pieces of its saved tensor
    (:meth:`~fzero.layout.Layout.saved_shape`: rank group ``q``'s values at ``q * numel``)."""
    out: dict[str, _Pieces] = {}
    for g in layout.groups if groups is None else groups:
        n, buf = g.shard_numel, rows[g.index]
        over, parts = (ranks, [0] * len(ranks)) if not g.axis else (places or {})[g.axis]
        for i in g.slots:
            s = layout.slots[i]
            if s.numel == 0:
                continue  # nothing to save; DCP would record no chunk for it
            pieces = []
            held = list(zip(over, parts))
            for row, (r, q) in enumerate(held):
                if (r, q) in held[:row]:
                    continue  # a mesh's second copy of a shard
                lo, hi = max(r * n, s.offset), min((r + 1) * n, s.offset + s.numel)
                if lo < hi:
                    pieces.append((q * s.numel + lo - s.offset, buf[row, lo - r * n : hi - r * n]))
            out[s.path] = _Pieces(s.numel * layout.parts(g.axis), buf.dtype, tuple(pieces))
    return out


class _SavePlanner(DefaultSavePlanner):
    """DCP's default save planner on an already flat state dict, looking :class:`_Pieces` chunks up by offset."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, _Pieces):
            return obj.__get_tensor_shard__(index)
        return super().lookup_object(index)


class _LoadPlanner(LoadPlanner):
    """Reads into the tensors and :class:`_Pieces` of a flat state dict in place with DCP's default local plan (a read
    per overlap of a wanted and a saved chunk: the resharding); object entries unpickled ``weights_only``."""

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
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
        t = obj.__get_tensor_shard__(read_item.dest_index) if isinstance(obj, _Pieces) else obj
        for dim, (o, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            t = t.narrow(dim, o, n)
        return t

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # resolve_tensor handed out a view of the destination: already in place


_SINGLE_PROCESS_NOTICE = ".*assuming the intent is to (save|load) in a single process.*"


def dcp_save(state_dict: dict[str, Any], path: Path, pg: dist.ProcessGroup | None,
             bind: Mapping[str, Any] | None = None, *, in_process: bool = False, direct: bool = False) -> None:
    """DCP's save with checksums (:class:`ChecksumWriter`; ``bind``: the step and the name the checksum file
    also binds); failures as :class:`CheckpointError`. One process (``pg`` None): DCP's ``save`` less its notice
    that it assumes one process (intended here), which off the main thread (a background save's writer) only a
    process-wide filter could silence: its inner ``_save_state_dict``, which ``save`` calls for a state dict of plain
    values such as this one.

    ``in_process`` (a process group only): DCP's ``async_save`` with its writer process (``AsyncCheckpointerType.
    PROCESS``: one per rank, started on the first such save and kept, with a process group of its own among the ranks'
    writer processes), waited for: the serialization, checksums and file writes run outside this process, holding
    none of its GIL. ``state_dict``'s tensors are sent as shared-memory handles when they are in shared memory
    (:class:`~.background.HostBuffers`), copied there otherwise. ``direct``: the data files written around the page
    cache (:class:`~.direct.DirectFile`)."""
    writer = ChecksumWriter(path, sync_files=True, bind=bind, direct=direct)
    if in_process:
        if pg is None:
            raise ValueError("dcp_save: in_process needs a process group")
        run = lambda: dcp.async_save(  # noqa: E731
            state_dict, storage_writer=writer, planner=_SavePlanner(), process_group=pg,
            async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=_Staged()).result()
    elif pg is None:
        run = lambda: _save_state_dict(state_dict, storage_writer=writer, planner=_SavePlanner(), no_dist=True)  # noqa: E731
    else:
        run = lambda: dcp.save(state_dict, storage_writer=writer, planner=_SavePlanner(), process_group=pg)  # noqa: E731
    _call(run, f"writing checkpoint {path} failed", None)


class _Staged(AsyncStager):
    """The stager of a state dict already staged (:func:`~.background.snapshot` copied it before the step went on):
    ``async_save`` writes it as it is."""

    _synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def dcp_load(state_dict: dict[str, Any], checked: CheckedDir, pg: dist.ProcessGroup | None) -> None:
    """DCP's load into ``state_dict`` in place from a checked directory, every record's checksum checked as
    it is read (:class:`VerifyingReader`); failures as :class:`CheckpointError` naming the entry and file."""
    reader = VerifyingReader(checked)
    _call(lambda: dcp.load(state_dict, storage_reader=reader, planner=_LoadPlanner(), process_group=pg,
                           no_dist=pg is None),
          f"reading checkpoint {checked.dir} failed", reader)


def _call(run: Callable[[], Any], what: str, reader: VerifyingReader | None) -> None:
    """``run()`` without DCP's one-process notice (intended here), any failure converted. Off the main thread (a
    background save's writer) no filter is set: ``catch_warnings`` swaps the process's filter list, safe on the main
    thread only (:func:`dcp_save` gives the writer nothing to silence)."""
    try:
        if threading.current_thread() is threading.main_thread():
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_NOTICE)
                run()
        else:
            run()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        raise _converted(e, what, None if reader is None else reader.current) from e


def _converted(e: BaseException, what: str, where: tuple[str, str] | None) -> CheckpointError:
    causes = [exc for exc, _ in e.failures.values()] if isinstance(e, CheckpointException) else [e]
    for c in causes:
        if isinstance(c, (KeyboardInterrupt, SystemExit)):
            return c  # type: ignore[return-value] - raised as it is
    for c in causes:
        if isinstance(c, CheckpointError):
            return c  # a checksum or a check of ours: already names directory, file and entry
    cause = causes[0]
    text = f"{type(cause).__name__}: {_first_line(cause)}"
    if where is not None:
        key, file = where
        if isinstance(cause, OSError):
            return CheckpointError(f"{what}: reading entry {key!r} in data file {file}: {text}")
        # DCP failed decoding a record: damaged bytes of a checkpoint saved without checksums
        return CheckpointCorruptError(f"{what}: entry {key!r} in data file {file} cannot be decoded ({text})")
    return CheckpointError(f"{what}: {text}")
