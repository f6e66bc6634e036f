"""The mixed-precision policy (after FSDP2's ``MixedPrecisionPolicy``).

Three dtypes meet in a step: the *master* copy the optimizer updates
(float32; float64 for float64 parameters), the *compute* dtype in which
parameters are gathered and the model runs (``param_dtype``), and the dtype
in which gradients are reduced across ranks (``reduce_dtype``).

Imports: torch only.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

__all__ = ["MixedPrecision"]

_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """``param_dtype``: compute dtype of gathered parameters (None: each parameter's own).
    ``reduce_dtype``: gradient communication dtype (None: the master dtype); fp16/bf16
    use FSDP's pre/post-divide factors.
    """

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            v = getattr(self, name)
            if v is not None and v not in _FLOATING:
                raise TypeError(f"MixedPrecision.{name} must be a floating dtype or None, got {v}")

    def compute_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        return self.param_dtype or param_dtype
