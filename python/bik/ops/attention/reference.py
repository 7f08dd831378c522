"""The CPU backend's attention contract in torch: :func:`attention_cpu_reference` (tests only).

bik/ops/attention/cpu.py runs the same sequence in C++ (csrc/cpu/attention.h) and gives its
bits; the reference is built from bik's fixed-order CPU matmul. For a sequence, each split
[j*SPLIT, (j+1)*SPLIT) of its keys is reduced from a fresh state: scores = q @ k^T (fixed-order matmul kernel, fp32, mul-add), times
scale*log2(e), masked to -inf where a row cannot see a key; m_j = row max (exact);
p = exp2(s - m_j) (exp2f, a pure function of each value); l_j = p @ 1 and acc_j = p @ v
(fixed-order matmul kernels). Splits are folded in ascending j by :func:`merge_partial` and
finally divided. A masked key contributes an exact 0 to every sum and an empty split folds as
an exact identity, so a token's bits do not depend on how its prompt was chunked, on the
batch, or on the page size.
"""

from __future__ import annotations

import math

import torch

from bik.configs import CPU_ATTENTION_SPLIT, matmul_split
from bik.ops._pointwise import LN2, LOG2E, unary_f32
from bik.runtime import cpu_ext


def _exp2(x: torch.Tensor) -> torch.Tensor:
    return unary_f32("exp2", x)


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # bik's fixed-order CPU matmul kernel on contract.h's mul-add sequence, which attention's
    # dots run in every process (fp32 in, fp32 out: no rounding beyond the kernel's own)
    (m, k), n = a.shape, b.shape[1]
    out = torch.empty(m, n)
    if m and n:
        cpu_ext.require().matmul_f32(
            a.data_ptr(), a.stride(0), a.stride(1), b.data_ptr(), b.stride(0), b.stride(1), 0,
            out.data_ptr(), n, m, n, k, matmul_split(torch.float32, n, k).split, 1,
            fp32_fma=False)
    return out


def merge_partial(m, l, acc, m_j, l_j, acc_j):
    """Fold one split's (max, sum, acc) into the running state (log2 units). Elementwise ops
    only, each exactly rounded, so each row's result depends on that row alone."""
    m_new = torch.maximum(m, m_j)
    m_safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
    a, b = _exp2(m - m_safe), _exp2(m_j - m_safe)
    return m_new, l * a + l_j * b, acc * a[:, None] + acc_j * b[:, None]


def _split_partial(q_rows, k, v, pos_rows, lo, causal, scale_log2e):
    """One split's (m_j, l_j, acc_j) for query rows [R, D] against keys k, v [n, D]."""
    s = _mm(q_rows, k.t()) * scale_log2e
    if causal:
        kv_pos = torch.arange(lo, lo + k.shape[0])
        s = torch.where(kv_pos[None, :] <= pos_rows[:, None], s, float("-inf"))
    m_j = s.amax(dim=1)
    m_safe = torch.where(m_j == float("-inf"), torch.zeros_like(m_j), m_j)
    p = _exp2(s - m_safe[:, None])
    l_j = _mm(p, torch.ones(k.shape[0], 1))[:, 0]
    return m_j, l_j, _mm(p, v)


def attention_cpu_reference(q: torch.Tensor, keys_of, *, cu_q: list[int], seqlens_k: list[int],
                            num_kv_heads: int, scale: float, causal: bool):
    """The spec: q [total_q, Hq, D]; ``keys_of(b, L)`` -> fp32 (K [L, Hkv, D], V [L, Hkv, D]) of
    sequence b (e.g. :func:`reference_keys`). One split at a time, in Python.

    Returns (out [total_q, Hq, D] in q.dtype, lse [total_q, Hq] fp32, natural log).
    """
    total_q, hq, d = q.shape
    g = hq // num_kv_heads
    out = torch.empty((total_q, hq, d), dtype=q.dtype)
    lse = torch.empty((total_q, hq), dtype=torch.float32)
    scale_log2e = torch.tensor(scale * LOG2E, dtype=torch.float32)
    for b in range(len(seqlens_k)):
        q0, q1 = cu_q[b], cu_q[b + 1]
        t = q1 - q0
        if t == 0:
            continue
        length = seqlens_k[b]
        k_all, v_all = keys_of(b, length)
        pos = torch.arange(length - t, length).repeat_interleave(g)  # row = (token, head in group)
        for hk in range(num_kv_heads):
            heads = slice(hk * g, (hk + 1) * g)
            q_rows = q[q0:q1, heads].float().reshape(t * g, d)
            m = torch.full((t * g,), float("-inf"))
            l = torch.zeros(t * g)
            acc = torch.zeros(t * g, d)
            for j in range(math.ceil(length / CPU_ATTENTION_SPLIT)):
                lo = j * CPU_ATTENTION_SPLIT
                hi = min(lo + CPU_ATTENTION_SPLIT, length)
                part = _split_partial(q_rows, k_all[lo:hi, hk], v_all[lo:hi, hk], pos, lo,
                                      causal, scale_log2e)
                m, l, acc = merge_partial(m, l, acc, *part)
            out[q0:q1, heads] = (acc / l[:, None]).reshape(t, g, d).to(q.dtype)
            lse[q0:q1, heads] = ((m + unary_f32("log2", l)) * LN2).reshape(t, g)
    return out, lse


def reference_keys(k: torch.Tensor, v: torch.Tensor, *, table: torch.Tensor | None,
                   base: torch.Tensor | None):
    """``keys_of`` for :func:`attention_cpu_reference` over the op's inputs: a paged cache
    (``table`` [B, pages]), a contiguous cache [B, max_len, Hkv, D] or varlen k/v
    [total_k, Hkv, D] with ``base`` [B] the element offset of each sequence's key 0."""
    hkv, d = k.shape[-2], k.shape[-1]
    flat_k, flat_v = k.reshape(-1, hkv, d), v.reshape(-1, hkv, d)

    def keys_of(b, length):
        if table is not None:  # paged: gather the sequence's slots
            pos = torch.arange(length)
            block = k.shape[1]
            idx = table[b, pos // block].long() * block + pos % block
            return flat_k[idx].float(), flat_v[idx].float()
        if k.dim() == 4:  # contiguous cache [B, max_len, Hkv, D]
            return k[b, :length].float(), v[b, :length].float()
        start = int(base[b]) // k.stride(0)  # varlen [total_k, Hkv, D]
        return k[start:start + length].float(), v[start:start + length].float()

    return keys_of
