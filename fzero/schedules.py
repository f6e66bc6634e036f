"""Hyperparameter schedules: functions of the optimizer's step count (0-d int64: updates applied, so skipped steps do
not advance them, as DeepSpeed) to a 0-d float64 tensor, in tensor arithmetic and ``torch.where`` only: a compiled step
evaluates them in its graph, never recompiling. :func:`apply_schedules` sets an ``OptState``'s scheduled values.

Imports: pytree.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .pytree import replace

__all__ = ["Schedule", "apply_schedules", "constant", "linear", "linear_warmup", "cosine_decay", "warmup_cosine",
           "join"]

Schedule = Callable[[torch.Tensor], torch.Tensor]


def _t(step: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(step).to(torch.float64)


def constant(value: float) -> Schedule:
    """``value`` at every step."""
    def schedule(step: torch.Tensor) -> torch.Tensor:
        return torch.full_like(_t(step), float(value))

    return schedule


def linear(start: float, end: float, steps: int) -> Schedule:
    """From ``start`` at step 0 to ``end`` at step ``steps``, then ``end``."""
    if steps < 1:
        raise ValueError(f"linear: steps must be >= 1, got {steps}")

    def schedule(step: torch.Tensor) -> torch.Tensor:
        return start + (end - start) * torch.clamp(_t(step) / steps, 0.0, 1.0)

    return schedule


def linear_warmup(peak: float, warmup_steps: int, start: float = 0.0) -> Schedule:
    """Linear warm-up from ``start`` to ``peak`` over ``warmup_steps``, then ``peak``."""
    return linear(start, peak, warmup_steps)


def cosine_decay(peak: float, decay_steps: int, final: float = 0.0) -> Schedule:
    """``final + (peak - final) * (1 + cos(pi * t / decay_steps)) / 2``, held at ``final`` after."""
    if decay_steps < 1:
        raise ValueError(f"cosine_decay: decay_steps must be >= 1, got {decay_steps}")

    def schedule(step: torch.Tensor) -> torch.Tensor:
        return final + (peak - final) * 0.5 * (1.0 + torch.cos(math.pi * torch.clamp(_t(step) / decay_steps, 0.0, 1.0)))

    return schedule


def join(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """Schedule ``i`` from ``boundaries[i-1]`` on, evaluated at ``step - boundaries[i-1]``;
    ``len(boundaries) == len(schedules) - 1``, increasing (optax's ``join_schedules``)."""
    if len(boundaries) != len(schedules) - 1:
        raise ValueError("join: need exactly one boundary between consecutive schedules")
    if list(boundaries) != sorted(boundaries) or any(b < 0 for b in boundaries):
        raise ValueError(f"join: boundaries must be non-negative and increasing, got {list(boundaries)}")

    def schedule(step: torch.Tensor) -> torch.Tensor:
        t = torch.as_tensor(step)
        value = schedules[0](t)
        for start, sched in zip(boundaries, schedules[1:]):
            value = torch.where(t >= start, sched(t - start), value)
        return value

    return schedule


def warmup_cosine(peak: float, warmup_steps: int, total_steps: int, final: float = 0.0, start: float = 0.0) -> Schedule:
    """Linear warm-up to ``peak`` over ``warmup_steps``, then cosine decay to ``final`` at ``total_steps``."""
    if not 0 <= warmup_steps < total_steps:
        raise ValueError(f"warmup_cosine: need 0 <= warmup_steps < total_steps, got {warmup_steps}, {total_steps}")
    if warmup_steps == 0:
        return cosine_decay(peak, total_steps, final)
    return join([linear_warmup(peak, warmup_steps, start), cosine_decay(peak, total_steps - warmup_steps, final)],
                [warmup_steps])


def apply_schedules(opt: Any, schedules: Mapping[str, Schedule]) -> Any:
    """``opt`` (:class:`~fzero.optim.OptState`) with hyperparameters set by ``schedules`` (``{hyperparameter:
    schedule}``) at its step count: group 0 takes ``schedule(step)``, other groups that times ``base_group /
    base_default`` (as ``LambdaLR``), each on the step count's device (the rules take a device hyperparameter as a
    tensor). ``ValueError``: a hyperparameter the rule lacks. No collective, no host read."""
    if not schedules:
        return opt
    hyper = [dict(h) for h in opt.hyper]
    for name, schedule in schedules.items():
        if name not in hyper[0]:
            raise ValueError(f"schedules: {opt.optimizer.name} has no hyperparameter {name!r}; "
                             f"expected one of {sorted(hyper[0])}")
        value = schedule(opt.step).to(torch.float64).reshape(())
        base0 = opt.optimizer.hyperparams(0)[name]
        for i, h in enumerate(hyper):
            base = opt.optimizer.hyperparams(i)[name]
            # on the step count's device: copied to the host it would wait for the device every step
            h[name] = value * (base / base0 if base0 and base != base0 else 1.0)
    return replace(opt, hyper=tuple(hyper))
