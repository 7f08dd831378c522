"""Timers: triton.testing.do_bench on CUDA, a wall clock with repeats on the CPU."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

QUANTILES = (0.2, 0.5, 0.8)


def _quantiles(samples: list[float]) -> dict:
    if len(samples) == 1:
        return dict.fromkeys(("p20", "p50", "p80"), samples[0])
    cuts = statistics.quantiles(samples, n=10, method="inclusive")
    return {"p20": cuts[1], "p50": statistics.median(samples), "p80": cuts[7]}


def time_ms(fn: Callable[[], object], device: torch.device, *, budget_s: float = 0.25,
            max_reps: int = 50) -> dict:
    """p20/p50/p80 of one call's time in milliseconds."""
    if device.type == "cuda":
        from triton.testing import do_bench

        p20, p50, p80 = do_bench(fn, warmup=10, rep=50, quantiles=list(QUANTILES))
        return {"p20": p20, "p50": p50, "p80": p80}
    fn()  # warm-up: first-call allocation and lazy imports
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < max_reps and (len(samples) < 3 or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return _quantiles(samples)
