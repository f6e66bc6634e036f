"""Gradient buckets (parameters whose gradients are reduced together: about ``bucket_numel`` elements at stages 1-2,
:func:`size_buckets`, as DDP's ``bucket_cap_mb``; a shard unit at stage 3), each reduced as soon as backward completes
it. Eagerly :class:`BucketWatcher` hands a complete bucket over and :class:`BucketReduction` calls the step's
``on_ready`` on it through a :class:`Runner`, on a thread of its own when the communicator ``overlaps`` (as DDP).
Launch order is the same on every rank.

Imports: layout, scopes.
"""

from __future__ import annotations

import concurrent.futures
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .layout import FlatGrads, FlatGroup, Layout, compute_dtype, named_leaves, stack_rows
from .scopes import GRAD_BUCKETS, step_scope

__all__ = ["MIN_BUCKET_NUMEL", "SMALL_MODEL_NUMEL", "LARGE_BUCKET_NUMEL", "default_bucket_numel", "MAX_IN_FLIGHT",
           "size_buckets", "buckets_of", "Runner", "BufferPool", "BucketReduction", "BucketWatcher", "used_flags"]

# Small models' buckets keep a step's per-bucket blocks under the 4 MiB mmap pin (fzero.host_malloc): reused from the
# heap, not faulted in afresh (58M: 1.24x -> 1.04x DDP, held +48 MiB); at 162M they held more and were no faster
# (benchmarks/RESULTS.md, 5)
MIN_BUCKET_NUMEL = 1 << 19  # 2 MiB of fp32
SMALL_MODEL_NUMEL = 1 << 26  # 128 buckets of MIN_BUCKET_NUMEL
LARGE_BUCKET_NUMEL = 1 << 24  # 64 MiB of fp32
MAX_IN_FLIGHT = 2  # reductions under way (each holding its bucket's buffer) before a rank waits for the oldest


def default_bucket_numel(numel: int) -> int:
    """The default bucket for ``numel`` trainable elements: MIN_BUCKET_NUMEL up to SMALL_MODEL_NUMEL, else LARGE."""
    return MIN_BUCKET_NUMEL if numel <= SMALL_MODEL_NUMEL else LARGE_BUCKET_NUMEL


def size_buckets(params: Any, bucket_numel: int | None = None,
                 trainable: Callable[[str], bool] | None = None) -> dict[str, int]:
    """``{path: bucket}`` cutting the trainable parameters into buckets of about ``bucket_numel`` elements (default
    :func:`default_bucket_numel` of their total; ``ValueError`` unless a positive int): in reverse registration order
    (backward's, for most models) a bucket closes once it holds ``bucket_numel`` elements; a parameter that large gets
    its own (on a real rank autograd's gradient is then the bucket). Numbered in registration order: backward
    completes the last first."""
    if bucket_numel is not None and not (isinstance(bucket_numel, int) and bucket_numel >= 1):
        raise ValueError(f"bucket_numel must be a positive int, got {bucket_numel!r}")
    is_module = isinstance(params, torch.nn.Module)
    leaves = named_leaves(params)[0]
    sizes = [(path, x.numel()) for path, x in leaves
             if ((x.requires_grad if is_module else True) if trainable is None else trainable(path))]
    bucket_numel = default_bucket_numel(sum(n for _, n in sizes)) if bucket_numel is None else bucket_numel
    # cut from the end, then number from the front
    from_end: dict[str, int] = {}
    b, filled = 0, 0
    for path, n in reversed(sizes):
        if filled >= bucket_numel or (filled and n >= bucket_numel):
            b, filled = b + 1, 0
        from_end[path] = b
        filled += n
    return {path: b - from_end.get(path, b) for path, _ in leaves}


def buckets_of(layout: Layout) -> tuple[tuple[FlatGroup, ...], ...]:
    """The flat groups of each bucket ``0 .. max bucket`` (a bucket may have none)."""
    n = 1 + max((g.bucket for g in layout.groups), default=0)
    return tuple(tuple(g for g in layout.groups if g.bucket == b) for b in range(n))


class Runner:
    """Runs the calls a step hands it in that order (every rank issues its collectives in one order): ``threaded``, on a
    thread of its own, else (or under a profiler, which records only its own thread) at once. :meth:`submit` returns a
    function giving the result (raising its error). ``with runner:`` ends once every call has run, also after an error
    (a collective left running could pair with another thread's next one)."""

    def __init__(self) -> None:
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: list[concurrent.futures.Future] = []

    def submit(self, threaded: bool, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[[], Any]:
        if not threaded or torch.autograd.profiler._is_profiler_enabled:
            out = fn(*args, **kwargs)
            return lambda: out
        if self._thread is None:
            self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fzero-collectives")
        future = self._thread.submit(_on_caller_stream(fn), *args, **kwargs)
        self._pending.append(future)
        return future.result

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: Any) -> None:
        pending, self._pending = self._pending, []
        concurrent.futures.wait(pending)

    def __del__(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=False)


def _on_caller_stream(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` to run on another thread with the caller's current CUDA device and stream (a thread starts on the default
    stream of device 0: its collectives would race the caller's kernels on another stream, or run on another GPU);
    ``fn`` itself where CUDA is not in use."""
    if not torch.cuda.is_initialized():
        return fn
    stream = torch.cuda.current_stream()

    def on_stream(*args: Any, **kwargs: Any) -> Any:
        with torch.cuda.stream(stream):  # sets the stream's device too
            return fn(*args, **kwargs)

    return on_stream


class BufferPool:
    """Gradient bucket buffers reused from one bucket to the next within a step (eager stages 1-2),
    sparing fresh buffers' page faults: at most ``limit`` kept, emptied once the last bucket is launched."""

    def __init__(self, limit: int = MAX_IN_FLIGHT + 1):
        self.limit = limit
        self.free: list[torch.Tensor] = []

    def take(self, numel: int, dtype: torch.dtype, device: torch.device | None) -> torch.Tensor:
        """An uninitialised 1-D buffer of at least ``numel``: the smallest free one that fits, else a new one."""
        fits = [i for i, t in enumerate(self.free)
                if t.numel() >= numel and t.dtype == dtype and (device is None or t.device == device)]
        if fits:
            return self.free.pop(min(fits, key=lambda i: self.free[i].numel()))
        with step_scope(GRAD_BUCKETS):
            return torch.empty(numel, dtype=dtype, device=device)

    def give(self, t: torch.Tensor) -> None:
        """Return a buffer nothing else refers to any more; a full pool keeps the largest."""
        self.free.append(t)
        if len(self.free) > self.limit:
            self.free.pop(min(range(len(self.free)), key=lambda i: self.free[i].numel()))

    def clear(self) -> None:
        self.free.clear()


class BucketReduction:
    """Per bucket, each local rank's flat gradients until all have delivered them; then ``on_ready(FlatGrads)`` (the
    step's reduction: averaged shards per flat group) goes to the ``runner``, at most :data:`MAX_IN_FLIGHT` at a time.
    Eager only. ``groups[b]``: bucket ``b``'s flat groups. ``launches``: buckets launched together, in launch order
    (default: each alone, in bucket order). ``in_order``: a launch ready out of turn waits (stages 1-2); otherwise each
    goes when ready (stage 3)."""

    def __init__(self, groups: Sequence[Sequence[FlatGroup]], on_ready: Callable[[FlatGrads], Sequence[torch.Tensor]],
                 runner: Runner, threaded: bool, rows: int, launches: Sequence[Sequence[int]] | None = None, *,
                 in_order: bool = False, pool: BufferPool | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | None = None):
        self.groups, self.on_ready, self.runner, self.threaded, self.rows = groups, on_ready, runner, threaded, rows
        launches = [(b,) for b in range(len(groups))] if launches is None else launches
        self.launches = [ls for ls in (tuple(b for b in ls if groups[b]) for ls in launches) if ls]
        self.launch_of = {b: i for i, ls in enumerate(self.launches) for b in ls}
        self.in_order, self.dtype, self.device = in_order, dtype, device
        self.pool = pool if pool is not None else BufferPool(0)
        self.parts: dict[int, dict[int, tuple[torch.Tensor, ...] | None]] = {}
        self.own: dict[int, tuple[torch.Tensor, ...]] = {}  # bucket -> its buffers' bases
        self.ready: set[int] = set()
        self.launched = [False] * len(self.launches)
        self.next = 0  # in_order: the next launch in turn
        self.started: list[tuple[tuple[FlatGroup, ...], tuple[torch.Tensor, ...], Callable[[], Any]]] = []
        self.shards: dict[int, torch.Tensor] = {}  # flat group index -> averaged shard

    def buffers(self, bucket: int) -> tuple[torch.Tensor, ...]:
        """Bucket ``bucket``'s gradient buffers from the pool, ``[R, padded]`` per flat group, uninitialised."""
        if bucket not in self.own:
            self.own[bucket] = tuple(self.pool.take(self.rows * g.padded_numel, compute_dtype(g, self.dtype),
                                                    self.device) for g in self.groups[bucket])
        return tuple(base[:self.rows * g.padded_numel].view(self.rows, g.padded_numel)
                     for g, base in zip(self.groups[bucket], self.own[bucket]))

    def add(self, bucket: int, row: int, grads: tuple[torch.Tensor, ...] | None = None) -> None:
        """Local rank ``row``'s gradient of every flat group of ``bucket`` (``[padded]`` each),
        or, without ``grads``, written into its row of :meth:`buffers`."""
        got = self.parts.setdefault(bucket, {})
        got[row] = grads
        if len(got) < self.rows:
            return
        self.ready.add(bucket)
        if self.in_order:
            while self.next < len(self.launches) and all(b in self.ready for b in self.launches[self.next]):
                self._launch(self.next)
                self.next += 1
        elif all(b in self.ready for b in self.launches[self.launch_of[bucket]]):
            self._launch(self.launch_of[bucket])

    def _launch(self, i: int) -> None:
        while len(self.started) >= MAX_IN_FLIGHT:
            self._wait_oldest()
        groups, flats, owned = [], [], []
        for b in self.launches[i]:
            got = self.parts.pop(b)
            self.ready.discard(b)
            bufs = self.buffers(b) if b in self.own else None
            owned.extend(self.own.pop(b, ()))
            for pos, g in enumerate(self.groups[b]):
                groups.append(g)
                flats.append(bufs[pos] if bufs is not None else stack_rows([got[r][pos] for r in range(self.rows)]))
        self.launched[i] = True
        if all(self.launched):  # no bucket left to fill: the pool would only raise the step's peak, which is here
            self.pool.clear()
            self.pool = BufferPool(0)
        self.started.append((tuple(groups), tuple(owned),
                             self.runner.submit(self.threaded, self.on_ready, FlatGrads(groups, flats))))

    def _wait_oldest(self) -> None:
        groups, owned, done = self.started.pop(0)
        shards = done()
        self.shards.update((g.index, shard) for g, shard in zip(groups, shards))
        kept = {s.untyped_storage().data_ptr() for s in shards}
        for base in owned:  # back to the pool unless a result views it (one rank: the identity)
            if base.untyped_storage().data_ptr() not in kept:
                self.pool.give(base)

    def finish(self, device: torch.device, dtype: torch.dtype | None) -> tuple[torch.Tensor, ...]:
        """Launch what is left in launch order, the same on every rank (a bucket not every rank's loss reached: zeros
        for the missing rows), wait for every reduction; per flat group the averaged ``[R, shard_numel]`` shard."""
        for i, buckets in enumerate(self.launches):
            if self.launched[i]:
                continue
            for b in buckets:
                got = self.parts.setdefault(b, {})
                for r in [r for r in range(self.rows) if r not in got]:  # zeros for the rows not delivered
                    if b in self.own:
                        for buf in self.buffers(b):
                            buf[r].zero_()
                        got[r] = None
                    else:
                        got[r] = tuple(torch.zeros(g.padded_numel, dtype=compute_dtype(g, dtype), device=device)
                                       for g in self.groups[b])
            self._launch(i)
        self.next = len(self.launches)
        while self.started:
            self._wait_oldest()
        shards, self.shards = self.shards, {}
        return tuple(shards[k] for k in sorted(shards))


class BucketWatcher:
    """One local rank's (``row`` of ``rows``) gradients, written into its row of each bucket's buffers
    (``buffers(bucket)``: ``[R, padded]`` per flat group; ``groups``: :func:`buckets_of`). A post-accumulate-grad hook
    per trainable leaf copies the gradient into place and drops it; a complete bucket gets its padding zeroed and
    ``deliver(bucket, None)`` (:meth:`finish`: the incomplete ones, with zeros). A bucket of one parameter filling its
    flat group (``rows == 1``) is delivered as autograd's gradient itself: ``deliver(bucket, (grad,))``. :meth:`close`
    removes the hooks (also after an error: they would keep every leaf in a reference cycle)."""

    def __init__(self, layout: Layout, groups: Sequence[Sequence[FlatGroup]], row: int,
                 buffers: Callable[[int], tuple[torch.Tensor, ...]],
                 deliver: Callable[[int, tuple[torch.Tensor, ...] | None], None], rows: int = 1):
        self.layout, self.groups, self.row, self.buffers, self.deliver = layout, groups, row, buffers, deliver
        self.missing = [sum(len(g.slots) for g in gs) for gs in self.groups]
        self.whole = {b for b, gs in enumerate(groups)
                      if rows == 1 and len(gs) == 1 and len(gs[0].slots) == 1 and not gs[0].padding}
        self.position = {g.index: pos for gs in groups for pos, g in enumerate(gs)}
        self.filled: set[int] = set()  # slot indices whose gradient is in the buffer
        self.used: set[int] = set()  # slot indices that had a gradient (DDP's "used" parameters)
        self.handles: list[Any] = []

    def watch(self, leaves: Sequence[torch.Tensor]) -> None:
        """Hook the leaf tensors of the trainable slots (in ``layout.trainable_slots`` order)."""
        index = {s.path: i for i, s in enumerate(self.layout.slots)}
        for s, leaf in zip(self.layout.trainable_slots, leaves):
            self.handles.append(leaf.register_post_accumulate_grad_hook(functools.partial(self._got, index[s.path])))

    def _view(self, slot: int) -> torch.Tensor:
        s = self.layout.slots[slot]
        g = self.layout.groups[s.group]
        return self.buffers(s.bucket)[self.position[g.index]][self.row, s.offset : s.offset + s.numel]

    def _got(self, slot: int, leaf: torch.Tensor) -> None:
        b = self.layout.slots[slot].bucket
        grad, leaf.grad = leaf.grad, None
        self.used.add(slot)
        if b in self.whole and grad.is_contiguous():
            # autograd's accumulated gradient is its own tensor (it copies one it cannot take)
            self.missing[b] = -1
            self.deliver(b, (grad.view(-1),))
            return
        self._view(slot).view(leaf.shape).copy_(grad)
        del grad
        self.filled.add(slot)
        self.missing[b] -= 1
        if self.missing[b] == 0:
            self._deliver(b)

    def _deliver(self, bucket: int) -> None:
        for g in self.groups[bucket]:
            for i in [i for i in g.slots if i not in self.filled]:  # parameters without a gradient
                self._view(i).zero_()
            if g.padding:
                self.buffers(bucket)[self.position[g.index]][self.row, g.numel:].zero_()
        self.missing[bucket] = -1  # delivered
        self.deliver(bucket, None)

    def finish(self) -> None:
        """Deliver the buckets backward left incomplete (parameters without a gradient: zeros)."""
        self.close()
        for b, gs in enumerate(self.groups):
            if gs and self.missing[b] > 0:
                self._deliver(b)

    def close(self) -> None:
        """Remove the hooks."""
        for h in self.handles:
            h.remove()
        self.handles.clear()


def used_flags(used: Sequence[Sequence[float]], device: torch.device | str) -> torch.Tensor:
    """``[R, T]`` float64 on ``device``: 1 where local rank ``r``'s loss reached trainable parameter ``t`` (``used``,
    what the hooks saw on the host). Made there by fills, never copied from the host: a host list copied to a GPU
    waits for every kernel queued before it."""
    rows, width = len(used), len(used[0]) if used else 0
    if all(all(row) for row in used):
        return torch.ones(rows, width, dtype=torch.float64, device=device)
    out = torch.zeros(rows, width, dtype=torch.float64, device=device)
    for r, row in enumerate(used):
        t = 0
        while t < width:  # one fill per run of used parameters
            if not row[t]:
                t += 1
                continue
            end = t
            while end < width and row[end]:
                end += 1
            out.select(0, r).narrow(0, t, end - t).fill_(1.0)
            t = end
    return out
