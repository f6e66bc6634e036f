"""The update-rule protocol on flat fp32 shards, and the built-in rules.

An :class:`Optimizer` is the protocol: hashable static configuration (the flags
that change the computation graph, default hyperparameters and parameter groups
chosen by path predicate) plus pure update functions on a flat shard, in the
spirit of optax's ``GradientTransformation``. :class:`OptState` holds what
changes: the moments of every flat group (``[R, shard_numel]``, master dtype),
the step count, every hyperparameter of every group as a 0-d float64 tensor (so
changing a learning rate never recompiles a step), per-parameter counts and
scalars (``[T]`` vectors), and per-parameter vector state (``OptState.vectors``).

The built-in rules (:class:`SGD`, :class:`Adam`; :func:`sgd`, :func:`adam`,
:func:`adamw`) follow ``torch.optim``'s single-tensor implementations operation
by operation, written out of place; eagerly Adam(W) runs torch's fused kernel.
Elementwise rules call no collective; a :class:`ShardRule` (``torch.optim`` classes on pieces,
:func:`fzero.muon`, :func:`fzero.adafactor`) updates the whole state in place and may.

Imports: ``fzero.pytree``.
"""

from __future__ import annotations

import dataclasses
import mmap
from typing import Any, Callable, ClassVar, Mapping, NamedTuple, Optional, Sequence, Union

import torch

from .pytree import pytree_dataclass, replace, static_field

__all__ = [
    "ParamGroup",
    "Optimizer",
    "SGD",
    "Adam",
    "OptState",
    "Update",
    "ShardRule",
    "check_compilable",
    "hyper_scalars",
    "sgd",
    "adam",
    "adamw",
    "init_opt_state",
    "init_scalars",
    "init_vectors",
    "vector_dtype",
    "vector_spans",
    "set_hyperparams",
    "no_weight_decay",
    "no_weight_decay_for",
]

Predicate = Callable[[str], bool]


@dataclasses.dataclass(frozen=True)
class ParamGroup:
    """Parameters whose dotted path satisfies ``match`` get ``overrides`` of the defaults."""

    match: Predicate
    overrides: tuple[tuple[str, float], ...]
    name: str = ""


def no_weight_decay(path: str) -> bool:
    """Path predicate for the usual no-decay group, *by name*: biases, and parameters of
    modules whose name contains ``norm`` or starts with ``ln``/``bn`` (``ln_f.weight``).

    Names cannot tell a LayerNorm inside ``nn.Sequential`` (``1.weight``) from a
    Linear; for a module use :func:`no_weight_decay_for`, which looks at types.
    """
    leaf = path.rsplit(".", 1)[-1]
    parent = path.rsplit(".", 2)[-2].lower() if path.count(".") else ""
    return leaf == "bias" or "norm" in parent or parent.startswith(("ln", "bn"))


_NORM_TYPES = (
    torch.nn.LayerNorm,
    torch.nn.GroupNorm,
    torch.nn.LocalResponseNorm,
    torch.nn.modules.batchnorm._NormBase,
    torch.nn.RMSNorm,
)


def _is_norm(m: torch.nn.Module) -> bool:
    # torch's normalisation types, and any class whose name says it normalises
    # (LlamaRMSNorm, T5LayerNorm, a user's ScaleNorm): the convention every model zoo follows
    return isinstance(m, _NORM_TYPES) or "norm" in type(m).__name__.lower()


def no_weight_decay_for(module: torch.nn.Module) -> Predicate:
    """Predicate for ``module``'s no-decay group: every bias, and every parameter of a
    normalisation module.

    A module is a normalisation module if it is one of torch's (LayerNorm,
    GroupNorm, LocalResponseNorm, BatchNorm/InstanceNorm, RMSNorm) or if its
    class name contains ``norm`` in any case (``LlamaRMSNorm``, ``T5LayerNorm``).
    """
    names = set()
    for prefix, m in module.named_modules():
        is_norm = _is_norm(m)
        for name, _ in m.named_parameters(recurse=False):
            if is_norm or name == "bias":
                names.add(f"{prefix}.{name}" if prefix else name)
    return frozenset(names).__contains__


class Update(NamedTuple):
    """What a :class:`ShardRule` updates in place (:meth:`ShardRule.update_shards`): per flat
    group the master shard, its unscaled gradient and moments (``[R, shard_numel]``); per
    optimizer group the hyperparameters; per trainable parameter (``Layout.trainable_slots``
    order) its own step count, whether it takes this step, its scalar state (one list per
    :attr:`Optimizer.scalar_names`, written back); the rows' global ranks; the vector state
    (:attr:`Optimizer.vector_names`, written in place)."""

    layout: Any
    master: tuple[torch.Tensor, ...]
    grads: tuple[torch.Tensor, ...]
    moments: tuple[tuple[torch.Tensor, ...], ...]
    hyper: tuple[Mapping[str, torch.Tensor], ...]
    own: list[int]
    take: list[bool]
    ranks: list[int]
    scalars: list[list[float]]
    vectors: list[torch.Tensor]


def check_compilable(optimizer: "Optimizer") -> None:
    """Raise ``ValueError`` naming the rule if it cannot run inside ``torch.compile``."""
    if not optimizer.elementwise:
        raise ValueError(f"optimizer {optimizer.name} cannot run in a compiled step: {optimizer.not_compilable}; "
                         "use compile=False")


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """The update-rule protocol: static, hashable configuration plus pure functions on a flat
    shard. :func:`sgd`, :func:`adam` and :func:`adamw` are instances; a user's rule is a
    frozen dataclass subclass overriding :meth:`update` (and what it needs of the rest).

    ``defaults``: ``(name, value)`` hyperparameters of group 0; ``groups``: further groups,
    the first matching predicate wins. Every hyperparameter lives in ``OptState.hyper`` as a
    0-d float64 tensor, so changing one (a schedule) never recompiles a step. Every other
    field of a subclass is static configuration: it may change which tensors exist or which
    operations run, and it is part of :attr:`signature`.

    What fzero reads through this protocol (never a ``kind`` branch): :attr:`name` and
    :attr:`signature` (manifests, replica checks), :attr:`moment_names` (per-element state:
    one ``[R, shard_numel]`` tensor each, in the master dtype, zero at init),
    :attr:`scalar_names` (per-parameter scalar state, one ``[T]`` float64 vector each,
    replicated), :attr:`vector_names` and :meth:`vector_lengths` (per-parameter vector state,
    replicated, ``OptState.vectors``), :meth:`step_scalars` (what of an update depends on the parameter's own step
    count, for parameters that sat out steps), :meth:`update` (pure), :meth:`update_` (in
    place; a fused kernel may go here). A rule must keep the padding
    zero: zero parameter, gradient and moments give zero parameter and moments.
    """

    defaults: tuple[tuple[str, float], ...]
    groups: tuple[ParamGroup, ...] = ()

    #: per-element state, one ``[R, shard_numel]`` tensor each (torch.optim's state names)
    moment_names: ClassVar[tuple[str, ...]] = ()
    #: per-parameter scalar state, one ``[T]`` float64 vector each (``OptState.scalars``)
    scalar_names: ClassVar[tuple[str, ...]] = ()
    #: per-parameter vector state, replicated and independent of the world size (``OptState.vectors``):
    #: one 1-D tensor per name, each parameter's vector of :meth:`vector_lengths` elements, joined
    #: in ``Layout.trainable_slots`` order (Adafactor's factored ``row_var``/``col_var``)
    vector_names: ClassVar[tuple[str, ...]] = ()
    #: what of an update depends on the step count (columns of :meth:`step_scalars`)
    step_scalar_names: ClassVar[tuple[str, ...]] = ()
    #: why a rule that is not elementwise cannot run in a compiled step (:func:`check_compilable`)
    not_compilable: ClassVar[str] = ("it updates each parameter's piece eagerly (torch.optim's own step on views "
                                     "of the shards)")

    @property
    def elementwise(self) -> bool:
        """Whether the rule is an elementwise :meth:`update` of flat shards (it runs in compiled
        steps), not a :class:`ShardRule`."""
        return not isinstance(self, ShardRule)

    @property
    def name(self) -> str:
        """A stable name of the rule (manifests, messages): the class name in lower case."""
        return type(self).__name__.lower()

    @property
    def kind(self) -> str:
        """The rule's :attr:`name` (the word earlier versions used)."""
        return self.name

    def config(self) -> tuple[tuple[str, Any], ...]:
        """The static configuration: every dataclass field but ``defaults`` and ``groups``."""
        return tuple((f.name, getattr(self, f.name)) for f in dataclasses.fields(self)
                     if f.name not in ("defaults", "groups"))

    @property
    def signature(self) -> str:
        """Name and static configuration as one string: equal exactly when two ranks (or a
        checkpoint and a state) run the same computation on the same state tensors."""
        items = ",".join(f"{k}={v!r}" for k, v in self.config())
        vectors = f"|vectors={self.vector_names}" if self.vector_names else ""
        return f"{self.name}({items})|moments={self.moment_names}|scalars={self.scalar_names}{vectors}"

    def vector_lengths(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The length of a parameter's vector of each of :attr:`vector_names`, from its shape
        (0: the parameter has none). The default: no vector state."""
        return (0,) * len(self.vector_names)

    def manifest(self) -> dict[str, Any]:
        """The JSON description a checkpoint's manifest holds: ``kind`` (:attr:`name`) first,
        then the static configuration (values as ``repr`` strings unless JSON scalars)."""
        out: dict[str, Any] = {"kind": self.name}
        for k, v in self.config():
            out[k] = v if isinstance(v, (bool, int, float, str, type(None))) else repr(v)
        return out

    @property
    def num_groups(self) -> int:
        return 1 + len(self.groups)

    def group_of(self, path: str) -> int:
        for i, g in enumerate(self.groups):
            if g.match(path):
                return i + 1
        return 0

    def group_name(self, index: int) -> str:
        return "default" if index == 0 else (self.groups[index - 1].name or f"group{index}")

    def hyperparams(self, index: int) -> dict[str, float]:
        h = dict(self.defaults)
        if index:
            h.update(self.groups[index - 1].overrides)
        return h

    def check_hyper(self, name: str, value: float, where: str) -> None:
        """Raise ``ValueError`` (``"{where}: invalid {name} {value}"``) for a value the rule
        refuses; the default refuses NaN and a negative ``lr``."""
        _check_hyper(name, value, where)

    @classmethod
    def configure(cls, *, groups: Sequence["GroupSpec"] = (), **values: Any) -> "Optimizer":
        """An instance: float keyword arguments are the default hyperparameters (in the order
        given), the others static fields of ``cls``; ``groups`` as for :func:`adamw`."""
        fields = {f.name for f in dataclasses.fields(cls)} - {"defaults", "groups"}
        static = {k: v for k, v in values.items() if k in fields}
        hyper = tuple((k, float(v)) for k, v in values.items() if k not in fields)
        probe = cls(hyper, (), **static)
        for k, v in hyper:
            probe.check_hyper(k, v, probe.name)
        return cls(hyper, _groups(groups, [k for k, _ in hyper], probe), **static)

    def step_scalars(self, hyper: Mapping[str, torch.Tensor], steps: torch.Tensor) -> torch.Tensor:
        """``[k, len(step_scalar_names)]`` float64: for ``k`` parameters with step counts
        ``steps`` (``[k]`` int64, updates applied before this one) the scalars of their update
        that depend on the count, computed as :meth:`update` computes them for a 0-d step.
        The default: a rule that does not depend on the step count. No collective."""
        return torch.zeros(steps.shape[0], 0, dtype=torch.float64, device=steps.device)

    def step_values(self, hyper: Mapping[str, torch.Tensor], step: torch.Tensor,
                    per_element: Optional[Mapping[str, torch.Tensor]], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """What :meth:`update` needs of the step count, ``{name: tensor}`` in ``dtype``:
        ``per_element`` when given (each parameter's own count, spread over the shard),
        else :meth:`step_scalars` of the 0-d ``step``. So a rule written once with
        :meth:`step_scalars` is exact for parameters that sat out steps. No collective."""
        if per_element is not None:
            return {k: v.to(dtype) for k, v in per_element.items()}
        row = self.step_scalars(hyper, step.reshape(1))[0].to(dtype)
        return {k: row[j] for j, k in enumerate(self.step_scalar_names)}

    def update(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        moments: tuple[torch.Tensor, ...],
        hyper: Mapping[str, torch.Tensor],
        step: torch.Tensor,
        per_element: Optional[Mapping[str, torch.Tensor]] = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """One update of a shard. ``param``, ``grad``, moments: ``[R, n]``, same dtype.

        ``hyper``: ``{name: 0-d float64}`` (:func:`hyper_scalars` casts them to the shard's
        dtype as torch.optim reads Python floats). ``step``: 0-d int64, updates applied before
        this one. ``per_element``: the step-dependent scalars of :meth:`step_scalars`, each
        broadcastable to ``param`` (one parameter's piece of a shard has its own step count),
        replacing those of ``step`` (:meth:`step_values` picks the one that applies). Returns new ``(param, moments)`` (as many as
        :attr:`moment_names`); inputs are not modified. No collective.
        """
        raise NotImplementedError(f"{type(self).__name__} does not define update()")

    def update_(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        moments: tuple[torch.Tensor, ...],
        hyper: Mapping[str, torch.Tensor],
        step: torch.Tensor,
        found_inf: Optional[torch.Tensor] = None,
    ) -> None:
        """:meth:`update` in place on ``param`` and ``moments``; a no-op where ``found_inf``
        (0-d, nonzero: skip). The default writes the update out and copies it back through
        ``torch.where``, which inductor fuses into one read-modify-write pass. No collective."""
        new_param, new_moments = self.update(param, grad, moments, hyper, step)
        skip = None if found_inf is None else found_inf.to(torch.bool)
        for old, new in zip((param, *moments), (new_param, *new_moments)):
            old.copy_(new if skip is None else torch.where(skip, old, new))

    # torch.optim interchange (fzero.checkpoint.torch_optim); a rule without a torch.optim
    # equivalent keeps these defaults, and export/import name it.

    def torch_class(self) -> Optional[type]:
        """The ``torch.optim`` class with the same update, or None."""
        return None

    def torch_kwargs(self, hyper: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """Constructor keyword arguments of :meth:`torch_class` for one group's ``hyper``."""
        raise NotImplementedError

    def torch_state(self, own_step: int, moments: Mapping[str, torch.Tensor], scalars: Mapping[str, float],
                    shape: tuple[int, ...], dtype: torch.dtype) -> dict[str, Any]:
        """One parameter's ``torch.optim`` state at its own step count (``own_step``) from its
        moments (``{name: tensor of shape, dtype}``; ``{}`` before any step) and scalar state;
        ``{}``: torch keeps none for it."""
        raise NotImplementedError

    def from_torch_state(self, state: Mapping[str, Any]) -> tuple[int, dict[str, torch.Tensor], dict[str, float]]:
        """Inverse of :meth:`torch_state`: ``(own step, moments present, scalars)``."""
        raise NotImplementedError

    def vectors_from_torch_state(self, state: Mapping[str, Any], shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
        """A parameter's vector state (``{name: 1-D tensor}``, the names present) from its
        ``torch.optim`` state; a rule with :attr:`vector_names` gets them in :meth:`torch_state`
        as ``vectors=``. The default: none."""
        return {}

    def hyper_from_torch_group(self, group: Mapping[str, Any]) -> dict[str, float]:
        """fzero's hyperparameters from a ``torch.optim`` param group, or ``ValueError`` naming
        the static setting or kind that differs (a phrase: "belongs to adam, ...")."""
        raise NotImplementedError


class ShardRule(Optimizer):
    """An update rule that is not elementwise: it updates each parameter's piece of the shards
    (:func:`fzero.from_torch_optim`), or calls collectives (:func:`fzero.muon`,
    :func:`fzero.adafactor`). Instead of :meth:`Optimizer.update` it has one in-place form for
    the whole state, :meth:`update_shards`, which :func:`fzero.shard_step` runs eagerly on
    copies (a pure step) or on the state's own tensors (a donating one)."""

    def update_shards(self, u: Update, comm: Any) -> None:
        """One step of every flat group, in place on ``u``'s master shards and moments, only for
        the parameters that take it (``u.take``), at their own step counts (``u.own``). It may
        call ``comm``'s collectives: every rank calls it with the same layout and flags."""
        raise NotImplementedError(f"{type(self).__name__} does not define update_shards()")


GroupSpec = Union[ParamGroup, tuple[Predicate, Mapping[str, float]]]


def _groups(groups: Sequence[GroupSpec], allowed: Sequence[str],
            rule: Optional[Optimizer] = None) -> tuple[ParamGroup, ...]:
    out = []
    for i, g in enumerate(groups):
        if not isinstance(g, ParamGroup):
            match, overrides = g
            g = ParamGroup(match, tuple(sorted((k, float(v)) for k, v in dict(overrides).items())))
        for k, v in g.overrides:
            if k not in allowed:
                raise ValueError(
                    f"param group {i + 1}: unknown hyperparameter {k!r}; expected one of {sorted(allowed)}"
                )
            (rule.check_hyper if rule is not None else _check_hyper)(k, v, f"param group {i + 1}")
        out.append(g)
    return tuple(out)


_VALID = {
    "lr": lambda v: v >= 0,
    "momentum": lambda v: v >= 0,
    "dampening": lambda v: True,
    "weight_decay": lambda v: v >= 0,
    "beta1": lambda v: 0 <= v < 1,
    "beta2": lambda v: 0 <= v < 1,
    "eps": lambda v: v >= 0,
}


def _check_hyper(name: str, value: float, where: str) -> None:
    # names fzero knows are range-checked as torch.optim checks them; others only for NaN
    ok = _VALID.get(name, lambda v: True)(value) and value == value
    if not ok:
        raise ValueError(f"{where}: invalid {name} {value}")


def _defaults(where: str, **values: float) -> tuple[tuple[str, float], ...]:
    for k, v in values.items():
        _check_hyper(k, float(v), where)
    return tuple((k, float(v)) for k, v in values.items())


@dataclasses.dataclass(frozen=True)
class SGD(Optimizer):
    """``torch.optim.SGD`` (see :func:`sgd`). ``momentum_buffer``: whether a buffer exists
    (``momentum != 0`` at construction); static, since it decides which tensors exist."""

    nesterov: bool = False
    maximize: bool = False
    momentum_buffer: bool = False
    step_scalar_names: ClassVar[tuple[str, ...]] = ("first",)

    @property
    def name(self) -> str:
        return "sgd"

    @property
    def moment_names(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("momentum_buffer",) if self.momentum_buffer else ()

    @property
    def amsgrad(self) -> bool:
        return False

    def manifest(self) -> dict[str, Any]:
        # the manifest of fzero's first checkpoints, so that they keep loading
        return {"kind": "sgd", "nesterov": self.nesterov, "maximize": self.maximize, "amsgrad": False,
                "momentum_buffer": self.momentum_buffer}

    def step_scalars(self, hyper: Mapping[str, torch.Tensor], steps: torch.Tensor) -> torch.Tensor:
        """``first``: 1.0 where the momentum buffer starts as the gradient (own step 0)."""
        return (steps == 0).to(torch.float64).unsqueeze(1)

    def update(self, param, grad, moments, hyper, step, per_element=None):  # noqa: ANN001, ANN201
        """The written-out ``torch.optim.SGD`` single-tensor rule (see :meth:`Optimizer.update`)."""
        return _sgd_update(self, param, grad, moments, hyper, step, per_element)

    def torch_class(self) -> Optional[type]:
        return torch.optim.SGD

    def torch_kwargs(self, hyper: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        h = {k: float(v) for k, v in hyper.items()}
        return dict(lr=h["lr"], momentum=h["momentum"], dampening=h["dampening"],
                    weight_decay=h["weight_decay"], nesterov=self.nesterov, maximize=self.maximize)

    def torch_state(self, own_step, moments, scalars, shape, dtype):  # noqa: ANN001, ANN201
        return dict(moments) if own_step > 0 else {}

    def from_torch_state(self, state):  # noqa: ANN001, ANN201
        # SGD keeps no step: 1 once it has a momentum buffer, which exists from the first step
        buf = state.get("momentum_buffer")
        return int(buf is not None), ({} if buf is None else {"momentum_buffer": buf}), {}

    def hyper_from_torch_group(self, group: Mapping[str, Any]) -> dict[str, float]:
        if "momentum" not in group or "betas" in group:
            other = "adam or adamw" if "betas" in group else "another optimizer"
            raise ValueError(f"belongs to {other} (no 'momentum'), this state's optimizer is sgd")
        if (float(group["momentum"]) != 0) != self.momentum_buffer:
            raise ValueError(f"has momentum {group['momentum']} but this state's SGD "
                             f"{'has' if self.momentum_buffer else 'has no'} momentum buffer")
        _same_flags(group, {"maximize": self.maximize, "nesterov": self.nesterov})
        return {k: float(group[k]) for k, _ in self.defaults if k in group}


@dataclasses.dataclass(frozen=True)
class Adam(Optimizer):
    """``torch.optim.Adam`` or, ``decoupled``, ``torch.optim.AdamW`` (see :func:`adam`)."""

    decoupled: bool = False
    maximize: bool = False
    amsgrad: bool = False
    step_scalar_names: ClassVar[tuple[str, ...]] = ("neg_step_size", "bias_correction2_sqrt")

    @property
    def name(self) -> str:
        return "adamw" if self.decoupled else "adam"

    @property
    def moment_names(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if self.amsgrad else ())

    @property
    def nesterov(self) -> bool:
        return False

    @property
    def momentum_buffer(self) -> bool:
        return False

    def manifest(self) -> dict[str, Any]:
        # the manifest of fzero's first checkpoints, so that they keep loading
        return {"kind": self.name, "nesterov": False, "maximize": self.maximize, "amsgrad": self.amsgrad,
                "momentum_buffer": False}

    def step_scalars(self, hyper: Mapping[str, torch.Tensor], steps: torch.Tensor) -> torch.Tensor:
        """``-lr / (1 - beta1^t)`` and ``sqrt(1 - beta2^t)``, ``t = steps + 1``."""
        t = (steps + 1).to(torch.float64)
        lr, beta1, beta2 = (hyper[k].to(torch.float64) for k in ("lr", "beta1", "beta2"))
        return torch.stack([-(lr / (1 - beta1**t)), torch.sqrt(1 - beta2**t)], dim=1)

    def update(self, param, grad, moments, hyper, step, per_element=None):  # noqa: ANN001, ANN201
        """The written-out ``torch.optim.Adam(W)`` single-tensor rule (see :meth:`Optimizer.update`)."""
        return _adam_update(self, param, grad, moments, hyper, step, per_element)

    def update_(self, param, grad, moments, hyper, step, found_inf=None) -> None:  # noqa: ANN001
        """:meth:`update` in place on ``param`` and ``moments``; a no-op where ``found_inf``: torch's
        fused kernel (``torch._fused_adam(w)_``), which reads the hyperparameters as Python floats
        from their CPU tensors (no device sync) and skips itself on ``found_inf``. (A compiled
        step writes the update out instead: inductor fuses the unscale and clip multiply into it;
        torch's kernel as an operator of the graph could not take it in, 3.6x slower,
        ``benchmarks/bench_optimizer.py --unscale``.)"""
        kernel = torch._fused_adamw_ if self.decoupled else torch._fused_adam_
        # One tensor per local rank: the kernel splits each tensor into vector-width blocks
        # and a scalar tail that can round differently, so a simulated rank must be its own
        # tensor, exactly as on a real rank, for the worlds to agree bitwise.
        rows = [list(t.unbind(0)) for t in (param, grad, *moments)]
        kernel(
            rows[0], rows[1], rows[2], rows[3], rows[4] if self.amsgrad else [],
            [(step + 1).to(torch.float32)] * len(rows[0]),
            lr=hyper["lr"].item(), beta1=hyper["beta1"].item(), beta2=hyper["beta2"].item(),
            weight_decay=hyper["weight_decay"].item(), eps=hyper["eps"].item(),
            amsgrad=self.amsgrad, maximize=self.maximize,
            # the kernel skips only where found_inf == 1.0; the contract is nonzero (2.0, NaN, inf)
            found_inf=None if found_inf is None else (found_inf != 0).to(param.device, torch.float32),
        )

    def torch_class(self) -> Optional[type]:
        return torch.optim.AdamW if self.decoupled else torch.optim.Adam

    def torch_kwargs(self, hyper: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        h = {k: float(v) for k, v in hyper.items()}
        return dict(lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"], weight_decay=h["weight_decay"],
                    amsgrad=self.amsgrad, maximize=self.maximize)

    def torch_state(self, own_step, moments, scalars, shape, dtype):  # noqa: ANN001, ANN201
        # torch's non-capturable default: a float32 0-d step; none before the first step
        return {"step": torch.tensor(float(own_step), dtype=torch.float32), **moments} if own_step > 0 else {}

    def from_torch_state(self, state):  # noqa: ANN001, ANN201
        step = int(float(state["step"])) if "step" in state else 0
        return step, {k: state[k] for k in self.moment_names if k in state}, {}

    def hyper_from_torch_group(self, group: Mapping[str, Any]) -> dict[str, float]:
        if "betas" not in group:
            raise ValueError(f"belongs to {'sgd' if 'momentum' in group else 'another optimizer'}, "
                             f"this state's optimizer is {self.name}")
        # torch >= 2.6 tells Adam from AdamW by this key; without it either reads the other's state
        if "decoupled_weight_decay" in group and bool(group["decoupled_weight_decay"]) != self.decoupled:
            kind = "adamw" if group["decoupled_weight_decay"] else "adam"
            raise ValueError(f"belongs to {kind}, this state's optimizer is {self.name}")
        _same_flags(group, {"maximize": self.maximize, "amsgrad": self.amsgrad})
        values = {**group, "beta1": group["betas"][0], "beta2": group["betas"][1]}
        return {k: float(values[k]) for k, _ in self.defaults if k in values}


def _same_flags(group: Mapping[str, Any], flags: Mapping[str, bool]) -> None:
    for flag, mine in flags.items():
        if bool(group.get(flag, False)) != mine:
            raise ValueError(f"has {flag} {group.get(flag)}, here {mine}")


def sgd(
    lr: float = 1e-3,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    *,
    nesterov: bool = False,
    maximize: bool = False,
    groups: Sequence[GroupSpec] = (),
) -> SGD:
    """``torch.optim.SGD``. A momentum buffer exists iff ``momentum != 0`` here."""
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("nesterov momentum requires a momentum and zero dampening")
    d = _defaults("sgd", lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay)
    return SGD(d, _groups(groups, [k for k, _ in d]), nesterov=nesterov, maximize=maximize,
               momentum_buffer=momentum != 0)


def adam(
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    amsgrad: bool = False,
    maximize: bool = False,
    groups: Sequence[GroupSpec] = (),
) -> Adam:
    """``torch.optim.Adam`` (L2 weight decay added to the gradient)."""
    d = _defaults("adam", lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay)
    return Adam(d, _groups(groups, [k for k, _ in d]), maximize=maximize, amsgrad=amsgrad)


def adamw(
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    *,
    amsgrad: bool = False,
    maximize: bool = False,
    groups: Sequence[GroupSpec] = (),
) -> Adam:
    """``torch.optim.AdamW`` (decoupled weight decay)."""
    d = _defaults("adamw", lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay)
    return Adam(d, _groups(groups, [k for k, _ in d]), decoupled=True, maximize=maximize, amsgrad=amsgrad)


@pytree_dataclass
class OptState:
    """Optimizer state of this process's shards.

    Leaves: ``step`` (0-d int64, updates applied); ``hyper`` (per optimizer
    group, ``{name: 0-d float64}``); ``moments`` (per flat group, one
    ``[R, shard_numel]`` tensor per :attr:`Optimizer.moment_names`); ``missed``
    (``()`` or ``[T]`` int64: per trainable parameter, the applied steps it sat out
    because it had no gradient on any rank, see :func:`fzero.make_train_step`'s ``unused``);
    ``scalars`` (one ``[T]`` float64 per :attr:`Optimizer.scalar_names`); ``vectors`` (one
    1-D tensor per :attr:`Optimizer.vector_names`, replicated, see :func:`vector_spans`).
    Static: the :class:`Optimizer`.
    """

    step: torch.Tensor
    hyper: tuple[dict[str, torch.Tensor], ...]
    moments: tuple[tuple[torch.Tensor, ...], ...]
    optimizer: Optimizer = static_field()
    # ``()`` or one ``[T]`` int64 tensor (T trainable parameters, ``Layout.trainable_slots``
    # order, replicated): the applied steps that left each parameter alone because no rank
    # had a gradient for it. Its own step count (torch.optim's per-parameter ``step``) is
    # ``step - missed``. ``()``: every parameter took every applied step.
    missed: tuple[torch.Tensor, ...] = ()
    # One ``[T]`` float64 CPU tensor per ``Optimizer.scalar_names`` (replicated): per-parameter
    # scalar state such as NAdam's ``mu_product``, as torch.optim keeps it per parameter, so a
    # parameter that sat out steps keeps its own. ``()`` for rules without any.
    scalars: tuple[torch.Tensor, ...] = ()
    # One 1-D tensor per ``Optimizer.vector_names`` (replicated, master dtype, with the shards):
    # each trainable parameter's vector (``Optimizer.vector_lengths`` of its shape) joined in
    # ``Layout.trainable_slots`` order (:func:`vector_spans`). ``()`` for rules without any.
    vectors: tuple[torch.Tensor, ...] = ()
    # Static: no parameter has sat out an applied step (``missed`` all zero), as the host last
    # read it: a compiled step takes the plain update on it (fzero.compiled sets it before each
    # call; eager steps read ``missed`` themselves). A change compiles the step once more.
    all_stepped: bool = static_field(default=True)


# CPU moments of at least this size start as pages the OS has not committed (below it, a mapping
# per tensor costs more than it saves).
ON_DEMAND_BYTES = 1 << 20


def zeros_on_demand(like: torch.Tensor) -> torch.Tensor:
    """Zeros shaped like ``like`` (contiguous); on the CPU, from ``ON_DEMAND_BYTES`` on, in a
    fresh anonymous mapping, which the OS zero-fills page by page on first write.

    So optimizer moments take no memory until the first step writes them, as
    ``torch.optim`` and DeepSpeed create theirs at the first step: the initial state
    of a model the size of one rank's memory fits beside the model being handed over
    (measured at 162M parameters: the init peak drops by the moments, 620 MiB). The
    mapping lives as long as the tensor's storage."""
    nbytes = like.numel() * like.element_size()
    if like.device.type != "cpu" or nbytes < ON_DEMAND_BYTES:
        return torch.zeros(like.shape, dtype=like.dtype, device=like.device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=like.dtype).view(like.shape)


def init_opt_state(optimizer: Optimizer, master: Sequence[torch.Tensor],
                   num_params: Optional[int] = None, shapes: Optional[Sequence[tuple[int, ...]]] = None) -> OptState:
    """Zero moments shaped like each master shard ``[R, shard_numel]``; hyperparameters as tensors;
    with ``num_params`` (T, the trainable parameters), the per-parameter scalars ``[T]`` (zeros:
    a parameter's scalar state is the rule's own from its first step; without ``num_params``
    :func:`fzero.shard_step` creates them at the first step); with ``shapes`` (the trainable
    parameters' shapes, ``Layout.trainable_slots`` order), the per-parameter vectors (zeros;
    without, the first step of a rule that has them creates them).

    Hyperparameters live on the CPU whatever the device of the shards: a 0-d
    CPU tensor combines with device tensors, and reading one (for torch's fused
    kernels) does not synchronise a device. The step count lives with the shards.
    """
    hyper = tuple(
        {k: torch.tensor(v, dtype=torch.float64) for k, v in optimizer.hyperparams(i).items()}
        for i in range(optimizer.num_groups)
    )
    moments = tuple(tuple(zeros_on_demand(m) for _ in optimizer.moment_names) for m in master)
    scalars = () if num_params is None else init_scalars(optimizer, num_params)
    vectors = () if shapes is None else init_vectors(optimizer, shapes, vector_dtype(master), master[0].device)
    return OptState(torch.zeros((), dtype=torch.int64, device=master[0].device), hyper, moments, optimizer,
                    scalars=scalars, vectors=vectors)


def vector_dtype(master: Sequence[torch.Tensor]) -> torch.dtype:
    """The dtype of ``OptState.vectors``: the master dtype (the widest, if flat groups differ)."""
    dtype = master[0].dtype if master else torch.float32
    for m in master[1:]:
        dtype = torch.promote_types(dtype, m.dtype)
    return dtype


def vector_spans(optimizer: Optimizer, shapes: Sequence[tuple[int, ...]]) -> tuple[list[tuple[int, int]], ...]:
    """Per :attr:`Optimizer.vector_names`, each trainable parameter's ``(begin, end)`` in the
    joined vector (``shapes``: ``Layout.trainable_slots`` order). Static. No collective."""
    out: tuple[list[tuple[int, int]], ...] = tuple([] for _ in optimizer.vector_names)
    ends = [0] * len(optimizer.vector_names)
    for shape in shapes:
        for j, n in enumerate(optimizer.vector_lengths(tuple(shape))):
            out[j].append((ends[j], ends[j] + n))
            ends[j] += n
    return out


def init_vectors(optimizer: Optimizer, shapes: Sequence[tuple[int, ...]], dtype: torch.dtype = torch.float32,
                 device: Optional[torch.device] = None) -> tuple[torch.Tensor, ...]:
    """``OptState.vectors`` before any step: one zero vector per :attr:`Optimizer.vector_names`,
    as long as the parameters' vectors joined (``()`` for a rule without vector state)."""
    spans = vector_spans(optimizer, shapes)
    return tuple(torch.zeros(s[-1][1] if s else 0, dtype=dtype, device=device) for s in spans)


def init_scalars(optimizer: Optimizer, num_params: int) -> tuple[torch.Tensor, ...]:
    """``OptState.scalars`` before any step: one ``[num_params]`` float64 CPU zero vector per
    :attr:`Optimizer.scalar_names` (CPU: the host reads them without a device sync)."""
    return tuple(torch.zeros(num_params, dtype=torch.float64) for _ in optimizer.scalar_names)


def set_hyperparams(
    state: OptState, group: Optional[int] = None, **values: Union[float, torch.Tensor]
) -> OptState:
    """A new state with hyperparameters replaced, in one group or (``group=None``) all.

    Values may be floats or 0-d tensors (e.g. a schedule's output inside a
    compiled step); nothing recompiles.
    """
    groups = range(len(state.hyper)) if group is None else [group]
    hyper = [dict(h) for h in state.hyper]
    for g in groups:
        if not 0 <= g < len(hyper):
            raise ValueError(f"set_hyperparams: no param group {g} (the optimizer has {len(hyper)})")
        for k, v in values.items():
            if k not in hyper[g]:
                raise ValueError(
                    f"set_hyperparams: {state.optimizer.name} has no hyperparameter {k!r}; "
                    f"expected one of {sorted(hyper[g])}"
                )
            old = hyper[g][k]
            hyper[g][k] = torch.as_tensor(v, dtype=old.dtype, device=old.device).reshape(())
    return replace(state, hyper=tuple(hyper))


def hyper_scalars(h: Mapping[str, torch.Tensor], dtype: torch.dtype, **extra: torch.Tensor) -> dict[str, torch.Tensor]:
    """Hyperparameters (and derived scalars, computed in float64) cast to the shard's dtype:
    ``{name: 0-d tensor of dtype}``, what an update rule multiplies its shards by.

    torch.optim passes Python floats, which kernels read in the tensor's own
    (opmath) dtype; casting here does the same, and keeps a compiled update
    in fp32 instead of promoting the whole elementwise kernel to float64.
    """
    items = {**h, **extra}
    # One small vector: under torch.compile it is computed once, before the elementwise
    # kernel, instead of being re-derived (pow, sqrt...) inside the kernel's loop.
    packed = torch.stack([v.reshape(()).to(torch.float64) for v in items.values()]).to(dtype)
    return {k: packed[i] for i, k in enumerate(items)}


_scalars = hyper_scalars


def _sgd_update(
    opt: Optimizer,
    p: torch.Tensor,
    g: torch.Tensor,
    moments: tuple[torch.Tensor, ...],
    h: Mapping[str, torch.Tensor],
    step: torch.Tensor,
    per_element: Optional[Mapping[str, torch.Tensor]] = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    c = _scalars(h, p.dtype, damp=1 - h["dampening"])
    if opt.maximize:
        g = -g
    g = g + c["weight_decay"] * p
    new_moments: tuple[torch.Tensor, ...] = ()
    if opt.momentum_buffer:
        (buf,) = moments
        first = step == 0 if per_element is None else per_element["first"] != 0
        # torch starts the buffer as a copy of the first gradient (no dampening).
        buf = torch.where(first, g, buf * c["momentum"] + c["damp"] * g)
        g = g + c["momentum"] * buf if opt.nesterov else buf
        new_moments = (buf,)
    return p + (-c["lr"]) * g, new_moments


def _adam_update(
    opt: Optimizer,
    p: torch.Tensor,
    g: torch.Tensor,
    moments: tuple[torch.Tensor, ...],
    h: Mapping[str, torch.Tensor],
    step: torch.Tensor,
    per_element: Optional[Mapping[str, torch.Tensor]] = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    if opt.maximize:
        g = -g
    t = step + 1
    lr, wd, beta1, beta2 = h["lr"], h["weight_decay"], h["beta1"], h["beta2"]
    # Scalars in float64, as torch computes them from Python floats, then in p's dtype.
    c = _scalars(
        h, p.dtype,
        decay=1 - lr * wd,
        one_minus_beta1=1 - beta1,
        one_minus_beta2=1 - beta2,
        neg_step_size=-(lr / (1 - beta1**t)),
        bias_correction2_sqrt=torch.sqrt(1 - beta2**t),
    )
    if per_element is not None:
        c = {**c, **per_element}
    if opt.decoupled:
        p = p * c["decay"]
    else:
        g = g + c["weight_decay"] * p
    exp_avg = torch.lerp(moments[0], g, c["one_minus_beta1"])
    exp_avg_sq = moments[1] * c["beta2"] + c["one_minus_beta2"] * g * g
    second = exp_avg_sq
    new_moments = (exp_avg, exp_avg_sq)
    if opt.amsgrad:
        second = torch.maximum(moments[2], exp_avg_sq)
        new_moments = new_moments + (second,)
    denom = second.sqrt() / c["bias_correction2_sqrt"] + c["eps"]
    return p + c["neg_step_size"] * (exp_avg / denom), new_moments
