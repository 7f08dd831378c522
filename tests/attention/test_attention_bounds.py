"""bik.attention's Triton kernel when the host metadata is wrong: a length past
``max_seqlen_k`` / ``max_seqlen_q`` (a caller error; BIK_DEBUG_CHECKS=1 raises it on the host,
tests/test_host_metadata.py) must never write past the SPLIT workspace the bound sized, nor
leave a row's output as stale memory. Such a sequence's rows come back NaN, the other rows
keep their bits. Also: a launch too large for the grid is refused by name.

Interpreter (real kernel programs) and GPU; the bodies (tests/attention_checks.py) allocate the
workspace with guard elements after it and pre-fill the output with a sentinel. The CUDA C++
kernel runs the same bodies in tests/cuda/test_cuda_kernels_host.py.
"""

from __future__ import annotations

import pytest
import torch
from attention_checks import BOUND_HEADS, past_key_bound, past_query_bound
from bik.ops.attention import triton as triton_attention
from targets import targets


@pytest.mark.parametrize("target", targets("interpreter", "gpu-triton"))
def test_a_key_length_past_the_bound_gives_nan_and_never_writes_past_the_workspace(
        target, monkeypatch):
    untouched, out, lse, right = past_key_bound(triton_attention, monkeypatch, "triton",
                                                target.device)
    assert untouched  # no partial past the 2 splits max_seqlen_k = 64 sized
    assert torch.equal(out[0], right[0])  # within the bound: its bits
    assert bool(out[1:].isnan().all()) and bool(lse[1:].isnan().all())


@pytest.mark.parametrize("target", targets("interpreter", "gpu-triton"))
def test_a_query_length_past_the_bound_gives_nan_rows_past_the_grid_too(target):
    out, lse, right = past_query_bound(triton_attention, "triton", target.device)
    assert torch.equal(out[:3], right[:3])
    assert bool(out[3:].isnan().all()) and bool(lse[3:].isnan().all())


@pytest.mark.parametrize("target", targets("interpreter"))
def test_a_launch_past_the_grid_limits_is_refused_by_name(target):
    """Axis 2 holds SPLIT's runs of splits: more than 65535 is refused before any workspace
    or launch (the tensors are tiny; the bound is what sizes the grid)."""
    hq, hkv, d = BOUND_HEADS
    k = v = torch.zeros(1, 16, hkv, d)
    q = torch.zeros(1, hq, d)
    with pytest.raises(ValueError, match="bik.attention \\(triton\\): .* 65535"):
        triton_attention.launch_attention(
            q, k, v, torch.empty_like(q), torch.empty(1, hq),
            cu_q=torch.tensor([0, 1], dtype=torch.int32),
            seqlens_k=torch.tensor([16], dtype=torch.int32),
            table=torch.zeros(1, 1, dtype=torch.int32), base=None, block_size=16,
            stride_page=k.stride(0), stride_tok=k.stride(1), max_q_len=1, max_k_len=2**40,
            scale=d ** -0.5, causal=True, split_mode=True, per_program=1)
