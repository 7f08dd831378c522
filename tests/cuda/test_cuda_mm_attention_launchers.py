"""The CUDA matmul and attention launchers without a GPU: launch plans, 16-byte load flags,
argument lists against the kernels' declarations, and the errors on machines that cannot run
the backend.

No kernel runs here: ``cuda_jit.get_kernel`` and ``cuda_jit.launch`` are replaced by recorders
and CPU tensors stand in for device memory (their pointers are never dereferenced). Each
recorded argument list is checked against the kernel's declaration (``KERNELS``, which
tests/cuda/test_cuda_kernel_decls.py holds to the compiled ``extern "C"`` signatures): same
count, and pointer / int32 / int64 / float32 in the same places (cuda.core would pass a bare
Python int as 8 bytes, which silently shifts every later argument).
(tests/cuda/test_cuda_kernels_host.py runs the same launches on the host build of the kernels.)
"""

from __future__ import annotations

import bik
import pytest
import torch
from bik import configs
from bik.ops._registry import BackendUnavailableError
from bik.ops.attention import cuda as cuda_attention
from bik.ops.matmul import cuda as cuda_matmul
from bik.runtime import cuda_jit
from cuda_host_build import arg_kind, declared_kernels


@pytest.fixture
def recorder(monkeypatch):
    calls = []

    def get_kernel(name, kernel, device, options=()):
        # Every source is loaded with the -D macros configs gives it (the matmul tile).
        assert tuple(options) == configs.cuda_options(name), (name, options)
        return name, kernel

    monkeypatch.setattr(cuda_jit, "get_kernel", get_kernel)
    monkeypatch.setattr(cuda_jit, "launch",
                        lambda kernel, grid, block, smem, *args, device=None:
                        calls.append((kernel, grid, block, args)))
    for mod in (cuda_matmul, cuda_attention):
        monkeypatch.setattr(mod, "device_arch", lambda device: "sm90")
    return calls


def _check_calls(calls):
    declared = declared_kernels()
    for (source, kernel), grid, block, args in calls:
        assert source == declared[kernel].source, kernel
        assert tuple(arg_kind(a) for a in args) == declared[kernel].kinds, kernel
        assert all(0 < g < 2**31 for g in grid) and grid[1] <= 65535 and grid[2] <= 65535
        assert 0 < block[0] <= 1024


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 3000])
def test_matmul_launch_arguments_match_the_kernels(recorder, dtype, m):
    a = torch.zeros(2, m, 4096, dtype=dtype)
    b = torch.zeros(4096, 300, dtype=dtype).t().contiguous().t().expand(2, 4096, 300)
    out = torch.empty(2, m, 300, dtype=torch.bfloat16)
    cuda_matmul.launch_matmul(a, b, torch.zeros(300, dtype=torch.float16), out)
    names = [c[0][1] for c in recorder]
    spread = m == 1
    assert names == [cuda_matmul.plan_matmul(dtype, 2, m, 300, 4096, "sm90").config.kernel] + (
        ["bik_matmul_reduce"] if spread else [])
    _check_calls(recorder)


def test_matmul_load_flags():
    f = cuda_matmul.load_flags
    bf = torch.bfloat16
    a, w = torch.zeros(1, 5, 64, dtype=bf), torch.zeros(96, 64, dtype=bf)
    assert f(a, w.t()[None]) == cuda_matmul.VEC_A | cuda_matmul.VEC_B_K  # x @ weight.t()
    assert f(a, w[:64, :].contiguous()[None]) == cuda_matmul.VEC_A | cuda_matmul.VEC_B_N
    assert f(a[:, :, 1:57], w.t()[None, 1:57]) == 0  # misaligned bases
    assert f(a[:, :, ::2], w.t()[None, ::2]) == 0  # k not unit-stride
    assert f(a.float(), w.t()[None].float()) == 0  # fp32: element loads
    odd = torch.zeros(1, 3, 60, dtype=bf)  # row stride 60: rows are not 16-byte aligned
    assert f(odd[:, :, :56], w.t()[None, :56]) == cuda_matmul.VEC_B_K
    assert f(odd[:, :1, :56], w.t()[None, :56]) & cuda_matmul.VEC_A  # one row never steps


def test_matmul_plans():
    plan = cuda_matmul.plan_matmul(torch.bfloat16, 1, 1, 4096, 4096, "sm90")
    # K = 4096 = 8 groups of 512 (bik.configs.matmul_split), each one split.
    assert plan.n_splits == 8 and plan.spread and plan.grid == (32, 8, 1)
    assert plan.workspace == (1, 8, 1, 4096)
    big = cuda_matmul.plan_matmul(torch.bfloat16, 1, 4096, 4096, 4096, "sm90")
    assert big.n_splits == 8 and not big.spread and big.grid == (64 * 32, 1, 1)
    ungrouped = cuda_matmul.plan_matmul(torch.bfloat16, 1, 1, 4096, 3000, "sm90")
    assert ungrouped.n_splits == 3 and ungrouped.config.split_k == 1024
    assert big.config == plan.config  # M never reaches the configuration
    one = cuda_matmul.plan_matmul(torch.float32, 1, 1, 4096, 1000, "sm80")
    assert one.n_splits == 1 and not one.spread
    with pytest.raises(ValueError, match="2\\*\\*31"):
        cuda_matmul.plan_matmul(torch.float32, 1, 2**31, 8, 8, "sm90")


@pytest.mark.parametrize("paged", [True, False])
@pytest.mark.parametrize("split_mode", [True, False])
def test_attention_launch_arguments_match_the_kernels(recorder, paged, split_mode):
    hq, hkv, d = 32, 8, 128
    q = torch.zeros(5, hq, d, dtype=torch.bfloat16)
    kc = torch.zeros(40, 16, hkv, d, dtype=torch.bfloat16)
    out, lse = torch.empty_like(q), torch.empty(5, hq)
    cuda_attention.launch_attention(
        q, kc, kc, out, lse, cu_q=torch.tensor([0, 1, 5], dtype=torch.int32),
        seqlens_k=torch.tensor([300, 600], dtype=torch.int32),
        table=torch.zeros(2, 40, dtype=torch.int32) if paged else None,
        base=None if paged else torch.tensor([0, 10**6]), block_size=16 if paged else 1,
        stride_page=kc.stride(0), stride_tok=kc.stride(1), max_q_len=4, max_k_len=600,
        scale=0.1, causal=True, split_mode=split_mode)
    names = [c[0][1] for c in recorder]
    assert names == ["bik_attention_bf16_d128"]  # SPLIT's merge is fused: one launch
    _check_calls(recorder)
    # 4 heads x 4 tokens a program; SPLIT: the 3 splits of 600 keys in runs of one (16 items)
    assert recorder[0][1] == (2 * hkv, 1, 3 if split_mode else 1)
    tickets = recorder[0][3][7]
    assert (tickets is None) != split_mode
    if split_mode:
        assert tickets.dtype == torch.int32 and tickets.numel() == 2 * hkv and not tickets.any()


def test_attention_plans():
    plan = cuda_attention.plan_attention(torch.float16, n_seq=3, total_q=3, hq=40, hkv=2, d=64,
                                         max_q_len=1, max_k_len=1000, arch="sm80")
    assert (plan.gh, plan.block_t, plan.n_splits) == (16, 1, 4)  # G = 20: two head slices
    assert plan.grid == (3 * 2 * 2, 1, 4) and plan.split_mode and plan.per_program == 1
    prefill = cuda_attention.plan_attention(torch.float16, n_seq=1, total_q=8192, hq=32, hkv=8,
                                            d=128, max_q_len=8192, max_k_len=8192, arch="sm90")
    assert (prefill.gh, prefill.block_t) == (4, 4) and not prefill.split_mode
    assert prefill.config.split == plan.config.split == 256  # never the length or the batch
    with pytest.raises(ValueError, match="head_dim"):
        cuda_attention.plan_attention(torch.float16, n_seq=1, total_q=1, hq=2, hkv=1, d=96,
                                      max_q_len=1, max_k_len=1, arch="sm90")


def test_backend_cuda_on_cpu_tensors_raises_clearly():
    a = torch.zeros(2, 3)
    with pytest.raises(BackendUnavailableError, match="backend='cuda'"):
        bik.matmul(a, torch.zeros(3, 4), backend="cuda")
    q = torch.zeros(1, 2, 64)
    with pytest.raises(BackendUnavailableError, match="backend='cuda'"):
        bik.attention(q, torch.zeros(1, 4, 2, 64), torch.zeros(1, 4, 2, 64),
                      cache_seqlens=torch.tensor([1]), cu_seqlens_q=torch.tensor([0, 1]),
                      backend="cuda")


def test_every_configured_kernel_is_declared():
    """The kernels configs names are declared (test_cuda_kernel_decls.py holds each declaration
    to the compiled source)."""
    from bik import configs

    declared = declared_kernels()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert configs.cuda_matmul_config(dtype, 8, 8, "sm90").kernel in declared
        name = configs.cuda_attention_config(dtype, 64, 1, "sm90").kernel
        for d in configs.CUDA_ATTENTION_HEAD_DIMS:
            assert f"{name}_d{d}" in declared
