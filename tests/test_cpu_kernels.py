"""Low-level tests of bik's fixed-order CPU kernels (bik/ops/*/cpu.py over bik.runtime.cpu_ext, csrc/cpu).

Exactness against literal references of the contract (csrc/cpu/contract.h), bitwise batch
invariance with torch.equal, a negative control showing the same comparison catches stock
torch.mm, and a loose fp64 accuracy sanity check.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch
from bik.ops.matmul.cpu import matmul_f32
from bik.ops.rms_norm.cpu import rms_norm_f32
from bik.runtime import cpu_ext

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason=cpu_ext.unavailable_reason())

ISAS = [i for i in ("avx512", "avx2", "generic") if cpu_ext.available() and cpu_ext._ext.isa_supported(i)]
SIZES = (1, 3, 17, 33, 64, 100)
BATCHES = (2, 3, 4, 7, 8, 16, 31, 64, 127, 128, 255, 256)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def ref_matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The contract, literally: acc = acc + a[m,k]*b[k,n], k ascending, each op rounded (fp32
    elementwise torch ops are correctly rounded and do not fuse), then + bias."""
    acc = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float32)
    for k in range(a.shape[1]):
        acc = acc + a[:, k : k + 1] * b[k : k + 1, :]
    return acc if bias is None else acc + bias


def ref_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The contract's 16-lane sum of squares, fold 8/4/2/1, fp32 divide/sqrt, two multiplies."""
    M, H = x.shape
    s = torch.zeros(M, 16, dtype=torch.float32)
    for j in range(H):
        s[:, j % 16] = s[:, j % 16] + x[:, j] * x[:, j]
    for width in (8, 4, 2, 1):
        s[:, :width] = s[:, :width] + s[:, width : 2 * width]
    # Correct rounding, which torch's fp32 CPU ops do not all give: fp32 torch.sqrt is off by an
    # ulp on some inputs (measured, torch 2.13), and division by a 0-dim tensor may become a
    # multiply by its reciprocal. fp64 sqrt/div of fp32 values, rounded once to fp32, is exact.
    total = s[:, 0:1]
    mean = (total.double() / float(H)).float()
    q = mean + torch.full_like(mean, eps)
    rstd = (1.0 / torch.sqrt(q.double()).float().double()).float()
    return (x * rstd) * w


def mm(a, b, bias=None, **kw) -> torch.Tensor:
    out = torch.full((a.shape[0], b.shape[1]), float("nan"))
    matmul_f32(a, b, bias, out, **kw)
    return out


def rms(x, w, eps=1e-6, **kw) -> torch.Tensor:
    out = torch.full(x.shape, float("nan"))
    rms_norm_f32(x, w, eps, out, **kw)
    return out


# ---- exactness against the contract ------------------------------------------------------------


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("M", SIZES)
@pytest.mark.parametrize("N", SIZES)
def test_matmul_matches_contract(isa, M, N):
    for K in SIZES:
        g = _gen(M * 10007 + N * 101 + K)
        a = torch.randn(M, K, generator=g)
        w = torch.randn(N, K, generator=g)  # nn.Linear layout; b = w.t() (K contiguous)
        bias = torch.randn(N, generator=g)
        for b in (w.t(), w.t().contiguous()):
            for bb in (None, bias):
                assert torch.equal(mm(a, b, bb, isa=isa), ref_matmul(a, b, bb)), (M, N, K, bb)


def test_matmul_blocking_and_odd_k_match_contract():
    # K blocks of every size (store/reload of the fp32 acc) and N blocks keep the order exactly.
    g = _gen(1)
    M, N, K = 13, 77, 1000
    a, b, bias = torch.randn(M, K, generator=g), torch.randn(K, N, generator=g), torch.randn(N)
    want = ref_matmul(a, b, bias)
    for bk, bn in ((0, 0), (1, 1), (7, 33), (64, 64), (256, 512), (999, 32), (4096, 4096)):
        for isa in ISAS:
            assert torch.equal(mm(a, b, bias, isa=isa, block_k=bk, block_n=bn), want), (bk, bn)
            assert torch.equal(mm(a, b.t().contiguous().t(), bias, isa=isa, block_k=bk), want)


def test_matmul_empty_and_k0():
    for M, N in ((0, 5), (5, 0), (0, 0)):
        out = torch.empty(M, N)
        matmul_f32(torch.empty(M, 3), torch.empty(3, N), None, out)
    bias = torch.tensor([1.5, -0.0, float("inf")])
    assert torch.equal(mm(torch.empty(2, 0), torch.empty(0, 3)), torch.zeros(2, 3))
    got = mm(torch.empty(2, 0), torch.empty(0, 3), bias)
    assert torch.equal(got, (torch.zeros(2, 3) + bias))  # 0.0f + bias: -0.0 becomes +0.0
    assert not torch.signbit(got[:, 1]).any()


@pytest.mark.parametrize("H", (1, 15, 16, 17, 111, 500))
@pytest.mark.parametrize("isa", ISAS)
def test_rms_norm_matches_contract(H, isa):
    g = _gen(H)
    x = torch.randn(9, H, generator=g) * 3
    w = torch.randn(H, generator=g)
    for eps in (1e-6, 1e-5, 0.1):
        assert torch.equal(rms(x, w, eps, isa=isa), ref_rms_norm(x, w, eps)), (H, eps)


def test_rms_norm_row_stride_and_empty():
    g = _gen(3)
    big = torch.randn(8, 300, generator=g)
    x = big[:, 10:121]  # row stride 300, unit stride along H
    w = torch.randn(111, generator=g)
    assert torch.equal(rms(x, w), ref_rms_norm(x.contiguous(), w, 1e-6))
    rms_norm_f32(torch.empty(0, 4), torch.ones(4), 1e-6, torch.empty(0, 4))
    rms_norm_f32(torch.empty(3, 0), torch.ones(0), 1e-6, torch.empty(3, 0))


# ---- batch invariance (bitwise) --------------------------------------------------------------


@pytest.mark.parametrize("N,K", [(100, 333), (515, 64), (64, 1030)])
def test_matmul_row_alone_equals_row_in_batch(N, K):
    g = _gen(N + K)
    pool = torch.randn(max(BATCHES), K, generator=g)
    w = torch.randn(N, K, generator=g)
    bias = torch.randn(N, generator=g)
    alone = torch.cat([mm(pool[i : i + 1], w.t(), bias) for i in range(pool.shape[0])])
    for M in BATCHES:
        for start in (0, max(BATCHES) - M):  # rows at different positions
            assert torch.equal(mm(pool[start : start + M], w.t(), bias), alone[start : start + M])


def test_matmul_threads_isa_and_layouts_are_bit_identical():
    g = _gen(7)
    M, N, K = 70, 300, 257
    a, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    want = mm(a, w.t().contiguous(), num_threads=1)
    for t in (1, 2, 3, 8):
        for isa in ISAS:
            assert torch.equal(mm(a, w.t(), num_threads=t, isa=isa), want), (t, isa)
    a_t = a.t().contiguous().t()  # column-major a
    a_s = torch.randn(M, 2 * K, generator=g)[:, ::2]  # non-contiguous: stride 2 along K
    a_s_want = mm(a_s.contiguous(), w.t())
    b_s = torch.randn(2 * K, N + 5, generator=g)[::2, 3 : N + 3]  # strided rows, sliced cols
    assert torch.equal(mm(a_t, w.t()), want)
    assert torch.equal(mm(a_s, w.t()), a_s_want)
    assert torch.equal(mm(a, b_s), mm(a, b_s.contiguous()))
    # zero strides (expanded views) on either side
    a_e = a[:1].expand(M, K)
    assert torch.equal(mm(a_e, w.t()), want[:1].expand(M, N))
    b_e = w.t()[:, :1].expand(K, N)
    assert torch.equal(mm(a, b_e), mm(a, b_e.contiguous()))


def test_rms_norm_row_alone_equals_row_in_batch_and_threads():
    g = _gen(11)
    H = 4096
    pool = torch.randn(300, H, generator=g)
    w = torch.randn(H, generator=g)
    alone = torch.cat([rms(pool[i : i + 1], w) for i in range(pool.shape[0])])
    for M in BATCHES:
        assert torch.equal(rms(pool[:M], w), alone[:M])
    for t in (1, 2, 5):
        for isa in ISAS:
            assert torch.equal(rms(pool, w, num_threads=t, isa=isa), alone), (t, isa)


def test_caller_flush_denormal_does_not_change_bits():
    # Products here are denormal; the kernels honour them whatever the caller's FTZ/DAZ.
    a = torch.full((64, 512), 1e-20)
    b = torch.full((512, 256), 1e-20)
    want = ref_matmul(a[:1], b, None)
    assert want.abs().max() > 0
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        got1 = mm(a[:1], b, num_threads=1)
        got = mm(a, b, num_threads=2)
    finally:
        torch.set_flush_denormal(False)
    assert torch.equal(got1, want) and torch.equal(got, want.expand(64, 256))


# ---- negative control: the same comparison catches stock torch.mm -----------------------------


def test_negative_control_torch_mm_is_not_batch_invariant():
    # toolchain notes: CPU fp32 torch.mm gives a row at M=1 other bits than at M>=4.
    g = _gen(5)
    found = []
    for N, K in ((256, 512), (1024, 1024), (4096, 256)):
        pool = torch.randn(64, K, generator=g)
        w = torch.randn(N, K, generator=g)
        alone = torch.cat([torch.mm(pool[i : i + 1], w.t()) for i in range(pool.shape[0])])
        if not torch.equal(torch.mm(pool, w.t()), alone):
            found.append((N, K))
        assert torch.equal(mm(pool, w.t()), torch.cat([mm(p[None], w.t()) for p in pool]))
    assert found, "torch.mm was batch-invariant on every shape: the control cannot fail here"


# ---- accuracy sanity vs fp64 ---------------------------------------------------------------


def test_matmul_and_rms_norm_accuracy_vs_fp64():
    g = _gen(9)
    M, N, K = 33, 200, 2048
    a, w, bias = (torch.randn(M, K, generator=g), torch.randn(N, K, generator=g),
                  torch.randn(N, generator=g))  # fmt: skip
    exact = a.double() @ w.t().double() + bias.double()
    err = (mm(a, w.t(), bias).double() - exact).abs().max().item()
    scale = (a.double().abs() @ w.t().double().abs()).max().item()
    assert err <= 4 * K * 2**-24 * scale, err  # loose sequential-sum bound
    x = torch.randn(17, 4096, generator=g)
    wn = torch.rand(4096, generator=g) + 0.5
    exact = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * wn
    assert (rms(x, wn).double() - exact).abs().max().item() < 1e-4


def test_no_fused_multiply_add_in_binary():
    # -ffp-contract=off must hold in every ISA clone: an FMA would change the bits.
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump not found")
    dis = subprocess.run([objdump, "-d", cpu_ext._ext.__file__], capture_output=True, text=True,
                         check=False)
    assert dis.returncode == 0
    for mnemonic in ("vfmadd", "vfmsub", "vfnmadd", "vfnmsub", "fmla", "fmadd"):
        assert f"\t{mnemonic}" not in dis.stdout, mnemonic


def test_unavailable_reason_is_empty_when_built():
    assert cpu_ext.available() and cpu_ext.unavailable_reason() == ""
    assert cpu_ext.isa() in ISAS
