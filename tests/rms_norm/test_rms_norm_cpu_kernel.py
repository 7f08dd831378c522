"""Low-level tests of bik's fixed-order CPU rms_norm kernel (bik/ops/rms_norm/cpu.py over
bik.runtime.cpu_ext, csrc/cpu).

Exactness against the literal reference of the contract (bik/ops/rms_norm/reference.py, the spec
in csrc/cpu/contract.h) for every ISA the CPU runs, H around the 16-lane width, eps and row
strides; bitwise batch invariance and thread-count independence with torch.equal; a loose fp64
accuracy sanity check. The matmul kernel's (and the extension's no-FMA check):
tests/matmul/test_matmul_cpu_kernel.py.
"""

from __future__ import annotations

import pytest
import torch
from bik.ops._define import DECLARED
from bik.ops.rms_norm.cpu import launch_rms_norm
from bik.ops.rms_norm.reference import rms_norm_cpu_reference
from bik.runtime import cpu_ext

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason=cpu_ext.unavailable_reason())

ISAS = [i for i in ("avx512", "avx2", "generic")
        if cpu_ext.available() and cpu_ext._ext.isa_supported(i)]
BATCHES = (2, 3, 4, 7, 8, 16, 31, 64, 127, 128, 255, 256)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


Args = DECLARED["rms_norm"].Args


def rms(x, w, eps=1e-6, **kw) -> torch.Tensor:
    out = torch.full(x.shape, float("nan"))
    launch_rms_norm(Args(x, w, eps), out, **kw)
    return out


# ---- exactness against the contract ------------------------------------------------------------


@pytest.mark.parametrize("H", (1, 15, 16, 17, 111, 500))
@pytest.mark.parametrize("isa", ISAS)
def test_rms_norm_matches_contract(H, isa):
    g = _gen(H)
    x = torch.randn(9, H, generator=g) * 3
    w = torch.randn(H, generator=g)
    for eps in (1e-6, 1e-5, 0.1):
        assert torch.equal(rms(x, w, eps, isa=isa), rms_norm_cpu_reference(x, w, eps)), (H, eps)


def test_rms_norm_row_stride_and_empty():
    g = _gen(3)
    big = torch.randn(8, 300, generator=g)
    x = big[:, 10:121]  # row stride 300, unit stride along H
    w = torch.randn(111, generator=g)
    assert torch.equal(rms(x, w), rms_norm_cpu_reference(x.contiguous(), w, 1e-6))
    assert rms(torch.empty(0, 4), torch.ones(4)).shape == (0, 4)
    assert rms(torch.empty(3, 0), torch.ones(0)).shape == (3, 0)


# ---- batch invariance (bitwise) --------------------------------------------------------------


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


# ---- accuracy sanity vs fp64 ---------------------------------------------------------------


def test_rms_norm_accuracy_vs_fp64():
    g = _gen(9)
    x = torch.randn(17, 4096, generator=g)
    wn = torch.rand(4096, generator=g) + 0.5
    exact = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * wn
    assert (rms(x, wn).double() - exact).abs().max().item() < 1e-4


# ---- bf16 rows straight into the kernel ----------------------------------------------------------


def _fp32_path(x, w, eps, residual=None):
    """What the launcher did for bf16 before rms_norm_bf16: h = x + residual in fp32 rounded to
    bf16, the fp32 kernel on the widened row, one rounding of the result."""
    h = x if residual is None else (x.float() + residual.float()).bfloat16()
    out = torch.empty(x.shape)
    launch_rms_norm(Args(h.float(), w.float(), eps), out)
    return out.bfloat16(), h


def _same_bits(a, b) -> bool:
    """bf16 bit patterns equal, any NaN matching any NaN (payloads are not the contract's)."""
    same = a.view(torch.int16) == b.view(torch.int16)
    return bool((same | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("H", (1, 17, 576, 1000))
@pytest.mark.parametrize("isa", ISAS)
def test_bf16_rows_give_the_fp32_paths_bits(H, isa):
    g = _gen(H + 7)
    m = 70
    x = (torch.randn(m, H, generator=g) * 3).bfloat16()
    res = torch.randn(m, H, generator=g).bfloat16()
    w = torch.randn(H, generator=g).bfloat16()
    x[3, 0], x[5, -1], res[7, 0] = float("nan"), float("inf"), float("-inf")
    x[9] = 0  # an all-zero row: rstd = 1/sqrt(eps)
    fused = DECLARED["fused_add_rms_norm"].Args
    for threads in (1, 2):
        out = torch.empty(m, H, dtype=torch.bfloat16)
        launch_rms_norm(Args(x, w, 1e-5), out, num_threads=threads, isa=isa)
        assert _same_bits(out, _fp32_path(x, w, 1e-5)[0])
        out, h = torch.empty_like(x), torch.empty_like(x)
        launch_rms_norm(fused(x=x, residual=res, weight=w, eps=1e-5), out, h,
                        num_threads=threads, isa=isa)
        want, want_h = _fp32_path(x, w, 1e-5, res)
        assert _same_bits(out, want) and _same_bits(h, want_h)
    # the control: one rounding fewer (h kept in fp32) is other bits, which this check sees
    h32 = x.float() + res.float()
    out32 = torch.empty(m, H)
    launch_rms_norm(Args(h32, w.float(), 1e-5), out32)
    assert H == 1 or not _same_bits(out, out32.bfloat16())
