"""The CPU's fp32 fma sequence: contract.h's ``p = fma(a[m,k], b[k,n], p)`` (csrc/cpu/kernels_isa.h's
Fma32 kernels per ISA), its two transcriptions (reference.py's ``fma_step`` in torch,
fma_reference.h in g++ scalar code, neither using an FMA instruction), exact rational rounding
as their judge, the start-up self-test, ``BIK_CPU_FP32=mul-add``, and every route taking the
process's sequence.

Where the CPU has FMA these tests fail rather than skip when the kernel is refused; elsewhere
the kernels' tests skip and the transcriptions' still run.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from fractions import Fraction

import bik
import pytest
import torch
import torch.nn.functional as F
from bik.configs import MatmulSplit, matmul_split
from bik.ops.matmul.cpu import matmul_f32
from bik.ops.matmul.reference import fma_step, matmul_contract_reference
from bik.runtime import cpu_ext
from checks import alone_rows, bits_equal as _bits_equal, child_with, cpu_flags, first_bad_m

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason=cpu_ext.unavailable_reason())

ISAS = [i for i in ("avx512", "avx2", "generic")
        if cpu_ext.available() and cpu_ext._ext.isa_supported(i)]


@pytest.fixture
def fma():
    """The sequence must run wherever the CPU has FMA: a refusal there fails."""
    if "fma" not in cpu_flags():
        pytest.skip("this CPU has no FMA")
    assert cpu_ext.fp32_fma_refusal() == "", cpu_ext.fp32_fma_refusal()
    assert cpu_ext.fp32_fma() and cpu_ext.fp32_contract() == "fma", \
        f"{cpu_ext.FP32_ENV}={os.environ.get(cpu_ext.FP32_ENV)} turned the sequence off"


def _floats(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """fp32 values whose exponents reach the denormals, the overflow range and ordinary sizes,
    both signs."""
    exps = torch.tensor([0, 1, 2, 40, 100, 120, 126, 127, 128, 131, 150, 200, 254])
    e = exps[torch.randint(0, len(exps), shape, generator=gen)]
    sign = torch.randint(0, 2, shape, generator=gen) << 31
    bits = sign | (e << 23) | torch.randint(0, 1 << 23, shape, generator=gen)
    return bits.to(torch.int32).view(torch.float32)


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def _round_exact(v: Fraction) -> float:
    """The fp32 nearest to the rational v, ties to even (no overflow: |v| < 2^128 here)."""
    x = _f32(float(v))  # float(v) is v rounded once; the fp32 candidates are around it
    cands = {x, float(torch.nextafter(torch.tensor(x), torch.tensor(float("inf")))),
             float(torch.nextafter(torch.tensor(x), torch.tensor(float("-inf"))))}
    cands = [c for c in cands if abs(c) != float("inf")]

    def key(c):
        mantissa_odd = struct.unpack("I", struct.pack("f", c))[0] & 1
        return abs(Fraction(c) - v), mantissa_odd

    return min(cands, key=key)


def _scalar_reference(a, b, bias, split: int) -> torch.Tensor:
    """fma_reference.h (g++ scalar code) on a [M, K] and b [K, N] with any strides."""
    m, k = a.shape
    n = b.shape[1]
    out = torch.empty(m, n)
    bias32 = None if bias is None else bias.contiguous()
    cpu_ext.require().matmul_fp32_fma_reference(
        a.data_ptr(), a.stride(0), a.stride(1), b.data_ptr(), b.stride(0), b.stride(1),
        0 if bias32 is None else bias32.data_ptr(), out.data_ptr(), n, m, n, k, split)
    return out


# The trap of rounding an exact fp64 sum to fp32: p = 1 + 2^-23 and a*b = 2^-24 - 2^-70 put
# p + a*b just below the midpoint of 1 + 2^-23 and 1 + 2^-22; in fp64 the sum rounds onto that
# midpoint, and from there to fp32 the tie goes to even, 1 + 2^-22, where fma gives 1 + 2^-23.
TRAP = (1 + 2**-23, 1 + 2**-23, 2**-24 - 2**-47)


# ---- the transcriptions (any CPU) ---------------------------------------------------------------


def test_the_step_is_exact_rounding_on_hard_values():
    """fma_step against Fraction arithmetic: random words over the whole exponent range, the
    double-rounding trap both ways, cancellations to zero and the overflow edge."""
    g = torch.Generator().manual_seed(0)
    p, a, b = (_floats(g, 3000) for _ in range(3))
    cases = list(zip(p.tolist(), a.tolist(), b.tolist()))
    cases += [TRAP, (-TRAP[0], TRAP[1], -TRAP[2]), (1.0, 1 + 2**-12, 1 + 2**-12),
              (-1.0, 1 + 2**-12, 1 + 2**-12), (1.0, 1.0, -1.0), (-0.0, 2.0**-149, -2.0**-149),
              (_f32(3.4028234663852886e38), 2.0**103, 1.0 - 2**-24)]
    pt, at, bt = (torch.tensor(c, dtype=torch.float32) for c in zip(*cases))
    got = fma_step(pt, at, bt)
    for i, (pi, ai, bi) in enumerate(cases):
        v = Fraction(pi) + Fraction(ai) * Fraction(bi)
        if abs(v) >= 2**128 - 2**103:
            want = float("inf") if v > 0 else float("-inf")
        elif v == 0:
            want = float(torch.tensor(pi) + torch.tensor(ai) * torch.tensor(bi))  # IEEE's sign
        else:
            want = _round_exact(v)
        assert _bits_equal(got[i:i + 1], torch.tensor([want])), (pi, ai, bi, got[i].item(), want)
    # the trap: fma's answer, which rounding the fp64 sum to fp32 misses
    naive = (pt[-7].double() + at[-7].double() * bt[-7].double()).float()
    assert got[-7].item() == 1 + 2**-23 and naive.item() == 1 + 2**-22


@pytest.mark.parametrize("m,n,k,split", [(7, 35, 45, 45), (7, 35, 45, 16), (3, 5, 1, 1),
                                         (4, 40, 100, 7), (2, 3, 0, 1), (5, 9, 64, 64)])
def test_the_torch_and_scalar_transcriptions_agree(m, n, k, split):
    g = torch.Generator().manual_seed(m * 1000 + k)
    a, b, bias = _floats(g, m, k), _floats(g, k, n), _floats(g, n)
    want = matmul_contract_reference(a, b, bias, MatmulSplit(1, split), fma=True)
    assert _bits_equal(_scalar_reference(a, b, bias, split), want)
    assert _bits_equal(_scalar_reference(a, b.t().contiguous().t(), None, split),
                       matmul_contract_reference(a, b, None, MatmulSplit(1, split), fma=True))


# ---- the kernels ---------------------------------------------------------------------------------


@pytest.mark.parametrize("isa", ISAS)
def test_kernel_equals_the_transcription_on_hard_words(fma, isa):
    """Every ISA's kernel, B as a weight's transpose, row-major, strided and broadcast, K blocks,
    splits and threads, on words over the whole exponent range (denormals, overflow, NaN)."""
    g = torch.Generator().manual_seed(5)
    for m, n, k, split in ((7, 35, 45, 45), (7, 35, 45, 16), (13, 70, 301, 64), (1, 1, 1, 1)):
        a, w, bias = _floats(g, m, k), _floats(g, n, k), _floats(g, n)
        wide = _floats(g, k, 2 * n)
        for b in (w.t(), w.t().contiguous(), wide[:, ::2], w.t()[:, :1].expand(k, n)):
            want_b = _scalar_reference(a, b, bias, split)
            for block_k, threads in ((0, 2), (16, 1), (5, 3)):
                out = torch.full((m, n), float("nan"))
                matmul_f32(a, b, bias, out, split=split, isa=isa, block_k=block_k,
                           num_threads=threads, fp32_fma=True)
                assert _bits_equal(out, want_b), (isa, m, n, k, split, b.stride(), block_k)


def test_a_bf16_weight_packed_and_batched(fma):
    """A bf16 B widened in the kernel's packing, a PackedWeight's panels and batch entries run
    the same sequence (the transcription on the widened values)."""
    g = torch.Generator().manual_seed(6)
    x, w = torch.randn(9, 1536, generator=g), torch.randn(70, 1536, generator=g)
    plan = matmul_split(torch.float32, 70, 1536)  # 8 splits of 192
    want = _scalar_reference(x, w.t(), None, plan.split)
    assert torch.equal(bik.PackedWeight(w)(x), want)
    wb = w.bfloat16()
    got = torch.empty(9, 70)
    ext = cpu_ext.require()
    ext.matmul_f32(x.data_ptr(), 1536, 1, wb.data_ptr(), 1, 1536, 0, got.data_ptr(), 70, 9, 70,
                   1536, plan.split, 2, "auto", 0, 0, True, fp32_fma=True)
    assert torch.equal(got, _scalar_reference(x, wb.float().t(), None, plan.split))
    xb, wb3 = torch.randn(4, 3, 64, generator=g), torch.randn(4, 64, 11, generator=g)
    out = bik.bmm(xb, wb3)
    for e in range(4):
        assert torch.equal(out[e], _scalar_reference(xb[e], wb3[e], None, 64))


@pytest.mark.parametrize("change", ["mul-add", "fp64 then fp32"])
def test_the_probe_tells_fma_from_other_sequences(fma, change):
    """The self-test's probes (which the kernel passes: the fixture) are failed by the mul-add
    sequence, and the trap is failed by rounding an fp64 sum to fp32, so neither could pass
    the self-test as the fma sequence."""
    if change == "mul-add":
        differs = []
        for probe in cpu_ext.require().fp32_fma_probe():
            a = torch.tensor(probe["a"]).view(probe["M"], probe["K"])
            b = torch.tensor(probe["b"]).view(probe["K"], probe["N"])
            for split in probe["splits"]:
                want = _scalar_reference(a, b, None, split)
                out = torch.empty(probe["M"], probe["N"])
                matmul_f32(a, b, None, out, split=split, fp32_fma=False)
                differs.append(not _bits_equal(out, want))
                matmul_f32(a, b, None, out, split=split, fp32_fma=True)
                assert _bits_equal(out, want)
        assert all(differs)
    else:
        a = torch.tensor([[1.0, TRAP[1]]])
        b = torch.tensor([[TRAP[0]], [TRAP[2]]])
        out = torch.empty(1, 1)
        matmul_f32(a, b, None, out, split=2, fp32_fma=True)
        assert out.item() == 1 + 2**-23 == _scalar_reference(a, b, None, 2).item()


# ---- the routes and the process's choice --------------------------------------------------------


def test_every_route_takes_the_fma_sequence(fma):
    g = torch.Generator().manual_seed(11)
    x, w, bias = torch.randn(5, 4096, generator=g), torch.randn(40, 4096, generator=g), \
        torch.randn(40, generator=g)
    split = matmul_split(torch.float32, 40, 4096).split  # 8 splits of 512
    want = _scalar_reference(x, w.t(), bias, split)
    mul_add = matmul_contract_reference(x, w.t(), bias, matmul_split(torch.float32, 40, 4096))
    assert not torch.equal(want, mul_add)  # the routes below could fail
    assert torch.equal(bik.linear(x, w, bias), want)
    assert torch.equal(bik.PackedWeight(w)(x, bias), want)
    assert torch.equal(bik.matmul(x, w.t()), _scalar_reference(x, w.t(), None, split))
    with bik.enabled():
        assert torch.equal(F.linear(x, w, bias), want)  # addmm
        assert torch.equal(x @ w.t(), _scalar_reference(x, w.t(), None, split))  # mm
        xg = x.clone().requires_grad_(True)
        F.linear(xg, w).backward(torch.ones(5, 40))
    ones = torch.ones(5, 40)
    assert torch.equal(xg.grad, _scalar_reference(ones, w, None, matmul_split(
        torch.float32, 4096, 40).split))  # grad_x = grad @ W


def test_rows_alone_equal_batched_and_a_batch_dependent_product_is_caught(fma):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(576, 1536, generator=g)
    pool = torch.randn(130, 1536, generator=g)
    packed = bik.PackedWeight(w)
    for fn in (lambda rows: bik.linear(rows, w), packed):
        assert first_bad_m(fn, pool, alone_rows(fn, pool)) is None

    def dependent(rows):  # the mul-add sequence alone, the fma one batched
        if rows.shape[0] > 1:
            return bik.linear(rows, w)
        out = torch.empty(1, 576)
        matmul_f32(rows, w.t(), None, out, fp32_fma=False)
        return out

    assert first_bad_m(dependent, pool, alone_rows(dependent, pool)) is not None


_CHILD = """
import sys, torch, bik, torch.nn.functional as F
x, w, want = torch.load(sys.argv[1])
f = bik.fingerprint('cpu')
with bik.enabled():
    mode = F.linear(x, w)
print(torch.equal(bik.linear(x, w), want), torch.equal(bik.PackedWeight(w)(x), want),
      torch.equal(mode, want), f.versions['cpu_fp32'], f.digest)
"""


def test_mul_add_keeps_the_other_sequence_and_the_fingerprint_says_so(fma, tmp_path):
    """``BIK_CPU_FP32=mul-add`` (set before the process starts): every route gives the mul-add
    sequence's bits, the fingerprint says so and its digest differs; a bad value is refused
    naming the variable."""
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(6, 1536, generator=g), torch.randn(50, 1536, generator=g)
    want = matmul_contract_reference(x, w.t(), None, matmul_split(torch.float32, 50, 1536))
    assert not torch.equal(bik.linear(x, w), want)  # this process's fma bits differ
    *same, contract, digest = child_with(cpu_ext.FP32_ENV, "mul-add", _CHILD, (x, w, want),
                                         tmp_path)
    assert same == ["True"] * 3 and contract == "mul-add"
    assert digest != bik.fingerprint("cpu").digest
    assert bik.fingerprint("cpu").versions["cpu_fp32"] == "fma"
    bad = subprocess.run([sys.executable, "-c", "import bik; bik.fingerprint('cpu')"],
                         capture_output=True, text=True, timeout=300, check=False,
                         env=dict(os.environ, **{cpu_ext.FP32_ENV: "tf32"}))
    assert bad.returncode != 0
    assert "BIK_CPU_FP32='tf32'; expected 'auto' or 'mul-add'" in bad.stderr
