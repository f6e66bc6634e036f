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

So a training program on CPU should pin the threshold: :func:`tune_host_allocator`, one call
at its start (the main job, the benchmarks and the long-run tests make it), sets it at
:data:`DEFAULT_MMAP_THRESHOLD` (``mallopt(M_MMAP_THRESHOLD)``, which also turns the dynamic
adjustment off) unless the environment chose (``MALLOC_MMAP_THRESHOLD_`` or ``GLIBC_TUNABLES``'s
``glibc.malloc.mmap_threshold``). It is a setting of the whole process, so fzero never makes it
on its own: ``import fzero`` and :func:`fzero.init_train_state` leave the allocator alone, as
FSDP2 and DeepSpeed do. Elsewhere (another C library, a preloaded jemalloc) nothing changes.

The heap's top. glibc's dynamic adjustment also raises the *trim threshold* (free memory at the
heap's top beyond it goes back to the kernel at ``free``) to twice the mmap threshold; pinned,
it stays at its start, 128 KiB. Then the blocks under the mmap threshold that a step allocates
and frees at the top of the heap (activations, small shards and their copies) go back to the
kernel at every step and fault in again at the next. So the pin sets the trim threshold too,
at :data:`DEFAULT_TRIM_THRESHOLD`, unless the environment chose one (``MALLOC_TRIM_THRESHOLD_``,
``glibc.malloc.trim_threshold``). Measured on an MLP of 1.1M parameters, gloo W=2, eager stage
2, per rank and step: 5300 page faults and 32.7 ms with the trim threshold at 128 KiB, 4200 at
8 MiB, 2500 and 29.2 ms at 16 MiB, 2500 at 32 MiB, 2700 at 64 MiB (stage 3: 6600 faults and
48.6 ms, 4200 and 43.6 ms at 16 MiB). At 162M parameters the step's blocks are mostly above
the mmap threshold, and faults, peak and held RSS were the same both ways.

Large pages. Pinned or not, a block of many MiB comes fresh from the kernel each time a step
allocates it, and its first touch faults every 4 KiB page in: measured on this project's machine,
filling a fresh 162 MB tensor took 101 ms against 27 ms for memory already mapped; with
transparent huge pages (2 MiB) 37 ms. A compiled stage-2 step of a 162M-parameter model on gloo
W=2 faults about 730 000 pages a step (2.9 GB: its gradients, the collectives' receive buffers,
the gathered parameters), DDP's about 190 000-310 000. A process cannot turn huge pages on for
itself once it runs: the kernel gives them to mappings that ask (``madvise`` mode, the default of
most distributions), and who asks is decided at start: PyTorch's ``THP_MEM_ALLOC_ENABLE=1``
(read at the first allocation of 2 MiB or more: in the launch's environment) or glibc's
``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``. :func:`large_pages` says whether this process has
them and why; a CPU state logs it once (logger ``fzero``, INFO) with the setting to launch with.

Imports: torch only (none of fzero).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
from typing import Mapping, Optional

__all__ = ["DEFAULT_MMAP_THRESHOLD", "DEFAULT_TRIM_THRESHOLD", "pin_mmap_threshold", "tune_host_allocator",
           "large_pages", "THP_ENV"]

# Above every activation and per-parameter gradient of a small model and below the
# blocks that fragment a large one's heap (gathered units, flat gradients and their
# receive buffers are 10-30 MiB for GPT-2-small blocks)
DEFAULT_MMAP_THRESHOLD = 4 << 20

# The free memory the heap's top keeps: the smallest measured that took the whole gain (module doc)
DEFAULT_TRIM_THRESHOLD = 16 << 20

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3

# PyTorch's own switch: allocations of 2 MiB or more aligned to 2 MiB and advised as huge pages
THP_ENV = "THP_MEM_ALLOC_ENABLE"
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"

_log = logging.getLogger("fzero")


def _glibc() -> Optional[ctypes.CDLL]:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") else None


def _environment_chose(setting: str = "mmap_threshold") -> bool:
    """Whether the environment set glibc's ``setting`` (its ``MALLOC_<SETTING>_`` variable or
    ``GLIBC_TUNABLES``'s ``glibc.malloc.<setting>``)."""
    return f"MALLOC_{setting.upper()}_" in os.environ or f"malloc.{setting}" in os.environ.get("GLIBC_TUNABLES", "")


def pin_mmap_threshold(nbytes: int = DEFAULT_MMAP_THRESHOLD,
                       trim_bytes: Optional[int] = DEFAULT_TRIM_THRESHOLD) -> bool:
    """Serve every ``malloc`` of at least ``nbytes`` bytes from a mapping of its own, returned
    to the system when freed, and turn glibc's dynamic threshold off (the whole process).
    ``trim_bytes``: the free memory the heap's top keeps (``M_TRIM_THRESHOLD``; the dynamic
    adjustment would have raised it, see the module doc), unless the environment set it;
    ``None`` leaves it. Returns whether the mmap threshold was set (``False`` where the C
    library is not glibc)."""
    global _decided
    if not 0 < nbytes <= 32 << 20:
        raise ValueError(f"pin_mmap_threshold: nbytes must be in (0, 32 MiB] (glibc's limit), got {nbytes}")
    if trim_bytes is not None and not 0 <= trim_bytes < 1 << 31:
        raise ValueError(f"pin_mmap_threshold: trim_bytes must be in [0, 2 GiB) (mallopt takes an int), "
                         f"got {trim_bytes}")
    libc = _glibc()
    if libc is None or not libc.mallopt(_M_MMAP_THRESHOLD, int(nbytes)):
        return False
    if trim_bytes is not None and not _environment_chose("trim_threshold"):
        libc.mallopt(_M_TRIM_THRESHOLD, int(trim_bytes))
    return True


def tune_host_allocator() -> str:
    """Pin glibc's mmap threshold at :data:`DEFAULT_MMAP_THRESHOLD` and its trim threshold at
    :data:`DEFAULT_TRIM_THRESHOLD` for the whole process, unless the environment chose (module
    doc); log it, and whether large tensors get huge pages (logger ``fzero``, INFO). Call it
    once, at the start of a CPU training program. Returns ``"pinned"``, ``"environment"`` or
    ``"unsupported"`` (not glibc)."""
    if _environment_chose():
        decided = "environment"
    elif pin_mmap_threshold(DEFAULT_MMAP_THRESHOLD):
        decided = "pinned"
        _log.info("fzero: pinned glibc's mmap threshold at %d bytes (fzero.host_malloc)", DEFAULT_MMAP_THRESHOLD)
    else:
        decided = "unsupported"
    on, why = large_pages()
    _log.info("fzero: large tensors %s huge pages: %s", "get" if on else "do not get", why)
    return decided


def _kernel_thp_mode(path: str = _THP_MODE) -> Optional[str]:
    """The kernel's transparent-huge-page mode (``always``, ``madvise``, ``never``), or ``None``."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def _asked_in_environment(env: Mapping[str, str]) -> Optional[str]:
    """Which setting of the launch's environment asks for huge pages, if one does."""
    if env.get(THP_ENV) == "1":  # PyTorch takes "1" and ignores anything else but "0"
        return f"{THP_ENV}={env[THP_ENV]} (PyTorch's allocator advises its blocks of 2 MiB or more)"
    for tunable in env.get("GLIBC_TUNABLES", "").split(":"):
        name, _, value = tunable.partition("=")
        if name.strip() == "glibc.malloc.hugetlb" and value.strip() in ("1", "2"):
            return f"GLIBC_TUNABLES {tunable.strip()} (glibc's malloc advises its mappings)"
    return None


def large_pages(env: Optional[Mapping[str, str]] = None, mode: Optional[str] = "read") -> tuple[bool, str]:
    """Whether large CPU tensors of this process are backed by transparent huge pages, and why.

    ``env``: the environment the process started with (default ``os.environ``); ``mode``: the
    kernel's THP mode (default: read from ``/sys/kernel/mm/transparent_hugepage/enabled``).
    ``always``: yes. ``madvise``: when the launch asked (``THP_MEM_ALLOC_ENABLE=1`` or glibc's
    ``hugetlb`` tunable; set after the process's first large allocation, PyTorch's switch is
    not read any more). ``never``, or no THP: no."""
    env = os.environ if env is None else env
    mode = _kernel_thp_mode() if mode == "read" else mode
    if mode is None:
        return False, "the kernel has no transparent huge pages (or does not say: no " + _THP_MODE + ")"
    if mode == "always":
        return True, "the kernel backs every large mapping with huge pages (THP mode 'always')"
    if mode == "never":
        return False, "the kernel's THP mode is 'never'"
    asked = _asked_in_environment(env)
    if asked:
        return True, f"the kernel gives them to mappings that ask (THP mode '{mode}') and the launch asked: {asked}"
    return False, (f"the kernel gives them only to mappings that ask (THP mode '{mode}') and nothing asked: "
                   f"launch with {THP_ENV}=1 (every fresh block of a step then faults in 2 MiB pages, "
                   f"not 4 KiB ones; fzero.host_malloc)")
