"""Communicators: the only way fzero's functions talk to other ranks. A tensor that differs between ranks has a leading
*local-rank axis* of size ``R = comm.local_ranks``: every rank in :class:`SimulatedWorld`, 1 on a real rank
(``fzero.dist``). Collectives are methods over it: one step runs on both, eagerly or traced. A *mesh* ``(replicas,
shards)`` (HSDP) shards the state over each group of ``world_size`` ranks and replicates it ``replicas`` times: the
collectives span one shard group, and :meth:`Communicator.all_reduce_replicas_start` the ranks that hold the same shard.
*Parameter groups* (:attr:`Communicator.groups`): named communicators over disjoint groups of the world's ranks (an
expert-data-parallel group: the ranks holding the same experts), over which the parameters given to them are sharded.

Imports: torch only.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
import torch.utils._pytree as tp

__all__ = ["CollectiveError", "Communicator", "SimulatedWorld", "CountingCommunicator", "CollectiveRecord",
           "gradient_divide_factors", "rank_order_sum", "mesh_groups", "Mesh", "param_groups"]
Mesh = Sequence[Any]  # a shape (replicas, shards), or the shard groups: replicas lists of shards global ranks
ReduceOp = Literal["sum", "avg", "max"]


class CollectiveError(RuntimeError):
    """A collective did not complete on this rank: a peer stalled past the communicator's timeout, or died.
    ``collective`` names it, ``step`` the train step (``state.opt.step + 1``; None outside one), ``timeout`` the bound
    in seconds. The group is then unusable: end the process, for torchrun to stop or restart the job."""

    def __init__(self, collective: str, rank: int, timeout: float | None, cause: str, step: int | None = None):
        self.collective, self.rank, self.timeout, self.cause, self.step = collective, rank, timeout, cause, step
        within = "" if timeout is None else f" within {timeout:g} s"
        during = "" if step is None else f" during step {step}"
        super().__init__(f"rank {rank}: collective {collective}{during} did not complete{within} (a peer rank "
                         f"stalled or died): {cause}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.collective, self.rank, self.timeout, self.cause, self.step))

    def at_step(self, step: int) -> CollectiveError:
        """The same error, naming the train step it happened in."""
        return type(self)(self.collective, self.rank, self.timeout, self.cause, step)


def gradient_divide_factors(world_size: int) -> tuple[float, float]:
    """FSDP's ``(pre, post)`` factors, ``pre * post == world_size``: a 16-bit reduction divides by ``pre``
    before the sum and by ``post`` after it, so the sum neither overflows nor underflows."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    pre = 1
    while world_size % pre == 0 and world_size / pre > pre:
        pre *= 2
    return float(pre), world_size / pre


def mesh_groups(mesh: Mesh, world: int) -> tuple[tuple[int, ...], ...]:
    """The shard groups of ``mesh`` over ``world`` ranks, each a tuple of global ranks (column ``j`` of them: the ranks
    holding shard ``j``, a replica group). ``mesh``: a shape ``(R, S)``, ``R * S == world`` (group ``q``: ranks ``q*S``
    to ``q*S + S - 1``, as ``init_device_mesh``), or ``R`` lists of ``S`` ranks (each sorted, as torch numbers a group's
    ranks; the groups by their first rank). ``ValueError`` naming what is wrong (a
    shape that does not multiply to ``world``, a rank in two groups or in none) before any collective."""
    if len(mesh) == 2 and all(isinstance(n, int) for n in mesh):
        r, s = mesh
        if not (r >= 1 and s >= 1 and r * s == world):
            raise ValueError(f"mesh {tuple(mesh)}: (replicas, shards) must be positive and multiply to the world size "
                             f"{world}, but {r} * {s} = {r * s}")
        return tuple(tuple(range(q * s, (q + 1) * s)) for q in range(r))
    groups = tuple(tuple(int(x) for x in g) for g in mesh)
    if not groups or len({len(g) for g in groups}) != 1 or not groups[0]:
        raise ValueError(f"mesh {mesh!r}: give (replicas, shards) or replicas lists of as many ranks (shard groups), "
                         f"got groups of sizes {[len(g) for g in groups]}")
    seen: dict[int, int] = {}
    for q, g in enumerate(groups):
        for x in g:
            if not 0 <= x < world:
                raise ValueError(f"mesh: rank {x} in shard group {q} is not a rank of the world (size {world})")
            if x in seen:
                raise ValueError(f"mesh: rank {x} is in two shard groups ({seen[x]} and {q}); each rank must be in one")
            seen[x] = q
    if len(seen) != world:
        raise ValueError(f"mesh: ranks {sorted(set(range(world)) - set(seen))} are in no shard group (world size "
                         f"{world})")
    return tuple(sorted(tuple(sorted(g)) for g in groups))  # as torch numbers a new group's ranks


def mesh_text(groups: tuple[tuple[int, ...], ...]) -> str:
    """How a mesh reads in a repr and a log: its shape, and what it degenerates to."""
    r, s = len(groups), len(groups[0])
    flat = ": flat, one shard group" if r == 1 else ": replicated only, as DDP" if s == 1 else ""
    return f"mesh=({r}, {s}){flat}"


def param_groups(groups: Mapping[str, Mesh], world: int) -> dict[str, tuple[tuple[int, ...], ...]]:
    """Each named parameter group's rank groups, validated for a world of ``world`` ranks: a value is a mesh
    (:func:`mesh_groups`: a shape ``(count, size)``, consecutive ranks in each group, or the lists of ranks), each
    group of ``size`` ranks sharding the parameters given that name, and every rank in exactly one. ``ValueError``
    naming the group (a name that is not a non-empty string, a shape that does not divide the world, a rank in two
    groups or none) before any collective."""
    out = {}
    for name, mesh in groups.items():
        if not (isinstance(name, str) and name):
            raise ValueError(f"groups: a parameter group's name must be a non-empty string, got {name!r}")
        try:
            out[name] = mesh_groups(mesh, world)
        except (ValueError, TypeError) as e:
            text = str(e).replace("shard group", "rank group").replace("(replicas, shards)", "(groups, ranks each)")
            raise ValueError(f"groups[{name!r}]: {text.replace('replicas lists', 'lists')}") from None
    return out


def rank_order_sum(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """A new ``rows[0] + rows[1] + ...``, one row at a time in rank order in the rows' dtype: the one definition of a
    reduce-scatter's and an all-reduce's sum, so every communicator and path gives the same bits (each element a chain
    of IEEE additions, whatever the CPU's vector width)."""
    total = rows[0] + rows[1] if len(rows) > 1 else rows[0].clone()
    for row in rows[2:]:
        total.add_(row)
    return total


class Communicator:
    """Base class: subclasses implement each of ``all_reduce``, ``reduce_scatter``, ``all_gather`` or its ``*_start``
    form (started now; the returned function waits, gives the result). Pieces read the capabilities below."""

    world_size: int  # W: the ranks the state is sharded over (a mesh's shard group)
    local_ranks: int  # R
    ranks: tuple[int, ...]  # each local row's rank in its shard group: the shard it holds
    replicas: int = 1  # copies of the sharded state (a mesh's replica axis); the batch: world_size * replicas parts
    node: Communicator | None = None  # hpZ: this rank's shard group (a node), where stage 3 regathers for backward
    # parameter groups: the communicator each named group of parameters is sharded over (init_train_state(groups=))
    groups: Mapping[str, Communicator] = {}  # never mutated: each communicator with groups assigns its own
    # a parameter group's communicator: its collectives run in each of `parts` disjoint groups of `world_size` ranks;
    # `part`, each local row's group (the world's own: one part)
    parts: int = 1
    rank_groups: tuple[tuple[int, ...], ...] = ()  # a parameter group's communicator: every rank group's job ranks
    # where the small tensors a piece builds to send live (unit-call tags, init agreement, layout digests): a
    # process group's device (NCCL: this rank's GPU; a CPU tensor is refused there), the simulated world's tensors'
    device: torch.device = torch.device("cpu")
    traced: bool = False  # its collectives are being traced into a graph (see ``tracing``)
    overlaps: bool = False  # they may run on a thread of their own while backward goes on
    # what one gradient reduction allocates beside its result, per element of one rank's input (memory_report)
    reduce_scatter_buffers: float = 0.0
    all_reduce_buffers: float = 0.0
    # an all-reduce that lets go of its input before its whole sum exists: what it holds beside the input until then
    # (None: it holds its input throughout)
    all_reduce_input_buffers: float | None = None

    @property
    def part(self) -> tuple[int, ...]:
        """Each local row's group among :attr:`parts` (a parameter group's communicator; otherwise all 0)."""
        return self.__dict__.get("_part") or (0,) * self.local_ranks

    def param_group(self, name: str) -> Communicator:
        """The communicator of parameter group ``name``; ``""``: this one. ``ValueError`` naming the groups there are."""
        if not name:
            return self
        found = self.groups.get(name)
        if found is None:
            raise ValueError(f"parameter group {name!r}: this communicator ({self!r}) has "
                             f"{'groups ' + ', '.join(map(repr, self.groups)) if self.groups else 'no parameter groups'}"
                             f"; give it the group (SimulatedWorld(groups=...), TorchCommunicator(groups=...))")
        return found

    @property
    def data_ranks(self) -> tuple[int, ...]:
        """Each local row's rank in the whole job (which part of the batch, which random stream)."""
        inner = getattr(self, "inner", None)  # a wrapper's: its inner communicator's
        return inner.data_ranks if isinstance(inner, Communicator) else self.ranks

    @property
    def data_world_size(self) -> int:
        """The ranks the batch is split over: ``world_size * replicas``."""
        return self.world_size * self.replicas

    def holder(self, shard_rank: int) -> int:
        """The lowest data rank whose shard is shard ``shard_rank``'s, the same answer on every rank: where a piece of
        that shard is :meth:`broadcast` from (``src`` is a data rank). Without replicas, ``shard_rank`` itself; a
        wrapper answers as its inner communicator; a mesh backend that holds one rank here overrides it."""
        inner = getattr(self, "inner", None)
        if isinstance(inner, Communicator):
            return inner.holder(shard_rank)
        if not 0 <= shard_rank < self.world_size:
            raise ValueError(f"holder: shard rank must be in [0, {self.world_size}), got {shard_rank}")
        if self.replicas == 1:
            return shard_rank
        if self.local_ranks == self.data_world_size:  # every data rank here, row i data rank i
            return self.ranks.index(shard_rank)
        raise NotImplementedError(f"{type(self).__name__} does not say which data rank holds shard {shard_rank}")

    def wrapping(self, inner: Communicator, capabilities: bool = True) -> None:
        """Make this a wrapper of ``inner`` with its world's shape (sizes, ranks, replicas, node) and, with
        ``capabilities``, its ``overlaps`` and buffer factors: in one place, so no wrapper misses what the protocol
        gains."""
        self.inner, self.world_size, self.local_ranks = inner, inner.world_size, inner.local_ranks
        self.ranks, self.replicas, self.node, self.device = inner.ranks, inner.replicas, inner.node, inner.device
        self.groups, self.parts, self._part, self.rank_groups = inner.groups, inner.parts, inner.part, inner.rank_groups
        if capabilities:
            self.overlaps = inner.overlaps
            self.reduce_scatter_buffers = inner.reduce_scatter_buffers
            self.all_reduce_buffers = inner.all_reduce_buffers
            self.all_reduce_input_buffers = inner.all_reduce_input_buffers

    def all_reduce(self, x: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """``[R, ...] -> [R, ...]``, ``op`` in sum/avg/max (``avg``: the sum divided by ``W``, everywhere)."""
        if type(self).all_reduce_start is Communicator.all_reduce_start:
            raise NotImplementedError
        return self.all_reduce_start(x, op)()

    def reduce_scatter(self, x: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """``[R, W*n] -> [R, n]``, ``op`` sum or avg: row ``r`` keeps chunk ``ranks[r]`` of the sum."""
        if type(self).reduce_scatter_start is Communicator.reduce_scatter_start:
            raise NotImplementedError
        return self.reduce_scatter_start(x, op)()

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """``[R, n] -> [R, W*n]``: every rank's chunk, in rank order."""
        if type(self).all_gather_start is Communicator.all_gather_start:
            raise NotImplementedError
        return self.all_gather_start(x)()

    def all_reduce_start(self, x: torch.Tensor, op: ReduceOp = "sum") -> Callable[[], torch.Tensor]:
        out = self.all_reduce(x, op)
        return lambda: out

    def reduce_scatter_start(self, x: torch.Tensor, op: ReduceOp = "sum") -> Callable[[], torch.Tensor]:
        out = self.reduce_scatter(x, op)
        return lambda: out

    def all_gather_start(self, x: torch.Tensor) -> Callable[[], torch.Tensor]:
        out = self.all_gather(x)
        return lambda: out

    def all_to_all_start(self, x: torch.Tensor) -> Callable[[], torch.Tensor]:
        """``[R, W*n] -> [R, W*n]``, any dtype: chunk ``k`` of row ``r`` is what rank ``k`` sent as its chunk
        ``ranks[r]`` (each rank's chunk ``j`` goes to rank ``j``)."""
        raise NotImplementedError

    def all_to_all_lists(self, chunks: Sequence[Sequence[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """Each local row's ``W`` tensors, chunk ``k`` to rank ``k``: ``[R][W] -> [R][W]``, ``out[r][k]`` what rank
        ``k`` sent to rank ``ranks[r]``. Chunks may differ in their first dimension (the rest, and the dtype, alike):
        an expert-parallel layer's tokens. A real rank first exchanges the sizes (one small all-to-all, read on the
        host); a simulated world needs every row's chunks at once (rows in lockstep: :mod:`fzero.lockstep`)."""
        inner = getattr(self, "inner", None)
        if isinstance(inner, Communicator):
            return inner.all_to_all_lists(chunks)
        raise NotImplementedError

    def all_reduce_replicas_start(self, x: torch.Tensor, op: ReduceOp = "sum") -> Callable[[], torch.Tensor]:
        """``[R, ...] -> [R, ...]`` over the ranks holding the same shard (a mesh's replica group; one rank: ``x``)."""
        if self.replicas == 1:
            return lambda: x
        inner = getattr(self, "inner", None)
        if isinstance(inner, Communicator):
            return inner.all_reduce_replicas_start(x, op)
        raise NotImplementedError

    def all_reduce_shard_start(self, x: torch.Tensor, op: ReduceOp = "sum") -> Callable[[], torch.Tensor]:
        """ZeRO-1's reduction: ``all_reduce`` of ``x`` ``[R, W*n]``, each rank keeping its chunk ``[R, n]``."""
        self._chunk(x, "all_reduce_shard")
        reduced = self.all_reduce_start(x, op)
        return lambda: self.take_shard(reduced())

    def all_gather_into_start(self, x: torch.Tensor, out: torch.Tensor) -> Callable[[], torch.Tensor]:
        """``all_gather`` of ``x`` ``[R, n]`` into ``out`` ``[R, W*n]`` (same dtype); default: gathered, then copied."""
        self._check_into(x, out)
        started = self.all_gather_start(x)
        return lambda: out.copy_(started())

    def all_gather_into(self, xs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]) -> None:
        """``all_gather_into_start`` of every pair, all started before any is waited for."""
        for done in [self.all_gather_into_start(x, o) for x, o in zip(xs, outs)]:
            done()

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``[R, n] -> [R, n]``, any dtype: every row becomes rank ``src``'s (here: a gather, W times the traffic)."""
        if self.replicas > 1:
            raise NotImplementedError
        self._check_broadcast(x, src)
        n = x.shape[1]
        return self.all_gather(x)[:, src * n:(src + 1) * n].contiguous()

    def all_gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        """Every rank's ``values`` on the host (one local rank; as many ints in ``[0, 2**63)`` on every rank), for a
        check that must see them before going on (stage 3's unit calls): an ``all_gather`` of their bytes (one float32
        each, exact) on :attr:`device`, read back, a host sync. A backend may wait for less
        (``fzero.dist.TorchCommunicator`` on CUDA: for this gather alone, not for the kernels queued before it)."""
        sent = self._int_bytes(values).to(self.device).unsqueeze(0)
        return self._ints(self.all_gather(sent).view(self.world_size, -1).cpu())

    @staticmethod
    def _int_bytes(values: Sequence[int]) -> torch.Tensor:
        """``values`` as float32 bytes on the host (what :meth:`all_gather_ints` sends)."""
        return torch.tensor(list(values), dtype=torch.int64, device="cpu").view(torch.uint8).to(torch.float32)

    @staticmethod
    def _ints(table: torch.Tensor) -> list[list[int]]:
        """``[W, 8k]`` float32 bytes on the host -> each rank's ``k`` ints."""
        return table.round().to(torch.uint8).contiguous().view(torch.int64).tolist()

    def tracing(self) -> Communicator:
        """A copy as a compiled step traces it: ``traced`` set (a wrapper's ``.inner`` too). No communication.
        ``NotImplementedError`` with hpZ (``node``): its secondary shards are kept by eager steps."""
        if self.node is not None:
            raise NotImplementedError(f"{self!r}: hpZ keeps secondary shards in eager stage-3 steps: compile=False")
        out = copy.copy(self)
        out.traced = True
        if isinstance(getattr(self, "inner", None), Communicator):
            out.inner = self.inner.tracing()
        if self.groups:
            out.groups = {name: c.tracing() for name, c in self.groups.items()}
        return out

    def reusing_buffers(self) -> contextlib.AbstractContextManager[None]:
        """A block in which received buffers may be handed out again once nothing refers to them (default: never)."""
        inner = getattr(self, "inner", None)
        return inner.reusing_buffers() if isinstance(inner, Communicator) else contextlib.nullcontext()

    def check_layout(self, layout: Any) -> None:
        """Raise unless every rank built the same layout (one process: nothing to compare)."""

    def take_shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of a ``[R, W*n]`` tensor: ``[R, n]``. No communication."""
        self._check_rows(x, "take_shard")
        n = self._chunk(x, "take_shard")
        return torch.stack([x[i, r * n:(r + 1) * n] for i, r in enumerate(self.ranks)])

    def split_batch(self, batch: Any, micro_batches: int = 1) -> Any:
        """A global batch cut per rank, as ``DistributedSampler`` (for examples and tests): ``[B, ...]`` (``B``
        divisible by ``W * K``, ``K = micro_batches``) -> ``[R, B // W, ...]``, or ``[R, K, B // (W K), ...]``."""
        parts_n, world = self.data_world_size * micro_batches, self.data_world_size

        def one(path: Any, x: torch.Tensor) -> torch.Tensor:
            if x.dim() == 0 or x.shape[0] % parts_n:
                raise ValueError(f"split_batch: batch{tp.keystr(path)} has shape {tuple(x.shape)}; dim 0 must be "
                                 f"divisible by the world size {world} times micro_batches {micro_batches}")
            lead = (world,) if micro_batches == 1 else (world, micro_batches)
            parts = x.reshape(*lead, x.shape[0] // parts_n, *x.shape[1:])
            return parts[list(self.data_ranks)] if self.local_ranks < world else parts

        return tp.tree_map_with_path(one, batch)

    def _check_rows(self, x: torch.Tensor, what: str) -> None:
        if x.dim() < 1 or x.shape[0] != self.local_ranks:
            raise ValueError(f"{what}: expected a leading local-rank axis of size {self.local_ranks}, "
                             f"got shape {tuple(x.shape)}")

    def _check_broadcast(self, x: torch.Tensor, src: int) -> None:
        self._check_rows(x, "broadcast")
        if not 0 <= src < self.data_world_size:
            raise ValueError(f"broadcast: src must be a rank in [0, {self.data_world_size}), got {src}")

    def _check_into(self, x: torch.Tensor, out: torch.Tensor) -> None:
        self._check_rows(x, "all_gather_into_start")
        want = (self.local_ranks, self.world_size * x.shape[-1])
        if x.dim() != 2 or tuple(out.shape) != want or out.dtype != x.dtype:
            raise ValueError(f"all_gather_into_start: x {tuple(x.shape)} {x.dtype} needs out of shape {want} "
                             f"and dtype {x.dtype}, got {tuple(out.shape)} {out.dtype}")

    def _chunk(self, x: torch.Tensor, what: str) -> int:
        if x.dim() != 2 or x.shape[1] % self.world_size:
            raise ValueError(f"{what}: expected shape [R, W*n] with W={self.world_size}, got {tuple(x.shape)}")
        return x.shape[1] // self.world_size


class SimulatedWorld(Communicator):
    """All ``world_size`` ranks in one process: a reduce-scatter and an all-reduce add the rows in rank order
    (:func:`rank_order_sum`: ``fzero.dist``'s point-to-point bits, at every world size and on every CPU; a sum over
    dim 0 is a reduction kernel whose order follows the CPU's vector width); one rank's reductions return their input.
    ``mesh`` (:func:`mesh_groups`): rows are the job's ranks, each collective runs per shard group as a world of its
    own, and :meth:`all_reduce_replicas_start` adds each shard's copies in replica order; ``broadcast`` spans all.
    ``hpz=True`` (ZeRO++ hpZ, with a mesh): the state sharded over every rank, and ``node`` the mesh's shard groups,
    within which stage 3 regathers each unit for backward from a secondary shard. ``device``: where its tensors live
    (:attr:`Communicator.device`; it runs on tensors of any device). ``groups`` (:func:`param_groups`; a flat world
    only): ``{name: mesh}``, each a parameter group's communicator in :attr:`groups`, its collectives run per rank group
    as a world of its own, nothing replicated across them (``parts`` groups; ``part``, each row's)."""

    def __init__(self, world_size: int, *, mesh: Mesh | None = None, hpz: bool = False,
                 device: torch.device | str = "cpu", groups: Mapping[str, Mesh] | None = None):
        if not (isinstance(world_size, int) and world_size >= 1):
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if hpz and mesh is None:
            raise ValueError("SimulatedWorld(hpz=True) needs a mesh: its shard groups are the nodes")
        if groups and mesh is not None:
            raise ValueError("SimulatedWorld: parameter groups (groups=) need a flat world: not with a mesh")
        named = param_groups(groups or {}, world_size)
        groups = None if mesh is None else mesh_groups(mesh, world_size)
        self.device = torch.device(device)
        self._text = "" if groups is None else (", hpz " if hpz else ", ") + mesh_text(groups)
        if hpz:  # the state over every rank; the mesh's groups only where stage 3 regathers
            self.node, groups = SimulatedWorld(world_size, mesh=mesh, device=device), None
        # one group in rank order: the flat world's code and bits
        self._groups = None if groups is None or groups == (tuple(range(world_size)),) else groups
        shards = world_size if self._groups is None else len(groups[0])
        self.world_size, self.local_ranks, self.replicas = shards, world_size, world_size // shards
        place = {r: j for g in groups or (range(world_size),) for j, r in enumerate(g)}  # each rank's shard
        self.ranks = tuple(place[r] for r in range(world_size))
        self.reduce_scatter_buffers, self.all_reduce_buffers = 0.0, float(shards)  # the sum, one per row
        self._flat = self if self._groups is None else SimulatedWorld(shards, device=device)
        if named:
            self._text += ", groups={" + ", ".join(f"{n!r}: ({len(g)}, {len(g[0])})" for n, g in named.items()) + "}"
            self.groups = {name: SimulatedWorld._partition(world_size, name, lists, device)
                           for name, lists in named.items()}

    @staticmethod
    def _partition(world_size: int, name: str, lists: tuple[tuple[int, ...], ...],
                   device: torch.device | str) -> SimulatedWorld:
        """Parameter group ``name``'s communicator: the mesh of its rank groups, nothing replicated across them."""
        out = SimulatedWorld(world_size, mesh=lists, device=device)
        out.replicas, out.parts, out.rank_groups = 1, len(lists), lists
        out._part = tuple(next(q for q, g in enumerate(lists) if r in g) for r in range(world_size))
        out._text = f", group {name!r}: {len(lists)} of {len(lists[0])} ranks"
        return out

    @property
    def data_ranks(self) -> tuple[int, ...]:
        return tuple(range(self.local_ranks))

    def __repr__(self) -> str:
        on = "" if self.device.type == "cpu" else f", device={str(self.device)!r}"
        return f"SimulatedWorld({self.local_ranks}{self._text}{on})"

    def _per_group(self, x: torch.Tensor, op: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        if self._groups is None:
            return op(x)
        parts = [(list(g), op(x[list(g)])) for g in self._groups]
        out = parts[0][1].new_empty(self.local_ranks, *parts[0][1].shape[1:])
        for rows, part in parts:
            out[rows] = part
        return out

    def all_reduce(self, x: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        self._check_rows(x, "all_reduce")
        if op not in ("sum", "avg", "max"):
            raise ValueError(f"unknown reduce op {op!r}")
        if self.world_size == 1:  # the identity: no copy
            return x
        if self._groups is not None:
            return self._per_group(x, lambda rows: self._flat.all_reduce(rows, op))
        total = x.amax(dim=0) if op == "max" else rank_order_sum(x.unbind(0))  # new: averaged in place
        total = total.div_(self.world_size) if op == "avg" else total
        return total.unsqueeze(0).repeat(self.world_size, *([1] * (x.dim() - 1)))

    def all_reduce_replicas_start(self, x: torch.Tensor, op: ReduceOp = "sum") -> Callable[[], torch.Tensor]:
        self._check_rows(x, "all_reduce_replicas")
        if self._groups is None or self.replicas == 1:  # a parameter group's rank groups hold different parameters
            return lambda: x
        out = torch.empty_like(x)
        for holders in zip(*self._groups):  # the ranks holding one shard, in replica order
            rows = [x[r] for r in holders]
            total = torch.stack(rows).amax(dim=0) if op == "max" else rank_order_sum(rows)
            out[list(holders)] = total.div_(self.replicas) if op == "avg" else total
        return lambda: out

    def reduce_scatter(self, x: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        self._check_rows(x, "reduce_scatter")
        if op == "max":
            raise ValueError("reduce_scatter supports 'sum' and 'avg'")
        n = self._chunk(x, "reduce_scatter")
        if self.world_size == 1:
            return x
        if self._groups is not None:
            return self._per_group(x, lambda rows: self._flat.reduce_scatter(rows, op))
        total = rank_order_sum(x.reshape(self.world_size, self.world_size, n).unbind(0))
        return total.div_(self.world_size) if op == "avg" else total

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        self._check_rows(x, "all_gather")
        if x.dim() != 2:
            raise ValueError(f"all_gather: expected shape [R, n], got {tuple(x.shape)}")
        if self._groups is not None:
            return self._per_group(x, self._flat.all_gather)
        return x.reshape(1, -1).expand(self.world_size, -1).clone()  # a gather's output never aliases its input

    def all_gather_into_start(self, x: torch.Tensor, out: torch.Tensor) -> Callable[[], torch.Tensor]:
        self._check_into(x, out)
        out.copy_(x.reshape(1, -1).expand(self.world_size, -1) if self._groups is None else self.all_gather(x))
        return lambda: out

    def all_to_all_start(self, x: torch.Tensor) -> Callable[[], torch.Tensor]:
        self._check_rows(x, "all_to_all")
        n = self._chunk(x, "all_to_all")
        w = self.world_size
        out = self._per_group(x, lambda rows: rows.view(w, w, n).transpose(0, 1).reshape(w, w * n))
        return lambda: out

    def all_to_all_lists(self, chunks: Sequence[Sequence[torch.Tensor]]) -> list[list[torch.Tensor]]:
        if len(chunks) != self.local_ranks or any(len(c) != self.world_size for c in chunks):
            raise ValueError(f"all_to_all_lists: expected {self.local_ranks} rows of {self.world_size} chunks, got "
                             f"{[len(c) for c in chunks]}")
        out: list[list[torch.Tensor]] = [[] for _ in range(self.local_ranks)]
        for g in self._groups or (tuple(range(self.local_ranks)),):  # within each group, rank k is row g[k]
            for r in g:
                out[r] = [chunks[src][self.ranks[r]].clone() for src in g]  # a received tensor is its own
        return out

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        self._check_broadcast(x, src)
        return x[src].unsqueeze(0).repeat(self.local_ranks, *([1] * (x.dim() - 1)))


@dataclasses.dataclass(frozen=True)
class CollectiveRecord:
    """One collective as one rank saw it: ``elements`` of its buffer per rank (the input of all-reduce and
    reduce-scatter, the output of all-gather); ``moved``, the elements each rank sends (ring: ``2 (W-1)/W`` of them for
    all-reduce, ``(W-1)/W`` otherwise; a tree broadcast: about all); ``bytes = moved * itemsize``. ``axis``: the ranks
    it spans, ``"shard"`` (a shard group: W its size), ``"replica"`` (a mesh's copies of a shard), ``"world"``,
    ``"node"`` (hpZ's regathers within a shard group), or a parameter group's name (one of its rank groups)."""

    op: str
    dtype: torch.dtype
    elements: int
    moved: float
    bytes: float
    axis: str = "shard"


class CountingCommunicator(Communicator):
    """Wraps a communicator and records every collective it runs, in the order issued (traced: once, while tracing)."""

    def __init__(self, inner: Communicator, records: list[CollectiveRecord] | None = None, axis: str = "shard"):
        self.wrapping(inner)
        self.records, self._axis = [] if records is None else records, axis
        # hpZ's node: counted into the same records, on the "node" axis; a parameter group's, on an axis of its name
        self.node = None if inner.node is None else CountingCommunicator(inner.node, self.records, "node")
        self.groups = {name: CountingCommunicator(c, self.records, name) for name, c in inner.groups.items()}

    def __repr__(self) -> str:
        return f"CountingCommunicator({self.inner!r})"

    def reset(self) -> None:
        self.records.clear()  # in place: a node's counter shares the list

    def _record(self, op: str, x: torch.Tensor, axis: str | None = None) -> Communicator:
        """Record collective ``op`` of ``x`` over ``axis``; return the wrapped communicator, which runs it."""
        if op == "reduce_scatter" and getattr(self.inner, "reduce_scatter_via", None) == "all_reduce":
            op = "all_reduce"  # what the backend really sends
        axis = "world" if op == "broadcast" and self.replicas > 1 else axis or self._axis
        w = {"replica": self.replicas, "world": self.data_world_size}.get(axis, self.world_size)
        elements = x[0].numel() * (w if op == "all_gather" else 1)
        ring_factor = {"all_reduce": 2.0, "broadcast": w / max(w - 1, 1)}.get(op, 1.0)
        moved = elements * ring_factor * (w - 1) / w
        self.records.append(CollectiveRecord(op, x.dtype, elements, moved, moved * x.element_size(), axis))
        return self.inner

    def all_reduce_start(self, x: torch.Tensor, op: ReduceOp = "sum") -> Callable[[], torch.Tensor]:
        return self._record("all_reduce", x).all_reduce_start(x, op)

    def reduce_scatter_start(self, x: torch.Tensor, op: ReduceOp = "sum") -> Callable[[], torch.Tensor]:
        return self._record("reduce_scatter", x).reduce_scatter_start(x, op)

    def all_reduce_replicas_start(self, x: torch.Tensor, op: ReduceOp = "sum") -> Callable[[], torch.Tensor]:
        if self.replicas == 1:
            return lambda: x
        return self._record("all_reduce", x, "replica").all_reduce_replicas_start(x, op)

    def all_reduce_shard_start(self, x: torch.Tensor, op: ReduceOp = "sum") -> Callable[[], torch.Tensor]:
        return self._record("all_reduce", x).all_reduce_shard_start(x, op)

    def all_gather_start(self, x: torch.Tensor) -> Callable[[], torch.Tensor]:
        return self._record("all_gather", x).all_gather_start(x)

    def all_to_all_start(self, x: torch.Tensor) -> Callable[[], torch.Tensor]:
        return self._record("all_to_all", x).all_to_all_start(x)

    def all_to_all_lists(self, chunks: Sequence[Sequence[torch.Tensor]]) -> list[list[torch.Tensor]]:
        # what each row sends to the other ranks of its group (its own chunk stays), one record per row: the rows'
        # chunks differ in size
        for rank, row in zip(self.ranks, chunks):
            sent = sum(c.numel() for k, c in enumerate(row) if k != rank)
            self.records.append(CollectiveRecord("all_to_all", row[0].dtype, sum(c.numel() for c in row), sent,
                                                 sent * row[0].element_size(), self._axis))
        return self.inner.all_to_all_lists(chunks)

    def all_gather_into_start(self, x: torch.Tensor, out: torch.Tensor) -> Callable[[], torch.Tensor]:
        return self._record("all_gather", x).all_gather_into_start(x, out)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        return self._record("broadcast", x).broadcast(x, src)

    def check_layout(self, layout: Any) -> None:
        self.inner.check_layout(layout)

    def totals(self, ops: Sequence[str] | None = None, min_elements: int = 0,
               axis: str | None = None) -> dict[str, float]:
        """Sums over the records (optionally only ``ops``, only buffers of ``min_elements`` or more, one ``axis``)."""
        rows = [r for r in self.records if (ops is None or r.op in ops) and r.elements >= min_elements
                and axis in (None, r.axis)]
        return {"calls": len(rows), "elements": sum(r.elements for r in rows),
                "moved": sum(r.moved for r in rows), "bytes": sum(r.bytes for r in rows)}
