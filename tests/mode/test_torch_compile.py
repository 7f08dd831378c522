"""torch.compile(fullgraph=True) traces bik ops as opaque custom ops and keeps their bits."""

import bik
import pytest
import torch
from bik.runtime import cpu_ext

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason="CPU extension not built")


def block(x, w_norm, w_up, bias):
    h = bik.rms_norm(x, w_norm)
    out, res = bik.rms_norm(h, w_norm, residual=x)
    # Only bik ops here: inductor may reorder the reductions of stock ops such as sum.
    return bik.linear(out, w_up, bias) * 2.0, res, bik.bmm(out[None], w_up.t()[None])


def test_compiled_fullgraph_matches_eager_bits(gen):
    torch._dynamo.reset()
    x = torch.randn(5, 3, 64, generator=gen)
    w_norm, w_up, bias = (torch.randn(64, generator=gen), torch.randn(32, 64, generator=gen),
                          torch.randn(32, generator=gen))
    compiled = torch.compile(block, fullgraph=True, dynamic=False)
    eager = block(x.reshape(15, 64), w_norm, w_up, bias)
    got = compiled(x.reshape(15, 64), w_norm, w_up, bias)
    for e, g in zip(eager, got):
        assert torch.equal(e, g)
    # The bik ops are in the graph as custom ops, not decomposed into aten matmuls.
    gm_ops = []

    def capture(gm, example_inputs):
        gm_ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    torch._dynamo.reset()
    torch.compile(block, fullgraph=True, backend=capture)(x.reshape(15, 64), w_norm, w_up, bias)
    assert {"bik.matmul", "bik.rms_norm", "bik.fused_add_rms_norm", "bik.bmm"} <= set(gm_ops)
    assert not any("aten" in op and "mm" in op for op in gm_ops)
