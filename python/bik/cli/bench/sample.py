"""`bik bench sample`: bik.sample against torch softmax + multinomial and against argmax.

Model: the sampler reads the logits once (B * V * itemsize bytes); ``bik_gbps`` is that over
bik's p50 time, ``copy_gbps`` the measured bandwidth of a device copy of the same logits (read +
write bytes over its time), and ``frac_of_copy`` their ratio (the issue's target on the H200:
>= 0.8 at B >= 64, V >= 128k, temperature-only and top-p 0.9). ``bik_rows_identical``: row 0
(the same request at every B) drew the same token at every B. On a GPU ``bik_device_ms`` (the
kernels' own time) and ``bik_graph_ms`` (a CUDA-graph replay) come from
bik.cli.timing.breakdown_ms: the op time minus those is host overhead.
"""

from __future__ import annotations

import torch
from rich.console import Console
from rich.progress import track
from rich.table import Table

import bik
from bik._dtypes import dtype_name
from bik.cli.bench.stream import emit
from bik.cli.bench.sweep import per_backend
from bik.cli.common import print_table
from bik.cli.timing import breakdown_ms, noisy, time_ms

BACKEND_OP = "sample"  # --backend chooses among this op's backends

GPU_BS = (1, 8, 64, 256, 1024)
GPU_VOCABS = (32000, 128256, 262144)
CPU_BS = (1, 16, 64)
CPU_VOCABS = (32000,)
TOP_PS = (1.0, 0.9)  # temperature only, then top-p (the two sampler targets)


def bench_sample(device, dtype, backend, quick: bool, bs=None) -> list[dict]:
    on_gpu = device.type == "cuda"
    vocabs = (1000,) if quick else GPU_VOCABS if on_gpu else CPU_VOCABS
    bs = bs or ((1, 4) if quick else GPU_BS if on_gpu else CPU_BS)
    records = []
    for v in track(list(vocabs), description="sample", transient=True):
        gen = torch.Generator().manual_seed(v)
        pool = (torch.randn(max(bs), v, generator=gen) * 3).to(dtype=dtype, device=device)
        for top_p in TOP_PS:
            first = []
            for b in bs:
                x = pool[:b]
                pos = torch.arange(b, device=device)

                def run(x=x, pos=pos, top_p=top_p):
                    return bik.sample(x, seed=1, position=pos, temperature=1.0, top_p=top_p,
                                      backend=backend)

                first.append(run().tokens[0].item())
                t_bik = time_ms(run, device)
                t_mult = time_ms(lambda x=x: torch.multinomial(torch.softmax(x.float(), -1), 1),
                                 device)
                t_argmax = time_ms(lambda x=x: x.argmax(-1), device)
                t_copy = time_ms(lambda x=x: x.clone(), device)
                nbytes = x.numel() * x.element_size()
                bik_gbps = nbytes / t_bik["p50"] / 1e6
                copy_gbps = 2 * nbytes / t_copy["p50"] / 1e6
                records.append(emit({
                    "op": "sample", "B": b, "V": v, "top_p": top_p, "dtype": dtype_name(dtype),
                    "bik_ms": t_bik, "multinomial_ms": t_mult, "argmax_ms": t_argmax,
                    "copy_ms": t_copy, "bik_gbps": bik_gbps, "copy_gbps": copy_gbps,
                    "frac_of_copy": bik_gbps / copy_gbps,
                    "speedup_vs_multinomial": t_mult["p50"] / t_bik["p50"],
                    "noisy": noisy(t_bik, t_mult),
                } | {f"bik_{k}": v for k, v in breakdown_ms(run, device).items()}))
            for rec in records[-len(bs):]:
                rec["bik_rows_identical"] = len(set(first)) == 1
    return records


def render_sample(records: list[dict], console: Console) -> None:
    table = Table(title=f"sample ({records[0]['dtype']} logits, temperature 1)")
    with_backend = "backend" in records[0]
    if with_backend:
        table.add_column("backend")
    for col in ("V", "top-p", "B", "bik ms", "softmax+multinomial ms", "argmax ms", "bik GB/s",
                "of copy", "row 0 same", ""):
        table.add_column(col, justify="right")
    for r in records:
        table.add_row(*([r["backend"]] if with_backend else []), str(r["V"]),
                      str(r.get("top_p", 1.0)), str(r["B"]),
                      f"{r['bik_ms']['p50']:.3f}",
                      f"{r['multinomial_ms']['p50']:.3f}", f"{r['argmax_ms']['p50']:.3f}",
                      f"{r['bik_gbps']:.1f}", f"{r['frac_of_copy']:.2f}",
                      "yes" if r["bik_rows_identical"] else "[red]NO",
                      "[yellow]noisy" if r["noisy"] else "")
    print_table(console, table, keys=3 + int(with_backend))


def run(device, dtype, args) -> list[dict]:
    return per_backend("sample", args.backend, device,
                       lambda be: bench_sample(device, dtype, be, args.quick, args.ms))


render = render_sample
plot = None  # a handful of rates per vocabulary: the table and --json hold them
