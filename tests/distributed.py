"""Running a test's worker on 2 CPU processes (gloo), failing the test if a rank hangs."""

import time

import pytest
import torch


def run_ranks(worker, args: tuple, seconds: float, nprocs: int = 2) -> None:
    """``worker(rank, *args)`` on ``nprocs`` processes; a rank still running after ``seconds``
    is killed and the test fails (instead of the suite hanging)."""
    ctx = torch.multiprocessing.spawn(worker, nprocs=nprocs, join=False, args=args)
    deadline = time.monotonic() + seconds
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"distributed workers did not finish within {seconds:g} s")
