"""Shared test configuration.

Hypothesis profiles: ``ci`` (default; derandomized, so CI is deterministic and
bounded) and ``long`` (many more examples, for local runs:
``FZERO_HYPOTHESIS_PROFILE=long pytest``).
"""

import os

import torch
from hypothesis import HealthCheck, settings

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

# Keep CPU tests reproducible and light on a 2-core machine.
torch.set_num_threads(min(2, torch.get_num_threads()))
