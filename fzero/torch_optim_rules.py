"""Any per-element ``torch.optim`` class as an fzero update rule, run on the shards.

:func:`from_torch_optim` (``fzero.from_torch_optim(torch.optim.NAdam, lr=1e-3)``) wraps a
``torch.optim.Optimizer`` class, as ``ZeroRedundancyOptimizer(optimizer_class=...)`` does:
the math is the class's own ``step()``, called on views of this rank's shards, one torch
"parameter" per parameter piece of a shard row, with the piece's state injected.

What the class keeps per parameter is found by probing it once on a small dense tensor:
a state tensor of the parameter's shape is per-element (a moment, ``[R, shard_numel]``
in fzero's state); a 0-d tensor (or a number) is per-parameter scalar state, kept as one
``[T]`` float64 vector per name (``OptState.scalars``), replicated on every rank, as
torch.optim keeps it per parameter; ``step`` is the parameter's own step count
(``OptState.step - OptState.missed``). A parameter takes its first step with no injected
state, so the class initialises it exactly as torch.optim would. Float constructor
arguments are hyperparameters (0-d tensors in ``OptState.hyper``, schedulable); the rest
(``maximize``, ``amsgrad``, ``foreach``...) is static configuration.

Eager only: the rule updates Python-level pieces (``by_piece``), so a compiled step raises
naming the class (:func:`fzero.optim.check_compilable`).

Imports: ``fzero.optim``.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Mapping, NamedTuple, Optional, Sequence

import torch

from .layout import FlatGroup, Layout, shard_pieces, trainable_index
from .optim import GroupSpec, Optimizer, ShardRule, Update, _groups

__all__ = ["TorchOptimRule", "Piece", "update_by_piece", "from_torch_optim", "torch_rule_from_manifest"]

ELEMENT, SCALAR, STEP = "element", "scalar", "step"

# fzero's own checkpoint entries under "fzero/": a moment of one of these names would collide
_RESERVED = frozenset({"master", "hyper", "scalar", "vector", "frozen", "buffer", "rng", "scaler", "missed", "manifest",
                       "step"})


class Piece(NamedTuple):
    """One parameter's piece of one local rank's shard: views into the state's shards, written
    in place."""

    param: int  # the parameter's position in ``Layout.trainable_slots``
    step: int  # its own step count: updates applied to it before this one
    value: torch.Tensor  # [m] view of the master row (m = 0: the parameter lies on other ranks)
    grad: torch.Tensor  # [m], the master dtype
    moments: tuple[torch.Tensor, ...]  # [m] views, one per moment name
    scalars: tuple[float, ...]  # its scalar state, one per scalar name


def update_by_piece(rule: "TorchOptimRule", layout: Layout, group: FlatGroup, p: torch.Tensor, grad: torch.Tensor,
                    moments: tuple[torch.Tensor, ...], hyper: Mapping[str, torch.Tensor], own: Sequence[int],
                    take: Sequence[bool], scalars: list[list[float]], ranks: Sequence[int]) -> None:
    """In place: each parameter of ``group`` that takes the step updates its piece of every row
    of ``p`` and ``moments`` (``[R, n]``) by ``rule``'s torch class at its own step count
    ``own[k]``; ``scalars`` (per scalar name, per parameter) gets its new scalar state. A
    parameter with no piece on a rank still steps its scalar state there (every rank holds it)."""
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
    """A ``torch.optim`` class run on each parameter's piece of the shards (see
    :func:`from_torch_optim`, which builds it).

    ``torch_cls``: the class. ``static``: its non-hyperparameter constructor arguments
    (``(name, value)``, sorted). ``tuples``: hyperparameters given as tuples (``betas``),
    ``(name, length)``, stored as one hyperparameter per element (``beta1``, ``beta2``;
    otherwise ``name[i]``). ``state``: the probed layout of a parameter's state,
    ``(key, "element" | "scalar" | "step")`` in the class's order. ``scalar_dtype``: the
    dtype of the class's 0-d state tensors (``None``: Python numbers).
    """

    torch_cls: Optional[type] = None
    static: tuple[tuple[str, Any], ...] = ()
    tuples: tuple[tuple[str, int], ...] = ()
    state: tuple[tuple[str, str], ...] = ()
    scalar_dtype: Optional[torch.dtype] = torch.float32

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

    def torch_class(self) -> Optional[type]:
        return self.torch_cls

    def torch_kwargs(self, hyper: Mapping[str, Any]) -> dict[str, Any]:
        """The class's constructor arguments: the static ones and ``hyper`` as Python floats
        (read from CPU tensors: no device sync), tuples rebuilt."""
        values = {k: float(v) for k, v in hyper.items()}
        out: dict[str, Any] = dict(self.static)
        tupled = dict(self.tuples)
        for k in values:
            if not any(k in _tuple_names(t, n) for t, n in self.tuples):
                out[k] = values[k]
        for t, n in tupled.items():
            out[t] = tuple(values[x] for x in _tuple_names(t, n))
        return out

    def update_shards(self, u: Update, comm: Any) -> None:
        """Each flat group by piece (:func:`update_by_piece`). No collective."""
        for g in u.layout.groups:
            update_by_piece(self, u.layout, g, u.master[g.index], u.grads[g.index], u.moments[g.index],
                            u.hyper[g.opt_group], u.own, u.take, u.scalars, u.ranks)

    def update_pieces(self, pieces: Sequence[Piece], hyper: Mapping[str, torch.Tensor]) -> list[tuple[float, ...]]:
        """The class's own ``step()`` on every piece at once (one torch param group), each
        piece's state injected from its moments (views, updated in place), scalars and own
        step count; a piece at its first step gets the class's own initial state."""
        if not pieces:
            return []
        kwargs = self.torch_kwargs(hyper)
        opt = self.torch_cls([torch.zeros(1, dtype=pieces[0].value.dtype)], **kwargs)
        opt.state.clear()
        params = []
        for piece in pieces:
            param = piece.value
            param.grad = piece.grad
            params.append(param)
            opt.state[param] = self._injected(piece) if piece.step > 0 else self._initial(param, kwargs)
        opt.param_groups[0]["params"] = params
        opt.step()
        out = []
        for piece, param in zip(pieces, params):
            out.append(self._read_back(piece, opt.state[param]))
            param.grad = None
        return out

    def _injected(self, piece: Piece) -> dict[str, Any]:
        """A piece's torch state from fzero's: moments as views (torch writes them in place)."""
        moments = dict(zip(self.moment_names, piece.moments))
        scalars = dict(zip(self.scalar_names, piece.scalars))
        out: dict[str, Any] = {}
        for key, kind in self.state:
            if kind == ELEMENT:
                out[key] = moments[key]
            else:
                value = float(piece.step) if kind == STEP else scalars[key]
                out[key] = value if self.scalar_dtype is None else torch.tensor(value, dtype=self.scalar_dtype)
        return out

    def _initial(self, param: torch.Tensor, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The state the class gives ``param`` when constructed with it (Adagrad fills its
        ``sum`` there; most classes create nothing until their first step)."""
        return dict(self.torch_cls([param], **kwargs).state.get(param, {}))

    def _read_back(self, piece: Piece, state: Mapping[str, Any]) -> tuple[float, ...]:
        """Copy a piece's stepped state into its moment views (a first step made new tensors)
        and return its scalars; a key the probe did not see is refused."""
        known = dict(self.state)
        for key in state:
            if key not in known:
                raise ValueError(
                    f"{self.name}: state {key!r} appeared after construction (the probe saw "
                    f"{sorted(known)}): a hyperparameter that decides which state exists (e.g. a "
                    "momentum set above 0 later) must be given when the rule is built"
                )
        for key, view in zip(self.moment_names, piece.moments):
            new = state[key]
            if new is not view:
                view.copy_(new)
        return tuple(float(state[key]) for key in self.scalar_names)

    def torch_state(self, own_step: int, moments: Mapping[str, torch.Tensor], scalars: Mapping[str, float],
                    shape: tuple[int, ...] = (), dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        if own_step <= 0:
            return {}
        piece = Piece(-1, own_step, torch.empty(0), torch.empty(0),
                      tuple(moments[k] for k in self.moment_names), tuple(scalars.get(k, 0.0) for k in self.scalar_names))
        return self._injected(piece)

    def from_torch_state(self, state: Mapping[str, Any]) -> tuple[int, dict[str, torch.Tensor], dict[str, float]]:
        kinds = dict(self.state)
        if STEP in kinds.values():
            key = next(k for k, kind in self.state if kind == STEP)
            own = int(float(state[key])) if key in state else 0
        else:
            own = int(bool(state))
        moments = {k: state[k] for k in self.moment_names if k in state}
        return own, moments, {k: float(state[k]) for k in self.scalar_names if k in state}

    def hyper_from_torch_group(self, group: Mapping[str, Any]) -> dict[str, float]:
        names = [k for k, _ in self.defaults]
        singles = [k for k in names if not any(k in _tuple_names(t, n) for t, n in self.tuples)]
        for key in [*singles, *(t for t, _ in self.tuples)]:
            if key not in group:
                raise ValueError(f"has no {key!r}: it belongs to another optimizer than {self.name}")
        for key, mine in self.static:
            if key in group and group[key] != mine and key not in ("foreach", "fused"):
                raise ValueError(f"has {key} {group[key]!r}, here {mine!r}")
        out = {k: float(group[k]) for k in singles}
        for t, n in self.tuples:
            out.update(zip(_tuple_names(t, n), (float(v) for v in group[t])))
        return out


def _tuple_names(key: str, n: int) -> tuple[str, ...]:
    """The hyperparameter names of a tuple argument: ``betas`` as fzero's Adam names them."""
    if key == "betas" and n == 2:
        return ("beta1", "beta2")
    return tuple(f"{key}[{i}]" for i in range(n))


def _float_arguments(cls: type) -> set[str]:
    """Constructor arguments annotated as floats (``weight_decay: float = 0`` is a float given
    as the int 0: still a hyperparameter)."""
    out = set()
    for name, p in inspect.signature(cls.__init__).parameters.items():
        if "float" in str(p.annotation) or isinstance(p.default, float):
            out.add(name)
    return out


def _split(cls: type, values: Mapping[str, Any]
           ) -> tuple[list[tuple[str, float]], list[tuple[str, int]], list[tuple[str, Any]]]:
    """The constructed class's defaults as (hyperparameters, tuples, static arguments)."""
    floats = _float_arguments(cls)
    hyper, tuples, static = [], [], []
    for key, v in values.items():
        if key == "params":
            continue
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = float(v)
        is_number = isinstance(v, (int, float)) and not isinstance(v, bool)
        if is_number and (isinstance(v, float) or key in floats):
            hyper.append((key, float(v)))
        elif isinstance(v, tuple) and v and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
            tuples.append((key, len(v)))
            hyper.extend(zip(_tuple_names(key, len(v)), (float(x) for x in v)))
        else:
            try:
                hash(v)
            except TypeError:
                raise ValueError(f"{cls.__name__}: argument {key}={v!r} is neither a number nor hashable "
                                 "static configuration") from None
            static.append((key, v))
    return hyper, tuples, sorted(static)


def _constructor_arguments(cls: type, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of a constructed class's ``defaults`` that its constructor takes: a class
    may record more than it accepts (AdamW records ``decoupled_weight_decay=True``, which
    only Adam's constructor takes), and the rule rebuilds the class from these every step."""
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in params}


def _needs_closure(cls: type) -> bool:
    closure = inspect.signature(cls.step).parameters.get("closure")
    return closure is not None and closure.default is inspect.Parameter.empty


def probe_state(cls: type, kwargs: Mapping[str, Any]) -> tuple[tuple[tuple[str, str], ...], Optional[torch.dtype]]:
    """A parameter's state layout in ``cls``, ``((key, kind), ...)``, found by one step on a
    dense 2x3 tensor, and the dtype of its 0-d state tensors. ``ValueError`` naming the class
    when it cannot run on dense shards, and naming the key of a state tensor that is neither
    per-element nor 0-d (the class does not update elementwise)."""
    name = cls.__name__
    if _needs_closure(cls):
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
            raise ValueError(f"{name} cannot run on shards: its state {key!r} is {what}, neither per-element "
                             f"(the parameter's shape {tuple(param.shape)}) nor 0-d, so it does not update "
                             "elementwise")
        if kind == ELEMENT and key in _RESERVED:
            raise ValueError(f"{name}: its state {key!r} has the name of one of fzero's checkpoint entries")
        layout.append((key, kind))
    # 0-d state as Python numbers is injected as numbers (None); a class with none keeps torch's
    # default scalar dtype for the record
    return tuple(layout), (None if numbers and dtype is None else dtype or torch.float32)


def from_torch_optim(optimizer_class: type, *, groups: Sequence[GroupSpec] = (), **kwargs: Any) -> Optimizer:
    """An fzero update rule running ``optimizer_class`` (a ``torch.optim.Optimizer`` subclass
    whose update is elementwise: Adamax, NAdam, RAdam, RMSprop, Adagrad, ASGD, Adadelta,
    Rprop, SGD, Adam...) on the shards, with ``kwargs`` its constructor arguments.

    Float arguments (and tuples of them: ``betas`` become ``beta1``/``beta2``) are
    hyperparameters, schedulable and per-group (``groups`` as for :func:`fzero.adamw`,
    overriding those names); the others are static. The numbers are the class's own:
    its ``step()`` runs on each parameter's piece of this rank's shard (eagerly only:
    ``make_train_step(compile=True)`` raises naming the class).

    Raises ``ValueError`` naming the class when it cannot run on shards: a ``step`` that
    needs a closure (LBFGS), a class that refuses dense gradients (SparseAdam), or state
    neither per-element nor 0-d (naming the key). A state value that depends on the
    parameter's values other than elementwise (a per-parameter norm) cannot be detected
    here and would differ between a parameter's pieces: such classes are not per-element.
    ``torch.optim.Adafactor`` (factored, norm-based) is the exception fzero knows: it returns
    :func:`fzero.adafactor` with the same arguments, which computes it on the shards.
    """
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(f"from_torch_optim: {optimizer_class!r} is not a torch.optim.Optimizer subclass")
    if optimizer_class is getattr(torch.optim, "Adafactor", None):
        # not per-element (factored statistics, norms of the whole parameter): fzero's own rule
        # computes it on the shards with two small all_reduces (fzero.adafactor). Imported here:
        # that module sits above this one.
        from .adafactor_rules import adafactor

        return adafactor(groups=groups, **kwargs)
    state, dtype = probe_state(optimizer_class, kwargs)
    constructed = _constructor_arguments(optimizer_class, optimizer_class([torch.zeros(1)], **kwargs).defaults)
    hyper, tuples, static = _split(optimizer_class, constructed)
    rule = TorchOptimRule(tuple(hyper), (), torch_cls=optimizer_class, static=tuple(static),
                          tuples=tuple(tuples), state=state, scalar_dtype=dtype)
    return dataclasses.replace(rule, groups=_groups(groups, [k for k, _ in hyper], rule))


def torch_rule_from_manifest(section: Mapping[str, Any]) -> Optional[TorchOptimRule]:
    """The rule a checkpoint's manifest describes when it is one of ``torch.optim``'s own
    classes (found by name in ``torch.optim``: nothing is imported), else None. Its state
    layout is the manifest's (the probe's at save time); hyperparameter values are zeros:
    the checkpoint holds the saved ones."""
    kind = section.get("kind", "")
    module, _, qualname = kind.rpartition(".")
    cls = getattr(torch.optim, qualname, None)
    if not module.startswith("torch.optim") or not isinstance(cls, type) or cls.__module__ != module:
        return None
    dtype = section.get("scalar_dtype", "None")
    names = section.get("hyperparameters", [[]])[0]
    return TorchOptimRule(
        tuple((n, 0.0) for n in names), (), torch_cls=cls,
        static=tuple((k, v) for k, v in section.get("static", [])),
        tuples=tuple((k, n) for k, n in section.get("tuples", [])),
        state=tuple((k, kind) for k, kind in section.get("state", [])),
        scalar_dtype=None if dtype == "None" else getattr(torch, dtype.removeprefix("torch.")),
    )
