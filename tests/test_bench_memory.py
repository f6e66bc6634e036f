"""Smoke test of ``benchmarks/bench_memory.py``: two systems on a tiny model, each in its own
2-rank gloo launch, print a table with numbers.

Bounded: the script kills each launch after ``--timeout`` 28 s, and the test gives the script
60 s. A launch takes 12-15 s on a quiet 2-core machine (mostly importing torch in three
processes); on a machine running several times more processes than cores it can take longer
and the test fails by timing out."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--vocab", "256", "--d-model", "64", "--layers", "2", "--heads", "2", "--seq", "32", "--batch", "4"]


def test_bench_memory_prints_a_row_of_numbers_per_system():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_memory.py"), "--systems", "ddp,fzero-s2",
           "--steps", "1", "--timeout", "28", *TINY]
    # each launch is killed with its ranks by the script after --timeout; this bounds the script
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    number = r"\s+-?\d+\.\d+"
    for key in ("ddp", "fzero-s2"):
        row = next((ln for ln in out.splitlines() if ln.startswith(key + " ")), None)
        assert row is not None and "FAILED" not in row, out
        assert re.match(re.escape(key) + f"({number}){{12}}", row), row   # 12 numeric columns
        assert f"census of {key}" in out
    assert re.search(r"^huge pages (on|off) in the ranks: ", out, re.M), out
    assert "parameters" in out.splitlines()[0]


def test_sizes_are_the_model_sizes_they_name_and_the_summary_divides_by_ddp():
    """``--sizes``: each preset builds a TinyGPT of the size it is named for (within 10 %), replaces the model flags,
    and the summary gives each system's ms/step and its ratio to ddp-fused at that size."""
    sys.path[:0] = [str(ROOT / "benchmarks")]
    try:
        import torch

        import bench_memory as bm
        from models import build
    finally:
        del sys.path[:2]
    named = {"7M": 7e6, "58M": 58e6, "162M": 162e6}
    assert list(bm.SIZES) == list(named)
    args = bm.parse_args(["--sizes", "7M,58M,162M", "--systems", "ddp-fused,fzero-s2d"])
    for size, n in named.items():
        sized = bm.with_size(args, size)
        with torch.device("meta"):
            count = sum(p.numel() for p in build("tiny", bm.config_of(sized)).parameters())
        assert abs(count - n) <= 0.1 * n, (size, count)
        assert "--d-model" in bm.model_args(sized) and sized.sizes == []
    with pytest.raises(SystemExit):
        bm.parse_args(["--sizes", "9M"])
    row = lambda ms: {"ranks": [{"ms": ms}]}  # noqa: E731
    table = bm.format_sizes({"7M": {"ddp-fused": row(100.0), "fzero-s2d": row(125.0)},
                             "58M": {"ddp-fused": row(1000.0), "fzero-s2d": {"error": "died"}}})
    lines = {ln.split()[0]: ln for ln in table.splitlines()[3:]}
    assert "125.0 (1.25x)" in lines["fzero-s2d"] and lines["fzero-s2d"].rstrip().endswith("-")
    assert "100.0 (1.00x)" in lines["ddp-fused"] and "1000.0 (1.00x)" in lines["ddp-fused"]


def _bench_memory():
    sys.path[:0] = [str(ROOT / "benchmarks")]
    try:
        import bench_memory as bm
    finally:
        del sys.path[:1]
    return bm


def test_the_table_adds_the_cuda_allocator_columns_only_for_a_state_on_cuda():
    """A system whose state was on a GPU (a rank's result has ``cuda``) gets the caching
    allocator's four columns, max over the ranks; a CPU table keeps its 12 numbers and header."""
    bm = _bench_memory()
    mib = 2**20
    census = {k: 1.0 * mib for k in ("state", "new st.", "module", "other", "total")} | {"missed": 0}

    def rank(cuda=None):
        r = {"init_peak": 10 * mib, "step_peak": 20 * mib, "held": 5 * mib, "heap": 4 * mib, "ms": 1.0,
             "faults": 0, "census": census, "note": ""}
        return r | ({"cuda": cuda} if cuda else {})

    args = bm.parse_args(["--systems", "ddp"])
    number = r"\s+-?\d+\.\d+"
    cpu = bm.format_table(args, {"ddp": {"ranks": [rank(), rank()]}}).splitlines()
    assert "cu " not in cpu[0] and cpu[0].split()[1:] == ["init", "peak", "step", "peak", "held", "heap", "ms/step",
                                                          "kflt/step", "state", "new", "st.", "module", "other",
                                                          "total", "/peak", "note"]
    assert re.fullmatch(f"ddp({number}){{12}}\\s*", cpu[2]), cpu[2]
    cuda = [{"init_peak": 3 * mib, "step_peak": 7 * mib, "held": 2 * mib, "reserved": 8 * mib},
            {"init_peak": 4 * mib, "step_peak": 6 * mib, "held": 1 * mib, "reserved": 9 * mib}]
    gpu = bm.format_table(args, {"ddp": {"ranks": [rank(cuda[0]), rank(cuda[1])]}}).splitlines()
    assert [c for c, _ in bm.CUDA_COLUMNS] == ["cu init", "cu step", "cu held", "cu resv"]
    assert gpu[0].rstrip().endswith("cu init   cu step   cu held   cu resv  note")
    assert gpu[2].split()[-4:] == ["4.0", "7.0", "2.0", "9.0"]  # max over the ranks
    assert re.fullmatch(f"ddp({number}){{16}}\\s*", gpu[2]), gpu[2]
