"""Dynamic loss scaling as pure functions on an immutable :class:`ScalerState`: ``torch.amp.GradScaler``'s rule (CPU
kernel ``_amp_update_scale_``) bit for bit, plus DeepSpeed's floor (``min_scale``) and hysteresis. What changes between
steps is a 0-d tensor: a compiled step never recompiles nor syncs with the host.

Imports: comm, layout, pytree.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as tp

from .comm import Communicator
from .layout import check_floating_tensor
from .pytree import pytree_dataclass, replace, static_field

__all__ = ["ScalerState", "init_scaler", "static_scaler", "scale", "unscale_and_check", "Checked", "local_sq_norm",
           "update_scale"]


@pytree_dataclass
class ScalerState:
    """Leaves (0-d, alike on all ranks): ``scale`` (float32), ``growth_tracker`` (int32, clean steps since growth or
    overflow), ``hysteresis_left`` (int32, overflows still tolerated; 1 without hysteresis). Static: the configuration;
    ``dynamic=False``: a fixed scale (bf16/fp32, fixed fp16), yet non-finite gradients skip the step."""

    scale: torch.Tensor
    growth_tracker: torch.Tensor
    hysteresis_left: torch.Tensor
    growth_factor: float = static_field(default=2.0)
    backoff_factor: float = static_field(default=0.5)
    growth_interval: int = static_field(default=2000)
    min_scale: float | None = static_field(default=None)
    hysteresis: int | None = static_field(default=None)
    dynamic: bool = static_field(default=True)


def init_scaler(init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                growth_interval: int = 2000, *, min_scale: float | None = None, hysteresis: int | None = None,
                device: torch.device | str | None = None) -> ScalerState:
    """A dynamic scaler (``GradScaler``'s defaults); ``min_scale``: floor; ``hysteresis``: back off at the
    ``hysteresis``-th overflow since growth (DeepSpeed's ``delayed_shift``; ``None``: each). Bad settings:
    ``ValueError``."""
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
    return _state(init_scale, hysteresis or 1, device, growth_factor=float(growth_factor),
                  backoff_factor=float(backoff_factor), growth_interval=growth_interval,
                  min_scale=None if min_scale is None else float(min_scale), hysteresis=hysteresis, dynamic=True)


def static_scaler(value: float = 1.0, *, device: torch.device | str | None = None) -> ScalerState:
    """A scaler whose scale never changes (1.0: no scaling, for bf16/fp32)."""
    if not value > 0:
        raise ValueError(f"static scale must be positive, got {value}")
    return _state(value, 1, device, dynamic=False)


def _state(value: float, hysteresis_left: int, device: torch.device | str | None, **static: Any) -> ScalerState:
    return ScalerState(torch.tensor(value, dtype=torch.float32, device=device),
                       torch.tensor(0, dtype=torch.int32, device=device),
                       torch.tensor(hysteresis_left, dtype=torch.int32, device=device), **static)


def _opmath(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def scale(scaler: ScalerState, tree: Any) -> Any:
    """Every tensor of ``tree`` (a tensor or nested list/tuple/dict) times the scale, in its own
    dtype; ``TypeError`` naming a leaf that is not a floating tensor. No collective."""
    def one(path: Any, x: Any) -> torch.Tensor:
        x = check_floating_tensor(f"scale: output{tp.keystr(path)}", x)
        return (x * scaler.scale.to(x.device)).to(x.dtype)

    return tp.tree_map_with_path(one, tree)


def local_sq_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-rank sum of squares of ``[R, ...]`` gradients, ``[R]`` float64: norms in gradient dtype, squared in float64;
    a non-finite value or an overflowing fp32 norm (as ``clip_grad_norm_``) makes it inf/nan. No collective."""
    return sum(torch.linalg.vector_norm(g.reshape(g.shape[0], -1), dim=1).double().square() for g in grads)


class Checked(tuple):
    """What :func:`unscale_and_check` gives: it unpacks as ``(grads, found_inf)`` (the unscaled gradients, and a 0-d
    fp32 1.0 if any rank's gradient is not finite), and carries what the step's agreement adds: ``grad_norm`` (0-d
    float64, unscaled, before clipping), ``loss`` (0-d float64, the mean of every rank's loss), ``used`` (``[T]`` bool,
    some rank had a gradient) and ``riders`` (``[k]`` float64, summed over ranks); None where not asked for."""

    grad_norm: torch.Tensor | None
    loss: torch.Tensor | None
    used: torch.Tensor | None
    riders: torch.Tensor | None

    def __new__(cls, grads: Any, found_inf: torch.Tensor, grad_norm: torch.Tensor | None = None,
                loss: torch.Tensor | None = None, used: torch.Tensor | None = None,
                riders: torch.Tensor | None = None) -> Checked:
        out = super().__new__(cls, (grads, found_inf))
        out.grad_norm, out.loss, out.used, out.riders = grad_norm, loss, used, riders
        return out

    @property
    def grads(self) -> Any:
        return self[0]

    @property
    def found_inf(self) -> torch.Tensor:
        return self[1]


def unscale_and_check(scaler: ScalerState, grads: Any, comm: Communicator, *, clip_norm: float | None = None,
                      losses: torch.Tensor | None = None, used: torch.Tensor | None = None,
                      riders: torch.Tensor | None = None, in_place: bool = False) -> Checked:
    """Unscale gradients (a tree of floating ``[R, ...]`` tensors: each times ``1/scale``, the float64 reciprocal
    rounded to float32 as ``torch.amp``, in float32 (fp64: float64), back in its dtype) and agree across ranks on
    skipping the step. On a mesh, first each shard's copies averaged (``all_reduce_replicas``, once a step). Alone:
    ``GradScaler``'s per-element ``found_inf``, one ``all_reduce(max)`` of ``R`` flags. The step's form (any of
    ``clip_norm``, ``losses`` ``[R]``, ``used`` ``[R, T]``, ``riders`` ``[R, k]``; ``grads`` this rank's disjoint
    shards): one ``all_reduce(sum)`` of ``[R, 2 + T + k]`` float64 (:func:`local_sq_norm`, loss, used flags, riders;
    on a mesh all but the norm first summed over replicas), ``found_inf`` if the norm is not finite, and one pass times
    ``1/scale`` and ``clip_grad_norm_``'s ``min(1, clip_norm / (norm + 1e-6))``. ``in_place``: the caller owns the
    gradients (scaled in place eagerly).
    ``ValueError``: an empty tree or no local-rank axis; ``TypeError``: a non-floating leaf."""
    leaves_with_path, spec = tp.tree_flatten_with_path(grads)
    if not leaves_with_path:
        raise ValueError("unscale_and_check: the gradient tree has no tensors")
    for path, g in leaves_with_path:
        g = check_floating_tensor(f"unscale_and_check: grads{tp.keystr(path)}", g)
        if g.dim() == 0 or g.shape[0] != comm.local_ranks:
            raise ValueError(f"unscale_and_check: grads{tp.keystr(path)} has shape {tuple(g.shape)}; "
                             f"expected a leading local-rank axis of size {comm.local_ranks}")
    leaves = [g for _, g in leaves_with_path]
    # a mesh: each shard's copies averaged once a step, after every micro-batch (reduce_scatter_grads spans one group)
    leaves = [done() for done in [comm.all_reduce_replicas_start(g, "avg") for g in leaves]]
    if clip_norm is None and losses is None and used is None and riders is None:
        inv = scaler.scale.double().reciprocal().float()
        bad = [(~torch.isfinite(g)).reshape(g.shape[0], -1).any(dim=1) for g in leaves]
        found = comm.all_reduce(functools.reduce(torch.logical_or, bad).to(torch.float32), "max")[0]
        out = [(g.to(_opmath(g.dtype)) * inv.to(device=g.device, dtype=_opmath(g.dtype))).to(g.dtype) for g in leaves]
        return Checked(tp.tree_unflatten(out, spec), found)
    norm_sq = local_sq_norm(leaves).unsqueeze(1)
    data = [(losses if losses is not None else norm_sq.new_zeros(comm.local_ranks)).double().unsqueeze(1)]
    n_used = 0 if used is None else used.shape[1]
    data += [] if used is None else [used.to(norm_sq.device, torch.float64)]
    data += [] if riders is None else [riders.to(norm_sq.device, torch.float64)]
    # the shards' norms over one shard group; what differs between ranks (loss, flags, riders) over every rank
    sums = comm.all_reduce(torch.cat([norm_sq, comm.all_reduce_replicas_start(torch.cat(data, dim=1))()], dim=1),
                           "sum")[0]
    scale64 = scaler.scale.double()
    norm64 = sums[0].sqrt() / scale64
    factor = scale64.reciprocal().float().double()
    if clip_norm is not None:
        factor = factor * torch.clamp(clip_norm / (norm64 + 1e-6), max=1.0)
    mutate = in_place and not comm.traced  # traced: out of place, inductor fuses it
    out = [g.mul_(factor.to(g.dtype)) if mutate else g * factor.to(g.dtype) for g in leaves]
    return Checked(tp.tree_unflatten(out, spec), (~torch.isfinite(norm64)).float(), norm64,
                   sums[1] / comm.data_world_size, None if used is None else sums[2:2 + n_used] > 0,
                   None if riders is None else sums[2 + n_used:])


def update_scale(scaler: ScalerState, found_inf: torch.Tensor) -> ScalerState:
    """The next scaler state after a step with ``found_inf`` (0-d, agreed across ranks), as ``GradScaler.update``: on
    overflow ``scale *= backoff_factor`` and the tracker resets; else the tracker counts up and at ``growth_interval``
    the scale grows by ``growth_factor`` (kept if finite) and the tracker resets; products in float64 rounded to
    float32. Then floored at ``min_scale``. With hysteresis ``h`` an overflow first spends one of ``h - 1`` tolerated
    overflows (the scale holds); growth refills them. Branch-free; no sync, no collective."""
    if not scaler.dynamic:
        return scaler
    found = found_inf.to(torch.bool)
    s64 = scaler.scale.double()
    successful = scaler.growth_tracker + 1
    grows = (~found) & (successful == scaler.growth_interval)
    grown = (s64 * scaler.growth_factor).float()
    grown = torch.where(torch.isfinite(grown), grown, scaler.scale)
    backs_off, hysteresis_left = found, scaler.hysteresis_left
    if scaler.hysteresis is not None:
        backs_off = found & (scaler.hysteresis_left <= 1)
        hysteresis_left = torch.where(grows, torch.full_like(scaler.hysteresis_left, scaler.hysteresis),
                                      torch.where(found & ~backs_off, scaler.hysteresis_left - 1,
                                                  scaler.hysteresis_left))
    backed_off = (s64 * scaler.backoff_factor).float()
    if scaler.min_scale is not None:
        backed_off = torch.clamp(backed_off, min=scaler.min_scale)
    new_scale = torch.where(backs_off, backed_off, torch.where(grows, grown, scaler.scale))
    new_tracker = torch.where(found | grows, torch.zeros_like(successful), successful)
    return replace(scaler, scale=new_scale, growth_tracker=new_tracker.to(torch.int32),
                   hysteresis_left=hysteresis_left.to(torch.int32))
