"""The host allocator's policy for large blocks: glibc's mmap threshold, pinned.

A CPU tensor's memory comes from ``malloc``. glibc serves a block of at least its
*mmap threshold* with a mapping of its own, which ``free`` returns to the system;
smaller blocks come from the heap, where freed memory stays in the process unless
it happens to lie at the heap's top. The threshold starts at 128 KiB and, by
default, rises to the size of every mapped block freed, up to 32 MiB: after a
step has freed one 27 MiB gathered unit, every later block under 27 MiB comes
from the heap. A training step frees and allocates blocks of that size many
times (gathered parameters, flat gradients, receive buffers) between activations
of other sizes, the heap fragments, and the process's resident memory climbs
step after step although its live bytes stay flat.

Measured (gloo W=2, eager stage 3, 2 cores; ``benchmarks/bench_memory.py``): a
TinyGPT of 40.7M parameters, RSS above the baseline at steps 50/100/150/200:
801, 909, 909, 1031 MiB with the dynamic threshold, 326, 333, 335, 337 MiB with
it pinned at 4 MiB (live heap 115 MiB both ways); at 162M parameters, held RSS
1811 and 1610 MiB against 1135 and 1122 MiB pinned (two launches each).

So :func:`fzero.init_train_state` on CPU pins the threshold once per process at
:data:`DEFAULT_MMAP_THRESHOLD` (``mallopt(M_MMAP_THRESHOLD)``, which also turns
the dynamic adjustment off), unless the process already chose: the environment
sets ``MALLOC_MMAP_THRESHOLD_`` or ``GLIBC_TUNABLES``'s
``glibc.malloc.mmap_threshold``, or the program called :func:`pin_mmap_threshold`
(its own value) or :func:`keep_host_malloc` (leave glibc as it is) first. It is
a setting of the whole process, as the many applications that pin it at start
do; fzero logs it (logger ``fzero``, INFO). Elsewhere (another C library, a
preloaded jemalloc or tcmalloc) nothing is changed.

Imports: torch only (none of fzero).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
from typing import Optional

__all__ = ["DEFAULT_MMAP_THRESHOLD", "pin_mmap_threshold", "keep_host_malloc", "apply_host_malloc_policy"]

# Above every activation and per-parameter gradient of a small model and below the
# blocks that fragment a large one's heap (gathered units, flat gradients and their
# receive buffers are 10-30 MiB for GPT-2-small blocks)
DEFAULT_MMAP_THRESHOLD = 4 << 20

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)

_log = logging.getLogger("fzero")
_decided: Optional[str] = None  # "pinned", "kept", "environment", "unsupported"


def _glibc() -> Optional[ctypes.CDLL]:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") else None


def _environment_chose() -> bool:
    return "MALLOC_MMAP_THRESHOLD_" in os.environ or "malloc.mmap_threshold" in os.environ.get("GLIBC_TUNABLES", "")


def pin_mmap_threshold(nbytes: int = DEFAULT_MMAP_THRESHOLD) -> bool:
    """Serve every ``malloc`` of at least ``nbytes`` bytes from a mapping of its own, returned
    to the system when freed, and turn glibc's dynamic threshold off (the whole process).
    Returns whether it was set (``False`` where the C library is not glibc)."""
    global _decided
    if not 0 < nbytes <= 32 << 20:
        raise ValueError(f"pin_mmap_threshold: nbytes must be in (0, 32 MiB] (glibc's limit), got {nbytes}")
    libc = _glibc()
    if libc is None or not libc.mallopt(_M_MMAP_THRESHOLD, int(nbytes)):
        _decided = "unsupported"
        return False
    _decided = "pinned"
    return True


def keep_host_malloc() -> None:
    """Leave glibc's allocator as it is: fzero will not pin its mmap threshold."""
    global _decided
    _decided = "kept"


def apply_host_malloc_policy(device_type: str) -> Optional[str]:
    """Once per process, for a state on the CPU: pin the threshold at
    :data:`DEFAULT_MMAP_THRESHOLD` unless the process chose already (see the module doc).
    Returns what was decided (``None`` for other devices: their tensors are not ``malloc``'s)."""
    global _decided
    if device_type != "cpu":
        return None
    if _decided is None:
        if _environment_chose():
            _decided = "environment"
        elif pin_mmap_threshold(DEFAULT_MMAP_THRESHOLD):
            _log.info("fzero: pinned glibc's mmap threshold at %d bytes (fzero.host_malloc; "
                      "fzero.host_malloc.keep_host_malloc() before init_train_state leaves it alone)", DEFAULT_MMAP_THRESHOLD)
    return _decided
