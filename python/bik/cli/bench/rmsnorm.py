"""`bik bench rmsnorm`: bik.rms_norm vs F.rms_norm over an M sweep (2*M*H*itemsize bytes plus
the weight, GB/s)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from rich.progress import track

import bik
from bik._dtypes import dtype_name
from bik.cli.bench.sweep import default_ms, per_backend, plot_sweep, render_sweep, sweep

BACKEND_OP = "rms_norm"  # --backend chooses among this op's backends

LLAMA_HIDDEN = (4096, 8192)


def bench_rms_norm(device, dtype, backend, ms, hiddens) -> list[dict]:
    records = []
    for hidden in track(list(hiddens), description="rmsnorm", transient=True):
        gen = torch.Generator().manual_seed(hidden)
        weight = torch.randn(hidden, generator=gen).to(dtype=dtype, device=device)
        pool = torch.randn(max(ms), hidden, generator=gen).to(dtype=dtype, device=device)
        itemsize = pool.element_size()
        records += sweep(device, pool, ms,
                         lambda x, w=weight: bik.rms_norm(x, w, backend=backend),
                         lambda x, w=weight, h=hidden: F.rms_norm(x, (h,), w, 1e-6),
                         lambda m, h=hidden, b=itemsize: ("gbps", (2 * m * h + h) * b / 1e6),
                         {"op": "rms_norm", "H": hidden, "dtype": dtype_name(dtype)})
    return records


def run(device, dtype, args) -> list[dict]:
    hiddens = (111, 256) if args.quick else LLAMA_HIDDEN
    ms = default_ms(args, device)
    return per_backend("rms_norm", args.backend, device,
                       lambda be: bench_rms_norm(device, dtype, be, ms, hiddens))


render = render_sweep
plot = plot_sweep
