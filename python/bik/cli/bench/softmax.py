"""`bik bench softmax`: bik.log_softmax and bik.softmax vs torch's over an M sweep, on rows of a
vocabulary (SmolLM2's 49152, Llama-3's 128256) and of attention scores (4096); reads and writes
2*M*n*itemsize bytes (GB/s). log_softmax is the sampler's normaliser (docs/design.md)."""

from __future__ import annotations

import torch
from rich.progress import track

import bik
from bik._dtypes import dtype_name
from bik.cli.bench.sweep import default_ms, per_backend, plot_sweep, render_sweep, sweep

BACKEND_OP = "log_softmax"  # --backend chooses among this op's backends (softmax's are the same)

LENGTHS = (4096, 49152, 128256)
OPS = {"log_softmax": (bik.log_softmax, torch.log_softmax), "softmax": (bik.softmax, torch.softmax)}


def bench_softmax(device, dtype, backend, ms, lengths) -> list[dict]:
    records = []
    for name, (bik_fn, torch_fn) in OPS.items():
        for n in track(list(lengths), description=name, transient=True):
            gen = torch.Generator().manual_seed(n)
            pool = (torch.randn(max(ms), n, generator=gen) * 4).to(dtype=dtype, device=device)
            itemsize = pool.element_size()
            records += sweep(device, pool, ms,
                             lambda x, f=bik_fn: f(x, -1, backend=backend),
                             lambda x, f=torch_fn: f(x, -1),
                             lambda m, n=n, b=itemsize: ("gbps", 2 * m * n * b / 1e6),
                             {"op": name, "H": n, "dtype": dtype_name(dtype)})
    return records


def run(device, dtype, args) -> list[dict]:
    lengths = (111, 1000) if args.quick else LENGTHS
    ms = default_ms(args, device)
    return per_backend("log_softmax", args.backend, device,
                       lambda be: bench_softmax(device, dtype, be, ms, lengths))


def render(records, console) -> None:
    for name in OPS:
        render_sweep([r for r in records if r["op"] == name], console)


plot = plot_sweep
