"""bik.batch_invariant_mode: what it routes, what it leaves alone, and how it enters and leaves."""

import threading
import warnings

import bik
import pytest
import torch
import torch.nn.functional as F
from bik.runtime import cpu_ext
from bik.testing import probe_every_position, rows_alone_vs_batched, same_bits
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason="CPU extension not built")

GRAD_CONTEXTS = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


def _routed(op: str) -> int:
    return bik.mode_stats().routed.get(op, 0)


@pytest.fixture(autouse=True)
def _clean_stats():
    bik.reset_mode_stats()
    yield
    assert not bik.is_batch_invariant_mode_enabled()


def _cases(gen):
    """(name, stock call, the bik call it must equal bit for bit)."""
    r = lambda *s: torch.randn(*s, generator=gen)
    x3, a, w, bias = r(3, 5, 40), r(7, 40), r(24, 40), r(24)
    a3, b3 = r(3, 7, 40), r(3, 40, 9)
    s4, gamma = r(2, 3, 5, 19), r(40)
    q, k, v = r(2, 4, 6, 16), r(2, 2, 6, 16), r(2, 2, 6, 16)
    cu = torch.tensor([0, 6, 12], dtype=torch.int32)

    def sdpa_ref():
        flat = lambda t: t.transpose(1, 2).reshape(-1, t.shape[1], 16)
        out = bik.attention_varlen(flat(q), flat(k), flat(v), cu_seqlens_q=cu, cu_seqlens_k=cu)
        return out.out.view(2, 6, 4, 16).transpose(1, 2)

    return [
        ("mm", lambda: torch.mm(a, w.t()), lambda: bik.matmul(a, w.t())),
        ("linear", lambda: F.linear(x3, w), lambda: bik.linear(x3, w)),
        ("linear_bias", lambda: F.linear(x3, w, bias), lambda: bik.linear(x3, w, bias)),
        ("addmm", lambda: torch.addmm(bias, a, w.t()), lambda: bik.matmul(a, w.t(), bias)),
        ("matmul_3d_2d", lambda: x3 @ w.t(), lambda: bik.matmul(x3, w.t())),
        ("bmm", lambda: torch.bmm(a3, b3), lambda: bik.bmm(a3, b3)),
        ("mv", lambda: a @ gamma, lambda: bik.matmul(a, gamma[:, None])[:, 0]),
        ("dot", lambda: gamma @ bias.repeat(2)[:40],
         lambda: bik.matmul(gamma[None], bias.repeat(2)[:40, None]).reshape(())),
        ("matmul_3d_3d", lambda: a3 @ b3, lambda: bik.bmm(a3, b3)),
        ("softmax", lambda: s4.softmax(-1), lambda: bik.softmax(s4, -1)),
        ("softmax_mid", lambda: F.softmax(s4, 1), lambda: bik.softmax(s4, 1)),
        ("log_softmax", lambda: F.log_softmax(s4, -1), lambda: bik.log_softmax(s4, -1)),
        ("mean_2dims", lambda: s4.mean((0, 3)), lambda: bik.mean(s4, (0, 3))),
        ("mean_keepdim", lambda: s4.mean(-1, keepdim=True), lambda: bik.mean(s4, -1, True)),
        ("mean_all", lambda: s4.mean(), lambda: bik.mean(s4)),
        ("softmax_half_to_float", lambda: F.softmax(s4.bfloat16(), -1, dtype=torch.float32),
         lambda: bik.softmax(s4.bfloat16(), -1, dtype=torch.float32)),
        ("mean_dtype", lambda: s4.bfloat16().mean((1, 2), dtype=torch.float32),
         lambda: bik.mean(s4.bfloat16().float(), (1, 2))),
        ("linear_bf16", lambda: F.linear(x3.bfloat16(), w.bfloat16(), bias.bfloat16()),
         lambda: bik.linear(x3.bfloat16(), w.bfloat16(), bias.bfloat16())),
        # Under no_grad on the CPU F.rms_norm decomposes above the mode (its mean is routed):
        # only inference_mode shows the mode aten::rms_norm itself.
        ("rms_norm inference_mode", lambda: F.rms_norm(x3, (40,), gamma, 1e-5),
         lambda: bik.rms_norm(x3, gamma, 1e-5)),
        ("sdpa_causal", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                               enable_gqa=True), sdpa_ref),
    ]


@pytest.mark.parametrize("ctx", GRAD_CONTEXTS)
def test_routed_ops_give_bik_bits(gen, ctx):
    """Under no_grad the mode sees the decomposed aten ops, under inference_mode the composite
    ones (linear, matmul, softmax.int, rms_norm, scaled_dot_product_attention): both routed."""
    for name, stock, ref in _cases(gen):
        if "inference_mode" in name and ctx != "inference_mode":
            continue
        with GRAD_CONTEXTS[ctx]():
            want = ref()
            before = sum(bik.mode_stats().routed.values())
            with bik.batch_invariant_mode():
                got = stock()
            assert sum(bik.mode_stats().routed.values()) > before, name
        assert same_bits(got, want), name
        assert got.shape == want.shape and got.dtype == want.dtype, name


def test_fused_rms_norm_is_routed(gen):
    """aten::_fused_rms_norm: what F.rms_norm reaches below autograd on CUDA. On the CPU it
    decomposes under no_grad (its mean is routed), so inference_mode shows it to the mode."""
    x, w = torch.randn(6, 3, 40, generator=gen), torch.randn(40, generator=gen)
    with torch.inference_mode():
        want_out, want_rstd = torch.ops.aten._fused_rms_norm(x, [40], w, 1e-5)
        with bik.batch_invariant_mode():
            out, rstd = torch.ops.aten._fused_rms_norm(x, [40], w, 1e-5)
            row = torch.ops.aten._fused_rms_norm(x[:1, :1], [40], w, 1e-5)
    assert _routed("aten._fused_rms_norm.default") == 2
    assert same_bits(out, bik.rms_norm(x, w, 1e-5))
    assert same_bits(row[0][0, 0], out[0, 0]) and same_bits(row[1][0, 0], rstd[0, 0])
    assert rstd.shape == want_rstd.shape and rstd.dtype == want_rstd.dtype
    torch.testing.assert_close(rstd, want_rstd)
    torch.testing.assert_close(out, want_out)


def test_rms_norm_decomposed_under_no_grad_is_invariant(gen):
    """Under no_grad on the CPU, F.rms_norm decomposes to pow/mean/rsqrt/mul: mean is routed."""
    pool, w = torch.randn(16, 111, generator=gen), torch.randn(111, generator=gen)
    with torch.no_grad(), bik.batch_invariant_mode():
        report = rows_alone_vs_batched(lambda x: F.rms_norm(x, (111,), w, 1e-6), pool,
                                       (1, 2, 5, 16))
        assert _routed("aten.mean.dim") > 0 or _routed("aten.rms_norm.default") > 0
    assert report.ok, report


@pytest.mark.parametrize("n,k", [(64, 64), (96, 33), (128, 4096)])
def test_linear_is_invariant_under_the_mode_and_not_without(gen, n, k):
    """The negative control of test_harness (stock CPU fp32 mm varies at M = 1 vs M >= 4) turns
    green under the mode, with the same calls."""
    pool, w = torch.randn(8, k, generator=gen), torch.randn(n, k, generator=gen)
    fn = lambda x: F.linear(x, w)
    with torch.no_grad():
        assert not rows_alone_vs_batched(fn, pool, (1, 4, 8)).ok
        with bik.batch_invariant_mode():
            assert rows_alone_vs_batched(fn, pool, (1, 4, 8)).ok
            assert probe_every_position(fn, pool[:1], pool[1:]).ok


def test_addmm_alpha_beta_are_honoured(gen):
    a, b = torch.randn(6, 32, generator=gen), torch.randn(32, 8, generator=gen)
    full_bias = torch.randn(6, 8, generator=gen)
    with torch.no_grad():
        for bias, beta, alpha in ((full_bias, 0.5, 2.0), (full_bias[0], 1, 3), (full_bias, 0, 1)):
            if beta == 0:
                bias = bias.clone().fill_(float("nan"))  # beta = 0 ignores bias, NaN included
            stock = torch.addmm(bias, a, b, beta=beta, alpha=alpha)
            with bik.batch_invariant_mode():
                got = torch.addmm(bias, a, b, beta=beta, alpha=alpha)
                row = torch.addmm(bias[:1] if bias.dim() == 2 else bias, a[:1], b, beta=beta,
                                  alpha=alpha)
            assert _routed("aten.addmm.default") >= 2
            torch.testing.assert_close(got, stock)  # accuracy, not invariance
            assert same_bits(got[:1], row)


def test_out_variants_are_routed(gen):
    a, b = torch.randn(5, 24, generator=gen), torch.randn(24, 7, generator=gen)
    bias = torch.randn(7, generator=gen)
    a3, b3 = torch.randn(2, 5, 24, generator=gen), torch.randn(2, 24, 7, generator=gen)
    out, out3 = torch.empty(5, 7), torch.empty(0)
    with torch.no_grad(), bik.batch_invariant_mode():
        torch.mm(a, b, out=out)
        assert same_bits(out, bik.matmul(a, b))
        torch.addmm(bias, a, b, out=out)
        assert same_bits(out, bik.matmul(a, b, bias))
        torch.bmm(a3, b3, out=out3)  # resized, as torch does
        assert same_bits(out3, bik.bmm(a3, b3))
    routed = bik.mode_stats().routed
    assert {"aten.mm.out", "aten.addmm.out", "aten.bmm.out"} <= set(routed)


def test_unsupported_dtypes_run_the_original_kernel(gen):
    a, b = torch.randn(4, 8, dtype=torch.float64, generator=gen), torch.randn(8, 3).double()
    ints = torch.arange(12).reshape(3, 4)
    with torch.no_grad():
        want = (torch.mm(a, b), a.mean(-1), ints @ ints.t(), torch.softmax(a, -1))
        with bik.batch_invariant_mode():
            got = (torch.mm(a, b), a.mean(-1), ints @ ints.t(), torch.softmax(a, -1))
    assert all(same_bits(g, w) for g, w in zip(got, want))
    stats = bik.mode_stats()
    assert not stats.routed
    assert stats.fallbacks["aten.mm.default: dtype float64"] == 1
    assert stats.fallbacks["aten.mm.default: dtype int64"] == 1


def test_inputs_that_require_grad_are_routed_forward_and_backward(gen):
    """Under grad the function layer routes F.linear to bik::matmul, whose registered backward
    runs on bik (tests/mode/test_mode_backward.py covers the stock formulas' routes)."""
    x = torch.randn(3, 16, generator=gen)
    w = torch.randn(8, 16, generator=gen, requires_grad=True)
    with bik.batch_invariant_mode():
        y = F.linear(x, w)
        assert same_bits(y.detach(), bik.linear(x, w.detach()))
        assert y.requires_grad and _routed("aten.linear.default") == 1
        y.sum().backward()
        grad_in_mode = w.grad
        w.grad = None
        # Ops the mode does not route keep stock autograd.
        (w * 2).sum().backward()
    assert torch.equal(w.grad, torch.full_like(w, 2.0))
    w.grad = None
    bik.linear(x, w).sum().backward()
    assert same_bits(grad_in_mode, w.grad)


def test_sdpa_with_an_unserved_mask_falls_back_and_warns_once(gen):
    """An additive bias is not a padding mask (those are served: test_masked_sdpa.py)."""
    q = torch.randn(2, 2, 5, 16, generator=gen)
    mask = torch.randn(5, 5, generator=gen)
    with torch.no_grad():
        want = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
        with bik.batch_invariant_mode():
            with pytest.warns(bik.BatchInvarianceWarning, match="attn_mask"):
                got = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # once per reason
                F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    assert same_bits(got, want)
    (key, count), = bik.mode_stats().fallbacks.items()
    assert "attn_mask" in key and count == 2


def test_sdpa_decode_step_equals_causal_prefill_token(gen):
    """One query and no mask (HF's decode step) takes the causal path: same bits as that token
    in a causal prefill."""
    q, k, v = (torch.randn(1, 4, 9, 16, generator=gen) for _ in range(3))
    with torch.no_grad(), bik.batch_invariant_mode():
        prefill = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        decode = F.scaled_dot_product_attention(q[:, :, -1:], k, v)
    assert same_bits(decode, prefill[:, :, -1:])


def test_nesting_is_counted_and_restores_exactly():
    stack_before = _get_current_dispatch_mode()
    with bik.batch_invariant_mode():
        inner_mode = _get_current_dispatch_mode()
        with bik.batch_invariant_mode():
            bik.set_batch_invariant_mode(True)
            assert _get_current_dispatch_mode() is inner_mode  # one mode on the stack
            bik.set_batch_invariant_mode(False)
        assert bik.is_batch_invariant_mode_enabled()
        assert not torch.backends.cuda.matmul.allow_tf32
    assert not bik.is_batch_invariant_mode_enabled()
    assert _get_current_dispatch_mode() is stack_before
    with pytest.raises(RuntimeError, match="not on in this thread"):
        bik.set_batch_invariant_mode(False)
    with pytest.raises(TypeError):
        bik.set_batch_invariant_mode(1)


def test_exception_inside_restores(gen):
    a = torch.randn(4, 8, generator=gen)
    with pytest.raises(ValueError, match="boom"), bik.batch_invariant_mode(), \
            bik.batch_invariant_mode():  # nested: both levels must unwind
        raise ValueError("boom")
    assert not bik.is_batch_invariant_mode_enabled()
    with torch.no_grad():
        a @ a.t()
    assert not bik.mode_stats().routed


def test_leaving_under_another_mode_raises():
    class Other(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    bik.set_batch_invariant_mode(True)
    other = Other()
    other.__enter__()
    try:
        with pytest.raises(RuntimeError, match="Other"):
            bik.set_batch_invariant_mode(False)
    finally:
        other.__exit__(None, None, None)
    bik.set_batch_invariant_mode(False)


def test_leaving_under_another_function_mode_raises_and_keeps_both():
    from torch.overrides import TorchFunctionMode

    class OtherFunctions(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    bik.set_batch_invariant_mode(True)
    other = OtherFunctions()
    other.__enter__()
    try:
        with pytest.raises(RuntimeError, match="OtherFunctions"):
            bik.set_batch_invariant_mode(False)
        assert bik.is_batch_invariant_mode_enabled()  # the refused exit changed nothing
    finally:
        other.__exit__(None, None, None)
    bik.set_batch_invariant_mode(False)
    assert not bik.is_batch_invariant_mode_enabled()
    assert torch._C._len_torch_function_stack() == 0


def _dispatch_flags():
    import torch.utils._python_dispatch as pd

    return (pd._is_in_torch_dispatch_mode, pd._is_in_non_infra_torch_dispatch_mode,
            pd._is_in_any_mode_without_ignore_compile_internals,
            torch.get_float32_matmul_precision())


@pytest.mark.parametrize("raised", [True, False], ids=["exception in flight", "no exception"])
@pytest.mark.parametrize("kind", ["dispatch", "function"])
def test_a_block_left_under_another_mode_turns_bik_off_and_keeps_the_users_error(raised, kind):
    """Before: bik's RuntimeError replaced the user's exception, and bik's mode stayed on at
    depth 1 with TF32 off after the block had ended."""
    from torch.overrides import TorchFunctionMode

    seen = []

    class OtherDispatch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    class OtherFunctions(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # the mode holds "highest" while on
    try:
        _leave_under_another_mode(raised, kind, seen, OtherDispatch, OtherFunctions)
    finally:
        torch.set_float32_matmul_precision(precision)


def _leave_under_another_mode(raised, kind, seen, OtherDispatch, OtherFunctions):
    before = (_dispatch_flags(), torch._C._len_torch_dispatch_stack(),
              torch._C._len_torch_function_stack())
    other = OtherDispatch() if kind == "dispatch" else OtherFunctions()
    expected = ValueError if raised else RuntimeError
    with pytest.raises(expected) as error, bik.batch_invariant_mode():
        other.__enter__()
        if raised:
            raise ValueError("the user's own error")
    if raised:
        assert str(error.value) == "the user's own error"
    else:
        assert "this block's bik mode is now off" in str(error.value)
    assert not bik.is_batch_invariant_mode_enabled()
    torch.ones(2) + 1  # the other mode is still on, and alone
    assert seen
    other.__exit__(None, None, None)
    after = (_dispatch_flags(), torch._C._len_torch_dispatch_stack(),
             torch._C._len_torch_function_stack())
    assert after == before  # every stack and flag back to where it was
    with bik.batch_invariant_mode():  # and the mode works again
        assert bik.is_batch_invariant_mode_enabled()


def test_exception_inside_a_compiled_function_that_enters_the_mode(gen):
    w = torch.randn(3, 8, generator=gen)

    def fn(x):
        with bik.batch_invariant_mode():
            y = F.linear(x, w)
            if x.shape[0] > 2:
                raise ValueError("too many rows")
        return y

    torch._dynamo.reset()
    compiled = torch.compile(fn)
    with pytest.raises(ValueError, match="too many rows"):
        compiled(torch.randn(4, 8, generator=gen))
    assert torch._C._len_torch_function_stack() == 0
    assert not bik.is_batch_invariant_mode_enabled()
    x2 = torch.randn(2, 8, generator=gen)
    with torch.no_grad():
        assert same_bits(compiled(x2), bik.linear(x2, w))  # the mode still works afterwards


def _numerics():
    from bik.mode._numerics import numerics_snapshot

    return numerics_snapshot()


@pytest.mark.parametrize("setup", [
    lambda: None,
    lambda: torch.set_float32_matmul_precision("high"),
    lambda: setattr(torch.backends.cudnn.conv, "fp32_precision", "ieee"),
    lambda: (torch.set_float32_matmul_precision("high"),
             setattr(torch.backends.cuda.matmul, "allow_tf32", False)),  # mixed legacy/new API
])
def test_tf32_off_inside_and_flags_restored(setup):
    saved = _numerics()
    try:
        setup()
        before = _numerics()
        with bik.batch_invariant_mode():
            assert torch.backends.cuda.matmul.allow_tf32 is False
            assert torch.backends.cudnn.allow_tf32 is False
            assert torch.get_float32_matmul_precision() == "highest"
        assert _numerics() == before
    finally:
        from bik.mode._numerics import restore_numerics

        restore_numerics(saved)
    assert _numerics() == saved


def test_other_threads_do_not_see_the_mode(gen):
    a, b = torch.randn(4, 8, generator=gen), torch.randn(8, 3, generator=gen)
    seen = {}

    def worker():
        seen["enabled"] = bik.is_batch_invariant_mode_enabled()
        with torch.no_grad():
            a @ b
        seen["routed_after_stock"] = dict(bik.mode_stats().routed)
        with bik.batch_invariant_mode(), torch.no_grad():  # each thread can enter its own
            seen["own"] = a @ b

    with bik.batch_invariant_mode():
        t = threading.Thread(target=worker)
        t.start()
        t.join()
        assert bik.is_batch_invariant_mode_enabled()
        assert torch.backends.cuda.matmul.allow_tf32 is False  # flags stay until the last exit
    assert seen["enabled"] is False
    assert seen["routed_after_stock"] == {}
    assert same_bits(seen["own"], bik.matmul(a, b))


def test_addmm_edge_cases_follow_torch(gen):
    a, b = torch.randn(3, 4, generator=gen), torch.randn(4, 1, generator=gen)
    inf_a = torch.full((2, 3), float("inf"))
    with torch.no_grad():
        want = [torch.addmm(torch.tensor(0.5), a, b),
                torch.addmm(torch.ones(2, 2), inf_a, torch.ones(3, 2), alpha=0)]
        with bik.batch_invariant_mode():
            got = [torch.addmm(torch.tensor(0.5), a, b),  # 0-D bias, N = 1
                   torch.addmm(torch.ones(2, 2), inf_a, torch.ones(3, 2), alpha=0)]
            with pytest.raises(RuntimeError):  # a bias that cannot broadcast: torch's error
                torch.addmm(torch.ones(3, 1), torch.ones(1, 4), torch.ones(4, 3))
    torch.testing.assert_close(got[0], want[0])
    assert torch.equal(got[1], want[1]) and torch.equal(got[1], torch.ones(2, 2))


def test_linear_with_a_1d_weight_falls_back(gen):
    x, w = torch.randn(3, 8, generator=gen), torch.randn(8, generator=gen)
    with torch.inference_mode():
        want = F.linear(x, w)
        with bik.batch_invariant_mode():
            got = F.linear(x, w)
    assert torch.equal(got, want)


def test_rms_norm_default_eps_is_fp32_eps_for_16_bit(gen):
    """Stock rms_norm with eps=None uses the fp32 epsilon for bf16 input too."""
    x = (torch.randn(4, 64, generator=gen) * 0.01).bfloat16()
    w = torch.ones(64, dtype=torch.bfloat16)
    with torch.inference_mode():
        want = F.rms_norm(x, (64,), w)
        with bik.batch_invariant_mode():
            got = F.rms_norm(x, (64,), w)
    assert _routed("aten.rms_norm.default") == 1
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_unrouted_matmul_variants_are_counted(gen):
    a3, b3 = torch.randn(2, 3, 4, generator=gen), torch.randn(2, 4, 5, generator=gen)
    with torch.no_grad(), bik.batch_invariant_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore", bik.BatchInvarianceWarning)
        torch.baddbmm(torch.zeros(2, 3, 5), a3, b3)
    assert any(key.startswith("aten.baddbmm") for key in bik.mode_stats().fallbacks)


def test_aten_arguments_are_read_by_aten_s_names():
    """The rms_norm handlers read aten's call through its schema (mode/_kit.aten_args):
    positional, keyword and defaulted arguments land on their names."""
    from bik.mode._kit import aten_args

    rms = torch.ops.aten.rms_norm.default
    x, w = torch.ones(2, 4), torch.ones(4)
    got = aten_args(rms, (x, [4]), {"eps": 0.5})
    assert got._fields == ("input", "normalized_shape", "weight", "eps")
    assert got.input is x and got.weight is None and got.eps == 0.5
    assert aten_args(rms, (x, [4], w), {}).weight is w and aten_args(rms, (x, [4], w), {}).eps \
        is None


def test_an_aten_keyword_eps_reaches_bik(gen):
    """aten::rms_norm called with eps as a keyword: bik's bits for that eps (a handler that
    dropped the keyword would use the fp32 epsilon and differ)."""
    x, w = torch.randn(3, 64, generator=gen), torch.rand(64, generator=gen) + 0.5
    with torch.inference_mode(), bik.batch_invariant_mode():
        got = torch.ops.aten.rms_norm(x, [64], weight=w, eps=0.25)
    assert _routed("aten.rms_norm.default") == 1
    assert same_bits(got, bik.rms_norm(x, w, 0.25))
    assert not same_bits(got, bik.rms_norm(x, w, torch.finfo(torch.float32).eps))
