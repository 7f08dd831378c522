"""The CPU's bf16 AMX sequence (contract.h; csrc/cpu/matmul_bf16_amx.h): what tdpbf16ps
computes, its scalar transcription (amx_reference.h), the kernel against it (both ways it
reads an unpacked weight: pair panels as B tiles, or the weight's rows in place as A tiles),
the start-up self-test, and the default it is: every 2-D product route takes it where it
passes, bmm keeps the dot sequence (a product's AMX bits move with where its leading zeros
end, which left padding changes), and ``BIK_CPU_BF16=dot`` puts every route back on the dot
sequence.

The judge of the transcription is tools/amx_probe.py's model, in exact rational arithmetic,
which that tool checks against the instruction itself. Where the CPU has AMX these tests fail
rather than skip when the kernel is refused; elsewhere the kernel's tests skip and the
transcription's still run.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import bik
import pytest
import torch
from bik.configs import matmul_split
from bik.runtime import cpu_ext
from checks import alone_rows, bits_equal, child_with, cpu_flags, first_bad_m
from test_matmul_bf16_dot import _normal, _scalar_reference, _words

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason=cpu_ext.unavailable_reason())

TOOL = Path(__file__).resolve().parents[2] / "tools" / "amx_probe.py"


def _probe_tool():
    spec = importlib.util.spec_from_file_location("amx_probe", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def amx():
    """The AMX kernel must pass wherever the CPU has AMX's bf16 tiles: a refusal there fails."""
    if not {"amx_bf16", "amx_tile", "avx512f"} <= cpu_flags():
        pytest.skip("this CPU has no AMX bf16 tiles")
    assert cpu_ext.bf16_dot_refusal("amx") == "", cpu_ext.bf16_dot_refusal("amx")
    return cpu_ext.require()


def _kernel(a, b, bias, split: int, *, threads: int = 2, block_k: int = 0, block_n: int = 0,
            kernel: str = "amx", packed: torch.Tensor | None = None) -> torch.Tensor:
    m, k = a.shape
    n = b.shape[1]
    out = torch.full((m, n), float("nan"))
    bias32 = None if bias is None else bias.float().contiguous()
    cpu_ext.require().matmul_f32(
        a.data_ptr(), a.stride(0), a.stride(1), b.data_ptr(), b.stride(0), b.stride(1),
        0 if bias32 is None else bias32.data_ptr(), out.data_ptr(), n, m, n, k, split, threads,
        "auto", block_k, block_n, True, 1, 0, 0, 0, 0 if packed is None else packed.data_ptr(),
        True, kernel)
    return out


def _amx_reference(a, b, bias, split: int) -> torch.Tensor:
    return _scalar_reference(a, b, bias, split, sequence="amx")


# ---- the transcription (any CPU) -----------------------------------------------------------------


def test_the_transcription_is_the_measured_model():
    """amx_reference.h equals tools/amx_probe.py's model (exact rationals) on the tool's
    hand-made cases and on 300 two-block rows of words over the whole exponent range (the
    second block's incoming accumulator is the first block's result, as in the kernel)."""
    tool = _probe_tool()

    def bits(t: torch.Tensor) -> list[int]:
        return (t.view(torch.int16).int() & 0xFFFF).tolist()

    def bf16(words: list[int]) -> torch.Tensor:
        return torch.tensor(words, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)

    def check(a_words: list[int], b_words: list[int], want: int) -> None:
        got = _amx_reference(bf16(a_words).view(1, -1), bf16(b_words).view(-1, 1), None,
                             len(a_words))
        assert bits_equal(got, torch.tensor([[want]], dtype=torch.int64).to(torch.int32)
                          .view(torch.float32)), (a_words, b_words)

    for acc, terms in tool.cases().values():
        a, b = [0] * 32, [0] * 32
        for k, (x, y) in terms.items():
            a[k], b[k] = tool._bf16(x), tool._bf16(y)
        acc_bits = tool._bits(acc)
        if acc_bits & 0xFFFF or (acc_bits & 0x7F800000) == 0:  # acc must come from a block:
            if acc != 0:  # one term acc * 1, so a normal bf16 value
                continue
            check(a, b, tool.model(acc_bits, a, b))
            continue
        first = [acc_bits >> 16] + [0] * 31
        one = [0x3F80] + [0] * 31
        check(first + a, one + b, tool.model(tool.model(0, first, one), a, b))
    g = torch.Generator().manual_seed(1)
    for row in _words(g, 300, 2, 64):
        a, b = bits(row[0]), bits(row[1])
        check(a, b, tool.model(tool.model(0, a[:32], b[:32]), a[32:], b[32:]))


# ---- the kernel --------------------------------------------------------------------------------


@pytest.mark.parametrize("m,n,k", [(1, 33, 45), (7, 35, 64), (16, 32, 31), (17, 70, 300),
                                   (40, 100, 577)])
def test_kernel_equals_the_transcription(amx, m, n, k):
    """Every B layout, splits that end mid-block and odd, K blocks (rounded to whole
    32-term blocks), threads; words reaching the denormals, the flush and the overflow."""
    g = torch.Generator().manual_seed(m * 1000 + k)
    a = _words(g, m, k)
    w = _words(g, n, k)
    wide = _words(g, k, 2 * n)
    bias = torch.randn(n, generator=g)
    for b in (w.t(), w.t().contiguous(), wide[:, ::2]):
        for split in (k, 16, 45):
            want = _amx_reference(a, b, bias, split)
            for threads, block_k in ((2, 0), (1, 64), (3, 40)):
                got = _kernel(a, b, bias, split, threads=threads, block_k=block_k)
                assert bits_equal(got, want), (b.stride(), split, threads, block_k)


@pytest.mark.parametrize("m", [1, 8, 33, 64, 128, 129])
def test_weight_rows_in_place_equal_the_transcription(amx, m):
    """b = W.t() with up to 128 rows of x runs the product transposed, W's rows read in place as
    A tiles (amx_rows_product); past that the pair panels. Both equal the transcription and a
    PackedWeight's call: weight rows and x rows with strides past K, a row tail (N = 70), an odd
    K, splits that end mid-block, odd and of 192 (a bf16 layer's, 8 of them), words reaching the
    denormals, the flush and the overflow. Past K the rows hold inf and NaN: a block that read
    them against its zero padding would turn the sum into NaN."""
    g = torch.Generator().manual_seed(m)
    for n, k, splits in ((70, 577, (577, 45, 100)), (48, 1536, (192,))):
        x, w = _words(g, m, k + 3), _words(g, n, k + 5)
        x[:, k:], w[:, k:] = float("inf"), float("nan")
        x, w = x[:, :k], w[:, :k]
        bias = torch.randn(n, generator=g)
        for split in splits:
            want = _amx_reference(x, w.t(), bias, split)
            assert bits_equal(_kernel(x, w.t(), bias, split), want), (n, k, split)
    w = _normal(g, 48, 1536)
    x = _normal(g, m, 1536)
    packed = bik.PackedWeight(w)
    assert torch.equal(bik.linear(x, w), packed(x))


def test_packed_panels_and_batch_entries(amx):
    g = torch.Generator().manual_seed(7)
    x, w = _normal(g, 20, 1536), _normal(g, 70, 1536)
    split = matmul_split(torch.bfloat16, 70, 1536).split  # 8 splits of 192
    want = _amx_reference(x, w.t(), None, split)
    packed = bik.PackedWeight(w)
    got = _kernel(x, w.t(), None, split, packed=packed._panels)
    assert torch.equal(got, want)
    xb, wb = _normal(g, 5, 6, 64), _normal(g, 5, 64, 9)
    out = torch.full((5, 6, 9), float("nan"))
    cpu_ext.require().matmul_f32(xb.data_ptr(), 64, 1, wb.data_ptr(), 9, 1, 0, out.data_ptr(),
                                 9, 6, 9, 64, 0, 2, "auto", 0, 0, True, 5, 6 * 64, 64 * 9, 6 * 9,
                                 0, True, "amx")  # batch entries, whole entries per thread
    for e in range(5):
        assert torch.equal(out[e], _amx_reference(xb[e], wb[e], None, 64))


def test_the_probe_tells_amx_from_the_dot_sequence(amx):
    """The self-test's probes (which the AMX kernel passes: the fixture) are failed by the dot
    sequence's kernel, and the AMX kernel fails the dot sequence's transcription: neither could
    pass the other's self-test."""
    for probe in cpu_ext.require().bf16_dot_probe():
        a = torch.tensor(probe["a"], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
        b = torch.tensor(probe["b"], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
        a, b = a.view(probe["M"], probe["K"]), b.view(probe["K"], probe["N"])
        for split in probe["splits"]:
            amx_bits = _amx_reference(a, b, None, split)
            dot_bits = _scalar_reference(a, b, None, split)
            assert bits_equal(_kernel(a, b, None, split), amx_bits)
            assert not bits_equal(_kernel(a, b, None, split, kernel="fma"), amx_bits)
            assert not bits_equal(_kernel(a, b, None, split), dot_bits)


def test_the_instruction_is_the_model(amx):
    """tools/amx_probe.py: tdpbf16ps itself, one instruction per case, equals the model the
    transcription writes down (hand-made cases and 2000 random ones)."""
    done = subprocess.run([sys.executable, str(TOOL), "--random", "2000"], capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "2000 of 2000 equal the model" in done.stdout


# ---- the process's choice and the routes ---------------------------------------------------------


def _linear_bits(x, w, bias=None, sequence: str = "amx") -> torch.Tensor:
    """bik.linear's fp32 bits on ``sequence`` (before the one rounding to x's dtype)."""
    n, k = w.shape
    return _scalar_reference(x, w.t(), bias, matmul_split(torch.bfloat16, n, k).split,
                             sequence=sequence)


def test_a_leading_zero_moves_the_amx_bits_not_the_dot_ones(amx):
    """Why bmm keeps the dot sequence: a row whose K starts with exact zeros (a left-padded
    sequence's keys in an attention product p @ v) keeps the dot sequence's bits, whose one
    chain from +0 adds those zeros exactly, but not the AMX sequence's, whose 32-term blocks and
    two chains are cut where the zeros end."""
    g = torch.Generator().manual_seed(5)
    p, v = _normal(g, 4, 40), _normal(g, 40, 64)
    pad = torch.zeros(4, 3, dtype=torch.bfloat16)
    padded_p, padded_v = torch.cat([pad, p], 1), torch.cat([_normal(g, 3, 64), v], 0)
    for kernel, stays in (("fma", True), ("amx", False)):
        alone = _kernel(p, v, None, 40, kernel=kernel)
        shifted = _kernel(padded_p, padded_v, None, 43, kernel=kernel)
        assert torch.equal(alone, shifted) == stays, kernel


def test_bmm_keeps_left_padding_exact_where_2d_products_take_amx(amx):
    """This process's routes (AMX the default for 2-D products): bik.bmm and torch.bmm under
    bik.enable() give a left-padded attention product p @ v the bits of the unpadded one; the
    same product as a 2-D bik.matmul (AMX) does not, so the bmm check could fail."""
    assert cpu_ext.bf16_contract() == "amx+dot", cpu_ext.bf16_contract()
    g = torch.Generator().manual_seed(5)
    p, v = _normal(g, 2, 4, 40), _normal(g, 2, 40, 64)
    pad = torch.zeros(2, 4, 3, dtype=torch.bfloat16)
    padded_p, padded_v = torch.cat([pad, p], 2), torch.cat([_normal(g, 2, 3, 64), v], 1)
    alone = bik.bmm(p, v, out_dtype=torch.float32)
    assert torch.equal(bik.bmm(padded_p, padded_v, out_dtype=torch.float32), alone)
    with bik.enabled():
        assert torch.equal(torch.bmm(padded_p, padded_v), torch.bmm(p, v))
    flat = [bik.matmul(x[0], y[0], out_dtype=torch.float32)
            for x, y in ((p, v), (padded_p, padded_v))]
    assert not torch.equal(*flat)


def test_dot_puts_every_route_on_the_dot_sequence(amx, tmp_path):
    """``BIK_CPU_BF16=dot`` (before the process starts): bik.linear, PackedWeight and
    bik.enable()'s addmm give the dot sequence's bits, rows alone equal batched, the
    fingerprint says "dot" and its digest differs from this (default, AMX) process's."""
    g = torch.Generator().manual_seed(11)
    x, w, bias = _normal(g, 5, 4096), _normal(g, 40, 4096), _normal(g, 40)
    want = _linear_bits(x, w, bias, "dot")
    assert not torch.equal(want, _linear_bits(x, w, bias))  # the routes could fail
    assert torch.equal(bik.linear(x, w, bias, out_dtype=torch.float32), _linear_bits(x, w, bias))
    *same, contract, digest = child_with(cpu_ext.BF16_ENV, "dot", _CHILD, (x, w, bias, want),
                                         tmp_path)
    assert same == ["True"] * 4 and contract == "dot"
    assert digest != bik.fingerprint("cpu").digest
    assert bik.fingerprint("cpu").versions["cpu_bf16"] == "amx+dot"


_CHILD = """
import sys, torch, bik, torch.nn.functional as F
x, w, bias, want = torch.load(sys.argv[1])
f = bik.fingerprint('cpu')
with bik.enabled():
    mode = F.linear(x, w, bias)
packed = bik.PackedWeight(w)
rows = torch.cat([packed(x[i:i + 1], bias) for i in range(x.shape[0])])
print(torch.equal(bik.linear(x, w, bias, out_dtype=torch.float32), want),
      torch.equal(packed(x, bias), want.bfloat16()), torch.equal(mode, want.bfloat16()),
      torch.equal(rows, packed(x, bias)), f.versions['cpu_bf16'], f.digest)
"""


def test_rows_alone_equal_batched_and_a_batch_dependent_product_is_caught(amx):
    g = torch.Generator().manual_seed(3)
    w = _normal(g, 576, 1536)
    pool = _normal(g, 70, 1536)
    split = matmul_split(torch.bfloat16, 576, 1536).split

    def amx_rows(rows):
        return _kernel(rows, w.t(), None, split)

    assert first_bad_m(amx_rows, pool, alone_rows(amx_rows, pool)) is None

    def dependent(rows):  # the dot sequence alone, AMX's batched
        return _kernel(rows, w.t(), None, split, kernel="fma" if rows.shape[0] == 1 else "amx")

    assert first_bad_m(dependent, pool, alone_rows(dependent, pool)) is not None
