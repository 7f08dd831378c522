"""CPU attention with the fixed KV split size, built from bik's fixed-order CPU kernels.

For a sequence, each split [j*SPLIT, (j+1)*SPLIT) of its keys is reduced from a fresh state:
scores = q @ k^T (fixed-order matmul kernel, fp32), times scale*log2(e), masked to -inf where a
row cannot see a key; m_j = row max (exact); p = exp2(s - m_j) (exp2f, a pure function of each
value); l_j = p @ 1 and acc_j = p @ v (fixed-order matmul kernels). Splits are folded in
ascending j by :func:`merge_partial` and finally divided. A masked key contributes an exact 0
to every sum and an empty split folds as an exact identity, so a token's bits do not depend on
how its prompt was chunked, on the batch, or on the page size.
"""

from __future__ import annotations

import math

import torch

from bik.configs import CPU_ATTENTION_SPLIT
from bik.kernels import cpu

__all__ = ["attention_cpu", "merge_partial"]

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def _exp2(x: torch.Tensor) -> torch.Tensor:
    return cpu.unary_f32("exp2", x)


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = torch.empty((a.shape[0], b.shape[1]), dtype=torch.float32)
    cpu.matmul_f32(a, b, None, out)
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


def attention_cpu(q: torch.Tensor, keys_of, *, cu_q: list[int], seqlens_k: list[int],
                  num_kv_heads: int, scale: float, causal: bool):
    """q [total_q, Hq, D]; ``keys_of(b, L)`` -> fp32 (K [L, Hkv, D], V [L, Hkv, D]) of sequence b.

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
            lse[q0:q1, heads] = ((m + cpu.unary_f32("log2", l)) * LN2).reshape(t, g)
    return out, lse
