"""Memory over a long run on 2 gloo ranks, eager steps at stages 1-3: no cyclic garbage, and the
live heap flat from step 250 to step 1000 (the launch and the checks: ``long_run_memory.py``)."""

from __future__ import annotations

import pytest

from long_run_memory import check_heap_growth, check_no_cyclic_garbage, launch

pytestmark = pytest.mark.distributed

KEYS = ["s1", "s2", "s3"]


@pytest.fixture(scope="module")
def readings():
    return launch(KEYS)


@pytest.mark.parametrize("key", KEYS)
def test_gloo_steps_leave_no_cyclic_garbage(readings, key):
    check_no_cyclic_garbage(readings, key)


@pytest.mark.parametrize("key", KEYS)
def test_live_heap_from_step_250_to_1000_grows_less_than_60_bytes_a_step(readings, key):
    check_heap_growth(readings, key)
