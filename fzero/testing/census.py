"""A census of live tensor storage at a block's peak: inside a :class:`Census` block PyTorch's profiler records the
allocator's allocations and frees of one device (the CPU's c10 allocator by default; a CUDA device's caching allocator,
which reports each block to the profiler too) on this thread, replayed on exit: the peak and what was live at it, named
by ``known`` tensors. The device is the ``device`` argument, else that of the first ``known`` tensor off the CPU, else
the CPU. On a device with an :class:`AllocatorReader` (on CUDA by default :class:`CudaAllocator`:
``memory_allocated``, ``memory_reserved``, ``max_memory_allocated`` after ``reset_peak_memory_stats``) the census also
reads the allocator's own counters at entry and exit, which count every thread and stream, and what the allocator keeps
cached (``reserved``).
Not counted: Python objects, memory outside the allocator (oneDNN/MKL, malloc overhead, cuBLAS workspaces before the
block), threads the profiler does not follow (their frees unseen until the address is reused). The first profiler
session costs ~2 s.

Imports: none of fzero.
"""

from __future__ import annotations

import bisect
import dataclasses
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import torch

__all__ = ["Allocation", "AllocatorReader", "AllocatorReading", "Census", "CudaAllocator", "device_of",
           "malloc_in_use", "storages_of"]

KnownTensors = Iterable[torch.Tensor] | Callable[[], Iterable[torch.Tensor]]
OTHER = "other"
SCOPE_PREFIXES = ("fzero::",)  # record_function scopes that name allocations (fzero.memory.SCOPES)
CPU = torch.device("cpu")
DeviceLike = torch.device | str | int


@dataclasses.dataclass(frozen=True)
class Allocation:
    """One CPU allocation in the block: ``nbytes`` at ``ptr`` from ``start_ns`` to ``end_ns`` (None: live at
    exit). ``kind``: the profiler's category or ``"other"``; ``op``/``scope``: the innermost allocating operator
    / census ``record_function``; ``free_seen=False``: ``end_ns`` is when its address was reused, or None."""

    ptr: int
    nbytes: int
    start_ns: int
    end_ns: int | None
    kind: str = OTHER
    op: str = ""
    scope: str = ""
    free_seen: bool = True

    def live_at(self, t_ns: int) -> bool:
        return self.start_ns <= t_ns and (self.end_ns is None or t_ns < self.end_ns)


def _on(device: torch.device, want: torch.device) -> bool:
    """Whether ``device`` is ``want`` (``want`` without an index: any device of its type)."""
    return device.type == want.type and (want.index is None or device.index == want.index)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # DTensor (FSDP2 parameters): its local shard


def storages_of(tensors: Iterable[torch.Tensor], device: DeviceLike = CPU) -> list[torch.UntypedStorage]:
    """The distinct storages on ``device`` (default the CPU; without an index: every device of its type) behind
    ``tensors`` (views share one; a DTensor's local shard; empty skipped; others' devices skipped)."""
    want = torch.device(device)
    out: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t = _local(t)
            s = t.untyped_storage() if _on(t.device, want) else None
            if s is not None and s.nbytes() != 0:
                out.setdefault(s.data_ptr(), s)
    return list(out.values())


def device_of(tensors: Iterable[Any]) -> torch.device:
    """The device of the first of ``tensors`` (or anything else with a ``torch.device`` as ``device``) on neither the
    CPU nor meta, else the CPU: a training state on a GPU keeps a few CPU tensors too (a call counter, generator
    states, the hyperparameters), so any accelerator tensor decides."""
    for t in tensors:
        d = getattr(_local(t) if isinstance(t, torch.Tensor) else t, "device", None)
        if isinstance(d, torch.device) and d.type not in ("cpu", "meta"):
            return d
    return CPU


@dataclasses.dataclass(frozen=True)
class AllocatorReading:
    """One reading of a device allocator's counters, bytes: ``allocated`` (live tensor blocks), ``reserved`` (what it
    holds from the driver, cached free blocks included), ``peak_allocated`` / ``peak_reserved`` (the most of each since
    its peak was last reset)."""

    allocated: int
    reserved: int
    peak_allocated: int
    peak_reserved: int


class AllocatorReader(Protocol):
    """A device allocator's counters, as :class:`Census` reads them: ``reset_peak()`` at entry, ``read()`` at entry and
    exit. :class:`CudaAllocator` is CUDA's; a test passes its own."""

    def reset_peak(self) -> None: ...

    def read(self) -> AllocatorReading: ...


class CudaAllocator:
    """The CUDA caching allocator's counters on ``device`` (``torch.cuda.memory_allocated``, ``memory_reserved``,
    ``max_memory_allocated``, ``max_memory_reserved``; ``reset_peak_memory_stats``). Its counters change on the host at
    each allocation and free call, not when kernels run, so a reading needs no synchronisation; resetting the peak
    resets it for the whole process (``torch.cuda.max_memory_allocated`` reads from there on)."""

    def __init__(self, device: DeviceLike | None = None):
        self.device = torch.device("cuda") if device is None else torch.device(device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def read(self) -> AllocatorReading:
        d = self.device
        return AllocatorReading(int(torch.cuda.memory_allocated(d)), int(torch.cuda.memory_reserved(d)),
                                int(torch.cuda.max_memory_allocated(d)), int(torch.cuda.max_memory_reserved(d)))


@dataclasses.dataclass
class _Baseline:
    """A known storage from before the block: its address range and when it died (if it did)."""

    category: str
    ptr: int
    nbytes: int
    freed_ns: int | None = None

    def live_at(self, t_ns: int) -> bool:
        return self.freed_ns is None or t_ns < self.freed_ns

    def mark_freed(self) -> None:
        self.freed_ns = time.time_ns()


def _sums(pairs: Iterable[tuple[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for name, n in pairs:
        out[name] = out.get(name, 0) + n
    return out


class Census:
    """Live storage of a block on one device. ``known``: category -> tensors, an iterable read at entry (its storages
    are the ``baseline``) or a zero-argument callable read at exit; an in-block allocation holding a known storage
    belongs to the first category naming it, the rest to ``"other"`` (``categories=True``: the profiler's kinds).
    ``scopes``: ``record_function`` name prefixes naming an allocation's ``scope``. ``device``: the device counted
    (default: :func:`device_of` the entry-time known tensors, so a state on a GPU is counted there; a census whose known
    tensors are all callables says its device). ``reader``: that device's allocator counters (default
    :class:`CudaAllocator` on CUDA, none on the CPU). After the block: ``peak_bytes`` (first at ``peak_ns``),
    ``end_bytes`` (live at exit), ``allocations``, ``missed_frees`` (address reused) and breakdowns; with a reader,
    ``allocator_at_entry`` / ``allocator_at_exit`` and :attr:`allocator_peak_bytes` / :attr:`allocator_end_bytes`."""

    def __init__(self, known: Mapping[str, KnownTensors] = {}, *, categories: bool = False,
                 scopes: tuple[str, ...] = SCOPE_PREFIXES, device: DeviceLike | None = None,
                 reader: AllocatorReader | None = None):
        self.categories, self.scopes = categories, scopes
        entry = {k: list(v) for k, v in known.items() if not callable(v)}  # read once: a generator is spent after
        self.device = torch.device(device) if device is not None else device_of(t for v in entry.values() for t in v)
        self.reader = reader if reader is not None else CudaAllocator(self.device) if self.device.type == "cuda" \
            else None
        self.allocator_at_entry: AllocatorReading | None = None
        self.allocator_at_exit: AllocatorReading | None = None
        self._at_entry = {k: storages_of(v, self.device) for k, v in entry.items()}
        self._at_exit = {k: v for k, v in known.items() if callable(v)}
        self._baseline: list[_Baseline] = []
        self._attributed: dict[int, str] = {}  # index in allocations -> category
        self._prof = None
        self.allocations: list[Allocation] = []
        self.missed_frees = self.peak_bytes = self.peak_ns = self.end_bytes = self.start_ns = self.end_ns = 0
        self.category_note = ""

    def __enter__(self) -> Census:
        seen: set[int] = set()  # entry-time known storages -> address ranges, watched by a finalizer
        for name, storages in self._at_entry.items():
            for s in storages:
                if s.data_ptr() not in seen:
                    seen.add(s.data_ptr())
                    b = _Baseline(name, s.data_ptr(), s.nbytes())
                    weakref.finalize(s, b.mark_freed)
                    self._baseline.append(b)
        self._at_entry = {}
        from torch.profiler import ProfilerActivity, profile
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=self.categories)
        self._prof.__enter__()
        if self.reader is not None:  # after the profiler started: its own start-up is not the block's
            self.reader.reset_peak()
            self.allocator_at_entry = self.reader.read()
        self.start_ns = time.time_ns()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.end_ns = time.time_ns()
        if self.reader is not None:  # before the profiler stops (and frees its own)
            self.allocator_at_exit = self.reader.read()
        self._prof.__exit__(*exc)
        if exc[0] is not None:
            return
        results = self._prof.profiler.kineto_results
        events = _allocation_events(results, self.scopes, self.device)
        kinds = _profiler_kinds(results) if self.categories else {}
        if self.categories and not kinds:
            self.category_note = "torch's memory profiler gave no categories"
        self._prof = None
        self.allocations, self.missed_frees = _replay(events, kinds)
        self.peak_bytes, self.peak_ns = _peak(self.allocations, self.start_ns)
        self.end_bytes = sum(a.nbytes for a in self.allocations if a.end_ns is None)
        self.attribute({name: fn() for name, fn in self._at_exit.items()})
        self._at_exit = {}

    @property
    def allocator_peak_bytes(self) -> int | None:
        """The allocator's most bytes allocated at once in the block above what was allocated at entry (``None``
        without a reader): every thread and stream, where :attr:`peak_bytes` is the profiler's replay."""
        if self.allocator_at_entry is None or self.allocator_at_exit is None:
            return None
        return self.allocator_at_exit.peak_allocated - self.allocator_at_entry.allocated

    @property
    def allocator_end_bytes(self) -> int | None:
        """The allocator's bytes allocated at exit minus at entry (``None`` without a reader)."""
        if self.allocator_at_entry is None or self.allocator_at_exit is None:
            return None
        return self.allocator_at_exit.allocated - self.allocator_at_entry.allocated

    def attribute(self, known: Mapping[str, Iterable[torch.Tensor]]) -> None:
        """Name allocations live at exit holding a ``known`` tensor's storage (first claim wins); a known
        storage the block did not allocate joins the category's baseline."""
        live = sorted((a.ptr, i) for i, a in enumerate(self.allocations) if a.end_ns is None)
        starts = [p for p, _ in live]
        have = {b.ptr for b in self._baseline}
        for name, tensors in known.items():
            for s in storages_of(tensors, self.device):
                ptr, n = s.data_ptr(), s.nbytes()
                j = bisect.bisect_right(starts, ptr) - 1
                if j >= 0:
                    a_ptr, i = live[j]
                    if ptr + n <= a_ptr + self.allocations[i].nbytes:
                        self._attributed.setdefault(i, name)
                        continue
                if ptr not in have:
                    have.add(ptr)
                    self._baseline.append(_Baseline(name, ptr, n))

    def _named(self, live: Callable[[Allocation], bool]) -> dict[str, int]:
        return _sums((self._attributed.get(i, a.kind), a.nbytes) for i, a in enumerate(self.allocations) if live(a))

    @property
    def baseline(self) -> dict[str, int]:
        """Bytes of known storages that existed before the block, by category."""
        return _sums((b.category, b.nbytes) for b in self._baseline)

    @property
    def baseline_at_peak(self) -> int:
        return sum(b.nbytes for b in self._baseline if b.live_at(self.peak_ns))

    @property
    def in_block_by_category(self) -> dict[str, int]:
        """In-block bytes live at the peak, by known category, else by ``Allocation.kind``."""
        return self._named(lambda a: a.live_at(self.peak_ns))

    @property
    def end_by_category(self) -> dict[str, int]:
        """In-block bytes still live at exit (``end_bytes``), by category."""
        return self._named(lambda a: a.end_ns is None)

    @property
    def baseline_by_category(self) -> dict[str, int]:
        """Baseline bytes still live at the peak, by category."""
        return _sums((b.category, b.nbytes) for b in self._baseline if b.live_at(self.peak_ns))

    @property
    def by_category(self) -> dict[str, int]:
        """Everything the census sees live at the peak, by category (baseline + in block)."""
        return _sums([*self.baseline_by_category.items(), *self.in_block_by_category.items()])

    def by_op(self, category: str | None = OTHER) -> dict[str, int]:
        """In-block bytes live at the peak of ``category`` (``None``: all) by allocating operator, largest first."""
        out = _sums((a.op or "?", a.nbytes) for i, a in enumerate(self.allocations)
                    if a.live_at(self.peak_ns) and category in (None, self._attributed.get(i, a.kind)))
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    @property
    def by_scope(self) -> dict[str, int]:
        """In-block bytes live at the peak by scope (``""``: allocated outside every scope)."""
        return _sums((a.scope, a.nbytes) for a in self.allocations if a.live_at(self.peak_ns))

    def _peak_of(self, keep: Callable[[Allocation], bool]) -> tuple[int, int]:
        return _peak([a for a in self.allocations if keep(a)], self.start_ns)

    @property
    def scope_peaks(self) -> dict[str, int]:
        """Each scope's own peak: the most bytes its allocations held at once (at any time)."""
        scopes = dict.fromkeys(a.scope for a in self.allocations if a.scope)
        return {s: self._peak_of(lambda a, s=s: a.scope == s)[0] for s in scopes}

    def scope_peak_ns(self, scope: str) -> int:
        """When ``scope``'s allocations first held their peak (:attr:`scope_peaks`)."""
        return self._peak_of(lambda a: a.scope == scope)[1]

    def unseen_bytes(self, scope: str | None = None, at_ns: int | None = None) -> int:
        """Bytes whose free was not seen (another thread's, e.g. a backend's; live until the address is reused)
        of ``scope``'s allocations (``None``: all), live at ``at_ns`` (``None``: whenever in the block)."""
        return sum(a.nbytes for a in self.allocations if not a.free_seen
                   and (scope is None or a.scope == scope) and (at_ns is None or a.live_at(at_ns)))

    def joint_peak(self, scopes: Iterable[str], seen_only: bool = False) -> int:
        """The most bytes ``scopes``' allocations held at once, together; ``seen_only``: a lower bound, without
        those whose free was not seen (:meth:`unseen_bytes`)."""
        wanted = set(scopes)
        return self._peak_of(lambda a: a.scope in wanted and (a.free_seen or not seen_only))[0]

    @property
    def total_at_peak(self) -> int:
        return self.peak_bytes + self.baseline_at_peak

    def table(self, unit: float = 2.0**20, unit_name: str = "MiB", ops: int = 4) -> str:
        """A plain-text breakdown at the peak: per category the bytes from before and in the block, the
        ``ops`` operators that allocated most unnamed bytes, per-scope peaks, then totals."""
        before, inside = self.baseline_by_category, self.in_block_by_category
        names = list(dict.fromkeys([*before, *inside]))
        names.sort(key=lambda k: (k == OTHER, -(before.get(k, 0) + inside.get(k, 0))))
        top = [(_short(op), n) for op, n in self.by_op().items()][:ops] if OTHER in inside else []
        w = max([len(n) for n in names] + [len(f"  {op}") for op, _ in top] + [32])
        lines = [f"{'at the peak (' + unit_name + ')':<{w}} {'before':>10} {'in block':>10} {'total':>10}"]
        for n in names:
            b, i = before.get(n, 0), inside.get(n, 0)
            lines.append(f"{n:<{w}} {b / unit:10.2f} {i / unit:10.2f} {(b + i) / unit:10.2f}")
        lines += [f"{'  ' + op:<{w}} {'':>10} {n / unit:10.2f}" for op, n in top]
        scoped, peaks = self.by_scope, self.scope_peaks
        if peaks:
            lines.append(f"{'in block by scope':<{w}} {'own peak':>10} {'at peak':>10}")
            lines += [f"{'  ' + k:<{w}} {peaks[k] / unit:10.2f} {scoped.get(k, 0) / unit:10.2f}" for k in sorted(peaks)]
        lines.append(f"{'live at the peak':<{w}} {self.baseline_at_peak / unit:10.2f} "
                     f"{self.peak_bytes / unit:10.2f} {self.total_at_peak / unit:10.2f}")
        lines.append(f"{'allocated in block, live at exit':<{w}} {'':>10} {self.end_bytes / unit:10.2f}")
        a, b = self.allocator_at_entry, self.allocator_at_exit
        if a is not None and b is not None:  # the allocator's own counters: entry, the block's, exit
            lines.append(f"{self.device.type + ' allocator (' + unit_name + ')':<{w}} {'entry':>10} {'in block':>10} "
                         f"{'exit':>10}")
            lines.append(f"{'  allocated':<{w}} {a.allocated / unit:10.2f} {(b.allocated - a.allocated) / unit:10.2f} "
                         f"{b.allocated / unit:10.2f}")
            lines.append(f"{'  peak allocated':<{w}} {'':>10} {(b.peak_allocated - a.allocated) / unit:10.2f} "
                         f"{b.peak_allocated / unit:10.2f}")
            lines.append(f"{'  reserved':<{w}} {a.reserved / unit:10.2f} {(b.reserved - a.reserved) / unit:10.2f} "
                         f"{b.reserved / unit:10.2f}")
        missed = f"{self.missed_frees} frees not seen (address reused)" if self.missed_frees else ""
        notes = [f"{len(self.allocations)} allocations in the block", missed, self.category_note]
        return "\n".join([*lines, "(" + "; ".join(n for n in notes if n) + ")"])


def _short(op: str, width: int = 40) -> str:
    """An operator name for the table: inductor's graph calls by their hash's start."""
    if op.startswith("## Call CompiledFxGraph"):
        return "compiled graph " + op.split()[3][:8]
    return op if len(op) <= width else op[:width - 3] + "..."


def _allocation_events(results: Any, scopes: tuple[str, ...] = (),
                       device: torch.device = CPU) -> list[tuple[int, int, int, str, str]]:
    """``(time ns, ptr, signed bytes, operator, scope)`` of every allocator event on ``device`` in the profiler's
    ``results``, in time order (:func:`_events_of`)."""
    return _events_of(results.experimental_event_tree(), scopes, device)


def _events_of(roots: Iterable[Any], scopes: tuple[str, ...] = (),
               device: torch.device = CPU) -> list[tuple[int, int, int, str, str]]:
    """``(time ns, ptr, signed bytes, operator, scope)`` of every allocator event on ``device`` (:func:`_on`) under
    the profiler event tree ``roots``, in time order; the scope is the innermost enclosing ``record_function`` whose
    name starts with one of ``scopes``."""
    from torch._C._profiler import _EventType
    out: list[tuple[int, int, int, str, str]] = []
    stack = [(node, "", "") for node in reversed(list(roots))]
    while stack:  # depth first, in recorded order
        node, op, scope = stack.pop()
        if node.tag == _EventType.Allocation:
            f = node.extra_fields
            if _on(f.device, device) and f.alloc_size != 0:
                out.append((node.start_time_ns, f.ptr, f.alloc_size, op, scope))
        if node.name.startswith(scopes):
            scope = node.name
        stack.extend((child, node.name, scope) for child in reversed(node.children))
    out.sort(key=lambda e: e[0])  # stable
    return out


def _profiler_kinds(results) -> dict[tuple[int, int], str]:
    """``(ptr, time ns) -> category`` of each allocation by torch's private memory profiler ({} if it fails)."""
    try:
        from torch._C._profiler import _EventType
        from torch.profiler import _memory_profiler as mp
        profile = mp.MemoryProfile(results)
        out: dict[tuple[int, int], str] = {}
        for node in profile._op_tree.dfs():
            if node.tag != _EventType.Allocation or node.extra_fields.alloc_size <= 0:
                continue
            key = mp.TensorKey.from_allocation(node.extra_fields)
            cat = profile._categories.get(key, 0) if key is not None else None
            if cat is not None:
                out[(node.extra_fields.ptr, node.start_time_ns)] = cat.name.lower()
        return out
    except Exception:  # noqa: BLE001 - a private API: the census works without it
        return {}


def _replay(events: list[tuple[int, int, int, str, str]],
            kinds: Mapping[tuple[int, int], str]) -> tuple[list[Allocation], int]:
    """Pair allocations with frees by address: ``(allocations, missed frees)``; frees of unknown addresses ignored."""
    open_: dict[int, tuple[int, int, str, str]] = {}  # ptr -> (start, nbytes, op, scope)
    out: list[Allocation] = []
    missed = 0

    def close(ptr: int, t: int | None, seen: bool = True) -> None:
        start, n, op, scope = open_.pop(ptr)
        out.append(Allocation(ptr, n, start, t, kinds.get((ptr, start), OTHER), op, scope, seen))

    for t, ptr, size, op, scope in events:
        if size > 0:
            if ptr in open_:  # a free missed: the old allocation ends here
                missed += 1
                close(ptr, t, seen=False)
            open_[ptr] = (t, size, op, scope)
        elif ptr in open_:
            close(ptr, t)
    for ptr in list(open_):
        close(ptr, None, seen=False)
    out.sort(key=lambda a: a.start_ns)
    return out, missed


def _peak(allocations: list[Allocation], start_ns: int) -> tuple[int, int]:
    """``(peak live bytes, first time reached)``, frees first at a tie; ``(0, start_ns)`` for an empty block."""
    deltas = [(a.start_ns, 1, a.nbytes) for a in allocations]
    deltas += [(a.end_ns, 0, -a.nbytes) for a in allocations if a.end_ns is not None]
    live, best, when = 0, 0, start_ns
    for t, _, d in sorted(deltas):
        live += d
        if live > best:
            best, when = live, t
    return best, when


def malloc_in_use() -> int | None:
    """Bytes glibc's malloc has handed out and not taken back, all arenas plus mmapped chunks
    (``mallinfo2``: ``uordblks + hblkhd``), whatever RSS it keeps. ``None`` without glibc 2.33+."""
    import ctypes
    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]

    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = MallInfo2
    info = fn()
    return int(info.uordblks + info.hblkhd)
