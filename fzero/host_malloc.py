"""The host allocator's policy for large blocks. glibc's dynamic mmap threshold rises to the largest block freed, so a
step's 10-30 MiB blocks come from the heap, which fragments (a 40.7M-parameter model: 801 -> 1031 MiB resident over 200
steps; 326 -> 337 MiB pinned at 4 MiB, ``design.md``). :func:`tune_host_allocator` pins it and the trim threshold unless
the environment chose (fzero never calls it); :func:`large_pages` says whether large tensors get transparent huge pages.

Imports: none of fzero.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
from collections.abc import Mapping

__all__ = ["DEFAULT_MMAP_THRESHOLD", "DEFAULT_TRIM_THRESHOLD", "pin_mmap_threshold", "tune_host_allocator",
           "large_pages", "THP_ENV"]

DEFAULT_MMAP_THRESHOLD = 4 << 20  # above a small model's blocks, below a large one's fragmenting ones
DEFAULT_TRIM_THRESHOLD = 16 << 20  # the smallest measured that took the whole gain
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers (malloc.h)
THP_ENV = "THP_MEM_ALLOC_ENABLE"  # PyTorch's switch: blocks of 2 MiB or more advised as huge pages
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"
_log = logging.getLogger("fzero")


def _glibc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") else None


def _environment_chose(setting: str = "mmap_threshold") -> bool:
    """Whether ``MALLOC_<SETTING>_`` or ``GLIBC_TUNABLES``'s ``glibc.malloc.<setting>`` is set."""
    return f"MALLOC_{setting.upper()}_" in os.environ or f"malloc.{setting}" in os.environ.get("GLIBC_TUNABLES", "")


def pin_mmap_threshold(nbytes: int = DEFAULT_MMAP_THRESHOLD,
                       trim_bytes: int | None = DEFAULT_TRIM_THRESHOLD) -> bool:
    """Serve every ``malloc`` of at least ``nbytes`` from a mapping of its own, turning glibc's dynamic
    threshold off, and set the trim threshold to ``trim_bytes`` unless the environment chose it (``None``:
    leave it); whole process. Returns whether it was set (``False``: not glibc). ``ValueError``: out of range."""
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
    """Pin the default thresholds unless the environment chose; log it and :func:`large_pages` (logger ``fzero``, INFO).
    Call once, at a CPU training program's start. Returns ``"pinned"``, ``"environment"`` or ``"unsupported"``."""
    decided = "environment" if _environment_chose() else "pinned" if pin_mmap_threshold() else "unsupported"
    if decided == "pinned":
        _log.info("fzero: pinned glibc's mmap threshold at %d bytes (fzero.host_malloc)", DEFAULT_MMAP_THRESHOLD)
    on, why = large_pages()
    _log.info("fzero: large tensors %s huge pages: %s", "get" if on else "do not get", why)
    return decided


def _kernel_thp_mode(path: str = _THP_MODE) -> str | None:
    """The kernel's transparent-huge-page mode (``always``, ``madvise``, ``never``), or ``None``."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def large_pages(env: Mapping[str, str] | None = None, mode: str | None = "read") -> tuple[bool, str]:
    """Whether large CPU tensors of this process get transparent huge pages, and why. ``env``: the launch's environment
    (default ``os.environ``); ``mode``: the kernel's THP mode (default: read). ``always``: yes; ``madvise``: when the
    launch asked (:data:`THP_ENV` ``=1`` or glibc's ``hugetlb`` tunable); ``never`` or no THP: no."""
    env = os.environ if env is None else env
    mode = _kernel_thp_mode() if mode == "read" else mode
    settled = {None: (False, "the kernel has no transparent huge pages (or does not say: no " + _THP_MODE + ")"),
               "always": (True, "the kernel backs every large mapping with huge pages (THP mode 'always')"),
               "never": (False, "the kernel's THP mode is 'never'")}
    if mode in settled:
        return settled[mode]
    tunables = [t.strip().partition("=") for t in env.get("GLIBC_TUNABLES", "").split(":")]
    asked = [f"GLIBC_TUNABLES {''.join(t)} (glibc's malloc advises its mappings)" for t in tunables
             if t[0].strip() == "glibc.malloc.hugetlb" and t[2].strip() in ("1", "2")]
    if env.get(THP_ENV) == "1":  # PyTorch takes "1" and ignores anything else but "0"
        asked.insert(0, f"{THP_ENV}=1 (PyTorch's allocator advises its blocks of 2 MiB or more)")
    if asked:
        return True, f"the kernel gives them to mappings that ask (THP mode '{mode}') and the launch asked: {asked[0]}"
    return False, (f"the kernel gives them only to mappings that ask (THP mode '{mode}') and nothing asked: "
                   f"launch with {THP_ENV}=1 (every fresh block of a step then faults in 2 MiB pages, "
                   f"not 4 KiB ones; fzero.host_malloc)")
