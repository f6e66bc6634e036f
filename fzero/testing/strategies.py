"""Hypothesis strategies for property tests of fzero: parameter trees with awkward leaves, batch splits, optimizers,
loss scalers, precision policies, fault schedules; small draws. Needs ``hypothesis`` (``fzero[testing]``).

Imports: optim, precision, scaler, testing.faults.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch

try:
    from hypothesis import strategies as st
except ImportError as e:  # pragma: no cover - exercised only without hypothesis
    raise ImportError("fzero.testing.strategies needs hypothesis: pip install 'fzero[testing]' "
                      "(or hypothesis>=6.100)") from e

from ..optim import Optimizer, adam, adamw, sgd
from ..precision import MixedPrecision
from ..scaler import ScalerState, init_scaler, static_scaler
from .faults import CorruptResult, Delay, Fault, GradFault

__all__ = ["FLOAT_DTYPES", "shapes", "float_dtypes", "world_sizes", "alignments", "ParamTree", "param_trees",
           "LayoutCase", "layout_cases", "BatchSplit", "batch_splits", "PathIn", "optimizers", "powers_of_two",
           "init_scales", "growth_factors", "backoff_factors", "growth_intervals", "overflow_patterns",
           "scalers", "precisions", "fault_schedules"]

FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
IntOrStrategy = int | st.SearchStrategy


def _ints(x: IntOrStrategy) -> st.SearchStrategy:
    return x if isinstance(x, st.SearchStrategy) else st.just(x)


def shapes(max_dims: int = 3, max_side: int = 7, *, allow_empty: bool = True) -> st.SearchStrategy:
    """Shapes of 0 to ``max_dims`` dims, sides up to ``max_side`` (0 if ``allow_empty``); shrink towards ``()``."""
    return st.lists(st.integers(0 if allow_empty else 1, max_side), min_size=0, max_size=max_dims).map(tuple)


def float_dtypes(choices: Sequence[torch.dtype] = FLOAT_DTYPES) -> st.SearchStrategy:
    return st.sampled_from(tuple(choices))


def world_sizes(min_size: int = 1, max_size: int = 8) -> st.SearchStrategy:
    """World sizes; shrink towards ``min_size``."""
    return st.integers(min_size, max_size)


def alignments() -> st.SearchStrategy:
    """Shard alignments (elements): 1 (no alignment), 2 and the default 16."""
    return st.sampled_from([1, 2, 16])


@dataclasses.dataclass(frozen=True)
class ParamTree:
    """A pytree ``{"a": [first half of the leaves], "b": (second half)}`` (paths ``a.0, ..., b.0, ...``) of
    leaves with ``shapes`` and ``dtypes``, values from ``seed``; ``frozen[i]``: leaf ``i`` is not trainable."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    seed: int = 0
    frozen: tuple[bool, ...] = ()

    @property
    def n(self) -> int:
        return len(self.shapes)

    @property
    def split(self) -> int:
        return (self.n + 1) // 2

    @property
    def paths(self) -> list[str]:
        return [f"a.{i}" for i in range(self.split)] + [f"b.{i}" for i in range(self.n - self.split)]

    def is_frozen(self, i: int) -> bool:
        return bool(self.frozen) and self.frozen[i]

    @property
    def trainable_paths(self) -> list[str]:
        return [p for i, p in enumerate(self.paths) if not self.is_frozen(i)]

    def trainable(self, path: str) -> bool:
        """The ``trainable`` predicate to give ``init_train_state`` / ``init_shard``."""
        return path not in {p for i, p in enumerate(self.paths) if self.is_frozen(i)}

    def tensors(self) -> list[torch.Tensor]:
        """The leaves: standard normal values (drawn in float64) in each leaf's dtype."""
        g = torch.Generator().manual_seed(self.seed)
        return [torch.randn(s, generator=g, dtype=torch.float64).to(d) for s, d in zip(self.shapes, self.dtypes)]

    def tree(self, leaves: Sequence[Any] | None = None) -> dict:
        leaves = list(self.tensors() if leaves is None else leaves)
        return {"a": leaves[: self.split], "b": tuple(leaves[self.split :])}

    def leaves_of(self, tree: dict) -> list:
        return list(tree["a"]) + list(tree["b"])

    def grads(self, world: int, scale: float = 1.0) -> list[torch.Tensor]:
        """Per-rank gradients ``[world, *shape]`` from ``seed + 1`` (float64 for float64 leaves, else float32)."""
        g = torch.Generator().manual_seed(self.seed + 1)
        return [(torch.randn((world, *s), generator=g, dtype=torch.float64) * scale).to(
            torch.float64 if d == torch.float64 else torch.float32) for s, d in zip(self.shapes, self.dtypes)]


@st.composite
def param_trees(draw: Any, min_leaves: int = 1, max_leaves: int = 6, *, dtypes: Sequence[torch.dtype] = FLOAT_DTYPES,
                max_dims: int = 3, max_side: int = 7, allow_empty: bool = True, allow_frozen: bool = True) -> ParamTree:
    """:class:`ParamTree` s of 0-d, empty, odd-sized, mixed-dtype leaves; ``allow_frozen``: some (not all) frozen."""
    n = draw(st.integers(min_leaves, max_leaves))
    shp = tuple(draw(st.lists(shapes(max_dims, max_side, allow_empty=allow_empty), min_size=n, max_size=n)))
    dts = tuple(draw(st.lists(float_dtypes(dtypes), min_size=n, max_size=n)))
    frozen: tuple[bool, ...] = ()
    if allow_frozen and n > 1:
        frozen = tuple(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
        if all(frozen):
            frozen = (False, *frozen[1:])
    return ParamTree(shp, dts, draw(st.integers(0, 2**20)), frozen)


@dataclasses.dataclass(frozen=True)
class LayoutCase(ParamTree):
    """A :class:`ParamTree` with a world size and an alignment."""

    world: int = 1
    alignment: int = 16

    def grads(self, world: int | None = None, scale: float = 1.0) -> list[torch.Tensor]:  # type: ignore[override]
        return super().grads(self.world if world is None else world, scale)


@st.composite
def layout_cases(draw: Any, min_leaves: int = 1, max_leaves: int = 6, *, worlds: st.SearchStrategy | None = None,
                 allow_empty: bool = False, allow_frozen: bool = False, **tree_kw: Any) -> LayoutCase:
    """:class:`LayoutCase` s: a parameter tree, a world size (``worlds``, default 1-8) and an alignment."""
    t = draw(param_trees(min_leaves, max_leaves, allow_empty=allow_empty, allow_frozen=allow_frozen, **tree_kw))
    world = draw(worlds if worlds is not None else world_sizes())
    return LayoutCase(t.shapes, t.dtypes, t.seed, t.frozen, world, draw(alignments()))


@dataclasses.dataclass(frozen=True)
class BatchSplit:
    """A global batch: each of ``world`` ranks takes ``accum`` micro-batches of ``per_rank`` examples."""

    world: int
    per_rank: int
    accum: int = 1

    @property
    def global_batch(self) -> int:
        return self.world * self.accum * self.per_rank

    def split(self, comm: Any, batch: Any) -> Any:
        """``comm.split_batch(batch, micro_batches=accum)``: leaves ``[R, (K,) per_rank, ...]``."""
        return comm.split_batch(batch, micro_batches=self.accum)


@st.composite
def batch_splits(draw: Any, world: IntOrStrategy = None,  # type: ignore[assignment]
                 max_per_rank: int = 3, max_accum: int = 3) -> BatchSplit:
    """:class:`BatchSplit` s; ``world``: an int, a strategy, or None (1-4)."""
    w = draw(world_sizes(1, 4) if world is None else _ints(world))
    return BatchSplit(w, draw(st.integers(1, max_per_rank)), draw(st.integers(1, max_accum)))


@dataclasses.dataclass(frozen=True)
class PathIn:
    """A path predicate: ``path in paths`` (hashable, readable in a shrunk example)."""

    paths: frozenset

    def __call__(self, path: str) -> bool:
        return path in self.paths

    def __repr__(self) -> str:
        return f"PathIn({sorted(self.paths)})"


_lrs = st.sampled_from([1e-3, 1e-2, 0.05, 0.1])
_decays = st.sampled_from([0.0, 1e-2, 0.1])


@st.composite
def optimizers(draw: Any, paths: Sequence[str] = (), kinds: Sequence[str] = ("sgd", "adam", "adamw"),
               max_groups: int = 2) -> Optimizer:
    """SGD (momentum, dampening, nesterov, maximize), Adam and AdamW (amsgrad, maximize) randomly configured; with
    ``paths``, up to ``max_groups`` groups over random subsets (:class:`PathIn`) overriding lr and/or weight decay."""
    kind = draw(st.sampled_from(tuple(kinds)))
    groups = []
    if paths and max_groups:
        for _ in range(draw(st.integers(0, max_groups))):
            members = draw(st.sets(st.sampled_from(sorted(paths)), min_size=1))
            over = draw(st.fixed_dictionaries({}, optional={"lr": _lrs, "weight_decay": _decays}))
            groups.append((PathIn(frozenset(members)), over))
    if kind == "sgd":
        momentum = draw(st.sampled_from([0.0, 0.5, 0.9]))
        nesterov = momentum > 0 and draw(st.booleans())
        dampening = 0.0 if nesterov else draw(st.sampled_from([0.0, 0.1]))
        return sgd(draw(_lrs), momentum, dampening, draw(_decays), nesterov=nesterov,
                   maximize=draw(st.booleans()), groups=groups)
    make = adam if kind == "adam" else adamw
    betas = (draw(st.sampled_from([0.8, 0.9])), draw(st.sampled_from([0.99, 0.999])))
    return make(draw(_lrs), betas, draw(st.sampled_from([1e-8, 1e-6])), draw(_decays),
                amsgrad=draw(st.booleans()), maximize=draw(st.booleans()), groups=groups)


powers_of_two = st.integers(0, 24).map(lambda k: 2.0**k)
init_scales = st.one_of(powers_of_two, st.floats(1.0, 2.0**24, allow_nan=False))  # and arbitrary floats
growth_factors = st.floats(1.0, 4.0, exclude_min=True, allow_nan=False)
backoff_factors = st.floats(0.0, 1.0, exclude_min=True, exclude_max=True, allow_nan=False)
growth_intervals = st.integers(1, 5)
overflow_patterns = st.lists(st.booleans(), min_size=1, max_size=40)  # per step: True = non-finite gradients


@st.composite
def scalers(draw: Any, dynamic: bool | None = None) -> ScalerState:
    """Static (a power-of-two scale) or dynamic scalers (``dynamic=None``: either): power-of-two
    initial scale, growth factor, backoff, interval, optional ``min_scale`` floor and hysteresis."""
    if dynamic is None:
        dynamic = draw(st.booleans())
    if not dynamic:
        return static_scaler(draw(st.integers(0, 16).map(lambda k: 2.0**k)))
    init = draw(st.integers(0, 16).map(lambda k: 2.0**k))
    floor = draw(st.one_of(st.none(), st.sampled_from([1.0, 2.0**-4])))
    return init_scaler(init, draw(st.sampled_from([2.0, 1.5, 4.0])), draw(st.sampled_from([0.5, 0.25])),
                       draw(growth_intervals), min_scale=floor if floor is None or floor <= init else None,
                       hysteresis=draw(st.one_of(st.none(), st.integers(1, 3))))


def precisions(param_dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16, torch.float16)
               ) -> st.SearchStrategy:
    """:class:`~fzero.MixedPrecision` policies: compute dtype, reduce dtype (None or fp32)."""
    return st.builds(MixedPrecision, param_dtype=st.sampled_from(tuple(param_dtypes)),
                     reduce_dtype=st.sampled_from([None, torch.float32]))


@st.composite
def fault_schedules(draw: Any, world_size: IntOrStrategy, steps: int, *, max_faults: int = 3,
                    kinds: Sequence[str] = ("grad", "corrupt", "delay"), corrupt_ops: Sequence[str] = ("all_gather",),
                    max_index: int = 0, max_delay: float = 0.01) -> tuple[Fault, ...]:
    """Up to ``max_faults`` faults for ``steps`` steps on ``world_size`` (an int or a strategy) ranks,
    sorted by step: :class:`GradFault` (inf, -inf or nan), :class:`CorruptResult` (of one of
    ``corrupt_ops``, element ``0..max_index``, bit flip or a value), :class:`Delay` (up to ``max_delay`` s)."""
    w = draw(_ints(world_size))
    out: list[Fault] = []
    for _ in range(draw(st.integers(0, max_faults))):
        kind = draw(st.sampled_from(tuple(kinds)))
        step, rank = draw(st.integers(0, steps - 1)), draw(st.integers(0, w - 1))
        if kind == "grad":
            out.append(GradFault(step, rank, draw(st.sampled_from([math.inf, -math.inf, math.nan]))))
        elif kind == "corrupt":
            out.append(CorruptResult(step, rank, draw(st.sampled_from(tuple(corrupt_ops))),
                                     draw(st.integers(0, max_index)),
                                     draw(st.one_of(st.none(), st.sampled_from([0.0, 1.0, 1e30, math.inf])))))
        else:
            out.append(Delay(step, rank, draw(st.floats(0.0, max_delay))))
    return tuple(sorted(out, key=lambda f: (f.step, f.rank)))
