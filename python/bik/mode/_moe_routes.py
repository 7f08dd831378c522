"""The aten ops of mixture-of-experts blocks the mode routes, one handler each, built with the
helper kit (_kit.py); _handlers.py joins them to the others.

``aten::_grouped_mm`` (``torch.nn.functional.grouped_mm``): Hugging Face's default experts
implementation sorts the (token, expert) pairs by expert and runs every expert's rows as one
group of a grouped product. Stock CPU computes a group with torch's mm, whose rows change bits
with the group's size (a row alone differs from the same row among four:
tests/mode/test_moe_routes.py measures it), so a token's expert output follows how many other
tokens chose that expert. Here 2-D rows by 3-D groups are bik::grouped_matmul (each row
bik::matmul's bits), and its backward's weight layout (2-D by 2-D, groups along the rows'
dimension) bik::grouped_matmul_weight_grad (a fixed order per group).

``aten::topk`` and ``aten::sort``: a router picks its experts with ``topk``, often
``sorted=False``, and the combine sums the experts' outputs in the order topk returned them.
Which order that is, and which of tied elements come first, torch leaves to the kernel: stock
CPU returned a ``sorted=False`` top-8 of 64 in neither value nor index order, and ties of 0.7
at ids 1, 3, 5 as 3, 5, 1 (tests/mode/test_moe_routes.py measures both). bik's rule, on every
device: values in descending order (ascending for ``largest=False``; NaN counts as the
largest, as in torch), ties by the lowest index, whatever ``sorted`` says (a sorted result is
one that ``sorted=False`` permits). A sort is stable: equal elements keep their index order.
Both are exact (no arithmetic), so a stable sort's result is unique and every device gives it.

``aten::sigmoid`` on the CPU: stock rounds its SIMD body and its scalar tail differently, so a
router score's bits followed its position in the [tokens, experts] tensor
(tests/test_pointwise.py measures it); here it is ``1 / (1 + exp(-x))`` in fp32 from torch's
exp, which is position-independent, rounded once to x's dtype. CUDA runs one instruction
sequence per element already (bik.enable() routes it on the CPU only).
"""

from __future__ import annotations

import torch

from bik.mode._kit import Fallback, WarnedFallback, handler_table, need, prepare
from bik.ops._call import call
from bik.ops._pointwise import sigmoid_f32

__all__ = ["MOE_HANDLERS"]


def _ends_on_host_ok(ends, rows: int) -> None:
    """CPU ends are read (free there): ends stock accepts but bik's op refuses (decreasing, or
    past the rows) run stock, warned. GPU ends stay on the device (the op clamps them)."""
    if ends.device.type == "cpu":
        values = ends.tolist()
        if not all(0 <= x <= y <= rows for x, y in zip([0] + values, values)):
            raise WarnedFallback("grouped product ends that decrease or pass the rows")


def _grouped_mm(func, a, b, offs=None, bias=None, out_dtype=None):
    """a [S, K] rows in groups ending at ``offs`` [G] (cumulative), b [G, K, N]: group g's rows
    times b[g] (rows past the last end are zeros; stock leaves them unwritten). a [K, S] by
    b [S, N] with groups along S: [G, K, N], group g's columns of a times its rows of b."""
    backend = prepare(func, a, b)
    if offs is None or a.dim() != 2 or b.dim() not in (2, 3):
        raise WarnedFallback("a grouped product other than 2-D rows by 3-D groups or its "
                             "weight gradient's 2-D by 2-D")
    if bias is not None or out_dtype not in (None, a.dtype):
        raise WarnedFallback("a grouped product with a bias or another out_dtype")
    need(offs.dim() == 1 and not offs.is_floating_point() and a.shape[1] == b.shape[-2],
         "operand shapes")
    if b.dim() == 3:
        need(offs.shape[0] == b.shape[0], "operand shapes")
        _ends_on_host_ok(offs, a.shape[0])
        return call("grouped_matmul", a, b, offs, None, backend, validated=True)
    _ends_on_host_ok(offs, a.shape[1])
    return call("grouped_matmul_weight_grad", a.t(), b, offs, a.dtype, backend)


def _ordered(x, dim):
    """Real, at least 1-D: what bik orders (anything else is torch's, errors included)."""
    if x.dim() == 0 or x.is_complex() or not -x.dim() <= dim < x.dim():
        raise Fallback("a 0-D, complex or out-of-range sort")


def _topk(func, x, k, dim=-1, largest=True, sorted=True):
    """The first k of a stable sort: bik's rule above. Copies, as topk returns fresh tensors
    (a caller may .view() them)."""
    del sorted  # always sorted: an order sorted=False permits
    _ordered(x, dim)
    if not 0 <= k <= x.shape[dim]:
        raise Fallback("k out of range")  # torch's own error
    values, indices = torch.sort(x, dim=dim, descending=largest, stable=True)
    return values.narrow(dim, 0, k).contiguous(), indices.narrow(dim, 0, k).contiguous()


def _sort(func, x, dim=-1, descending=False):
    _ordered(x, dim)
    return torch.sort(x, dim=dim, descending=descending, stable=True)


def _sort_stable(func, x, *, stable=None, dim=-1, descending=False):
    del stable  # always stable: the one order every kernel agrees on
    return _sort(func, x, dim, descending)


def _sigmoid(func, x):
    prepare(func, x)
    return sigmoid_f32(x.float()).to(x.dtype)


_ROUTES = (  # (aten op, overload, handler); ops missing from an older torch are skipped
    ("_grouped_mm", "default", _grouped_mm),
    ("topk", "default", _topk),
    ("sort", "default", _sort),
    ("sort", "stable", _sort_stable),
    ("sigmoid", "default", _sigmoid),
)

MOE_HANDLERS = handler_table(_ROUTES)
