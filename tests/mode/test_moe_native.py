"""bik.moe's one-call C++ route (csrc/native/moe.h): the experts with packed weights and the
softmax routers, as the vLLM plugin runs them under bik.enable().

Proven here: each gives the bits of bik.moe's torch code under bik.enable() (the route turned
off for the reference) over dtypes, token counts, top-k, expert counts, skewed routing (every
token on one expert, one token per expert, empty experts), router ties, NaN, ±inf and all-equal
logits, weights in fp32 or the model's dtype; it serves those calls (not a silent fallback);
a layer on it is the same alone as batched, which the same report finds false of a layer whose
grouped products are tiled by group size; everything it does not serve (fp16, out-of-range
ids, autograd, a dispatch mode watching, bik.enable() off) runs the torch code; weights changed
after packing are refused by name. (test_moe_routes.py's op-for-op test compares the same route
with transformers' own modules.)
"""

from __future__ import annotations

import contextlib

import bik
import bik.moe
import pytest
import torch
from bik.runtime import cpu_ext, native_ext
from bik.testing import rows_alone_vs_batched
from bik.testing.controls import split_by_m_matmul

pytestmark = pytest.mark.skipif(not native_ext.available(), reason="no C++ dispatcher kernels")

HIDDEN, INTER = 64, 32


def _dtypes():
    """fp32, and bf16 where packed bf16 weights take the dot path (the route's bf16)."""
    return [torch.float32] + ([torch.bfloat16] if cpu_ext.bf16_dot() else [])


def _weights(experts, dtype, gen):
    w13 = (torch.randn(experts, 2 * INTER, HIDDEN, generator=gen) * 0.1).to(dtype)
    w2 = (torch.randn(experts, HIDDEN, INTER, generator=gen) * 0.1).to(dtype)
    return w13, w2


def _routing(kind, tokens, k, experts, gen):
    """ids [T, k] (distinct per token) for a routing pattern."""
    if kind == "random":
        return torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    if kind == "one expert":  # every token's first slot on expert 0, the rest on the next ids
        return torch.arange(k).repeat(tokens, 1)
    if kind == "one token per expert":
        return (torch.arange(tokens * k) % experts).view(tokens, k)
    # empty experts: only the last k experts are used
    return (experts - k + torch.arange(k)).repeat(tokens, 1).flip(0)


@contextlib.contextmanager
def _torch_code(monkeypatch):
    """The one-call route off: bik.moe runs its torch code."""
    with monkeypatch.context() as m:
        m.setattr(bik.moe.one_call, "fused_module", lambda *tensors: None)
        yield


@pytest.mark.parametrize("dtype", _dtypes(), ids=str)
@pytest.mark.parametrize("kind", ["random", "one expert", "one token per expert", "empty"])
@pytest.mark.parametrize("tokens, k, experts", [(1, 2, 8), (7, 2, 8), (64, 8, 64), (129, 1, 4),
                                                (5, 4, 4)])
@pytest.mark.parametrize("weights_dtype", ["fp32", "model"])
def test_fused_experts_give_the_torch_codes_bits(dtype, kind, tokens, k, experts, weights_dtype,
                                                 monkeypatch, gen):
    w13, w2 = _weights(experts, dtype, gen)
    packed = bik.moe.PackedExperts(w13, w2)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
    ids = _routing(kind, tokens, k, experts, gen)
    weights = torch.rand(tokens, k, generator=gen)
    weights = weights if weights_dtype == "fp32" else weights.to(dtype)
    with torch.no_grad(), bik.enabled():
        fused = packed.fused(x, ids, weights)
        with _torch_code(monkeypatch):
            want = bik.moe.experts(x, ids, weights, w13, w2, packed)
    assert fused is not None, "the one-call route did not serve the call"
    assert fused.dtype == dtype and torch.equal(fused, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("family, renormalize", [("qwen3_moe", True), ("qwen3_moe", False),
                                                 ("mixtral", True)])
@pytest.mark.parametrize("tokens, k, experts", [(1, 2, 8), (9, 2, 8), (64, 8, 64), (3, 4, 4)])
def test_fused_router_gives_the_torch_codes_bits(dtype, family, renormalize, tokens, k, experts,
                                                 monkeypatch, gen):
    """Ties (all-equal rows, pairs of equal logits), a NaN row, +inf and -inf logits."""
    logits = torch.randn(tokens, experts, generator=gen)
    if tokens >= 9:
        logits[1] = 0.25  # every expert tied
        logits[2, 1::2] = logits[2, 0::2]  # pairs tied
        logits[3] = float("nan")
        logits[4, 3] = float("inf")
        logits[5, : experts // 2] = float("-inf")
    logits = logits.to(dtype)
    module = native_ext.module()
    with torch.no_grad(), bik.enabled():
        served = module.moe_route_softmax(logits, k, renormalize, family == "qwen3_moe")
        got = bik.moe.route(family, logits, k, renormalize=renormalize)
        with _torch_code(monkeypatch):
            want = bik.moe.route(family, logits, k, renormalize=renormalize)
    assert served is not None, "the one-call route did not serve the call"
    assert got[0].dtype == want[0].dtype and torch.equal(got[1], want[1])
    assert torch.equal(got[0].nan_to_num(7.0), want[0].nan_to_num(7.0))
    assert torch.equal(got[0].isnan(), want[0].isnan())
    if tokens >= 9:
        assert got[1][1].tolist() == list(range(k))  # ties: the lowest ids first
        assert got[0][3].isnan().all() and got[1][3].tolist() == list(range(k))


def _layer(family, w13, w2, gate, packed, k):
    def run(x):
        weights, ids = bik.moe.route(family, x @ gate.t(), k, renormalize=True)
        return bik.moe.experts(x, ids, weights, w13, w2, packed)

    return run


def _layer_tiled_by_group_size(w13, w2, gate, k):
    """The negative control: the same layer with every expert's products tiled by how many rows
    it got (bik.testing.controls.split_by_m_matmul), as a grouped GEMM picking tiles by tokens
    per expert would."""

    def grouped(rows, ends, w):
        out = rows.new_zeros(rows.shape[0], w.shape[1])
        start = 0
        for e, end in enumerate(ends.tolist()):
            if end > start:
                out[start:end] = split_by_m_matmul(rows[start:end], w[e].t())
            start = end
        return out

    def run(x):
        weights, ids = bik.moe.route("qwen3_moe", x @ gate.t(), k, renormalize=True)
        pairs = bik.moe.sort_pairs(x, ids, weights, w13.shape[0])
        proj = grouped(pairs.selected, pairs.ends, w13)
        gate_rows, up = proj.chunk(2, dim=-1)
        rows = grouped(torch.nn.functional.silu(gate_rows) * up, pairs.ends, w2)
        return bik.moe.combine(rows, pairs, x.shape[0], x.dtype)

    return run


@pytest.mark.parametrize("dtype", _dtypes(), ids=str)
def test_a_layer_on_the_fused_route_is_the_same_alone_as_batched(dtype, gen):
    w13, w2 = _weights(8, dtype, gen)
    gate = torch.randn(8, HIDDEN, generator=gen).to(dtype)
    pool = torch.randn(64, HIDDEN, generator=gen).to(dtype) * 4
    ms = (1, 2, 5, 16, 64)
    with torch.no_grad(), bik.enabled():
        report = rows_alone_vs_batched(
            _layer("qwen3_moe", w13, w2, gate, bik.moe.PackedExperts(w13, w2), 2), pool, ms,
            name="bik.moe on its one-call route")
        # in fp32: bf16's rounding of the outputs can hide the control's differences
        control = rows_alone_vs_batched(
            _layer_tiled_by_group_size(w13.float(), w2.float(), gate.float(), 2), pool.float(),
            ms, name="tiled by group size")
    assert report.ok, report
    assert control.mismatches, "the control no longer differs: the test could not fail"


def test_calls_it_does_not_serve_run_the_torch_code(monkeypatch, gen):
    """fp16 experts, an id outside the experts, autograd on, a dispatch mode watching, and
    bik.enable() off: no one-call route (the torch code gives the result)."""
    w13, w2 = _weights(4, torch.float32, gen)
    packed = bik.moe.PackedExperts(w13, w2)
    x = torch.randn(3, HIDDEN, generator=gen)
    ids = torch.tensor([[0, 1], [2, 3], [1, 0]])
    weights = torch.rand(3, 2, generator=gen)
    module = native_ext.module()
    args = (packed._panels13, packed._panels2, INTER, *packed._splits, packed._dot)
    with torch.no_grad(), bik.enabled():
        assert module.moe_experts(x.half(), ids, weights, *args) is None
        assert module.moe_experts(x, ids.clamp(max=3) + 1, weights, *args) is None  # id 4 of 4
        assert module.moe_route_softmax(torch.randn(2, 4), 5, True, True) is None  # k > E
        with bik.batch_invariant_mode():
            assert module.moe_experts(x, ids, weights, *args) is None
    with bik.enabled():
        grad_x = x.clone().requires_grad_()
        assert packed.fused(grad_x, ids, weights) is None
        with _torch_code(monkeypatch):
            want = bik.moe.experts(grad_x, ids, weights, w13, w2, packed)
        assert torch.equal(bik.moe.experts(grad_x, ids, weights, w13, w2, packed), want)
    with torch.no_grad():
        assert packed.fused(x, ids, weights) is None  # bik.enable() off


def test_weights_changed_after_packing_are_refused(gen):
    w13, w2 = _weights(4, torch.float32, gen)
    packed = bik.moe.PackedExperts(w13, w2)
    w2.mul_(2)
    x, ids = torch.randn(2, HIDDEN, generator=gen), torch.tensor([[0, 1], [2, 3]])
    with torch.no_grad(), bik.enabled(), pytest.raises(ValueError, match="changed after packing"):
        bik.moe.experts(x, ids, torch.rand(2, 2), w13, w2, packed)
