"""bik.linear / bik.matmul on a GPU with the device's default backend (Triton; skipped without
CUDA): every row at every M up to 4096 equals its M = 1 result, bit for bit, on the real
tensor-core dot; a probe at every position; accuracy against torch; and a record of whether
torch.mm (cuBLAS) itself varies with M on the same shapes (written to $BIK_GPU_RECORD if set).
Both backends' suites and the CUDA K-split: tests/matmul/test_matmul_cuda_gpu.py; rms_norm's:
tests/rms_norm/test_rms_norm_gpu.py."""

import json
import os

import bik
import pytest
import torch
from bik.testing.harness import same_bits
from bik.testing.suites import matmul_suite
from checks import (
    ACCURACY_RATIO,
    DTYPES,
    GPU_M_MAX,
    alone_rows,
    assert_invariant,
    first_bad_m,
)

pytestmark = pytest.mark.gpu

SHAPES = [(4096, 4096), (1000, 333), (128256 // 8, 4096)]  # (N, K)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES[:2])
def test_matmul_every_m_equals_m1(dtype, shape):
    n, k = shape
    if dtype == torch.float32 and n * k > 10**6:
        pytest.skip("IEEE fp32 runs without tensor cores: the small shape covers it")
    gen = torch.Generator().manual_seed(n + k)
    pool = torch.randn(GPU_M_MAX, k, generator=gen).to("cuda", dtype)
    weight = torch.randn(n, k, generator=gen).to("cuda", dtype) / k**0.5
    fn = lambda a: bik.linear(a, weight)
    assert first_bad_m(fn, pool, alone_rows(fn, pool)) is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_accuracy_vs_torch(dtype):
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(300, 4096, generator=gen).to("cuda", dtype)
    w = torch.randn(1024, 4096, generator=gen).to("cuda", dtype) / 64
    ref = a.double() @ w.double().t()
    err_bik = (bik.linear(a, w).double() - ref).abs().max().item()
    err_torch = (torch.nn.functional.linear(a, w).double() - ref).abs().max().item()
    assert err_bik <= ACCURACY_RATIO[dtype] * err_torch + 1e-6


def test_probe_every_position_on_gpu():
    assert_invariant(matmul_suite(
        device="cuda", dtype=torch.bfloat16, backend=None, ms=(1, 7, 128, 129, 1000),
        shapes=[(4096, 4096)], probe_batch=130))


def test_record_whether_torch_mm_varies_with_m():
    """Not an assertion about torch: a record for docs and bench/results."""
    record = {}
    for dtype in DTYPES:
        for n, k in SHAPES:
            gen = torch.Generator().manual_seed(11)
            pool = torch.randn(1024, k, generator=gen).to("cuda", dtype)
            w = torch.randn(n, k, generator=gen).to("cuda", dtype)
            fn = lambda a, w=w: torch.nn.functional.linear(a, w)
            alone = alone_rows(fn, pool[:256])
            varies = [m for m in (2, 4, 8, 16, 64, 128, 256)
                      if not same_bits(fn(pool[:m]), alone[:m])]
            record[f"{str(dtype)[6:]} N={n} K={k}"] = varies
    path = os.environ.get("BIK_GPU_RECORD")
    if path:
        with open(path, "w") as f:
            json.dump({"torch_mm_M_values_that_differ_from_M1": record,
                       "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}, f,
                      indent=2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b_layout", ["weight", "row_major"])
def test_launch_modes_same_bits_on_gpu(dtype, b_layout):
    """Triton's three launch modes on the real tensor cores: PERSISTENT (TMA, Hopper), FOLD and
    SPREAD give the same bits for a Llama projection at a large M; PERSISTENT is skipped where
    the arch does not run it."""
    from bik._arch import device_arch
    from bik.ops.matmul import schedule
    from bik.ops.matmul import triton as triton_matmul

    gen = torch.Generator().manual_seed(11)
    a = torch.randn(1, 2048, 4096, generator=gen).to("cuda", dtype)
    w = (torch.randn(4096, 4096, generator=gen) / 64).to("cuda", dtype)
    b = w.t()[None] if b_layout == "weight" else w.t().contiguous()[None]
    modes = [{"persistent": False, "spread": False}, {"persistent": False, "spread": True}]
    if schedule.use_persistent(device_arch(a.device), dtype, 1 << 20):
        modes.append({"persistent": True})
    outs = []
    for mode in modes:
        out = torch.empty(1, 2048, 4096, device="cuda", dtype=dtype)
        triton_matmul.launch_matmul(a, b, None, out, **mode)
        outs.append(out)
    assert all(same_bits(o, outs[0]) for o in outs[1:])
