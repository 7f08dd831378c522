"""`bik bench moe`: one mixture-of-experts layer's experts on the CPU, bik against vLLM-CPU's
``cpu_fused_moe`` and against transformers' own experts code.

The layer is Qwen3-30B-A3B's scaled down by 4 to fit a small machine (hidden 512, expert
intermediate 192; the real one 2048 / 768), with 8 experts top-2 and 64 experts top-8, at
T = 1 ... 256 tokens (``--ms``), routed by a softmax top-k of random logits. The calls, given
the same routing:

* ``bik``: the vLLM plugin's experts (``bik.moe.experts``: transformers' ``grouped_mm``
  implementation op for op) under ``bik.enable()``, which puts its
  grouped products on ``bik.grouped_matmul`` and its sums, SiLU and sort on bik;
* ``bik packed``: the same with each expert's weights packed once for bik's CPU kernel
  (``bik.moe.PackedExperts``, the same bits): what the plugin runs;
* ``hf grouped_mm``: the same code stock (torch's ``_grouped_mm``: not batch-invariant);
* ``hf eager``: transformers' loop over the experts hit (``index_add_`` per expert), stock;
* ``vllm``: ``cpu_fused_moe`` on weights packed by vLLM's own prepack (where vllm is
  installed: the vLLM venv), the kernel the plugin replaces.

Each call's time is the median of ROUNDS interleaved rounds (p20 / p80 kept, noisy rows
flagged); ratios are to ``vllm`` where it ran, else to ``hf grouped_mm``. ``rows same``: bik's
output for every token alone equals its row of the batch, and the packed call's the unpacked.

On a GPU (``--device cuda``, vLLM not involved) it times the grouped product itself at
Qwen3-30B-A3B's real widths (128 experts top-8, hidden 2048, expert intermediate 768; the
gate-up product [1536, 2048] and the down product [2048, 768]): ``bik.grouped_matmul``
(Triton) against torch's ``_grouped_mm`` on the same sorted rows, each row of bik's checked
against ``bik.matmul`` of the row alone.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

import bik
from bik._dtypes import dtype_name
from bik.cli.common import print_table
from bik.cli.timing import median_call_ms, noisy, quantiles_ms

HIDDEN, INTERMEDIATE = 512, 192  # Qwen3-30B-A3B's 2048 / 768, divided by 4
LAYOUTS = ((8, 2), (64, 8))  # (experts, top-k)
ROUNDS = 5


def _nothing():
    return contextlib.nullcontext()


def _eager(x, ids, weights, w13, w2):
    """transformers' eager experts loop (Qwen3MoeExperts.forward), stock."""
    out = torch.zeros_like(x)
    mask = F.one_hot(ids, num_classes=w13.shape[0]).permute(2, 1, 0)
    for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()[:, 0].tolist():
        slot, token = torch.where(mask[e])
        gate, up = F.linear(x[token], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e]) * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


def _vllm_call(x, ids, weights, w13, w2):
    """cpu_fused_moe on vLLM's packed weights, or None where vllm is not installed."""
    try:
        from vllm import _custom_ops as ops
    except ImportError:
        return None
    isa = "vec"
    p13, p2 = ops.cpu_prepack_moe_weight(w13, isa), ops.cpu_prepack_moe_weight(w2, isa)
    out = torch.empty_like(x)
    ids32, w32 = ids.to(torch.int32), weights.float()
    return lambda: ops.cpu_fused_moe(out, x, p13, p2, None, None, w32, ids32, "silu", isa, False)


def _one(experts: int, k: int, tokens: int, dtype, rounds: int) -> dict:
    from bik.moe import PackedExperts
    from bik.moe import experts as experts_grouped_mm

    gen = torch.Generator().manual_seed(experts * 131 + tokens)
    w13 = (torch.randn(experts, 2 * INTERMEDIATE, HIDDEN, generator=gen) / HIDDEN**0.5).to(dtype)
    w2 = (torch.randn(experts, HIDDEN, INTERMEDIATE, generator=gen) / INTERMEDIATE**0.5).to(dtype)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
    probs = torch.softmax(torch.randn(tokens, experts, generator=gen), -1)
    weights, ids = torch.topk(probs, k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(dtype)

    def on_bik():  # timed with bik.enable() on (switched outside the sample, as an engine
        return experts_grouped_mm(x, ids, weights, w13, w2)  # keeps it on)

    packs = PackedExperts(w13, w2)
    fns = {"bik": on_bik,
           "bik packed": lambda: experts_grouped_mm(x, ids, weights, w13, w2, packs),
           "hf grouped_mm": lambda: experts_grouped_mm(x, ids, weights, w13, w2),
           "hf eager": lambda: _eager(x, ids, weights, w13, w2)}
    vllm = _vllm_call(x, ids, weights, w13, w2)
    if vllm is not None:
        fns["vllm"] = vllm
    samples: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(-1, rounds):  # round -1: warm-up
        for i in range(len(names)):
            name = names[(i + r) % len(names)]
            with bik.enabled() if name.startswith("bik") else _nothing():
                ms = median_call_ms(fns[name], max_calls=15)
            if r >= 0:
                samples[name].append(ms)
    times = {name: quantiles_ms(s) for name, s in samples.items()}
    base = "vllm" if "vllm" in times else "hf grouped_mm"
    with bik.enabled():
        batch = on_bik()
        packed_same = torch.equal(fns["bik packed"](), batch)
        alone = [experts_grouped_mm(x[t:t + 1], ids[t:t + 1], weights[t:t + 1], w13, w2)
                 for t in range(min(tokens, 16))]
    rec = {"op": "moe experts", "experts": experts, "top_k": k, "tokens": tokens,
           "hidden": HIDDEN, "intermediate": INTERMEDIATE, "dtype": dtype_name(dtype),
           "rounds": rounds, "baseline": base, "noisy": noisy(*times.values()),
           "bik_rows_identical": packed_same and all(torch.equal(a[0], batch[t])
                                                     for t, a in enumerate(alone))}
    for name, t in times.items():
        rec[f"{name}_ms"] = t
        rec[f"{name}_vs_{base}"] = t["p50"] / times[base]["p50"]
    return rec


GPU_EXPERTS, GPU_TOP_K, GPU_PRODUCTS = 128, 8, {"gate-up": (1536, 2048), "down": (2048, 768)}


def _gpu_one(name: str, n: int, k: int, tokens: int, dtype, device) -> dict:
    from bik.cli.timing import time_ms

    gen = torch.Generator(device=device).manual_seed(tokens * 7 + n)
    w = (torch.randn(GPU_EXPERTS, n, k, generator=gen, device=device) / k**0.5).to(dtype)
    b = w.transpose(1, 2)  # the experts' [E, N, K] weights, as a model stores them
    ids = torch.randint(0, GPU_EXPERTS, (tokens * GPU_TOP_K,), generator=gen, device=device)
    sorted_ids, _ = torch.sort(ids)
    ends = torch.cumsum(torch.bincount(sorted_ids, minlength=GPU_EXPERTS), 0).to(torch.int32)
    a = torch.randn(tokens * GPU_TOP_K, k, generator=gen, device=device).to(dtype)
    times = {"bik": time_ms(lambda: bik.grouped_matmul(a, b, ends), device),
             "torch grouped_mm": time_ms(lambda: torch._grouped_mm(a, b, ends), device)}
    out = bik.grouped_matmul(a, b, ends)
    rows = range(0, a.shape[0], max(1, a.shape[0] // 8))
    same = all(torch.equal(out[r], bik.matmul(a[r:r + 1], b[int(sorted_ids[r])])[0])
               for r in rows)
    return {"op": "grouped product", "product": name, "N": n, "K": k, "experts": GPU_EXPERTS,
            "top_k": GPU_TOP_K, "tokens": tokens, "dtype": dtype_name(dtype),
            "device": torch.cuda.get_device_name(device), "noisy": noisy(*times.values()),
            "bik_rows_identical": same, "bik_ms": times["bik"],
            "torch grouped_mm_ms": times["torch grouped_mm"],
            "bik_vs_torch": times["bik"]["p50"] / times["torch grouped_mm"]["p50"]}


def run(device, dtype, args) -> list[dict]:
    if device.type == "cuda":
        dtype = torch.bfloat16 if args.dtype is None else dtype
        tokens = list(args.ms) if args.ms else ([1, 16] if args.quick else [1, 16, 128, 1024])
        return [_gpu_one(name, n, k, t, dtype, device) for name, (n, k) in GPU_PRODUCTS.items()
                for t in tokens]
    if device.type != "cpu":
        raise SystemExit(f"bik bench moe: the CPU or a CUDA device, got {device}")
    tokens = list(args.ms) if args.ms else ([1, 4] if args.quick else [1, 4, 16, 64, 256])
    layouts = LAYOUTS[:1] if args.quick else LAYOUTS
    rounds = 2 if args.quick else ROUNDS
    return [_one(e, k, t, dtype, rounds) for e, k in layouts for t in tokens]


def _render_gpu(records: list[dict], console: Console) -> None:
    table = Table(title=f"grouped product on {records[0]['device']} ({records[0]['dtype']}), "
                        f"{GPU_EXPERTS} experts top-{GPU_TOP_K}: bik.grouped_matmul vs torch "
                        f"_grouped_mm")
    for col in ("product", "N x K", "tokens", "torch ms", "bik ms", "bik / torch", "rows same",
                ""):
        table.add_column(col, justify="right")
    for r in records:
        table.add_row(r["product"], f"{r['N']} x {r['K']}", str(r["tokens"]),
                      f"{r['torch grouped_mm_ms']['p50']:.4f}", f"{r['bik_ms']['p50']:.4f}",
                      f"{r['bik_vs_torch']:.2f}x", "yes" if r["bik_rows_identical"] else "NO",
                      "noisy" if r["noisy"] else "")
    print_table(console, table, keys=3)


def render(records: list[dict], console: Console) -> None:
    if records and records[0]["op"] == "grouped product":
        _render_gpu(records, console)
        return
    base = records[0]["baseline"]
    table = Table(title=f"MoE experts on the CPU ({records[0]['dtype']}), hidden {HIDDEN}, "
                        f"intermediate {INTERMEDIATE}; median of {records[0]['rounds']} "
                        f"interleaved rounds, time vs {base}")
    calls = [c for c in ("bik", "bik packed", "hf grouped_mm", "hf eager", "vllm")
             if f"{c}_ms" in records[0]]
    for col in ("experts", "top-k", "tokens", f"{base} ms", *calls, "rows same", ""):
        table.add_column(col, justify="right")
    for r in records:
        table.add_row(str(r["experts"]), str(r["top_k"]), str(r["tokens"]),
                      f"{r[f'{base}_ms']['p50']:.3f}",
                      *(f"{r[f'{c}_vs_{base}']:.2f}x" for c in calls),
                      "yes" if r["bik_rows_identical"] else "NO", "noisy" if r["noisy"] else "")
    print_table(console, table, keys=3)


def plot(records: list[dict], plt, path: str) -> None:
    if records and records[0]["op"] == "grouped product":
        raise SystemExit("bik bench moe: --plot is for the CPU records")
    base = records[0]["baseline"]
    layouts = list(dict.fromkeys((r["experts"], r["top_k"]) for r in records))
    fig, axes = plt.subplots(1, len(layouts), figsize=(5 * len(layouts), 4), squeeze=False)
    for ax, (experts, k) in zip(axes[0], layouts):
        rows = [r for r in records if (r["experts"], r["top_k"]) == (experts, k)]
        for call in ("bik", "bik packed", "hf grouped_mm", "hf eager", "vllm"):
            if rows and f"{call}_ms" in rows[0]:
                ax.plot([r["tokens"] for r in rows], [r[f"{call}_ms"]["p50"] for r in rows],
                        marker="o", label=call)
        ax.set(xscale="log", yscale="log", xlabel="tokens", ylabel="ms per layer",
               title=f"{experts} experts, top-{k}")
        ax.legend()
    fig.suptitle(f"MoE experts ({records[0]['dtype']}), baseline {base}")
    fig.tight_layout()
    fig.savefig(path)
