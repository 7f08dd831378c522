"""`bik bench boundary`: what the op boundary and the front ends cost per call, for a
1 x 64 x 64 matmul whose kernel is nearly free, and what an op the front ends do not route
pays while they are on; then (without --backend) the host µs per eager call of a decode step's
ops on every backend that runs here (bik/cli/bench/host_route.py).

Each sample times a loop of calls (the per-call time is the loop's over its length), so the
timer's own cost does not swamp microsecond calls; p20/p50/p80 over the samples are reported
and a row whose p80 exceeds 1.5 x its p20 is flagged as noisy. The issue's target (routed mm
within 2 x the raw kernel call) is shown as the ratio column.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

import bik
from bik.cli.bench.host_route import route_records
from bik.cli.common import print_table, progress
from bik.cli.timing import NOISY, time_ms
from bik.configs import matmul_split
from bik.ops._registry import resolve_backend

BACKEND_OP = "matmul"  # --backend chooses among this op's backends

LOOP = 200  # calls per sample


def _per_call_us(fn, device, budget_s: float) -> dict:
    ms = time_ms(fn, device, budget_s=budget_s, max_reps=200, calls_per_sample=LOOP)
    return {k: v * 1e3 for k, v in ms.items()}


def _kernel_call(a, b, out):
    """The CPU extension's matmul entry with precomputed arguments: the floor of any call."""
    from bik.runtime import cpu_ext

    ext = cpu_ext.require()
    args = (a.data_ptr(), a.stride(0), a.stride(1), b.data_ptr(), b.stride(0), b.stride(1), 0,
            out.data_ptr(), out.shape[1], a.shape[0], b.shape[1], a.shape[1],
            matmul_split(a.dtype, b.shape[1], a.shape[1]).split, torch.get_num_threads(),
            "auto", 0, 0, False, 1, 0, 0, 0, 0, False, "fma", cpu_ext.fp32_fma())

    def call(keep=(a, b, out)):  # the raw pointers are only valid while the tensors live
        return ext.matmul_f32(*args)

    return call


def bench_boundary(device, dtype, backend, budget_s: float = 0.3) -> list[dict]:
    backend = resolve_backend("matmul", backend, device)
    a = torch.randn(1, 64, device=device).to(dtype)
    b = torch.randn(64, 64, device=device).to(dtype)
    calls = {}
    if backend == "cpu" and dtype == torch.float32:
        calls["raw kernel call (extension)"] = _kernel_call(a, b, torch.empty(1, 64))
    calls |= {
        "torch.ops.bik.matmul": lambda: torch.ops.bik.matmul(a, b, None, None, backend),
        "bik.matmul": lambda: bik.matmul(a, b, backend=backend),
        "bik.linear": lambda: bik.linear(a, b, backend=backend),
        "torch.mm (stock)": lambda: torch.mm(a, b),
        "F.linear (stock)": lambda: F.linear(a, b),
    }
    fronts = {"bik.enabled()": bik.enabled, "batch_invariant_mode()": bik.batch_invariant_mode}
    # Once bik.enabled() has loaded the C++ dispatcher kernels, the CPU direct route runs them.
    loaded = {"bik.matmul, C++ kernels loaded": calls["bik.matmul"],
              "bik.linear, C++ kernels loaded": calls["bik.linear"]} if backend == "cpu" else {}
    records = []
    steps = len(calls) + 1 + 3 * len(fronts) + len(loaded)
    with torch.no_grad(), progress("bik bench boundary", steps) as advance:
        def timed(name, fn):
            records.append({"call": name, **_per_call_us(fn, device, budget_s)})
            advance()

        for name, fn in calls.items():
            timed(name, fn)
        timed("x + x (stock)", lambda: a + a)
        for front, ctx in fronts.items():
            with ctx():
                timed(f"torch.mm under {front}", lambda: torch.mm(a, b))
                timed(f"F.linear under {front}", lambda: F.linear(a, b))
                timed(f"x + x under {front}", lambda: a + a)
        for name, fn in loaded.items():
            timed(name, fn)
    floor = records[0]["p50"]
    for r in records:
        r.update(op="boundary", ratio=r["p50"] / floor, noisy=r["p80"] > NOISY * r["p20"],
                 floor=records[0]["call"])
    return records


def run(device, dtype, args) -> list[dict]:
    records = bench_boundary(device, dtype, args.backend)
    if args.backend is None:  # the route table covers every backend that runs here
        records += route_records(device, quick=args.quick)
    return records


def render(records: list[dict], console: Console) -> None:
    boundary = [r for r in records if r.get("table") != "route"]
    table = Table(title=f"op boundary, 1 x 64 x 64 matmul (ratio: p50 / {boundary[0]['floor']})")
    for col in ("call", "p20 µs", "p50 µs", "p80 µs", "ratio", ""):
        table.add_column(col, justify="left" if col in ("call", "") else "right")
    for r in boundary:
        table.add_row(r["call"], f"{r['p20']:.1f}", f"{r['p50']:.1f}", f"{r['p80']:.1f}",
                      f"{r['ratio']:.1f}x", "noisy" if r["noisy"] else "")
    print_table(console, table, keys=1)
    route = [r for r in records if r.get("table") == "route"]
    if not route:
        return
    table = Table(title="host µs per eager call, a Llama-3-8B decode step's ops (bf16)")
    for col in ("call", "backend", "how", "p20", "p50", "p80", "launches", ""):
        table.add_column(col, justify="left" if col in ("call", "backend", "how", "") else "right")
    for r in route:
        table.add_row(r["call"], r["backend"], r["how"], f"{r['p20']:.1f}", f"{r['p50']:.1f}",
                      f"{r['p80']:.1f}", "" if r["launches"] is None else str(r["launches"]),
                      "noisy" if r["noisy"] else "")
    print_table(console, table, keys=2)


plot = None  # a handful of numbers: the table says it all
