"""DCP planners for fzero's flat state dicts, and the calls into DCP.

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

Errors. DCP reports failures as ``CheckpointException``, a ``BaseException``
that ``except Exception:`` does not catch. :func:`dcp_save` and :func:`dcp_load`
convert it (and any other failure but ``KeyboardInterrupt``/``SystemExit``) to a
:class:`~fzero.checkpoint.errors.CheckpointError` naming the directory, and for
reads the entry and data file being read: a fzero error raised inside DCP (a
checksum) is re-raised as it is.

Imports: :mod:`fzero.layout`, :mod:`fzero.checkpoint.errors`, :mod:`fzero.checkpoint.checksums`.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultSavePlanner,
    create_default_local_load_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from ..layout import Layout
from .checksums import CheckedDir, ChecksumWriter, VerifyingReader
from .errors import CheckpointCorruptError, CheckpointError

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


def dcp_save(state_dict: dict[str, Any], path: Path, pg: Optional[dist.ProcessGroup],
             bind: Optional[Mapping[str, Any]] = None) -> None:
    """DCP's save with checksums (:class:`ChecksumWriter`; ``bind``: what the checksum file
    also binds, the step and the name); failures as :class:`CheckpointError`."""
    try:
        with warnings.catch_warnings():
            # DCP warns when it runs in one process (no_dist): here that is intended.
            warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_NOTICE)
            dcp.save(
                state_dict,
                storage_writer=ChecksumWriter(path, sync_files=True, bind=bind),
                planner=_SavePlanner(),
                process_group=pg,
                no_dist=pg is None,
            )
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        raise _converted(e, f"writing checkpoint {path} failed", None) from e


def dcp_load(state_dict: dict[str, Any], checked: CheckedDir, pg: Optional[dist.ProcessGroup]) -> None:
    """DCP's load into ``state_dict`` in place from a checked directory (its metadata read
    without running code), every record's checksum checked as it is read
    (:class:`VerifyingReader`); failures as :class:`CheckpointError` naming the entry and file."""
    reader: Optional[VerifyingReader] = None
    path = checked.dir
    try:
        reader = VerifyingReader(checked)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_NOTICE)
            dcp.load(state_dict, storage_reader=reader, planner=_LoadPlanner(), process_group=pg, no_dist=pg is None)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        where = None if reader is None else reader.current
        raise _converted(e, f"reading checkpoint {path} failed", where) from e


def _root_causes(e: BaseException) -> list[BaseException]:
    """The exceptions inside DCP's ``CheckpointException`` (one per failed rank), else ``e``."""
    if isinstance(e, CheckpointException):
        return [exc for exc, _ in e.failures.values()]
    return [e]


def _converted(e: BaseException, what: str, where: Optional[tuple[str, str]]) -> CheckpointError:
    causes = _root_causes(e)
    for c in causes:
        if isinstance(c, (KeyboardInterrupt, SystemExit)):
            return c  # type: ignore[return-value] - raised as it is
    for c in causes:
        if isinstance(c, CheckpointError):
            return c  # a checksum or a check of ours: already names directory, file and entry
    cause = causes[0]
    text = f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
    if where is not None:
        key, file = where
        if isinstance(cause, OSError):
            return CheckpointError(f"{what}: reading entry {key!r} in data file {file}: {text}")
        # DCP failed decoding a record: damaged bytes of a checkpoint saved without checksums.
        return CheckpointCorruptError(f"{what}: entry {key!r} in data file {file} cannot be decoded ({text})")
    return CheckpointError(f"{what}: {text}")


