"""bik's real CUDA kernel sources, run on the CPU through the real launchers and ops.

tests/cuda/cuda_host/kernels_host.cpp compiles csrc/cuda/matmul.cu and attention.cu with g++ against
tests/cuda/cuda_host/cuda_on_cpu.h (one CTA at a time, its threads as fibers, __syncthreads and warp
shuffles as barriers, -ffp-contract=off); ``cuda_jit.launch`` is routed there, each call's
arguments checked against the kernel's C signature and passed like cuLaunchKernel's. So the ops
layer, the launchers (plans, strides, workspaces, both launch modes) and the kernels' own index
math, loops, skips and reduction orders run as written, on CPU tensors: every matmul kernel
(fp32, and bf16/fp16 with the warp's mma.sync emulated from the PTX fragment table and cp.async
as a synchronous copy) and the split reduce, and the attention kernels for fp32, bf16 and fp16.
Not covered here: the tensor core's own bits, real concurrency (races), the GPU's exp2f/log2f —
the GPU tests (test_cuda_*_gpu.py) cover those. The split sizes are shrunk (matmul 64,
attention 32: contract knobs from the config tables) so that small problems cross many splits.
"""

from __future__ import annotations

import dataclasses

import attention_checks as ac
import bik
import bik.ops._registry
import bik.ops.attention
import bik.ops.matmul
import pytest
import torch
from bik import configs
from bik.ops.attention import cuda as cuda_attention
from bik.ops.matmul import cuda as cuda_matmul
from bik.ops.rms_norm import cuda as cuda_rms_norm
from bik.ops.matmul.reference import matmul_contract_reference
from bik.testing.attention import make_request, pack_paged
from bik.testing.harness import rows_alone_vs_batched, same_bits
from bik.testing.suites import bmm_suite, matmul_suite, rms_norm_suite
from checks import assert_invariant, cpu_mul_add
from cuda_host_build import force

HEADS = (4, 2, 64)
from attention_checks import check_neighbours, check_page_sizes, check_schedules

# ---- matmul (fp32 kernel + split reduce) -----------------------------------------------------

@pytest.mark.parametrize("spread", [None, True, False])
def test_matmul_suite_on_the_real_kernel(host, monkeypatch, spread):
    force(monkeypatch, cuda_matmul, "use_spread", spread)
    assert_invariant(matmul_suite(device="cpu", dtype=torch.float32, backend="cuda",
                                  ms=(1, 2, 3, 7, 64, 65), shapes=[(70, 300), (33, 47)],
                                  probe_batch=9 if spread is None else 0))
    assert "bik_matmul_f32" in host and ("bik_matmul_reduce" in host) == (spread is not False)


def test_bmm_suite_on_the_real_kernel(host):
    assert_invariant(bmm_suite(device="cpu", dtype=torch.float32, backend="cuda",
                               ms=(1, 2, 5, 17), n=20, k=100, batch=3))


@pytest.mark.parametrize("k", [0, 1, 64, 65, 128, 300, 320])
def test_matmul_is_the_literal_contract_and_the_cpu_backend(host, monkeypatch, k):
    """The SIMT fp32 kernel at every K (one split; G = 4 groups at K = 64, 128, 320; splits of
    64 at 65, 300) in both launch modes: the literal contract and the CPU backend, bit for
    bit, for strided operands too."""
    gen = torch.Generator().manual_seed(k)
    a, w = torch.randn(21, k, generator=gen), torch.randn(37, k, generator=gen)
    bias = torch.randn(37, generator=gen)
    plan = configs.matmul_split(torch.float32, 37, k)
    assert configs.cuda_matmul_config(torch.float32, 37, k, "sm90").split_k == plan.split
    expected = matmul_contract_reference(a, w.t(), bias, plan)
    assert same_bits(cpu_mul_add(a, w.t(), bias), expected)  # the CPU's mul-add sequence
    for spread in (True, False):
        force(monkeypatch, cuda_matmul, "use_spread", spread)
        assert same_bits(bik.matmul(a, w.t(), bias, backend="cuda"), expected)
        assert same_bits(bik.matmul(a, w.t().contiguous(), None, backend="cuda"),
                         matmul_contract_reference(a, w.t(), None, plan))
        assert same_bits(bik.matmul(a[:, ::3], w.t()[::3], backend="cuda"),
                         cpu_mul_add(a[:, ::3], w.t()[::3]))


def test_matmul_split_by_m_is_caught(host, monkeypatch):
    """Negative control: the same kernel with its split length picked by M fails the suite."""
    original = cuda_matmul.plan_matmul

    def plan_by_m(dtype, batch, m, n, k, arch, **kw):
        plan = original(dtype, batch, m, n, k, arch, **kw)
        if m > 1:
            plan = plan._replace(config=dataclasses.replace(plan.config, split_k=128))
        return plan

    monkeypatch.setattr(cuda_matmul, "plan_matmul", plan_by_m)
    gen = torch.Generator().manual_seed(4)
    pool, b = torch.randn(8, 300, generator=gen), torch.randn(300, 16, generator=gen)
    report = rows_alone_vs_batched(lambda x: bik.matmul(x, b, backend="cuda"), pool, (1, 8))
    assert not report.ok


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tensor_core_kernel_suite(host, monkeypatch, dtype):
    """The bf16/fp16 kernel (mma.sync emulated on the host: the fragment plumbing, loaders,
    cp.async pipeline, splits and epilogues are the kernel's own) keeps rows invariant."""
    for spread in (True, False):
        force(monkeypatch, cuda_matmul, "use_spread", spread)
        assert_invariant(matmul_suite(device="cpu", dtype=dtype, backend="cuda",
                                      ms=(1, 2, 9), shapes=[(24, 130), (136, 40)]))
    assert f"bik_matmul_{'bf16' if dtype == torch.bfloat16 else 'f16'}" in host


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tensor_core_kernel_load_paths_agree(host, dtype):
    """cp.async (both operands k-contiguous), 16-byte register loads (row-major B) and element
    loads (strided, misaligned) move the same values: the bits agree, and match fp64."""
    gen = torch.Generator().manual_seed(8)
    a = torch.randn(70, 208, generator=gen).to(dtype)
    w = torch.randn(136, 208, generator=gen).to(dtype)
    ref = a.double() @ w.double().t()
    a_buf, w_buf = torch.empty(70, 209, dtype=dtype), torch.empty(136, 209, dtype=dtype)
    a_buf[:, 1:], w_buf[:, 1:] = a, w
    flags, outs = {}, []
    for name, x, b in (("cp.async", a, w.t()), ("vector", a, w.t().contiguous()),
                       ("elements", a.t().contiguous().t(), w.t()),
                       ("misaligned", a_buf[:, 1:], w_buf[:, 1:].t())):
        flags[name] = cuda_matmul.load_flags(x[None], b[None])
        outs.append(bik.matmul(x, b, out_dtype=torch.float32, backend="cuda"))
    assert flags["cp.async"] == cuda_matmul.VEC_A | cuda_matmul.VEC_B_K
    assert flags["vector"] == cuda_matmul.VEC_A | cuda_matmul.VEC_B_N
    assert flags["elements"] == cuda_matmul.VEC_B_K and flags["misaligned"] == 0
    assert all(same_bits(o, outs[0]) for o in outs[1:])
    assert (outs[0].double() - ref).abs().max() <= 1e-5 * ref.abs().max()


# ---- attention -------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", [None, True, False])
def test_attention_schedules_on_the_real_kernel(host, monkeypatch, mode):
    """One prefill vs chunks vs verify windows vs decode steps (split 32: four splits)."""
    force(monkeypatch, cuda_attention, "use_split_mode", mode)
    check_schedules(ac.bik_attn("cuda"), torch.float32, 110, device="cpu", heads=HEADS,
                    chunks=(7, 40), windows=(4,), tail=16, last=6)
    assert "bik_attention_f32_d64" in host
    spread = any(grid[2] > 1 for kernel, grid in zip(host, host.grids)
                 if kernel.startswith("bik_attention_"))
    assert spread == (mode is not False)  # SPLIT ran (its merge fused) unless FOLD was forced


def test_attention_split_runs_and_fused_merge_keep_fold_bits(host, monkeypatch):
    """SPLIT with 1, 2, 3 or all of a tile's splits per program (the last program to take a
    ticket folds every partial) gives FOLD's bits, for a batch of a prefill chunk, decode rows
    and a verify window whose tiles see different numbers of splits."""
    batch = ac.mixed_batch(64)

    def run(mode, per=None):
        force(monkeypatch, cuda_attention, "use_split_mode", mode)
        if per is not None:
            monkeypatch.setattr(cuda_attention, "splits_per_program", lambda *args: per)
        return batch("cuda")

    fold = run(False)
    for per in (1, 2, 3, 5):  # 130 keys / 32 = 5 splits: 5 is one program per tile
        assert torch.equal(run(True, per), fold), per
        assert host.grids[-1][2] == -(-5 // per)  # runs of per splits


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attention_half_schedules_and_page_sizes(host, dtype):
    attn = ac.bik_attn("cuda")
    check_schedules(attn, dtype, 75, device="cpu", heads=HEADS, chunks=(9,), windows=(4,),
                    tail=8, last=4)
    check_page_sizes(attn, dtype, 70, (16, 1, 7), device="cpu", heads=HEADS)


@pytest.mark.parametrize("heads", [(2, 2, 64), (6, 2, 128), (40, 2, 64)])
def test_attention_gqa_packings(host, heads):
    """G = 1, 3 and 20 (two head slices of at most 16 rows per program), D = 64 and 128."""
    check_schedules(ac.bik_attn("cuda"), torch.float32, 40, device="cpu", heads=heads,
                    chunks=(5,), windows=(), tail=4, last=3)


def test_attention_neighbours_layouts_accuracy(host):
    check_neighbours(ac.bik_attn("cuda"), torch.float32, 80, 3, n_neighbours=4, max_len=100,
                     device="cpu", heads=HEADS)
    ac.check_layouts_agree("cuda", torch.float32, [5, 70, 33])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        ac.check_accuracy("cuda", dtype, [1, 60, 100], [1, 17, 100])


def test_attention_split_by_length_is_caught(host, monkeypatch):
    """Negative control: the same kernels with SPLIT picked by the call's q_len fail."""
    original = cuda_attention.plan_attention

    def plan_by_length(dtype, **kw):
        plan = original(dtype, **kw)
        if kw["max_q_len"] > 1:
            plan = plan._replace(config=dataclasses.replace(plan.config, split=64))
        return plan

    monkeypatch.setattr(cuda_attention, "plan_attention", plan_by_length)
    with pytest.raises(AssertionError, match="differ"):
        check_schedules(ac.bik_attn("cuda"), torch.float32, 90, device="cpu", heads=HEADS,
                        chunks=(), windows=(), tail=4, last=30)


def test_edge_shapes_dtypes_and_opcheck(host):
    """Empty M/N, K = 0 (bias only), a 16-bit bias with fp32 output, and opcheck of both ops on
    the CUDA backend path."""
    from torch.library import opcheck

    gen = torch.Generator().manual_seed(9)
    a = torch.randn(5, 40, generator=gen).to(torch.bfloat16)
    b = torch.randn(40, 7, generator=gen).to(torch.bfloat16)
    bias = torch.randn(7, generator=gen).to(torch.float16)
    out32 = bik.matmul(a, b, bias, out_dtype=torch.float32, backend="cuda")
    ref = a.double() @ b.double() + bias.double()
    assert out32.dtype == torch.float32 and (out32.double() - ref).abs().max() < 1e-4
    assert bik.matmul(a[:0], b, backend="cuda").shape == (0, 7)
    assert bik.matmul(a, b[:, :0], backend="cuda").shape == (5, 0)
    k0 = bik.matmul(a[:, :0], b[:0], bias, backend="cuda")
    assert same_bits(k0, bias.float().expand(5, 7).to(torch.bfloat16).contiguous())
    opcheck(torch.ops.bik.matmul.default, (a, b, bias, None, "cuda"))
    opcheck(torch.ops.bik.bmm.default, (a[None].expand(2, 5, 40), b[None].expand(2, 40, 7),
                                        torch.float32, "cuda"))
    reqs = [make_request(gen, n, 4, 2, 64, torch.float32) for n in (5, 40)]
    cache = pack_paged(reqs, [5, 40], 16, gen)
    q = torch.cat([reqs[0].q[3:], reqs[1].q[39:]])
    cu_q = torch.tensor([0, 2, 3], dtype=torch.int32)
    opcheck(torch.ops.bik.attention.default,
            (q, cache.k_cache, cache.v_cache, cache.cache_seqlens, cu_q, cache.block_table, 0.125,
             True, "cuda"))


# ---- RMSNorm (the 16-byte and the scalar instance) -----------------------------------------

_NORM_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _norm_kind(kernel: str) -> str:
    """Which RMSNorm kernel a launched name is: the block-per-row, vector or scalar one."""
    return "row" if kernel.startswith("bik_rms_norm_row_") else "vec" \
        if kernel.startswith("bik_rms_norm_vec_") else "scalar"


def _sequential_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """A different reduction order (one running fp32 sum per row): the negative control."""
    xf = x.float()
    s = torch.zeros(x.shape[0])
    for j in range(x.shape[1]):
        s = s + xf[:, j] * xf[:, j]
    return ((xf * (1.0 / torch.sqrt(s / x.shape[1] + eps))[:, None]) * w.float()).to(x.dtype)


@pytest.mark.parametrize("row", [False, True, None])
@pytest.mark.parametrize("dtype", _NORM_DTYPES)
def test_rms_norm_suite_on_the_real_kernel(host, monkeypatch, dtype, row):
    """Rows alone vs batched through both instances (row=False): H = 64 and 136 take the 16-byte
    one (16 or 32 rows per block, so 65 rows cross blocks), H = 100 takes it for fp32 only,
    H = 138 never; through the block-per-row kernel (True); and by batch size (None: rows up
    to ROW_MAX_ROWS take the row kernel, so the M sweep crosses kernels too)."""
    force(monkeypatch, cuda_rms_norm, "use_row_kernel", row)
    if row is None:
        monkeypatch.setattr(cuda_rms_norm, "ROW_MAX_ROWS", 8)
    assert_invariant(rms_norm_suite(device="cpu", dtype=dtype, backend="cuda",
                                    ms=(1, 2, 3, 17, 65), hiddens=(64, 100, 136, 138)))
    assert {_norm_kind(k) for k in host} == {False: {"vec", "scalar"}, True: {"row"},
                     None: {"row", "vec", "scalar"}}[row], host


@pytest.mark.parametrize("row", [False, True])
@pytest.mark.parametrize("dtype", _NORM_DTYPES)
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_rms_norm_instances_equal_the_cpu_backend(host, monkeypatch, dtype, wdtype, row):
    """Both instances (row=False) and the block-per-row kernel (True) give the CPU backend's
    bits, plain and fused, aligned and not, for hidden sizes below, at and past the 16
    contract lanes; a different summation order gives other bits on these inputs (so the
    equality is not vacuous)."""
    force(monkeypatch, cuda_rms_norm, "use_row_kernel", row)
    gen = torch.Generator().manual_seed(3)
    differs = False
    for hidden in (8, 16, 24, 40, 520):
        whole = (torch.randn(9, hidden + 8, generator=gen) * 3).to(dtype)
        res = torch.randn(9, hidden + 8, generator=gen).to(dtype)
        w = torch.randn(hidden, generator=gen).to(wdtype)
        for offset in (0, 1):  # 1: rows start off the 16-byte grid (the scalar instance)
            x, r = whole[:, offset:offset + hidden], res[:, offset:offset + hidden]
            host.clear()
            got = bik.rms_norm(x, w, 1e-6, backend="cuda")
            out, h = bik.rms_norm(x, w, 1e-6, residual=r, backend="cuda")
            vec = hidden % (16 // x.element_size()) == 0 and offset == 0
            want = "row" if row else "vec" if vec else "scalar"
            assert {_norm_kind(k) for k in host} == {want}, (hidden, host)
            assert same_bits(got, bik.rms_norm(x, w, 1e-6, backend="cpu"))
            ref_out, ref_h = bik.rms_norm(x, w, 1e-6, residual=r, backend="cpu")
            assert same_bits(out, ref_out) and same_bits(h, ref_h)
            differs |= not same_bits(got, _sequential_rms_norm(x, w, 1e-6))
    assert differs


def test_attention_lengths_past_the_host_bounds_give_nan_not_stale_or_stray_writes(
        host, monkeypatch):
    """The CUDA kernel's guard (tests/attention/test_attention_bounds.py for Triton): a key
    length past max_seqlen_k writes nothing past the SPLIT workspace and comes back NaN, a
    query length past max_seqlen_q NaN down to its last row (past the grid); rows within the
    bounds keep their bits."""
    untouched, out, lse, right = ac.past_key_bound(cuda_attention, monkeypatch, "cuda")
    assert untouched and torch.equal(out[0], right[0])
    assert bool(out[1:].isnan().all()) and bool(lse[1:].isnan().all())
    out, lse, right = ac.past_query_bound(cuda_attention, "cuda")
    assert torch.equal(out[:3], right[:3])
    assert bool(out[3:].isnan().all()) and bool(lse[3:].isnan().all())
    assert "bik_attention_f32_d64" in host


def test_attention_sequence_without_keys_is_nan_in_both_modes(host):
    """The CUDA kernel's empty tile (tests/attention/test_attention_bounds.py for Triton): a
    sequence with no keys under a query comes back NaN from FOLD and SPLIT alike, not the
    output's previous contents; the other sequence keeps its bits."""
    (fold, fold_lse), (split, split_lse) = ac.keyless_sequence(cuda_attention)
    assert bool(fold[0].isnan().all()) and bool(split[0].isnan().all())
    assert torch.equal(fold_lse[0].view(torch.int32), split_lse[0].view(torch.int32))
    assert not bool((fold_lse == ac.BOUND_SENTINEL).any())
    assert torch.equal(fold[1], split[1])
    assert "bik_attention_f32_d64" in host


def test_attention_spreads_the_real_splits_over_the_runs(host, monkeypatch):
    """A SPLIT launch sized by a generous bound (64 splits of 32 keys for 16 (sequence, KV
    head) items: 16 runs of 4) spreads each tile's 5 real splits over 5 programs (their tickets
    count them; tests/attention/test_attention_bounds.py for Triton), with the true bound's
    bits."""
    from bik.ops.attention._layout import busy_programs
    from bik.runtime import cuda_jit

    lengths = [5 * 32] * 8
    k, v, table = ac._bound_cache(lengths, 4, "cpu")
    q = torch.randn(8, ac.BOUND_HEADS[0], ac.BOUND_HEADS[2],
                    generator=torch.Generator().manual_seed(5))
    meta = {"cache_seqlens": torch.tensor(lengths, dtype=torch.int32),
            "cu_seqlens_q": torch.arange(9, dtype=torch.int32),
            "block_table": torch.nn.functional.pad(table, (0, 128 - table.shape[1]))}
    right = bik.attention(q, k, v, **meta, max_seqlen_q=1, max_seqlen_k=160, backend="cuda")
    tickets, launch = [], cuda_jit.launch

    def spy(kernel, grid, block, shared_bytes, *args, device=None):
        launch(kernel, grid, block, shared_bytes, *args, device=device)
        tickets.append((tuple(grid), args[7].clone()))

    monkeypatch.setattr(cuda_jit, "launch", spy)
    monkeypatch.setattr(cuda_attention, "use_split_mode", lambda *args: True)
    got = bik.attention(q, k, v, **meta, max_seqlen_q=1, max_seqlen_k=64 * 32, backend="cuda")
    assert torch.equal(got, right)
    (grid, counts), = tickets
    assert grid == (16, 1, 16)
    assert counts.tolist() == [busy_programs(16, [5])] * 16 == [5] * 16
