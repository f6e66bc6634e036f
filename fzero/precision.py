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

__all__ = ["MixedPrecision", "native_bf16"]

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


def native_bf16(device: Optional[torch.device] = None) -> tuple[bool, str]:
    """Whether ``device`` (default: CUDA if available, else the CPU) computes bfloat16 natively,
    and why: CUDA with bf16 support (``torch.cuda.is_bf16_supported()``), or a CPU with
    AVX512-BF16 or AMX tiles. Elsewhere bf16 matmuls are emulated in fp32 and run slower than
    fp32 itself (measured 3.5x slower on a CPU without them).
    """
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda":
        ok = torch.cuda.is_bf16_supported()
        name = torch.cuda.get_device_name(device)
        return ok, f"{name} {'supports' if ok else 'does not support'} bf16"
    if device.type != "cpu":
        return False, f"no bf16 detection for {device.type}"
    found = [name for name, probe in (("AVX512-BF16", "_is_avx512_bf16_supported"),
                                      ("AMX", "_is_amx_tile_supported"))
             if getattr(torch.cpu, probe, lambda: False)()]
    if not found and not hasattr(torch.cpu, "_is_avx512_bf16_supported"):
        try:  # older torch: read the kernel's CPU flags
            flags = set(open("/proc/cpuinfo").read().split())
        except OSError:
            flags = set()
        found = [name for name, flag in (("AVX512-BF16", "avx512_bf16"), ("AMX", "amx_bf16")) if flag in flags]
    if found:
        return True, f"the CPU has {' and '.join(found)}"
    return False, "the CPU has neither AVX512-BF16 nor AMX (bf16 would be emulated, slower than fp32)"
