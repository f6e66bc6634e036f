"""Dynamic loss scaling as pure functions on an immutable :class:`ScalerState`.

The rule is ``torch.amp.GradScaler``'s (CPU kernel ``_amp_update_scale_``),
bit for bit, extended with two options users of DeepSpeed know: a floor
(``min_scale``) and hysteresis (tolerate ``hysteresis - 1`` overflows before
backing off). Every value that changes between steps is a 0-d tensor, so a
compiled step never recompiles and never syncs with the host.

:func:`unscale_and_clip` is the step's fused form for gradient shards: one
``all_reduce(sum)`` agrees on the global norm, the overflow flag and the mean loss (and
carries whatever else the step needs summed), then one pass unscales and clips.

Imports: ``fzero.pytree``, ``fzero.comm`` (protocol only), ``fzero.layout`` (input checks).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

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
    "unscale_and_clip",
    "Unscaled",
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


def unscale_and_check(
    scaler: ScalerState, grads: Any, comm: Communicator
) -> tuple[Any, torch.Tensor]:
    """Unscale gradients and find non-finite values on any rank.

    ``grads``: a tree of floating tensors (fp32, fp16, bf16 or fp64), each with
    the communicator's leading local-rank axis ``[R, ...]``. Each is multiplied
    by ``1/scale`` (computed in float64 and rounded to float32, as torch does)
    in float32 (float64 for fp64 grads) and rounded back to its own dtype.

    Returns ``(grads, found_inf)``; ``found_inf`` is a 0-d float32 tensor, 1.0
    if any rank saw a non-finite gradient. It is agreed through one
    ``all_reduce(max)`` of ``R`` elements, so every rank skips together.
    """
    leaves_with_path, spec = tp.tree_flatten_with_path(grads)
    if not leaves_with_path:
        raise ValueError("unscale_and_check: the gradient tree has no tensors")
    inv = scaler.scale.double().reciprocal().float()
    local_found = None
    out = []
    for path, g in leaves_with_path:
        g = check_floating_tensor(f"unscale_and_check: grads{tp.keystr(path)}", g)
        if g.dim() == 0 or g.shape[0] != comm.local_ranks:
            raise ValueError(
                f"unscale_and_check: grads{tp.keystr(path)} has shape {tuple(g.shape)}; "
                f"expected a leading local-rank axis of size {comm.local_ranks}"
            )
        bad = (~torch.isfinite(g)).reshape(g.shape[0], -1).any(dim=1)
        local_found = bad if local_found is None else local_found | bad
        op = _opmath(g.dtype)
        out.append((g.to(op) * inv.to(device=g.device, dtype=op)).to(g.dtype))
    found = comm.all_reduce(local_found.to(torch.float32), "max")[0]
    return tp.tree_unflatten(out, spec), found


def local_sq_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-rank sum of squares of ``[R, shard_numel]`` shards: ``[R]`` float64. No collective.

    Each shard's norm is taken in its own dtype (no float64 copy of the shard)
    and squared in float64. A non-finite value gives a non-finite result; so
    does a shard whose fp32 norm overflows (as ``clip_grad_norm_`` would).
    """
    return sum(torch.linalg.vector_norm(g, dim=1).double().square() for g in grads)


class Unscaled(NamedTuple):
    """What :func:`unscale_and_clip` agreed on and gives."""

    grads: tuple[torch.Tensor, ...]   # the shards unscaled and clipped, each in its own dtype
    found_inf: torch.Tensor           # 0-d fp32: 1.0 if any rank's gradient is not finite
    grad_norm: torch.Tensor           # 0-d float64: the global norm, unscaled, before clipping
    loss: torch.Tensor                # 0-d fp32: the mean of every rank's loss
    used: Optional[torch.Tensor]      # [T] bool: some rank had a gradient (given ``used``)
    riders: Optional[torch.Tensor]    # [k] float64: ``riders`` summed over ranks (given them)


def unscale_and_clip(
    scaler: ScalerState,
    shards: Sequence[torch.Tensor],
    comm: Communicator,
    *,
    losses: torch.Tensor,
    clip_norm: Optional[float] = None,
    used: Optional[torch.Tensor] = None,
    riders: Optional[torch.Tensor] = None,
    in_place: bool = False,
) -> Unscaled:
    """Unscale and clip sharded gradients in one pass, agreeing on overflow, norm and loss.

    ``shards``: the averaged, still scaled gradient shards ``[R, shard_numel]`` (one per flat
    group; disjoint, padding zero); ``losses``: ``[R]`` each local rank's unscaled loss.
    One ``all_reduce(sum)`` of ``[R, 2 + T + k]`` float64 values: each rank's sum of squares
    of its scaled shards (:func:`local_sq_norm`) and loss, ``used`` (``[R, T]``, nonzero where
    the rank had a gradient for trainable parameter ``t``) and ``riders`` (``[R, k]``, summed
    along at no extra collective: e.g. the replica digest). The sum is non-finite exactly when
    some rank has a non-finite gradient (or a shard norm beyond fp32's range, which
    ``clip_grad_norm_`` calls infinite too), so ``found_inf`` comes agreed.

    Then every shard is multiplied by ``1/scale`` (float64 reciprocal rounded to fp32, as
    ``torch.amp`` does) times ``clip_grad_norm_``'s coefficient
    ``min(1, clip_norm / (norm + 1e-6))`` of the unscaled norm (DeepSpeed's fused form).
    ``in_place=True`` (eager only; the caller owns the shards): the shards are scaled in place,
    no second copy; under ``torch.compile`` always out of place (inductor fuses it).
    """
    local = torch.stack([local_sq_norm(shards), losses.double()], dim=1)
    if used is not None:
        local = torch.cat([local, used.to(local.device, torch.float64)], dim=1)
    n_used = 0 if used is None else used.shape[1]
    if riders is not None:
        local = torch.cat([local, riders], dim=1)
    sums = comm.all_reduce(local, "sum")[0]
    scale64 = scaler.scale.double()
    norm64 = sums[0].sqrt() / scale64
    factor = scale64.reciprocal().float().double()
    if clip_norm is not None:
        factor = factor * torch.clamp(clip_norm / (norm64 + 1e-6), max=1.0)
    if in_place and not torch.compiler.is_compiling():
        for s in shards:
            s.mul_(factor.to(s.dtype))
        out = tuple(shards)
    else:
        out = tuple(s * factor.to(s.dtype) for s in shards)
    return Unscaled(
        out,
        (~torch.isfinite(norm64)).float(),
        norm64,
        (sums[1] / comm.world_size).float(),
        None if used is None else sums[2:2 + n_used] > 0,
        None if riders is None else sums[2 + n_used:],
    )


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
