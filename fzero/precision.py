"""The mixed-precision policy (after FSDP2's ``MixedPrecisionPolicy``): the *master* copy the optimizer updates
(float32; float64 for float64 parameters), the *compute* dtype parameters are gathered and run in (``param_dtype``),
the dtype gradients are reduced in (``reduce_dtype``), and frozen parameters' ``frozen_dtype``.

Imports: layout.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from .layout import compute_dtype

__all__ = ["MixedPrecision", "native_bf16"]

_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """``param_dtype``: compute dtype of gathered parameters (None: each parameter's own). ``reduce_dtype``: gradient
    communication dtype (None: master dtype; 16 bits: FSDP's divide factors). ``keep_dtype``: ``nn.Module`` classes
    whose own parameters (not their submodules') compute in their own dtype when ``param_dtype`` is set (default every
    ``_BatchNorm``, as FSDP1: ``batch_norm`` rejects 16-bit weights with fp32 statistics; ``()``: none); their gradients
    are reduced in ``reduce_dtype``. ``frozen_dtype``: frozen parameters' held dtype (None: their own; ``keep_dtype``
    ones keep theirs), rounded once at init; meant equal to ``param_dtype`` (bf16: half fp32's bytes, as QLoRA; else
    cast each step). ``TypeError``: a non-floating dtype, or ``keep_dtype`` not a tuple of classes."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    keep_dtype: tuple[type[torch.nn.Module], ...] = (_BatchNorm,)
    frozen_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "frozen_dtype"):
            v = getattr(self, name)
            if v is not None and v not in _FLOATING:
                raise TypeError(f"MixedPrecision.{name} must be a floating dtype or None, got {v}")
        if isinstance(self.keep_dtype, type) or not isinstance(self.keep_dtype, (tuple, list)):
            raise TypeError(f"MixedPrecision.keep_dtype must be a tuple of nn.Module classes, got {self.keep_dtype!r} "
                            "(one class: keep_dtype=(cls,))")
        for c in self.keep_dtype:
            if not (isinstance(c, type) and issubclass(c, torch.nn.Module)):
                raise TypeError(f"MixedPrecision.keep_dtype: {c!r} is not an nn.Module class")
        object.__setattr__(self, "keep_dtype", tuple(self.keep_dtype))  # a list: hashable as static metadata

    def compute_dtype(self, of: Any) -> torch.dtype:
        """The compute dtype of ``of``: a parameter dtype, or a layout's ``ParamSlot`` or
        ``FlatGroup`` (one that keeps its dtype, ``keep_dtype``, computes in its own)."""
        if isinstance(of, torch.dtype):
            return self.param_dtype or of
        return compute_dtype(of, self.param_dtype)

    def frozen_storage(self, slot: Any) -> torch.dtype:
        """The dtype a frozen parameter (a layout's ``ParamSlot``) is held in."""
        return slot.dtype if self.frozen_dtype is None or slot.keep_dtype else self.frozen_dtype

    def keeps(self, params: object) -> Callable[[str], bool] | None:
        """Which parameters of ``params`` (``named_parameters`` paths) keep their own dtype: a ``keep_dtype`` module's,
        if their dtype differs from ``param_dtype``; ``None`` when none does (no ``param_dtype``, pytree, no such
        module). ``ValueError`` for a BatchNorm outside ``keep_dtype`` with running statistics not in
        ``param_dtype``."""
        dtype = self.param_dtype or self.frozen_dtype  # the dtype a parameter would change to
        if dtype is None or not isinstance(params, torch.nn.Module):
            return None
        kept = set()
        for name, m in params.named_modules(remove_duplicate=False):
            own = list(m.named_parameters(recurse=False))
            if isinstance(m, self.keep_dtype):
                kept.update(f"{name}.{n}" if name else n for n, p in own if p.dtype != dtype)
            elif isinstance(m, _BatchNorm) and any(p.dtype != dtype for _, p in own):
                stats = [b for b in (m.running_mean, m.running_var) if b is not None]
                if any(b.dtype != dtype for b in stats):
                    raise ValueError(f"MixedPrecision({dtype}): {name or 'the model'} is a {type(m).__name__} whose "
                                     f"running statistics are {stats[0].dtype}; torch's batch_norm rejects {dtype} "
                                     f"weights with {stats[0].dtype} statistics (\"expected scalar type\"). Keep "
                                     "BatchNorm in its own dtype: MixedPrecision(..., keep_dtype=(torch.nn.modules."
                                     f"batchnorm._BatchNorm,)), the default, or convert its buffers to {dtype} "
                                     "yourself")
        return kept.__contains__ if kept else None


# oneDNN's instruction-set caps (ONEDNN_MAX_CPU_ISA, DNNL_MAX_CPU_ISA) below its bf16 dot products
_ONEDNN_WITHOUT_BF16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}


def native_bf16(device: torch.device | None = None) -> tuple[bool, str]:
    """Whether ``device`` (default: CUDA if available, else the CPU) computes bfloat16 natively, and
    why: CUDA with ``torch.cuda.is_bf16_supported()``, or a CPU with AVX512-BF16 or AMX whose kernels
    this process may use: ATen's AVX-512 ones (not capped by ``ATEN_CPU_CAPABILITY``) and oneDNN's (not
    capped below bf16 by ``ONEDNN_MAX_CPU_ISA``). Elsewhere bf16 matmuls are emulated (measured 3.5x
    slower than fp32 on a CPU without them)."""
    device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        ok = torch.cuda.is_bf16_supported()
        return ok, f"{torch.cuda.get_device_name(device)} {'supports' if ok else 'does not support'} bf16"
    if device.type != "cpu":
        return False, f"no bf16 detection for {device.type}"
    found = [name for name, probe in (("AVX512-BF16", torch.cpu._is_avx512_bf16_supported),
                                      ("AMX", torch.cpu._is_amx_tile_supported)) if probe()]
    if not found:
        return False, "the CPU has neither AVX512-BF16 nor AMX (bf16 would be emulated, slower than fp32)"
    capability = torch.backends.cpu.get_cpu_capability()
    if not capability.startswith("AVX512"):
        return False, (f"the CPU has {' and '.join(found)}, but ATen runs its {capability} kernels "
                       "(ATEN_CPU_CAPABILITY): bf16 would be emulated, slower than fp32")
    cap = next((f"{k}={os.environ[k]}" for k in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
                if os.environ.get(k, "").upper() in _ONEDNN_WITHOUT_BF16), None)
    if cap is not None:
        return False, f"the CPU has {' and '.join(found)}, but oneDNN is capped below bf16 ({cap}): bf16 would be " \
                      "emulated, slower than fp32"
    return True, f"the CPU has {' and '.join(found)}"
