"""Memory over a long run on real ranks: flat, without ``gc.collect()``. The launch and the
checks of ``test_long_run_memory_eager.py`` and ``test_long_run_memory_compiled.py``.

A torchrun of 2 gloo ranks trains an MLP (about 0.08M parameters) for 1000
steps at stages 1-3, eager (one test file) and compiled (the other: two launches, so that
``-n 2 --dist loadfile`` runs them on both workers at once), and reads each rank's live malloc
bytes (``mallinfo2``) and RSS after steps 250, 500, 750 and 1000; steps 2-4 run with
Python's cyclic collector off, and what it then frees is checked too. A step whose
buffers stay in a reference cycle until Python's cyclic collector runs makes
the live heap grow step after step (it did: the gradient hooks at stages 1-2,
about 2 MB a step on a 7M-parameter model, and gloo's batched collectives at
stage 3, about 0.36 MB a step). The bound is in bytes a step, not a share of the
model: the 60 B a step it held on a 1.1M-parameter MLP (1/3 % of the model a
quarter) it holds on this smaller one, whose steps cost a third less (the
fixed overhead of a step is most of it).

Why the live heap and not RSS: glibc keeps freed memory and fragments it, so
RSS moves by megabytes whatever the program holds. Measured on the 1.1M MLP:
DDP's RSS moved by up to 4.3 MB between such readings (a whole model's worth),
a compiled fzero step's by up to 40 MB, both without growing. The live heap
moves only with what is allocated. ``benchmarks/bench_memory.py --long``
prints RSS and the live heap at GPT-2-small size.
"""

from __future__ import annotations

import pytest

from dist_harness import run_torchrun
from test_distributed import _case


def launch(keys: list[str]) -> list[dict]:
    """One torchrun of 2 gloo ranks: ``memory_growth`` for ``keys`` (of
    ``dist_worker.MEMORY_KEYS``); every rank's results, under ``"memory_growth"``."""
    # Its own processes: dynamo's caches filled by other cases' compiled steps would recompile
    # this one inside the measured steps. Without c10d's flight recorder, a ring buffer of
    # the last collectives (TORCH_FR_BUFFER_SIZE, 2000 entries by default) that fills during
    # the first thousand steps: measured on this MLP, it grew DDP's live heap by 1.6 kB a step
    # from step 500 to 1000 (and the first fzero loop of a process by 0.5 kB a step), then
    # nothing; with it off both stay within 20 B a step.
    case = f"memory_growth={','.join(keys)}"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TORCH_FR_BUFFER_SIZE", "0")
        results = run_torchrun(2, "dist_worker.py", [case], timeout=900)
    return [{"memory_growth": res[case]} for res in results]


def check_no_cyclic_garbage(readings: list[dict], key: str) -> None:
    """With Python's cyclic collector off, a step on a real rank leaves no tensor that only the
    collector could free (steps 2-4 of the long run: ``dist_cases.memory_growth``). (The
    gradient hooks once tied each step's leaves, and the gathered parameters they view, into a
    cycle, and so did gloo's batched collectives at stage 3.)"""
    for r, res in enumerate(_case(readings, "memory_growth")):
        got = {**res[key]["cyclic"], "model_bytes": res[key]["model_bytes"]}
        # a cycle holding a step's parameters or gradients holds at least a bucket of them;
        # compiled steps may leave a few bytes of 0-d tensors in dynamo's own cycles
        assert got["bytes"] < 0.01 * got["model_bytes"], (r, key, got)
        if not key.endswith("c"):
            assert got["tensors"] == 0, (r, key, got)


# The live heap's growth a step that is a leak: a step's smallest buffer is kilobytes; readings of a flat heap
# move by a few kB a quarter (measured up to 8 kB of 15 kB allowed)
LEAK_BYTES_PER_STEP = 60


def check_heap_growth(readings: list[dict], key: str) -> None:
    """A leak grows the heap in every quarter of the run; a one-time allocation (a library's
    lazily built table, an arena the allocator opens once: 6.7 MB once on one rank in a CI
    run, the readings before and after it flat) lands in one quarter only. So the median of
    the three quarters' growth is held to :data:`LEAK_BYTES_PER_STEP` a step (15 kB a quarter
    of 250 steps). Each reading is the lowest of three around its step
    (``dist_cases.memory_growth``): a buffer the backend frees a moment later is not counted."""
    for r, got in enumerate(_case(readings, "memory_growth")):
        one = got[key]
        heap = one["heap"]
        quarters = sorted(b - a for a, b in zip(heap, heap[1:]))
        assert quarters[1] < LEAK_BYTES_PER_STEP * one["steps"] // 4, (r, key, quarters, one)
