"""Per-element ``torch.optim`` classes as rules: :func:`from_torch_optim` wraps one (as
``ZeroRedundancyOptimizer(optimizer_class=...)``) and runs its ``step()`` on views of the shards, one torch "parameter"
per parameter piece, its state injected: shaped state a (sharded) moment, 0-d state a scalar, ``step`` its own step
count. Eager only.

Imports: optim, layout, adafactor_rules.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from .adafactor_rules import adafactor
from .layout import FlatGroup, Layout, shard_pieces, trainable_index
from .optim import GroupSpec, Optimizer, ShardRule, Update, _groups

__all__ = ["TorchOptimRule", "Piece", "update_by_piece", "from_torch_optim", "probe_state", "tuple_names"]

ELEMENT, SCALAR, STEP = "element", "scalar", "step"

# fzero's own checkpoint entries under "fzero/": a moment of one of these names would collide
_RESERVED = frozenset({"master", "hyper", "scalar", "vector", "frozen", "buffer", "rng", "scaler", "missed", "manifest",
                       "step"})


class Piece(NamedTuple):
    """One parameter's piece of one row of a shard: views, written in place."""

    param: int  # the parameter's position in ``Layout.trainable_slots``
    step: int  # its own step count: updates applied to it before this one
    value: torch.Tensor  # [m] view of the master row (m = 0: the parameter lies on other ranks)
    grad: torch.Tensor  # [m], the master dtype
    moments: tuple[torch.Tensor, ...]  # [m] views, one per moment name
    scalars: tuple[float, ...]  # its scalar state, one per scalar name


def update_by_piece(rule: TorchOptimRule, layout: Layout, group: FlatGroup, p: torch.Tensor, grad: torch.Tensor,
                    moments: tuple[torch.Tensor, ...], hyper: Mapping[str, torch.Tensor], own: Sequence[int],
                    take: Sequence[bool], scalars: list[list[float]], ranks: Sequence[int]) -> None:
    """In place: each parameter of ``group`` that takes the step (``take``) updates its pieces of ``p`` and
    ``moments`` at its own step count, and its ``scalars`` (per name, per parameter) on every rank."""
    where = trainable_index(layout)
    pieces = []
    for row, rank in enumerate(ranks):
        spans = {k: (lo, hi) for k, lo, hi in shard_pieces(layout, group, rank, where) if k is not None}
        for i in group.slots:
            k = where[i]
            lo, hi = spans.get(k, (0, 0))
            if take[k]:
                views = [t[row, lo:hi] for t in (p, grad, *moments)]
                pieces.append(Piece(k, own[k], views[0], views[1], tuple(views[2:]), tuple(s[k] for s in scalars)))
    for piece, new in zip(pieces, rule.update_pieces(pieces, hyper)):
        for s, v in zip(scalars, new):
            s[piece.param] = v  # every piece of a parameter gives the same values


@dataclasses.dataclass(frozen=True)
class TorchOptimRule(ShardRule):
    """A ``torch.optim`` class run on each parameter's shard pieces (:func:`from_torch_optim`). ``static``: other
    constructor arguments, sorted; ``tuples``: tuple hyperparameters ``(name, length)``; ``state``: ``(key, "element" |
    "scalar" | "step")`` as probed; ``scalar_dtype``: 0-d state tensors' dtype (``None``: Python numbers)."""

    torch_cls: type | None = None
    static: tuple[tuple[str, Any], ...] = ()
    tuples: tuple[tuple[str, int], ...] = ()
    state: tuple[tuple[str, str], ...] = ()
    scalar_dtype: torch.dtype | None = torch.float32

    @property
    def name(self) -> str:
        return f"{self.torch_cls.__module__}.{self.torch_cls.__qualname__}"

    @property
    def moment_names(self) -> tuple[str, ...]:  # type: ignore[override]
        return tuple(k for k, kind in self.state if kind == ELEMENT)

    @property
    def scalar_names(self) -> tuple[str, ...]:  # type: ignore[override]
        return tuple(k for k, kind in self.state if kind == SCALAR)

    def manifest(self) -> dict[str, Any]:
        return {"kind": self.name, "static": [[k, v] for k, v in self.static], "tuples": [list(t) for t in self.tuples],
                "state": [[k, kind] for k, kind in self.state], "scalar_dtype": str(self.scalar_dtype)}

    def check_hyper(self, name: str, value: float, where: str) -> None:
        if value != value:
            raise ValueError(f"{where}: invalid {name} {value}")

    def torch_kwargs(self, hyper: Mapping[str, Any]) -> dict[str, Any]:
        """The class's constructor arguments: static ones, ``hyper`` as floats (CPU: no sync), tuples rebuilt."""
        values = {k: float(v) for k, v in hyper.items()}
        tupled = {x for t, n in self.tuples for x in tuple_names(t, n)}
        return {**dict(self.static), **{k: v for k, v in values.items() if k not in tupled},
                **{t: tuple(values[x] for x in tuple_names(t, n)) for t, n in self.tuples}}

    def torch_state(self, step: int, moments: Sequence[torch.Tensor], scalars: Sequence[float]) -> dict[str, Any]:
        """A parameter's state in the class at ``step``; ``moments`` are used as they are (written in place)."""
        moment, scalar = dict(zip(self.moment_names, moments)), dict(zip(self.scalar_names, scalars))
        out: dict[str, Any] = {}
        for key, kind in self.state:
            if kind == ELEMENT:
                out[key] = moment[key]
            else:
                value = float(step) if kind == STEP else scalar[key]
                # on the host, as torch.optim keeps a non-capturable step count, whatever the parameter's device
                out[key] = value if self.scalar_dtype is None else torch.tensor(value, dtype=self.scalar_dtype,
                                                                                device="cpu")
        return out

    def update_shards(self, u: Update, comm: Any) -> None:
        """Each flat group by piece (:func:`update_by_piece`). No collective."""
        for g in u.layout.groups:
            update_by_piece(self, u.layout, g, u.master[g.index], u.grads[g.index], u.moments[g.index],
                            u.hyper[g.opt_group], u.own, u.take, u.scalars, u.ranks)

    def update_pieces(self, pieces: Sequence[Piece], hyper: Mapping[str, torch.Tensor]) -> list[tuple[float, ...]]:
        """The class's ``step()`` on every piece at once (one param group), each piece's state injected; a
        piece at its first step gets the class's own initial state. Returns each piece's new scalars."""
        if not pieces:
            return []
        kwargs = self.torch_kwargs(hyper)
        opt = self.torch_cls([torch.zeros(1, dtype=pieces[0].value.dtype)], **kwargs)
        opt.state.clear()
        params = [piece.value for piece in pieces]
        for piece, param in zip(pieces, params):
            param.grad = piece.grad
            opt.state[param] = (self.torch_state(piece.step, piece.moments, piece.scalars) if piece.step > 0
                                else dict(self.torch_cls([param], **kwargs).state.get(param, {})))  # Adagrad's sum
        opt.param_groups[0]["params"] = params
        opt.step()
        out = []
        for piece, param in zip(pieces, params):
            out.append(self._read_back(piece, opt.state[param]))
            param.grad = None
        return out

    def _read_back(self, piece: Piece, state: Mapping[str, Any]) -> tuple[float, ...]:
        """Copy stepped state into the moment views (a first step makes new tensors); return the scalars."""
        known = dict(self.state)
        for key in state:
            if key not in known:
                raise ValueError(f"{self.name}: state {key!r} appeared after construction (the probe saw "
                                 f"{sorted(known)}): a hyperparameter that decides which state exists (e.g. a "
                                 "momentum set above 0 later) must be given when the rule is built")
        for key, view in zip(self.moment_names, piece.moments):
            if state[key] is not view:
                view.copy_(state[key])
        return tuple(float(state[key]) for key in self.scalar_names)


def tuple_names(key: str, n: int) -> tuple[str, ...]:
    """The hyperparameter names of a tuple argument: ``betas`` as fzero's Adam names them, else ``key[i]``."""
    if key == "betas" and n == 2:
        return ("beta1", "beta2")
    return tuple(f"{key}[{i}]" for i in range(n))


def _split(cls: type, values: Mapping[str, Any]
           ) -> tuple[list[tuple[str, float]], list[tuple[str, int]], list[tuple[str, Any]]]:
    """The class's defaults its constructor takes (not AdamW's ``decoupled_weight_decay``) as (hyper, tuples,
    static)."""
    params = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
    # arguments annotated as floats are hyperparameters even given as ints (``weight_decay: float = 0``)
    floats = {name for name, p in params.items() if "float" in str(p.annotation) or isinstance(p.default, float)}
    hyper, tuples, static = [], [], []
    for key, v in values.items():
        if key == "params" or not (takes_any or key in params):
            continue
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = float(v)
        is_number = isinstance(v, (int, float)) and not isinstance(v, bool)
        if is_number and (isinstance(v, float) or key in floats):
            hyper.append((key, float(v)))
        elif isinstance(v, tuple) and v and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
            tuples.append((key, len(v)))
            hyper.extend(zip(tuple_names(key, len(v)), (float(x) for x in v)))
        else:
            try:
                hash(v)
            except TypeError:
                raise ValueError(f"{cls.__name__}: argument {key}={v!r} is neither a number nor hashable "
                                 "static configuration") from None
            static.append((key, v))
    return hyper, tuples, sorted(static)


def probe_state(cls: type, kwargs: Mapping[str, Any]) -> tuple[tuple[tuple[str, str], ...], torch.dtype | None]:
    """``((key, kind), ...)`` of a parameter's state in ``cls`` after one step on a dense 2x3 tensor, and the
    dtype of its 0-d state tensors. ``ValueError`` naming the class (and key) when it cannot run on shards."""
    name = cls.__name__
    closure = inspect.signature(cls.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ValueError(f"{name} cannot run on shards: its step() needs a closure (it re-evaluates the loss "
                         "within a step), which a sharded step cannot give")
    param = torch.linspace(-1.0, 1.0, 6).view(2, 3).clone()
    try:
        opt = cls([param], **kwargs)
        param.grad = torch.linspace(0.5, -0.7, 6).view(2, 3)
        opt.step()
    except Exception as e:  # the class's own refusal (SparseAdam: dense gradients) says why
        raise ValueError(f"{name} cannot run on shards: one step on a dense 2x3 tensor raised "
                         f"{type(e).__name__}: {e}") from e
    layout, dtype, numbers = [], None, False
    for key, v in opt.state[param].items():
        if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(param.shape):
            kind = ELEMENT
        elif isinstance(v, torch.Tensor) and v.dim() == 0 or isinstance(v, (int, float)) and not isinstance(v, bool):
            kind = STEP if key == "step" and float(v) == 1.0 else SCALAR
            if isinstance(v, torch.Tensor):
                dtype = v.dtype
            else:
                numbers = True
        else:
            what = f"a tensor of shape {tuple(v.shape)}" if isinstance(v, torch.Tensor) else f"a {type(v).__name__}"
            raise ValueError(f"{name} cannot run on shards: its state {key!r} is {what}, neither per-element (the "
                             f"parameter's shape {tuple(param.shape)}) nor 0-d, so it does not update elementwise")
        if kind == ELEMENT and key in _RESERVED:
            raise ValueError(f"{name}: its state {key!r} has the name of one of fzero's checkpoint entries")
        layout.append((key, kind))
    # 0-d state as Python numbers is injected as numbers (None); with none, torch's default for the record
    return tuple(layout), (None if numbers and dtype is None else dtype or torch.float32)


def from_torch_optim(optimizer_class: type, *, groups: Sequence[GroupSpec] = (), **kwargs: Any) -> Optimizer:
    """A rule running ``optimizer_class`` (an elementwise ``torch.optim.Optimizer`` subclass: Adam, NAdam, RMSprop,
    Adagrad, SGD...) on shards, ``kwargs`` its constructor arguments. Float arguments (and their tuples: ``betas`` ->
    ``beta1``/``beta2``) are hyperparameters, schedulable and per group (``groups`` as for :func:`fzero.adamw`).
    ``TypeError`` for a non-optimizer; ``ValueError`` naming the class when it cannot run on shards (LBFGS's closure,
    SparseAdam, state neither per-element nor 0-d). ``torch.optim.Adafactor`` gives :func:`fzero.adafactor`."""
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(f"from_torch_optim: {optimizer_class!r} is not a torch.optim.Optimizer subclass")
    if optimizer_class is getattr(torch.optim, "Adafactor", None):  # factored and norm-based: fzero's own rule
        return adafactor(groups=groups, **kwargs)
    state, dtype = probe_state(optimizer_class, kwargs)
    hyper, tuples, static = _split(optimizer_class, optimizer_class([torch.zeros(1)], **kwargs).defaults)
    rule = TorchOptimRule(tuple(hyper), (), torch_cls=optimizer_class, static=tuple(static),
                          tuples=tuple(tuples), state=state, scalar_dtype=dtype)
    return dataclasses.replace(rule, groups=_groups(groups, [k for k, _ in hyper], rule))
