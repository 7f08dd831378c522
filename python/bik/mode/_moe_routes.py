"""The aten ops of mixture-of-experts blocks the mode routes, one handler each, built with the
helper kit (_kit.py); _handlers.py joins them to the others.

``aten::_grouped_mm`` (``torch.nn.functional.grouped_mm``): Hugging Face's default experts
implementation sorts the (token, expert) pairs by expert and runs every expert's rows as one
group of a grouped product. Stock CPU computes a group with torch's mm, whose rows change bits
with the group's size (a row alone differs from the same row among four:
tests/mode/test_moe_routes.py measures it), so a token's expert output follows how many other
tokens chose that expert. Here each group is bik::matmul on its rows, whose bits are the row's.
"""

from __future__ import annotations

from bik.mode._kit import WarnedFallback, handler_table, need, prepare
from bik.ops._call import call

__all__ = ["MOE_HANDLERS"]


def _grouped_mm(func, a, b, offs=None, bias=None, out_dtype=None):
    """a [S, K] rows in groups ending at ``offs`` [G] (cumulative, int32), b [G, K, N]: group
    g's rows times b[g]. Rows past the last end are zeros (stock leaves them unwritten)."""
    backend = prepare(func, a, b)
    if a.dim() != 2 or b.dim() != 3 or offs is None:
        raise WarnedFallback("a grouped product other than 2-D rows by 3-D groups")
    if bias is not None or out_dtype not in (None, a.dtype):
        raise WarnedFallback("a grouped product with a bias or another out_dtype")
    if a.device.type != "cpu":
        # The groups' ends are device data: reading them is a sync (and breaks graph capture).
        raise WarnedFallback("a grouped product on a GPU (not routed through bik yet)")
    need(a.shape[1] == b.shape[1] and offs.dim() == 1 and offs.shape[0] == b.shape[0]
          and not offs.is_floating_point(), "operand shapes")
    ends = offs.tolist()
    if not all(0 <= x <= y <= a.shape[0] for x, y in zip([0] + ends, ends)):
        raise WarnedFallback("grouped product ends that decrease or pass the rows")
    out = a.new_zeros((a.shape[0], b.shape[2]))
    start = 0
    for group, end in enumerate(ends):
        if end > start:
            out[start:end] = call("matmul", a[start:end], b[group], None, None, backend,
                                  validated=True)
        start = end
    return out


_ROUTES = (  # (aten op, overload, handler); ops missing from an older torch are skipped
    ("_grouped_mm", "default", _grouped_mm),
)

MOE_HANDLERS = handler_table(_ROUTES)
