"""bik.attention / attention_varlen / write_kv_cache reject bad input with the op's name (GQA
ratio, head_dim, lengths, block table, cu_seqlens, dtypes, devices, scale, slots), before any
kernel runs: CPU tensors in the plain process, default backend; Triton's head_dim limits too."""

import bik
import pytest
import torch
from bik.runtime import cpu_ext

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason="CPU extension not built")

Q = torch.zeros(3, 4, 16)
KC = torch.zeros(4, 8, 2, 16)  # 4 pages of 8 tokens, 2 kv heads
TABLE = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
SEQ = torch.tensor([5, 9], dtype=torch.int32)
CU = torch.tensor([0, 1, 3], dtype=torch.int32)
I32 = torch.int32


def attn(q=Q, k=KC, v=KC, seqlens=SEQ, cu=CU, table=TABLE, **kw):
    return bik.attention(q, k, v, cache_seqlens=seqlens, cu_seqlens_q=cu, block_table=table, **kw)


def varlen(cu_k):
    return bik.attention_varlen(Q, torch.zeros(14, 2, 16), torch.zeros(14, 2, 16),
                                cu_seqlens_q=CU, cu_seqlens_k=cu_k)


def write(k, slots):
    return bik.write_kv_cache(KC.clone(), KC.clone(), k, k.clone(), slots)


@pytest.mark.parametrize("call, exc, pattern", [
    (lambda: attn(q=torch.zeros(3, 3, 16)), ValueError,
     r"bik.attention: q heads \(3\) must be a multiple of k/v heads \(2\)"),
    (lambda: attn(q=torch.zeros(3, 4, 32)), ValueError,
     r"bik.attention: head_dim of q \(32\) and k/v \(16\) differ"),
    (lambda: attn(seqlens=torch.tensor([5, 1], dtype=I32)), ValueError,
     "bik.attention: sequence 1 has cache_seqlens 1 < q_len 2"),
    (lambda: attn(table=torch.tensor([[0, 1], [2, 7]], dtype=I32)), ValueError,
     "bik.attention: block_table row 1 points outside the cache's 4 blocks"),
    (lambda: attn(seqlens=torch.tensor([5, 17], dtype=I32)), ValueError,
     "bik.attention: sequence 1 has 17 keys but room for 16"),
    (lambda: attn(cu=torch.tensor([0, 2, 1], dtype=I32)), ValueError,
     "bik.attention: cu_seqlens_q must start at 0, never decrease"),
    (lambda: attn(cu=torch.tensor([0, 3], dtype=I32)), ValueError,
     r"bik.attention: cu_seqlens_q \[2\] must have 3 entries"),
    (lambda: attn(seqlens=SEQ.float()), TypeError,
     "bik.attention: cache_seqlens must be int32 or int64"),
    (lambda: attn(q=Q.half()), TypeError,
     r"bik.attention: k \(torch.float32\) must have q's dtype \(torch.float16\)"),
    (lambda: attn(q=Q.double(), k=KC.double(), v=KC.double()), TypeError,
     "bik.attention: q has dtype float64"),
    (lambda: attn(v=torch.zeros(4, 8, 1, 16)), ValueError,
     "bik.attention: k .* and v .* must have the same shape"),
    (lambda: attn(k=KC.to("meta"), v=KC.to("meta")), ValueError,
     "bik.attention: q is on cpu but k_cache is on meta"),
    (lambda: attn(scale=float("nan")), ValueError, "bik.attention: scale must be finite"),
    (lambda: attn(q=torch.zeros(3, 4)), ValueError,
     r"bik.attention: q must be 3-D, got shape \[3, 4\]"),
    (lambda: attn(table=None), ValueError,
     r"bik.attention: a contiguous cache \[4, 8, 2, 16\] needs one row per sequence \(2\)"),
    (lambda: varlen(torch.tensor([0, 5, 13], dtype=I32)), ValueError,
     "bik.attention_varlen: cu_seqlens_k must .* end at total_k = 14"),
    (lambda: write(torch.zeros(2, 2, 16), torch.tensor([0, 32])), ValueError,
     "bik.write_kv_cache: slot 32 is outside the cache's 32 slots"),
    (lambda: write(torch.zeros(2, 3, 16), torch.tensor([0, 1])), ValueError,
     "bik.write_kv_cache: k .* must be \\[tokens, Hkv, D\\] matching the caches"),
    (lambda: write(torch.zeros(2, 2, 16).half(), torch.tensor([0, 1])), TypeError,
     "bik.write_kv_cache: new k/v"),
    (lambda: write(torch.zeros(3, 2, 16), torch.tensor([4, -1, 4])), ValueError,
     r"bik.write_kv_cache: slot_mapping names a slot more than once \(1 repeats\)"),
    (lambda: bik.write_kv_cache(KC, KC, torch.zeros(1, 2, 16), torch.ones(1, 2, 16),
                                torch.tensor([0])), ValueError,
     "bik.write_kv_cache: k_cache and v_cache are the same memory"),
    (lambda: attn(q=torch.zeros(3, 4, 0), k=torch.zeros(4, 8, 2, 0), v=torch.zeros(4, 8, 2, 0)),
     ValueError, "bik.attention: head_dim must be >= 1, got 0"),
])
def test_bad_input(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


def test_triton_head_dim_limits_are_reported(monkeypatch):
    # Let backend="triton" take CPU tensors without the interpreter (setting TRITON_INTERPRET
    # here would make this process's Triton kernels interpreted ones for every later test):
    # the head_dim check comes before any launch.
    import bik.ops._registry as registry

    monkeypatch.setitem(registry._CAN_RUN, "triton", lambda label, device: None)
    with pytest.raises(ValueError, match="bik.attention: backend='triton' supports head_dim"):
        bik.attention(torch.zeros(1, 2, 24), torch.zeros(1, 4, 2, 24), torch.zeros(1, 4, 2, 24),
                      cache_seqlens=torch.tensor([1]), cu_seqlens_q=torch.tensor([0, 1]),
                      block_table=torch.tensor([[0]]), backend="triton")
