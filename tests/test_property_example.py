"""examples/property_test.py runs as a script and its three properties hold."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_property_example_runs_as_a_script():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "property_test.py")], capture_output=True,
                         text=True, timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    for name in ("test_stages_equal_one_device", "test_inf_gradient_skips_step_bitwise",
                 "test_corrupted_all_gather_is_caught"):
        assert f"ok  {name}" in out.stdout, out.stdout
