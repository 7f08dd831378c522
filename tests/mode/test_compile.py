"""Both front ends under torch.compile: what the compiled graph holds, what Inductor generates,
and that the compiled bits are bik's.

A routed op must run as bik's op, never as an Inductor kernel: the tests read Inductor's
generated code (torch._inductor.utils.run_and_get_code) and fail on a generated reduction (the
accumulator and NaN-propagating max that Inductor's C++ reductions declare) in a function
whose reductions are all routed; the stock compile of the same function is shown to generate
them (so the check can fail). Inductor may still fuse the elementwise ops around bik's.
"""

import bik
import pytest
import torch
import torch.nn.functional as F
from bik.mode._inductor import INDUCTOR_FALLBACK_OPS
from bik.runtime import cpu_ext
from bik.testing import rows_alone_vs_batched, same_bits
from torch._inductor.utils import run_and_get_code

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason="CPU extension not built")


@pytest.fixture(autouse=True)
def _fresh(fresh_dynamo):
    yield


def routed_only(x, w, gamma):
    """Only ops bik routes: a linear, a softmax, an RMSNorm written with mean, a log_softmax."""
    h = F.linear(x, w)
    p = F.softmax(h, dim=-1)
    ms = (p * p).mean(-1, keepdim=True)
    return F.log_softmax(h, -1), p * torch.rsqrt(ms + 1e-6) * gamma


def eager_bik(x, w, gamma):
    h = bik.linear(x, w)
    p = bik.softmax(h, -1)
    ms = bik.mean(p * p, -1, keepdim=True)
    return bik.log_softmax(h, -1), p * torch.rsqrt(ms + 1e-6) * gamma


REDUCTION_MARKERS = ("tmp_acc", "max_propagate_nan", "welford")


def _inductor_reductions(code: list[str]) -> list[str]:
    text = "".join(code)
    return [m for m in REDUCTION_MARKERS if m in text]


def _inputs(gen):
    return (torch.randn(6, 40, generator=gen), torch.randn(24, 40, generator=gen),
            torch.randn(24, generator=gen))


def _graph_ops(fn, *args) -> list[str]:
    ops = []

    def capture(gm, example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    torch.compile(fn, fullgraph=True, backend=capture)(*args)
    return ops


def test_stock_inductor_fuses_the_reductions(gen):
    """The control: without bik, Inductor generates its own kernels for this function."""
    _, code = run_and_get_code(torch.compile(routed_only, fullgraph=True), *_inputs(gen))
    assert _inductor_reductions(code)


def test_mode_fullgraph_traces_bik_ops(gen):
    args = _inputs(gen)
    with bik.batch_invariant_mode():
        ops = _graph_ops(routed_only, *args)
    assert {"bik.matmul", "bik.softmax", "bik.mean", "bik.log_softmax"} <= set(ops), ops
    assert not any(op.startswith("aten.") and any(k in op for k in ("mm", "softmax", "mean"))
                   for op in ops), ops


def test_mode_inductor_runs_bik_ops_with_bik_bits(gen):
    args = _inputs(gen)
    with torch.no_grad():
        want = eager_bik(*args)
        with bik.batch_invariant_mode():
            got, code = run_and_get_code(torch.compile(routed_only, fullgraph=True), *args)
    assert not _inductor_reductions(code), "a routed reduction became an Inductor kernel"
    code = "".join(code)
    for op in ("softmax", "log_softmax", "mean"):
        assert f"torch.ops.bik.{op}.default" in code, op
    # no grad: the product is bik's C++ one where it can be built (test_compiled_native.py)
    products = ("torch.ops.bik_native.matmul.default", "torch.ops.bik.matmul.default")
    assert any(p in code for p in products)
    assert "extern_kernels.mm" not in code and "extern_kernels.addmm" not in code
    assert same_bits(got[0], want[0])  # log_softmax of the linear: bik ops only
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-7)  # a fused tail


def test_mode_entered_inside_a_compiled_function(gen):
    x, w, _ = _inputs(gen)

    def fn(x):
        with bik.batch_invariant_mode():
            y = F.linear(x, w)
        return y + 1, F.linear(x, w)  # the second linear is outside the mode: stock

    ops = _graph_ops(fn, x)
    # One linear became bik.matmul; the one after the block stayed torch's.
    assert ops.count("bik.matmul") == 1 and sum("linear" in op for op in ops) == 1, ops
    torch._dynamo.reset()
    with torch.no_grad():
        inside, outside = torch.compile(fn, fullgraph=True)(x)
    assert same_bits(inside, bik.linear(x, w) + 1)
    torch.testing.assert_close(outside, F.linear(x, w))
    assert not bik.is_batch_invariant_mode_enabled()


def test_mode_compiled_training_step_is_row_invariant(gen):
    """AOTAutograd takes bik's registered backward: input gradients of the compiled step are
    row-invariant, and agree with eager bik's (Inductor may round the fused elementwise tail
    differently, so values, not bits)."""
    x, w, gamma = _inputs(gen)
    pool = torch.cat([x, torch.randn(6, 24, generator=gen)], dim=1)

    def step(forward):
        def grads(rows):
            xs = rows[:, :40].detach().clone().requires_grad_()
            forward(xs, w, gamma)[1].backward(rows[:, 40:])
            return xs.grad

        return grads

    with bik.batch_invariant_mode():
        compiled = step(torch.compile(routed_only, fullgraph=True))
        report = rows_alone_vs_batched(compiled, pool, (1, 3, 6))
        got = compiled(pool)
    assert report.ok, report.summary()
    torch.testing.assert_close(got, step(eager_bik)(pool), rtol=1e-5, atol=1e-6)


def test_enable_keeps_routed_ops_as_aten_calls_under_inductor(gen):
    args = _inputs(gen)
    with torch.no_grad():
        want = eager_bik(*args)
        with bik.enabled():
            got, code = run_and_get_code(torch.compile(routed_only, fullgraph=True), *args)
            routed = bik.mode_stats().routed
    assert not _inductor_reductions(code), "a routed reduction became an Inductor kernel"
    code = "".join(code)
    for op in ("aten._softmax.default", "aten._log_softmax.default", "aten.mean.dim"):
        assert f"torch.ops.{op}" in code and routed.get(op, 0) >= 1, (op, routed)
    assert same_bits(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-7)


def _inductor_state():
    from torch._functorch import config as functorch_config
    from torch._inductor import config, decomposition, lowering

    tables = (decomposition.decompositions, decomposition.fast_random_decomps(),
              lowering.lowerings)
    return ([tuple(t.get(op) for op in INDUCTOR_FALLBACK_OPS) for t in tables],
            [tuple(op in s for op in INDUCTOR_FALLBACK_OPS)
             for s in (lowering.fallbacks, lowering.needs_realized_inputs)],
            (config.fx_graph_cache, functorch_config.enable_autograd_cache))


def test_disable_restores_inductor_exactly(gen):
    before = _inductor_state()
    bik.enable()
    try:
        during = _inductor_state()
    finally:
        bik.disable()
    assert during != before
    assert _inductor_state() == before
    _, code = run_and_get_code(torch.compile(routed_only, fullgraph=True), *_inputs(gen))
    assert _inductor_reductions(code)  # stock Inductor again
