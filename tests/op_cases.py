"""One small case per op of ``ops/_registry.TABLE``, read by the tests that go over every op.

A new op adds its entry here once; each reader checks that the table covers the ops it should
(so an op without an entry fails, it is not skipped):

* ``call``: a valid call through the op's public face on the CPU
  (tests/test_cpu_extension_required.py: it raises with the build hint once the CPU extension
  is masked, and runs without the mask); None for an op without a CPU backend.
* ``grad``: ``(inputs(generator) -> tensors, bik(*tensors) -> tensor, reference)`` where
  ``reference`` is the stock torch call that autograd differentiates, or None when the op's row
  refuses a backward (tests/test_registry.py: gradients against fp64 autograd, or the refusal).
* ``sparse``: calls that pass a sparse tensor, by the public name they must name and the
  argument ("linear weight"): each raises TypeError "bik.<name>: ... must be a dense (strided)
  tensor" (tests/test_errors.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import bik
import torch
from bik.ops.matmul.reference import grouped_matmul_reference
import torch.nn.functional as F

__all__ = ["CASES", "OpCase"]


class OpCase(NamedTuple):
    call: Callable[[], object] | None
    grad: tuple[Callable, Callable | None, Callable | None]
    sparse: dict[str, Callable[[], object]] = {}


X, W = torch.randn(3, 8), torch.randn(8)
LOGITS = torch.randn(2, 16)
_SPARSE = torch.zeros(4, 8).to_sparse()
_CU = torch.tensor([0, 2, 6])
_ENDS, _ENDS7 = torch.tensor([1, 3]), torch.tensor([2, 2, 6])  # grouped products' ends
_CU32 = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32)


def _varlen_inputs():
    return torch.randn(2, 2, 8), torch.randn(3, 1, 8), torch.randn(3, 1, 8)


def _varlen_call():
    q, k, v = _varlen_inputs()
    return bik.attention_varlen(q, k, v, cu_seqlens_q=_CU32[0], cu_seqlens_k=_CU32[1])


def _varlen_backward_call():
    q, k, v = _varlen_inputs()
    out, lse = torch.randn(2, 2, 8), torch.randn(2, 2)
    return torch.ops.bik.attention_varlen_backward(out, None, q, k, v, out, lse, *_CU32, 0.35,
                                                   True, "cpu")


def _paged_call():
    cache = torch.randn(1, 4, 1, 8)
    return bik.attention(torch.randn(1, 2, 8), cache, cache,
                         cache_seqlens=torch.tensor([3], dtype=torch.int32),
                         cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32),
                         block_table=torch.zeros(1, 1, dtype=torch.int32))


def _mm_inputs(g):
    return [torch.randn(7, 33, generator=g), torch.randn(33, 9, generator=g),
            torch.randn(9, generator=g)]


def _attn_inputs(g):
    return [torch.randn(6, 4, 16, generator=g), torch.randn(6, 2, 16, generator=g),
            torch.randn(6, 2, 16, generator=g)]


def _sdpa(q, k, v):
    """Two causal sequences (rows 0-1, 2-5), GQA 2:1, in stock SDPA."""
    outs = []
    for a, b in ((0, 2), (2, 6)):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(2, 0), vs.repeat_interleave(2, 0)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1))
    return torch.cat(outs)


CASES = {
    "matmul": OpCase(
        call=lambda: bik.matmul(X, torch.randn(8, 4)),
        grad=(_mm_inputs, lambda a, b, c: bik.matmul(a, b, c), lambda a, b, c: a @ b + c),
        sparse={"matmul": lambda: bik.matmul(_SPARSE, torch.zeros(8, 3)),
                "linear weight": lambda: bik.linear(torch.zeros(4, 8), _SPARSE)}),
    "bmm": OpCase(
        call=lambda: bik.bmm(torch.randn(2, 3, 8), torch.randn(2, 8, 4)),
        grad=(lambda g: [torch.randn(2, 5, 17, generator=g), torch.randn(2, 17, 3, generator=g)],
              lambda a, b: bik.bmm(a, b), torch.bmm),
        sparse={"bmm": lambda: bik.bmm(_SPARSE.unsqueeze(0), torch.zeros(1, 8, 3))}),
    "rms_norm": OpCase(
        call=lambda: bik.rms_norm(X, W),
        grad=(lambda g: [torch.randn(5, 40, generator=g), torch.randn(40, generator=g)],
              lambda x, w: bik.rms_norm(x, w, 1e-6),
              lambda x, w: F.rms_norm(x, (40,), w, 1e-6)),
        sparse={"rms_norm": lambda: bik.rms_norm(_SPARSE, torch.zeros(8)),
                "rms_norm weight": lambda: bik.rms_norm(torch.zeros(4, 8),
                                                        torch.zeros(8).to_sparse())}),
    "fused_add_rms_norm": OpCase(
        call=lambda: bik.rms_norm(X, W, residual=torch.randn(3, 8)),
        grad=(lambda g: [torch.randn(5, 40, generator=g), torch.randn(5, 40, generator=g),
                         torch.randn(40, generator=g)],
              lambda x, r, w: bik.rms_norm(x, w, 1e-6, residual=r)[0],
              lambda x, r, w: F.rms_norm(x + r, (40,), w, 1e-6))),
    "grouped_matmul": OpCase(
        call=lambda: bik.grouped_matmul(X, torch.randn(2, 8, 4), _ENDS),
        grad=(lambda g: [torch.randn(7, 33, generator=g), torch.randn(3, 33, 9, generator=g)],
              lambda a, b: bik.grouped_matmul(a, b, _ENDS7),
              lambda a, b: grouped_matmul_reference(a, b, _ENDS7, a.dtype)),
        sparse={"grouped_matmul": lambda: bik.grouped_matmul(_SPARSE, torch.zeros(1, 8, 3),
                                                             torch.tensor([4]))}),
    "grouped_matmul_weight_grad": OpCase(
        call=lambda: torch.ops.bik.grouped_matmul_weight_grad(X, torch.randn(3, 4), _ENDS,
                                                              torch.float32, "cpu"),
        grad=(lambda g: [torch.randn(7, 5, generator=g)],
              lambda a: torch.ops.bik.grouped_matmul_weight_grad(
                  a, torch.ones(7, 2), _ENDS7, torch.float32, "cpu"), None)),
    "softmax": OpCase(
        call=lambda: bik.softmax(X),
        grad=(lambda g: [torch.randn(4, 3, 37, generator=g)], lambda x: bik.softmax(x, 1),
              lambda x: torch.softmax(x, 1)),
        sparse={"softmax": lambda: bik.softmax(_SPARSE, -1)}),
    "log_softmax": OpCase(
        call=lambda: bik.log_softmax(X),
        grad=(lambda g: [torch.randn(4, 37, generator=g)], lambda x: bik.log_softmax(x, -1),
              lambda x: torch.log_softmax(x, -1)),
        sparse={"log_softmax": lambda: bik.log_softmax(_SPARSE, -1)}),
    "mean": OpCase(
        call=lambda: bik.mean(X, 1),
        grad=(lambda g: [torch.randn(4, 6, 5, generator=g)], lambda x: bik.mean(x, (0, 2)),
              lambda x: x.mean((0, 2))),
        sparse={"mean": lambda: bik.mean(_SPARSE, -1)}),
    "attention": OpCase(
        call=_paged_call,
        grad=(lambda g: [torch.randn(2, 2, 16, generator=g)],
              lambda q: bik.attention(q, torch.randn(1, 4, 2, 16), torch.randn(1, 4, 2, 16),
                                      cache_seqlens=torch.tensor([4]),
                                      cu_seqlens_q=torch.tensor([0, 2])), None)),
    "attention_varlen": OpCase(
        call=_varlen_call,
        grad=(_attn_inputs,
              lambda q, k, v: bik.attention_varlen(q, k, v, cu_seqlens_q=_CU,
                                                   cu_seqlens_k=_CU).out,
              _sdpa),
        sparse={"attention_varlen": lambda: bik.attention_varlen(
            torch.zeros(4, 1, 8).to_sparse(), torch.zeros(4, 1, 8), torch.zeros(4, 1, 8),
            cu_seqlens_q=torch.tensor([0, 4]), cu_seqlens_k=torch.tensor([0, 4]))}),
    "attention_varlen_backward": OpCase(
        call=_varlen_backward_call,
        grad=(_attn_inputs,
              lambda q, k, v: torch.ops.bik.attention_varlen_backward(
                  torch.ones_like(q), None, q, k, v, torch.zeros_like(q),
                  torch.zeros(q.shape[:2]), _CU, _CU, 0.25, True, "cpu")[0], None)),
    "write_kv_cache": OpCase(call=None,
                             grad=(lambda g: [torch.randn(2, 1, 4, generator=g)], None, None)),
    "sample": OpCase(
        call=lambda: bik.sample(LOGITS, seed=1, position=0),
        grad=(lambda g: [torch.randn(3, 11, generator=g)],
              lambda x: bik.sample(x, seed=1, position=0).logprobs, None),
        sparse={"sample": lambda: bik.sample(_SPARSE, seed=0, position=0)}),
    "verify_draft": OpCase(
        call=lambda: bik.verify_draft(torch.zeros(2, 1, dtype=torch.int64), 1,
                                      torch.randn(2, 2, 16), seed=1, position=0),
        grad=(lambda g: [torch.randn(2, 3, 11, generator=g)],
              lambda x: bik.verify_draft(torch.zeros(2, 2, dtype=torch.int64), 2, x, seed=1,
                                         position=0).logprobs, None)),
}
