"""The M sweep shared by `bik bench matmul` and `bik bench rmsnorm`: time bik and torch on the
first M rows of one pool for each M, check that row 0 keeps its bits, render one table and one
plot. ``speedup`` is torch time / bik time (1.0 = as fast as torch). On a GPU, at
``BREAKDOWN_MS``, the records also hold each side's device time and CUDA-graph replay
(bik.cli.timing.breakdown_ms): the op time minus those is host overhead."""

from __future__ import annotations

import torch
from rich.console import Console
from rich.table import Table

from bik.cli.bench.stream import emit, tags
from bik.cli.common import print_table
from bik.cli.timing import breakdown_ms, noisy, time_ms
from bik.ops._registry import resolve_backend

GPU_MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
CPU_MS = (1, 16, 64, 256)
# The Ms whose device time and CUDA-graph replay are recorded too (on a GPU; each costs a
# profiled run and a graph capture).
BREAKDOWN_MS = (1, 8, 64, 512)


def default_ms(args, device) -> tuple[int, ...]:
    return args.ms or ((1, 3, 16) if args.quick else GPU_MS if device.type == "cuda" else CPU_MS)


def backends_for(op: str, backend: str | None, device) -> list[str]:
    """The backends a bench compares: the one asked for, else by device; on a GPU "triton" and,
    when the op has it and it can run here, "cuda" side by side."""
    if backend is not None:
        return [backend]
    if device.type != "cuda":
        return [resolve_backend(op, None, device)]
    try:
        resolve_backend(op, "cuda", device)
    except Exception:  # noqa: BLE001 - not built, no driver, not implemented: compare Triton only
        return ["triton"]
    return ["triton", "cuda"]


def per_backend(op: str, backend: str | None, device, bench) -> list[dict]:
    """``bench(be)``'s records for each backend :func:`backends_for` picks, each tagged with
    its backend (and so are the records it streams meanwhile: bik.cli.bench.stream)."""
    records = []
    for be in backends_for(op, backend, device):
        with tags(backend=be):
            records += [r | {"backend": be} for r in bench(be)]
    return records


def _row_bits_stable(outputs: list[torch.Tensor]) -> bool:
    """Row 0 (the same input row at every M) has the same bits at every M."""
    return all(torch.equal(outputs[0][0], out[0]) for out in outputs[1:])


def sweep(device, pool, ms, bik_fn, torch_fn, work, base: dict) -> list[dict]:
    """Time bik_fn and torch_fn on pool[:M] for each M; ``work(m)`` -> (rate key, units)."""
    records, bik_out, torch_out = [], [], []
    for m in ms:
        rows = pool[:m]
        bik_out.append(bik_fn(rows))
        torch_out.append(torch_fn(rows))
        t_bik = time_ms(lambda rows=rows: bik_fn(rows), device)
        t_torch = time_ms(lambda rows=rows: torch_fn(rows), device)
        key, units = work(m)  # units per ms -> TFLOP/s or GB/s after the 1e9 / 1e6 scaling
        rec = base | {
            "M": m, "bik_ms": t_bik, "torch_ms": t_torch,
            f"bik_{key}": units / t_bik["p50"], f"torch_{key}": units / t_torch["p50"],
            "speedup": t_torch["p50"] / t_bik["p50"], "noisy": noisy(t_bik, t_torch),
        }
        if m in BREAKDOWN_MS:
            for name, fn in (("bik", bik_fn), ("torch", torch_fn)):
                rec |= {f"{name}_{k}": v
                        for k, v in breakdown_ms(lambda rows=rows, fn=fn: fn(rows), device).items()}
        records.append(emit(rec))
    for rec in records:
        rec["bik_rows_identical"] = _row_bits_stable(bik_out)
        rec["torch_rows_identical"] = _row_bits_stable(torch_out)
    return records


def render_sweep(records: list[dict], console: Console) -> None:
    is_mm = records[0]["op"] == "matmul"
    table = Table(title=f"{records[0]['op']} ({records[0]['dtype']})")
    with_backend = "backend" in records[0]
    if with_backend:
        table.add_column("backend")
    for col in (["N x K"] if is_mm else ["H"]) + ["M", "bik ms", "torch ms",
                                                   "bik TFLOP/s" if is_mm else "bik GB/s",
                                                   "speedup", "bik rows same", "torch rows same",
                                                   ""]:
        table.add_column(col, justify="right")
    for r in records:
        rate = f"{r['bik_tflops']:.2f}" if is_mm else f"{r['bik_gbps']:.1f}"
        backend = r.get("backend", "") + (f" split={r['split']}" if "split" in r else "")
        table.add_row(*([backend] if with_backend else []),
                      f"{r['N']}x{r['K']}" if is_mm else str(r["H"]), str(r["M"]),
                      f"{r['bik_ms']['p50']:.3f}", f"{r['torch_ms']['p50']:.3f}", rate,
                      f"{r['speedup']:.2f}", "yes" if r["bik_rows_identical"] else "[red]NO",
                      "yes" if r["torch_rows_identical"] else "no",
                      "[yellow]noisy" if r["noisy"] else "")
    print_table(console, table, keys=2 + int(with_backend))


def plot_sweep(records: list[dict], plt, path: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    if records[0]["op"] == "matmul":
        key = lambda r: (f"{r.get('backend', 'bik')} {r.get('split', '')} "
                         f"{r['N']}x{r['K']}")
    else:
        key = lambda r: f"{r.get('backend', 'bik')} H={r['H']}"
    for label in dict.fromkeys(key(r) for r in records):
        rows = [r for r in records if key(r) == label]
        ax.plot([r["M"] for r in rows], [r["speedup"] for r in rows], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")  # one outlier ratio must not flatten the rest
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("M (rows in the batch)")
    ax.set_ylabel("torch time / bik time")
    ax.set_title(f"bik {records[0]['op']} vs torch ({records[0]['dtype']})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
