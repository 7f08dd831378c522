"""GPU tests (skipped without CUDA): every row at every M equals its M = 1 result, bit for bit,
on the real tensor-core dot; accuracy against torch; and a record of whether torch.mm
(cuBLAS) itself varies with M on the same shapes (written to $BIK_GPU_RECORD if set)."""

import json
import os

import bik
import cases
import pytest
import torch
from bik.testing.harness import same_bits
from bik.testing.suites import matmul_suite

pytestmark = pytest.mark.gpu

SHAPES = [(4096, 4096), (1000, 333), (128256 // 8, 4096)]  # (N, K)
M_MAX = 4096
# Every M up to 128, then powers of two, their odd neighbours and a few others up to 4096.
EVERY_M = sorted(set(range(1, 129)) | {p + d for p in (256, 512, 1024, 2048) for d in (-1, 0, 1)}
                 | {1000, 3000, M_MAX - 1, M_MAX})


def _alone(fn, pool):
    return torch.cat([fn(pool[i:i + 1]) for i in range(pool.shape[0])])


def _first_bad_m(fn, pool, alone):
    for m in EVERY_M:
        if not same_bits(fn(pool[:m]), alone[:m]):
            return m
    return None


@pytest.mark.parametrize("dtype", cases.DTYPES)
@pytest.mark.parametrize("shape", SHAPES[:2])
def test_matmul_every_m_equals_m1(dtype, shape):
    n, k = shape
    if dtype == torch.float32 and n * k > 10**6:
        pytest.skip("IEEE fp32 runs without tensor cores: the small shape covers it")
    gen = torch.Generator().manual_seed(n + k)
    pool = torch.randn(M_MAX, k, generator=gen).to("cuda", dtype)
    weight = torch.randn(n, k, generator=gen).to("cuda", dtype) / k**0.5
    fn = lambda a: bik.linear(a, weight)
    assert _first_bad_m(fn, pool, _alone(fn, pool)) is None


@pytest.mark.parametrize("dtype", cases.DTYPES)
def test_rms_norm_every_m_equals_m1(dtype):
    gen = torch.Generator().manual_seed(3)
    pool = torch.randn(M_MAX, 4096, generator=gen).to("cuda", dtype)
    res = torch.randn(M_MAX, 4096, generator=gen).to("cuda", dtype)
    w = torch.randn(4096, generator=gen).to("cuda", dtype)
    fn = lambda x: bik.rms_norm(x, w)
    assert _first_bad_m(fn, pool, _alone(fn, pool)) is None
    both = lambda i: torch.cat(bik.rms_norm(pool[i], w, residual=res[i]), dim=-1)
    alone = torch.cat([both(slice(i, i + 1)) for i in range(256)])
    assert same_bits(both(slice(0, 256)), alone)


@pytest.mark.parametrize("dtype", cases.DTYPES)
def test_matmul_accuracy_vs_torch(dtype):
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(300, 4096, generator=gen).to("cuda", dtype)
    w = torch.randn(1024, 4096, generator=gen).to("cuda", dtype) / 64
    ref = a.double() @ w.double().t()
    err_bik = (bik.linear(a, w).double() - ref).abs().max().item()
    err_torch = (torch.nn.functional.linear(a, w).double() - ref).abs().max().item()
    assert err_bik <= cases.ACCURACY_RATIO[dtype] * err_torch + 1e-6


def test_probe_every_position_on_gpu():
    cases.assert_invariant(matmul_suite(
        device="cuda", dtype=torch.bfloat16, backend=None, ms=(1, 7, 128, 129, 1000),
        shapes=[(4096, 4096)], probe_batch=130))


def test_record_whether_torch_mm_varies_with_m():
    """Not an assertion about torch: a record for docs and bench/results."""
    record = {}
    for dtype in cases.DTYPES:
        for n, k in SHAPES:
            gen = torch.Generator().manual_seed(11)
            pool = torch.randn(1024, k, generator=gen).to("cuda", dtype)
            w = torch.randn(n, k, generator=gen).to("cuda", dtype)
            fn = lambda a, w=w: torch.nn.functional.linear(a, w)
            alone = _alone(fn, pool[:256])
            varies = [m for m in (2, 4, 8, 16, 64, 128, 256) if not same_bits(fn(pool[:m]), alone[:m])]
            record[f"{str(dtype)[6:]} N={n} K={k}"] = varies
    path = os.environ.get("BIK_GPU_RECORD")
    if path:
        with open(path, "w") as f:
            json.dump({"torch_mm_M_values_that_differ_from_M1": record,
                       "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}, f, indent=2)
