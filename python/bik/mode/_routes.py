"""The aten ops bik's mode routes, one handler each (docs/api.md#bikbatch_invariant_mode).

A handler gets ``(func, *args, **kwargs)`` as aten passes them and returns what ``func`` would,
computed by ``torch.ops.bik.*``; it raises :class:`Fallback` to hand the call to the original
kernel (counted, and warned once where ``warn``). The handlers of the ops that backward
formulas call are in _grad_routes.py.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

import bik.ops  # noqa: F401  (registers torch.ops.bik.*)
from bik._dtypes import dtype_name
from bik.configs import TRITON_ATTENTION_HEAD_DIMS as TRITON_HEAD_DIMS
from bik.ops._checks import SUPPORTED_DTYPES
from bik.ops._registry import default_backend

__all__ = ["HANDLERS", "AttentionLayout", "Fallback", "attention_layout"]

aten = torch.ops.aten


class Fallback(Exception):
    """Raised by a handler: this call goes to the original kernel, for ``reason``."""

    def __init__(self, reason: str, warn: bool = False):
        super().__init__(reason)
        self.reason, self.warn = reason, warn


def _backend(t: torch.Tensor) -> str:
    backend = default_backend(t.device)  # a dict lookup by the device type, no device query
    if backend is None:
        raise Fallback(f"device {t.device.type} has no bik backend")
    return backend


def _prepare(func, *tensors: torch.Tensor | None) -> str:
    """Check that bik serves these operands; return the backend. Raises Fallback otherwise.

    Inputs that require grad are fine: the mode runs below autograd, which has already
    recorded the op's stock backward formula; that formula's own aten ops reach the mode when
    ``.backward()`` runs inside it (the backward ops are routed in _grad_routes.py)."""
    ts = [t for t in tensors if t is not None]
    dtype, device = ts[0].dtype, ts[0].device
    for t in ts:
        if t.dtype not in SUPPORTED_DTYPES:
            raise Fallback(f"dtype {dtype_name(t.dtype)}")
        if t.dtype != dtype or t.device != device:
            raise Fallback("operands of different dtypes or devices")
    return _backend(ts[0])


def _cast_first(x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """x for a reduction called with ``dtype=``: torch casts x to it first. A dtype bik does
    not serve raises Fallback."""
    if dtype is None:
        return x
    if dtype not in SUPPORTED_DTYPES:
        raise Fallback(f"dtype {dtype}")
    return x.to(dtype)


def _matmul_rows(a: torch.Tensor, b: torch.Tensor, bias, backend: str, out_dtype=None):
    """a [..., K] @ b [K, N] (+ bias [N]) on bik::matmul, every leading dim of a a row."""
    rows = math.prod(a.shape[:-1])
    out = torch.ops.bik.matmul(a.reshape(rows, a.shape[-1]), b, bias, out_dtype, backend)
    return out.reshape(*a.shape[:-1], b.shape[-1])


def _write_out(func, out: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    if out.dtype != result.dtype or out.device != result.device:
        raise Fallback("out= tensor of another dtype or device")
    if out.shape != result.shape:
        out.resize_(result.shape)
    return out.copy_(result)


def _mm(func, a, b, out=None):
    r = torch.ops.bik.matmul(a, b, None, None, _prepare(func, a, b))
    return r if out is None else _write_out(func, out, r)


def _addmm(func, bias, a, b, *, beta=1, alpha=1, out=None):
    backend = _prepare(func, bias, a, b)
    m, n = a.shape[0], b.shape[-1]
    try:  # torch's broadcasting rule: bias must expand to [M, N]
        bias_mn = bias.expand(m, n)
    except RuntimeError as exc:
        raise Fallback("bias that does not broadcast to [M, N] (torch raises)") from exc
    if beta == 1 and alpha == 1 and bias.dim() >= 1 and bias.numel() == n \
            and bias.shape[-1] == n and (bias.dim() < 2 or bias.shape[0] == 1):
        r = torch.ops.bik.matmul(a, b, bias.reshape(n), None, backend)  # bias added in fp32
    else:  # alpha/beta honoured elementwise on bik's fp32 product (elementwise is invariant)
        if alpha == 0:  # BLAS semantics, as torch: a @ b is ignored (inf/NaN included)
            r = torch.zeros((m, n), dtype=torch.float32, device=a.device)
        else:
            r = torch.ops.bik.matmul(a, b, None, torch.float32, backend)
            if alpha != 1:
                r = r * alpha
        if beta != 0:  # beta == 0 ignores bias, NaN included, as torch does
            r = r + bias_mn.float() * beta if beta != 1 else r + bias_mn.float()
        r = r.to(a.dtype)
    return r if out is None else _write_out(func, out, r)


def _mv(func, a, v, out=None):  # [M, K] @ [K]: each output element is one row of a
    r = torch.ops.bik.matmul(a, v.unsqueeze(1), None, None, _prepare(func, a, v)).squeeze(1)
    return r if out is None else _write_out(func, out, r)


def _dot(func, a, b, out=None):
    r = torch.ops.bik.matmul(a.unsqueeze(0), b.unsqueeze(1), None, None,
                             _prepare(func, a, b)).reshape(())
    return r if out is None else _write_out(func, out, r)


def _not_routed(func, *args, **kwargs):
    raise Fallback("not routed through bik yet (stock kernel, may vary with the batch)",
                   warn=True)


def _bmm(func, a, b, out=None):
    r = torch.ops.bik.bmm(a, b, None, _prepare(func, a, b))
    return r if out is None else _write_out(func, out, r)


def _matmul(func, a, b):
    backend = _prepare(func, a, b)
    if a.dim() == 0 or b.dim() == 0:
        raise Fallback("0-D operand")
    if b.dim() == 2:
        return _matmul_rows(a, b, None, backend)
    if b.dim() == 1:
        return _matmul_rows(a, b.unsqueeze(1), None, backend).squeeze(-1)
    a2 = a.unsqueeze(0) if a.dim() == 1 else a
    batch = torch.broadcast_shapes(a2.shape[:-2], b.shape[:-2])
    m, k, n = a2.shape[-2], a2.shape[-1], b.shape[-1]
    a3 = a2.expand(*batch, m, k).reshape(-1, m, k)
    b3 = b.expand(*batch, k, n).reshape(-1, k, n)
    r = torch.ops.bik.bmm(a3, b3, None, backend).reshape(*batch, m, n)
    return r.squeeze(-2) if a.dim() == 1 else r


def _linear(func, x, weight, bias=None):
    backend = _prepare(func, x, weight, bias)
    if bias is not None and bias.dim() != 1:
        raise Fallback("bias that is not 1-D")
    if x.dim() == 0:
        raise Fallback("0-D input")
    if weight.dim() != 2:
        raise Fallback("weight that is not 2-D")
    return _matmul_rows(x, weight.t(), bias, backend)


def _softmax_like(log: bool):
    op = torch.ops.bik.log_softmax if log else torch.ops.bik.softmax

    def internal(func, x, dim, half_to_float):  # aten::_softmax / _log_softmax
        backend = _prepare(func, x)
        return op(x, dim, torch.float32 if half_to_float else None, backend)

    def public(func, x, dim, dtype=None):  # aten::softmax.int / log_softmax.int
        x = _cast_first(x, dtype)
        return op(x, dim, None, _prepare(func, x))

    return internal, public


def _mean(func, x, dim=None, keepdim=False, *, dtype=None):
    x = _cast_first(x, dtype)
    backend = _prepare(func, x)
    return torch.ops.bik.mean(x, [] if dim is None else list(dim), bool(keepdim), None, backend)


def _rms_norm_args(func, x, normalized_shape, weight, eps):
    backend = _prepare(func, x)
    if weight is not None:
        _prepare(func, weight)
    if len(normalized_shape) != 1 or x.dim() == 0 or normalized_shape[0] != x.shape[-1]:
        raise Fallback("normalized_shape other than the last dim")
    h = x.shape[-1]
    if weight is None:
        weight = torch.ones(h, dtype=x.dtype, device=x.device)
    # Stock rms_norm defaults to the fp32 epsilon for every input dtype (bf16's would be 0.0078).
    eps = torch.finfo(torch.float32).eps if eps is None else float(eps)
    x2 = x.reshape(math.prod(x.shape[:-1]), h)
    return torch.ops.bik.rms_norm(x2, weight, eps, backend).reshape(x.shape), x2, eps, backend


def _rms_norm(func, x, normalized_shape, weight=None, eps=None):
    return _rms_norm_args(func, x, normalized_shape, weight, eps)[0]


def _fused_rms_norm(func, x, normalized_shape, weight=None, eps=None):
    out, x2, eps, backend = _rms_norm_args(func, x, normalized_shape, weight, eps)
    x32 = x2.float()
    ms = torch.ops.bik.mean(x32 * x32, [1], True, None, backend)
    return out, torch.rsqrt(ms + eps).reshape(*x.shape[:-1], 1)


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


def attention_layout(func, q, k, v, attn_mask, dropout_p, is_causal, scale) -> AttentionLayout:
    """The checks both the SDPA forward and its backward routes make (so a forward that fell
    back pairs with a backward that falls back); raises Fallback for what bik does not serve."""
    if attn_mask is not None:
        raise Fallback("attn_mask given (padding or a custom mask)", warn=True)
    if dropout_p != 0:
        raise Fallback("dropout_p > 0", warn=True)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise Fallback("q/k/v not 4-D [B, H, L, D]", warn=True)
    backend = _prepare(func, q, k, v)
    nb, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    if k.shape[0] != nb or v.shape != k.shape or hkv == 0 or hq % hkv or lq == 0 or lq > lk:
        raise Fallback("shapes other than equal-batch GQA with 0 < Lq <= Lk", warn=True)
    if is_causal and lq != lk:
        raise Fallback("is_causal with Lq != Lk (torch aligns the mask top-left)", warn=True)
    if backend == "triton" and d not in TRITON_HEAD_DIMS:
        raise Fallback(f"head_dim {d} not in {TRITON_HEAD_DIMS}", warn=True)
    # A single query without a mask sees every key: the bottom-right causal case, the same keys.
    causal = bool(is_causal) or lq == 1
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    cu_q = torch.arange(nb + 1, dtype=torch.int32, device=q.device) * lq
    cu_k = torch.arange(nb + 1, dtype=torch.int32, device=q.device) * lk
    return AttentionLayout(backend, (nb, hq, hkv, lq, lk, d), causal, scale, cu_q, cu_k)


def _plain_attention(func, q, k, v, attn_mask, dropout_p, is_causal, scale):
    """SDPA on [B, H, L, D] through bik::attention_varlen; (out, lse) or Fallback."""
    lay = attention_layout(func, q, k, v, attn_mask, dropout_p, is_causal, scale)
    out, lse = torch.ops.bik.attention_varlen(
        lay.pack(q), lay.pack(k), lay.pack(v), lay.cu_q, lay.cu_k, lay.scale, lay.causal,
        lay.backend)
    lq = q.shape[2]
    return lay.unpack(out, lq).contiguous(), lay.unpack(lse, lq)


def _sdpa(func, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
          enable_gqa=False):
    if q.dim() == 4 and k.dim() == 4 and q.shape[1] != k.shape[1] and not enable_gqa:
        raise Fallback("Hq != Hkv without enable_gqa")
    return _plain_attention(func, q, k, v, attn_mask, dropout_p, is_causal, scale)[0]


def _sdpa_flash_cpu(func, q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None,
                    scale=None):
    return _plain_attention(func, q, k, v, attn_mask, dropout_p, is_causal, scale)


def _not_routed_cuda_attention(func, *args, **kwargs):
    raise Fallback("fused CUDA attention below autograd is not routed; run under "
                    "torch.inference_mode() (the mode then sees scaled_dot_product_attention) "
                    "or use eager attention", warn=True)


_softmax_internal, _softmax_public = _softmax_like(log=False)
_log_softmax_internal, _log_softmax_public = _softmax_like(log=True)

_ROUTES = (  # (aten op, overload, handler); ops missing from an older torch are skipped
    ("mm", "default", _mm),
    ("mm", "out", _mm),
    ("addmm", "default", _addmm),
    ("addmm", "out", _addmm),
    ("bmm", "default", _bmm),
    ("bmm", "out", _bmm),
    ("matmul", "default", _matmul),
    ("mv", "default", _mv),
    ("mv", "out", _mv),
    ("dot", "default", _dot),
    ("addmv", "default", _not_routed),
    ("baddbmm", "default", _not_routed),
    ("addbmm", "default", _not_routed),
    ("linear", "default", _linear),
    ("_softmax", "default", _softmax_internal),
    ("_log_softmax", "default", _log_softmax_internal),
    ("softmax", "int", _softmax_public),
    ("log_softmax", "int", _log_softmax_public),
    ("mean", "dim", _mean),
    ("mean", "default", _mean),
    ("rms_norm", "default", _rms_norm),
    ("_fused_rms_norm", "default", _fused_rms_norm),
    ("scaled_dot_product_attention", "default", _sdpa),
    ("_scaled_dot_product_flash_attention_for_cpu", "default", _sdpa_flash_cpu),
    ("_scaled_dot_product_flash_attention", "default", _not_routed_cuda_attention),
    ("_scaled_dot_product_efficient_attention", "default", _not_routed_cuda_attention),
    ("_scaled_dot_product_cudnn_attention", "default", _not_routed_cuda_attention),
)
HANDLERS = {
    getattr(getattr(aten, name), overload): handler
    for name, overload, handler in _ROUTES
    if hasattr(aten, name) and hasattr(getattr(aten, name), overload)
}
