"""`bik bench linear`: one linear layer on the CPU, F.linear vs bik.linear vs bik.PackedWeight.

The shapes a decode and a short prefill see: SmolLM2-135M's MLP (1536 x 576, 576 x 1536) and
Llama-3-8B's (4096 x 4096, 14336 x 4096), at M = 1, 8, 64 (``--ms``), in ``--dtype`` (bf16 by
default: the bf16 dot path when this CPU takes it, ``versions["cpu_bf16"]`` in the record's
meta). In bf16 it also times the product alone on each pair kernel this CPU has (unpacked
weight): the dot sequence's ``kernel fma`` and ``kernel vdpbf16ps`` (the same bits), and the
AMX sequence's ``kernel amx`` (other bits; the default where it runs); in fp32
on each of contract.h's two fp32 sequences (``kernel fma``, the default where the CPU has FMA,
and ``kernel mul-add``; the streamed rows add ``packed mul-add``). The
calls are timed in ROUNDS interleaved rounds (the order rotates each round), so a slow spell
of a shared machine lands on all of them; each round's sample is the median of a few calls. A record keeps every call's median, p20 and p80 across rounds, its time relative to
F.linear's, a noise flag, and whether bik's rows alone equal its batch. At M <= 8 (decode) the
"streamed" rows time F.linear and a packed layer cycling through distinct weights of
STREAM_BYTES in all, so each call reads its weight from memory as a decode step does; the
other rows reuse one weight, which stays in cache.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

import bik
import bik.configs
from bik._dtypes import dtype_name
from bik.cli.common import print_table
from bik.cli.timing import median_call_ms, noisy, quantiles_ms

SMOLLM2 = ((1536, 576), (576, 1536))
LLAMA = ((4096, 4096), (14336, 4096))
ROUNDS = 7
# Decode reads every layer's weight once per step, from memory: the streamed rows cycle through
# distinct weights of this many bytes in all (more than the machine's caches).
STREAM_BYTES = 256 << 20


def _one(n: int, k: int, m: int, dtype, rounds: int) -> dict:
    gen = torch.Generator().manual_seed(n * 31 + k)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    x = torch.randn(m, k, generator=gen).to(dtype)
    packed = bik.PackedWeight(weight)
    fns = {"stock": lambda: F.linear(x, weight), "bik.linear": lambda: bik.linear(x, weight),
           "packed": lambda: packed(x)}
    fns |= _kernels(x, weight)
    for fn in fns.values():
        fn()  # warm-up
    samples: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for i in range(len(names)):
            name = names[(i + r) % len(names)]
            samples[name].append(median_call_ms(fns[name]))
    times = {name: quantiles_ms(s) for name, s in samples.items()}
    out = bik.linear(x, weight)
    rows_same = bool(torch.equal(torch.cat([bik.linear(x[i:i + 1], weight) for i in range(m)]),
                                 out)) and torch.equal(packed(x), out)
    rec = {"op": "linear", "weights": "cached", "N": n, "K": k, "M": m,
           "dtype": dtype_name(dtype), "rounds": rounds, "bik_rows_identical": rows_same}
    return rec | _timings(times)


def _timings(times: dict) -> dict:
    rec = {"noisy": noisy(*times.values())}
    for name, t in times.items():
        rec[f"{name}_ms"] = t
        if name != "stock":
            rec[f"{name}_vs_stock"] = t["p50"] / times["stock"]["p50"]
    return rec


def _streamed(n: int, k: int, m: int, dtype, rounds: int, total_bytes: int) -> dict:
    """F.linear and a packed layer with the weight read from memory, as in a decode step: one
    call on each of ``copies`` distinct weights per sample, the time per call reported."""
    gen = torch.Generator().manual_seed(n * 37 + k)
    copies = max(2, -(-total_bytes // (n * k * torch.finfo(dtype).bits // 8)))
    weights = [(torch.randn(n, k, generator=gen) / k**0.5).to(dtype) for _ in range(copies)]
    packs = [bik.PackedWeight(w) for w in weights]
    x = torch.randn(m, k, generator=gen).to(dtype)
    fns = {"stock": lambda: [F.linear(x, w) for w in weights],
           "packed": lambda: [p(x) for p in packs]} | _packed_mul_add(packs, x)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(rounds):
        for i, name in enumerate(fns):
            name = list(fns)[(i + r) % len(fns)]
            t0 = time.perf_counter()
            fns[name]()
            samples[name].append((time.perf_counter() - t0) * 1e3 / copies)
    times = {name: quantiles_ms(s) for name, s in samples.items()}
    return {"op": "linear", "weights": "streamed", "N": n, "K": k, "M": m,
            "dtype": dtype_name(dtype), "rounds": rounds, "copies": copies,
            "bik_rows_identical": torch.equal(packs[0](x), bik.linear(x, weights[0]))
            } | _timings(times)


def _kernels(x, weight) -> dict:
    """The product alone (the extension's call on the unpacked weight) on each kernel of the
    sequences this CPU runs: bf16 on pair words, the dot sequence's FMA kernel and vdpbf16ps
    (the same bits, so only their speed tells them apart) and the AMX sequence's; fp32, the fma
    and mul-add sequences (two contracts: other bits)."""
    from bik.runtime import cpu_ext

    dot = x.dtype == torch.bfloat16 and cpu_ext.bf16_dot()
    if not dot and (x.dtype != torch.float32 or not cpu_ext.fp32_fma()):
        return {}
    ext = cpu_ext.require()
    (m, k), n = x.shape, weight.shape[0]
    split = bik.configs.matmul_split(x.dtype, n, k).split
    out = torch.empty(m, n)

    def call(kernel):
        return lambda: ext.matmul_f32(
            x.data_ptr(), k, 1, weight.data_ptr(), 1, k, 0, out.data_ptr(), n, m, n, k, split,
            torch.get_num_threads(), "auto", 0, 0, dot, 1, 0, 0, 0, 0, dot,
            kernel if dot else "fma", kernel == "fma")

    if not dot:
        return {"kernel fma": call("fma"), "kernel mul-add": call("mul-add")}
    kernels = ["fma"] + [k for k in ("vdpbf16ps", "amx") if cpu_ext.bf16_dot_refusal(k) == ""]
    return {f"kernel {name}": call(name) for name in kernels}


def _packed_mul_add(packs: list, x) -> dict:
    """fp32 where the process runs the fma sequence: the packed layers' panels on the mul-add
    one (the extension's call, as PackedWeight makes it), to time the two contracts."""
    from bik.runtime import cpu_ext

    if x.dtype != torch.float32 or not cpu_ext.fp32_fma():
        return {}
    ext = cpu_ext.require()
    (m, k), n = x.shape, packs[0].shape[0]
    split = bik.configs.matmul_split(x.dtype, n, k).split
    out = torch.empty(m, n)
    calls = [(p._panels_ptr, p._isa) for p in packs]

    def run():
        for panels, isa in calls:
            ext.matmul_f32(x.data_ptr(), k, 1, 0, 0, 0, 0, out.data_ptr(), n, m, n, k, split,
                           torch.get_num_threads(), isa, 0, 0, False, 1, 0, 0, 0, panels, False,
                           "fma", False)

    return {"packed mul-add": run}


def run(device, dtype, args) -> list[dict]:
    if device.type != "cpu":
        raise SystemExit("bik bench linear: the CPU (--device cpu); `bik bench matmul` times GPUs")
    dtype = torch.bfloat16 if args.dtype is None else dtype  # the CLI's CPU default is fp32
    shapes = ((96, 33),) if args.quick else SMOLLM2 + LLAMA
    ms = list(args.ms) if args.ms else ([1, 3] if args.quick else [1, 8, 64])
    rounds = 2 if args.quick else ROUNDS
    records = [_one(n, k, m, dtype, rounds) for n, k in shapes for m in ms]
    stream = (1 << 20) if args.quick else STREAM_BYTES
    return records + [_streamed(n, k, m, dtype, rounds, stream) for n, k in shapes for m in ms
                      if m <= 8]


def render(records: list[dict], console: Console) -> None:
    table = Table(title=f"linear on the CPU ({records[0]['dtype']}), median of "
                        f"{records[0]['rounds']} interleaved rounds, time vs F.linear")
    kernels = list(dict.fromkeys(c.removesuffix("_vs_stock") for r in records for c in r
                                 if c.endswith("_vs_stock")
                                 and c not in ("bik.linear_vs_stock", "packed_vs_stock")))
    for col in ("weights", "N x K", "M", "F.linear ms", "bik.linear", "packed", *kernels,
                "rows same", ""):
        table.add_column(col, justify="right")

    def ratio(r: dict, name: str) -> str:
        return f"{r[f'{name}_vs_stock']:.2f}x" if f"{name}_vs_stock" in r else "-"

    for r in records:
        table.add_row(r["weights"], f"{r['N']} x {r['K']}", str(r["M"]),
                      f"{r['stock_ms']['p50']:.3f}", ratio(r, "bik.linear"), ratio(r, "packed"),
                      *(ratio(r, c) for c in kernels),
                      "yes" if r["bik_rows_identical"] else "NO",
                      "noisy" if r["noisy"] else "")
    print_table(console, table, keys=3)


plot = None
