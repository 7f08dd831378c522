"""bik.softmax, bik.log_softmax and bik.mean (forward): what each backend target proves.

On every target this machine runs (the CPU backend's fixed-order C++ kernels; the Triton
kernels in the interpreter, at the sizes it can afford): each row's bits are the same alone and
inside any batch of the M sweep, at every position among neighbours; accuracy against fp64
within a bound relative to torch's own error; output dtypes (half -> float without rounding to
half), any dim, several mean dims, views, 0-D and empty inputs, NaN/inf kept in their row; input
errors naming the op and shape; opcheck; a hypothesis search for a row whose bits change in a
batch. CPU only: long rows (4096) at every position, torch.compile. The harness must be able to
fail: it rejects references whose sums split by M, and (interpreter) the real Triton softmax
program with its BLOCK picked by M. GPU (skipped without CUDA): the compiled Triton kernels at
real sizes, up to M = 4096 and a Llama-3 vocabulary.

In the interpreter the BLOCK is 64, so rows of a few hundred cross several chunks: that proves
the chunk loop, the masks of rows that are not a multiple of BLOCK, int64 row offsets, strides,
the three softmax passes and the casts. It cannot prove the bits of the GPU's compiled tl.sum
tree or ex2/lg2 (the GPU test's territory); tests/test_triton_compile.py compiles every config
for sm_90 and sm_80. The CPU kernels against the literal contract: test_reductions_cpu_kernel.py;
Triton's log_softmax against the sampler's normaliser: test_log_softmax_normaliser.py.
"""

from __future__ import annotations

import dataclasses
import inspect

import bik
import pytest
import torch
from bik import configs
from bik.testing import rows_alone_vs_batched, same_bits, split_by_m_mean, split_by_m_softmax
from bik.testing.harness import M_SWEEP
from bik.testing.suites import reduction_suite
from checks import ACCURACY_FLOOR, ACCURACY_RATIO, DTYPES, FULL, assert_invariant, max_err, randn
from hypothesis import given, settings
from hypothesis import strategies as st
from targets import targets
from torch.library import opcheck

OPS = ("softmax", "log_softmax", "mean")
SOFTMAXES = {"softmax": (bik.softmax, torch.softmax),
             "log_softmax": (bik.log_softmax, torch.log_softmax)}

LENGTHS = (1, 111, 500, 4096)  # odd and powers of two
# The interpreter's M sweep: one row, odd, a power of two and past it. Its cost is mostly the
# rows alone (max(M) launches per length and op), so CI stops at 17 rows.
SMALL_MS = (1, 2, 3, 16, 17, 33) if FULL else (1, 3, 16, 17)
SMALL_LENGTHS = (1, 111, 128)  # odd, and a power of two of two chunks (BLOCK 64)


# ---- invariance -------------------------------------------------------------------------------

@pytest.mark.parametrize("target", targets())
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_invariant_over_m_sweep(target, dtype):
    if target.small:
        # every position among neighbours for fp32 only: the interpreter costs ~1 ms per program
        ms, lengths, probe = SMALL_MS, SMALL_LENGTHS, 9 if dtype == torch.float32 else 0
    else:
        ms, lengths, probe = M_SWEEP, LENGTHS[:3], 0
    assert_invariant(reduction_suite(device=target.device, dtype=dtype, backend=target.backend,
                                     ms=ms, lengths=lengths, probe_batch=probe))


@pytest.mark.parametrize("target", targets("cpu"))
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_invariant_long_rows_and_every_position(target, dtype):
    assert_invariant(reduction_suite(device=target.device, dtype=dtype, backend=target.backend,
                                     ms=(1, 2, 3, 4, 7, 8, 16, 31, 64), lengths=LENGTHS[3:],
                                     probe_batch=24))


@pytest.mark.parametrize("reference", [split_by_m_softmax, split_by_m_mean])
def test_harness_rejects_a_sum_split_by_m(reference, gen):
    """The harness must be able to fail: a reference whose sum is split by M is rejected."""
    ms, n = (1, 2, 4, 17, 64), 500
    pool = randn(gen, max(ms), n) * 3
    report = rows_alone_vs_batched(reference, pool, ms, name=reference.__name__)
    assert not report.ok and report.comparisons == sum(ms)


@pytest.mark.parametrize("target", targets("interpreter"))
def test_harness_catches_a_block_chosen_by_m(target, gen, monkeypatch):
    """Negative control on this path: the same Triton program with BLOCK picked by the number
    of rows (what a row-count-tuned tiling risks) must fail the harness."""
    from bik.ops.reductions import triton as triton_reductions

    fixed = triton_reductions.reduction_config
    x = torch.randn(12, 500, generator=gen) * 3
    fn = lambda t: bik.softmax(t, backend=target.backend)
    ms = (1, 4, 12)
    assert rows_alone_vs_batched(fn, x, ms).ok  # the fixed BLOCK: invariant
    launch = triton_reductions.launch_softmax

    def launch_with_block_by_m(t, out, *, log):
        block = 16 if t.shape[0] == 1 else 64
        monkeypatch.setattr(triton_reductions, "reduction_config",
                            lambda *key: dataclasses.replace(fixed(*key), block=block))
        launch(t, out, log=log)

    monkeypatch.setattr(triton_reductions, "launch_softmax", launch_with_block_by_m)
    assert not rows_alone_vs_batched(fn, x, ms).ok


PADS = tuple(range(9))
PAD_FILLS = {"-inf": float("-inf"), "lowest": torch.finfo(torch.float32).min}


def _padded_rows(x, fill):
    """Row i of x with PADS[i % 9] leading masked entries, each row padded to one length: how
    an eager attention's scores look under HF's left padding (masked: -inf, or the lowest
    value added to a score)."""
    rows = []
    for i in range(x.shape[0]):
        p = PADS[i % len(PADS)]
        rows.append(torch.cat([torch.full((p,), fill), x[i], torch.full((max(PADS) - p,), fill)]))
    return torch.stack(rows)


def _pad_invariant(fn, x, fill) -> bool:
    """Each padded row's real entries = the unpadded row's outputs, bit for bit. Trailing pads
    keep every row the same length; they follow the real entries, so they move no lane."""
    want = fn(x)
    got = fn(_padded_rows(x, fill))
    return all(torch.equal(got[i, PADS[i % len(PADS)]:][:x.shape[1]], want[i])
               for i in range(x.shape[0]))


@pytest.mark.parametrize("target", targets("cpu", "interpreter"))
@pytest.mark.parametrize("fill", PAD_FILLS)
def test_leading_masked_entries_do_not_move_a_rows_bits(target, fill, gen):
    """Left padding under eager attention: 0-8 leading masked entries leave a row's softmax
    bits alone. CPU: its 16 lane sums only rotate, which the pairwise fold does not see.
    Triton: the sum starts at the row's first nonzero exp (the anchor). log_softmax promises
    no such thing: its sum is the sampler's normaliser, whose order is fixed by token position
    (test_log_softmax_normaliser.py)."""
    x = randn(gen, 9, 5 if target.small else 300) * 3
    fn = lambda t: bik.softmax(t, -1, backend=target.backend)
    assert _pad_invariant(fn, x, PAD_FILLS[fill])


@pytest.mark.parametrize("target", targets("interpreter"))
def test_padding_check_catches_an_unanchored_sum(target, gen):
    """Negative control: the same Triton program without the anchor fails the padding check
    (measured: 12 of 16 pad cases for one row of length 5, BLOCK 64)."""
    from bik.ops.reductions.triton import softmax_kernel

    def unanchored(t):
        out = torch.empty_like(t)
        softmax_kernel[(t.shape[0],)](t, out, t.shape[1], t.stride(0), out.stride(0),
                                      BLOCK=64, ANCHOR=False)
        return out

    x = randn(gen, 36, 5)  # each pad count 4 times
    assert not _pad_invariant(unanchored, x, float("-inf"))


def test_reduction_config_never_sees_m():
    assert list(inspect.signature(configs.reduction_config).parameters) == ["n", "arch"]


# ---- accuracy ---------------------------------------------------------------------------------

# Accuracy against fp64: bik's max error may be at most ACCURACY_RATIO x the error of an
# independent implementation of the same output dtype (torch on the CPU, fp32 inside, one final
# rounding) plus ACCURACY_FLOOR x eps(out dtype) x scale (tests/checks.py, keyed here by the
# output dtype; the scale is the output's largest magnitude, x's for mean). Measured worst
# ratios (CPU backend, n up to 50000): softmax fp32 1.3x, log_softmax 1.0x, mean fp32 10.5x at
# n = 50000 (16 sequential lane sums vs torch's cascade sum; the floor term dominates there),
# half -> fp32 outputs up to 2.0x, bf16 / fp16 outputs 1.0x (the final rounding dominates).

def _bound(indep, ref, out_dtype, scale):
    return (ACCURACY_RATIO[out_dtype] * max_err(indep, ref)
            + ACCURACY_FLOOR * torch.finfo(out_dtype).eps * scale)


def accuracy(backend, op, dtype, rows, n, gen, out_dtype=None):
    """(bik's max error vs fp64, the bound) for one op on random data (also used to measure)."""
    x = randn(gen, rows, n, dtype=dtype) * 4
    out_dtype = out_dtype or dtype
    if op == "mean":
        ref = x.double().mean(-1)
        got = bik.mean(x, -1, dtype=out_dtype, backend=backend)
        indep = x.float().mean(-1).to(out_dtype)
        scale = x.abs().max().item()
    else:
        fn, torch_fn = SOFTMAXES[op]
        ref = torch_fn(x.double(), -1)
        got = fn(x, -1, dtype=out_dtype, backend=backend)
        indep = torch_fn(x.float(), -1).to(out_dtype)
        scale = ref.abs().max().item()
    assert got.dtype == out_dtype and got.shape == ref.shape
    return max_err(got, ref), _bound(indep, ref, out_dtype, scale)


@pytest.mark.parametrize("target", targets())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_accuracy_vs_fp64(target, op, dtype, gen):
    rows, lengths = (5, (1, 64, 500)) if target.small else (9, LENGTHS + (50_000,))
    out_dtypes = (dtype,) if dtype == torch.float32 else (dtype, torch.float32)
    for n in lengths:
        for out_dtype in out_dtypes:
            err, bound = accuracy(target.backend, op, dtype, rows, n, gen, out_dtype)
            assert err <= bound, (op, dtype, out_dtype, n, err, bound)


# ---- dtypes, dims, layouts, empty and non-finite inputs ---------------------------------------

@pytest.mark.parametrize("target", targets())
@pytest.mark.parametrize("dtype", DTYPES)
def test_output_dtypes_and_half_to_float(target, dtype, gen):
    """dtype=float32 on half input (aten's half_to_float) equals computing on the upcast input:
    no rounding to half anywhere; a narrower dtype rounds the fp32 result once."""
    b = target.backend
    x = randn(gen, 6, 77, dtype=dtype)
    for fn in (bik.softmax, bik.log_softmax):
        wide = fn(x, dtype=torch.float32, backend=b)
        assert wide.dtype == torch.float32
        assert torch.equal(wide, fn(x.float(), backend=b))
        for narrow in (torch.float16, torch.bfloat16):
            assert torch.equal(fn(x, dtype=narrow, backend=b), wide.to(narrow))
        assert fn(x, backend=b).dtype == dtype
    wide = bik.mean(x, 1, dtype=torch.float32, backend=b)
    assert torch.equal(wide, bik.mean(x.float(), 1, backend=b))
    assert torch.equal(bik.mean(x, 1, dtype=torch.float16, backend=b), wide.half())


@pytest.mark.parametrize("target", targets())
@pytest.mark.parametrize("dtype", DTYPES)
def test_dims_and_layouts(target, dtype, gen):
    """Any dim gives the bits of the same rows laid out last; mean over several dims is the mean
    of the flattened row (reduced dims in ascending order); views equal contiguous copies."""
    if target.small and dtype != torch.float32:
        pytest.skip("the layouts are dtype-blind: fp32 only in the interpreter (~1 ms a program)")
    b = target.backend
    x = randn(gen, 5, 6, 7, dtype=dtype)
    for fn in (bik.softmax, bik.log_softmax):
        last = fn(x.transpose(1, 2).contiguous(), -1, backend=b)
        got = fn(x, 1, backend=b)
        assert got.is_contiguous() and got.shape == x.shape
        assert torch.equal(got, last.transpose(1, 2))
        assert torch.equal(fn(x, -2, backend=b), got)
        assert torch.equal(fn(x.transpose(0, 2), 1, backend=b),
                           fn(x.transpose(0, 2).contiguous(), 1, backend=b))
    flat = bik.mean(x.permute(1, 0, 2).reshape(6, 35), -1, backend=b)
    for dims in ((0, 2), (2, 0), [-1, 0], (0, -1)):
        assert torch.equal(bik.mean(x, dims, backend=b), flat)
    assert bik.mean(x, (0, 2), keepdim=True, backend=b).shape == (1, 6, 1)
    assert torch.equal(bik.mean(x, (0, 2), keepdim=True, backend=b).flatten(), flat)
    everything = bik.mean(x.reshape(-1), 0, backend=b)
    for dims in (None, (), [], (0, 1, 2), (2, 1, 0)):
        got = bik.mean(x, dims, backend=b)
        assert got.shape == () and torch.equal(got, everything)
    assert bik.mean(x, None, keepdim=True, backend=b).shape == (1, 1, 1)
    xt = x.transpose(0, 1)  # a non-contiguous view
    assert torch.equal(bik.mean(xt, 2, backend=b), bik.mean(xt.contiguous(), 2, backend=b))
    assert torch.equal(bik.mean(x, 1, backend=b),
                       bik.mean(x.transpose(1, 2).contiguous(), 2, backend=b))
    s = randn(gen, 1, dtype=dtype)[0]  # 0-D, as torch: softmax 1, log_softmax 0, mean itself
    assert bik.softmax(s, 0, backend=b).item() == 1.0
    assert bik.log_softmax(s, -1, backend=b).item() == 0.0
    assert torch.equal(bik.mean(s, backend=b), s)


@pytest.mark.parametrize("target", targets())
@pytest.mark.parametrize("dtype", DTYPES)
def test_empty(target, dtype):
    b = target.backend
    for fn in (bik.softmax, bik.log_softmax):
        assert fn(torch.zeros(0, 9, dtype=dtype), backend=b).shape == (0, 9)
        assert fn(torch.zeros(3, 0, dtype=dtype), backend=b).shape == (3, 0)
    assert bik.mean(torch.zeros(0, 9, dtype=dtype), 1, backend=b).shape == (0,)
    nan = bik.mean(torch.zeros(3, 0, dtype=dtype), 1, backend=b)  # 0/0, as torch
    assert nan.shape == (3,) and nan.isnan().all()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy: inf - inf
@pytest.mark.parametrize("target", targets())
@pytest.mark.parametrize("dtype", DTYPES)
def test_non_finite_stays_in_its_row(target, dtype, gen):
    """NaN/inf stay in their own row, with torch's values; other rows keep their bits."""
    b = target.backend
    x = randn(gen, 7, 40, dtype=dtype)
    clean = {f: f(x, backend=b) for f in (bik.softmax, bik.log_softmax)}
    clean_mean = bik.mean(x, -1, backend=b)
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    x[3] = float("-inf")
    x[4, :39] = float("-inf")  # one finite entry: softmax 1 there, 0 elsewhere
    x[5, 7] = float("-inf")
    x[6, 0], x[6, 1] = float("inf"), float("-inf")
    keep = [0]
    for f in (bik.softmax, bik.log_softmax):
        out = f(x, backend=b)
        ref = (torch.softmax if f is bik.softmax else torch.log_softmax)(x.float(), -1)
        for r in (1, 2, 3, 6):
            assert out[r].isnan().all(), (f.__name__, r)
        assert torch.equal(out[4].float(), ref[4]), f.__name__
        assert out[5].isnan().sum() == 0 and out[5, 7] == ref[5, 7]  # 0, or -inf for log
        assert torch.equal(out[keep], clean[f][keep])
    m = bik.mean(x, -1, backend=b)
    assert m[1].isnan() and m[2] == float("inf") and m[3] == float("-inf") and m[6].isnan()
    assert torch.equal(m[keep], clean_mean[keep])


# ---- errors -----------------------------------------------------------------------------------

X = torch.zeros(4, 8)


@pytest.mark.parametrize("target", targets())
@pytest.mark.parametrize(
    "call, exc, pattern",
    [
        (lambda b: bik.softmax(X.double(), backend=b), TypeError,
         "bik.softmax: x has dtype float64"),
        (lambda b: bik.log_softmax(X.int(), backend=b), TypeError,
         "bik.log_softmax: x has dtype int32"),
        (lambda b: bik.mean(X.double(), 0, backend=b), TypeError,
         "bik.mean: x has dtype float64"),
        (lambda b: bik.softmax(X, 2, backend=b), ValueError,
         r"bik.softmax: dim 2 is out of range for x of shape \[4, 8\]"),
        (lambda b: bik.log_softmax(X, -3, backend=b), ValueError,
         r"bik.log_softmax: dim -3 is out of range for x of shape \[4, 8\]"),
        (lambda b: bik.mean(X, (0, 5), backend=b), ValueError,
         r"bik.mean: dim 5 is out of range for x of shape \[4, 8\]"),
        (lambda b: bik.mean(X, (1, -1), backend=b), ValueError,
         r"bik.mean: dim \[1, -1\] names a dim twice for x of shape \[4, 8\]"),
        (lambda b: bik.mean(X, 1.0, backend=b), TypeError, "bik.mean: dim must be an int"),
        (lambda b: bik.softmax(X, (0, 1), backend=b), TypeError,
         "bik.softmax: dim must be an int"),
        (lambda b: bik.softmax(X, dtype=torch.int32, backend=b), TypeError,
         "bik.softmax: dtype torch.int32"),
        (lambda b: bik.mean(X, 0, dtype=torch.float64, backend=b), TypeError,
         "bik.mean: dtype torch.float64"),
        (lambda b: bik.softmax("x", backend=b), TypeError,
         "bik.softmax: x must be a torch.Tensor, got str"),
        (lambda b: bik.mean(X, 0, backend="gpu"), ValueError, "bik.mean: unknown backend 'gpu'"),
    ],
)
def test_bad_input_names_op_and_shape(target, call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call(target.backend)


@pytest.mark.parametrize("target", targets())
def test_registered_ops_check_inputs_too(target):
    with pytest.raises(ValueError, match=r"bik.mean: dim \[0, 0\] names a dim twice"):
        torch.ops.bik.mean(X, [0, 0], False, None, target.backend)
    with pytest.raises(ValueError, match="bik.softmax: dim 9 is out of range"):
        torch.ops.bik.softmax(X, 9, None, target.backend)


# ---- opcheck, torch.compile -------------------------------------------------------------------

@pytest.mark.parametrize("target", targets())
def test_opcheck(target, gen):
    b = target.backend
    x = randn(gen, 3, 4, 37)
    samples = [
        (torch.ops.bik.softmax.default, (x, -1, None, b)),
        (torch.ops.bik.softmax.default, (x, 1, torch.float16, b)),
        (torch.ops.bik.log_softmax.default, (x, 0, None, b)),
        (torch.ops.bik.log_softmax.default, (x.half(), -1, torch.float32, b)),
        (torch.ops.bik.mean.default, (x, [-1], False, None, b)),
        (torch.ops.bik.mean.default, (x, [0, 2], True, torch.float32, b)),
        (torch.ops.bik.mean.default, (x, [], False, None, b)),
    ]
    for op, args in samples:
        opcheck(op, args)


@pytest.mark.parametrize("target", targets("cpu"))
def test_compiled_fullgraph_matches_eager_bits(target, gen):
    def block(x):
        p = bik.softmax(x, -1, backend=target.backend)
        return (p, bik.log_softmax(x, 1, dtype=torch.float32, backend=target.backend),
                bik.mean(p, (0, 2), keepdim=True, backend=target.backend))

    x = torch.randn(5, 3, 64, generator=gen).half()
    torch._dynamo.reset()
    got = torch.compile(block, fullgraph=True, dynamic=False)(x)
    for e, g in zip(block(x), got):
        assert torch.equal(e, g)
    ops = []

    def capture(gm, example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    torch._dynamo.reset()
    torch.compile(block, fullgraph=True, backend=capture)(x)
    assert {"bik.softmax", "bik.log_softmax", "bik.mean"} <= set(ops)


# ---- hypothesis -------------------------------------------------------------------------------

@pytest.mark.parametrize("target", targets())
def test_hypothesis_row_alone_equals_row_in_batch(target):
    """A searched (M, n, row, op, layout): the row alone has the bits it has in the batch, and
    a transposed batch those of its contiguous copy; fp32 results are close to fp64."""
    small = target.small  # the interpreter: fewer and smaller batches, fp32 only
    m_max = 20 if small else 40

    @settings(deadline=None, derandomize=True, max_examples=15 if small else 60)
    @given(m=st.integers(1, m_max), n=st.integers(1, 200 if small else 300),
           row=st.integers(0, m_max - 1),
           dtype=st.just(torch.float32) if small else st.sampled_from(DTYPES),
           op=st.sampled_from(OPS), transposed=st.booleans())
    def check(m, n, row, dtype, op, transposed):
        gen = torch.Generator().manual_seed(m * 1000 + n)
        x = (torch.randn(n, m, generator=gen).t() if transposed else
             torch.randn(m, n, generator=gen)).to(dtype) * 3
        row %= m
        fn = ((lambda t: bik.mean(t, -1, backend=target.backend)) if op == "mean" else
              (lambda t: getattr(bik, op)(t, backend=target.backend)))
        full = fn(x)
        assert torch.equal(full[row], fn(x[row:row + 1])[0])
        assert torch.equal(full, fn(x.contiguous()))
        if dtype == torch.float32:
            ref = x.double().mean(-1) if op == "mean" else getattr(torch, op)(x.double(), -1)
            assert torch.allclose(full.double(), ref, atol=1e-5, rtol=1e-5)

    check()


# ---- GPU (skipped without CUDA) ---------------------------------------------------------------

@pytest.mark.parametrize("target", targets("gpu-triton"))
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_rows_invariant_and_accurate(target, dtype):
    """The compiled Triton kernels at real sizes: every row at M up to 4096 equals the row alone
    (one chunk, several chunks, a Llama-3 vocabulary), and accuracy vs fp64 on the device."""
    b = target.backend
    ms = (1, 2, 3, 4, 7, 8, 16, 31, 64, 127, 128, 255, 256, 1000, 4096)
    assert_invariant(reduction_suite(device=target.device, dtype=dtype, backend=b, ms=ms,
                                     lengths=(111, 4096)))
    assert_invariant(reduction_suite(device=target.device, dtype=dtype, backend=b,
                                     ms=(1, 2, 8, 64, 300), lengths=(128256,)))
    gen = torch.Generator().manual_seed(0)
    for op in OPS:
        for n in (1, 111, 4096, 128256):
            x = randn(gen, 9, n, dtype=dtype).to(target.device) * 4
            ref = (x.double().mean(-1) if op == "mean" else
                   getattr(torch, op)(x.double(), -1))
            got = bik.mean(x, -1, backend=b) if op == "mean" else getattr(bik, op)(x, backend=b)
            indep = (x.float().mean(-1) if op == "mean" else
                     getattr(torch, op)(x.float(), -1)).to(dtype)
            scale = x.abs().max().item() if op == "mean" else ref.abs().max().item()
            assert max_err(got, ref) <= _bound(indep, ref, dtype, scale), (op, n)


@pytest.mark.parametrize("target", targets("cpu"))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_overlapping_half_rows_give_the_bits_of_a_copy(target, dtype, gen):
    # x.unfold gives rows that overlap (strides (1, 1)); their fp32 upcast comes back with
    # strides (1, 3), which the CPU kernels must not be handed as is.
    x = torch.randn(10, generator=gen).to(dtype).unfold(0, 8, 1)
    for fn in (bik.softmax, bik.log_softmax, bik.mean):
        assert same_bits(fn(x, -1, backend=target.backend),
                         fn(x.contiguous(), -1, backend=target.backend))
