"""Dynamic loss scaling as pure functions on an immutable :class:`ScalerState`.

The rule is ``torch.amp.GradScaler``'s (CPU kernel ``_amp_update_scale_``),
bit for bit, extended with two options users of DeepSpeed know: a floor
(``min_scale``) and hysteresis (tolerate ``hysteresis - 1`` overflows before
backing off). Every value that changes between steps is a 0-d tensor, so a
compiled step never recompiles and never syncs with the host.

:func:`scale` multiplies the loss (or any tree) by the scale; :func:`unscale_and_check` divides
the gradients by it and agrees across ranks on whether to skip the step (in the step's form,
one ``all_reduce(sum)`` agrees on the global norm, the overflow flag, the mean loss and what
else rides along, then one pass unscales and clips); :func:`update_scale` is the scale's rule.

Imports: ``fzero.pytree``, ``fzero.comm`` (protocol only), ``fzero.layout`` (input checks).
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import torch
import torch.utils._pytree as tp

from .comm import Communicator
from .layout import check_floating_tensor
from .pytree import pytree_dataclass, replace, static_field

__all__ = [
    "ScalerState",
    "init_scaler",
    "static_scaler",
    "scale",
    "unscale_and_check",
    "Checked",
    "local_sq_norm",
    "update_scale",
]


@pytree_dataclass
class ScalerState:
    """Loss-scale state.

    Leaves (0-d tensors, identical on every rank):
      * ``scale``: float32, the current loss scale.
      * ``growth_tracker``: int32, consecutive clean steps since the last
        growth or overflow (``GradScaler._growth_tracker``).
      * ``hysteresis_left``: int32, overflows still tolerated before backing
        off (always 1 when hysteresis is off).

    Static metadata: the update rule's configuration. ``dynamic=False`` is the
    static mode (bf16/fp32 training, or a fixed fp16 scale): the scale never
    changes, but non-finite gradients are still detected and the step skipped.
    """

    scale: torch.Tensor
    growth_tracker: torch.Tensor
    hysteresis_left: torch.Tensor
    growth_factor: float = static_field(default=2.0)
    backoff_factor: float = static_field(default=0.5)
    growth_interval: int = static_field(default=2000)
    min_scale: Optional[float] = static_field(default=None)
    hysteresis: Optional[int] = static_field(default=None)
    dynamic: bool = static_field(default=True)


def init_scaler(
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    *,
    min_scale: Optional[float] = None,
    hysteresis: Optional[int] = None,
    device: torch.device | str | None = None,
) -> ScalerState:
    """A dynamic scaler with ``torch.amp.GradScaler``'s defaults.

    ``min_scale``: the scale never backs off below it. ``hysteresis``: back
    off only on the ``hysteresis``-th overflow since the last growth (DeepSpeed's
    ``delayed_shift``); ``None`` is torch's rule (back off on every overflow).
    """
    if not init_scale > 0:
        raise ValueError(f"init_scale must be positive, got {init_scale}")
    if not growth_factor > 1.0:
        raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
    if not 0.0 < backoff_factor < 1.0:
        raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
    if not (isinstance(growth_interval, int) and growth_interval > 0):
        raise ValueError(f"growth_interval must be a positive int, got {growth_interval!r}")
    if min_scale is not None and not 0 < min_scale <= init_scale:
        raise ValueError(f"min_scale must be in (0, init_scale], got {min_scale}")
    if hysteresis is not None and not (isinstance(hysteresis, int) and hysteresis >= 1):
        raise ValueError(f"hysteresis must be an int >= 1 or None, got {hysteresis!r}")
    return ScalerState(
        scale=torch.tensor(init_scale, dtype=torch.float32, device=device),
        growth_tracker=torch.tensor(0, dtype=torch.int32, device=device),
        hysteresis_left=torch.tensor(hysteresis or 1, dtype=torch.int32, device=device),
        growth_factor=float(growth_factor),
        backoff_factor=float(backoff_factor),
        growth_interval=growth_interval,
        min_scale=None if min_scale is None else float(min_scale),
        hysteresis=hysteresis,
        dynamic=True,
    )


def static_scaler(value: float = 1.0, *, device: torch.device | str | None = None) -> ScalerState:
    """A scaler whose scale never changes (1.0: no scaling, for bf16/fp32)."""
    if not value > 0:
        raise ValueError(f"static scale must be positive, got {value}")
    return ScalerState(
        scale=torch.tensor(value, dtype=torch.float32, device=device),
        growth_tracker=torch.tensor(0, dtype=torch.int32, device=device),
        hysteresis_left=torch.tensor(1, dtype=torch.int32, device=device),
        dynamic=False,
    )


def _opmath(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def scale(scaler: ScalerState, tree: Any) -> Any:
    """Multiply every tensor of ``tree`` (a tensor or nested list/tuple/dict) by the scale.

    Each output keeps its input's dtype and the tree's structure. No collective.
    """
    def one(path: Any, x: Any) -> torch.Tensor:
        x = check_floating_tensor(f"scale: output{tp.keystr(path)}", x)
        return (x * scaler.scale.to(x.device)).to(x.dtype)

    return tp.tree_map_with_path(one, tree)


def local_sq_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-rank sum of squares of ``[R, ...]`` gradients: ``[R]`` float64. No collective. Each
    norm is taken in the gradient's dtype (no float64 copy) and squared in float64: a non-finite
    value, or an fp32 norm that overflows (as ``clip_grad_norm_`` finds), gives a non-finite sum."""
    return sum(torch.linalg.vector_norm(g.reshape(g.shape[0], -1), dim=1).double().square() for g in grads)


class Checked(tuple):
    """What :func:`unscale_and_check` gives: it unpacks as ``(grads, found_inf)`` (the unscaled
    gradients, and a 0-d fp32 1.0 if any rank's gradient is not finite), and carries what the
    step's agreement adds: ``grad_norm`` (0-d float64, unscaled, before clipping), ``loss``
    (0-d fp32, the mean of every rank's loss), ``used`` (``[T]`` bool, some rank had a gradient)
    and ``riders`` (``[k]`` float64, summed over ranks); None where not asked for."""

    grad_norm: Optional[torch.Tensor]
    loss: Optional[torch.Tensor]
    used: Optional[torch.Tensor]
    riders: Optional[torch.Tensor]

    def __new__(cls, grads: Any, found_inf: torch.Tensor, grad_norm: Optional[torch.Tensor] = None,
                loss: Optional[torch.Tensor] = None, used: Optional[torch.Tensor] = None,
                riders: Optional[torch.Tensor] = None) -> "Checked":
        out = super().__new__(cls, (grads, found_inf))
        out.grad_norm, out.loss, out.used, out.riders = grad_norm, loss, used, riders
        return out

    @property
    def grads(self) -> Any:
        return self[0]

    @property
    def found_inf(self) -> torch.Tensor:
        return self[1]


def unscale_and_check(scaler: ScalerState, grads: Any, comm: Communicator, *, clip_norm: Optional[float] = None,
                      losses: Optional[torch.Tensor] = None, used: Optional[torch.Tensor] = None,
                      riders: Optional[torch.Tensor] = None, in_place: bool = False) -> Checked:
    """Unscale gradients and agree across ranks on whether the step must be skipped.

    ``grads``: a tree of floating tensors, each with the local-rank axis ``[R, ...]``. Each is
    multiplied by ``1/scale`` (float64 reciprocal rounded to float32, as ``torch.amp`` does) in
    float32 (float64 for fp64 gradients) and rounded back to its dtype.

    Alone, it is ``torch.amp.GradScaler``'s check: ``found_inf`` from a per-element check, agreed
    by one ``all_reduce(max)`` of ``R`` flags. The step's form (any of ``clip_norm``, ``losses``
    ``[R]``, ``used`` ``[R, T]``, ``riders`` ``[R, k]`` given; ``grads`` are this rank's disjoint
    gradient shards): one ``all_reduce(sum)`` of ``[R, 2 + T + k]`` float64 values, each rank's
    sum of squares of its shards (:func:`local_sq_norm`), its loss, its used flags and riders
    (the replica digest) at no collective of their own; ``found_inf`` when the agreed norm is
    not finite, which is exactly when some rank's shard is (or a shard's norm is beyond fp32's
    range, as ``clip_grad_norm_`` says too). Then one pass multiplies by ``1/scale`` times
    ``clip_grad_norm_``'s ``min(1, clip_norm / (norm + 1e-6))`` of the unscaled norm
    (DeepSpeed's fused form). ``in_place``: the caller owns the gradients; eagerly they are
    scaled in place (traced, out of place: inductor fuses it)."""
    leaves_with_path, spec = tp.tree_flatten_with_path(grads)
    if not leaves_with_path:
        raise ValueError("unscale_and_check: the gradient tree has no tensors")
    for path, g in leaves_with_path:
        g = check_floating_tensor(f"unscale_and_check: grads{tp.keystr(path)}", g)
        if g.dim() == 0 or g.shape[0] != comm.local_ranks:
            raise ValueError(f"unscale_and_check: grads{tp.keystr(path)} has shape {tuple(g.shape)}; "
                             f"expected a leading local-rank axis of size {comm.local_ranks}")
    leaves = [g for _, g in leaves_with_path]
    if clip_norm is None and losses is None and used is None and riders is None:
        inv = scaler.scale.double().reciprocal().float()
        bad = [(~torch.isfinite(g)).reshape(g.shape[0], -1).any(dim=1) for g in leaves]
        found = comm.all_reduce(functools.reduce(torch.logical_or, bad).to(torch.float32), "max")[0]
        out = [(g.to(_opmath(g.dtype)) * inv.to(device=g.device, dtype=_opmath(g.dtype))).to(g.dtype) for g in leaves]
        return Checked(tp.tree_unflatten(out, spec), found)
    local = [local_sq_norm(leaves).unsqueeze(1),
             (losses if losses is not None else torch.zeros(comm.local_ranks)).double().unsqueeze(1)]
    n_used = 0 if used is None else used.shape[1]
    local += [] if used is None else [used.to(local[0].device, torch.float64)]
    local += [] if riders is None else [riders.to(local[0].device, torch.float64)]
    sums = comm.all_reduce(torch.cat(local, dim=1), "sum")[0]
    scale64 = scaler.scale.double()
    norm64 = sums[0].sqrt() / scale64
    factor = scale64.reciprocal().float().double()
    if clip_norm is not None:
        factor = factor * torch.clamp(clip_norm / (norm64 + 1e-6), max=1.0)
    if in_place and not comm.traced:
        out = [g.mul_(factor.to(g.dtype)) for g in leaves]
    else:
        out = [g * factor.to(g.dtype) for g in leaves]
    return Checked(tp.tree_unflatten(out, spec), (~torch.isfinite(norm64)).float(), norm64,
                   (sums[1] / comm.world_size).float(), None if used is None else sums[2:2 + n_used] > 0,
                   None if riders is None else sums[2 + n_used:])


def update_scale(scaler: ScalerState, found_inf: torch.Tensor) -> ScalerState:
    """The next scaler state after a step with ``found_inf`` (0-d, agreed across ranks).

    Without hysteresis and floor this is ``torch.amp.GradScaler.update``:
    on overflow ``scale *= backoff_factor`` and the tracker resets; otherwise
    the tracker counts up and, on reaching ``growth_interval``, the scale is
    multiplied by ``growth_factor`` (kept only if finite) and the tracker
    resets. Products are taken in float64 and rounded to float32, as the CPU
    kernel does. Then the scale is floored at ``min_scale``. With hysteresis
    ``h``, an overflow first spends one of ``h - 1`` tolerated overflows
    (the scale holds) and backs off only when none is left; growth refills them.
    Branch-free (``torch.where``); no host sync; no collective.
    """
    if not scaler.dynamic:
        return scaler
    found = found_inf.to(torch.bool)
    s64 = scaler.scale.double()
    successful = scaler.growth_tracker + 1
    grows = (~found) & (successful == scaler.growth_interval)
    grown = (s64 * scaler.growth_factor).float()
    grown = torch.where(torch.isfinite(grown), grown, scaler.scale)

    if scaler.hysteresis is None:
        backs_off = found
        hysteresis_left = scaler.hysteresis_left
    else:
        backs_off = found & (scaler.hysteresis_left <= 1)
        hysteresis_left = torch.where(
            grows,
            torch.full_like(scaler.hysteresis_left, scaler.hysteresis),
            torch.where(found & ~backs_off, scaler.hysteresis_left - 1, scaler.hysteresis_left),
        )
    backed_off = (s64 * scaler.backoff_factor).float()
    if scaler.min_scale is not None:
        backed_off = torch.clamp(backed_off, min=scaler.min_scale)

    new_scale = torch.where(backs_off, backed_off, torch.where(grows, grown, scaler.scale))
    new_tracker = torch.where(found | grows, torch.zeros_like(successful), successful)
    return replace(
        scaler,
        scale=new_scale,
        growth_tracker=new_tracker.to(torch.int32),
        hysteresis_left=hysteresis_left.to(torch.int32),
    )
