""":class:`TorchCommunicator`, over a ``torch.distributed`` process group, one process per rank (``torchrun``). Eagerly
its collectives are c10d calls with ``async_op=True``; traced, fzero's operators on gloo (:mod:`fzero.dist.gloo`),
functional collectives elsewhere: the same algorithm, so eager and compiled steps reduce to the same bits. Its
``device`` is the CPU on gloo and this process's accelerator on NCCL (``LOCAL_RANK``'s: :func:`start_process_group`
sets it current and binds the group to it), where every tensor it sends lives.

Imports: comm, layout, dist.gloo.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import math
import os
import pickle
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ..comm import Communicator, Mesh, ReduceOp, mesh_groups, mesh_text, param_groups, rank_order_sum
from ..layout import Layout, first_difference
from .gloo import (
    C10D_OP,
    Bound,
    ScratchPool,
    average_owned,
    host_group,
    point_to_point_all_reduce,
    point_to_point_gather,
    point_to_point_reduce_scatter,
    wait,
    waiter,
)

__all__ = ["TorchCommunicator", "LayoutMismatchError", "REDUCE_SCATTER_PATHS", "ALL_GATHER_PATHS",
           "ALL_REDUCE_PATHS", "DEFAULT_TIMEOUT", "launcher_world_size", "choose_comm", "start_process_group",
           "device_for", "host_group"]

REDUCE_SCATTER_PATHS = ("reduce_scatter", "all_to_all", "all_reduce")
ALL_GATHER_PATHS = ("all_gather", "point_to_point")
ALL_REDUCE_PATHS = ("all_reduce", "rank_order")
# 10 min: a stalled peer must raise CollectiveError in bounded time; room for a slow step or checkpoint save under load
DEFAULT_TIMEOUT: float = 600.0

# torch 2.13 names these *_single; older torch only has the *_tensor names
_funcol_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_funcol_reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
_c10d_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_c10d_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def launcher_world_size(env: Mapping[str, str] | None = None) -> int | None:
    """The world size a launcher (``torchrun``) gave this process, or ``None``."""
    env = os.environ if env is None else env
    return int(env["WORLD_SIZE"]) if "LOCAL_RANK" in env and "WORLD_SIZE" in env else None


def choose_comm(requested: str, env: Mapping[str, str] | None = None) -> str:
    """``"sim"`` or ``"torch"`` for a script's ``--comm {auto,sim,torch}``: ``auto`` is ``torch`` under a
    launcher and ``sim`` otherwise; ``sim`` under a launcher of several ranks raises ``ValueError`` (each
    process would run the same simulated world and write the same files)."""
    if requested not in ("auto", "sim", "torch"):
        raise ValueError(f"--comm must be auto, sim or torch, got {requested!r}")
    world = launcher_world_size(env)
    if requested == "auto":
        return "torch" if world is not None else "sim"
    if requested == "sim" and world is not None and world > 1:
        raise ValueError(f"--comm sim under a launcher of {world} ranks (WORLD_SIZE={world}): each process would "
                         "run its own simulated world and write the same files; use --comm torch (or auto) under "
                         "torchrun, or run the script without torchrun for a simulated world")
    return requested


# backends whose collectives the host runs on host tensors; any other runs on an accelerator's streams
HOST_BACKENDS = ("gloo", "mpi")
# an accelerator backend's device type (one not named here: the accelerator torch has, else the CPU)
_BACKEND_DEVICE = {"nccl": "cuda", "xccl": "xpu", "hccl": "hpu"}


def local_rank(env: Mapping[str, str] | None = None) -> int | None:
    """This process's ``LOCAL_RANK`` (its place on its node, which a launcher sets), or ``None``."""
    env = os.environ if env is None else env
    return int(env["LOCAL_RANK"]) if env.get("LOCAL_RANK", "") != "" else None


def device_for(backend: str, rank: int | None = None) -> torch.device:
    """The device a process group of ``backend`` takes its tensors on, for the process of local rank ``rank``: the
    CPU for gloo (and MPI), else the backend's accelerator, index ``rank`` (``"nccl"`` -> ``cuda:rank``; ``rank`` None:
    the accelerator's current device, where torch knows it). A backend per device (``"cpu:gloo,cuda:nccl"``): its
    accelerator's. Needs no accelerator to answer."""
    text = str(backend).lower()
    if ":" in text:  # one backend per device type
        kind = next((d for d, _ in (e.split(":", 1) for e in text.split(",")) if d != "cpu"), "cpu")
    elif text in HOST_BACKENDS:
        kind = "cpu"
    else:
        accelerator = getattr(torch, "accelerator", None)
        found = accelerator.current_accelerator() if accelerator is not None else None
        kind = _BACKEND_DEVICE.get(text) or (found.type if found is not None else "cpu")
    if kind == "cpu":
        return torch.device("cpu")
    if rank is not None:
        return torch.device(kind, rank)
    module = getattr(torch, kind, None)
    available = module is not None and getattr(module, "is_available", lambda: False)()
    return torch.device(kind, module.current_device()) if available else torch.device(kind)


def start_process_group(backend: str | None = None, *, timeout: float | datetime.timedelta | None = None,
                        env: Mapping[str, str] | None = None, **kwargs: Any) -> torch.device:
    """``torch.distributed.init_process_group`` for a process a launcher started; returns its device (that of
    :func:`device_for`, ``LOCAL_RANK``'s). ``backend``: default ``"nccl"`` where CUDA is available, else ``"gloo"``. On
    an accelerator the device is made current (``torch.cuda.set_device``: what torch's own object collectives and
    ``.cuda()`` use) and the group bound to it (``device_id=``: NCCL's communicator made now, on this GPU).
    ``timeout`` (seconds or a ``timedelta``; default :data:`DEFAULT_TIMEOUT`): the group's own, which on NCCL is
    what bounds a stalled collective (the watchdog ends the process), as :class:`TorchCommunicator` does not wait
    with a timeout there. ``kwargs``: passed on (``store``, ``rank``, ``world_size``...)."""
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = device_for(backend, local_rank(env))
    seconds = DEFAULT_TIMEOUT if timeout is None else timeout
    if not isinstance(seconds, datetime.timedelta):
        if math.isinf(seconds):  # no bound of fzero's: torch's default
            seconds = None
        else:
            seconds = datetime.timedelta(seconds=float(seconds))
    if seconds is not None:
        kwargs.setdefault("timeout", seconds)
    if device.type != "cpu":
        if device.index is None:
            raise ValueError(f"start_process_group: backend {backend!r} runs on {device.type}, but there is no "
                             "LOCAL_RANK to say which device: launch with torchrun, or set LOCAL_RANK")
        getattr(torch, device.type).set_device(device)
        kwargs.setdefault("device_id", device)
    dist.init_process_group(backend, **kwargs)
    return device


class LayoutMismatchError(ValueError):
    """Ranks built different parameter layouts (different models or settings)."""


class TorchCommunicator(Communicator):
    """Collectives over ``group`` (default: the world) for this process's rank (local-rank axis of size 1);
    ``RuntimeError`` without a default process group. ``reduce_scatter_via``: ``"reduce_scatter"`` (the backend's),
    ``"all_to_all"`` (each rank sends every other its chunk point to point and adds what it received in rank order: the
    simulated world's bits) or ``"all_reduce"`` (and a slice: twice the traffic); default ``"all_to_all"`` on gloo (its
    own is its slowest), else the backend's. ``all_gather_via``: ``"all_gather"`` or ``"point_to_point"`` (gloo's
    default). ``all_reduce_via`` (sums and averages): ``"all_reduce"`` (the backend's, which beyond 2 ranks adds in
    its algorithm's order) or ``"rank_order"`` (gloo's default: the simulated world's bits at every world size; 2
    ranks' sum is the same in any order, so there the backend's, beyond a point-to-point reduce-scatter in rank order,
    then an all-gather: a ring's traffic). ``timeout`` (seconds or a ``timedelta``; ``None``, the default: :data:`DEFAULT_TIMEOUT`, 10 minutes, read
    when the communicator is built; ``float("inf")``: no bound but the process group's own) bounds each wait of a step,
    eager or compiled: a stalled or dead peer raises :class:`~fzero.comm.CollectiveError` (give
    ``init_process_group`` the same bound for what runs outside the step). ``self.timeout``: the bound in seconds, or
    ``None`` for none. ``mesh`` (instead of ``group``; :func:`fzero.comm.mesh_groups`): HSDP over the world, a process
    group per shard group and per replica group (every rank creates them all, in one order; a wrong mesh raises
    ``ValueError`` before any collective); the replica axis is a ``TorchCommunicator`` of its own, ``self.replica``.
    ``hpz=True`` (with a mesh; ZeRO++ hpZ): the state sharded over the whole world, and ``self.node`` a
    ``TorchCommunicator`` over this rank's shard group, within which stage 3 regathers for backward. ``groups`` (a
    flat world; :func:`fzero.comm.param_groups`): ``{name: mesh}``, a parameter group's rank groups, each a process
    group (every rank creates them all, in one order, after the mesh's); ``self.groups[name]`` a ``TorchCommunicator``
    over this rank's, with the same options (``parts``, ``part``: how many rank groups, and this rank's).

    ``device`` (:attr:`fzero.comm.Communicator.device`: where the tensors it sends live, and those it builds to send:
    the layout check's, the pieces' tags and agreements): default the CPU on gloo, on an accelerator backend (NCCL)
    ``LOCAL_RANK``'s device (:func:`device_for`). **Waits.** On the CPU each wait is ``work.wait(timeout)``, bounded as
    above (gloo's thread does the work, the host waits for it anyway). On an accelerator a wait is ``work.wait()``
    without a timeout, which only makes the current stream wait for the collective's and returns at once; with a
    timeout NCCL's wait would hold the host, polling, until the GPU finished, and the host could not run ahead
    queuing kernels. There ``timeout`` is not fzero's to bound (``self.timeout`` is None): a stalled peer is bounded
    by the process group's own timeout (``init_process_group(timeout=...)``, :func:`start_process_group`'s), past
    which NCCL's watchdog aborts the collective and ends the process, for torchrun to stop or restart the job."""

    def __init__(self, group: dist.ProcessGroup | None = None, *, reduce_scatter_via: str | None = None,
                 timeout: float | datetime.timedelta | None = None, all_gather_via: str | None = None,
                 mesh: Mesh | None = None, hpz: bool = False, all_reduce_via: str | None = None,
                 device: torch.device | str | None = None, groups: Mapping[str, Mesh] | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("TorchCommunicator needs an initialised default process group: call "
                               "torch.distributed.init_process_group (e.g. under torchrun) first")
        if groups and (mesh is not None or group is not None):
            raise ValueError("TorchCommunicator: parameter groups (groups=) need the flat world: not with a group or "
                             "a mesh")
        partitions = param_groups(groups or {}, dist.get_world_size())  # checked before any group is created
        self.device = (torch.device(device) if device is not None
                       else device_for(str(dist.get_backend(group if mesh is None else None)), local_rank()))
        self.replica: TorchCommunicator | None = None
        self._mesh, self._data_rank, self._groups = "", dist.get_rank(group), ()
        if hpz and mesh is None:
            raise ValueError("TorchCommunicator(hpz=True) needs a mesh: its shard groups are the nodes")
        if mesh is not None:
            if group is not None:
                raise ValueError("TorchCommunicator: give a group or a mesh, not both")
            groups = self._groups = mesh_groups(mesh, dist.get_world_size())
            shard_groups = [dist.new_group(list(g)) for g in groups]
            # every rank creates every group, in one order (hpZ has no replica axis)
            replica_groups = [] if hpz else [dist.new_group(list(c)) for c in zip(*groups)]
            q = next(i for i, g in enumerate(groups) if self._data_rank in g)
            group, self._mesh = shard_groups[q], ", " + mesh_text(groups)
            if hpz:
                self.node = TorchCommunicator(group, timeout=timeout, reduce_scatter_via=reduce_scatter_via,
                                              all_gather_via=all_gather_via, all_reduce_via=all_reduce_via,
                                              device=self.device)
                group, self._mesh, self._groups = None, ", hpz " + mesh_text(groups), ()
            elif len(groups) > 1:
                self.replica = TorchCommunicator(replica_groups[groups[q].index(self._data_rank)], timeout=timeout,
                                                 reduce_scatter_via=reduce_scatter_via, all_gather_via=all_gather_via,
                                                 all_reduce_via=all_reduce_via, device=self.device)
        # None, not the default group: holding it kept gloo's threads alive past shutdown, and could abort the process
        self._pg = group
        self._side: Any = None  # CUDA: the stream all_gather_ints waits on (made at its first use)
        self._name = (group if group is not None else dist.group.WORLD).group_name
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.local_ranks, self.ranks = 1, (self.rank,)
        self.backend = str(dist.get_backend(group))
        gloo = self.backend == "gloo"
        reduce_scatter_via = reduce_scatter_via or ("all_to_all" if gloo else "reduce_scatter")
        if reduce_scatter_via not in REDUCE_SCATTER_PATHS:
            raise ValueError(f"reduce_scatter_via must be one of {REDUCE_SCATTER_PATHS}, got {reduce_scatter_via!r}")
        all_gather_via = all_gather_via or ("point_to_point" if gloo else "all_gather")
        if all_gather_via not in ALL_GATHER_PATHS:
            raise ValueError(f"all_gather_via must be one of {ALL_GATHER_PATHS}, got {all_gather_via!r}")
        all_reduce_via = all_reduce_via or ("rank_order" if gloo else "all_reduce")
        if all_reduce_via not in ALL_REDUCE_PATHS:
            raise ValueError(f"all_reduce_via must be one of {ALL_REDUCE_PATHS}, got {all_reduce_via!r}")
        self.reduce_scatter_via, self.all_gather_via = reduce_scatter_via, all_gather_via
        self.all_reduce_via = all_reduce_via
        via_p2p = reduce_scatter_via == "all_to_all"
        if timeout is None:
            timeout = DEFAULT_TIMEOUT  # the module's, as it is now: a program may change it
        if isinstance(timeout, datetime.timedelta):
            timeout = timeout.total_seconds()
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds (float('inf'): no bound) or a timedelta, "
                             f"got {timeout!r}")
        # on an accelerator a wait orders streams, never holds the host: the process group's timeout bounds a stall
        self.timeout: float | None = None if math.isinf(timeout) or self.device.type != "cpu" else float(timeout)
        self.overlaps = True
        # beside the result: all_to_all receives the peers' chunks after the first, the others copy the input
        copies = 0.0 if reduce_scatter_via == "reduce_scatter" and not gloo else 1.0
        self.reduce_scatter_buffers = max(self.world_size - 2, 0) / self.world_size if via_p2p else copies
        # beside the chunk stage 1 keeps: the whole sum; in rank order point to point (fzero.dist.gloo) first, beside
        # the input, what its reduce-scatter receives (this rank's chunk of the sum among it)
        self.all_reduce_buffers = 1.0
        self.all_reduce_input_buffers = (self.world_size - 1) / self.world_size if self._rank_order("sum") else None
        self._ops = gloo and self.world_size > 1  # traced: fzero's operators (fzero.dist.gloo)
        # point to point: gathers, reductions, all-reduces each a residue mod 3 (stage 3 gathers while it reduces)
        self._tags = [0, 1, 2]
        self._pool: ScratchPool | None = None
        self.replicas = 1 if self.replica is None else self.replica.world_size
        if partitions:
            self._agree_on_groups(partitions)  # before new_group: ranks giving other groups would wait in it
            made = {}
            for name, lists in partitions.items():
                pgs = [dist.new_group(list(g)) for g in lists]  # every rank creates every group, in one order
                q = next(i for i, g in enumerate(lists) if self._data_rank in g)
                sub = TorchCommunicator(pgs[q], reduce_scatter_via=reduce_scatter_via, timeout=timeout,
                                        all_gather_via=all_gather_via, all_reduce_via=all_reduce_via,
                                        device=self.device)
                sub.parts, sub._part, sub._data_rank, sub.rank_groups = len(lists), (q,), self._data_rank, lists
                sub._mesh = f", group {name!r}: {len(lists)} of {len(lists[0])} ranks"
                made[name] = sub
            self.groups = made

    def _agree_on_groups(self, partitions: Mapping[str, tuple[tuple[int, ...], ...]]) -> None:
        """``ValueError`` on every rank unless every rank gave these parameter groups: one ``all_gather`` of their
        16-byte digest over the world, bounded as the step's waits."""
        digest = hashlib.sha256(repr(sorted(partitions.items())).encode()).digest()[:16]
        mine = torch.tensor(list(digest), dtype=torch.int64, device=self.device)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        wait(dist.all_gather(every, mine, async_op=True), self._bound("all_gather of the parameter groups' digest"))
        differ = [r for r, d in enumerate(every) if not torch.equal(d, every[0])]
        if differ:
            raise ValueError(f"TorchCommunicator(groups=...): ranks {differ} gave other parameter groups than rank 0 "
                             f"(this rank, {self._data_rank}: {dict(partitions)}); every rank must give the same")

    @property
    def data_ranks(self) -> tuple[int, ...]:
        return (self._data_rank,)

    def __repr__(self) -> str:
        bound = "" if self.timeout is None else f", timeout={self.timeout:g}s"
        on = "" if self.device.type == "cpu" else f", device={self.device}"
        return (f"TorchCommunicator(rank={self.rank}, world_size={self.world_size}, backend={self.backend}{on}"
                f"{bound}{self._mesh})")

    def all_reduce_replicas_start(self, x: torch.Tensor, op: ReduceOp = "sum") -> Callable[[], torch.Tensor]:
        self._check_rows(x, "all_reduce_replicas")
        return (lambda: x) if self.replica is None else self.replica.all_reduce_start(x, op)

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The process group (the default one while it exists, when none was given)."""
        return self._pg if self._pg is not None else dist.group.WORLD

    def tracing(self) -> TorchCommunicator:
        out = super().tracing()
        out.overlaps, out.replica = False, None if self.replica is None else self.replica.tracing()
        return out

    @contextlib.contextmanager
    def reusing_buffers(self) -> Iterator[None]:
        """Eagerly: gathers and reduce-scatter receives inside the block come from one :class:`ScratchPool`."""
        mine = not self.traced and self._pool is None
        self._pool = ScratchPool() if mine else self._pool
        try:
            yield
        finally:
            if mine:
                self._pool.clear()
                self._pool = None

    def _empty(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        pool = self._pool
        return pool.empty((numel,), like.dtype, like.device) if pool is not None else like.new_empty(numel)

    def _tag(self, kind: int) -> int:  # the next point-to-point tag of a kind (0: gathers, 1: reductions, 2: all-reduces)
        self._tags[kind] = (self._tags[kind] + 3) % (3 << 28)  # below the traced operators' tags (1 << 30 and up)
        return self._tags[kind]

    def _bound(self, collective: str) -> Bound:
        return None if self.timeout is None else (collective, self.rank, self.timeout)

    def _t(self) -> float:
        return self.timeout or 0.0

    def _average(self, total: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        return total / self.world_size if op == "avg" and self.world_size > 1 else total

    def _backend_avg(self, op: ReduceOp, dtype: torch.dtype) -> bool:
        """Whether ``avg`` is the backend's own ``ReduceOp.AVG``, sparing the divide's pass over the result: where it
        gives the bits of the sum divided by W, on an accelerator (gloo has no AVG) with W a power of two (1/W scales
        exactly, before the sum as NCCL's float AVG does, or after), in a dtype whose scaled terms stay normal
        (fp32, bf16, fp64; fp16 gradients scaled first would fall into subnormals)."""
        w = self.world_size
        return (op == "avg" and self.device.type != "cpu" and w > 1 and w & (w - 1) == 0
                and dtype in (torch.float32, torch.bfloat16, torch.float64))

    def _rank_order(self, op: ReduceOp) -> bool:
        """Whether an all-reduce of ``op`` runs point to point in rank order: a sum or average beyond 2 ranks (a
        maximum, and a sum of two, are the same bits in any order)."""
        return self.all_reduce_via == "rank_order" and op != "max" and self.world_size > 2

    def _traced_p2p(self) -> bool:
        return self.traced and self._ops and self.all_gather_via == "point_to_point"

    def all_reduce_start(self, x: torch.Tensor, op: ReduceOp = "sum") -> Callable[[], torch.Tensor]:
        self._check_rows(x, "all_reduce")
        if op not in ("sum", "avg", "max"):
            raise ValueError(f"unknown reduce op {op!r}")
        rank_order = self._rank_order(op)
        what = f"all_reduce ({op}) of {x[0].numel()} {x.dtype}"
        if not self.traced and rank_order:
            sent = x[0].contiguous()
            done = point_to_point_all_reduce(sent, self._pg, self.rank, self.world_size, (self._tag(2), self._tag(2)),
                                             lambda numel: self._empty(numel, sent),
                                             self._bound(what.replace(")", ", point to point)", 1)))
            return lambda: average_owned(done(), op, self.world_size).unsqueeze(0)
        native = self._backend_avg(op, x.dtype)
        if not self.traced:
            out = x[0].clone()  # c10d reduces in place; the caller's tensor stays as it was
            work = dist.all_reduce(out, dist.ReduceOp.AVG if native else C10D_OP[op], group=self._pg, async_op=True)
            return waiter(work, lambda: (out if native else average_owned(out, op, self.world_size)).unsqueeze(0),
                          self._bound(what))
        if self._ops:
            out = torch.ops.fzero.all_reduce_shard(x[0], self.world_size, -1, op, self._name, self._t(), rank_order)
            return lambda: out.unsqueeze(0)
        if native:
            started = funcol.all_reduce(x[0], "avg", self._name)
            return lambda: funcol.wait_tensor(started).unsqueeze(0)
        started = funcol.all_reduce(x[0], "max" if op == "max" else "sum", self._name)
        # functional collectives are waited for in the returned function: states hold plain tensors
        return lambda: self._average(funcol.wait_tensor(started), op).unsqueeze(0)

    def all_reduce_shard_start(self, x: torch.Tensor, op: ReduceOp = "sum") -> Callable[[], torch.Tensor]:
        """Traced on gloo one operator that frees the whole sum inside; otherwise the default."""
        if not (self.traced and self._ops):
            return super().all_reduce_shard_start(x, op)
        self._check_rows(x, "all_reduce_shard")
        self._chunk(x, "all_reduce_shard")
        if op not in ("sum", "avg"):
            raise ValueError(f"all_reduce_shard supports 'sum' and 'avg', got {op!r}")
        out = torch.ops.fzero.all_reduce_shard(x[0], self.world_size, self.rank, op, self._name, self._t(),
                                               self._rank_order(op))
        return lambda: out.unsqueeze(0)

    def reduce_scatter_start(self, x: torch.Tensor, op: ReduceOp = "sum") -> Callable[[], torch.Tensor]:
        self._check_rows(x, "reduce_scatter")
        if op not in ("sum", "avg"):
            raise ValueError("reduce_scatter supports 'sum' and 'avg'")
        n = self._chunk(x, "reduce_scatter")
        world = self.world_size
        what = f"reduce_scatter ({op}) of {x[0].numel()} {x.dtype}"
        if self.reduce_scatter_via == "all_reduce":
            # the whole sum is waited for, then sliced (slicing first was slower traced on gloo)
            reduced = self.all_reduce_start(x, "sum")
            mine = slice(self.rank * n, (self.rank + 1) * n)
            return lambda: self._average(reduced()[:, mine], op)
        if self.reduce_scatter_via == "all_to_all":
            if self.traced and self._ops:
                out = torch.ops.fzero.reduce_scatter_all_to_all(x[0].contiguous(), world, op, self._name, self._t())
                return lambda: out.unsqueeze(0)
            if self.traced:
                started = funcol.all_to_all_single(x[0].contiguous(), None, None, self._name)
                received = lambda: funcol.wait_tensor(started).view(world, n).unbind(0)  # noqa: E731
                return lambda: self._average(rank_order_sum(received()), op).unsqueeze(0)
            sent = x[0].contiguous()
            works, total = point_to_point_reduce_scatter(sent, self._pg, self.rank, world, self._tag(1),
                                                         lambda numel: self._empty(numel, sent))
            return waiter(works, lambda: average_owned(total(), op, world).unsqueeze(0),
                          self._bound(what.replace(")", ", point to point)", 1)), sent)
        native = self._backend_avg(op, x.dtype)
        if self.traced:
            started = _funcol_reduce_scatter(x[0], "avg" if native else "sum", 0, self._name)
            return lambda: (funcol.wait_tensor(started) if native
                            else self._average(funcol.wait_tensor(started), op)).unsqueeze(0)
        out, sent = x.new_empty(n), x[0].contiguous()
        work = _c10d_reduce_scatter(out, sent, dist.ReduceOp.AVG if native else dist.ReduceOp.SUM, group=self._pg,
                                    async_op=True)
        return waiter(work, lambda: (out if native else average_owned(out, op, world)).unsqueeze(0), self._bound(what),
                      sent)

    def all_gather_start(self, x: torch.Tensor) -> Callable[[], torch.Tensor]:
        self._check_rows(x, "all_gather")
        if x.dim() != 2:
            raise ValueError(f"all_gather: expected shape [R, n], got {tuple(x.shape)}")
        if self._traced_p2p():
            out = torch.ops.fzero.all_gather_point_to_point(x[0].contiguous(), self.world_size, self._name, self._t())
            return lambda: out.unsqueeze(0)
        if self.traced:
            started = _funcol_gather(x[0].contiguous(), 0, self._name)
            return lambda: funcol.wait_tensor(started).unsqueeze(0)
        out = self._empty(self.world_size * x.shape[1], x)
        return self._gather_into(out, x[0].contiguous(), lambda: out.unsqueeze(0))

    def all_to_all_start(self, x: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Eagerly c10d's ``all_to_all_single``; not traced (quantized collectives run in eager steps)."""
        self._check_rows(x, "all_to_all")
        self._chunk(x, "all_to_all")
        if self.traced:
            raise NotImplementedError("all_to_all runs eagerly only: quantized collectives need compile=False")
        sent = x[0].contiguous()
        out = torch.empty_like(sent)
        work = dist.all_to_all_single(out, sent, group=self._pg, async_op=True)
        return waiter(work, lambda: out.unsqueeze(0), self._bound(f"all_to_all of {out.numel()} {out.dtype}"), sent)

    def all_to_all_lists(self, chunks: Sequence[Sequence[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """Eagerly: the sizes by one ``all_to_all_single`` of ``W`` int64 (read on the host), then the chunks by one
        ``all_to_all_single`` with those splits, each wait bounded. Not traced."""
        if self.traced:
            raise NotImplementedError("all_to_all_lists runs eagerly only: its sizes are read on the host")
        if len(chunks) != 1 or len(chunks[0]) != self.world_size:
            raise ValueError(f"all_to_all_lists: expected 1 row of {self.world_size} chunks, got "
                             f"{[len(c) for c in chunks]}")
        mine = [c.contiguous() for c in chunks[0]]
        sizes = torch.tensor([c.shape[0] for c in mine], dtype=torch.int64).to(self.device)
        got = torch.empty_like(sizes)
        what = f"all_to_all of {self.world_size} sizes"
        wait(dist.all_to_all_single(got, sizes, group=self._pg, async_op=True), self._bound(what))
        received = got.tolist()
        sent = torch.cat(mine)
        out = sent.new_empty(sum(received), *sent.shape[1:])
        work = dist.all_to_all_single(out, sent, received, [c.shape[0] for c in mine], group=self._pg, async_op=True)
        wait(work, self._bound(f"all_to_all of {sent.numel()} {sent.dtype} in {self.world_size} chunks"))
        return [list(out.split(received))]

    def all_gather_into_start(self, x: torch.Tensor, out: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Eagerly c10d gathers straight into ``out``; traced, gloo's operator does, or the result is copied in."""
        self._check_into(x, out)
        if self._traced_p2p() and out.is_contiguous():
            torch.ops.fzero.gather_point_to_point_many([out[0]], [x[0].contiguous()], self._name, self._t())
            return lambda: out
        if self.traced or not out.is_contiguous():
            started = self.all_gather_start(x)
            return lambda: out.copy_(started())
        return self._gather_into(out[0], x[0].contiguous(), lambda: out)

    def all_gather_into(self, xs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]) -> None:
        """Traced on gloo's point-to-point path: one operator for every pair; otherwise the default."""
        if not (self._traced_p2p() and all(o.is_contiguous() for o in outs)):
            return super().all_gather_into(xs, outs)
        for x, out in zip(xs, outs):
            self._check_into(x, out)
        torch.ops.fzero.gather_point_to_point_many([o[0] for o in outs], [x[0].contiguous() for x in xs],
                                                   self._name, self._t())

    def _gather_into(self, out: torch.Tensor, sent: torch.Tensor,
                     result: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """Starts the eager gather of ``sent`` into ``out`` (``[W * n]``) as ``all_gather_via`` says."""
        if self.all_gather_via == "point_to_point" and self.world_size > 1:
            work: Any = point_to_point_gather(out, sent, self._pg, self.rank, self.world_size, self._tag(0))
        else:
            work = _c10d_all_gather(out, sent, group=self._pg, async_op=True)
        return waiter(work, result, self._bound(f"all_gather of {out.numel()} {out.dtype}"), sent)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """On a mesh from job rank ``src`` to every rank: over each replica group from its rank in ``src``'s shard
        group, then over each shard group from ``src``'s place in it."""
        self._check_broadcast(x, src)
        if self.replica is not None:
            home = next(g for g in self._groups if src in g)
            mine = next(g for g in self._groups if self._data_rank in g).index(self._data_rank)
            x = self.replica.broadcast(x, sorted(g[mine] for g in self._groups).index(home[mine]))
            src = home.index(src)
        if not self.traced:  # c10d's work, waited for as every eager collective (bounded on the CPU)
            out = x[0].contiguous().clone()
            work = dist.broadcast(out, group_src=src, group=self._pg, async_op=True)
            return waiter(work, lambda: out, self._bound(f"broadcast of {out.numel()} {out.dtype}"))().unsqueeze(0)
        out = funcol.broadcast(x[0].contiguous(), src, self._name)  # the rank within the group
        return funcol.wait_tensor(out).unsqueeze(0)

    def holder(self, shard_rank: int) -> int:
        """:meth:`Communicator.holder`: on a mesh, the lowest job rank at place ``shard_rank`` of a shard group."""
        if not self._groups or self.replicas == 1:
            return super().holder(shard_rank)
        if not 0 <= shard_rank < self.world_size:
            raise ValueError(f"holder: shard rank must be in [0, {self.world_size}), got {shard_rank}")
        return min(g[shard_rank] for g in self._groups)

    def all_gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        """:meth:`Communicator.all_gather_ints`; on CUDA on a stream of its own, read back into pinned memory there:
        the host waits for this small gather alone, not for every kernel the step has queued (stage 3 checks each unit
        call so before its gather, a stall per unit on the compute stream)."""
        if self.device.type != "cuda" or self.traced:
            return super().all_gather_ints(values)
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self._side):
            sent = self._int_bytes(values).pin_memory().to(self.device, non_blocking=True)
            out = sent.new_empty(self.world_size * sent.numel())
            _c10d_all_gather(out, sent, group=self._pg)  # NCCL orders this stream after the gather, no other
            host = out.to("cpu", non_blocking=True)  # into pinned memory
            done = torch.cuda.Event()
            done.record(self._side)
        done.synchronize()
        return self._ints(host.view(self.world_size, -1))

    def check_layout(self, layout: Layout) -> None:
        """Raise :class:`LayoutMismatchError` on every rank unless all built ``layout`` alike: one all-gather of its
        fingerprint's 16 bytes (on :attr:`device`), which every rank joins whatever it built (an error, not a hang);
        where they differ (every rank sees it), a second of each rank's ``layout.describe()`` to name the difference.
        On a mesh, per axis. Not ``all_gather_object``: on NCCL that takes the current CUDA device, not this one."""
        if self.replica is not None:
            self.replica.check_layout(layout)
        mine = torch.frombuffer(bytearray.fromhex(layout.fingerprint), dtype=torch.uint8)
        table = self._gather_host(mine.to(self.device), "the layout check's fingerprints").view(self.world_size, -1)
        odd = next((r for r in range(1, self.world_size) if not torch.equal(table[r], table[0])), None)
        if odd is None:
            return
        described = self._gather_objects(layout.describe(), "the layout check's descriptions")
        raise LayoutMismatchError(f"rank {self.rank}: ranks built different parameter layouts (rank 0 vs rank {odd}: "
                                  f"{first_difference(described[0], described[odd])}); every rank must build the "
                                  "same model with the same trainable set, parameter groups, dtypes and alignment")

    def _gather_host(self, sent: torch.Tensor, what: str) -> torch.Tensor:
        """Eagerly every rank's 1-D ``sent`` (on :attr:`device`), by c10d's all-gather, read back to the host:
        ``[world_size * n]`` on the CPU."""
        out = sent.new_empty(self.world_size * sent.numel())
        work = _c10d_all_gather(out, sent, group=self._pg, async_op=True)
        return waiter(work, lambda: out, self._bound(f"all_gather of {what}"), sent)().cpu()

    def _gather_objects(self, obj: Any, what: str) -> list[Any]:
        """Every rank's picklable ``obj`` (c10d's ``all_gather_object``, on :attr:`device`): the lengths, then the
        pickles padded to the longest."""
        data = pickle.dumps(obj)
        sizes = self._gather_host(torch.tensor([len(data)], dtype=torch.int64, device=self.device), what).tolist()
        padded = torch.zeros(max(sizes), dtype=torch.uint8)
        padded[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        table = self._gather_host(padded.to(self.device), what).view(self.world_size, -1)
        return [pickle.loads(table[r, :n].numpy().tobytes()) for r, n in enumerate(sizes)]
