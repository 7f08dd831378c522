"""bik.matmul / bik.bmm on a GPU for backend "triton" and "cuda" (skipped without CUDA).

The same invariance suites as the Triton backend (every row alone vs batched over the M sweep,
a probe at every position, B contiguous and as weight.t()), accuracy against fp64, and for the
CUDA kernels the K-split contract: the same bits for every M whether the splits are spread over
programs (decode-sized M) or computed one after another in a program (large M); fp32 equals a
literal implementation of the K-split contract (bik/ops/matmul/reference.py) and the CPU
backend at every K.
Budget: about a minute on an H200 (NVRTC compiles included, cached on disk afterwards).
"""

from __future__ import annotations

import bik
import pytest
import torch
from bik.configs import matmul_split
from bik.ops.matmul.reference import matmul_contract_reference
from bik.testing.harness import same_bits
from bik.testing.suites import bmm_suite, matmul_suite
from checks import ACCURACY_RATIO, DTYPES, assert_invariant

pytestmark = pytest.mark.gpu

BACKENDS = ["triton", "cuda"]
MS = (1, 2, 3, 7, 16, 31, 64, 127, 128, 255, 256, 1000)
# (N, K): K above 2048 crosses the CUDA K-split (1024 per split); odd N and K; a wide N.
SHAPES = [(4096, 4096), (1000, 333), (256, 4097), (6144, 2049)]


@pytest.fixture(params=BACKENDS)
def backend(request):
    if request.param == "cuda":
        from bik.runtime import cuda_jit

        if not cuda_jit.available():
            pytest.skip(f"backend='cuda' unavailable: {cuda_jit.unavailable_reason()}")
    return request.param


def _spread(monkeypatch, value: bool | None):
    """Force the CUDA launch mode (None = by work size). The bits must not change."""
    from bik.ops.matmul import cuda as cuda_matmul

    original = cuda_matmul.use_spread
    monkeypatch.setattr(cuda_matmul, "use_spread",
                        original if value is None else (lambda *args, **kwargs: value))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_alone_vs_batched(backend, dtype):
    shapes = SHAPES[1:3] if dtype == torch.float32 else SHAPES
    assert_invariant(matmul_suite(device="cuda", dtype=dtype, backend=backend, ms=MS,
                                  shapes=shapes))


def test_probe_every_position(backend):
    assert_invariant(matmul_suite(device="cuda", dtype=torch.bfloat16, backend=backend,
                                  ms=(1, 64, 129), shapes=[(4096, 4096)], probe_batch=130))


@pytest.mark.parametrize("dtype", DTYPES)
def test_bmm_rows_and_entries(backend, dtype):
    assert_invariant(bmm_suite(device="cuda", dtype=dtype, backend=backend, ms=MS[:9],
                               n=200, k=3000))


@pytest.mark.parametrize("dtype", DTYPES)
def test_accuracy_vs_fp64(backend, dtype):
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(300, 4096, generator=gen).to("cuda", dtype)
    w = torch.randn(1024, 4096, generator=gen).to("cuda", dtype) / 64
    bias = torch.randn(1024, generator=gen).to("cuda")
    ref = a.double() @ w.double().t() + bias.double()
    err_bik = (bik.linear(a, w, bias, backend=backend).double() - ref).abs().max().item()
    err_torch = (torch.nn.functional.linear(a, w, bias.to(dtype)).double() - ref).abs().max().item()
    assert err_bik <= ACCURACY_RATIO[dtype] * err_torch + 1e-6


def _k_split_problem(rows: int, k: int, dtype):
    """x [rows, k], weight [512, k] (scaled by 1/sqrt(k)) and an fp32 bias [512] on the GPU,
    seeded by k: a linear layer whose K crosses the split boundaries."""
    gen = torch.Generator().manual_seed(k)
    pool = torch.randn(rows, k, generator=gen).to("cuda", dtype)
    w = torch.randn(512, k, generator=gen).to("cuda", dtype) / k**0.5
    bias = torch.randn(512, generator=gen).to("cuda")
    return pool, w, bias


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [4096, 4097, 14336])
def test_cuda_k_split_same_bits_in_both_modes_and_every_m(dtype, k, monkeypatch):
    """The K-split's two schedules (spread over programs / one after another in a program)
    give the same bits, and every M gives a row its M = 1 bits."""
    from bik.runtime import cuda_jit

    if not cuda_jit.available():
        pytest.skip(cuda_jit.unavailable_reason())
    pool, w, bias = _k_split_problem(1024, k, dtype)
    results = {}
    for mode in (True, False, None):
        _spread(monkeypatch, mode)
        def fn(a):
            return bik.linear(a, w, bias, backend="cuda")

        alone = torch.cat([fn(pool[i:i + 1]) for i in range(64)])
        results[mode] = fn(pool)
        for m in (1, 2, 5, 16, 63, 64):
            assert same_bits(fn(pool[:m]), alone[:m]), (mode, m)
        assert same_bits(results[mode][:64], alone), mode
    assert same_bits(results[True], results[False]) and same_bits(results[None], results[True])


@pytest.mark.parametrize("k", [1, 333, 2048, 3001, 4096])
def test_cuda_fp32_is_the_literal_contract(k):
    from bik.runtime import cuda_jit

    if not cuda_jit.available():
        pytest.skip(cuda_jit.unavailable_reason())
    gen = torch.Generator().manual_seed(k)
    a, b = torch.randn(77, k, generator=gen), torch.randn(k, 130, generator=gen)
    bias = torch.randn(130, generator=gen)
    got = bik.matmul(a.cuda(), b.cuda(), bias.cuda(), backend="cuda").cpu()
    assert same_bits(got, matmul_contract_reference(a, b, bias,
                                                    matmul_split(torch.float32, 130, k)))
    assert same_bits(got, bik.matmul(a, b, bias, backend="cpu"))  # every K, not only one split


def test_cuda_edge_shapes_and_dtypes():
    from bik.runtime import cuda_jit

    if not cuda_jit.available():
        pytest.skip(cuda_jit.unavailable_reason())
    gen = torch.Generator().manual_seed(9)
    a = torch.randn(5, 40, generator=gen).to("cuda", torch.bfloat16)
    b = torch.randn(40, 7, generator=gen).to("cuda", torch.bfloat16)
    bias = torch.randn(7, generator=gen).to("cuda", torch.float16)
    ref = (a.double() @ b.double() + bias.double())
    out32 = bik.matmul(a, b, bias, out_dtype=torch.float32, backend="cuda")
    assert out32.dtype == torch.float32 and (out32.double() - ref).abs().max() < 1e-4
    assert bik.matmul(a[:0], b, backend="cuda").shape == (0, 7)
    k0 = bik.matmul(a[:, :0], b[:0], bias, backend="cuda")
    assert same_bits(k0, bias.float().expand(5, 7).to(torch.bfloat16).contiguous())
    strided = bik.matmul(a[:, ::2], b[::2], backend="cuda")  # non-unit strides everywhere
    assert same_bits(strided, bik.matmul(a[:, ::2].contiguous(), b[::2].contiguous(),
                                         backend="cuda"))


def test_cuda_opcheck_and_cuda_graph():
    """The registered ops pass opcheck on the CUDA backend, and a launch (both modes) replays
    from a captured CUDA graph with the bits of an eager call."""
    from bik.runtime import cuda_jit
    from torch.library import opcheck

    if not cuda_jit.available():
        pytest.skip(cuda_jit.unavailable_reason())
    gen = torch.Generator().manual_seed(12)
    a = torch.randn(3, 4096, generator=gen).to("cuda", torch.bfloat16)
    w = torch.randn(4096, 256, generator=gen).to("cuda", torch.bfloat16)
    bias = torch.randn(256, generator=gen).to("cuda")
    opcheck(torch.ops.bik.matmul.default, (a, w, bias, None, "cuda"))
    opcheck(torch.ops.bik.bmm.default, (a[None].expand(2, 3, 4096), w[None].expand(2, 4096, 256),
                                        torch.float32, "cuda"))
    for rows in (3, 3000):  # spread (decode-sized) and fold
        x = torch.randn(rows, 4096, generator=gen).to("cuda", torch.bfloat16)
        eager = bik.matmul(x, w, bias, backend="cuda")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            bik.matmul(x, w, bias, backend="cuda")  # warm-up: compile and load outside capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = bik.matmul(x, w, bias, backend="cuda")
        graph.replay()
        torch.cuda.synchronize()
        assert same_bits(captured, eager), rows


# ---- the opt-in sm_90a kernel (csrc/cuda/matmul_sm90.cu, BIK_CUDA_SM90A=1) --------------------
# The same suites with the switch on, on compute capability 9.0 only. Until these pass on an
# H200 the switch stays off by default (bik.configs.cuda_sm90a_matmul_enabled).

HALF = [torch.bfloat16, torch.float16]


@pytest.fixture
def sm90a(monkeypatch):
    from bik import configs
    from bik._arch import device_arch
    from bik.runtime import cuda_jit

    if not cuda_jit.available():
        pytest.skip(f"backend='cuda' unavailable: {cuda_jit.unavailable_reason()}")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm_90a matmul needs compute capability 9.0")
    monkeypatch.setenv(configs.SM90A_MATMUL_ENV, "1")
    for dtype in HALF:
        cfg = configs.cuda_matmul_config(dtype, 4096, 4096, device_arch(torch.device("cuda")))
        assert cfg.source == "matmul_sm90", cfg
    return monkeypatch


@pytest.mark.parametrize("dtype", HALF)
def test_sm90a_rows_alone_vs_batched(sm90a, dtype):
    assert_invariant(matmul_suite(device="cuda", dtype=dtype, backend="cuda", ms=MS,
                                  shapes=SHAPES))


def test_sm90a_probe_every_position(sm90a):
    assert_invariant(matmul_suite(device="cuda", dtype=torch.bfloat16, backend="cuda",
                                  ms=(1, 64, 129), shapes=[(4096, 4096)], probe_batch=130))


@pytest.mark.parametrize("dtype", HALF)
def test_sm90a_bmm_rows_and_entries(sm90a, dtype):
    assert_invariant(bmm_suite(device="cuda", dtype=dtype, backend="cuda", ms=MS[:9],
                               n=200, k=3000))


@pytest.mark.parametrize("dtype", HALF)
def test_sm90a_accuracy_vs_fp64(sm90a, dtype):
    test_accuracy_vs_fp64("cuda", dtype)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("k", [4096, 4097, 14336])
def test_sm90a_spread_equals_serial_at_every_m(sm90a, dtype, k):
    """SPREAD (splits over programs) and FOLD (splits one after another) give the same bits at
    every M from 1 to 130 (and 255, 256, 1000), and each equals those rows of the full batch."""
    pool, w, bias = _k_split_problem(1000, k, dtype)
    full = {}
    for mode in (True, False):
        _spread(sm90a, mode)
        full[mode] = bik.linear(pool, w, bias, backend="cuda")
    assert same_bits(full[True], full[False])
    for m in (*range(1, 131), 255, 256, 1000):
        outs = []
        for mode in (True, False):
            _spread(sm90a, mode)
            outs.append(bik.linear(pool[:m], w, bias, backend="cuda"))
        assert same_bits(outs[0], outs[1]), (m, "spread != serial")
        assert same_bits(outs[0], full[True][:m]), (m, "rows differ from the full batch")
    _spread(sm90a, None)
    test_cuda_k_split_same_bits_in_both_modes_and_every_m(dtype, k, sm90a)


@pytest.mark.parametrize("dtype", HALF)
def test_sm90a_load_paths_agree(sm90a, dtype):
    """cp.async (x @ weight.t()), 16-byte loads, element loads and a misaligned view: same bits."""
    gen = torch.Generator().manual_seed(8)
    a = torch.randn(300, 2056, generator=gen).to("cuda", dtype)
    w = torch.randn(520, 2056, generator=gen).to("cuda", dtype)
    a_buf = torch.empty(300, 2057, dtype=dtype, device="cuda")
    w_buf = torch.empty(520, 2057, dtype=dtype, device="cuda")
    a_buf[:, 1:], w_buf[:, 1:] = a, w
    outs = [bik.matmul(x, b, out_dtype=torch.float32, backend="cuda")
            for x, b in ((a, w.t()), (a, w.t().contiguous()), (a.t().contiguous().t(), w.t()),
                         (a_buf[:, 1:], w_buf[:, 1:].t()))]
    assert all(same_bits(o, outs[0]) for o in outs[1:])


def test_sm90a_edge_shapes_opcheck_and_cuda_graph(sm90a):
    test_cuda_edge_shapes_and_dtypes()
    test_cuda_opcheck_and_cuda_graph()
