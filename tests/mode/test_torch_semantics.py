"""Torch's semantics under each front end: torch's own OpInfo samples (op_db) give the same
values, dtypes and shapes as stock torch, and bad input raises the exception type stock torch
raises (bik routes only what torch accepts; the rest runs the stock op).

Eager: every sample of every op, fp32 / bf16 / fp64 (fp64 is a fallback to stock's kernels; on
an AVX-512 CPU a batched fp64 matmul sample was measured to differ from stock in its last bits
under the mode, so fp64 is compared to 1e-12). Compiled
with aot_eager: every fp32 sample against stock compiled the same way. Inductor: the first two
samples per op (compiles cost seconds on two cores).
"""

import bik
import pytest
import torch
import torch.nn.functional as F
from bik.runtime import cpu_ext

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason="CPU extension not built")

_FROZEN = torch.backends.flags_frozen()
op_db = pytest.importorskip("torch.testing._internal.common_methods_invocations").op_db
if not _FROZEN:
    # Importing torch's test internals calls torch.backends.disable_global_flags(), which
    # makes every later assignment to torch.backends flags raise, for the whole pytest
    # session (collection imports this module first). Undo that side effect.
    torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True

NAMES = ("mm", "addmm", "bmm", "matmul", "nn.functional.linear", "softmax", "log_softmax",
         "mean", "sum")
OPINFOS = [op for op in op_db if op.name in NAMES and op.variant_test_name != "triton_optimized"]
FRONT_ENDS = {"mode": bik.batch_invariant_mode, "enabled": bik.enabled}
TOLERANCE = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (2e-2, 2e-2),
             torch.float64: (1e-12, 1e-12)}


def _id(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


@pytest.fixture(autouse=True)
def _clean():
    bik.reset_mode_stats()
    yield
    assert not bik.is_enabled() and not bik.is_batch_invariant_mode_enabled()


def _outcome(call):
    try:
        return call(), None
    except Exception as exc:  # noqa: BLE001 - the exception type is what is compared
        return None, exc


def _assert_same(got, want, dtype, what):
    (g, g_err), (w, w_err) = got, want
    if w_err is not None:
        assert g_err is not None, f"{what}: stock raised {type(w_err).__name__}, bik returned"
        assert isinstance(g_err, type(w_err)), f"{what}: {type(g_err)} vs {type(w_err)}"
        return
    assert g_err is None, f"{what}: bik raised {g_err!r}, stock returned"
    assert g.dtype == w.dtype and g.shape == w.shape, what
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(g, w, rtol=rtol, atol=atol, equal_nan=True, msg=what)


def _variants(op):
    return [v for v in (op.op, op.method_variant) if v is not None]


def _call(variant, sample):
    return lambda: variant(sample.input, *sample.args, **sample.kwargs)


@pytest.mark.parametrize("front", FRONT_ENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64],
                         ids=["fp32", "bf16", "fp64"])
@pytest.mark.parametrize("op", OPINFOS, ids=_id)
def test_opinfo_samples_eager(op, dtype, front):
    samples = list(op.sample_inputs("cpu", dtype))
    assert samples
    for i, sample in enumerate(samples):
        for variant in _variants(op):
            call = _call(variant, sample)
            with torch.no_grad():
                want = _outcome(call)
                with FRONT_ENDS[front]():
                    got = _outcome(call)
            _assert_same(got, want, dtype, f"{_id(op)} sample {i} {variant}: {sample}")


def _error_samples(op):
    """Input torch rejects, built from each op's first sample: a dim out of range for the
    reductions, a second operand whose K does not match for the products."""
    sample = next(iter(op.sample_inputs("cpu", torch.float32)))
    x = sample.input
    if op.name in ("softmax", "log_softmax"):
        return [lambda: op.op(x, x.dim() + 2)]
    if op.name in ("mean", "sum"):
        return [lambda: op.op(x, x.dim() + 2), lambda: op.op(x, (0, 0))]  # out of range, repeated
    if op.name == "nn.functional.linear":
        return [lambda: F.linear(torch.randn(3, 5), torch.randn(4, 6))]
    if op.name == "addmm":
        return [lambda: torch.addmm(torch.randn(3, 4), torch.randn(3, 5), torch.randn(6, 4))]
    if op.name == "bmm":
        return [lambda: torch.bmm(torch.randn(2, 3, 5), torch.randn(2, 6, 4)),
                lambda: torch.bmm(torch.randn(2, 3, 5), torch.randn(3, 5, 4))]
    return [lambda: op.op(torch.randn(3, 5), torch.randn(6, 4))]  # mm, matmul


def _error_inputs(op) -> list:
    """The OpInfo's own error inputs, where it has them (mean does)."""
    try:
        return list(op.error_inputs("cpu"))
    except TypeError:  # no error_inputs_func for this op
        return []


@pytest.mark.parametrize("front", FRONT_ENDS)
@pytest.mark.parametrize("op", OPINFOS, ids=_id)
def test_bad_input_raises_torchs_exception(op, front):
    cases = _error_samples(op) + [_call(op.op, e.sample_input) for e in _error_inputs(op)]
    for i, call in enumerate(cases):
        want = _outcome(call)
        assert want[1] is not None, f"{_id(op)} case {i}: stock accepted it"
        with FRONT_ENDS[front]():
            got = _outcome(call)
        _assert_same(got, want, torch.float32, f"{_id(op)} error case {i}")
        assert type(got[1]) is type(want[1]) and str(got[1]) == str(want[1])


def test_the_issue_examples_keep_torchs_exception_types():
    x = torch.randn(4, 6)
    cases = [
        (lambda: torch.softmax(x, dim=-3), IndexError),
        (lambda: x.mean(dim=5), IndexError),
        (lambda: torch.mm(x, x), RuntimeError),
        (lambda: torch.bmm(x[None], x[None]), RuntimeError),
        (lambda: F.linear(x, torch.randn(3, 5)), RuntimeError),
        (lambda: x @ torch.randn(5, 2), RuntimeError),
        (lambda: F.rms_norm(x, 6), TypeError),  # normalized_shape must be a sequence
    ]
    for front in FRONT_ENDS.values():
        for call, kind in cases:
            with front(), pytest.raises(kind) as info:
                call()
            assert type(info.value) is kind  # not a bik ValueError subclass of it


def _compiled_outcome(variant, sample, backend):
    torch._dynamo.reset()
    fn = torch.compile(lambda: variant(sample.input, *sample.args, **sample.kwargs),
                       backend=backend)
    return _outcome(fn)


@pytest.mark.parametrize("op", OPINFOS, ids=_id)
def test_opinfo_samples_aot_eager(op):
    """Each sample compiled with aot_eager under each front end: stock's compiled outcome
    (computed once per sample, for both front ends)."""
    routed_enabled = False
    for i, sample in enumerate(op.sample_inputs("cpu", torch.float32)):
        with torch.no_grad():
            want = _compiled_outcome(op.op, sample, "aot_eager")
            for front, enter in FRONT_ENDS.items():
                bik.reset_mode_stats()
                with enter():
                    got = _compiled_outcome(op.op, sample, "aot_eager")
                _assert_same(got, want, torch.float32, f"{_id(op)} sample {i} (aot_eager, {front})")
                routed_enabled |= front == "enabled" and bool(bik.mode_stats().routed)
    torch._dynamo.reset()
    if op.variant_test_name != "with_dtype":  # (its dtype= is fp64)
        assert routed_enabled  # bik.enable()'s compiled graphs' aten calls reached bik


@pytest.mark.parametrize("front", FRONT_ENDS)
@pytest.mark.parametrize("op", [op for op in OPINFOS if not op.variant_test_name], ids=_id)
def test_opinfo_samples_inductor(op, front):
    for i, sample in enumerate(list(op.sample_inputs("cpu", torch.float32))[:2]):
        with torch.no_grad():
            want = _outcome(_call(op.op, sample))
            with FRONT_ENDS[front]():
                got = _compiled_outcome(op.op, sample, "inductor")
        _assert_same(got, want, torch.float32, f"{_id(op)} sample {i} (inductor)")
    torch._dynamo.reset()
