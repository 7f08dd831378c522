"""The CPU's bf16 dot path: contract.h's bf16 dot sequence (csrc/cpu/matmul_bf16_dot.h: an FMA
kernel per ISA under DAZ/FTZ, and a vdpbf16ps one), its two transcriptions (reference.py in
torch, dot_reference.h in g++ scalar code), the start-up self-test, and every route taking it.

Where the CPU has the instructions (FMA; AVX512_BF16 for vdpbf16ps) these tests fail rather
than skip when a kernel is refused; elsewhere the kernels' tests skip and the transcriptions'
still run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import bik
import pytest
import torch
import torch.nn.functional as F
from bik.configs import MatmulSplit, matmul_split
from bik.ops.matmul.reference import (bf16_dot_step, matmul_bf16_dot_reference,
                                      matmul_contract_reference)
from bik.runtime import cpu_ext
from checks import alone_rows, bits_equal as _bits_equal, cpu_flags, first_bad_m

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason=cpu_ext.unavailable_reason())


FLAGS = cpu_flags()
# (isa, dot kernel, the CPU flags it needs): every kernel of the contract this build has
KERNELS = [("avx512", "fma", {"avx512f", "fma"}), ("avx2", "fma", {"avx2", "fma"}),
           ("avx512", "vdpbf16ps", {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"})]


@pytest.fixture
def dot():
    """The path must run wherever the CPU has FMA: a refusal there fails."""
    if "fma" not in FLAGS:
        pytest.skip("this CPU has no FMA")
    assert cpu_ext.bf16_dot_refusal() == "", cpu_ext.bf16_dot_refusal()
    assert cpu_ext.bf16_dot() and cpu_ext.bf16_contract() in ("dot", "amx+dot"), \
        f"{cpu_ext.BF16_ENV}={os.environ.get(cpu_ext.BF16_ENV)} turned the pair path off"
    return cpu_ext.require()


@pytest.fixture(params=KERNELS, ids=[f"{i}-{k}" for i, k, _ in KERNELS])
def kernel(request, dot):
    """(isa, dot_kernel) of each kernel; one the CPU can run must pass its self-test."""
    isa, name, needs = request.param
    if not needs <= FLAGS:
        pytest.skip(f"this CPU lacks {sorted(needs - FLAGS)}")
    assert cpu_ext.bf16_dot_refusal(name) == "", cpu_ext.bf16_dot_refusal(name)
    return isa, name


EXPONENTS = (0, 1, 3, 60, 62, 63, 64, 65, 66, 120, 125, 127, 128, 131)


def _words(gen: torch.Generator, *shape: int, exponents=EXPONENTS) -> torch.Tensor:
    """bf16 values whose exponents reach the denormals and products near 2^-126 (the flush),
    with both signs, plus ordinary ones."""
    exps = torch.tensor(exponents)
    e = exps[torch.randint(0, len(exps), shape, generator=gen)]
    sign = torch.randint(0, 2, shape, generator=gen) << 15
    bits = sign | (e << 7) | torch.randint(0, 128, shape, generator=gen)
    return bits.to(torch.int16).view(torch.bfloat16)


def _normal(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(torch.bfloat16)


def _scalar_reference(a, b, bias, split: int, *, sequence: str = "dot") -> torch.Tensor:
    """dot_reference.h (or, ``sequence`` "amx", amx_reference.h; g++ scalar code) on a [M, K]
    and b [K, N] with any strides."""
    m, k = a.shape
    n = b.shape[1]
    out = torch.empty(m, n)
    bias32 = None if bias is None else bias.float().contiguous()
    getattr(cpu_ext.require(), f"matmul_bf16_{sequence}_reference")(
        a.data_ptr(), a.stride(0), a.stride(1), b.data_ptr(), b.stride(0), b.stride(1),
        0 if bias32 is None else bias32.data_ptr(), out.data_ptr(), n, m, n, k, split)
    return out


def _kernel(a, b, bias, split: int, *, threads: int = 2, block_k: int = 0,
            block_n: int = 0, kernel=("auto", "fma")) -> torch.Tensor:
    m, k = a.shape
    n = b.shape[1]
    out = torch.full((m, n), float("nan"))
    bias32 = None if bias is None else bias.float().contiguous()
    isa, name = kernel
    cpu_ext.require().matmul_f32(
        a.data_ptr(), a.stride(0), a.stride(1), b.data_ptr(), b.stride(0), b.stride(1),
        0 if bias32 is None else bias32.data_ptr(), out.data_ptr(), n, m, n, k, split, threads,
        isa, block_k, block_n, True, 1, 0, 0, 0, 0, True, name)
    return out


# ---- the two transcriptions agree (any CPU) ---------------------------------------------------


@pytest.mark.parametrize("m,n,k,split", [(7, 35, 45, 45), (7, 35, 45, 16), (3, 5, 1, 1),
                                         (4, 40, 100, 7), (2, 3, 0, 1), (5, 9, 64, 64)])
def test_the_torch_and_scalar_transcriptions_agree(m, n, k, split):
    g = torch.Generator().manual_seed(m * 1000 + k)
    a, b = _words(g, m, k), _words(g, k, n)
    bias = _normal(g, n)
    torch_ref = matmul_bf16_dot_reference(a, b, bias, MatmulSplit(1, split))
    assert _bits_equal(torch_ref, _scalar_reference(a, b, bias, split))


def test_the_step_rounds_once_and_flushes_after_rounding():
    tiny = torch.tensor(2.0**-76, dtype=torch.bfloat16)
    p = torch.tensor(2.0**-126)
    # 2^-126 - 2^-152 rounds up to 2^-126 at 24 bits: not tiny after rounding, so it is kept.
    assert bf16_dot_step(p, tiny, -tiny).item() == 2.0**-126
    # a result below 2^-126 flushes to a zero of its sign
    got = bf16_dot_step(torch.tensor(0.0), tiny, -tiny)
    assert got.item() == 0 and torch.signbit(got)
    # a denormal bf16 input reads as zero (2^-130 is a bf16 denormal)
    den = torch.tensor(2.0**-130, dtype=torch.bfloat16)
    assert bf16_dot_step(torch.tensor(1.0), den, torch.tensor(2.0**100, dtype=torch.bfloat16)) == 1


# ---- the kernel equals the transcription ------------------------------------------------------


def _layouts(b: torch.Tensor):
    """b [K, N] row-major, as a weight's transpose (K unit stride), and with no unit stride."""
    k, n = b.shape
    yield "row-major", b
    yield "weight.t()", b.t().contiguous().t()
    wide = torch.zeros(k, 2 * n, dtype=b.dtype)
    wide[:, ::2] = b
    yield "strided", wide.t().contiguous().t()[:, ::2]


@pytest.mark.parametrize("m", (1, 3, 6, 7, 13, 100))
@pytest.mark.parametrize("n,k", [(1, 1), (17, 2), (33, 45), (64, 64), (100, 131), (40, 1100)])
def test_kernel_equals_the_transcription(kernel, m, n, k):
    g = torch.Generator().manual_seed(m * 7919 + n * 31 + k)
    a, b, bias = _words(g, m, k), _words(g, k, n), _normal(g, n)
    for split in {k, 16, 7, 512}:
        want = _scalar_reference(a, b, bias, split)
        for name, bl in _layouts(b):
            assert _bits_equal(_kernel(a, bl, bias, split, kernel=kernel), want), (name, split)
        a_strided = a.t().contiguous().t()  # K with stride M
        assert _bits_equal(_kernel(a_strided, b, None, split, threads=1, block_k=6, block_n=48,
                                   kernel=kernel), _scalar_reference(a, b, None, split)), split


def test_a_packed_weight_in_each_isas_panels(kernel):
    isa, name = kernel
    g = torch.Generator().manual_seed(9)
    n, k, split = 70, 1100, 512
    w, x = _words(g, n, k), _words(g, 5, k)
    ext = cpu_ext.require()
    nrw = ext.matmul_panel_width(isa)
    panels = torch.zeros(-(-n // nrw) * ext.matmul_dot_pair_rows(k, split) * nrw,
                         dtype=torch.int32)
    ext.matmul_pack_b_pairs(w.data_ptr(), 1, k, k, n, split, isa, panels.data_ptr())
    out = torch.full((5, n), float("nan"))
    ext.matmul_f32(x.data_ptr(), k, 1, 0, 0, 0, 0, out.data_ptr(), n, 5, n, k, split, 2, isa,
                   b_bf16=True, packed=panels.data_ptr(), a_bf16=True, dot_kernel=name)
    assert _bits_equal(out, _scalar_reference(x, w.t(), None, split))


def test_kernel_with_k_blocks_threads_and_batch_entries(kernel, dot):
    g = torch.Generator().manual_seed(5)
    m, n, k = 70, 130, 1100
    a, b = _words(g, m, k), _words(g, k, n)
    want = _scalar_reference(a, b, None, 512)
    for threads, block_k, block_n in [(1, 0, 0), (2, 0, 0), (2, 10, 64), (1, 2, 32), (2, 3, 96)]:
        got = _kernel(a, b, None, 512, threads=threads, block_k=block_k, block_n=block_n,
                      kernel=kernel)
        assert _bits_equal(got, want), (threads, block_k, block_n)
    # three batch entries in one call (bmm's route), each its own product
    a3, b3 = _normal(g, 3, 9, 45), _normal(g, 3, 45, 20)
    out = torch.full((3, 9, 20), float("nan"))
    dot.matmul_f32(a3.data_ptr(), 45, 1, b3.data_ptr(), 20, 1, 0, out.data_ptr(), 20, 9, 20, 45,
                   45, 2, kernel[0], 0, 0, True, 3, 9 * 45, 45 * 20, 9 * 20, 0, True, kernel[1])
    for e in range(3):
        assert _bits_equal(out[e], _scalar_reference(a3[e], b3[e], None, 45)), e


def test_a_split_of_odd_length_turns_a_negative_zero_partial_into_plus_zero(kernel):
    # -2^-70 * 2^-70 = -2^-140 flushes to -0; the zero half of the odd pair then adds +0.
    a = torch.tensor([[-(2.0**-70)]], dtype=torch.bfloat16)
    b = torch.tensor([[2.0**-70]], dtype=torch.bfloat16)
    got = _kernel(a, b, None, 1, kernel=kernel)
    assert got.view(torch.int32).item() == 0  # +0.0
    assert not torch.signbit(_scalar_reference(a, b, None, 1)).item()
    # two terms (an even split) keep the -0
    a2, b2 = a.repeat(1, 2), b.repeat(2, 1)
    assert torch.signbit(_kernel(a2, b2, None, 2, kernel=kernel)).item()


# ---- the self-test's probe pins the instruction's semantics -------------------------------------


def _variant(a, b, split: int, *, pairs_reversed=False, tiny_before_rounding=False,
             gradual=False, sign_lost=False) -> torch.Tensor:
    """The bf16 dot sequence with one thing changed (what a different instruction would do)."""

    def step(p, x, y):
        if sign_lost:  # a broadcast that adds +0: -0 and, under DAZ, negative denormals lose
            x = torch.where(x == 0, torch.zeros_like(x), x)  # their sign
        if gradual:  # no denormal flush in or out: fp64 then one fp32 rounding
            return (p.double() + x.double() * y.double()).float()
        s = p.double() + x.double() * y.double()
        out = bf16_dot_step(p, x, y)
        if tiny_before_rounding:
            out = torch.where((s.abs() < 2.0**-126) & (s != 0),
                              torch.copysign(torch.zeros_like(out), s.float()), out)
        return out

    zero = torch.zeros((), dtype=torch.bfloat16)
    m, k = a.shape
    total = None
    for lo in range(0, max(k, 1), split):
        hi = min(lo + split, k)
        p = torch.zeros(m, b.shape[1])
        for kk in range(lo, hi, 2):
            terms = [(a[:, kk:kk + 1], b[kk:kk + 1, :])]
            terms.append((a[:, kk + 1:kk + 2], b[kk + 1:kk + 2, :]) if kk + 1 < hi else (zero, zero))
            for x, y in (terms[::-1] if pairs_reversed else terms):
                p = step(p, x, y)
        total = p if total is None else total + p
    return total


@pytest.mark.parametrize("change", ["contract", "pairs_reversed", "tiny_before_rounding",
                                    "gradual", "sign_lost", "widen"])
def test_the_probe_tells_the_contract_from_what_other_hardware_would_do(change):
    """The self-test refuses a kernel that differs from the transcription on its probe. Each
    sequence other hardware could run (the pair's other order, tininess judged before rounding,
    no flushing, the fp32 sequence) differs from the contract on the probe, so such hardware
    would be refused; and every kernel this CPU runs is the contract on it (which also pins
    what vdpbf16ps and FMA under DAZ / FTZ do here)."""
    differs = []  # the self-test refuses a kernel on any (probe, split) that differs
    for probe in cpu_ext.require().bf16_dot_probe():
        differs += _probe_case(probe, change)
    assert change == "contract" or any(differs), change


def _probe_case(probe: dict, change: str) -> list[bool]:
    m, n, k = probe["M"], probe["N"], probe["K"]
    a = torch.tensor(probe["a"], dtype=torch.int32).short().view(torch.bfloat16).reshape(m, k)
    b = torch.tensor(probe["b"], dtype=torch.int32).short().view(torch.bfloat16).reshape(k, n)
    differs = []
    for split in probe["splits"]:
        contract = _scalar_reference(a, b, None, split)
        if change == "contract":
            for isa, name, needs in KERNELS:
                if needs <= FLAGS:
                    got = _kernel(a, b, None, split, kernel=(isa, name))
                    assert _bits_equal(got, contract), (isa, name)
            continue
        if change == "widen":
            other = matmul_contract_reference(a, b, None, MatmulSplit(1, split))
        else:
            other = _variant(a, b, split, **{change: True})
        differs.append(not _bits_equal(other, contract))
    return differs


# ---- routes ---------------------------------------------------------------------------------------


def _process_reference(a, b, bias, split: int, *, bmm: bool = False) -> torch.Tensor:
    """The transcription of this process's bf16 sequence for a 2-D product (AMX's where it
    runs, the default; else the dot one) or, ``bmm``, for a bmm (always the dot one)."""
    amx = cpu_ext.bf16_contract() == "amx+dot" and not bmm
    return _scalar_reference(a, b, bias, split, sequence="amx" if amx else "dot")


def _contract_bf16(x2d, w, bias=None) -> torch.Tensor:
    """bik.linear's bits on this process's pair path: its transcription, rounded once to
    bf16."""
    n, k = w.shape
    split = matmul_split(torch.bfloat16, n, k).split
    return _process_reference(x2d, w.t(), bias, split).to(torch.bfloat16)


def test_every_route_takes_the_process_bf16_sequence(dot):
    """Every route on this process's sequences: 2-D products on AMX's where it runs (the
    default), else the dot one, and bmm on the dot one
    (tests/matmul/test_matmul_bf16_amx.py runs the routes with BIK_CPU_BF16=dot in a child)."""
    g = torch.Generator().manual_seed(11)
    x, w, bias = _normal(g, 5, 4096), _normal(g, 40, 4096), _normal(g, 40)  # 8 splits of 512
    want = _contract_bf16(x, w, bias)
    assert torch.equal(bik.linear(x, w, bias), want)
    assert torch.equal(bik.PackedWeight(w)(x, bias), want)
    assert torch.equal(bik.PackedWeight(w.t().contiguous().t())(x, bias), want)  # strided W
    assert torch.equal(bik.matmul(x, w.t()), _contract_bf16(x, w))
    xb, wb = _normal(g, 3, 6, 64), _normal(g, 3, 64, 9)
    bmm = bik.bmm(xb, wb)
    for e in range(3):
        assert torch.equal(bmm[e], _process_reference(xb[e], wb[e], None, 64, bmm=True)
                           .to(torch.bfloat16))
    bik.enable()
    try:
        assert torch.equal(F.linear(x, w, bias), want)  # addmm
        assert torch.equal(x @ w.t(), _contract_bf16(x, w))  # mm
        assert torch.equal(torch.bmm(xb, wb), bmm)
        xg = x.clone().requires_grad_(True)
        F.linear(xg, w).backward(torch.ones(5, 40, dtype=torch.bfloat16))
        grad = xg.grad
    finally:
        bik.disable()
    ones = torch.ones(5, 40, dtype=torch.bfloat16)
    assert torch.equal(grad, _process_reference(ones, w, None, matmul_split(
        torch.bfloat16, 4096, 40).split).to(torch.bfloat16))  # grad_x = grad @ W


def test_rows_alone_equal_batched_and_stock_bf16_differs(dot):
    g = torch.Generator().manual_seed(3)
    w = _normal(g, 576, 1536)
    pool = _normal(g, 130, 1536)
    packed = bik.PackedWeight(w)
    for fn in (lambda rows: bik.linear(rows, w), packed):
        assert first_bad_m(fn, pool, alone_rows(fn, pool)) is None

    # The harness catches a batch-dependent product: the fp32 sequence alone, the dot one batched.
    def dependent(rows):
        return bik.linear(rows, w) if rows.shape[0] > 1 else \
            F.linear(rows.float(), w.float()).to(torch.bfloat16)

    assert first_bad_m(dependent, pool, alone_rows(dependent, pool)) is not None
    # Stock bf16 F.linear, measured here (oneDNN: AMX or AVX-512 by size): where it varies with
    # the batch, the same check sees it.
    stock = lambda rows: F.linear(rows, w)  # noqa: E731
    stock_bad = first_bad_m(stock, pool, alone_rows(stock, pool))
    if stock_bad is None:
        pytest.skip("stock bf16 F.linear was batch-invariant on this CPU (the control above ran)")
    assert stock_bad >= 2


def test_widen_keeps_the_fp32_sequence_and_the_fingerprint_says_so(dot):
    g = torch.Generator().manual_seed(2)
    # Ordinary values give the same bits on both sequences (below); values near the flush
    # threshold do not, which makes the comparison in the child able to fail.
    near = (60, 62, 63, 64, 65, 66)  # products around 2^-126, sums too
    x, w = _words(g, 32, 1536, exponents=near), _words(g, 256, 1536, exponents=near)
    plan = matmul_split(torch.float32, *w.shape)
    widened = matmul_contract_reference(x, w.t(), None, plan, fma=cpu_ext.fp32_fma())
    assert not torch.equal(bik.linear(x, w), widened.bfloat16())
    code = ("import torch, bik, sys\n"
            "x, w, want = torch.load(sys.argv[1])\n"
            "f = bik.fingerprint('cpu')\n"
            "print(torch.equal(bik.linear(x, w), want), torch.equal(bik.PackedWeight(w)(x), want),"
            " f.versions['cpu_bf16'], f.digest)\n")
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"bik-widen-{os.getpid()}.pt"
    torch.save((x, w, widened.bfloat16()), path)
    try:
        env = dict(os.environ, **{cpu_ext.BF16_ENV: "widen"})
        res = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                             text=True, env=env, timeout=120, check=False)
        bad = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                             text=True, env=dict(env, **{cpu_ext.BF16_ENV: "fp8"}), timeout=120,
                             check=False)
    finally:
        path.unlink(missing_ok=True)
    assert res.returncode == 0, res.stderr
    same, same_packed, contract, digest = res.stdout.split()
    assert (same, same_packed, contract) == ("True", "True", "widen")
    assert digest != bik.fingerprint("cpu").digest
    assert bik.fingerprint("cpu").versions["cpu_bf16"] in ("dot", "amx+dot")
    assert "BIK_CPU_BF16='fp8'; expected 'auto', 'amx', 'dot' or 'widen'" in bad.stderr


def test_ordinary_values_give_the_fp32_sequences_bits():
    """A bf16 x bf16 product is exact in fp32, so where no product or partial sum falls below
    2^-126 the instruction's fused add rounds exactly where the fp32 sequence's add rounds: the
    two contracts differ only near the flush threshold (and in a -0 partial of an odd split).
    Checked on the transcription, so on any CPU."""
    g = torch.Generator().manual_seed(4)
    x, w = _normal(g, 16, 1536), _normal(g, 96, 1536)
    plan = matmul_split(torch.float32, *w.shape)
    assert torch.equal(_scalar_reference(x, w.t(), None, plan.split),
                       matmul_contract_reference(x, w.t(), None, plan))


def test_a_bf16_result_is_rounded_as_torch_rounds_it(dot):
    """The kernel rounds a bf16 result itself (no fp32 pass over it): the bits are the fp32
    result's (``out_dtype=torch.float32``) rounded by torch's ``.to(torch.bfloat16)``, NaN's
    pattern included. K = 2 products of words with few exponents put many results on a tie or
    next to one, a bias moves them off, inf and NaN rows give inf and NaN results; on each way
    the kernel writes: AMX's weight rows (up to 128 rows where AMX runs), the pair panels
    (129 rows; a PackedWeight's at every M), bmm's batch entries (the dot sequence), and
    through bik.enable()'s dispatcher kernels and PackedWeight's C++ route (C ABI 6's c_bf16)."""
    g = torch.Generator().manual_seed(8)
    narrow = (125, 126, 127, 128, 129, 254)
    w, bias = _words(g, 80, 2, exponents=narrow), torch.randn(80, generator=g).bfloat16()
    for m in (5, 129):
        x = _words(g, m, 2, exponents=narrow)
        x[0, 0], x[1, 1], x[2] = float("inf"), float("nan"), 0.0
        for b in (None, bias):
            got = bik.linear(x, w, b)
            want = bik.linear(x, w, b, out_dtype=torch.float32).to(torch.bfloat16)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (m, b is None)
            packed = bik.PackedWeight(w)
            assert torch.equal(packed(x, b).view(torch.int16), want.view(torch.int16))
            with bik.enabled():  # the dispatcher's addmm / mm and PackedWeight's C++ route
                mode = F.linear(x, w, b)
                assert torch.equal(packed(x, b).view(torch.int16), want.view(torch.int16))
            assert torch.equal(mode.view(torch.int16), want.view(torch.int16)), (m, b is None)
            assert got.isnan().any() and got.isinf().any()
    xb, wb = _words(g, 3, 6, 2, exponents=narrow), _words(g, 3, 2, 40, exponents=narrow)
    assert torch.equal(bik.bmm(xb, wb).view(torch.int16),
                       bik.bmm(xb, wb, out_dtype=torch.float32).bfloat16().view(torch.int16))
    # A strided bf16 out (a tensor-parallel shard's columns): the same bits, where torch's
    # strided copy from fp32 would write NaN otherwise (measured here, so this could fail).
    from bik.ops.matmul.op import matmul_shard

    want = bik.linear(x, w, out_dtype=torch.float32)
    wide = torch.zeros(x.shape[0], 2 * w.shape[0], dtype=torch.bfloat16)
    matmul_shard(x[None], w.t()[None], None, wide[None, :, ::2], layer=tuple(w.shape),
                 backend="cpu")
    assert torch.equal(wide[:, ::2].view(torch.int16), want.bfloat16().view(torch.int16))
    torch_copy = torch.zeros_like(wide)
    torch_copy[:, ::2].copy_(want)
    assert not torch.equal(torch_copy[:, ::2].view(torch.int16), want.bfloat16().view(torch.int16))
