"""A communicator that injects faults, to test a training step when a rank misbehaves: :class:`FaultyWorld` applies
:class:`GradFault`, :class:`CorruptResult` and :class:`Delay` at given steps on given ranks, inside step scopes only
(:meth:`FaultyWorld.wrap`, ``with world.stepping():``; scope ``s`` is step ``s``); other collectives pass through.
Eager only (under ``torch.compile`` an injection would happen once, while tracing).

Imports: comm.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..comm import Communicator, ReduceOp

__all__ = ["GradFault", "CorruptResult", "Delay", "FaultRecord", "FaultyWorld", "Fault"]

_OPS = ("all_reduce", "reduce_scatter", "all_gather")


@dataclasses.dataclass(frozen=True)
class GradFault:
    """``value`` (``inf``, ``-inf`` or ``nan``) in rank ``rank``'s gradient at step ``step``: element ``index``
    of its input to the step's first gradient reduction (``reduce_scatter``, or ``all_reduce`` sum/avg)."""

    step: int
    rank: int
    value: float = math.inf
    index: int = 0


@dataclasses.dataclass(frozen=True)
class CorruptResult:
    """Rank ``rank``'s ``call``-th ``op`` result at step ``step``: element ``index`` set to ``value`` (``None``: low bit
    flipped)."""

    step: int
    rank: int
    op: str = "all_gather"
    index: int = 0
    value: float | None = None
    call: int = 0


@dataclasses.dataclass(frozen=True)
class Delay:
    """``rank`` sleeps ``seconds`` at step ``step`` before its ``call``-th ``op`` (``None``: first collective)."""

    step: int
    rank: int
    seconds: float
    op: str | None = None
    call: int = 0


Fault = GradFault | CorruptResult | Delay


@dataclasses.dataclass(frozen=True)
class FaultRecord:
    """One injection made on this process: the fault, the collective (``op``, its ``call`` index
    in the step), the flat ``index`` changed in the rank's row, the value ``before`` and ``after``."""

    fault: Fault
    step: int
    rank: int
    op: str
    call: int
    index: int | None = None
    before: float | None = None
    after: float | None = None

    @property
    def kind(self) -> str:
        return {GradFault: "grad", CorruptResult: "corrupt", Delay: "delay"}[type(self.fault)]


_INT_OF_SIZE = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _flip_lowest_bit(x: torch.Tensor) -> torch.Tensor:
    """``x`` (one element) with the lowest bit of its representation flipped."""
    if x.dtype == torch.bool:
        return ~x
    bits = x.reshape(1).view(_INT_OF_SIZE[x.element_size()])
    return (bits ^ 1).view(x.dtype).reshape(x.shape)


class FaultyWorld(Communicator):
    """Wraps ``inner`` and injects ``faults`` deterministically (``TypeError``/``ValueError`` if malformed).
    ``step``: the current or next step scope's index; ``records``: the injections made on this process
    (only where ``comm.ranks`` holds the fault's ``rank``; on the simulated world, that row)."""

    def __init__(self, inner: Communicator, faults: Sequence[Fault] = ()):
        self.wrapping(inner, capabilities=False)
        for f in faults:
            if not isinstance(f, (GradFault, CorruptResult, Delay)):
                raise TypeError(f"FaultyWorld: not a fault: {f!r}")
            if not (isinstance(f.step, int) and f.step >= 0):
                raise ValueError(f"FaultyWorld: {f!r}: step must be a non-negative int")
            if not (isinstance(f.rank, int) and 0 <= f.rank < self.world_size):
                raise ValueError(f"FaultyWorld: {f!r}: rank must be in [0, {self.world_size})")
            if getattr(f, "op", None) not in (None, *_OPS):
                raise ValueError(f"FaultyWorld: {f!r}: op must be one of {_OPS}")
            if isinstance(f, GradFault) and not (math.isinf(f.value) or math.isnan(f.value)):
                raise ValueError(f"FaultyWorld: {f!r}: value must be inf, -inf or nan")
            if isinstance(f, Delay) and not f.seconds >= 0:
                raise ValueError(f"FaultyWorld: {f!r}: seconds must be >= 0")
        self.faults = tuple(faults)
        self.step = 0
        self.records: list[FaultRecord] = []
        self._active, self._calls, self._grad_reduced = False, Counter(), False

    def __repr__(self) -> str:
        return f"FaultyWorld({self.inner!r}, {len(self.faults)} faults)"

    def __getattr__(self, name: str) -> Any:  # backend attributes (rank, group, ...) come from inner
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    @contextlib.contextmanager
    def stepping(self) -> Iterator[int]:
        """A step scope (not nestable): faults of step ``self.step`` apply inside; it advances on exit."""
        if self._active:
            raise RuntimeError("FaultyWorld.stepping: step scopes do not nest")
        self._active, self._calls, self._grad_reduced = True, Counter(), False
        try:
            yield self.step
        finally:
            self._active = False
            self.step += 1

    def wrap(self, step_fn: Callable[..., Any]) -> Callable[..., Any]:
        """``step_fn`` with each call run in its own step scope."""
        def faulty_step(*args: Any, **kwargs: Any) -> Any:
            with self.stepping():
                return step_fn(*args, **kwargs)
        return faulty_step

    def faults_at(self, step: int) -> tuple[Fault, ...]:
        return tuple(f for f in self.faults if f.step == step)

    def _rows(self, rank: int) -> list[int]:
        return [i for i, r in enumerate(self.ranks) if r == rank]

    def _inject(self, x: torch.Tensor, faults: list[Fault], op: str, call: int) -> torch.Tensor:
        """``x``, or a copy with element ``index`` of each fault's rank's rows set to its ``value`` (None: bit flip)."""
        for f, row in [(fault, row) for fault in faults for row in self._rows(fault.rank)]:
            n, index = x[row].numel(), f.index
            if not -n <= index < n:
                raise IndexError(f"FaultyWorld: {f!r}: index {index} is out of range for the {op} row of {n} elements")
            index %= n
            x = x.clone()
            flat = x[row].reshape(-1)  # a view: x is contiguous after clone
            before = flat[index].clone()
            flat[index] = _flip_lowest_bit(before) if f.value is None else f.value
            after = flat[index].item()
            self.records.append(FaultRecord(f, self.step, self.ranks[row], op, call, index, before.item(), after))
        return x

    def _collective(self, op: str, x: torch.Tensor, run: Callable[[torch.Tensor], torch.Tensor],
                    reduce_op: str | None = None) -> torch.Tensor:
        if not self._active:
            return run(x)
        call = self._calls[op]
        first = sum(self._calls.values()) == 0
        self._calls[op] += 1
        here = self.faults_at(self.step)
        for f in here:
            if isinstance(f, Delay) and ((f.op is None and first) or (f.op == op and f.call == call)):
                if self._rows(f.rank):
                    time.sleep(f.seconds)
                    self.records.append(FaultRecord(f, self.step, f.rank, op, call))
        if (op == "reduce_scatter" or (op == "all_reduce" and reduce_op in ("sum", "avg"))) and not self._grad_reduced:
            self._grad_reduced = True
            x = self._inject(x, [f for f in here if isinstance(f, GradFault)], op, call)
        corrupt = [f for f in here if isinstance(f, CorruptResult) and f.op == op and f.call == call]
        return self._inject(run(x), corrupt, op, call)

    def all_reduce(self, x: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        return self._collective("all_reduce", x, lambda y: self.inner.all_reduce(y, op), op)

    def reduce_scatter(self, x: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        return self._collective("reduce_scatter", x, lambda y: self.inner.reduce_scatter(y, op), op)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return self._collective("all_gather", x, self.inner.all_gather)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        return self.inner.broadcast(x, src)  # module buffers: untouched and uncounted

    def check_layout(self, layout: Any) -> None:
        self.inner.check_layout(layout)
