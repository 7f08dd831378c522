"""`bik bench matmul|rmsnorm|attention|sample|boundary`: bik vs torch, plus a bit-identity check.

Attention's runner, table and plot live in bik.cli.bench.attention; the sampler's in
bik.cli.bench.sample.

Runners return plain records (dicts); one printer renders them as a table, JSON and a plot.
Models: matmul moves 2*M*N*K flops (TFLOP/s); RMSNorm moves 2*M*H*itemsize bytes plus the
weight (GB/s). ``speedup`` is torch time / bik time (1.0 = as fast as torch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import track
from rich.table import Table

import bik
from bik._dtypes import dtype_name
from bik.cli.common import DTYPES, make_console, pick_device, run_metadata, write_json
from bik.cli.timing import time_ms
from bik.ops._registry import resolve_backend

# Llama-3-8B: qkv, o, gate/up, down, LM head (N x K of the weight [N, K]).
LLAMA_MATMUL = ((4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336), (128256, 4096))
LLAMA_HIDDEN = (4096, 8192)
GPU_MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
CPU_MS = (1, 16, 64, 256)
CPU_MATMUL = LLAMA_MATMUL[:2] + ((1024, 1024),)  # the big ones take minutes on two cores


def _row_bits_stable(outputs: list[torch.Tensor]) -> bool:
    """Row 0 (the same input row at every M) has the same bits at every M."""
    return all(torch.equal(outputs[0][0], out[0]) for out in outputs[1:])


def _sweep(device, pool, ms, bik_fn, torch_fn, work, base: dict) -> list[dict]:
    """Time bik_fn and torch_fn on pool[:M] for each M; ``work(m)`` -> (rate key, units)."""
    records, bik_out, torch_out = [], [], []
    for m in ms:
        rows = pool[:m]
        bik_out.append(bik_fn(rows))
        torch_out.append(torch_fn(rows))
        t_bik = time_ms(lambda rows=rows: bik_fn(rows), device)
        t_torch = time_ms(lambda rows=rows: torch_fn(rows), device)
        key, units = work(m)  # units per ms -> TFLOP/s or GB/s after the 1e9 / 1e6 scaling
        records.append(base | {
            "M": m, "bik_ms": t_bik, "torch_ms": t_torch,
            f"bik_{key}": units / t_bik["p50"], f"torch_{key}": units / t_torch["p50"],
            "speedup": t_torch["p50"] / t_bik["p50"],
        })
    for rec in records:
        rec["bik_rows_identical"] = _row_bits_stable(bik_out)
        rec["torch_rows_identical"] = _row_bits_stable(torch_out)
    return records


def bench_matmul(device, dtype, backend, ms, shapes) -> list[dict]:
    records = []
    for n, k in track(list(shapes), description="matmul", transient=True):
        gen = torch.Generator().manual_seed(n * 7 + k)
        weight = torch.randn(n, k, generator=gen).to(dtype=dtype, device=device) / k**0.5
        pool = torch.randn(max(ms), k, generator=gen).to(dtype=dtype, device=device)
        records += _sweep(device, pool, ms,
                          lambda a, w=weight: bik.linear(a, w, backend=backend),
                          lambda a, w=weight: F.linear(a, w),
                          lambda m, n=n, k=k: ("tflops", 2.0 * m * n * k / 1e9),
                          {"op": "matmul", "N": n, "K": k, "dtype": dtype_name(dtype)})
    return records


def bench_rms_norm(device, dtype, backend, ms, hiddens) -> list[dict]:
    records = []
    for hidden in track(list(hiddens), description="rmsnorm", transient=True):
        gen = torch.Generator().manual_seed(hidden)
        weight = torch.randn(hidden, generator=gen).to(dtype=dtype, device=device)
        pool = torch.randn(max(ms), hidden, generator=gen).to(dtype=dtype, device=device)
        itemsize = pool.element_size()
        records += _sweep(device, pool, ms,
                          lambda x, w=weight: bik.rms_norm(x, w, backend=backend),
                          lambda x, w=weight, h=hidden: F.rms_norm(x, (h,), w, 1e-6),
                          lambda m, h=hidden, b=itemsize: ("gbps", (2 * m * h + h) * b / 1e6),
                          {"op": "rms_norm", "H": hidden, "dtype": dtype_name(dtype)})
    return records


def bench_boundary(device, dtype, backend) -> list[dict]:
    """What the op boundary costs: public wrapper vs registered op vs the bare launcher."""
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


def _render(records: list[dict], console: Console) -> None:
    if records[0]["op"] == "attention":
        from bik.cli.bench.attention import render_attention

        return render_attention(records, console)
    if records[0]["op"] == "sample":
        from bik.cli.bench.sample import render_sample

        return render_sample(records, console)
    if records[0]["op"] == "boundary":
        table = Table(title="op boundary (M=1, N=K=16)")
        table.add_column("call")
        table.add_column("p50 µs", justify="right")
        for r in records:
            table.add_row(r["call"], f"{r['us']:.1f}")
        console.print(table)
        return
    is_mm = records[0]["op"] == "matmul"
    table = Table(title=f"{records[0]['op']} ({records[0]['dtype']})")
    with_backend = "backend" in records[0]
    if with_backend:
        table.add_column("backend")
    for col in (["N x K"] if is_mm else ["H"]) + ["M", "bik ms", "torch ms",
                                                   "bik TFLOP/s" if is_mm else "bik GB/s",
                                                   "speedup", "bik rows same", "torch rows same"]:
        table.add_column(col, justify="right")
    for r in records:
        rate = f"{r['bik_tflops']:.2f}" if is_mm else f"{r['bik_gbps']:.1f}"
        table.add_row(*([r["backend"]] if with_backend else []),
                      f"{r['N']}x{r['K']}" if is_mm else str(r["H"]), str(r["M"]),
                      f"{r['bik_ms']['p50']:.3f}", f"{r['torch_ms']['p50']:.3f}", rate,
                      f"{r['speedup']:.2f}", "yes" if r["bik_rows_identical"] else "[red]NO",
                      "yes" if r["torch_rows_identical"] else "no")
    console.print(table)


def _plot(records: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit(f"bik bench --plot needs matplotlib (pip install 'bik[plot]'): {exc}")
    if records[0]["op"] == "attention":
        from bik.cli.bench.attention import plot_attention

        return plot_attention(records, plt, path)
    fig, ax = plt.subplots(figsize=(7, 4))
    if records[0]["op"] == "matmul":
        key = lambda r: f"{r.get('backend', 'bik')} {r['N']}x{r['K']}"
    else:
        key = lambda r: f"{r.get('backend', 'bik')} H={r['H']}"
    for label in dict.fromkeys(key(r) for r in records):
        rows = [r for r in records if key(r) == label]
        ax.plot([r["M"] for r in rows], [r["speedup"] for r in rows], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("M (rows in the batch)")
    ax.set_ylabel("torch time / bik time")
    ax.set_title(f"bik {records[0]['op']} vs torch ({records[0]['dtype']})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _backends(backend: str | None, device) -> list[str]:
    """The backends a matmul/attention bench compares: the one asked for, else by device; on a
    GPU "triton" and, when it can run here, "cuda" side by side."""
    if backend is not None:
        return [backend]
    if device.type != "cuda":
        return [resolve_backend("matmul", None, device)]
    from bik.runtime import cuda_jit

    return ["triton", "cuda"] if cuda_jit.available() else ["triton"]


def run_bench(args) -> int:
    console = make_console()
    device = pick_device(args.device)
    on_gpu = device.type == "cuda"
    dtype = DTYPES[args.dtype or ("bf16" if on_gpu else "fp32")]
    if args.op == "dvr":
        from bik.cli.bench.dvr import bench_dvr, render_dvr

        records = bench_dvr(device, dtype, args.quick)
        render_dvr(records, console)
        if args.json:
            write_json(args.json, {"meta": run_metadata(device), "records": records})
        return 0
    if args.op == "boundary":
        records = bench_boundary(device, dtype, args.backend)
    elif args.op == "attention":
        from bik.cli.bench.attention import bench_attention

        records = [r | {"backend": be} for be in _backends(args.backend, device)
                   for r in bench_attention(device, dtype, be, args.quick, args.ms)]
    elif args.op == "sample":
        from bik.cli.bench.sample import bench_sample

        records = [r | {"backend": be} for be in _backends(args.backend, device)
                   for r in bench_sample(device, dtype, be, args.quick, args.ms)]
    elif args.op == "matmul":
        shapes = ((256, 128), (96, 33)) if args.quick else (LLAMA_MATMUL if on_gpu else CPU_MATMUL)
        ms = args.ms or ((1, 3, 16) if args.quick else GPU_MS if on_gpu else CPU_MS)
        records = [r | {"backend": be} for be in _backends(args.backend, device)
                   for r in bench_matmul(device, dtype, be, ms, shapes)]
    else:
        hiddens = (111, 256) if args.quick else LLAMA_HIDDEN
        ms = args.ms or ((1, 3, 16) if args.quick else GPU_MS if on_gpu else CPU_MS)
        records = [r | {"backend": be} for be in _backends(args.backend, device)
                   for r in bench_rms_norm(device, dtype, be, ms, hiddens)]
    _render(records, console)
    if args.json:
        write_json(args.json, {"meta": run_metadata(device), "records": records})
    if args.plot and records[0]["op"] not in ("boundary", "sample"):
        _plot(records, args.plot)
    stable = all(r.get("bik_rows_identical", True) for r in records)
    if not stable:
        console.print("[red]bik rows changed with the batch: this is a bug, please report it")
    return 0 if stable else 1
