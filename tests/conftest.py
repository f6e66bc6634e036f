"""Shared test configuration.

Hypothesis profiles: ``ci`` (default; derandomized, so CI is deterministic and
bounded) and ``long`` (many more examples, for local runs:
``FZERO_HYPOTHESIS_PROFILE=long pytest``; it also runs the whole of the matrices CI
samples, ``LONG``).
"""

import os
import re
import tempfile

# torch.compile's on-disk cache, one per CPU kernel set the suite runs with (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA),
# unless the caller chose one: on an Intel host, an ATEN_CPU_CAPABILITY=avx2 run under pytest-xdist that finds the
# kernels an AVX-512 run left in torch's default cache gives compiled steps wrong numbers and crashes gloo ranks
# (torch 2.13; with a cache of its own, or run serially, the same tests pass). Set before torch is imported, so that
# the torchrun ranks the tests start inherit it.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    _isa = "-".join(os.environ.get(k, "native") for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"fzero-tests-inductor-{os.getuid() if hasattr(os, 'getuid') else 'user'}-"
        + re.sub(r"[^A-Za-z0-9_.-]", "_", _isa))

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=30,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "long",
    max_examples=1000,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("FZERO_HYPOTHESIS_PROFILE", "ci"))

# Keep CPU tests reproducible and light on a 2-core machine: under pytest-xdist (the README's
# `-n 2`) the workers already fill both cores, and a second intra-op thread each would only
# contend for them.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, torch.get_num_threads()))


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module's tests (``pytestmark = pytest.mark.usefixtures("one_thread")``):
    the gloo workers run with one, and so must everything whose bits are compared with them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Test files whose module-scoped launches run for minutes, longest first: they are handed out
# first. CI runs the suite as `-n 2 --dist loadfile`; xdist would otherwise order files by
# their number of tests, and the long-run memory launch (then one file of 12 tests, about 5
# minutes beside another worker) started last in measured runs, one worker running it alone
# at the end. It is now two launches in two files, one per worker at the start.
START_FIRST = (
    "test_long_run_memory_eager.py", "test_long_run_memory_compiled.py", "test_stage3_modules.py", "test_zero3.py", "test_distributed.py",
    "test_checkpoint_fuzz.py", "test_checkpoint.py", "test_unused_params.py", "test_unit_calls.py",
    "test_torch_optim_rules.py", "test_user_models_gloo.py",
)


def pytest_configure(config):  # noqa: ANN001, ANN201
    # keep the collection order below under --dist loadfile (xdist >= 3.6 reorders by count)
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):  # noqa: ANN001, ANN201
    def rank(item) -> int:  # noqa: ANN001
        name = item.path.name
        return START_FIRST.index(name) if name in START_FIRST else len(START_FIRST)

    items.sort(key=rank)  # stable: the order inside each file, and among the others, is kept
