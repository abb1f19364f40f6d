"""Shared test settings: hypothesis profile with a fixed seed (no flaky property tests); under
pytest-xdist (``-n auto`` in pyproject.toml) each worker takes its share of the cores for
torch's threads, so the workers do not oversubscribe them."""

import os

import torch
from hypothesis import HealthCheck, settings

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))

settings.register_profile(
    "ci", derandomize=True, deadline=None, max_examples=40,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("ci")
