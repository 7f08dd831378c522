"""The mode's one handler table, {aten overload: handler}, below the three front ends (the
function layer, the dispatch layer, bik.enable()): the forward routes, SDPA's, those of
the ops backward formulas call and those of mixture-of-experts blocks, each built with the
helper kit (_kit.py)."""

from __future__ import annotations

from bik.mode._attention_routes import ATTENTION_HANDLERS
from bik.mode._forward_routes import FORWARD_HANDLERS
from bik.mode._grad_routes import GRAD_HANDLERS
from bik.mode._moe_routes import MOE_HANDLERS

__all__ = ["HANDLERS"]

HANDLERS = {**FORWARD_HANDLERS, **ATTENTION_HANDLERS, **GRAD_HANDLERS, **MOE_HANDLERS}
