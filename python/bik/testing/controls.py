"""Deliberately batch-dependent references: the harness must reject them.

They mimic what non-invariant libraries do — pick a split of the reduction by the number of
rows — so a test that passes bik and rejects these shows that the test can fail.
"""

from __future__ import annotations

import torch

__all__ = [
    "head_adaptive_attention",
    "length_adaptive_attention",
    "row_keyed_sample",
    "sdpa_attention",
    "split_by_m_matmul",
    "split_by_m_mean",
    "split_by_m_rms_norm",
    "split_by_m_softmax",
    "splits_for_rows",
]


def splits_for_rows(m: int) -> int:
    """A split-K heuristic in the style of GEMM libraries: fewer rows, more splits."""
    return 4 if m <= 2 else 2 if m <= 16 else 1


def _chunked_sum(terms: torch.Tensor, splits: int) -> torch.Tensor:
    """Sum fp32 ``terms`` [M, K, ...] over dim 1 in ``splits`` sequential partial sums."""
    total = None
    for chunk in terms.tensor_split(splits, dim=1):
        part = torch.zeros_like(terms[:, 0])
        for k in range(chunk.shape[1]):  # sequential, so the only variable is the split
            part = part + chunk[:, k]
        total = part if total is None else total + part
    return total


def split_by_m_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [K, N] in fp32 with a K split chosen by M (NOT batch-invariant)."""
    terms = a.float()[:, :, None] * b.float()[None, :, :]
    return _chunked_sum(terms, splits_for_rows(a.shape[0])).to(a.dtype)


def split_by_m_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm whose sum of squares is split by M (NOT batch-invariant)."""
    x32 = x.float()
    ss = _chunked_sum((x32 * x32)[:, :, None], splits_for_rows(x.shape[0]))[:, 0]
    rstd = torch.rsqrt(ss / x.shape[1] + eps)
    return (x32 * rstd[:, None] * weight.float()).to(x.dtype)


def split_by_m_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax over the last dim of x [M, n] whose sum of exp(x - max) is split by M (NOT
    batch-invariant)."""
    assert dim in (-1, x.dim() - 1)
    x32 = x.float()
    e = torch.exp(x32 - x32.amax(dim=-1, keepdim=True))
    total = _chunked_sum(e[:, :, None], splits_for_rows(x.shape[0]))
    return (e / total).to(x.dtype)


def split_by_m_mean(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Mean over the last dim of x [M, n] with the sum split by M (NOT batch-invariant)."""
    assert dim in (-1, x.dim() - 1)
    total = _chunked_sum(x.float()[:, :, None], splits_for_rows(x.shape[0]))[:, 0]
    return (total / x.shape[-1]).to(x.dtype)


def length_adaptive_attention(q, k_cache, v_cache, cache_seqlens, cu_seqlens_q, block_table,
                              *, keys_per_split: int = 16):
    """Paged attention whose split COUNT follows the number of cached keys (NOT invariant).

    Like kernels that pick num_splits from the sequence length, the split boundaries move when
    the same token is computed in a prefill (many keys cached) or in decode (fewer), so its bits
    change with the schedule. Same calling convention as :func:`bik.attention` (paged only).
    """
    return _split_attention(q, k_cache, v_cache, cache_seqlens, cu_seqlens_q, block_table,
                            lambda length: max(1, length // keys_per_split))


def head_adaptive_attention(q, k_cache, v_cache, cache_seqlens, cu_seqlens_q, block_table,
                            *, work_items: int = 16):
    """Paged attention whose split COUNT fills ``work_items`` with (sequences x q heads) (NOT
    invariant): what split-KV heuristics sized to the SM count do, so a tensor-parallel rank
    that holds fewer heads splits its keys more finely and gets other bits for the same head.
    Same calling convention as :func:`bik.attention` (paged only)."""
    rows = (cu_seqlens_q.numel() - 1) * q.shape[1]
    return _split_attention(q, k_cache, v_cache, cache_seqlens, cu_seqlens_q, block_table,
                            lambda length: max(1, min(length, -(-work_items // rows))))


def _split_attention(q, k_cache, v_cache, cache_seqlens, cu_seqlens_q, block_table, splits_for):
    """Causal paged attention whose keys are cut into ``splits_for(length)`` equal splits, each
    reduced in fp32 and merged with the online-softmax rescaling."""
    page = k_cache.shape[1]
    hq, hkv, d = q.shape[1], k_cache.shape[2], q.shape[2]
    out = torch.empty_like(q)
    cu, lens = cu_seqlens_q.tolist(), cache_seqlens.tolist()
    for b, length in enumerate(lens):
        pos = torch.arange(length)
        slot = block_table[b, pos // page].long() * page + pos % page
        k = k_cache.reshape(-1, hkv, d)[slot].float().repeat_interleave(hq // hkv, 1)
        v = v_cache.reshape(-1, hkv, d)[slot].float().repeat_interleave(hq // hkv, 1)
        splits = splits_for(length)
        q_len = cu[b + 1] - cu[b]
        for t in range(q_len):
            p = length - q_len + t
            qt = q[cu[b] + t].float() / d**0.5  # [Hq, D]
            m = torch.full((hq,), float("-inf"))
            den = torch.zeros(hq)
            acc = torch.zeros(hq, d)
            for idx in torch.arange(p + 1).tensor_split(splits):
                if idx.numel() == 0:
                    continue
                s = (qt[None] * k[idx]).sum(-1)  # [n, Hq]
                m_j = s.amax(0)
                e = torch.exp(s - m_j)
                m_new = torch.maximum(m, m_j)
                a, c = torch.exp(m - m_new), torch.exp(m_j - m_new)
                den = den * a + e.sum(0) * c
                acc = acc * a[:, None] + (e[:, :, None] * v[idx]).sum(0) * c[:, None]
                m = m_new
            out[cu[b] + t] = (acc / den[:, None]).to(q.dtype)
    return out


def sdpa_attention(q, k_cache, v_cache, cache_seqlens, cu_seqlens_q, block_table):
    """Stock torch SDPA behind :func:`bik.attention`'s calling convention (paged cache), per
    sequence: causal prefill with is_causal, decode without a mask, other chunks with a
    bottom-right mask. Not bik's: the stock path that the demo and the tests compare against
    (on the CPU, fp32 SDPA gives a token other bits in decode than in a prefill, measured)."""
    page, hkv, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    hq = q.shape[1]
    outs = []
    cu, lens = cu_seqlens_q.tolist(), cache_seqlens.tolist()
    for b, length in enumerate(lens):
        pos = torch.arange(length)
        slot = block_table[b, pos // page].long() * page + pos % page
        k = k_cache.reshape(-1, hkv, d)[slot].repeat_interleave(hq // hkv, 1).transpose(0, 1)
        v = v_cache.reshape(-1, hkv, d)[slot].repeat_interleave(hq // hkv, 1).transpose(0, 1)
        qb = q[cu[b]:cu[b + 1]].transpose(0, 1)
        t = qb.shape[1]
        kwargs = ({"is_causal": True} if t == length else {} if t == 1 else
                  {"attn_mask": pos[None, :] <= torch.arange(length - t, length)[:, None]})
        outs.append(torch.nn.functional.scaled_dot_product_attention(qb, k, v, **kwargs)
                    .transpose(0, 1))
    return torch.cat(outs)


def row_keyed_sample(logits: torch.Tensor, seed: int, temperature: float = 1.0) -> torch.Tensor:
    """Gumbel-max sampling whose noise is keyed by the batch ROW (NOT batch-invariant).

    Like FlashInfer's sampler (Philox offset by row), row i reads the i-th slice of one random
    stream seeded per call, so a request's token changes when it moves to another row or the
    batch grows. Returns int64 tokens [B]. The sampler tests must reject it.
    """
    gen = torch.Generator(device=logits.device).manual_seed(seed)
    u = torch.rand(logits.shape, generator=gen, device=logits.device).clamp(1e-7, 1 - 1e-7)
    return (logits.float() / temperature - torch.log(-torch.log(u))).argmax(dim=-1)
