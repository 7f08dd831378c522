"""While bik.enable() is on, Inductor must leave the ops bik routes to aten, where the
dispatcher overrides see them: Inductor otherwise lowers softmax / mean / sum (and so RMSNorm)
to its own generated kernels and may decompose a small matmul into mul + sum (or a sort, a
top-k, a sigmoid into its own code), and no dispatcher override sees either.

:func:`keep_as_aten_calls` removes those ops' Inductor decompositions, makes them Inductor
fallbacks (a generated call to the aten op) and turns Inductor's and AOTAutograd's on-disk
caches off (a graph compiled before would come back with its own reductions); the returned
function restores every table entry and flag exactly. These are Inductor internals
(torch._inductor.lowering / decomposition), checked against the pinned torch by
tests/mode/test_compile.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["INDUCTOR_FALLBACK_OPS", "keep_as_aten_calls"]

aten = torch.ops.aten
_MISSING = object()

INDUCTOR_FALLBACK_OPS = (
    aten.mm.default, aten.addmm.default, aten.bmm.default,
    aten._softmax.default, aten._log_softmax.default,
    aten._softmax_backward_data.default, aten._log_softmax_backward_data.default,
    aten.mean.dim, aten.sum.dim_IntList,
    # a mixture of experts' router and products (mode/_moe_routes.py)
    aten.topk.default, aten.sort.default, aten.sort.stable, aten.sigmoid.default,
    aten._grouped_mm.default,
)


def _set(table: dict, key, value) -> None:
    if value is _MISSING:
        table.pop(key, None)
    else:
        table[key] = value


def keep_as_aten_calls() -> Callable[[], None]:
    """Make INDUCTOR_FALLBACK_OPS Inductor fallbacks; return the exact undo."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config, decomposition, lowering

    tables = [decomposition.decompositions, decomposition.fast_random_decomps()]
    saved_tables = [(t, {op: t.get(op, _MISSING) for op in INDUCTOR_FALLBACK_OPS})
                    for t in tables]
    saved_lowerings = {op: lowering.lowerings.get(op, _MISSING) for op in INDUCTOR_FALLBACK_OPS}
    saved_sets = [(s, {op for op in INDUCTOR_FALLBACK_OPS if op in s})
                  for s in (lowering.fallbacks, lowering.needs_realized_inputs)]
    saved_flags = (config.fx_graph_cache, functorch_config.enable_autograd_cache)

    def undo() -> None:
        for table, entries in saved_tables:
            for op, value in entries.items():
                _set(table, op, value)
        for op, value in saved_lowerings.items():
            _set(lowering.lowerings, op, value)
        for members, had in saved_sets:
            for op in INDUCTOR_FALLBACK_OPS:
                if op not in had:
                    members.discard(op)
        config.fx_graph_cache, functorch_config.enable_autograd_cache = saved_flags

    try:
        for table in tables:
            for op in INDUCTOR_FALLBACK_OPS:
                table.pop(op, None)
        for op in INDUCTOR_FALLBACK_OPS:
            lowering.make_fallback(op, warn=False, override_decomp=True)
        config.fx_graph_cache = False
        functorch_config.enable_autograd_cache = False
    except BaseException:
        undo()
        raise
    return undo
