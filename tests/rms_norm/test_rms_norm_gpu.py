"""bik.rms_norm (plain and fused with a residual add) on a GPU with the device's default backend
(Triton; skipped without CUDA): every row at every M up to 4096 equals its M = 1 result, bit
for bit; the fused form's (out, h) likewise for M up to 256. The CUDA C++ backend's rms_norm
checks are in tests/cuda/test_cuda_gpu.py."""

import bik
import pytest
import torch
from bik.testing.harness import same_bits
from checks import DTYPES, GPU_M_MAX, alone_rows, first_bad_m

pytestmark = pytest.mark.gpu

@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_every_m_equals_m1(dtype):
    gen = torch.Generator().manual_seed(3)
    pool = torch.randn(GPU_M_MAX, 4096, generator=gen).to("cuda", dtype)
    res = torch.randn(GPU_M_MAX, 4096, generator=gen).to("cuda", dtype)
    w = torch.randn(4096, generator=gen).to("cuda", dtype)
    fn = lambda x: bik.rms_norm(x, w)
    assert first_bad_m(fn, pool, alone_rows(fn, pool)) is None
    both = lambda i: torch.cat(bik.rms_norm(pool[i], w, residual=res[i]), dim=-1)
    alone = torch.cat([both(slice(i, i + 1)) for i in range(256)])
    assert same_bits(both(slice(0, 256)), alone)
