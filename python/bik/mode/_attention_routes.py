"""The front ends' SDPA handlers: [B, H, L, D] attention as bik::attention_varlen.

Without a mask (or with is_causal) the batch is reshaped into equal-length varlen sequences;
with a padding (+ causal) mask each sequence's real queries and keys are compacted into one
(the mask analysis: mode/_masks.py), with or without grad: a trainer's padded or packed
batch then computes each sequence's forward bits alone (a Hugging Face trainer's logprobs
equal to the vLLM plugin's), and the backward route (mode/_grad_routes.py) compacts the same
sequences for bik::attention_varlen_backward. Fused CUDA attention below autograd is not
routed.
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import torch

from bik.configs import TRITON_ATTENTION_HEAD_DIMS as TRITON_HEAD_DIMS
from bik.mode._masks import MaskNotServed, PaddedSpans, padded_spans
from bik.mode._kit import Fallback, WarnedFallback, handler_table, prepare
from bik.ops._call import call

__all__ = ["ATTENTION_HANDLERS", "AttentionLayout", "attention_layout",
           "masked_attention_backward"]

aten = torch.ops.aten


class AttentionLayout(NamedTuple):
    """SDPA's [B, H, L, D] operands as bik::attention_varlen sees them (packed by sequence)."""

    backend: str
    shape: tuple[int, int, int, int, int, int]  # (B, Hq, Hkv, Lq, Lk, D)
    causal: bool
    scale: float
    cu_q: torch.Tensor
    cu_k: torch.Tensor

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """[B, H, L, ...] -> [B * L, H, ...] (each sequence's tokens contiguous)."""
        return t.transpose(1, 2).reshape(t.shape[0] * t.shape[2], t.shape[1], *t.shape[3:])

    def unpack(self, t: torch.Tensor, length: int) -> torch.Tensor:
        """[B * L, H, ...] -> [B, H, L, ...] (a view)."""
        return t.view(self.shape[0], length, *t.shape[1:]).transpose(1, 2)


def _gqa_operands(func, q, k, v) -> tuple[str, tuple[int, int, int, int, int, int]]:
    """(backend, (B, Hq, Hkv, Lq, Lk, D)) of [B, H, L, D] operands bik attends over (equal
    batch, GQA heads, at least one query), or Fallback."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise WarnedFallback("q/k/v not 4-D [B, H, L, D]")
    backend = prepare(func, q, k, v)
    nb, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    if k.shape[0] != nb or v.shape != k.shape or hkv == 0 or hq % hkv or lq == 0:
        raise WarnedFallback("shapes other than equal-batch GQA")
    if backend == "triton" and d not in TRITON_HEAD_DIMS:
        raise WarnedFallback(f"head_dim {d} not in {TRITON_HEAD_DIMS}")
    return backend, (nb, hq, hkv, lq, lk, d)


def attention_layout(func, q, k, v, attn_mask, dropout_p, is_causal, scale) -> AttentionLayout:
    """The checks both the SDPA forward and its backward routes make (so a forward that fell
    back pairs with a backward that falls back); raises Fallback for what bik does not serve."""
    if attn_mask is not None:
        raise WarnedFallback("attn_mask given (padding or a custom mask)")
    if dropout_p != 0:
        raise WarnedFallback("dropout_p > 0")
    backend, (nb, hq, hkv, lq, lk, d) = _gqa_operands(func, q, k, v)
    if lq > lk:
        raise WarnedFallback("more queries than keys (Lq > Lk)")
    if is_causal and lq != lk:
        raise WarnedFallback("is_causal with Lq != Lk (torch aligns the mask top-left)")
    # A single query without a mask sees every key: the bottom-right causal case, the same keys.
    causal = bool(is_causal) or lq == 1
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    cu_q = torch.arange(nb + 1, dtype=torch.int32, device=q.device) * lq
    cu_k = torch.arange(nb + 1, dtype=torch.int32, device=q.device) * lk
    return AttentionLayout(backend, (nb, hq, hkv, lq, lk, d), causal, scale, cu_q, cu_k)


class _Compacted(NamedTuple):
    """A padded or packed batch's sequences with real queries, packed for attention_varlen."""

    spans: PaddedSpans
    seqs: list[int]  # the spans' sequences that have real queries
    starts: list[int]  # each one's first packed query row (and the total, last)
    key_starts: list[int]  # each one's first packed key row (and the total, last)
    cu_q: torch.Tensor
    cu_k: torch.Tensor

    def pack(self, t: torch.Tensor, keys: bool = False) -> torch.Tensor:
        """[B, H, L, ...] -> [sum L, H, ...]: each sequence's query rows (or its keys)."""
        sp = self.spans
        a, z = (sp.lo, [h + 1 for h in sp.hi]) if keys else (sp.qa, sp.qb)
        return torch.cat([t[sp.batch[i], :, a[i]:z[i]].transpose(0, 1) for i in self.seqs])

    def unpack_into(self, dest: torch.Tensor, packed: torch.Tensor, keys: bool = False):
        """The inverse of pack, written into dest [B, H, L, ...] (rows elsewhere untouched)."""
        sp, at = self.spans, self.key_starts if keys else self.starts
        for n, i in enumerate(self.seqs):
            rows = slice(sp.lo[i], sp.hi[i] + 1) if keys else slice(sp.qa[i], sp.qb[i])
            dest[sp.batch[i], :, rows] = packed[at[n]:at[n + 1]].transpose(0, 1)


def _compacted(func, q, k, v, attn_mask, dropout_p, is_causal):
    """(backend, shape, _Compacted) of an SDPA call with a padding (+ causal) or packed mask,
    or Fallback: what the masked forward and its backward both serve."""
    if dropout_p != 0 or is_causal:
        raise WarnedFallback("attn_mask with dropout_p > 0 or is_causal")
    if torch.compiler.is_compiling():
        raise WarnedFallback("attn_mask under torch.compile (the mask's structure is data)")
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        raise WarnedFallback("attn_mask during CUDA graph capture (the mask is read on the host)")
    backend, shape = _gqa_operands(func, q, k, v)
    try:
        spans = padded_spans(attn_mask, shape[0], shape[3], shape[4])
    except MaskNotServed as exc:
        raise WarnedFallback(str(exc)) from None
    seqs = [i for i in range(len(spans.batch)) if spans.qb[i] > spans.qa[i]]
    starts = [0, *itertools.accumulate(spans.qb[i] - spans.qa[i] for i in seqs)]
    key_starts = [0, *itertools.accumulate(spans.hi[i] + 1 - spans.lo[i] for i in seqs)]
    # host copies: the op reads nothing back
    cu_q = torch.tensor(starts, dtype=torch.int32, device=q.device)
    cu_k = torch.tensor(key_starts, dtype=torch.int32, device=q.device)
    return backend, shape, _Compacted(spans, seqs, starts, key_starts, cu_q, cu_k)


def _max_len(at: list[int]) -> int:
    return max(b - a for a, b in zip(at, at[1:]))


def _rows_of(attn_mask, b, rows, lq, lk):
    mask4 = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    mask4 = mask4.expand(mask4.shape[0], mask4.shape[1], lq, lk)
    return mask4[min(b, mask4.shape[0] - 1)][:, rows][None]


def _masked_attention(func, q, k, v, attn_mask, dropout_p, is_causal, scale, stock):
    """SDPA with a padding (+ causal) or packed mask: each sequence's real queries and keys
    compacted into one bik::attention_varlen call (mode/_masks.py); (out, lse) or Fallback.
    ``stock`` computes the rows the spans leave to it (pad queries):
    stock(q_rows, k_b, v_b, mask_rows) -> (out, lse)."""
    backend, (nb, hq, _, lq, lk, d), c = _compacted(func, q, k, v, attn_mask, dropout_p,
                                                    is_causal)
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.full((nb, hq, lq), float("-inf"), dtype=torch.float32, device=q.device)
    if c.seqs:
        scale_f = 1.0 / math.sqrt(d) if scale is None else float(scale)
        o, s = call(
            "attention_varlen", c.pack(q), c.pack(k, keys=True), c.pack(v, keys=True),
            c.cu_q, c.cu_k, scale_f, c.spans.causal, backend, _max_len(c.starts),
            _max_len(c.key_starts))
        c.unpack_into(out, o)
        c.unpack_into(lse, s)
    for b, rows in c.spans.stock_rows:
        o_rows, s_rows = stock(q[b:b + 1, :, rows], k[b:b + 1], v[b:b + 1],
                               _rows_of(attn_mask, b, rows, lq, lk))
        out[b, :, rows], lse[b, :, rows] = o_rows[0], s_rows[0].float()
    return out, lse


def masked_attention_backward(func, grad_out, q, k, v, out, lse, dropout_p, is_causal,
                              attn_mask, scale):
    """The backward of _masked_attention (``func``: the aten backward op), or Fallback: the
    compacted sequences through bik::attention_varlen_backward, the pad queries the forward
    left to the stock kernel through ``func`` on their rows alone, their key gradients added
    after bik's. Each sequence's gradients then depend on that sequence alone."""
    backend, (_, _, _, lq, lk, d), c = _compacted(func, q, k, v, attn_mask, dropout_p,
                                                  is_causal)
    dq, dk, dv = (torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    scale_f = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if c.seqs:
        gq, gk, gv = call(
            "attention_varlen_backward", c.pack(grad_out), None, c.pack(q),
            c.pack(k, keys=True), c.pack(v, keys=True), c.pack(out), c.pack(lse).float(),
            c.cu_q, c.cu_k, scale_f, c.spans.causal, backend)
        c.unpack_into(dq, gq)
        c.unpack_into(dk, gk, keys=True)
        c.unpack_into(dv, gv, keys=True)
    for b, rows in c.spans.stock_rows:
        one = slice(b, b + 1)
        gq, gk, gv = func(grad_out[one][:, :, rows], q[one][:, :, rows], k[one], v[one],
                          out[one][:, :, rows], lse[one][:, :, rows], 0.0, False,
                          attn_mask=_rows_of(attn_mask, b, rows, lq, lk), scale=scale)
        dq[b, :, rows] = gq[0]
        dk[b] = dk[b] + gk[0]
        dv[b] = dv[b] + gv[0]
    return dq, dk, dv


def _plain_attention(func, q, k, v, attn_mask, dropout_p, is_causal, scale, stock=None):
    """SDPA on [B, H, L, D] through bik::attention_varlen; (out, lse) or Fallback."""
    if attn_mask is not None and stock is not None:
        return _masked_attention(func, q, k, v, attn_mask, dropout_p, is_causal, scale, stock)
    lay = attention_layout(func, q, k, v, attn_mask, dropout_p, is_causal, scale)
    lq, lk = q.shape[2], k.shape[2]
    out, lse = call(
        "attention_varlen",
        lay.pack(q), lay.pack(k), lay.pack(v), lay.cu_q, lay.cu_k, lay.scale, lay.causal,
        lay.backend, lq, lk)  # every sequence has lq queries and lk keys: host metadata
    return lay.unpack(out, lq).contiguous(), lay.unpack(lse, lq)


def _sdpa(func, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
          enable_gqa=False):
    if q.dim() == 4 and k.dim() == 4 and q.shape[1] != k.shape[1] and not enable_gqa:
        raise Fallback("Hq != Hkv without enable_gqa")

    def stock(q_rows, k_b, v_b, mask_rows):  # rows that see no key: torch's values
        o = func(q_rows, k_b, v_b, mask_rows, scale=scale, enable_gqa=enable_gqa)
        return o, torch.zeros(o.shape[:-1])

    return _plain_attention(func, q, k, v, attn_mask, dropout_p, is_causal, scale, stock)[0]


def _sdpa_flash_cpu(func, q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None,
                    scale=None):
    def stock(q_rows, k_b, v_b, mask_rows):
        return func(q_rows, k_b, v_b, attn_mask=mask_rows, scale=scale)

    return _plain_attention(func, q, k, v, attn_mask, dropout_p, is_causal, scale, stock)


def _not_routed_cuda_attention(func, *args, **kwargs):
    raise WarnedFallback("fused CUDA attention below autograd is not routed; run under "
                         "torch.inference_mode() (the mode then sees "
                         "scaled_dot_product_attention) or use eager attention")


_ROUTES = (  # (aten op, overload, handler); ops missing from an older torch are skipped
    ("scaled_dot_product_attention", "default", _sdpa),
    ("_scaled_dot_product_flash_attention_for_cpu", "default", _sdpa_flash_cpu),
    ("_scaled_dot_product_flash_attention", "default", _not_routed_cuda_attention),
    ("_scaled_dot_product_efficient_attention", "default", _not_routed_cuda_attention),
    ("_scaled_dot_product_cudnn_attention", "default", _not_routed_cuda_attention),
)
ATTENTION_HANDLERS = handler_table(_ROUTES)
