"""``benchmarks/bench_gpu.py --tiny --device cpu`` runs every row and passes each, and its verdicts can fail.

The smoke test runs the script in a subprocess of its own session, killed with it past ``TIMEOUT`` (the script's
torchrun rank ends itself once the script is gone, and the script kills its launch past ``--timeout``). The script
takes about 25 s on a quiet 2-core machine (the CPU time is mostly dynamo tracing the compiled rows; the launch runs
beside the numerics), longer while other jobs share the cores. The other tests call the script's verdicts directly on
made-up results, in this process, in about a second.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.distributed  # the script launches torchrun (gloo)

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 150  # the script's own bound on its launch (--timeout) comes first
NUMERICS = [f"SimulatedWorld({w}) s{s} {m}" for w in (2, 8) for s in (1, 2, 3) for m in ("eager", "donate", "compiled")]
TORCHRUN = [f"torchrun W=1 s{s} eager" for s in (1, 2, 3)]
FZERO = [f"fzero s{s} {how}" for how in ("eager", "compiled") for s in (1, 2, 3)]
PERF = ["torch AdamW(fused)", "FSDP2 W=1", *FZERO]


def _bench():
    sys.path[:0] = [str(ROOT / "benchmarks")]
    try:
        import bench_gpu
    finally:
        del sys.path[0]
    return bench_gpu


def _run(args: list[str]) -> subprocess.CompletedProcess:
    """The script in a new session; past ``TIMEOUT`` the whole session is killed and the test fails."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py"), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"bench_gpu.py {' '.join(args)} ran past {TIMEOUT} s and was killed:\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _table(out: str) -> dict[str, dict[str, str]]:
    """The markdown table's rows by name: ``{row: {column: cell}}``."""
    lines = [ln for ln in out.splitlines() if ln.startswith("|")]
    assert len(lines) > 2, out
    cells = lambda ln: [c.strip() for c in ln.strip().strip("|").split("|")]  # noqa: E731
    head = cells(lines[0])
    assert set(lines[1].replace("|", "")) == {"-"}, lines[1]
    rows = [dict(zip(head, cells(ln))) for ln in lines[2:]]
    assert all(len(r) == len(head) for r in rows), rows
    return {r["row"]: r for r in rows}


def test_tiny_cpu_run_passes_every_row():
    proc = _run(["--tiny", "--device", "cpu"])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = _table(proc.stdout)
    assert list(rows) == NUMERICS + TORCHRUN + PERF, list(rows)
    not_passing = {k: r["verdict"] + " " + r["note"] for k, r in rows.items() if r["verdict"] != "PASS"}
    assert not not_passing, not_passing
    for name in NUMERICS:
        assert float(rows[name]["max abs diff"]) <= 1e-5 and rows[name]["tol"] == "1e-05", rows[name]
    for name in (n for n in NUMERICS if n.endswith("compiled")):
        assert re.match(r"[1-9]\d* graph\(s\)", rows[name]["note"]), rows[name]
    for name in TORCHRUN:
        assert rows[name]["bitwise"] == "yes" and float(rows[name]["max abs diff"]) == 0.0, rows[name]
    losses = [float(rows[n]["last loss"]) for n in PERF]
    assert all(math.isfinite(x) and abs(x - losses[0]) <= 0.05 * losses[0] for x in losses), losses
    for name in PERF:
        assert float(rows[name]["median ms/step"]) > 0 and float(rows[name]["state MiB"]) > 0, rows[name]
        assert rows[name]["peak MiB"] == "n/a" and rows[name]["reserved MiB"] == "n/a", rows[name]  # the CPU's
    for name in FZERO:  # the state the step left holds what memory_report says it holds
        state, report = float(rows[name]["state MiB"]), float(rows[name]["memory_report held MiB"])
        assert abs(state - report) <= 0.1 * report + 0.1, rows[name]
    foot = proc.stdout.split("\n\n", 1)[1]
    assert "n/a on the CPU" in foot and "29/29 rows PASS" in foot, foot


def test_a_numerics_row_that_differs_fails_and_the_script_exits_non_zero(monkeypatch, capsys):
    """One world, stage and mode (fast), against an oracle with one element moved by 1e-4: FAIL, exit 1."""
    bench = _bench()
    monkeypatch.setattr(bench, "WORLDS", (2,))
    monkeypatch.setattr(bench, "STAGES", (1,))
    monkeypatch.setattr(bench, "MODES", ("eager",))
    oracle = bench.oracle_params

    def moved(*args, **kwargs):
        params = oracle(*args, **kwargs)
        name = next(iter(params))
        params[name] = params[name].clone()
        params[name].view(-1)[0] += 1e-4
        return params

    monkeypatch.setattr(bench, "oracle_params", moved)
    threads = torch.get_num_threads()
    try:
        assert bench.main(["--tiny", "--device", "cpu", "--only", "numerics"]) == 1
    finally:
        torch.set_num_threads(threads)
    rows = _table(capsys.readouterr().out)
    row = rows["SimulatedWorld(2) s1 eager"]
    assert row["verdict"] == "FAIL" and row["bitwise"] == "no", row
    assert 0.5e-4 < float(row["max abs diff"]) < 2e-4, row


def test_compare_sees_every_rank_row():
    bench = _bench()
    want = {"w": torch.tensor([1.0, 2.0])}
    assert bench.compare({"w": torch.tensor([[1.0, 2.0], [1.0, 2.0]])}, want) == (0.0, True)
    diff, same = bench.compare({"w": torch.tensor([[1.0, 2.0], [1.0, 2.5]])}, want)  # rank 1 differs
    assert diff == 0.5 and not same


def test_perf_rows_fail_on_a_loss_that_trained_something_else_and_name_missing_rows():
    bench = _bench()
    names = bench.perf_names()
    done = [dict(vars(bench.Row(n, "perf", verdict="PENDING", loss=5.0))) for n in names[:3]]
    done[2]["loss"] = 5.5  # 10 % off plain torch's
    rows = {r.name: r for r in bench.perf_rows({"perf": done}, "launch exited 1")}
    assert [rows[n].verdict for n in names[:3]] == ["PASS", "PASS", "FAIL"]
    assert all(rows[n].verdict == "ERROR" and rows[n].note == "launch exited 1" for n in names[3:])
    nan = [dict(vars(bench.Row(n, "perf", verdict="PENDING", loss=float("nan")))) for n in names]
    assert all(r.verdict == "FAIL" for r in bench.perf_rows({"perf": nan}, ""))
