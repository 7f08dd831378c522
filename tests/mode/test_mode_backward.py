"""Stock backward formulas on bik: their aten ops (mm, sum, _softmax_backward_data, the CPU
flash-attention backward) are routed by the handlers of bik/mode/_grad_routes.py.

They run under bik.enabled() (the dispatcher overrides sit below autograd) and under
batch_invariant_mode's dispatch layer for ops its function layer did not map; ops the function
layer maps take bik's own registered backward instead. Each route is checked against an
explicit bik computation bit for bit, for row invariance under both front ends (with a
batch-dependent negative control through the same harness), and for the fallback of dtypes bik
does not serve (counted in mode_stats).
"""

import bik
import pytest
import torch
import torch.nn.functional as F
from bik.runtime import cpu_ext
from bik.testing import rows_alone_vs_batched, same_bits, split_by_m_softmax

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason="CPU extension not built")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.fixture(autouse=True)
def _clean_stats():
    bik.reset_mode_stats()
    yield
    assert not bik.is_batch_invariant_mode_enabled() and not bik.is_enabled()


def _routed(op: str) -> int:
    return bik.mode_stats().routed.get(op, 0)


FRONT_ENDS = {"mode": bik.batch_invariant_mode, "enabled": bik.enabled}


def _grads(fn, inputs, upstream, front=bik.enabled):
    """Forward and backward of fn, both inside the front end (or both outside: None)."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    if front is not None:
        with front():
            torch.autograd.backward(fn(*leaves), upstream)
    else:
        torch.autograd.backward(fn(*leaves), upstream)
    return [t.grad for t in leaves]


def _ones_col(n, dtype=torch.float32):
    return torch.ones(n, 1, dtype=dtype)


def _grad_rows(forward, n):
    """fn(rows [M, 2n]) -> d/dx sum(forward(x) * u), x = rows[:, :n], u = rows[:, n:]."""

    def fn(rows):
        x = rows[:, :n].detach().clone().requires_grad_()
        forward(x).backward(rows[:, n:])
        return x.grad

    return fn


# ---- matmul family: the stock backward's mm/sum calls run on bik ------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_grads_equal_bik_linear_grads(dtype, gen):
    x, w = torch.randn(6, 40, generator=gen).to(dtype), torch.randn(24, 40, generator=gen)
    b, u = torch.randn(24, generator=gen), torch.randn(6, 24, generator=gen).to(dtype)
    w, b = w.to(dtype), b.to(dtype)
    got = _grads(F.linear, [x, w, b], [u])
    want = _grads(bik.linear, [x, w, b], [u], front=None)
    assert all(same_bits(g, h) for g, h in zip(got, want))
    assert _routed("aten.addmm.default") == 1 and _routed("aten.mm.default") == 2
    assert _routed("aten.sum.dim_IntList") == 1  # the bias gradient


def test_3d_linear_bias_grad_is_the_row_sum_over_both_leading_dims(gen):
    x, w = torch.randn(3, 5, 16, generator=gen), torch.randn(8, 16, generator=gen)
    b, u = torch.randn(8, generator=gen), torch.randn(3, 5, 8, generator=gen)
    gx, gw, gb = _grads(F.linear, [x, w, b], [u])
    assert same_bits(gb, bik.matmul(torch.ones(1, 15), u.reshape(15, 8))[0])
    assert same_bits(gx, bik.matmul(u, w))
    assert same_bits(gw, bik.matmul(x.reshape(15, 16).t(), u.reshape(15, 8)).t())


@pytest.mark.parametrize("front", FRONT_ENDS)
def test_linear_grad_input_rows_invariant_under_the_mode_and_not_without(front, gen):
    # Measured: stock CPU fp32 mm (F.linear's grad_input) differs at M = 1, 2 from M >= 4.
    k, n = 256, 192
    w = torch.randn(n, k, generator=gen)
    pool = torch.randn(16, k + n, generator=gen)
    fn = _grad_rows(lambda x: F.linear(x, w), k)
    assert not rows_alone_vs_batched(fn, pool, (1, 2, 4, 16)).ok
    with FRONT_ENDS[front]():
        rep = rows_alone_vs_batched(fn, pool, (1, 2, 3, 4, 7, 16))
    assert rep.ok, rep.summary()


# ---- sum ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_sum_is_a_ones_matmul(dtype, gen):
    x = torch.randn(4, 6, 10, generator=gen).to(dtype)
    mm = bik.matmul
    ones = torch.ones
    cases = [  # (under the mode, explicit bik computation)
        (lambda: x.sum(0), lambda: mm(ones(1, 4, dtype=dtype), x.reshape(4, 60)).reshape(6, 10)),
        (lambda: x.sum((0, 1), keepdim=True),
         lambda: mm(ones(1, 24, dtype=dtype), x.reshape(24, 10)).reshape(1, 1, 10)),
        (lambda: x.sum(-1), lambda: mm(x.reshape(24, 10), _ones_col(10, dtype)).reshape(4, 6)),
        (lambda: x.sum((2, 0)),
         lambda: mm(x.permute(1, 0, 2).reshape(6, 40), _ones_col(40, dtype)).reshape(6)),
        (lambda: x.sum(), lambda: mm(ones(1, 240, dtype=dtype), x.reshape(240, 1)).reshape(())),
        (lambda: x.sum(1, dtype=torch.float32),
         lambda: mm(x.float().permute(0, 2, 1).reshape(40, 6), _ones_col(6)).reshape(4, 10)),
    ]
    for i, (stock, explicit) in enumerate(cases):
        with torch.no_grad():
            want = explicit()
            with bik.batch_invariant_mode():
                got = stock()
        assert same_bits(got, want), i
        torch.testing.assert_close(got.float(), stock().float(), rtol=1e-2, atol=1e-2)
    assert _routed("aten.sum.dim_IntList") == 5 and _routed("aten.sum.default") == 1


@pytest.mark.parametrize("front", FRONT_ENDS)
def test_row_sums_are_row_invariant(front, gen):
    pool = torch.randn(16, 111, generator=gen)
    with torch.no_grad(), FRONT_ENDS[front]():
        rep = rows_alone_vs_batched(lambda x: x.sum(-1, keepdim=True), pool, (1, 2, 5, 16))
    assert rep.ok, rep.summary()


def test_sum_falls_back_for_other_dtypes_and_bad_dims():
    d, i = torch.arange(6.0, dtype=torch.float64).reshape(2, 3), torch.arange(6).reshape(2, 3)
    with torch.no_grad(), bik.batch_invariant_mode():
        assert torch.equal(d.sum(0), torch.tensor([3.0, 5, 7], dtype=torch.float64))
        assert torch.equal(i.sum(), torch.tensor(15))
        with pytest.raises((RuntimeError, IndexError)):  # torch's own error
            torch.ones(2, 3).sum(5)
    fb = bik.mode_stats().fallbacks
    assert fb["aten.sum.dim_IntList: dtype float64"] == 1
    assert fb["aten.sum.default: dtype int64"] == 1
    assert not bik.mode_stats().routed


# ---- softmax / log_softmax backward -----------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("log", [False, True])
def test_softmax_backward_is_bik(dtype, log, gen):
    x = torch.randn(5, 3, 19, generator=gen).to(dtype)
    u = torch.randn(5, 3, 19, generator=gen).to(dtype)
    fn = (lambda t: F.log_softmax(t, 1)) if log else (lambda t: F.softmax(t, 1))
    (got,) = _grads(fn, [x], [u])
    op = "aten._log_softmax_backward_data.default" if log else \
        "aten._softmax_backward_data.default"
    assert _routed(op) == 1
    with torch.no_grad():  # explicit: rows along dim 1, row sums by a ones matmul, fp32
        y = (bik.log_softmax if log else bik.softmax)(x, 1).movedim(1, -1).float()
        y, g = y.reshape(95, 3), u.movedim(1, -1).float().reshape(95, 3)
        if log:
            from bik.ops._pointwise import exp_f32

            want = g - exp_f32(y) * bik.matmul(g, _ones_col(3))
        else:
            want = y * (g - bik.matmul(g * y, _ones_col(3)))
        want = want.reshape(5, 19, 3).movedim(-1, 1).to(dtype)
    assert same_bits(got, want)
    (ref,) = _grads(fn, [x.double()], [u.double()], front=None)
    (stock,) = _grads(fn, [x], [u], front=None)
    # Measured (6 seeds, max abs error in eps): fp32 bik 0.8-4.1 vs stock 1.2-3.3 (bik's
    # log_softmax backward takes exp(y) via exp2f, within 1.5 ulp); bf16/fp16 equal to stock.
    err = (got.double() - ref).abs().max().item()
    err_stock = (stock.double() - ref).abs().max().item()
    assert err <= max(3.0 * err_stock, 6 * torch.finfo(dtype).eps), (err, err_stock)


def test_softmax_half_to_float_backward_has_the_input_dtype(gen):
    x = torch.randn(4, 33, generator=gen).bfloat16()
    (got,) = _grads(lambda t: F.softmax(t, -1, dtype=torch.float32), [x],
                    [torch.randn(4, 33, generator=gen)])
    assert got.dtype == torch.bfloat16 and _routed("aten._softmax_backward_data.default") == 1


@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("front", FRONT_ENDS)
def test_softmax_grad_rows_invariant_and_a_split_reference_is_caught(log, front, gen):
    n = 111
    pool = torch.randn(16, 2 * n, generator=gen)
    fn = _grad_rows((lambda t: F.log_softmax(t, -1)) if log else (lambda t: F.softmax(t, -1)), n)
    with FRONT_ENDS[front]():
        rep = rows_alone_vs_batched(fn, pool, (1, 2, 3, 5, 16))
    assert rep.ok, rep.summary()
    # Stock CPU softmax backward was measured row-invariant here, so the negative control is
    # autograd through a softmax whose sum is split by the number of rows.
    split = _grad_rows((lambda t: split_by_m_softmax(t).log()) if log else split_by_m_softmax, n)
    assert not rows_alone_vs_batched(split, pool, (1, 2, 3, 5, 16)).ok


@pytest.mark.parametrize("log", [False, True])
def test_softmax_backward_falls_back_for_float64(log, gen):
    x = torch.randn(3, 7, generator=gen, dtype=torch.float64)
    u = torch.randn(3, 7, generator=gen, dtype=torch.float64)
    fn = (lambda t: F.log_softmax(t, -1)) if log else (lambda t: F.softmax(t, -1))
    (got,) = _grads(fn, [x], [u])
    assert torch.equal(got, _grads(fn, [x], [u], front=None)[0])
    name = "_log_softmax" if log else "_softmax"
    fb = bik.mode_stats().fallbacks
    assert fb[f"aten.{name}.default: dtype float64"] == 1
    assert fb[f"aten.{name}_backward_data.default: dtype float64"] == 1


# ---- RMSNorm -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rms_norm_backward_is_bik_rms_norm_backward(dtype, gen):
    """aten::_fused_rms_norm_backward (what CUDA's F.rms_norm backward calls; no CPU kernel, but
    the mode answers first) equals bik.rms_norm's own backward given the same rstd."""
    x, g = torch.randn(7, 40, generator=gen).to(dtype), torch.randn(7, 40, generator=gen)
    w, eps = (1 + 0.1 * torch.randn(40, generator=gen)).to(dtype), 1e-5
    g = g.to(dtype)
    rstd = 1.0 / torch.sqrt(bik.mean(x.float() ** 2, 1, keepdim=True) + eps)
    with bik.batch_invariant_mode():
        gx, gw = torch.ops.aten._fused_rms_norm_backward(g, x, [40], rstd, w, [True, True])
    assert _routed("aten._fused_rms_norm_backward.default") == 1
    want_x, want_w = _grads(lambda x, w: bik.rms_norm(x, w, eps), [x, w], [g], front=None)
    assert same_bits(gx, want_x) and same_bits(gw, want_w)


def test_fused_rms_norm_backward_falls_back_for_float64():
    x = torch.ones(2, 8, dtype=torch.float64)
    rstd = torch.ones(2, 1, dtype=torch.float64)
    with bik.batch_invariant_mode(), pytest.raises(NotImplementedError, match="CPU"):
        # counted, then torch's own kernel runs: it has none for CPU tensors
        torch.ops.aten._fused_rms_norm_backward(x, x, [8], rstd, x[0], [True, True])
    assert bik.mode_stats().fallbacks == {
        "aten._fused_rms_norm_backward.default: dtype float64": 1}


@pytest.mark.parametrize("front", FRONT_ENDS)
def test_hand_written_rms_norm_grads_rows_invariant(front, gen):
    """The Llama formula (pow, mean, rsqrt, mul): its backward's row sum (sum over the hidden
    dim) and weight gradient (sum over rows) are routed."""
    h = 111
    w = torch.randn(h, generator=gen)

    def norm(x):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    pool = torch.randn(16, 2 * h, generator=gen)
    with FRONT_ENDS[front]():
        rep = rows_alone_vs_batched(_grad_rows(norm, h), pool, (1, 2, 3, 16))
    assert rep.ok, rep.summary()
    assert _routed("aten.sum.dim_IntList") > 0


# ---- attention ---------------------------------------------------------------------------------

def _flat(t):
    return t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[-1])


def test_sdpa_backward_is_bik_attention_backward(gen):
    q = torch.randn(2, 4, 6, 16, generator=gen)
    k, v = torch.randn(2, 2, 6, 16, generator=gen), torch.randn(2, 2, 6, 16, generator=gen)
    u = torch.randn(2, 4, 6, 16, generator=gen)
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True)
    got = _grads(sdpa, [q, k, v], [u])
    assert _routed("aten._scaled_dot_product_flash_attention_for_cpu_backward.default") == 1
    cu = torch.tensor([0, 6, 12], dtype=torch.int32)

    def packed(q, k, v):
        out = bik.attention_varlen(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu).out
        return out.view(2, 6, 4, 16).transpose(1, 2)

    want = [_flat_back(g) for g in _grads(packed, [_flat(q), _flat(k), _flat(v)], [u],
                                          front=None)]
    assert all(same_bits(g.contiguous(), w) for g, w in zip(got, want))


def _flat_back(t):  # [B*L, H, D] -> [B, H, L, D] for B = 2
    return t.view(2, -1, *t.shape[1:]).transpose(1, 2).contiguous()


def test_stock_flash_backward_agrees_with_bik_lse_convention(gen):
    """bik's lse (natural log, fp32) is what the stock CPU flash backward expects: given the
    mode's (out, lse), the stock backward gives the correct gradients too."""
    q, k, v = (torch.randn(1, 2, 9, 16, generator=gen) for _ in range(3))
    u = torch.randn(1, 2, 9, 16, generator=gen)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    with torch.no_grad(), bik.batch_invariant_mode():
        out, lse = flash(q, k, v, 0.0, True)
    stock = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        u, q, k, v, out, lse, 0.0, True)
    ref = _grads(lambda *t: F.scaled_dot_product_attention(*t, is_causal=True),
                 [q.double(), k.double(), v.double()], [u.double()], front=None)
    for s, r in zip(stock, ref):
        torch.testing.assert_close(s.double(), r, rtol=1e-5, atol=1e-5)


def test_sdpa_with_a_padding_mask_routes_both_directions(gen):
    """Under grad a padding (+ causal) mask's forward and backward run on bik, per sequence
    (test_masked_sdpa.py checks their bits against each sequence alone), close to stock."""
    q = torch.randn(1, 2, 5, 16, generator=gen)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    fn = lambda q: F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    (got,) = _grads(fn, [q], [torch.ones_like(q)])
    torch.testing.assert_close(got, _grads(fn, [q], [torch.ones_like(q)], front=None)[0])
    stats = bik.mode_stats()
    backward = "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"
    assert any(key.startswith(backward) for key in stats.routed), stats.routed
    assert not any("scaled_dot_product" in key for key in stats.fallbacks), stats.fallbacks