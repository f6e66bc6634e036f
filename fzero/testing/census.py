"""A census of live CPU tensor storage: where every allocator byte is at a block's peak.

:class:`Census` is a context manager. Inside it, PyTorch's profiler
(``torch.profiler.profile(profile_memory=True)``) records every allocation and
free that the c10 CPU allocator makes on the profiled thread, with its address
and size; on exit the census replays them in time order and reports the live
bytes over time, the peak, and which allocations were live at the peak, named
by what they hold when the caller says (``known``).

What is counted, exactly:

* bytes the c10 CPU allocator hands out for tensor storages (``at::empty`` and
  friends: every CPU tensor's data, autograd's saved tensors and gradients,
  kernels' temporaries that go through the allocator), counted at their
  requested size, not at what ``malloc`` rounds them to;
* only allocations made *inside* the block (``peak_bytes``, ``end_bytes``),
  plus, reported separately (``baseline``), the storages of ``known`` tensors
  that existed *before* the block: their frees are learned from a
  ``weakref.finalize`` on each storage (the profiler reports no free for a
  buffer it did not see allocated) and ordered against the profiler's events
  by wall-clock time (both are Unix-epoch nanoseconds; measured agreement
  within a microsecond).

Not counted: Python objects, memory that does not go through the c10 CPU
allocator (gloo's internal buffers, oneDNN/MKL scratch space, the allocator's
and ``malloc``'s own overhead and fragmentation, shared libraries, code), and
allocations made on threads the profiler does not follow (autograd's CPU
backward runs on the calling thread, so it is followed). A buffer allocated in
the block and freed on a thread the profiler does not follow stays live in the
replay until its address is handed out again (``missed_frees`` counts those
reuses). Allocated is not resident either: pages never written cost no RSS. So
the census and an RSS measurement differ by everything listed here.

Cost (measured on a 2-core CPU): the first profiler session of a process starts
Kineto (about 2 s); then one eager fzero step of a small GPT (d_model 128, 2
layers, SimulatedWorld(2), about 300 allocations) took 0.05-0.08 s in all under
the census, replay included. ``categories=True`` (the profiler's own split of
the unnamed bytes into activations, gradients, temporaries, ...) records shapes
and runs torch's (private) memory profiler on exit: 0.4-0.7 s for that step. On
fzero's steps it names little (most bytes stay ``other``); the table's split by
allocating operator says more.

Imports: torch only.
"""

from __future__ import annotations

import bisect
import dataclasses
import time
import weakref
from typing import Callable, Iterable, Mapping, Optional, Union

import torch

__all__ = ["Allocation", "Census", "malloc_in_use", "storages_of"]

KnownTensors = Union[Iterable[torch.Tensor], Callable[[], Iterable[torch.Tensor]]]
OTHER = "other"
# record_function scopes the census names allocations by (fzero's step buffers: fzero.memory.SCOPES)
SCOPE_PREFIXES = ("fzero::",)


@dataclasses.dataclass(frozen=True)
class Allocation:
    """One CPU allocation made inside the block: ``nbytes`` at ``ptr`` from ``start_ns``
    to ``end_ns`` (``None``: still live at exit). ``kind``: the profiler's category of the
    buffer when ``categories=True`` (``"activation"``, ``"gradient"``, ``"temporary"``, ...),
    else ``"other"``."""

    ptr: int
    nbytes: int
    start_ns: int
    end_ns: Optional[int]
    kind: str = OTHER
    op: str = ""  # the innermost operator (or record_function scope) that allocated it
    scope: str = ""  # the innermost enclosing ``record_function`` named with a census prefix
    # False: no free was seen (made on a thread the profiler does not follow, e.g. gloo's):
    # ``end_ns`` is then when its address was handed out again, or None
    free_seen: bool = True

    def live_at(self, t_ns: int) -> bool:
        return self.start_ns <= t_ns and (self.end_ns is None or t_ns < self.end_ns)


def storages_of(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The distinct CPU storages behind ``tensors`` (views share one; DTensors give their
    local shard; non-CPU, meta and empty storages are skipped)."""
    seen: set[int] = set()
    out = []
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        if hasattr(t, "to_local"):  # DTensor (FSDP2 parameters): the rank's own shard
            t = t.to_local()
        if t.device.type != "cpu":
            continue
        s = t.untyped_storage()
        if s.nbytes() == 0 or s.data_ptr() in seen:
            continue
        seen.add(s.data_ptr())
        out.append(s)
    return out


@dataclasses.dataclass
class _Baseline:
    """A known storage that existed before the block: its address range and, once the
    storage dies, the wall-clock time it died."""

    category: str
    ptr: int
    nbytes: int
    freed_ns: Optional[int] = None

    def live_at(self, t_ns: int) -> bool:
        return self.freed_ns is None or t_ns < self.freed_ns


class Census:
    """Live CPU storage bytes of a block: peak, end, and what was live at the peak.

    ``known``: named categories of tensors. An iterable is read when the block starts
    (tensors that exist before it, e.g. a training state; its storages' bytes are the
    category's ``baseline``); a zero-argument callable is called when the block ends
    (tensors that exist after it, e.g. the state a step returned). At the peak, each
    live allocation made in the block whose address range contains a known tensor's
    storage is attributed to that category (the first that names it); the rest is
    ``"other"``, or the profiler's categories with ``categories=True``. More categories
    can be named after the block with :meth:`attribute`. The census keeps no reference to
    known tensors (it would change what is freed).

    After the block:

    * ``peak_bytes``: max over time of live bytes allocated inside the block (and not
      freed before that time); ``peak_ns`` when it was first reached;
    * ``end_bytes``: bytes allocated inside the block and still alive at exit;
    * ``baseline``: bytes of known storages that existed at entry, by category;
    * ``by_category``: at the peak, everything the census sees live: for each known
      category its baseline storages still alive plus its in-block allocations, and the
      other in-block bytes; ``sum(by_category.values()) == total_at_peak ==
      peak_bytes + baseline_at_peak``. ``in_block_by_category`` is the in-block part;
    * ``allocations``: every in-block :class:`Allocation`; ``missed_frees``: allocations
      whose free the profiler did not see (their address was handed out again).
    """

    def __init__(self, known: Mapping[str, KnownTensors] = {}, *, categories: bool = False,
                 scopes: tuple[str, ...] = SCOPE_PREFIXES):
        self.categories = categories
        self.scopes = scopes
        self._at_entry: dict[str, list[torch.UntypedStorage]] = {}
        self._at_exit: dict[str, Callable[[], Iterable[torch.Tensor]]] = {}
        for name, tensors in known.items():
            if callable(tensors):
                self._at_exit[name] = tensors
            else:
                self._at_entry[name] = storages_of(tensors)
        self._baseline: list[_Baseline] = []
        self._attributed: dict[int, str] = {}  # index in allocations -> category
        self._prof = None
        self.allocations: list[Allocation] = []
        self.missed_frees = 0
        self.peak_bytes = 0
        self.peak_ns = 0
        self.end_bytes = 0
        self.start_ns = 0
        self.end_ns = 0
        self.category_note = ""

    # ------------------------------------------------------------------ the block
    def __enter__(self) -> "Census":
        self._watch_baseline()
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                             record_shapes=self.categories)
        self._prof.__enter__()
        self.start_ns = time.time_ns()
        return self

    def __exit__(self, *exc) -> None:
        self.end_ns = time.time_ns()
        self._prof.__exit__(*exc)
        if exc[0] is not None:
            return
        events = _allocation_events(self._prof.profiler.kineto_results, self.scopes)
        kinds = _profiler_kinds(self._prof.profiler.kineto_results) if self.categories else {}
        if self.categories and not kinds:
            self.category_note = "torch's memory profiler gave no categories"
        self._prof = None
        self.allocations, self.missed_frees = _replay(events, kinds)
        self.peak_bytes, self.peak_ns = _peak(self.allocations, self.start_ns)
        self.end_bytes = sum(a.nbytes for a in self.allocations if a.end_ns is None)
        self.attribute({name: fn() for name, fn in self._at_exit.items()})
        self._at_exit = {}

    def _watch_baseline(self) -> None:
        """Turn the entry-time known storages into address ranges with a finalizer each
        (the census must not keep them alive), first category first."""
        seen: set[int] = set()
        for name, storages in self._at_entry.items():
            for s in storages:
                ptr = s.data_ptr()
                if ptr in seen:
                    continue
                seen.add(ptr)
                b = _Baseline(name, ptr, s.nbytes())
                weakref.finalize(s, _mark_freed, b)
                self._baseline.append(b)
        self._at_entry = {}

    # ------------------------------------------------------------------ naming bytes
    def attribute(self, known: Mapping[str, Iterable[torch.Tensor]]) -> None:
        """Name in-block allocations after the block: each allocation still live at exit
        that contains the storage of one of ``known``'s tensors (alive now) belongs to that
        category, unless an earlier category claimed it. A live known storage the block
        did not allocate existed before it and stayed live throughout: it is added to the
        category's baseline."""
        live = sorted((a.ptr, i) for i, a in enumerate(self.allocations) if a.end_ns is None)
        starts = [p for p, _ in live]
        have = {b.ptr for b in self._baseline}
        for name, tensors in known.items():
            for s in storages_of(tensors):
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

    # ------------------------------------------------------------------ results
    @property
    def baseline(self) -> dict[str, int]:
        """Bytes of known storages that existed before the block, by category."""
        out: dict[str, int] = {}
        for b in self._baseline:
            out[b.category] = out.get(b.category, 0) + b.nbytes
        return out

    @property
    def baseline_at_peak(self) -> int:
        return sum(b.nbytes for b in self._baseline if b.live_at(self.peak_ns))

    @property
    def in_block_by_category(self) -> dict[str, int]:
        """In-block bytes live at the peak, by known category, else by ``Allocation.kind``."""
        out: dict[str, int] = {}
        for i, a in enumerate(self.allocations):
            if a.live_at(self.peak_ns):
                name = self._attributed.get(i, a.kind)
                out[name] = out.get(name, 0) + a.nbytes
        return out

    @property
    def end_by_category(self) -> dict[str, int]:
        """In-block bytes still live at exit (``end_bytes``), by category."""
        out: dict[str, int] = {}
        for i, a in enumerate(self.allocations):
            if a.end_ns is None:
                name = self._attributed.get(i, a.kind)
                out[name] = out.get(name, 0) + a.nbytes
        return out

    @property
    def baseline_by_category(self) -> dict[str, int]:
        """Baseline bytes still live at the peak, by category."""
        out: dict[str, int] = {}
        for b in self._baseline:
            if b.live_at(self.peak_ns):
                out[b.category] = out.get(b.category, 0) + b.nbytes
        return out

    @property
    def by_category(self) -> dict[str, int]:
        """Everything the census sees live at the peak, by category (baseline + in block)."""
        out = dict(self.baseline_by_category)
        for name, n in self.in_block_by_category.items():
            out[name] = out.get(name, 0) + n
        return out

    def by_op(self, category: Optional[str] = OTHER) -> dict[str, int]:
        """In-block bytes live at the peak by the operator that allocated them, largest
        first: those of ``category`` (default: the unnamed ones; ``None``: all)."""
        out: dict[str, int] = {}
        for i, a in enumerate(self.allocations):
            if a.live_at(self.peak_ns) and category in (None, self._attributed.get(i, a.kind)):
                out[a.op or "?"] = out.get(a.op or "?", 0) + a.nbytes
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    @property
    def by_scope(self) -> dict[str, int]:
        """In-block bytes live at the peak by scope (``""``: allocated outside every scope)."""
        out: dict[str, int] = {}
        for a in self.allocations:
            if a.live_at(self.peak_ns):
                out[a.scope] = out.get(a.scope, 0) + a.nbytes
        return out

    @property
    def scope_peaks(self) -> dict[str, int]:
        """Each scope's own peak: the most bytes its allocations held at once during the
        block (at whatever time; not necessarily the block's peak)."""
        by: dict[str, list[Allocation]] = {}
        for a in self.allocations:
            if a.scope:
                by.setdefault(a.scope, []).append(a)
        return {name: _peak(allocs, self.start_ns)[0] for name, allocs in by.items()}

    def scope_peak_ns(self, scope: str) -> int:
        """When ``scope``'s allocations first held their peak (:attr:`scope_peaks`)."""
        return _peak([a for a in self.allocations if a.scope == scope], self.start_ns)[1]

    def unseen_bytes(self, scope: Optional[str] = None, at_ns: Optional[int] = None) -> int:
        """Bytes whose free the census did not see (their last reference dropped on a thread
        the profiler does not follow, e.g. gloo's): it counts them live until their address
        is handed out again. Of ``scope``'s allocations (``None``: all), live at ``at_ns``
        (``None``: whenever in the block)."""
        return sum(a.nbytes for a in self.allocations if not a.free_seen
                   and (scope is None or a.scope == scope) and (at_ns is None or a.live_at(at_ns)))

    def joint_peak(self, scopes: Iterable[str], seen_only: bool = False) -> int:
        """The most bytes the allocations of ``scopes`` held at once, together. ``seen_only``:
        without the allocations whose free the census did not see (:meth:`unseen_bytes`): a
        lower bound where another thread freed them, the plain peak an upper one."""
        wanted = set(scopes)
        return _peak([a for a in self.allocations if a.scope in wanted and (a.free_seen or not seen_only)],
                     self.start_ns)[0]

    @property
    def total_at_peak(self) -> int:
        return self.peak_bytes + self.baseline_at_peak

    def timeline(self) -> list[tuple[int, int]]:
        """``(ns since the block started, in-block live bytes)`` after every event."""
        return [(t - self.start_ns, live) for t, live in _live_curve(self.allocations)]

    def table(self, unit: float = 2.0**20, unit_name: str = "MiB", ops: int = 4) -> str:
        """A plain-text breakdown at the peak: per category the bytes that existed before
        the block and those the block allocated, the ``ops`` operators that allocated most
        of the unnamed bytes, then totals."""
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
        scoped = {k: v for k, v in self.by_scope.items() if k}
        peaks = self.scope_peaks
        if peaks:
            lines.append(f"{'in block by scope':<{w}} {'own peak':>10} {'at peak':>10}")
            lines += [f"{'  ' + k:<{w}} {peaks[k] / unit:10.2f} {scoped.get(k, 0) / unit:10.2f}" for k in sorted(peaks)]
        lines.append(f"{'live at the peak':<{w}} {self.baseline_at_peak / unit:10.2f} "
                     f"{self.peak_bytes / unit:10.2f} {self.total_at_peak / unit:10.2f}")
        lines.append(f"{'allocated in block, live at exit':<{w}} {'':>10} {self.end_bytes / unit:10.2f}")
        notes = [f"{len(self.allocations)} allocations in the block"]
        if self.missed_frees:
            notes.append(f"{self.missed_frees} frees not seen (address reused)")
        if self.category_note:
            notes.append(self.category_note)
        lines.append("(" + "; ".join(notes) + ")")
        return "\n".join(lines)


def _short(op: str, width: int = 40) -> str:
    """An operator name for the table: inductor's graph calls by their hash's start."""
    if op.startswith("## Call CompiledFxGraph"):
        return "compiled graph " + op.split()[3][:8]
    return op if len(op) <= width else op[:width - 3] + "..."


# ---------------------------------------------------------------------- replay
def _mark_freed(b: _Baseline) -> None:
    b.freed_ns = time.time_ns()


def _allocation_events(results, scopes: tuple[str, ...] = ()) -> list[tuple[int, int, int, str, str]]:
    """``(time ns, ptr, signed bytes, enclosing operator, enclosing scope)`` of every CPU
    allocator event, in time order (ties in the order the profiler recorded them). The scope
    is the innermost enclosing ``record_function`` whose name starts with one of ``scopes``."""
    from torch._C._profiler import _EventType

    out: list[tuple[int, int, int, str, str]] = []
    stack = [(node, "", "") for node in reversed(results.experimental_event_tree())]
    while stack:  # depth first, in recorded order
        node, op, scope = stack.pop()
        if node.tag == _EventType.Allocation:
            f = node.extra_fields
            if f.device.type == "cpu" and f.alloc_size != 0:
                out.append((node.start_time_ns, f.ptr, f.alloc_size, op, scope))
        if node.name.startswith(scopes):
            scope = node.name
        stack.extend((child, node.name, scope) for child in reversed(node.children))
    # stable: events with one time stamp keep the order they were recorded in
    out.sort(key=lambda e: e[0])
    return out


def _profiler_kinds(results) -> dict[tuple[int, int], str]:
    """``(ptr, time ns) -> category`` of each allocation by torch's memory profiler
    (private API; empty if it fails)."""
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
    """Pair allocations with frees by address. A free of an address the block did not
    allocate belongs to an older buffer and is ignored; an allocation at an address still
    live means its free was not seen: the old one ends there (counted)."""
    open_: dict[int, tuple[int, int, str, str]] = {}  # ptr -> (start, nbytes, op, scope)
    out: list[Allocation] = []
    missed = 0

    def close(ptr: int, t: Optional[int], seen: bool = True) -> None:
        start, n, op, scope = open_.pop(ptr)
        out.append(Allocation(ptr, n, start, t, kinds.get((ptr, start), OTHER), op, scope, seen))

    for t, ptr, size, op, scope in events:
        if size > 0:
            if ptr in open_:
                missed += 1
                close(ptr, t, seen=False)
            open_[ptr] = (t, size, op, scope)
        elif ptr in open_:
            close(ptr, t)
    for ptr in list(open_):
        close(ptr, None, seen=False)
    out.sort(key=lambda a: a.start_ns)
    return out, missed


def _live_curve(allocations: list[Allocation]) -> list[tuple[int, int]]:
    """In-block live bytes after each allocation or free, in time order."""
    deltas = [(a.start_ns, 1, a.nbytes) for a in allocations]
    deltas += [(a.end_ns, 0, -a.nbytes) for a in allocations if a.end_ns is not None]
    deltas.sort()  # at one time stamp frees (0) before allocations (1)
    live, out = 0, []
    for t, _, d in deltas:
        live += d
        out.append((t, live))
    return out


def _peak(allocations: list[Allocation], start_ns: int) -> tuple[int, int]:
    """``(peak bytes, first time reached)``; ``(0, start_ns)`` for an empty block."""
    best, when = 0, start_ns
    for t, live in _live_curve(allocations):
        if live > best:
            best, when = live, t
    return best, when


def malloc_in_use() -> Optional[int]:
    """Bytes glibc's malloc has handed out and not taken back, all arenas plus mmapped
    chunks (``mallinfo2``: ``uordblks + hblkhd``): the heap that is live, whatever RSS the
    allocator keeps after frees. ``None`` without glibc 2.33+."""
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
