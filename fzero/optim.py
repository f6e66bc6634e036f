"""The update-rule protocol on flat shards, and the built-in :class:`SGD` and :class:`Adam` (``torch.optim``'s). An
:class:`Optimizer` is hashable configuration plus a pure elementwise update of a flat shard (else a :class:`ShardRule`);
:class:`OptState` holds what changes, hyperparameters as 0-d float64 tensors (no recompiles).

Imports: pytree.
"""

from __future__ import annotations

import dataclasses
import functools
import mmap
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, NamedTuple

import torch

from .pytree import pytree_dataclass, replace, static_field

__all__ = ["ParamGroup", "Optimizer", "SGD", "Adam", "OptState", "Update", "ShardRule", "check_compilable",
           "hyper_scalars", "sgd", "adam", "adamw", "init_opt_state", "init_scalars", "init_vectors", "vector_dtype",
           "vector_spans", "set_hyperparams", "no_weight_decay", "no_weight_decay_for"]

Predicate = Callable[[str], bool]
_NORM_TYPES = (torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.LocalResponseNorm,
               torch.nn.modules.batchnorm._NormBase, torch.nn.RMSNorm)


@dataclasses.dataclass(frozen=True)
class ParamGroup:
    """Parameters whose dotted path satisfies ``match`` get ``overrides`` of the defaults."""

    match: Predicate
    overrides: tuple[tuple[str, float], ...]
    name: str = ""


def no_weight_decay(path: str) -> bool:
    """No-decay predicate by path: biases, parameters of modules named ``*norm*``, ``ln*``, ``bn*``."""
    leaf = path.rsplit(".", 1)[-1]
    parent = path.rsplit(".", 2)[-2].lower() if path.count(".") else ""
    return leaf == "bias" or "norm" in parent or parent.startswith(("ln", "bn"))


def no_weight_decay_for(module: torch.nn.Module) -> Predicate:
    """``module``'s no-decay predicate: biases, and parameters of norm modules (torch's, or ``*Norm*`` classes)."""
    names = set()
    for prefix, m in module.named_modules():
        is_norm = isinstance(m, _NORM_TYPES) or "norm" in type(m).__name__.lower()
        for name, _ in m.named_parameters(recurse=False):
            if is_norm or name == "bias":
                names.add(f"{prefix}.{name}" if prefix else name)
    return frozenset(names).__contains__


class Update(NamedTuple):
    """What :meth:`ShardRule.update_shards` updates in place: per flat group master, gradient, moments (``[R, n]``);
    per optimizer group ``hyper``; per trainable parameter its own step count, ``take``, scalars (per name)."""

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


def check_compilable(optimizer: Optimizer) -> None:
    """Raise ``ValueError`` naming the rule if it cannot run inside ``torch.compile``."""
    if not optimizer.elementwise:
        raise ValueError(f"optimizer {optimizer.name} cannot run in a compiled step: {optimizer.not_compilable}; "
                         "use compile=False")


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """An update rule, a frozen dataclass. ``defaults``: group 0's ``(name, value)`` hyperparameters; ``groups``:
    further groups, first match wins; other fields: static. Zeros in must give zeros out (the padding)."""

    defaults: tuple[tuple[str, float], ...]
    groups: tuple[ParamGroup, ...] = ()

    #: per-element state, one ``[R, shard_numel]`` tensor each, in the master dtype, zero at init
    moment_names: ClassVar[tuple[str, ...]] = ()
    #: per-parameter scalar state, one replicated ``[T]`` float64 vector each (``OptState.scalars``)
    scalar_names: ClassVar[tuple[str, ...]] = ()
    #: per-parameter vector state (``OptState.vectors``): per name, the parameters' :meth:`vector_lengths` joined
    vector_names: ClassVar[tuple[str, ...]] = ()
    #: what of an update depends on the step count (columns of :meth:`step_scalars`)
    step_scalar_names: ClassVar[tuple[str, ...]] = ()

    @property
    def elementwise(self) -> bool:
        """Whether the rule is an elementwise :meth:`update` (it runs in compiled steps)."""
        return not isinstance(self, ShardRule)

    @property
    def name(self) -> str:
        """A stable name (manifests, messages): the class name in lower case."""
        return type(self).__name__.lower()

    @property
    def kind(self) -> str:
        """:attr:`name` (the word earlier versions used)."""
        return self.name

    def config(self) -> tuple[tuple[str, Any], ...]:
        """The static configuration: every dataclass field but ``defaults`` and ``groups``."""
        return tuple((f.name, getattr(self, f.name)) for f in dataclasses.fields(self)
                     if f.name not in ("defaults", "groups"))

    @property
    def signature(self) -> str:
        """Name, configuration and state names: equal iff two ranks (or checkpoint and state) compute alike."""
        items = ",".join(f"{k}={v!r}" for k, v in self.config())
        vectors = f"|vectors={self.vector_names}" if self.vector_names else ""
        return f"{self.name}({items})|moments={self.moment_names}|scalars={self.scalar_names}{vectors}"

    def vector_lengths(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Per :attr:`vector_names`, the length of a parameter's vector from its shape (0: none)."""
        return (0,) * len(self.vector_names)

    def manifest(self) -> dict[str, Any]:
        """A checkpoint manifest's description: ``kind``, then the configuration (``repr`` unless JSON scalars)."""
        plain = (bool, int, float, str, type(None))
        return {"kind": self.name, **{k: v if isinstance(v, plain) else repr(v) for k, v in self.config()}}

    @property
    def num_groups(self) -> int:
        """The number of optimizer groups (the defaults' and :attr:`groups`)."""
        return 1 + len(self.groups)

    def group_of(self, path: str) -> int:
        """The optimizer group of the parameter at ``path``."""
        return next((i + 1 for i, g in enumerate(self.groups) if g.match(path)), 0)

    def group_name(self, index: int) -> str:
        """``"default"``, the group's name, or ``group{index}``."""
        return "default" if index == 0 else (self.groups[index - 1].name or f"group{index}")

    def hyperparams(self, index: int) -> dict[str, float]:
        """Group ``index``'s hyperparameters: the defaults with its overrides."""
        overrides = self.groups[index - 1].overrides if index else ()
        return {**dict(self.defaults), **dict(overrides)}

    def check_hyper(self, name: str, value: float, where: str) -> None:
        """Raise ``ValueError("{where}: invalid {name} {value}")`` for a value the rule refuses."""
        _check_hyper(name, value, where)

    @classmethod
    def configure(cls, *, groups: Sequence[GroupSpec] = (), **values: Any) -> Optimizer:
        """An instance: arguments naming fields are static, the rest default hyperparameters (see :func:`adamw`)."""
        fields = {f.name for f in dataclasses.fields(cls)} - {"defaults", "groups"}
        static = {k: v for k, v in values.items() if k in fields}
        hyper = tuple((k, float(v)) for k, v in values.items() if k not in fields)
        probe = cls(hyper, (), **static)
        for k, v in hyper:
            probe.check_hyper(k, v, probe.name)
        return cls(hyper, _groups(groups, [k for k, _ in hyper], probe), **static)

    def step_scalars(self, hyper: Mapping[str, torch.Tensor], steps: torch.Tensor) -> torch.Tensor:
        """``[k, len(step_scalar_names)]`` float64: the count-dependent scalars at counts ``steps`` (``[k]``)."""
        return torch.zeros(steps.shape[0], 0, dtype=torch.float64, device=steps.device)

    def step_values(self, hyper: Mapping[str, torch.Tensor], step: torch.Tensor,
                    per_element: Mapping[str, torch.Tensor] | None, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """``{name: tensor}`` in ``dtype``: ``per_element`` when given, else :meth:`step_scalars` of 0-d ``step``."""
        if per_element is not None:
            return {k: v.to(dtype) for k, v in per_element.items()}
        row = self.step_scalars(hyper, step.reshape(1))[0].to(dtype)
        return {k: row[j] for j, k in enumerate(self.step_scalar_names)}

    def update(self, param: torch.Tensor, grad: torch.Tensor, moments: tuple[torch.Tensor, ...],
               hyper: Mapping[str, torch.Tensor], step: torch.Tensor,
               per_element: Mapping[str, torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """New ``(param, moments)`` of a shard, inputs untouched. ``param``, ``grad``, moments: ``[R, n]``, one dtype;
        ``hyper``: ``{name: 0-d float64}``; ``step``: 0-d int64, updates applied before; ``per_element``:
        :meth:`step_scalars` broadcastable to ``param`` (own counts), replacing those of ``step``."""
        raise NotImplementedError(f"{type(self).__name__} does not define update()")

    def update_(self, param: torch.Tensor, grad: torch.Tensor, moments: tuple[torch.Tensor, ...],
                hyper: Mapping[str, torch.Tensor], step: torch.Tensor,
                found_inf: torch.Tensor | None = None) -> None:
        """:meth:`update` in place on ``param`` and ``moments``, a no-op where ``found_inf`` is nonzero."""
        new_param, new_moments = self.update(param, grad, moments, hyper, step)
        skip = None if found_inf is None else found_inf.to(torch.bool)
        for old, new in zip((param, *moments), (new_param, *new_moments)):
            old.copy_(new if skip is None else torch.where(skip, old, new))


class ShardRule(Optimizer):
    """A rule that is not elementwise (:func:`fzero.muon`...): :meth:`update_shards`, run eagerly."""

    #: why the rule cannot run in a compiled step (:func:`check_compilable`)
    not_compilable: ClassVar[str] = ("it updates each parameter's piece eagerly (torch.optim's own step on views "
                                     "of the shards)")

    def update_shards(self, u: Update, comm: Any) -> None:
        """One step in place on ``u`` for parameters in ``u.take`` at counts ``u.own``; every rank calls it."""
        raise NotImplementedError(f"{type(self).__name__} does not define update_shards()")


GroupSpec = ParamGroup | tuple[Predicate, Mapping[str, float]]


def _groups(groups: Sequence[GroupSpec], allowed: Sequence[str],
            rule: Optimizer | None = None) -> tuple[ParamGroup, ...]:
    out = []
    for i, g in enumerate(groups):
        if not isinstance(g, ParamGroup):
            match, overrides = g
            g = ParamGroup(match, tuple(sorted((k, float(v)) for k, v in dict(overrides).items())))
        for k, v in g.overrides:
            if k not in allowed:
                raise ValueError(f"param group {i + 1}: unknown hyperparameter {k!r}; "
                                 f"expected one of {sorted(allowed)}")
            (rule.check_hyper if rule is not None else _check_hyper)(k, v, f"param group {i + 1}")
        out.append(g)
    return tuple(out)


_VALID = {"lr": lambda v: v >= 0, "momentum": lambda v: v >= 0, "weight_decay": lambda v: v >= 0,
          "beta1": lambda v: 0 <= v < 1, "beta2": lambda v: 0 <= v < 1, "eps": lambda v: v >= 0}


def _check_hyper(name: str, value: float, where: str) -> None:
    # the names fzero knows are range-checked as torch.optim checks them; all for NaN
    if not (_VALID.get(name, lambda v: True)(value) and value == value):
        raise ValueError(f"{where}: invalid {name} {value}")


@dataclasses.dataclass(frozen=True)
class SGD(Optimizer):
    """``torch.optim.SGD`` (see :func:`sgd`). ``momentum_buffer``: whether a buffer exists."""

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

    def manifest(self) -> dict[str, Any]:  # fzero's first checkpoints' manifest, so that they keep loading
        return {"kind": "sgd", "nesterov": self.nesterov, "maximize": self.maximize, "amsgrad": False,
                "momentum_buffer": self.momentum_buffer}

    def step_scalars(self, hyper: Mapping[str, torch.Tensor], steps: torch.Tensor) -> torch.Tensor:
        """``first``: 1.0 where the momentum buffer starts as the gradient (own step 0)."""
        return (steps == 0).to(torch.float64).unsqueeze(1)

    def update(self, param, grad, moments, hyper, step, per_element=None):  # noqa: ANN001, ANN201
        """``torch.optim.SGD``'s single-tensor rule, written out (see :meth:`Optimizer.update`)."""
        c = hyper_scalars(hyper, param.dtype, damp=1 - hyper["dampening"])
        g = -grad if self.maximize else grad
        g = g + c["weight_decay"] * param
        new_moments: tuple[torch.Tensor, ...] = ()
        if self.momentum_buffer:
            first = step == 0 if per_element is None else per_element["first"] != 0
            buf = torch.where(first, g, moments[0] * c["momentum"] + c["damp"] * g)  # torch: no dampening at first
            g = g + c["momentum"] * buf if self.nesterov else buf
            new_moments = (buf,)
        return param + (-c["lr"]) * g, new_moments


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

    def manifest(self) -> dict[str, Any]:  # fzero's first checkpoints' manifest, so that they keep loading
        return {"kind": self.name, "nesterov": False, "maximize": self.maximize, "amsgrad": self.amsgrad,
                "momentum_buffer": False}

    def step_scalars(self, hyper: Mapping[str, torch.Tensor], steps: torch.Tensor) -> torch.Tensor:
        """``-lr / (1 - beta1^t)`` and ``sqrt(1 - beta2^t)``, ``t = steps + 1``."""
        t = (steps + 1).to(torch.float64)
        lr, beta1, beta2 = (hyper[k].to(torch.float64) for k in ("lr", "beta1", "beta2"))
        return torch.stack([-(lr / (1 - beta1**t)), torch.sqrt(1 - beta2**t)], dim=1)

    def update(self, param, grad, moments, hyper, step, per_element=None):  # noqa: ANN001, ANN201
        """``torch.optim.Adam(W)``'s single-tensor rule, written out (see :meth:`Optimizer.update`)."""
        g = -grad if self.maximize else grad
        t = step + 1
        lr, wd, beta1, beta2 = hyper["lr"], hyper["weight_decay"], hyper["beta1"], hyper["beta2"]
        c = hyper_scalars(hyper, param.dtype, decay=1 - lr * wd, one_minus_beta1=1 - beta1,
                          one_minus_beta2=1 - beta2, neg_step_size=-(lr / (1 - beta1**t)),
                          bias_correction2_sqrt=torch.sqrt(1 - beta2**t))
        if per_element is not None:
            c = {**c, **per_element}
        p = param * c["decay"] if self.decoupled else param
        if not self.decoupled:
            g = g + c["weight_decay"] * param
        exp_avg = torch.lerp(moments[0], g, c["one_minus_beta1"])
        exp_avg_sq = moments[1] * c["beta2"] + c["one_minus_beta2"] * g * g
        second, new_moments = exp_avg_sq, (exp_avg, exp_avg_sq)
        if self.amsgrad:
            second = torch.maximum(moments[2], exp_avg_sq)
            new_moments = new_moments + (second,)
        denom = second.sqrt() / c["bias_correction2_sqrt"] + c["eps"]
        return p + c["neg_step_size"] * (exp_avg / denom), new_moments

    def update_(self, param, grad, moments, hyper, step, found_inf=None) -> None:  # noqa: ANN001
        """:meth:`update` in place, a no-op where ``found_inf`` is nonzero: ``fzero::fused_adam_`` (traced too)."""
        # one tensor per row, as on a real rank: the kernel's vector blocks and scalar tail round differently
        if any(hyper[k].device.type != "cpu" for k in _FUSED_HYPER[1:]):
            # the kernel takes these as host numbers: one on the device (a schedule's) would be read back each step
            return super().update_(param, grad, moments, hyper, step, found_inf)
        rows = [list(t.unbind(0)) for t in (param, grad, *moments)]
        skip = None if found_inf is None else (found_inf != 0).to(param.device, torch.float32)
        torch.ops.fzero.fused_adam_(rows[0], rows[1], rows[2], rows[3], rows[4] if self.amsgrad else [],
                                    hyper["lr"].to(torch.float64),
                                    torch.stack([hyper[k].to(torch.float64) for k in _FUSED_HYPER[1:]]),
                                    (step + 1).to(torch.float32), skip, self.decoupled, self.amsgrad, self.maximize)


_FUSED_HYPER = ("lr", "beta1", "beta2", "weight_decay", "eps")
# registered plainly: torch.library.custom_op's eager call imports the compiler stack (+75 MiB resident per rank)
_LIB = torch.library.Library("fzero", "FRAGMENT")
_LIB.define("fused_adam_(Tensor(a!)[] p, Tensor[] g, Tensor(b!)[] m, Tensor(c!)[] v, Tensor(d!)[] vmax, Tensor lr, "
            "Tensor hyper, Tensor step, Tensor? skip, bool decoupled, bool amsgrad, bool maximize) -> ()")


def _fused_adam(p, g, m, v, vmax, lr, hyper, step, skip, decoupled, amsgrad, maximize) -> None:  # noqa: ANN001
    """``fzero::fused_adam_``: torch's fused Adam(W), skipped where ``skip`` is 1. ``lr``: 0-d, on the host (read as a
    number) or on the device (a schedule's: the kernel reads it there, no copy back); ``hyper``: the rest of
    ``_FUSED_HYPER``, on the host."""
    beta1, beta2, weight_decay, eps = hyper.tolist()
    rate = float(lr) if lr.device.type == "cpu" else lr
    (torch._fused_adamw_ if decoupled else torch._fused_adam_)(
        p, g, m, v, vmax, [step] * len(p), lr=rate, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
        amsgrad=amsgrad, maximize=maximize, found_inf=skip)


_LIB.impl("fused_adam_", _fused_adam, "CompositeExplicitAutograd")
_LIB.impl("fused_adam_", lambda *args: None, "Meta")


def sgd(lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0, *,
        nesterov: bool = False, maximize: bool = False, groups: Sequence[GroupSpec] = ()) -> SGD:
    """``torch.optim.SGD``. A momentum buffer exists iff ``momentum != 0`` here."""
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("nesterov momentum requires a momentum and zero dampening")
    return SGD.configure(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, groups=groups,
                         nesterov=nesterov, maximize=maximize, momentum_buffer=momentum != 0)


def adam(lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
         *, amsgrad: bool = False, maximize: bool = False, groups: Sequence[GroupSpec] = ()) -> Adam:
    """``torch.optim.Adam`` (L2 weight decay added to the gradient)."""
    return Adam.configure(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay, groups=groups,
                          maximize=maximize, amsgrad=amsgrad)


def adamw(lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
          *, amsgrad: bool = False, maximize: bool = False, groups: Sequence[GroupSpec] = ()) -> Adam:
    """``torch.optim.AdamW``. ``groups``: :class:`ParamGroup`\\ s or ``(predicate, {name: value})`` overrides."""
    return Adam.configure(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay, groups=groups,
                          decoupled=True, maximize=maximize, amsgrad=amsgrad)


@pytree_dataclass
class OptState:
    """State of this process's shards: ``step`` (0-d int64); ``hyper`` (per group, 0-d float64 on CPU); ``moments``;
    ``missed`` (``()`` or ``[T]`` int64: steps each parameter sat out); ``scalars`` (``[T]`` float64); ``vectors``.
    Static: the optimizer; ``all_stepped`` (``missed`` all zero)."""

    step: torch.Tensor
    hyper: tuple[dict[str, torch.Tensor], ...]
    moments: tuple[tuple[torch.Tensor, ...], ...]
    optimizer: Optimizer = static_field()
    missed: tuple[torch.Tensor, ...] = ()
    scalars: tuple[torch.Tensor, ...] = ()
    vectors: tuple[torch.Tensor, ...] = ()
    all_stepped: bool = static_field(default=True)


ON_DEMAND_BYTES = 1 << 20


def zeros_on_demand(like: torch.Tensor) -> torch.Tensor:
    """Zeros like ``like``; on the CPU from ``ON_DEMAND_BYTES``, an anonymous mapping (no memory until written)."""
    nbytes = like.numel() * like.element_size()
    if like.device.type != "cpu" or nbytes < ON_DEMAND_BYTES:
        return torch.zeros(like.shape, dtype=like.dtype, device=like.device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=like.dtype).view(like.shape)


def init_opt_state(optimizer: Optimizer, master: Sequence[torch.Tensor],
                   num_params: int | None = None, shapes: Sequence[tuple[int, ...]] | None = None) -> OptState:
    """The state before any step; scalars with ``num_params``, vectors with (trainable) ``shapes``, else later."""
    hyper = tuple({k: torch.tensor(v, dtype=torch.float64, device="cpu") for k, v in optimizer.hyperparams(i).items()}
                  for i in range(optimizer.num_groups))
    moments = tuple(tuple(zeros_on_demand(m) for _ in optimizer.moment_names) for m in master)
    scalars = () if num_params is None else init_scalars(optimizer, num_params)
    vectors = () if shapes is None else init_vectors(optimizer, shapes, vector_dtype(master), master[0].device)
    return OptState(torch.zeros((), dtype=torch.int64, device=master[0].device), hyper, moments, optimizer,
                    scalars=scalars, vectors=vectors)


def vector_dtype(master: Sequence[torch.Tensor]) -> torch.dtype:
    """The dtype of ``OptState.vectors``: the master dtype (the widest, if flat groups differ)."""
    return functools.reduce(torch.promote_types, [m.dtype for m in master]) if master else torch.float32


def vector_spans(optimizer: Optimizer, shapes: Sequence[tuple[int, ...]]) -> tuple[list[tuple[int, int]], ...]:
    """Per vector name, each parameter's ``(begin, end)`` in the joined vector (``shapes``: trainable slot order)."""
    out: tuple[list[tuple[int, int]], ...] = tuple([] for _ in optimizer.vector_names)
    ends = [0] * len(optimizer.vector_names)
    for shape in shapes:
        for j, n in enumerate(optimizer.vector_lengths(tuple(shape))):
            out[j].append((ends[j], ends[j] + n))
            ends[j] += n
    return out


def init_vectors(optimizer: Optimizer, shapes: Sequence[tuple[int, ...]], dtype: torch.dtype = torch.float32,
                 device: torch.device | None = None) -> tuple[torch.Tensor, ...]:
    """``OptState.vectors`` before any step: one zero vector per :attr:`Optimizer.vector_names`."""
    return tuple(torch.zeros(s[-1][1] if s else 0, dtype=dtype, device=device) for s in vector_spans(optimizer, shapes))


def init_scalars(optimizer: Optimizer, num_params: int) -> tuple[torch.Tensor, ...]:
    """``OptState.scalars`` before any step: a ``[num_params]`` float64 CPU zero vector per scalar name."""
    return tuple(torch.zeros(num_params, dtype=torch.float64, device="cpu") for _ in optimizer.scalar_names)


def set_hyperparams(state: OptState, group: int | None = None, **values: float | torch.Tensor) -> OptState:
    """A new state with hyperparameters (floats or 0-d tensors) replaced in one group or (``None``) all."""
    groups = range(len(state.hyper)) if group is None else [group]
    hyper = [dict(h) for h in state.hyper]
    for g in groups:
        if not 0 <= g < len(hyper):
            raise ValueError(f"set_hyperparams: no param group {g} (the optimizer has {len(hyper)})")
        for k, v in values.items():
            if k not in hyper[g]:
                raise ValueError(f"set_hyperparams: {state.optimizer.name} has no hyperparameter {k!r}; "
                                 f"expected one of {sorted(hyper[g])}")
            old = hyper[g][k]
            hyper[g][k] = torch.as_tensor(v, dtype=old.dtype, device=old.device).reshape(())
    return replace(state, hyper=tuple(hyper))


def hyper_scalars(h: Mapping[str, torch.Tensor], dtype: torch.dtype, **extra: torch.Tensor) -> dict[str, torch.Tensor]:
    """Hyperparameters and ``extra`` (computed in float64) as 0-d tensors of ``dtype``, as torch.optim's kernels, each
    on the device it was given on."""
    items = {**h, **extra}
    # one small vector per device: under torch.compile computed once, not inside the elementwise kernel's loop. The
    # hyperparameters are host scalars and what depends on the step count is on the state's device: never copied
    # across (a copy to the device waits for it), each taken by the elementwise kernels as it is
    by_device: dict[torch.device, list[str]] = {}
    for k, v in items.items():
        by_device.setdefault(v.device, []).append(k)
    out: dict[str, torch.Tensor] = {}
    for keys in by_device.values():
        packed = torch.stack([items[k].reshape(()).to(torch.float64) for k in keys]).to(dtype)
        out.update({k: packed.select(0, i) for i, k in enumerate(keys)})
    return {k: out[k] for k in items}
