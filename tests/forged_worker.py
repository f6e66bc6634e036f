"""Every public reader of a checkpoint, run once each on one checkpoint root, in a process of its own (for
``tests/test_checkpoint_forged.py``): ``forged_worker.py ROOT OUT [HANG_S]``.

The readers, in this order: ``verify_checkpoint``, ``checkpoint_info``, ``load_checkpoint`` (into a template of the
state :func:`ckpt_worker.fresh` builds, on ``SimulatedWorld(2)``, as the checkpoint was saved), and the command line
in this process (``main(["verify", ROOT])``, ``main(["info", ROOT])``). Each line of ``OUT`` is a JSON object: one
``{"start": reader}`` before each reader, one result after it (``reader``, ``seconds``, ``ok``, ``type`` and
``checkpoint_error`` of what it raised, ``length`` and the first 300 characters of its message, ``value``: what it
returned, summarised; ``seconds`` of wall clock, ``cpu`` seconds of this process), and last ``{"peak_rss": bytes}`` (the process's peak: :func:`_peak_rss`). A reader still running
after ``HANG_S`` seconds (default 12) ends the process (``faulthandler``, which needs no GIL: a reader looping in C is
stopped too), its tracebacks on stderr: the last ``start`` line names it. The address space is capped 6 GiB above
what the process holds once ready, so a runaway allocation fails here rather than exhausting the host.
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import json
import resource
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import fzero
import fzero.checkpoint as ckpt
from ckpt_worker import fresh
from fzero.checkpoint.__main__ import main as cli

HEADROOM = 6 << 30  # bytes of address space a reader may add to what the process holds before it starts


def _summary(reader: str, value: Any) -> Any:
    """What a reader returned, as JSON: load, the extra entries and the table; info, what it says of the state."""
    if reader == "load_checkpoint":
        state, extra = value
        table = extra.get("table")
        flat = table.reshape(-1) if isinstance(table, torch.Tensor) else None
        return {"step": int(state.opt.step), "extra": sorted(extra),
                "table_shape": None if flat is None else list(table.shape),
                "table_is_arange": flat is not None and bool(torch.equal(flat, torch.arange(flat.numel())))}
    if reader == "checkpoint_info":
        return {"step": value["step"], "extra": value["extra"], "num_params": value["num_params"]}
    return value if isinstance(value, int) else None


def _peak_rss() -> int:
    """This process's peak resident bytes: ``VmHWM``, the high-water mark of its own memory map since exec (not
    ``ru_maxrss``, which Linux carries across fork and exec: the resident size of the parent that launched it)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _cli(argv: list[str]) -> Callable[[], dict[str, Any]]:
    def run() -> dict[str, Any]:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli(argv)
        return {"rc": rc, "stdout_lines": out.getvalue().count("\n"), "stderr": err.getvalue()}
    return run


def main(root: str, out: str, hang_s: float = 12.0) -> None:
    torch.set_num_threads(1)
    comm = fzero.SimulatedWorld(2)
    template = fresh(comm, seed=3)
    readers: dict[str, Callable[[], Any]] = {
        "verify_checkpoint": lambda: ckpt.verify_checkpoint(root),
        "checkpoint_info": lambda: ckpt.checkpoint_info(root),
        "load_checkpoint": lambda: ckpt.load_checkpoint(root, template, comm),
        "cli verify": _cli(["verify", root]),
        "cli info": _cli(["info", root]),
    }
    with open("/proc/self/status") as f:
        held = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (held + HEADROOM, resource.getrlimit(resource.RLIMIT_AS)[1]))
    with open(out, "w") as log:
        def write(row: dict[str, Any]) -> None:
            log.write(json.dumps(row) + "\n")
            log.flush()

        for name, fn in readers.items():
            write({"start": name})
            faulthandler.dump_traceback_later(hang_s, exit=True)
            t0, c0 = time.perf_counter(), time.process_time()
            row: dict[str, Any] = {"reader": name}
            try:
                value = fn()
            except BaseException as e:  # noqa: BLE001 - the test judges what it was
                row.update(ok=False, type=type(e).__name__, checkpoint_error=isinstance(e, ckpt.CheckpointError))
                text = str(e)
                row.update(length=len(text), message=text[:300])
            else:
                if name.startswith("cli"):
                    err = value["stderr"]
                    row.update(ok=value["rc"] == 0, rc=value["rc"], stdout_lines=value["stdout_lines"],
                               stderr_lines=err.count("\n"), length=len(err), message=err[:300])
                else:
                    row.update(ok=True, value=_summary(name, value))
            row.update(seconds=time.perf_counter() - t0, cpu=time.process_time() - c0)
            faulthandler.cancel_dump_traceback_later()
            write(row)
        write({"peak_rss": _peak_rss()})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *(float(a) for a in sys.argv[3:4]))
