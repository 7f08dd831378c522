"""The reductions a Llama forward needs, as swappable kernel sets.

:class:`BikKernels` runs every reduction on bik's batch-invariant ops: a token's logits do not
depend on the batch around it. :class:`FastKernels` runs the same math on ordinary torch
kernels whose reduction order may change with the batch shape (CPU fp32 ``torch.mm`` computes a
row at M = 1 differently from M >= 4; cuBLAS picks split-K by M): close values, different bits.
The decode-verify-rollback loop decodes with the fast set and verifies with the bik set.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

import bik
from bik.dvr.step import Step

__all__ = ["BikKernels", "FastKernels", "Kernels"]


@runtime_checkable
class Kernels(Protocol):
    """Shapes: x [T, K]; w [N, K]; norms over the last dim; q [T, Hq, D]; caches
    [num_blocks, block_size, Hkv, D] with this step's K/V already written."""

    name: str

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor: ...

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(h), h) with h = x + residual rounded to x.dtype."""
        ...

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  step: Step, scale: float) -> torch.Tensor: ...


class BikKernels:
    """bik.linear, bik.rms_norm (residual fused) and bik.attention over the paged cache.

    ``backend`` is passed to every op ("cpu", "triton", "cuda" or None = by device); an
    explicit backend that cannot run raises rather than falling back.
    """

    def __init__(self, backend: str | None = None):
        self.backend = backend
        self.name = "bik" if backend is None else f"bik-{backend}"

    def linear(self, x, w):
        return bik.linear(x, w, backend=self.backend)

    def rms_norm(self, x, w, eps):
        return bik.rms_norm(x, w, eps, backend=self.backend)

    def add_rms_norm(self, x, residual, w, eps):
        return bik.rms_norm(x, w, eps, residual=residual, backend=self.backend)

    def attention(self, q, k_cache, v_cache, step, scale):
        return bik.attention(q, k_cache, v_cache, cache_seqlens=step.cache_seqlens,
                             cu_seqlens_q=step.cu_seqlens_q, block_table=step.block_table,
                             scale=scale, max_seqlen_q=step.max_seqlen_q,
                             max_seqlen_k=step.max_seqlen_k, backend=self.backend)

    def __repr__(self) -> str:
        return f"BikKernels(backend={self.backend!r})"


class FastKernels:
    """Stock torch kernels: F.linear, the usual RMSNorm formula, and one padded SDPA over the
    keys gathered from the paged cache. Not batch-invariant (that is the point)."""

    name = "fast"

    def linear(self, x, w):
        return F.linear(x, w)

    def rms_norm(self, x, w, eps):
        x32 = x.float()
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return (x32 * rstd * w.float()).to(x.dtype)

    def add_rms_norm(self, x, residual, w, eps):
        h = x + residual  # torch rounds the sum to x.dtype, as bik does
        return self.rms_norm(h, w, eps), h

    def attention(self, q, k_cache, v_cache, step, scale):
        """One SDPA call for the whole step: every sequence's queries and keys gathered into
        a padded [B, H, Qmax / Lmax, D] batch with a bottom-right causal mask. The padding
        (set by the longest sequence in the step) is one more way the bits follow the batch."""
        block_size, hkv, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
        nb, device = step.num_seqs, q.device
        if step.num_tokens == 0:
            return torch.empty_like(q)
        q_max, kv_max = max(step.q_lens), max(step.kv_lens)
        q_lens = torch.tensor(step.q_lens, device=device)
        kv_lens = step.cache_seqlens.to(torch.int64)
        key_pos = torch.arange(kv_max, device=device)
        pages = step.block_table.long().gather(1, (key_pos // block_size).expand(nb, -1)
                                               .clamp(max=step.block_table.shape[1] - 1))
        slots = pages * block_size + key_pos % block_size  # [B, Lmax]
        k = k_cache.view(-1, hkv, d)[slots].transpose(1, 2)  # [B, Hkv, Lmax, D]
        v = v_cache.view(-1, hkv, d)[slots].transpose(1, 2)
        # Packed row of query i of sequence b (padding rows read row 0 and are dropped).
        row = torch.arange(q_max, device=device)
        valid = row[None, :] < q_lens[:, None]  # [B, Qmax]
        packed = (step.cu_seqlens_q[:-1].long()[:, None] + row[None, :]).where(valid, 0)
        qb = q[packed].transpose(1, 2)  # [B, Hq, Qmax, D]
        q_pos = kv_lens[:, None] - q_lens[:, None] + row[None, :]  # absolute positions
        mask = key_pos[None, None, :] <= q_pos[:, :, None]  # [B, Qmax, Lmax]
        mask = mask | ~valid[:, :, None]  # padding rows see every key: no empty softmax
        out = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask[:, None], scale=scale,
                                             enable_gqa=True)
        return out.transpose(1, 2)[valid]  # [T, Hq, D] in packed order

    def __repr__(self) -> str:
        return "FastKernels()"
