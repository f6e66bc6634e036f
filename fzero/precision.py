"""The mixed-precision policy (after FSDP2's ``MixedPrecisionPolicy``).

Three dtypes meet in a step: the *master* copy the optimizer updates
(float32; float64 for float64 parameters), the *compute* dtype in which
parameters are gathered and the model runs (``param_dtype``), and the dtype
in which gradients are reduced across ranks (``reduce_dtype``). Parameters of the module
classes in ``keep_dtype`` (BatchNorm by default) are gathered and computed in their own
dtype instead of ``param_dtype``, as FSDP1's ``MixedPrecision`` keeps ``_BatchNorm`` in full
precision and autocast runs ``batch_norm`` in float32: torch's ``batch_norm`` takes a 16-bit
input with float32 weight, bias and running statistics, but not 16-bit weights with float32
running statistics.

Imports: layout (its ``compute_dtype``, the one rule for a slot or flat group).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from .layout import compute_dtype

__all__ = ["MixedPrecision", "native_bf16"]

_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """``param_dtype``: compute dtype of gathered parameters (None: each parameter's own).
    ``reduce_dtype``: gradient communication dtype (None: the master dtype); fp16/bf16
    use FSDP's pre/post-divide factors.
    ``keep_dtype``: ``nn.Module`` classes whose own parameters (not their submodules') are
    gathered and computed in their own dtype, not ``param_dtype`` (default: every BatchNorm,
    ``_BatchNorm``, as FSDP1; ``()``: none). Their gradients come out of backward in that
    dtype and are reduced in ``reduce_dtype`` as every other gradient. A pytree of tensors
    has no module classes: nothing is kept. Only matters when ``param_dtype`` is set.
    """

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    keep_dtype: tuple[type[torch.nn.Module], ...] = (_BatchNorm,)

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            v = getattr(self, name)
            if v is not None and v not in _FLOATING:
                raise TypeError(f"MixedPrecision.{name} must be a floating dtype or None, got {v}")
        if isinstance(self.keep_dtype, type) or not isinstance(self.keep_dtype, (tuple, list)):
            raise TypeError(
                f"MixedPrecision.keep_dtype must be a tuple of nn.Module classes, got {self.keep_dtype!r} "
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

    def keeps(self, params: object) -> Optional[Callable[[str], bool]]:
        """Which parameters of ``params`` keep their own dtype, by path (``named_parameters``
        names): those registered on a module of a ``keep_dtype`` class whose dtype differs from
        ``param_dtype``. ``None`` when nothing is kept (no ``param_dtype``, a pytree, no such
        module): the layout is then the one without a policy. Raises ``ValueError`` for a
        BatchNorm left out of ``keep_dtype`` whose running statistics are not in
        ``param_dtype``: torch's ``batch_norm`` would reject it at the first step.
        """
        if self.param_dtype is None or not isinstance(params, torch.nn.Module):
            return None
        kept = set()
        for name, m in params.named_modules(remove_duplicate=False):
            own = [(n, p) for n, p in m.named_parameters(recurse=False)]
            if isinstance(m, self.keep_dtype):
                kept.update(f"{name}.{n}" if name else n for n, p in own if p.dtype != self.param_dtype)
            elif isinstance(m, _BatchNorm) and any(p.dtype != self.param_dtype for _, p in own):
                stats = [b for b in (m.running_mean, m.running_var) if b is not None]
                if any(b.dtype != self.param_dtype for b in stats):
                    raise ValueError(
                        f"MixedPrecision(param_dtype={self.param_dtype}): {name or 'the model'} is a "
                        f"{type(m).__name__} whose running statistics are {stats[0].dtype}; torch's batch_norm "
                        f"rejects {self.param_dtype} weights with {stats[0].dtype} statistics (\"expected scalar "
                        "type\"). Keep BatchNorm in its own dtype: MixedPrecision(..., keep_dtype=(torch.nn."
                        "modules.batchnorm._BatchNorm,)), the default, or convert its buffers to "
                        f"{self.param_dtype} yourself")
        return kept.__contains__ if kept else None


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
