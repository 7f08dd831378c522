"""Timers: triton.testing.do_bench on CUDA, a wall clock with repeats on the CPU."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

QUANTILES = (0.2, 0.5, 0.8)
NOISY = 1.5  # a timing whose p80 exceeds this times its p20 is flagged: its ratios are not firm


def noisy(*timings: dict | None) -> bool:
    """True when any of these p20/p50/p80 timings spreads past :data:`NOISY`."""
    return any(t is not None and t["p80"] > NOISY * t["p20"] for t in timings)


def _quantiles(samples: list[float]) -> dict:
    if len(samples) == 1:
        return dict.fromkeys(("p20", "p50", "p80"), samples[0])
    cuts = statistics.quantiles(samples, n=10, method="inclusive")
    return {"p20": cuts[1], "p50": statistics.median(samples), "p80": cuts[7]}


def quantiles_ms(samples_ms: list[float]) -> dict:
    """p20/p50/p80 of samples already taken (a bench that must run a fixed number of calls,
    e.g. a collective every rank times in lockstep)."""
    return _quantiles(samples_ms)


def median_call_ms(fn: Callable[[], object], budget_s: float = 0.05,
                   max_calls: int = 25) -> float:
    """One sample of an interleaved CPU bench: the median of at least 3 timed calls (as many as
    ``budget_s`` allows, at most ``max_calls``), in milliseconds."""
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_calls and (len(times) < 3 or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_ms(fn: Callable[[], object], device: torch.device, *, budget_s: float = 0.25,
            max_reps: int = 50, calls_per_sample: int = 1) -> dict:
    """p20/p50/p80 of one call's time in milliseconds.

    On the CPU a sample times ``calls_per_sample`` calls in a loop (and divides), so that
    microsecond calls are not swamped by the timer's own cost."""
    if device.type == "cuda":
        from triton.testing import do_bench

        p20, p50, p80 = do_bench(fn, warmup=10, rep=50, quantiles=list(QUANTILES))
        return {"p20": p20, "p50": p50, "p80": p80}
    for _ in range(max(1, calls_per_sample // 4)):
        fn()  # warm-up: first-call allocation, lazy imports, caches
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < max_reps and (len(samples) < 3 or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        for _ in range(calls_per_sample):
            fn()
        samples.append((time.perf_counter() - t0) * 1e3 / calls_per_sample)
    return _quantiles(samples)


def device_ms(fn: Callable[[], object], calls: int = 5) -> float:
    """GPU time per call (ms): the device time torch.profiler records for every kernel and copy
    ``calls`` calls launch, divided by ``calls``. Unlike a timed call it leaves out the host's
    launch overhead and the gaps it leaves on the stream."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total_us = sum(e.self_device_time_total for e in prof.key_averages())
    return total_us / calls / 1e3


def breakdown_ms(fn: Callable[[], object], device: torch.device) -> dict:
    """Where a call's time goes, next to :func:`time_ms` (the op time: each call launched from
    Python, host overhead included). On CUDA: ``device_ms`` (:func:`device_ms`: the kernels'
    own time) and
    ``graph_ms``, p20/p50/p80 of the call replayed from a CUDA graph
    (triton.testing.do_bench_cudagraph), or ``graph_error`` when the call cannot be captured
    (e.g. it copies host data or synchronises). Elsewhere: {} (no device time to separate)."""
    if device.type != "cuda":
        return {}
    from triton.testing import do_bench_cudagraph

    out: dict = {"device_ms": device_ms(fn)}
    try:
        p20, p50, p80 = do_bench_cudagraph(fn, rep=20, quantiles=list(QUANTILES))
        out["graph_ms"] = {"p20": p20, "p50": p50, "p80": p80}
    except Exception as exc:  # noqa: BLE001 - recorded: the bench goes on without a graph time
        out["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
        torch.cuda.synchronize()
    return out
