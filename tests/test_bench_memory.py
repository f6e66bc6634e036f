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
