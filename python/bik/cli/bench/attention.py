"""`bik bench attention`: bik.attention against torch SDPA on decode, verify and prefill.

Inputs: a paged KV cache (page size 16) whose pages are handed out in a shuffled order, so no
sequence owns contiguous pages; torch SDPA gets the same K/V copied into a contiguous
[B, Hkv, L, D] layout (GQA through ``enable_gqa``, else by repeating the KV heads). Every
sequence of a workload has the same context length (SDPA takes no per-sequence lengths).
Decode (q_len 1) calls SDPA without a mask, a prefill (q_len = context) with ``is_causal``,
a verify window with a bottom-right causal mask. On CUDA, SDPA runs with the flash backend
when it accepts the call, else efficient, else math; ``torch_backend`` says which ran.

Bytes model (GB/s): every sequence's attended K and V are read once
(B * context * Hkv * D * 2 * itemsize) plus q read and out written (2 * B * q_len * Hq * D *
itemsize), divided by the p50 time. A lower bound on the traffic (the block table and the
split-mode fp32 partials are not counted). ``bik_bw_fraction`` divides bik's GB/s by the
measured copy bandwidth (``copy_gbps``: one large tensor copied, read + write bytes / time).
``bik_tflops`` counts 4 * D flops per (query head, visible key) pair.

Rows identical: the probe sequence (row B // 2) inside the batch against the probe computed
alone (a batch of one), and, when q_len > 1, its last token against a decode step (q_len 1) of
that token. ``torch_rows_identical`` is the same comparison for SDPA: a record, not a claim.
``bik_kernel_ms`` (Triton and CUDA backends) times the kernel launcher without the op's input
checks and host reads, to show what the op boundary costs. On a GPU ``bik_device_ms`` /
``torch_device_ms`` (the kernels' own time) and ``*_graph_ms`` (a CUDA-graph replay) come from
bik.cli.timing.breakdown_ms.
"""

from __future__ import annotations

import math
from typing import NamedTuple

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
from bik.ops._registry import resolve_backend
from bik.testing.harness import same_bits

BACKEND_OP = "attention"  # --backend chooses among this op's backends

PAGE = 16
KV_LIMIT_BYTES = 40e9  # skip decode shapes whose K + V cache would exceed this
LLAMA_HEADS = (32, 8, 128)  # Llama-3-8B: q heads, kv heads, head_dim
CPU_HEADS = (4, 2, 64)


class Workload(NamedTuple):
    kind: str  # decode, verify or prefill
    batch: int
    context: int  # keys per sequence (including the new tokens)
    q_len: int


def attention_workloads(on_gpu: bool, quick: bool, batches=None) -> list[Workload]:
    """Decode (B x context), verify windows ((B, context, T)) and prefill ((B, tokens))."""
    if quick:
        default, contexts, verify, prefill = (1, 3), (40, 300), [(2, 100, 4)], [(1, 70)]
    elif on_gpu:
        default, contexts = (1, 8, 32, 64, 128, 256), (1024, 4096, 16384, 32768)
        verify = [(8, 4096, t) for t in (4, 8, 16, 32)]
        prefill = [(1, 4096), (1, 16384), (8, 2048)]
    else:
        default, contexts, verify, prefill = (1, 4), (256, 600), [(2, 600, 4)], [(1, 300)]
    batches = batches or default
    work = [Workload("decode", b, c, 1) for c in contexts for b in batches]
    work += [Workload("verify", b, c, t) for b, c, t in verify]
    return work + [Workload("prefill", b, n, n) for b, n in prefill]


class _Inputs(NamedTuple):
    q: torch.Tensor  # [B * q_len, Hq, D]
    k_cache: torch.Tensor  # [pages, PAGE, Hkv, D]
    v_cache: torch.Tensor
    table: torch.Tensor  # int32 [B, pages per sequence], shuffled pages
    seqlens: torch.Tensor
    cu_q: torch.Tensor
    q_t: torch.Tensor  # torch's layout: [B, Hq, q_len, D]
    k_t: torch.Tensor  # [B, Hkv, context, D]
    v_t: torch.Tensor


def _inputs(w: Workload, heads, dtype, device, seed: int) -> _Inputs:
    hq, hkv, d = heads
    gen = torch.Generator(device=device).manual_seed(seed)
    per_seq = -(-w.context // PAGE)
    n_pages = w.batch * per_seq

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    k_cache, v_cache = randn(n_pages, PAGE, hkv, d), randn(n_pages, PAGE, hkv, d)
    order = torch.randperm(n_pages, generator=torch.Generator().manual_seed(seed))
    table = order.view(w.batch, per_seq).to(device=device, dtype=torch.int32)
    q = randn(w.batch * w.q_len, hq, d)
    seqlens = torch.full((w.batch,), w.context, dtype=torch.int32, device=device)
    cu_q = torch.arange(w.batch + 1, dtype=torch.int32, device=device) * w.q_len
    k_t = torch.empty(w.batch, hkv, w.context, d, dtype=dtype, device=device)
    v_t = torch.empty_like(k_t)
    step = max(1, (1 << 31) // (per_seq * PAGE * hkv * d * k_t.element_size()))  # ~2 GB gathers
    for b0 in range(0, w.batch, step):
        pages = table[b0:b0 + step].long()
        for cache, dst in ((k_cache, k_t), (v_cache, v_t)):
            rows = cache[pages].reshape(pages.shape[0], -1, hkv, d)[:, : w.context]
            dst[b0:b0 + step] = rows.transpose(1, 2)
    q_t = q.view(w.batch, w.q_len, hq, d).transpose(1, 2).contiguous()
    return _Inputs(q, k_cache, v_cache, table, seqlens, cu_q, q_t, k_t, v_t)


def _sdpa_candidates(on_gpu: bool):
    """(name, backends) in order of preference; None = torch's default choice (CPU)."""
    if not on_gpu:
        return [("default", None)]
    from torch.nn.attention import SDPBackend

    return [("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
            ("math", SDPBackend.MATH)]


def _torch_call(q_t, k_t, v_t, on_gpu: bool):
    """A zero-argument SDPA call on these tensors and the name of the backend that ran it."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    q_len, context = q_t.shape[2], k_t.shape[2]
    group = q_t.shape[1] // k_t.shape[1]
    if q_len == 1:
        kwargs, mask_name = {}, "none"
    elif q_len == context:
        kwargs, mask_name = {"is_causal": True}, "causal"
    elif on_gpu:
        from torch.nn.attention.bias import causal_lower_right

        kwargs, mask_name = {"attn_mask": causal_lower_right(q_len, context)}, "bottom-right"
    else:
        pos = torch.arange(context, device=q_t.device)
        mask = pos[None, :] <= torch.arange(context - q_len, context, device=q_t.device)[:, None]
        kwargs, mask_name = {"attn_mask": mask}, "bottom-right"
    kv_bytes = 2 * k_t.numel() * k_t.element_size()
    errors = []
    for name, backend in _sdpa_candidates(on_gpu):
        if name == "math" and q_t.shape[0] * q_t.shape[1] * q_len * context * 4 > 8e9:
            continue  # the math backend materialises the scores
        for gqa in ("native", "repeat"):
            if gqa == "repeat" and (group == 1 or kv_bytes * group > 30e9):
                continue
            k, v = (k_t, v_t) if gqa == "native" else (k_t.repeat_interleave(group, 1),
                                                     v_t.repeat_interleave(group, 1))
            extra = {"enable_gqa": True} if gqa == "native" and group > 1 else {}

            def call(k=k, v=v, backend=backend, extra=extra):
                if backend is None:
                    return F.scaled_dot_product_attention(q_t, k, v, **kwargs, **extra)
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q_t, k, v, **kwargs, **extra)

            try:
                call()
            except (RuntimeError, TypeError, ValueError, NotImplementedError) as exc:
                errors.append(f"{name}/{gqa}: {str(exc).splitlines()[0][:80]}")
                continue
            label = name + ("" if gqa == "native" or group == 1 else " (kv heads repeated)")
            return call, f"{label}, mask {mask_name}"
    return None, "none ran: " + "; ".join(errors)


def _copy_gbps(device) -> float:
    n = (1 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    gbps = 2 * n / time_ms(lambda: dst.copy_(src), device)["p50"] / 1e6
    return gbps


def _bik_probe_ok(run, w: Workload, x: _Inputs, out: torch.Tensor) -> bool:
    p = w.batch // 2
    rows = out[p * w.q_len:(p + 1) * w.q_len]
    alone = run(x.q[p * w.q_len:(p + 1) * w.q_len], x.seqlens[p:p + 1],
                torch.tensor([0, w.q_len], dtype=torch.int32, device=out.device), x.table[p:p + 1])
    ok = same_bits(rows, alone)
    if w.q_len > 1:
        step = run(x.q[(p + 1) * w.q_len - 1:(p + 1) * w.q_len], x.seqlens[p:p + 1],
                   torch.tensor([0, 1], dtype=torch.int32, device=out.device), x.table[p:p + 1])
        ok = ok and same_bits(rows[-1:], step)
    return ok


def _torch_probe_ok(w: Workload, x: _Inputs, out: torch.Tensor, on_gpu: bool) -> bool | None:
    p = slice(w.batch // 2, w.batch // 2 + 1)
    alone, _ = _torch_call(x.q_t[p], x.k_t[p], x.v_t[p], on_gpu)
    if alone is None:
        return None
    ok = same_bits(out[p], alone())
    if w.q_len > 1:
        step, _ = _torch_call(x.q_t[p, :, -1:], x.k_t[p], x.v_t[p], on_gpu)
        ok = ok and step is not None and same_bits(out[p, :, -1:], step())
    return ok


def _one(w: Workload, heads, dtype, device, backend: str, seed: int) -> dict:
    hq, hkv, d = heads
    on_gpu = device.type == "cuda"
    x = _inputs(w, heads, dtype, device, seed)

    def run(q, seqlens, cu_q, table):
        # With the host maxima bik reads nothing back (a serving engine has them on the host),
        # so the time is the kernels' and a CUDA graph can capture the call.
        return bik.attention(q, x.k_cache, x.v_cache, cache_seqlens=seqlens, cu_seqlens_q=cu_q,
                             block_table=table, max_seqlen_q=w.q_len, max_seqlen_k=w.context,
                             backend=backend)

    out = run(x.q, x.seqlens, x.cu_q, x.table)
    rec = {"op": "attention", "workload": w.kind, "B": w.batch, "context": w.context,
           "q_len": w.q_len, "Hq": hq, "Hkv": hkv, "D": d, "dtype": dtype_name(dtype),
           "page_size": PAGE, "bik_rows_identical": _bik_probe_ok(run, w, x, out)}
    rec["bik_ms"] = time_ms(lambda: run(x.q, x.seqlens, x.cu_q, x.table), device)
    rec |= {f"bik_{k}": v for k, v in breakdown_ms(
        lambda: run(x.q, x.seqlens, x.cu_q, x.table), device).items()}
    rec["bik_kernel_ms"] = None
    if backend in ("triton", "cuda"):
        import importlib

        launch_attention = importlib.import_module(
            f"bik.ops.attention.{backend}").launch_attention

        o, lse = torch.empty_like(x.q), x.q.new_empty(x.q.shape[:2], dtype=torch.float32)
        kernel = lambda: launch_attention(
            x.q, x.k_cache, x.v_cache, o, lse, cu_q=x.cu_q, seqlens_k=x.seqlens, table=x.table,
            base=None, block_size=PAGE, stride_page=x.k_cache.stride(0),
            stride_tok=x.k_cache.stride(1), max_q_len=w.q_len, max_k_len=w.context,
            scale=1 / math.sqrt(d), causal=True)
        rec["bik_kernel_ms"] = time_ms(kernel, device)
    call, rec["torch_backend"] = _torch_call(x.q_t, x.k_t, x.v_t, on_gpu)
    rec["torch_ms"] = time_ms(call, device) if call else None
    if call:
        rec |= {f"torch_{k}": v for k, v in breakdown_ms(call, device).items()}
    rec["torch_rows_identical"] = _torch_probe_ok(w, x, call(), on_gpu) if call else None
    item = x.q.element_size()
    nbytes = 2 * w.batch * w.context * hkv * d * item + 2 * w.batch * w.q_len * hq * d * item
    pairs = w.batch * hq * sum(w.context - w.q_len + 1 + t for t in range(w.q_len))
    rec["bik_gbps"] = nbytes / rec["bik_ms"]["p50"] / 1e6
    rec["bik_tflops"] = 4 * d * pairs / rec["bik_ms"]["p50"] / 1e9
    rec["torch_gbps"] = nbytes / rec["torch_ms"]["p50"] / 1e6 if call else None
    rec["speedup"] = rec["torch_ms"]["p50"] / rec["bik_ms"]["p50"] if call else None
    rec["noisy"] = noisy(rec["bik_ms"], rec["torch_ms"] if call else None)
    return rec


def bench_attention(device, dtype, backend, quick: bool, batches=None) -> list[dict]:
    on_gpu = device.type == "cuda"
    heads = LLAMA_HEADS if on_gpu and not quick else CPU_HEADS
    backend = resolve_backend("attention", backend, device)
    copy = _copy_gbps(device)
    records = []
    item = torch.empty((), dtype=dtype).element_size()
    work = attention_workloads(on_gpu, quick, batches)
    for i, w in enumerate(track(work, description="attention", transient=True)):
        if 2 * w.batch * w.context * heads[1] * heads[2] * item > KV_LIMIT_BYTES:
            continue
        rec = _one(w, heads, dtype, device, backend, seed=i)
        rec["copy_gbps"] = copy
        rec["bik_bw_fraction"] = rec["bik_gbps"] / copy
        records.append(emit(rec))
        if on_gpu:
            torch.cuda.empty_cache()
    return records


def _fmt(t) -> str:
    return "-" if t is None else f"{t['p50']:.3f}"


def render_attention(records: list[dict], console: Console) -> None:
    r0 = records[0]
    table = Table(title=f"attention (Hq {r0['Hq']} / Hkv {r0['Hkv']}, D {r0['D']}, {r0['dtype']}, "
                        f"page {r0['page_size']}, copy {r0['copy_gbps']:.0f} GB/s)")
    with_backend = "backend" in r0
    if with_backend:
        table.add_column("backend")
    for col in ("workload", "B", "context", "q_len", "bik ms", "kernel ms", "torch ms", "speedup",
                "bik GB/s", "% copy", "bik TFLOP/s", "bik rows same", "torch rows same",
                "torch backend", ""):
        table.add_column(col, justify="left" if col in ("workload", "torch backend") else "right")
    for r in records:
        same_t = {True: "yes", False: "no", None: "-"}[r["torch_rows_identical"]]
        table.add_row(*([r["backend"]] if with_backend else []),
                      r["workload"], str(r["B"]), str(r["context"]), str(r["q_len"]),
                      _fmt(r["bik_ms"]), _fmt(r["bik_kernel_ms"]), _fmt(r["torch_ms"]),
                      "-" if r["speedup"] is None else f"{r['speedup']:.2f}",
                      f"{r['bik_gbps']:.3g}", f"{100 * r['bik_bw_fraction']:.3g}",
                      f"{r['bik_tflops']:.3g}", "yes" if r["bik_rows_identical"] else "[red]NO",
                      same_t, r["torch_backend"], "[yellow]noisy" if r["noisy"] else "")
    print_table(console, table, keys=4 + int(with_backend))


def plot_attention(records: list[dict], plt, path: str) -> None:
    """Speedup (torch time / bik time): decode against B per context, verify against T,
    prefill per shape."""
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    dec = [r for r in records if r["workload"] == "decode" and r["speedup"]]
    for be, ctx in dict.fromkeys((r.get("backend", ""), r["context"]) for r in dec):
        rows = [r for r in dec if r["context"] == ctx and r.get("backend", "") == be]
        axes[0].plot([r["B"] for r in rows], [r["speedup"] for r in rows], marker="o",
                     label=f"{be} context {ctx}".strip())
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("B (decode)")
    ver = [r for r in records if r["workload"] == "verify" and r["speedup"]]
    for be in dict.fromkeys(r.get("backend", "") for r in ver):
        rows = [r for r in ver if r.get("backend", "") == be]
        axes[1].plot([r["q_len"] for r in rows], [r["speedup"] for r in rows], marker="o",
                     label=be or None)
    axes[1].set_xlabel("T (verify window)")
    pre = [r for r in records if r["workload"] == "prefill" and r["speedup"]]
    axes[2].bar([f"{r.get('backend', '')} {r['B']}x{r['context']}".strip() for r in pre],
                [r["speedup"] for r in pre])
    axes[2].set_xlabel("B x tokens (prefill)")
    for ax in axes:
        ax.set_yscale("log")  # one outlier ratio must not flatten the rest
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_ylabel("torch time / bik time")
    if dec:
        axes[0].legend(fontsize=7)
    fig.suptitle(f"bik attention vs torch SDPA ({records[0]['dtype']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(device, dtype, args) -> list[dict]:
    return per_backend("attention", args.backend, device,
                       lambda be: bench_attention(device, dtype, be, args.quick, args.ms))


render = render_attention
plot = plot_attention
