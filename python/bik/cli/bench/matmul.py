"""`bik bench matmul`: bik.linear vs F.linear over an M sweep (2*M*N*K flops, TFLOP/s; where a
device time is recorded, also the GB/s of the bytes a call must move: weight, rows in and out).

Each backend runs twice: with bik's K-split contract (``split: fixed``, the default) and with
the pure data-parallel one (``split: none``, BIK_MATMUL_SPLIT=none: one split over all of K),
so the table shows what each costs or gains per shape and M; ``--split fixed`` (or ``none``)
runs one of them.
"""

from __future__ import annotations

import contextlib
import itertools
import os

import torch
import torch.nn.functional as F
from rich.progress import track

import bik
from bik._dtypes import dtype_name
from bik.cli.bench.stream import tags
from bik.cli.bench.sweep import default_ms, per_backend, plot_sweep, render_sweep, sweep
from bik.configs import MATMUL_SPLIT_ENV

BACKEND_OP = "matmul"  # --backend chooses among this op's backends

# Llama-3-8B: qkv, o, gate/up, down, LM head (N x K of the weight [N, K]).
LLAMA_MATMUL = ((4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336), (128256, 4096))
CPU_MATMUL = LLAMA_MATMUL[:2] + ((1024, 1024),)  # the big ones take minutes on two cores


# Decode reads the weight: back-to-back calls on one 32 MiB weight would read it from the
# H200's 50 MiB L2. On a GPU each call takes the next of enough copies that together they
# exceed L2 several times over (bik and torch alike), so every time (op, device, graph replay
# of the captured call aside) is of a weight coming from HBM.
COLD_BYTES = 3 * 50 * 2**20
MAX_COPIES = 8


def weight_copies(weight: torch.Tensor) -> list[torch.Tensor]:
    """The copies a GPU bench cycles through (one on the CPU: no L2 to outrun)."""
    if weight.device.type != "cuda":
        return [weight]
    count = min(MAX_COPIES, max(1, -(-COLD_BYTES // weight.nbytes)))
    return [weight] + [weight.clone() for _ in range(count - 1)]


def bench_matmul(device, dtype, backend, ms, shapes) -> list[dict]:
    records = []
    for n, k in track(list(shapes), description="matmul", transient=True):
        gen = torch.Generator().manual_seed(n * 7 + k)
        weight = torch.randn(n, k, generator=gen).to(dtype=dtype, device=device) / k**0.5
        pool = torch.randn(max(ms), k, generator=gen).to(dtype=dtype, device=device)
        copies = weight_copies(weight)
        turn = itertools.count()

        def rotating(fn, copies=copies, turn=turn):
            return lambda a: fn(a, copies[next(turn) % len(copies)])

        size = weight.element_size()
        recs = sweep(device, pool, ms,
                     rotating(lambda a, w: bik.linear(a, w, backend=backend)),
                     rotating(F.linear),
                     lambda m, n=n, k=k: ("tflops", 2.0 * m * n * k / 1e9),
                     {"op": "matmul", "N": n, "K": k, "dtype": dtype_name(dtype),
                      "weight_copies": len(copies)})
        for r in recs:  # what a decode step reads: the weight, the rows in and out
            r["bytes"] = (n * k + r["M"] * (k + n)) * size
            for side in ("bik", "torch"):
                device_ms = r.get(f"{side}_device_ms")
                if device_ms:
                    r[f"{side}_device_gbps"] = r["bytes"] / device_ms / 1e6
        records += recs
        del copies
    return records


SPLIT_MODES = ("fixed", "none")


@contextlib.contextmanager
def split_mode(mode: str):
    """BIK_MATMUL_SPLIT for the block (matmul_split reads it at every call)."""
    before = os.environ.get(MATMUL_SPLIT_ENV)
    os.environ[MATMUL_SPLIT_ENV] = mode
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(MATMUL_SPLIT_ENV, None)
        else:
            os.environ[MATMUL_SPLIT_ENV] = before


def run(device, dtype, args) -> list[dict]:
    on_gpu = device.type == "cuda"
    shapes = ((256, 128), (96, 33)) if args.quick else (LLAMA_MATMUL if on_gpu else CPU_MATMUL)
    ms = default_ms(args, device)
    modes = (args.split,) if getattr(args, "split", None) else SPLIT_MODES

    def both_splits(be: str) -> list[dict]:
        records = []
        for mode in modes:
            with split_mode(mode), tags(split=mode):
                records += [r | {"split": mode} for r in bench_matmul(device, dtype, be, ms, shapes)]
        return records

    return per_backend("matmul", args.backend, device, both_splits)


render = render_sweep
plot = plot_sweep
