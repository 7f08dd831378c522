"""`bik bench layer`: one Llama-3-8B-shaped decoder layer, a decode step, bik vs stock.

The layer is bik.dvr's (RMSNorm, fused QKV, RoPE, the K/V write, paged attention, o_proj, fused
residual RMSNorm, gate/up, SwiGLU, down) with seeded random weights: hidden 4096, 32 query / 8
KV heads of 128, intermediate 14336 (on the CPU a 1/8-width layer, ``--quick`` a tiny one), and
a 128-token vocabulary so that the LM head does not hide the layer. One decode step per
sequence at batch 1, 8 and 64 (``--ms``), each sequence with ``CONTEXT`` keys in a paged cache.
bik runs it on :class:`~bik.dvr.kernels.BikKernels`, stock on
:class:`~bik.dvr.kernels.FastKernels` (F.linear, torch's RMSNorm formula, one padded SDPA over
the gathered pages). Per batch: the op time (each call launched from Python: host overhead
included); on a GPU also the kernels' device time (the profiler's) and the CUDA-graph
replayed time (bik.cli.timing.breakdown_ms). ``bik_rows_identical``: sequence 0's logits have
the same bits at every batch on bik's kernels.
"""

from __future__ import annotations

import torch
from rich.console import Console
from rich.table import Table

from bik._dtypes import dtype_name
from bik.cli.bench.stream import emit
from bik.cli.common import print_table, progress
from bik.cli.timing import breakdown_ms, noisy, time_ms
from bik.dvr.config import LlamaConfig
from bik.dvr.kernels import BikKernels, FastKernels
from bik.dvr.model import random_model
from bik.dvr.step import KVCache, build_step

LLAMA3_8B_LAYER = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "head_dim": 128}
CPU_LAYER = {"hidden_size": 512, "intermediate_size": 1792, "num_attention_heads": 4,
             "num_key_value_heads": 1, "head_dim": 128}
QUICK_LAYER = {"hidden_size": 64, "intermediate_size": 176, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16}
BATCHES = (1, 8, 64)
CONTEXT = {"cuda": 1024, "cpu": 256, "quick": 40}  # keys per sequence, this step's included
BLOCK_SIZE = 16


def _config(shape: dict) -> LlamaConfig:
    return LlamaConfig(vocab_size=128, num_hidden_layers=1, rms_norm_eps=1e-5,
                       rope_theta=500000.0, max_position_embeddings=8192,
                       tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                       rope_scaling=None, **shape)


def _decode_step(model, batch: int, context: int, dtype, device):
    """(tokens, positions, step, cache) for one decode token per sequence; sequence b's context
    and token come from seed b, so sequence 0 is the same request at every batch."""
    cfg = model.config
    pages = -(-context // BLOCK_SIZE)
    cache = KVCache.allocate(cfg, batch * pages, BLOCK_SIZE, dtype, device)
    tokens = torch.empty(batch, dtype=torch.int64)
    for b in range(batch):
        gen = torch.Generator().manual_seed(b)
        for kv in (cache.k[0], cache.v[0]):
            kv[b * pages:(b + 1) * pages] = torch.randn(
                kv[b * pages:(b + 1) * pages].shape, generator=gen).to(dtype)
        tokens[b] = int(torch.randint(0, cfg.vocab_size, (1,), generator=gen))
    step = build_step([1] * batch, [context] * batch,
                      [range(b * pages, (b + 1) * pages) for b in range(batch)], BLOCK_SIZE,
                      device)
    positions = torch.full((batch,), context - 1, dtype=torch.int64, device=device)
    return tokens.to(device), positions, step, cache


def bench_layer(device, dtype, shape: dict, batches, context: int) -> list[dict]:
    model = random_model(_config(shape), seed=0, dtype=dtype, device=device)
    records, first_rows = [], []
    with progress("bik bench layer", len(batches)) as advance:
        for batch in batches:
            inputs = _decode_step(model, batch, context, dtype, device)
            calls = {name: (lambda k=kernels, x=inputs: model.forward(*x, k))
                     for name, kernels in (("bik", BikKernels()), ("torch", FastKernels()))}
            first_rows.append(calls["bik"]()[0].clone())
            rec = {"op": "decoder_layer", "dtype": dtype_name(dtype), "batch": batch,
                   "context": context, **shape}
            for name, call in calls.items():
                rec[f"{name}_ms"] = time_ms(call, device)
                rec |= {f"{name}_{k}": v for k, v in breakdown_ms(call, device).items()}
            rec["speedup"] = rec["torch_ms"]["p50"] / rec["bik_ms"]["p50"]
            rec["noisy"] = noisy(rec["bik_ms"], rec["torch_ms"])
            records.append(emit(rec))
            advance()
    for rec in records:
        rec["bik_rows_identical"] = all(torch.equal(first_rows[0], r) for r in first_rows)
    return records


def run(device, dtype, args) -> list[dict]:
    if args.quick:
        shape, context = QUICK_LAYER, CONTEXT["quick"]
    elif device.type == "cuda":
        shape, context = LLAMA3_8B_LAYER, CONTEXT["cuda"]
    else:
        shape, context = CPU_LAYER, CONTEXT["cpu"]
    batches = args.ms or ((1, 3) if args.quick else BATCHES)
    return bench_layer(device, dtype, shape, batches, context)


def _ms(rec: dict, key: str) -> str:
    value = rec.get(key)
    if value is None:
        return "-" if f"{key[:-3]}_graph_error" not in rec else "[yellow]no graph"
    return f"{value['p50'] if isinstance(value, dict) else value:.3f}"


def render(records: list[dict], console: Console) -> None:
    r0 = records[0]
    table = Table(title=f"decoder layer ({r0['dtype']}, hidden {r0['hidden_size']}, "
                        f"{r0['context']} keys per sequence): ms per decode step")
    on_gpu = any("bik_device_ms" in r for r in records)  # device time and graphs: CUDA only
    timings = [("bik op", "bik_ms")]
    if on_gpu:
        timings += [("bik kernels", "bik_device_ms"), ("bik graph", "bik_graph_ms")]
    timings += [("torch op", "torch_ms")]
    if on_gpu:
        timings += [("torch kernels", "torch_device_ms"), ("torch graph", "torch_graph_ms")]
    for col in ("batch", *(c for c, _ in timings), "speedup (op)", "bik rows same", ""):
        table.add_column(col, justify="right")
    for r in records:
        table.add_row(str(r["batch"]), *(_ms(r, key) for _, key in timings),
                      f"{r['speedup']:.2f}", "yes" if r["bik_rows_identical"] else "[red]NO",
                      "[yellow]noisy" if r["noisy"] else "")
    print_table(console, table, keys=1)


plot = None
