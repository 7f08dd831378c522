"""Backward of bik::attention_varlen: bik::attention_varlen_backward, built from bik::bmm.

Contract (docs/design.md#backward): sequence b's gradients (dq of its queries, dk and dv of its
keys) are computed from sequence b's tensors alone, one sequence at a time, so their bits do not
depend on the other sequences packed with it or on its place in the pack. Per sequence, with
its G = Hq / Hkv query heads of a KV head folded into the rows (row = token * G + head):

    P  = exp(scale * Q K^T - lse), 0 where the bottom-right causal mask hides a key
    dV = P^T dO                  (reduction over the t*G rows: tokens and the G heads)
    dP = dO V^T                  Di = rowsum(dO * O) = (dO * O) @ ones
    dS = P * (dP - Di + grad_lse)
    dQ = scale * dS K            dK = scale * dS^T Q   (again over the t*G rows)

Every reduction is one bik::bmm over the KV heads (fixed order, fp32 accumulation); the rest
is elementwise. ``exp`` runs on the sequence's own [Hkv, t*G, L] tensor (through the CPU
extension's exp2f on CPU tensors), so no other sequence can shift its elements.
"""

from __future__ import annotations

import torch

from bik.ops._checks import check_same_device, check_tensor
from bik.ops._pointwise import exp_f32
from bik.ops._define import define
from bik.ops.attention.checks import check_cu_seqlens, check_qkv, int_vector

_OP = "bik.attention_varlen_backward"


def _check(op, args):
    q, cu_q, cu_k = args.q, args.cu_seqlens_q, args.cu_seqlens_k
    check_qkv(op, q, args.k, args.v, 3)
    check_same_device(op, q=q, k=args.k, v=args.v, out=args.out, lse=args.lse,
                      grad_out=args.grad_out, grad_lse=args.grad_lse, cu_seqlens_q=cu_q,
                      cu_seqlens_k=cu_k)
    for name, shape in (("out", q.shape), ("grad_out", q.shape), ("lse", q.shape[:2]),
                        ("grad_lse", q.shape[:2])):
        t = getattr(args, name)
        if t is None:
            continue
        check_tensor(op, name, t)
        if t.shape != shape:
            raise ValueError(f"{op}: {name} {list(t.shape)} must be {list(shape)}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{op}: {name} must be floating point, got {t.dtype}")
    int_vector(op, "cu_seqlens_k", cu_k)
    int_vector(op, "cu_seqlens_q", cu_q, cu_k.shape[0])
    return args


def _lengths(cu_q, cu_k, total_q: int, total_k: int) -> tuple[list, list]:
    cq, ck = cu_q.tolist(), cu_k.tolist()  # one host copy per call, as the forward
    check_cu_seqlens(_OP, "cu_seqlens_q", cq, total_q, "total_q")
    check_cu_seqlens(_OP, "cu_seqlens_k", ck, total_k, "total_k")
    for b in range(len(cq) - 1):
        if cq[b + 1] - cq[b] > ck[b + 1] - ck[b]:
            raise ValueError(f"{_OP}: sequence {b} has more queries than keys")
    return cq, ck


def _rows(t: torch.Tensor, hkv: int) -> torch.Tensor:
    """[n, Hkv*G, ...] -> fp32 [Hkv, n*G, ...]: a KV head's G query heads folded into rows."""
    n, h = t.shape[0], t.shape[1]
    g = h // hkv
    t = t.float().reshape(n, hkv, g, *t.shape[2:]).transpose(0, 1)
    return t.reshape(hkv, n * g, *t.shape[3:]).contiguous()


def _unrows(t: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of _rows: [Hkv, n*G, D] -> [n, Hkv*G, D]."""
    hkv, rows, d = t.shape
    return t.reshape(hkv, n, rows // n, d).transpose(0, 1).reshape(n, -1, d)


def sequence_grads(q, k, v, out, lse, grad_out, grad_lse, scale, causal, backend):
    """One sequence: q/out/grad_out [t, Hq, D], k/v [L, Hkv, D], lse/grad_lse [t, Hq]."""
    t, length, hkv = q.shape[0], k.shape[0], k.shape[1]
    bmm = torch.ops.bik.bmm
    f32 = torch.float32
    qs, ks, vs = _rows(q, hkv), k.float().transpose(0, 1).contiguous(), None
    s = bmm(qs, ks.transpose(1, 2), f32, backend)  # [Hkv, t*G, L]
    p = exp_f32(s * scale - _rows(lse, hkv)[..., None])
    if causal:  # query i sits at absolute position L - t + i
        g = qs.shape[1] // t
        pos = torch.arange(length - t, length, device=q.device).repeat_interleave(g)
        visible = torch.arange(length, device=q.device)[None, :] <= pos[:, None]
        p = torch.where(visible, p, torch.zeros((), device=q.device))
    dv = None
    if grad_out is not None:
        do = _rows(grad_out, hkv)
        vs = v.float().transpose(0, 1).contiguous()
        dv = bmm(p.transpose(1, 2), do, f32, backend)  # [Hkv, L, D]
        dp = bmm(do, vs.transpose(1, 2), f32, backend)  # [Hkv, t*G, L]
        ones = do.new_ones((hkv, do.shape[2], 1))
        di = bmm(do * _rows(out, hkv), ones, f32, backend)  # rowsum(dO * O), fixed order
        inner = dp - di
        if grad_lse is not None:
            inner = inner + _rows(grad_lse, hkv)[..., None]
    else:
        inner = _rows(grad_lse, hkv)[..., None]
    ds = (p * inner) * scale
    dq = bmm(ds, ks, f32, backend)  # [Hkv, t*G, D]
    dk = bmm(ds.transpose(1, 2), qs, f32, backend)  # [Hkv, L, D]
    return _unrows(dq, t), dk.transpose(0, 1), None if dv is None else dv.transpose(0, 1)


def _run(launch, args, *, backend):
    """``launch`` is :func:`sequence_grads` (the row's entry): one sequence at a time."""
    q, k, v, grad_out, grad_lse = args.q, args.k, args.v, args.grad_out, args.grad_lse
    dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    if grad_out is None and grad_lse is None:
        return dq, dk, dv
    cq, ck = _lengths(args.cu_seqlens_q, args.cu_seqlens_k, q.shape[0], k.shape[0])
    for b in range(len(cq) - 1):
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if qs.stop == qs.start:
            continue  # no queries: this sequence's keys get zero gradients
        g_q, g_k, g_v = launch(
            q[qs], k[ks], v[ks], args.out[qs], args.lse[qs],
            None if grad_out is None else grad_out[qs],
            None if grad_lse is None else grad_lse[qs], args.scale, args.causal, backend)
        dq[qs], dk[ks] = g_q.to(q.dtype), g_k.to(k.dtype)
        if g_v is not None:
            dv[ks] = g_v.to(v.dtype)
    return dq, dk, dv


def _fake(args):
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device)
                 for t in (args.q, args.k, args.v))


define("attention_varlen_backward",
       "(Tensor? grad_out, Tensor? grad_lse, Tensor q, Tensor k, Tensor v, Tensor out, "
       "Tensor lse, Tensor cu_seqlens_q, Tensor cu_seqlens_k, float scale, bool causal, "
       "str backend) -> (Tensor, Tensor, Tensor)",
       check=_check, run=_run, fake=_fake)


def attention_varlen_grads(grad_out, grad_lse, q, k, v, out, lse, *, cu_seqlens_q, cu_seqlens_k,
                           scale: float, causal: bool, backend: str):
    """(dq, dk, dv) of bik::attention_varlen given the forward's (out, lse) and the upstream
    gradients (either may be None). Shapes and dtypes follow q, k, v."""
    return torch.ops.bik.attention_varlen_backward(
        grad_out, grad_lse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, float(scale),
        bool(causal), backend)


def _setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, scale, causal, backend = inputs[:8]  # then the host bounds
    ctx.save_for_backward(q, k, v, output[0], output[1], cu_q, cu_k)
    ctx.scale, ctx.causal, ctx.backend = scale, causal, backend


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    need = ctx.needs_input_grad[:3]
    if not any(need):
        return (None,) * 10
    grads = attention_varlen_grads(grad_out, grad_lse, q, k, v, out, lse, cu_seqlens_q=cu_q,
                                   cu_seqlens_k=cu_k, scale=ctx.scale, causal=ctx.causal,
                                   backend=ctx.backend)
    return (*(g if n else None for g, n in zip(grads, need)), *(None,) * 7)


AUTOGRAD = (_backward, _setup)  # bik::attention_varlen's (ops/attention/op.py declares it)
