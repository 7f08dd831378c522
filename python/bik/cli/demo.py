"""`bik demo`: one request's bits as the batch around it grows, stock path vs bik.

The embedded default is a Llama-shaped block with seeded random weights (no files): RMSNorm,
then the fused gate/up projection. The probe request is row 0; the other rows are other
users' requests. On the CPU, stock fp32 F.linear computes a lone row differently from a row in
a batch of four or more (measured), so its bits move; bik's do not. The second table computes
one request's attention under four schedules (one prefill, chunks, verify windows, token-by-token
decode); stock fp32 SDPA gives the last token other bits in decode (measured), bik does not.
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F
from rich.table import Table

import bik
from bik._dtypes import dtype_name
from bik.cli.common import make_console, pick_device, print_table

HIDDEN, FFN = 512, 1536
BATCHES = (1, 2, 3, 4, 8, 32, 128)


def _digest(row: torch.Tensor) -> str:
    raw = row.detach().cpu().contiguous().view(torch.uint8).numpy()
    return hashlib.sha256(raw).hexdigest()[:12]


def embedded_block(device: torch.device, dtype: torch.dtype) -> dict:
    gen = torch.Generator().manual_seed(42)
    make = lambda *s: (torch.randn(*s, generator=gen) / s[-1] ** 0.5).to(device, dtype)
    return {"norm": 1 + make(HIDDEN) * 0.1, "up": make(2 * FFN, HIDDEN),
            "requests": torch.randn(max(BATCHES), HIDDEN, generator=gen).to(device, dtype)}


def stock_forward(block: dict, x: torch.Tensor) -> torch.Tensor:
    h = F.rms_norm(x, (HIDDEN,), block["norm"], 1e-6)
    return F.linear(h, block["up"])


def bik_forward(block: dict, x: torch.Tensor) -> torch.Tensor:
    return bik.linear(bik.rms_norm(x, block["norm"], 1e-6), block["up"])


def demo_rows(device: torch.device, dtype: torch.dtype) -> list[dict]:
    block = embedded_block(device, dtype)
    rows = []
    for batch in BATCHES:
        x = block["requests"][:batch]
        rows.append({"batch": batch, "stock": _digest(stock_forward(block, x)[0]),
                     "bik": _digest(bik_forward(block, x)[0])})
    return rows


SCHEDULES = (("prefill", 96), ("chunks of 32", 32), ("verify K=8", 8), ("decode", 1))


def attention_rows(device: torch.device, dtype: torch.dtype) -> list[dict]:
    """One request's last-token attention output under four schedules: stock SDPA vs bik."""
    from bik.testing.attention import make_request, run_chunks
    from bik.testing.controls import sdpa_attention

    gen = torch.Generator().manual_seed(7)
    req = make_request(gen, 96, 8, 2, 64, dtype, device)

    def bik_attn(q, k_cache, v_cache, seqlens, cu, table):
        return bik.attention(q, k_cache, v_cache, cache_seqlens=seqlens, cu_seqlens_q=cu,
                             block_table=table)

    return [{"schedule": name,
             "stock": _digest(run_chunks(sdpa_attention, req, chunk, 16, gen)[-1]),
             "bik": _digest(run_chunks(bik_attn, req, chunk, 16, gen)[-1])}
            for name, chunk in SCHEDULES]


def _print_table(console, title: str, key: str, rows: list[dict]) -> tuple[bool, bool]:
    table = Table(title=title)
    for col in (key, "stock torch (digest)", "same as first?", "bik (digest)", "same as first?"):
        table.add_column(col, justify="right")
    for r in rows:
        s_ok, b_ok = r["stock"] == rows[0]["stock"], r["bik"] == rows[0]["bik"]
        table.add_row(str(r[key]), r["stock"], "yes" if s_ok else "[red]no",
                      r["bik"], "yes" if b_ok else "[red]NO")
    print_table(console, table, keys=1)
    return len({r["stock"] for r in rows}) > 1, len({r["bik"] for r in rows}) == 1


def run_demo(args) -> int:
    console = make_console()
    device = pick_device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    moved, fixed = _print_table(
        console, f"request 0's output bits as its batch grows ({device}, {dtype_name(dtype)})",
        "batch", demo_rows(device, dtype))
    a_moved, a_fixed = _print_table(
        console, "the last token's attention output under four schedules", "schedule",
        attention_rows(device, dtype))
    bik_fixed = fixed and a_fixed
    console.print(
        f"stock path: {'bits changed' if moved or a_moved else 'no change seen here'}; "
        f"bik: {'the same bits every time' if bik_fixed else '[red]bits changed (bug)'}"
    )
    console.print(f"fingerprint {bik.fingerprint(device).digest}")
    return 0 if bik_fixed else 1
