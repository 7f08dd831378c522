"""Handlers for the aten ops that autograd's backward formulas call (docs/design.md#backward).

Under grad, autograd records the stock backward of each routed forward op (MmBackward,
SoftmaxBackward, ...). When ``.backward()`` runs inside the mode, that formula's aten calls
reach the mode: the matmuls go through _routes.py, and the reductions stock kernels would
otherwise do are routed here, each through a bik op in a fixed order:

- ``sum`` (bias and norm-weight gradients, broadcast reductions): a matmul with a ones vector;
- ``_softmax_backward_data`` / ``_log_softmax_backward_data``: the row sum likewise;
- ``_fused_rms_norm_backward`` (CUDA's F.rms_norm): bik.mean per row, ones @ for the weight;
- ``silu_backward``: elementwise, from the same position-independent exp as the forward;
- ``_scaled_dot_product_flash_attention_for_cpu_backward``: bik::attention_varlen_backward,
  with a padding or packed mask on the sequences the forward compacted.
"""

from __future__ import annotations

import math

import torch

from bik.mode._attention_routes import attention_layout, masked_attention_backward
from bik.mode._kit import Fallback, cast_first, handler_table, prepare, reduced_dims
from bik.ops._call import call
from bik.ops._checks import SUPPORTED_DTYPES
from bik.ops._pointwise import exp_f32, sigmoid_f32

__all__ = ["GRAD_HANDLERS", "ones_sum"]

aten = torch.ops.aten
_F32 = torch.float32


def _matmul(*args):
    """bik::matmul on operands this module has shaped (ops/_call.py picks the route)."""
    return call("matmul", *args, validated=True)


def ones_sum(x: torch.Tensor, dims: list[int], backend: str, out_dtype=None) -> torch.Tensor:
    """Sum of x over ``dims`` (sorted, distinct, non-negative), kept dims in order, through
    bik::matmul with a ones vector (``1 * x`` is exact, so it is bik's fixed-order sum).

    Leading dims (a sum over rows, e.g. a bias gradient): ``ones[1, n] @ x[n, rest]``.
    Otherwise the reduced dims are moved last: ``x[rest, n] @ ones[n, 1]``, each output
    element one row of the product, so it depends only on its own elements.
    """
    kept = [d for d in range(x.dim()) if d not in dims]
    n = math.prod([x.shape[d] for d in dims])  # a list: Dynamo traces no genexpr here
    m = math.prod([x.shape[d] for d in kept])
    mm = _matmul
    if dims == list(range(len(dims))):
        ones = torch.ones((1, n), dtype=x.dtype, device=x.device)
        r = mm(ones, x.reshape(n, m), None, out_dtype, backend)
    else:
        ones = torch.ones((n, 1), dtype=x.dtype, device=x.device)
        r = mm(x.permute(*kept, *dims).reshape(m, n), ones, None, out_dtype, backend)
    return r.reshape([x.shape[d] for d in kept])


def _sum(func, x, dim=None, keepdim=False, *, dtype=None):
    dims = reduced_dims(x, dim)
    x = cast_first(x, dtype)
    backend = prepare(func, x)
    if x.dim() == 0:
        raise Fallback("0-D input")
    r = ones_sum(x, dims, backend)
    if keepdim:
        r = r.reshape([1 if d in dims else x.shape[d] for d in range(x.dim())])
    return r


def _sum_all(func, x, *, dtype=None):
    return _sum(func, x, None, False, dtype=dtype)


def _rows_last(t: torch.Tensor, dim: int) -> torch.Tensor:
    """fp32 [rows, n] with ``dim`` moved last."""
    t = t.movedim(dim, -1).float()
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def _softmax_backward_like(log: bool):
    def handler(func, grad, out, dim, input_dtype):
        backend = prepare(func, grad, out)
        if input_dtype not in SUPPORTED_DTYPES:
            raise Fallback(f"input_dtype {input_dtype}")
        if out.dim() == 0:
            raise Fallback("0-D input")
        dim = dim % out.dim()
        g, y = _rows_last(grad, dim), _rows_last(out, dim)
        ones = g.new_ones((g.shape[1], 1))
        mm = _matmul
        if log:  # d x = g - exp(y) * sum(g)
            r = g - exp_f32(y) * mm(g, ones, None, _F32, backend)
        else:  # d x = y * (g - sum(g * y))
            r = y * (g - mm(g * y, ones, None, _F32, backend))
        moved = out.movedim(dim, -1).shape
        return r.reshape(moved).movedim(-1, dim).to(input_dtype).contiguous()

    return handler


def _fused_rms_norm_backward(func, grad, x, normalized_shape, rstd, weight, output_mask):
    backend = prepare(func, grad, x)
    if weight is not None:
        prepare(func, weight)
    if len(normalized_shape) != 1 or x.dim() == 0 or normalized_shape[0] != x.shape[-1]:
        raise Fallback("normalized_shape other than the last dim")
    h = x.shape[-1]
    rows = math.prod(x.shape[:-1])
    x2, g2 = x.reshape(rows, h).float(), grad.reshape(rows, h).float()
    xhat = x2 * rstd.reshape(rows, 1).float()
    grad_x = grad_w = None
    if output_mask[0]:  # rstd * (g*w - xhat * mean(g*w*xhat)), every term the row's own
        gw = g2 if weight is None else g2 * weight.float()
        dot = call("mean", gw * xhat, [1], True, _F32, backend, validated=True)
        grad_x = (rstd.reshape(rows, 1).float() * (gw - xhat * dot)).to(x.dtype).reshape(x.shape)
    if output_mask[1] and weight is not None:
        grad_w = ones_sum(g2 * xhat, [0], backend, weight.dtype).reshape(weight.shape)
    return grad_x, grad_w


def _silu_backward(func, grad, x):
    """d silu(x) = s * (1 + x * (1 - s)) with s = sigmoid(x) = 1 / (1 + exp(-x)), elementwise
    in fp32 from the same position-independent exp as the forward route."""
    prepare(func, grad, x)
    x32 = x.float()
    s = sigmoid_f32(x32)
    return (grad.float() * (s * (1.0 + x32 * (1.0 - s)))).to(x.dtype)


def _sdpa_flash_cpu_backward(func, grad_out, q, k, v, out, lse, dropout_p, is_causal, *,
                             attn_mask=None, scale=None):
    if attn_mask is not None:  # a padded or packed batch: its forward was compacted too
        prepare(func, q, grad_out, out)
        return masked_attention_backward(func, grad_out, q, k, v, out, lse, dropout_p,
                                         is_causal, attn_mask, scale)
    lay = attention_layout(func, q, k, v, attn_mask, dropout_p, is_causal, scale)
    prepare(func, q, grad_out, out)
    dq, dk, dv = call(
        "attention_varlen_backward",
        lay.pack(grad_out), None, lay.pack(q), lay.pack(k), lay.pack(v), lay.pack(out),
        lay.pack(lse).float(), lay.cu_q, lay.cu_k, lay.scale, lay.causal, lay.backend)
    lq, lk = q.shape[2], k.shape[2]
    return lay.unpack(dq, lq), lay.unpack(dk, lk), lay.unpack(dv, lk)


_ROUTES = (  # (aten op, overload, handler); ops missing from an older torch are skipped
    ("sum", "dim_IntList", _sum),
    ("sum", "default", _sum_all),
    ("_softmax_backward_data", "default", _softmax_backward_like(log=False)),
    ("_log_softmax_backward_data", "default", _softmax_backward_like(log=True)),
    ("_fused_rms_norm_backward", "default", _fused_rms_norm_backward),
    ("silu_backward", "default", _silu_backward),
    ("_scaled_dot_product_flash_attention_for_cpu_backward", "default",
     _sdpa_flash_cpu_backward),
)
GRAD_HANDLERS = handler_table(_ROUTES)
