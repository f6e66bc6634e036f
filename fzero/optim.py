"""Optimizers as static specs plus pure update rules on flat fp32 shards.

An :class:`Optimizer` is hashable static configuration (its kind, the flags
that change the computation graph, default hyperparameters and parameter
groups chosen by path predicate). :class:`OptState` holds what changes: the
moments of every flat group (``[R, shard_numel]``, master dtype), the step
count, and every hyperparameter of every group as a 0-d float64 tensor, so
changing a learning rate never recompiles a step.

The update rules follow ``torch.optim``'s single-tensor implementations
operation by operation (SGD with momentum/dampening/nesterov/weight decay/
maximize; Adam and AdamW with amsgrad/maximize), written out of place.

Imports: ``fzero.pytree``.
"""

from __future__ import annotations

import dataclasses
import mmap
from typing import Callable, Mapping, Optional, Sequence, Union

import torch

from .pytree import pytree_dataclass, replace, static_field

__all__ = [
    "ParamGroup",
    "Optimizer",
    "OptState",
    "sgd",
    "adam",
    "adamw",
    "init_opt_state",
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


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """Static description of an optimizer (see :func:`sgd`, :func:`adam`, :func:`adamw`).

    ``defaults``: ``(name, value)`` hyperparameters of group 0; ``groups``:
    further groups, the first matching predicate wins. Flags (``nesterov``,
    ``maximize``, ``amsgrad``, ``momentum_buffer``) are static because they
    change which tensors exist or which operations run.
    """

    kind: str
    defaults: tuple[tuple[str, float], ...]
    groups: tuple[ParamGroup, ...] = ()
    nesterov: bool = False
    maximize: bool = False
    amsgrad: bool = False
    momentum_buffer: bool = False

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

    @property
    def moment_names(self) -> tuple[str, ...]:
        if self.kind == "sgd":
            return ("momentum_buffer",) if self.momentum_buffer else ()
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if self.amsgrad else ())

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

        ``step``: 0-d int64, updates applied before this one. ``per_element``: the
        step-dependent scalars of :meth:`step_scalars`, each broadcastable to ``param``
        (0-d for one parameter's piece of a shard, which has its own step count), replacing
        those of ``step``.
        Returns new ``(param, moments)``; inputs are not modified. No collective.
        """
        if self.kind == "sgd":
            return _sgd_update(self, param, grad, moments, hyper, step, per_element)
        return _adam_update(self, param, grad, moments, hyper, step, per_element)

    @property
    def step_scalar_names(self) -> tuple[str, ...]:
        """What of an update depends on the step count (see :meth:`step_scalars`)."""
        return ("first",) if self.kind == "sgd" else ("neg_step_size", "bias_correction2_sqrt")

    def step_scalars(self, hyper: Mapping[str, torch.Tensor], steps: torch.Tensor) -> torch.Tensor:
        """``[k, len(step_scalar_names)]`` float64: for ``k`` parameters with step counts
        ``steps`` (``[k]`` int64, updates applied before this one) the scalars of their update
        that depend on the count, computed as :meth:`update` computes them for a 0-d step.
        SGD: ``first`` (1.0 where the momentum buffer starts as the gradient); Adam(W):
        ``-lr / (1 - beta1^t)`` and ``sqrt(1 - beta2^t)``, ``t = steps + 1``. No collective."""
        if self.kind == "sgd":
            return (steps == 0).to(torch.float64).unsqueeze(1)
        t = (steps + 1).to(torch.float64)
        lr, beta1, beta2 = (hyper[k].to(torch.float64) for k in ("lr", "beta1", "beta2"))
        return torch.stack([-(lr / (1 - beta1**t)), torch.sqrt(1 - beta2**t)], dim=1)

    def update_(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        moments: tuple[torch.Tensor, ...],
        hyper: Mapping[str, torch.Tensor],
        step: torch.Tensor,
        found_inf: Optional[torch.Tensor] = None,
    ) -> None:
        """:meth:`update` in place on ``param`` and ``moments``; a no-op where ``found_inf``.

        Eagerly, Adam and AdamW run torch's fused kernel (``torch._fused_adam(w)_``),
        which reads the hyperparameters as Python floats from their CPU tensors
        (no device sync) and skips the update itself when ``found_inf`` is nonzero.
        Under ``torch.compile`` (and for SGD) the update is written out and
        copied back through ``torch.where``, which inductor fuses into one
        read-modify-write pass, together with what produced the gradient (the
        unscale and clip multiply of a step). torch's kernel as an opaque operator
        in the graph measured the same on a bare 50M-element shard, but cannot
        take that multiply in, so the unscaled gradient is materialised: 3.6x
        slower (``benchmarks/bench_optimizer.py --unscale``).
        """
        if self.kind != "sgd" and not torch.compiler.is_compiling():
            kernel = torch._fused_adamw_ if self.kind == "adamw" else torch._fused_adam_
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
            return
        new_param, new_moments = self.update(param, grad, moments, hyper, step)
        skip = None if found_inf is None else found_inf.to(torch.bool)
        for old, new in zip((param, *moments), (new_param, *new_moments)):
            old.copy_(new if skip is None else torch.where(skip, old, new))


GroupSpec = Union[ParamGroup, tuple[Predicate, Mapping[str, float]]]


def _groups(groups: Sequence[GroupSpec], allowed: Sequence[str]) -> tuple[ParamGroup, ...]:
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
            _check_hyper(k, v, f"param group {i + 1}")
        out.append(g)
    return tuple(out)


def _check_hyper(name: str, value: float, where: str) -> None:
    ok = {
        "lr": value >= 0,
        "momentum": value >= 0,
        "dampening": True,
        "weight_decay": value >= 0,
        "beta1": 0 <= value < 1,
        "beta2": 0 <= value < 1,
        "eps": value >= 0,
    }[name]
    if not ok:
        raise ValueError(f"{where}: invalid {name} {value}")


def _defaults(where: str, **values: float) -> tuple[tuple[str, float], ...]:
    for k, v in values.items():
        _check_hyper(k, float(v), where)
    return tuple((k, float(v)) for k, v in values.items())


def sgd(
    lr: float = 1e-3,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    *,
    nesterov: bool = False,
    maximize: bool = False,
    groups: Sequence[GroupSpec] = (),
) -> Optimizer:
    """``torch.optim.SGD``. A momentum buffer exists iff ``momentum != 0`` here."""
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("nesterov momentum requires a momentum and zero dampening")
    d = _defaults("sgd", lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay)
    return Optimizer(
        "sgd", d, _groups(groups, [k for k, _ in d]),
        nesterov=nesterov, maximize=maximize, momentum_buffer=momentum != 0,
    )


def adam(
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    amsgrad: bool = False,
    maximize: bool = False,
    groups: Sequence[GroupSpec] = (),
) -> Optimizer:
    """``torch.optim.Adam`` (L2 weight decay added to the gradient)."""
    d = _defaults("adam", lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay)
    return Optimizer("adam", d, _groups(groups, [k for k, _ in d]), maximize=maximize, amsgrad=amsgrad)


def adamw(
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    *,
    amsgrad: bool = False,
    maximize: bool = False,
    groups: Sequence[GroupSpec] = (),
) -> Optimizer:
    """``torch.optim.AdamW`` (decoupled weight decay)."""
    d = _defaults("adamw", lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay)
    return Optimizer("adamw", d, _groups(groups, [k for k, _ in d]), maximize=maximize, amsgrad=amsgrad)


@pytree_dataclass
class OptState:
    """Optimizer state of this process's shards.

    Leaves: ``step`` (0-d int64, updates applied); ``hyper`` (per optimizer
    group, ``{name: 0-d float64}``); ``moments`` (per flat group, one
    ``[R, shard_numel]`` tensor per :attr:`Optimizer.moment_names`); ``missed``
    (``()`` or ``[T]`` int64: per trainable parameter, the applied steps it sat out
    because it had no gradient on any rank, see :func:`fzero.make_train_step`'s ``unused``).
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


def init_opt_state(optimizer: Optimizer, master: Sequence[torch.Tensor]) -> OptState:
    """Zero moments shaped like each master shard ``[R, shard_numel]``; hyperparameters as tensors.

    Hyperparameters live on the CPU whatever the device of the shards: a 0-d
    CPU tensor combines with device tensors, and reading one (for torch's fused
    kernels) does not synchronise a device. The step count lives with the shards.
    """
    hyper = tuple(
        {k: torch.tensor(v, dtype=torch.float64) for k, v in optimizer.hyperparams(i).items()}
        for i in range(optimizer.num_groups)
    )
    moments = tuple(tuple(zeros_on_demand(m) for _ in optimizer.moment_names) for m in master)
    return OptState(torch.zeros((), dtype=torch.int64, device=master[0].device), hyper, moments, optimizer)


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
                    f"set_hyperparams: {state.optimizer.kind} has no hyperparameter {k!r}; "
                    f"expected one of {sorted(hyper[g])}"
                )
            old = hyper[g][k]
            hyper[g][k] = torch.as_tensor(v, dtype=old.dtype, device=old.device).reshape(())
    return replace(state, hyper=tuple(hyper))


def _scalars(h: Mapping[str, torch.Tensor], dtype: torch.dtype, **extra: torch.Tensor) -> dict[str, torch.Tensor]:
    """Hyperparameters (and derived scalars, computed in float64) cast to the shard's dtype.

    torch.optim passes Python floats, which kernels read in the tensor's own
    (opmath) dtype; casting here does the same, and keeps a compiled update
    in fp32 instead of promoting the whole elementwise kernel to float64.
    """
    items = {**h, **extra}
    # One small vector: under torch.compile it is computed once, before the elementwise
    # kernel, instead of being re-derived (pow, sqrt...) inside the kernel's loop.
    packed = torch.stack([v.reshape(()).to(torch.float64) for v in items.values()]).to(dtype)
    return {k: packed[i] for i, k in enumerate(items)}


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
    if opt.kind == "adamw":
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
