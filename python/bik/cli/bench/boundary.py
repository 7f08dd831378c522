"""`bik bench boundary`: what the op boundary costs (public wrapper vs registered op vs the bare
launcher), for a 1 x 16 x 16 matmul where the kernel itself is nearly free."""

from __future__ import annotations

import torch
from rich.console import Console
from rich.table import Table

import bik
from bik.cli.timing import time_ms
from bik.ops._registry import resolve_backend

__all__ = ["bench_boundary", "plot", "render", "run"]


def bench_boundary(device, dtype, backend) -> list[dict]:
    backend = resolve_backend("matmul", backend, device)
    a = torch.ones(1, 16, dtype=dtype, device=device)
    b = torch.ones(16, 16, dtype=dtype, device=device)
    calls = {
        "bik.matmul (wrapper + op)": lambda: bik.matmul(a, b, backend=backend),
        "torch.ops.bik.matmul": lambda: torch.ops.bik.matmul(a, b, None, None, backend),
        "torch.mm": lambda: torch.mm(a, b),
    }
    if backend == "cpu":
        from bik.ops.matmul.cpu import matmul_f32

        out = torch.empty(1, 16, device=device)
        a32, b32 = a.float(), b.float()
        calls["kernel only (cpu.matmul_f32)"] = lambda: matmul_f32(a32, b32, None, out)
    return [{"op": "boundary", "call": name, "us": time_ms(fn, device, budget_s=0.2,
                                                          max_reps=2000)["p50"] * 1e3}
            for name, fn in calls.items()]


def run(device, dtype, args) -> list[dict]:
    return bench_boundary(device, dtype, args.backend)


def render(records: list[dict], console: Console) -> None:
    table = Table(title="op boundary (M=1, N=K=16)")
    table.add_column("call")
    table.add_column("p50 µs", justify="right")
    for r in records:
        table.add_row(r["call"], f"{r['us']:.1f}")
    console.print(table)


plot = None  # four numbers: the table says it all
