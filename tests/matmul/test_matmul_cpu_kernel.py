"""Low-level tests of bik's fixed-order CPU matmul kernel (bik/ops/matmul/cpu.py over
bik.runtime.cpu_ext, csrc/cpu), and of the CPU extension's build (no FMA in the object code).

Exactness against the literal reference of the contract (bik/ops/matmul/reference.py, the spec
in csrc/cpu/contract.h) for every ISA the CPU runs, blockings, strides and threads; bitwise
batch invariance with torch.equal; a negative control showing the same comparison catches stock
torch.mm; and a loose fp64 accuracy sanity check. The rms_norm kernel's:
tests/rms_norm/test_rms_norm_cpu_kernel.py.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys

import pytest
import torch
from bik.configs import MatmulSplit, matmul_split
from bik.ops.matmul.cpu import matmul_f32
from bik.ops.matmul.reference import matmul_contract_reference, split_ranges
from bik.runtime import cpu_ext

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason=cpu_ext.unavailable_reason())

ISAS = [i for i in ("avx512", "avx2", "generic")
        if cpu_ext.available() and cpu_ext._ext.isa_supported(i)]
SIZES = (1, 3, 17, 33, 64, 100)
BATCHES = (2, 3, 4, 7, 8, 16, 31, 64, 127, 128, 255, 256)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def matmul_cpu_reference(a, b, bias, split: int | None = None,
                         fp32_fma: bool | None = None) -> torch.Tensor:
    """The contract's bits for this problem's plan (or one split of ``split``), on the fp32
    sequence ``fp32_fma`` names (default this process's, as the kernel's default). The fma
    sequence's from its scalar C++ transcription (fma_reference.h; equal to the torch one and
    to exact rounding: test_matmul_fp32_fma.py), which is many times faster at long K."""
    k, n = b.shape
    plan = matmul_split(torch.float32, n, k) if split is None else MatmulSplit(1, split)
    fma = cpu_ext.fp32_fma() if fp32_fma is None else fp32_fma
    if not fma:
        return matmul_contract_reference(a, b, bias, plan)
    # one group, or every group one split: the two-level fold is the flat one the C++ takes
    assert plan.groups == 1 or len(split_ranges(k, plan)[0]) == 1
    out = torch.empty(a.shape[0], n)
    cpu_ext.require().matmul_fp32_fma_reference(
        a.data_ptr(), a.stride(0), a.stride(1), b.data_ptr(), b.stride(0), b.stride(1),
        0 if bias is None else bias.contiguous().data_ptr(), out.data_ptr(), n, a.shape[0], n, k,
        plan.split)
    return out


def mm(a, b, bias=None, **kw) -> torch.Tensor:
    out = torch.full((a.shape[0], b.shape[1]), float("nan"))
    matmul_f32(a, b, bias, out, **kw)
    return out


# ---- exactness against the contract ------------------------------------------------------------


@pytest.mark.parametrize("fp32_fma", [True, False], ids=["fma", "mul-add"])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("M", SIZES)
@pytest.mark.parametrize("N", SIZES)
def test_matmul_matches_contract(isa, M, N, fp32_fma):
    for K in SIZES:
        g = _gen(M * 10007 + N * 101 + K)
        a = torch.randn(M, K, generator=g)
        w = torch.randn(N, K, generator=g)  # nn.Linear layout; b = w.t() (K contiguous)
        bias = torch.randn(N, generator=g)
        for b in (w.t(), w.t().contiguous()):
            for bb in (None, bias):
                want = matmul_cpu_reference(a, b, bb, fp32_fma=fp32_fma)
                got = mm(a, b, bb, isa=isa, fp32_fma=fp32_fma)
                assert torch.equal(got, want), (M, N, K, bb)


def test_matmul_blocking_and_odd_k_match_contract():
    # K blocks of every size (store/reload of the fp32 acc) and N blocks keep the order exactly.
    g = _gen(1)
    M, N, K = 13, 77, 1000
    a, b, bias = torch.randn(M, K, generator=g), torch.randn(K, N, generator=g), torch.randn(N)
    want = matmul_cpu_reference(a, b, bias)
    for bk, bn in ((0, 0), (1, 1), (7, 33), (64, 64), (256, 512), (999, 32), (4096, 4096)):
        for isa in ISAS:
            assert torch.equal(mm(a, b, bias, isa=isa, block_k=bk, block_n=bn), want), (bk, bn)
            assert torch.equal(mm(a, b.t().contiguous().t(), bias, isa=isa, block_k=bk), want)


@pytest.mark.parametrize("K", [512, 1536, 2049, 3000, 4096])
def test_matmul_k_splits_match_contract(K):
    """K long enough to split (G = 8 groups, or splits of 1024 from 0): the kernel folds the
    split partials exactly as the literal contract, whatever the K/N blocking (K blocks never
    cross a split), ISA, thread count, and with rows past the per-call row chunk (256)."""
    g = _gen(K)
    plan = matmul_split(torch.float32, 70, K)
    assert plan.n_splits(K) > 1
    a, w = torch.randn(300, K, generator=g), torch.randn(70, K, generator=g)
    bias = torch.randn(70, generator=g)
    want = matmul_cpu_reference(a, w.t(), bias)
    assert not torch.equal(want, matmul_cpu_reference(a, w.t(), bias, split=K))  # can fail
    for isa in ISAS:
        for bk, bn, threads in ((0, 0, 2), (100, 32, 1), (1000, 4096, 3)):
            got = mm(a, w.t(), bias, isa=isa, block_k=bk, block_n=bn, num_threads=threads)
            assert torch.equal(got, want), (isa, bk, bn, threads)
    assert torch.equal(mm(a[:1], w.t().contiguous(), None),
                       matmul_cpu_reference(a[:1], w.t(), None))


@pytest.mark.parametrize("split", [1, 7, 64, 333])
def test_matmul_explicit_split_matches_contract(split):
    g = _gen(split)
    a, b, bias = torch.randn(9, 700, generator=g), torch.randn(700, 45, generator=g), \
        torch.randn(45, generator=g)
    for isa in ISAS:
        assert torch.equal(mm(a, b, bias, split=split, isa=isa, block_k=50),
                           matmul_cpu_reference(a, b, bias, split=split))


def test_matmul_empty_and_k0():
    for M, N in ((0, 5), (5, 0), (0, 0)):
        out = torch.empty(M, N)
        matmul_f32(torch.empty(M, 3), torch.empty(3, N), None, out)
    bias = torch.tensor([1.5, -0.0, float("inf")])
    assert torch.equal(mm(torch.empty(2, 0), torch.empty(0, 3)), torch.zeros(2, 3))
    got = mm(torch.empty(2, 0), torch.empty(0, 3), bias)
    assert torch.equal(got, (torch.zeros(2, 3) + bias))  # 0.0f + bias: -0.0 becomes +0.0
    assert not torch.signbit(got[:, 1]).any()


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


@pytest.mark.parametrize("bf16", [False, True])
def test_batched_call_is_a_call_per_entry(bf16):
    """One kernel call for a whole batch (entry strides; whole entries per thread when there are
    enough, else each entry split across threads) writes each entry's bits as its own call."""
    ext = cpu_ext.require()
    g = _gen(11)
    for n_batch, M, N, K in ((1, 5, 40, 33), (3, 1, 80, 64), (40, 2, 37, 70), (7, 70, 300, 9)):
        a = torch.randn(n_batch, M, K, generator=g)
        w = torch.randn(n_batch, N, K, generator=g)
        if bf16:
            w = w.bfloat16()
        for b in (w.transpose(1, 2), w.transpose(1, 2).contiguous(), w[:1].transpose(1, 2)
                  .expand(n_batch, K, N)):
            want = torch.stack([mm(a[e], b[e].float()) for e in range(n_batch)])
            for threads in (1, 2, 3):
                got = torch.full((n_batch, M, N), float("nan"))
                ext.matmul_f32(a.data_ptr(), a.stride(1), a.stride(2), b.data_ptr(),
                               b.stride(1), b.stride(2), 0, got.data_ptr(), N, M, N, K, 0,
                               threads, "auto", 0, 0, bf16, n_batch, a.stride(0), b.stride(0), M * N,
                               fp32_fma=cpu_ext.fp32_fma())
                assert torch.equal(got, want), (n_batch, M, N, K, b.stride(), threads)


def test_kernels_share_torchs_openmp_runtime():
    """The extension's threads are torch's OpenMP pool: one libgomp in the process. A second
    runtime would put its threads next to torch's spinning workers (2x slower on 2 cores)."""
    script = ("import torch, bik; from bik.runtime import cpu_ext; cpu_ext.require()\n"
              "print(sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libgomp' in l}))")
    if not os.path.exists("/proc/self/maps"):
        pytest.skip("needs /proc/self/maps (Linux)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    libs = ast.literal_eval(out)
    assert len(libs) == 1 and "torch" in libs[0], libs


_FORK_CHILD = """
import os, sys, torch
from bik.runtime import cpu_ext
ext = cpu_ext.require()
a, w = torch.randn(256, 576), torch.randn(1536, 576)
def mm():
    out, b = torch.empty(256, 1536), w.t()
    ext.matmul_f32(a.data_ptr(), 576, 1, b.data_ptr(), b.stride(0), b.stride(1), 0,
                   out.data_ptr(), 1536, 256, 1536, 576, 0, 2)
    return out.numpy().tobytes()
want = mm()  # the parent's OpenMP pool now exists
pid = os.fork()
if pid == 0:  # no torch op with threads here: stock torch itself hangs in this child
    os._exit(0 if mm() == want else 3)
sys.exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_threaded_kernel_runs_in_a_forked_child():
    """libgomp's pool does not survive fork; a child's kernel call runs on fresh threads
    instead of waiting forever for the parent's (pthread_atfork in the extension)."""
    done = subprocess.run([sys.executable, "-c", _FORK_CHILD], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-2000:]


def test_caller_flush_denormal_does_not_change_bits():
    # Products here are denormal; the kernels honour them whatever the caller's FTZ/DAZ.
    a = torch.full((64, 512), 1e-20)
    b = torch.full((512, 256), 1e-20)
    want = matmul_cpu_reference(a[:1], b, None)
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


def test_matmul_accuracy_vs_fp64():
    g = _gen(9)
    M, N, K = 33, 200, 2048
    a, w, bias = (torch.randn(M, K, generator=g), torch.randn(N, K, generator=g),
                  torch.randn(N, generator=g))  # fmt: skip
    exact = a.double() @ w.t().double() + bias.double()
    err = (mm(a, w.t(), bias).double() - exact).abs().max().item()
    scale = (a.double().abs() @ w.t().double().abs()).max().item()
    assert err <= 4 * K * 2**-24 * scale, err  # loose sequential-sum bound


FMA_MNEMONICS = ("vfmadd", "vfmsub", "vfnmadd", "vfnmsub", "fmla", "fmadd")


def test_no_fused_multiply_add_in_binary():
    """-ffp-contract=off must hold in every ISA clone: an FMA would change the bits. The places
    FMAs are the contract are the bf16 dot path's FMA kernel and the fp32 fma sequence's
    (contract.h: each step is a fused multiply-add), which must have them."""
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump not found")
    dis = subprocess.run([objdump, "-d", "-C", cpu_ext._ext.__file__], capture_output=True,
                         text=True, check=False)
    assert dis.returncode == 0
    with_fma, function = set(), ""
    for line in dis.stdout.splitlines():
        if line.endswith(">:"):
            function = line
        elif any(f"\t{m}" in line for m in FMA_MNEMONICS):
            with_fma.add(function)
    # the FMA kernels' micro kernels, or their tiles where the compiler inlined one
    outside = [f for f in with_fma if "::dot::Fma" not in f and "::Fma32>" not in f]
    assert not outside, outside
    if cpu_ext._ext.isa_supported("avx2"):  # built for x86: the FMA kernels are there
        for isa in ("avx512", "avx2"):
            assert any(f"{isa}::dot::Fma" in f for f in with_fma), isa
            assert any(f"{isa}::Fma32>" in f for f in with_fma), isa
        # and the mul-add sequence's tiles have none
        assert not any("MulAdd32>" in f for f in with_fma)


def test_unavailable_reason_is_empty_when_built():
    assert cpu_ext.available() and cpu_ext.unavailable_reason() == ""
    assert cpu_ext.isa() in ISAS


# ---- a bf16 b, widened while packing -----------------------------------------------------------

def _bf16_b_layouts(k: int, n: int, gen: torch.Generator):
    """b [k, n] in bf16 as the kernel meets it: a weight.t() view, row-major, strided, and a
    broadcast (stride 0) row."""
    w = torch.randn(n, k, generator=gen).bfloat16()
    wide = torch.randn(k, 2 * n, generator=gen).bfloat16()
    row = torch.randn(1, n, generator=gen).bfloat16()
    return {"weight.t()": w.t(), "row-major": w.t().contiguous(), "strided": wide[:, ::2],
            "broadcast": row.expand(k, n)}


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("k,n", [(1, 1), (17, 33), (64, 100), (300, 70)])
def test_bf16_b_gives_the_bits_of_b_upcast_first(isa, k, n):
    """What launch_matmul relies on: b_bf16=True is the fp32 kernel on b.float(), bit for bit,
    for every layout, K blocking (block_k splits K) and ISA."""
    gen = _gen(k * 1000 + n)
    ext = cpu_ext.require()
    for name, b in _bf16_b_layouts(k, n, gen).items():
        for m in (1, 5, 33):
            a = torch.randn(m, k, generator=gen).bfloat16().float()
            bias = torch.randn(n, generator=gen)
            want = mm(a, b.float(), bias, isa=isa, block_k=16)
            got = torch.full((m, n), float("nan"))
            ext.matmul_f32(a.data_ptr(), a.stride(0), a.stride(1), b.data_ptr(), b.stride(0),
                           b.stride(1), bias.data_ptr(), got.data_ptr(), n, m, n, k, 0, 2,
                           isa, 16, 0, True)
            assert torch.equal(got, want), (name, m)


def test_bik_matmul_bf16_equals_its_fp32_upcast_product(gen):
    """The op end to end: bf16 operands (b read as bf16 by the kernel) give the fp32 product
    of their exact upcasts, rounded once."""
    import bik

    a = torch.randn(9, 96, generator=gen).bfloat16()
    w = torch.randn(40, 96, generator=gen).bfloat16()
    want = bik.matmul(a.float(), w.t().float(), backend="cpu").bfloat16()
    assert torch.equal(bik.linear(a, w, backend="cpu"), want)
    assert torch.equal(bik.bmm(a[None], w.t()[None], backend="cpu")[0], want)
