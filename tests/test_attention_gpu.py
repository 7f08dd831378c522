"""bik.attention on a GPU (skipped without CUDA) at Llama-3-8B heads (32 q / 8 kv, D = 128).

Every token's output must have the same bits under every schedule: one prefill, chunked
prefill (chunks of 7, 64, 511), verify windows, decode steps (chunk 1: a sample of positions,
the last 64 tokens and those around the 256-key split boundaries — decoding all of a 4k or 32k
prompt token by token would take minutes), page sizes 1, 16 and 64, and inside batches of
random neighbours at every row. Both launch modes (in-program fold and split + merge kernel)
must keep the contract on their own and agree with each other. Accuracy against fp64 on a
shorter length. A record (not an assertion) of whether torch SDPA's flash backend gives a
token different bits in prefill and in decode is written to $BIK_GPU_RECORD_ATTN if set; it
runs first so that ``pytest -x`` writes it even when a later test fails.

The checks are functions of (attn, device, heads, sizes) so they can be dry-run on the CPU
backend at small sizes. Budget: under about 2 minutes on an H200, Triton compiles included.
"""

from __future__ import annotations

import json
import os

import attention_cases as ac
import pytest
import torch
from bik.testing.attention import (
    Request,
    chunking_report,
    make_request,
    neighbours_report,
    pack_paged,
    page_size_report,
)
from bik.testing.harness import InvarianceReport, same_bits
from cases import assert_invariant

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
LLAMA = (32, 8, 128)  # q heads, kv heads, head_dim
TRITON = ac.bik_attn("triton")
HALF = (torch.bfloat16, torch.float16)
SPLIT = 256  # the sm90/sm80 table's split size: decode positions probe its boundaries


@pytest.fixture(params=["fold", "split"])
def launch_mode(request, monkeypatch):
    """Run a test in one launch mode: each must keep the contract on its own."""
    from bik.ops.attention import triton as triton_attention

    monkeypatch.setattr(triton_attention, "use_split_mode",
                        lambda *args: request.param == "split")
    return request.param


# --- schedules of one sequence -------------------------------------------------------------

def _one_call(attn, seq: Request, start: int, end: int, cache) -> torch.Tensor:
    """Tokens start..end-1 of ``seq`` in one call over ``cache`` (lengths set to ``end``)."""
    cu = torch.tensor([0, end - start], dtype=torch.int32, device=seq.q.device)
    lens = torch.tensor([end], dtype=torch.int32, device=seq.q.device)
    return attn(seq.q[start:end], cache.k_cache, cache.v_cache, lens, cu, cache.block_table)


def whole_prefill(attn, seq: Request, page_size: int, gen) -> torch.Tensor:
    length = seq.q.shape[0]
    return _one_call(attn, seq, 0, length, pack_paged([seq], [length], page_size, gen))


def window_report(attn, seq: Request, whole: torch.Tensor, window: int, tail: int,
                  page_size: int, gen) -> InvarianceReport:
    """The last ``tail`` tokens as verify windows of ``window`` tokens, each call over a fresh
    cache holding exactly the keys up to the window's end, vs the one prefill."""
    length = seq.q.shape[0]
    start = max(0, length - tail)
    outs = [_one_call(attn, seq, s, min(s + window, length),
                      pack_paged([seq], [min(s + window, length)], page_size, gen))
            for s in range(start, length, window)]
    got = torch.cat(outs)
    bad = tuple((window, start + t) for t in range(got.shape[0])
                if not same_bits(got[t], whole[start + t]))
    return InvarianceReport(f"windows of {window} over the last {length - start} tokens vs one "
                            f"prefill (L={length})", got.shape[0], bad)


def decode_positions(length: int, last: int = 64) -> list[int]:
    """The last ``last`` positions and those around split boundaries and the middle."""
    near = {0, 1, length // 2}
    for j in (1, 2, length // SPLIT):
        near |= {j * SPLIT - 1, j * SPLIT, j * SPLIT + 1}
    return sorted({p for p in near if 0 <= p < length} | set(range(max(0, length - last), length)))


def decode_report(attn, seq: Request, whole: torch.Tensor, positions, page_size: int,
                  gen) -> InvarianceReport:
    """Decode steps (q_len 1) at ``positions`` vs the one prefill. The cache holds the whole
    sequence and each step's cache_seqlens stops at its token, so a step that read a key past
    its length (a later token's key) would show in the bits."""
    length = seq.q.shape[0]
    cache = pack_paged([seq], [length], page_size, gen)
    bad = tuple((1, p) for p in positions
                if not same_bits(_one_call(attn, seq, p, p + 1, cache)[0], whole[p]))
    return InvarianceReport(f"decode at {len(positions)} positions vs one prefill (L={length})",
                            len(positions), bad)


def check_schedules(attn, dtype, length, *, device=DEVICE, heads=LLAMA, chunks=(7, 64, 511),
                    windows=(4, 16, 32), tail=128, last=64, page_size=16, seed=0):
    """One prefill vs chunked prefill vs verify windows vs sampled decode steps, per token."""
    gen = torch.Generator().manual_seed(seed)
    seq = make_request(gen, length, *heads, dtype, device=device)
    reports = chunking_report(attn, seq, chunks, page_size=page_size, seed=seed) if chunks else []
    whole = whole_prefill(attn, seq, page_size, gen)
    reports += [window_report(attn, seq, whole, w, tail, page_size, gen) for w in windows]
    reports.append(decode_report(attn, seq, whole, decode_positions(length, last), page_size, gen))
    assert_invariant(reports)


def check_page_sizes(attn, dtype, length, page_sizes, *, device=DEVICE, heads=LLAMA):
    gen = torch.Generator().manual_seed(1)
    seq = make_request(gen, length, *heads, dtype, device=device)
    assert_invariant(page_size_report(attn, seq, page_sizes))


def check_neighbours(attn, dtype, length, q_len, n_neighbours, max_len, *, device=DEVICE,
                     heads=LLAMA, seed=2):
    """The last q_len tokens alone vs among random neighbours (random lengths and q_lens), at
    every row of the batch."""
    gen = torch.Generator().manual_seed(seed)
    seq = make_request(gen, length, *heads, dtype, device=device)
    lens = torch.randint(1, max_len, (n_neighbours,), generator=gen).tolist()
    neighbours = [make_request(gen, n, *heads, dtype, device=device) for n in lens]
    q_lens = [int(torch.randint(1, n + 1, (1,), generator=gen)) for n in lens]
    assert_invariant([neighbours_report(attn, seq, q_len, neighbours, q_lens, seed=seed)])


def modes_outputs(attn, dtype, length, q_len, monkeypatch, *, device=DEVICE, heads=LLAMA):
    """The last q_len tokens computed in fold mode and in split mode."""
    from bik.ops.attention import triton as triton_attention

    gen = torch.Generator().manual_seed(6)
    seq = make_request(gen, length, *heads, dtype, device=device)
    cache = pack_paged([seq], [length], 16, gen)
    outs = []
    for split in (False, True):
        monkeypatch.setattr(triton_attention, "use_split_mode", lambda *args, s=split: s)
        outs.append(_one_call(attn, seq, length - q_len, length, cache))
    return outs


# --- accuracy ------------------------------------------------------------------------------

def check_accuracy(backend, dtype, lengths, q_lens, *, device=DEVICE, heads=LLAMA):
    """tests/attention_cases.check_accuracy at Llama heads on the GPU."""
    hq, hkv, d = heads
    ac.check_accuracy(backend, dtype, lengths, q_lens, hq=hq, hkv=hkv, d=d, device=device)


# --- the torch SDPA record -----------------------------------------------------------------

def _sdpa_flash(q, k, v, **kwargs):
    """SDPA on [1, H, L, D] tensors, flash backend on CUDA (GQA native, else repeated heads);
    torch's default backend on the CPU."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    f = torch.nn.functional.scaled_dot_product_attention
    if q.device.type != "cuda":
        return f(q, k, v, enable_gqa=True, **kwargs)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        try:
            return f(q, k, v, enable_gqa=True, **kwargs)
        except (RuntimeError, TypeError):
            g = q.shape[1] // k.shape[1]
            return f(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), **kwargs)


def sdpa_schedule_record(attn, dtype, length, *, device=DEVICE, heads=LLAMA, window=8,
                         tail=64) -> dict:
    """For one sequence: which sampled tokens get different bits from SDPA (flash) in one
    causal prefill vs a decode step, and vs verify windows over the last ``tail`` tokens
    (lower-right causal); the same for bik. A record of measurements, never an assertion."""
    from torch.nn.attention.bias import causal_lower_right

    gen = torch.Generator().manual_seed(7)
    seq = make_request(gen, length, *heads, dtype, device=device)
    q, k, v = (t.transpose(0, 1)[None] for t in seq)  # [1, H, L, D]
    positions = decode_positions(length, last=tail)
    rec = {"dtype": str(dtype)[6:], "length": length, "heads": list(heads),
           "decode_positions_checked": len(positions), "window": window, "window_tail": tail}
    try:
        whole = _sdpa_flash(q, k, v, is_causal=True)[0].transpose(0, 1)
        steps = {p: _sdpa_flash(q[:, :, p:p + 1], k[:, :, :p + 1], v[:, :, :p + 1])[0, :, 0]
                 for p in positions}
        rec["sdpa_decode_differs_at"] = [p for p in positions if not same_bits(steps[p], whole[p])]
        start, differ = length - tail, []
        for s in range(start, length, window):
            e = min(s + window, length)
            got = _sdpa_flash(q[:, :, s:e], k[:, :, :e], v[:, :, :e],
                              attn_mask=causal_lower_right(e - s, e))[0].transpose(0, 1)
            differ += [s + t for t in range(e - s) if not same_bits(got[t], whole[s + t])]
        rec["sdpa_window_differs_at"] = differ
    except Exception as exc:  # noqa: BLE001 - a record: say what failed instead of failing
        rec["sdpa_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    whole_bik = whole_prefill(attn, seq, 16, gen)
    rep = decode_report(attn, seq, whole_bik, positions, 16, gen)
    rec["bik_decode_differs_at"] = [p for _, p in rep.mismatches]
    rep = window_report(attn, seq, whole_bik, window, tail, 16, gen)
    rec["bik_window_differs_at"] = [p for _, p in rep.mismatches]
    return rec


# --- the tests -----------------------------------------------------------------------------

def test_record_whether_torch_sdpa_varies_between_prefill_and_decode():
    """Not an assertion about torch: a record for docs and bench/results."""
    records = [sdpa_schedule_record(TRITON, dtype, 4097) for dtype in HALF]
    path = os.environ.get("BIK_GPU_RECORD_ATTN")
    if path:
        with open(path, "w") as f:
            json.dump({"sdpa_flash_prefill_vs_decode": records,
                       "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}, f,
                      indent=2)
    assert all(not r["bik_decode_differs_at"] and not r["bik_window_differs_at"] for r in records)


@pytest.mark.parametrize("length", [1, 511, 2048, 4097])
@pytest.mark.parametrize("dtype", HALF)
def test_schedules_same_bits(dtype, length, launch_mode):
    check_schedules(TRITON, dtype, length)


def test_schedules_fp32(launch_mode):
    check_schedules(TRITON, torch.float32, 1000, chunks=(7, 64, 511), windows=(4, 16))


@pytest.mark.parametrize("page_size", [1, 64])
def test_schedules_other_page_sizes(page_size):
    check_schedules(TRITON, torch.bfloat16, 2048, chunks=(64, 511), windows=(8,),
                    page_size=page_size)


def test_page_sizes_4097():
    check_page_sizes(TRITON, torch.bfloat16, 4097, (16, 1, 64))


def test_32k_sequence():
    """One 32k prompt: one prefill vs chunks of 511 and 4096, windows of 8, and decode steps
    at the split boundaries, the middle and the last 32 tokens (launch mode by work size:
    fold for the prefill, split for decode)."""
    check_schedules(TRITON, torch.bfloat16, 32768 + 3, chunks=(511, 4096), windows=(8,),
                    tail=64, last=32)


@pytest.mark.parametrize("q_len", [1, 8, 300])
def test_random_neighbours(q_len, launch_mode):
    check_neighbours(TRITON, torch.bfloat16, 3000, q_len, n_neighbours=7, max_len=5000)


def test_decode_among_many_neighbours():
    """A decode row among 47 short decode neighbours, at every row (split mode by size)."""
    check_neighbours(TRITON, torch.bfloat16, 1500, 1, n_neighbours=47, max_len=600, seed=3)


@pytest.mark.parametrize("q_len", [1, 16, 300])
def test_fold_and_split_modes_agree(q_len, monkeypatch):
    fold, split = modes_outputs(TRITON, torch.bfloat16, 4097, q_len, monkeypatch)
    assert same_bits(fold, split)


@pytest.mark.parametrize("dtype", [*HALF, torch.float32])
def test_accuracy_vs_fp64(dtype):
    lengths = [1, 300, 2049] if dtype != torch.float32 else [1, 300, 1000]
    check_accuracy("triton", dtype, lengths, [1, 77, lengths[-1]])
