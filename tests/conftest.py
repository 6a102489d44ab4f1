"""Shared test settings: a fixed hypothesis profile and a small, fixed thread count."""

from __future__ import annotations

import os
import tempfile

import torch
from hypothesis import HealthCheck, settings

# at these widths extra threads only contend: on a shared 2-core machine the property tests ran ~10x
# slower with 2 threads than with 1
torch.set_num_threads(1)

# engines built with enforce_eager=None read step-mode verdicts measured on this machine
# (mlakit/engine/warmup.py): none from the user's cache, so every test engine runs eager steps unless
# it asks otherwise (child processes inherit it)
os.environ["MLAKIT_STEP_MODES"] = os.path.join(tempfile.mkdtemp(prefix="mlakit-test-"), "step_modes.json")

settings.register_profile(
    "mlakit",
    max_examples=40,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("thorough", max_examples=400, deadline=None)
settings.load_profile(os.environ.get("MLAKIT_HYPOTHESIS_PROFILE", "mlakit"))
