"""`bik check`: the invariance doctor. Runs the harness on this device and prints a verdict per
op and dtype, the harness's own negative control, whether stock torch varies here, and the
fingerprint. Exit status 0 only if every bik op is bit-identical across batch sizes."""

from __future__ import annotations

import torch
from rich.table import Table

import bik
from bik._dtypes import dtype_name
from bik.cli.common import (
    make_console,
    pick_device,
    print_table,
    progress,
    run_metadata,
    write_json,
)
from bik.testing import rows_alone_vs_batched, split_by_m_matmul
from bik.testing.harness import M_SWEEP
from bik.testing.suites import bmm_suite, matmul_suite, reduction_suite, rms_norm_suite

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _plan(device: torch.device, quick: bool) -> dict:
    if quick:
        return {"ms": (1, 2, 4, 17, 64), "shapes": ((96, 64),), "hiddens": (111,),
                "lengths": (111,), "probe": 0, "attention_len": 40}
    if device.type == "cuda":
        return {"ms": M_SWEEP + (2048, 4096), "shapes": ((4096, 4096), (1000, 333)),
                "hiddens": (111, 4096, 8192), "lengths": (111, 4096), "probe": 130,
                "attention_len": 1100}
    return {"ms": M_SWEEP, "shapes": ((256, 256), (96, 333)), "hiddens": (111, 4096),
            "lengths": (111, 4096), "probe": 33, "attention_len": 300}


def _matmul_norm_reports(device, dtype, backend, plan: dict) -> list:
    common = {"device": device, "backend": backend, "ms": plan["ms"], "dtype": dtype}
    return (matmul_suite(shapes=plan["shapes"], probe_batch=plan["probe"], **common)
            + bmm_suite(n=96, k=64, **common)
            + rms_norm_suite(hiddens=plan["hiddens"], probe_batch=plan["probe"], **common))


def _rows(reports, prefix: str = "") -> list[dict]:
    return [{"check": prefix + r.name, "rows": r.comparisons, "ok": r.ok,
             "mismatches": len(r.mismatches)} for r in reports]


def check_rows(device: torch.device, quick: bool) -> list[dict]:
    plan = _plan(device, quick)
    reports = []
    with progress(f"bik check on {device}", 3 * len(DTYPES) + 1) as advance:
        for dtype in DTYPES:
            reports += _matmul_norm_reports(device, dtype, None, plan)
            advance()
            # softmax, log_softmax, mean: row lengths odd and a power of two
            reports += reduction_suite(device=device, dtype=dtype, backend=None, ms=plan["ms"],
                                       lengths=plan["lengths"])
            advance()
            reports += _attention_reports(device, dtype, plan["attention_len"])
            advance()
        reports.append(_sample_report(device, plan["ms"]))
        advance()
    return _rows(reports) + _cuda_backend_rows(device, plan)


def _cuda_backend_rows(device: torch.device, plan: dict) -> list[dict]:
    """The CUDA C++ backend's matmul, bmm and RMSNorm suites, when it can run here (it is
    not the default backend, so the suites above do not reach it)."""
    if device.type != "cuda":
        return []
    from bik.runtime import cuda_jit

    if not cuda_jit.available():
        return []
    reports = [r for dtype in DTYPES for r in _matmul_norm_reports(device, dtype, "cuda", plan)]
    return _rows(reports, prefix="backend=cuda ")


def _sample_report(device, ms):
    """bik.sample rows (token and logprob bits) alone vs batched, each row with its own
    position, temperature and top-k carried in the row itself."""
    gen = torch.Generator().manual_seed(13)
    vocab = 1000
    logits = torch.randn(max(ms), vocab, generator=gen) * 3
    params = torch.stack([torch.arange(max(ms)).float(),  # position
                          torch.rand(max(ms), generator=gen) * 1.5,  # temperature
                          torch.randint(0, 50, (max(ms),), generator=gen).float()], dim=1)
    pool = torch.cat([logits, params], dim=1).to(device)

    def fn(rows):
        out = bik.sample(rows[:, :vocab], seed=1234, position=rows[:, vocab].long(),
                         temperature=rows[:, vocab + 1], top_k=rows[:, vocab + 2].long())
        return torch.stack([out.tokens.float(), out.logprobs], dim=1)

    return rows_alone_vs_batched(fn, pool, ms, name="sample fp32 V=1000")


def _attention_reports(device, dtype, length):
    """One request prefilled at once vs in chunks vs decoded token by token (bik.attention)."""
    from bik.testing.attention import chunking_report, make_request

    def attn(q, k_cache, v_cache, seqlens, cu, table):
        return bik.attention(q, k_cache, v_cache, cache_seqlens=seqlens, cu_seqlens_q=cu,
                             block_table=table)

    gen = torch.Generator().manual_seed(11)
    hq, hkv, d = (32, 8, 128) if device.type == "cuda" else (4, 2, 64)
    req = make_request(gen, length, hq, hkv, d, dtype, device)
    return chunking_report(attn, req, (1, 7, 64), name=f"attention {dtype_name(dtype)}")


def controls(device: torch.device) -> dict:
    """Can the harness fail here? And does stock torch.mm vary with M on this device?"""
    gen = torch.Generator().manual_seed(7)
    pool = torch.randn(64, 256, generator=gen).to(device)
    b = torch.randn(256, 256, generator=gen).to(device)
    ms = (1, 2, 4, 8, 64)
    ref = rows_alone_vs_batched(lambda a: split_by_m_matmul(a, b), pool, ms)
    stock = rows_alone_vs_batched(lambda a: torch.mm(a, b), pool, ms)
    return {"harness_rejects_batch_dependent_reference": not ref.ok,
            "stock_torch_mm_fp32_varies_with_M": not stock.ok,
            "stock_mismatched_rows": len(stock.mismatches)}


def run_check(args) -> int:
    console = make_console()
    device = pick_device(args.device)
    fp = bik.fingerprint(device)
    rows = check_rows(device, args.quick)
    ctl = controls(device)
    table = Table(title=f"bik check on {device} ({fp.arch})")
    for col in ("check", "rows compared", "verdict"):
        table.add_column(col)
    for r in rows:
        verdict = "bit-identical" if r["ok"] else f"[red]{r['mismatches']} rows differ"
        table.add_row(r["check"], str(r["rows"]), verdict)
    print_table(console, table, keys=1)
    console.print(
        "harness negative control (split-K chosen by M): "
        + ("rejected, as it must be" if ctl["harness_rejects_batch_dependent_reference"]
           else "[red]NOT rejected: the harness is broken")
    )
    console.print("stock torch.mm fp32 on this device: " + (
        f"varies with M ({ctl['stock_mismatched_rows']} rows differ)"
        if ctl["stock_torch_mm_fp32_varies_with_M"] else "did not vary on this probe"))
    console.print(f"fingerprint {fp.digest}  backends {fp.backends}  versions {fp.versions}")
    ok = all(r["ok"] for r in rows) and ctl["harness_rejects_batch_dependent_reference"]
    if args.json:
        write_json(args.json, {"meta": run_metadata(device), "ok": ok, "checks": rows,
                               "controls": ctl})
    console.print("[green]verdict: batch-invariant" if ok else "[red]verdict: FAILED")
    return 0 if ok else 1
