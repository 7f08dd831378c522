"""bik.attention's Triton kernels on a GPU (target gpu-triton, skipped without CUDA) at
Llama-3-8B heads (32 q / 8 kv, D = 128).

Every token's output must have the same bits under every schedule: one prefill, chunked
prefill (chunks of 7, 64, 511), verify windows, decode steps (chunk 1: a sample of positions,
the last 64 tokens and those around the 256-key split boundaries — decoding all of a 4k or 32k
prompt token by token would take minutes), page sizes 1, 16 and 64, and inside batches of
random neighbours at every row. Both launch modes (in-program fold and split + merge kernel)
must keep the contract on their own and agree with each other. Accuracy against fp64 on a
shorter length. A record (not an assertion) of whether torch SDPA's flash backend gives a
token different bits in prefill and in decode is written to $BIK_GPU_RECORD_ATTN if set; it
runs first so that ``pytest -x`` writes it even when a later test fails.

The check bodies live in tests/attention_checks.py, functions of (attn, device, heads, sizes),
so they can be dry-run on the CPU backend at small sizes (tests/attention/test_attention.py
runs them there). Budget: under about 2 minutes on an H200, Triton compiles included.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from attention_checks import (
    bik_attn,
    check_accuracy,
    check_neighbours,
    check_page_sizes,
    check_schedules,
    decode_positions,
    decode_report,
    one_call,
    whole_prefill,
    window_report,
)
from bik.testing.attention import make_request, pack_paged
from bik.testing.harness import same_bits
from targets import targets

pytestmark = pytest.mark.gpu

LLAMA = (32, 8, 128)  # q heads, kv heads, head_dim
HALF = (torch.bfloat16, torch.float16)
GPU_TRITON = pytest.mark.parametrize("target", targets("gpu-triton"))


@pytest.fixture(params=["fold", "split"])
def launch_mode(request, monkeypatch):
    """Run a test in one launch mode: each must keep the contract on its own."""
    from bik.ops.attention import triton as triton_attention

    monkeypatch.setattr(triton_attention, "use_split_mode",
                        lambda *args: request.param == "split")
    return request.param


def modes_outputs(attn, dtype, length, q_len, monkeypatch, *, device, heads=LLAMA):
    """The last q_len tokens computed in fold mode and in split mode."""
    from bik.ops.attention import triton as triton_attention

    gen = torch.Generator().manual_seed(6)
    seq = make_request(gen, length, *heads, dtype, device=device)
    cache = pack_paged([seq], [length], 16, gen)
    outs = []
    for split in (False, True):
        monkeypatch.setattr(triton_attention, "use_split_mode", lambda *args, s=split: s)
        outs.append(one_call(attn, seq, length - q_len, length, cache))
    return outs


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


def sdpa_schedule_record(attn, dtype, length, *, device, heads=LLAMA, window=8,
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

@GPU_TRITON
def test_record_whether_torch_sdpa_varies_between_prefill_and_decode(target):
    """Not an assertion about torch: a record for docs and bench/results."""
    records = [sdpa_schedule_record(bik_attn(target.backend), dtype, 4097, device=target.device)
               for dtype in HALF]
    path = os.environ.get("BIK_GPU_RECORD_ATTN")
    if path:
        with open(path, "w") as f:
            json.dump({"sdpa_flash_prefill_vs_decode": records,
                       "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}, f,
                      indent=2)
    assert all(not r["bik_decode_differs_at"] and not r["bik_window_differs_at"] for r in records)


@pytest.mark.parametrize("length", [1, 511, 2048, 4097])
@pytest.mark.parametrize("dtype", HALF)
@GPU_TRITON
def test_schedules_same_bits(target, dtype, length, launch_mode):
    check_schedules(bik_attn(target.backend), dtype, length, device=target.device, heads=LLAMA)


@GPU_TRITON
def test_schedules_fp32(target, launch_mode):
    check_schedules(bik_attn(target.backend), torch.float32, 1000, device=target.device,
                    heads=LLAMA, chunks=(7, 64, 511), windows=(4, 16))


@pytest.mark.parametrize("page_size", [1, 64])
@GPU_TRITON
def test_schedules_other_page_sizes(target, page_size):
    check_schedules(bik_attn(target.backend), torch.bfloat16, 2048, device=target.device,
                    heads=LLAMA, chunks=(64, 511), windows=(8,), page_size=page_size)


@GPU_TRITON
def test_page_sizes_4097(target):
    check_page_sizes(bik_attn(target.backend), torch.bfloat16, 4097, (16, 1, 64),
                     device=target.device, heads=LLAMA)


@GPU_TRITON
def test_32k_sequence(target):
    """One 32k prompt: one prefill vs chunks of 511 and 4096, windows of 8, and decode steps
    at the split boundaries, the middle and the last 32 tokens (launch mode by work size:
    fold for the prefill, split for decode)."""
    check_schedules(bik_attn(target.backend), torch.bfloat16, 32768 + 3, device=target.device,
                    heads=LLAMA, chunks=(511, 4096), windows=(8,), tail=64, last=32)


@pytest.mark.parametrize("q_len", [1, 8, 300])
@GPU_TRITON
def test_random_neighbours(target, q_len, launch_mode):
    check_neighbours(bik_attn(target.backend), torch.bfloat16, 3000, q_len, n_neighbours=7,
                     max_len=5000, device=target.device, heads=LLAMA)


@GPU_TRITON
def test_decode_among_many_neighbours(target):
    """A decode row among 47 short decode neighbours, at every row (split mode by size)."""
    check_neighbours(bik_attn(target.backend), torch.bfloat16, 1500, 1, n_neighbours=47,
                     max_len=600, device=target.device, heads=LLAMA, seed=3)


@pytest.mark.parametrize("q_len", [1, 16, 300])
@GPU_TRITON
def test_fold_and_split_modes_agree(target, q_len, monkeypatch):
    fold, split = modes_outputs(bik_attn(target.backend), torch.bfloat16, 4097, q_len,
                                monkeypatch, device=target.device)
    assert same_bits(fold, split)


@pytest.mark.parametrize("dtype", [*HALF, torch.float32])
@GPU_TRITON
def test_accuracy_vs_fp64(target, dtype):
    lengths = [1, 300, 2049] if dtype != torch.float32 else [1, 300, 1000]
    check_accuracy(target.backend, dtype, lengths, [1, 77, lengths[-1]], device=target.device,
                   heads=LLAMA)
