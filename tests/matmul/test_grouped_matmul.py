"""bik.grouped_matmul (bik::grouped_matmul): every row's bits are bik.matmul's for that row and
its group's matrix, whatever the groups' sizes; accuracy, bad input, opcheck, torch.compile,
backward.

Targets: the CPU backend (bik::matmul's kernel per group) and the Triton kernel in the
interpreter (tests/conftest.py's fixed-tree dot; small sizes). The harness below is shown able
to fail on a grouped product whose K split follows its group's size (the GEMM libraries' way)
and on stock torch's grouped_mm, measured here.
"""

from __future__ import annotations

import bik
import pytest
import torch
from bik.ops.matmul.reference import grouped_matmul_reference
from bik.testing.controls import split_by_m_matmul
from bik.testing.harness import same_bits
from checks import DTYPES, accuracy_bound, max_err, randn
from targets import targets
from torch.library import opcheck

N, K, G = 24, 40, 5


def _ends(sizes) -> torch.Tensor:
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32)


def _ends_on(sizes, device) -> torch.Tensor:
    return _ends(sizes).to(device)


def skewed_layouts(s: int) -> dict[str, list[int]]:
    """Group sizes (G groups) of ``s`` rows routed the ways a router can skew them."""
    layouts = {"all on one": [0, 0, s, 0, 0],
               "empty between": [s // 2, 0, 0, 0, s - s // 2],
               "tail rows": [s // 3, 0, s // 3, 0, 0]}  # rows past the last end
    if s >= G:
        layouts["one each, rest last"] = [1, 1, 1, 1, s - 4]
    if s > 1:
        layouts["first and last"] = [1, 0, 0, 0, s - 1]
    return layouts


def rows_alone_report(fn, a, b, sizes) -> list[tuple[int, int]]:
    """(group, row) of every row of fn(a, b, ends) whose bits differ from the row run alone as
    the one row of its group; rows past the last end must be zeros."""
    out = fn(a, b, _ends_on(sizes, a.device))
    bad, start = [], 0
    for g, size in enumerate(sizes):
        for r in range(start, start + size):
            alone = fn(a[r:r + 1], b, _ends_on([0] * g + [1] + [0] * (G - g - 1), a.device))
            if not same_bits(out[r], alone[0]):
                bad.append((g, r))
        start += size
    if not torch.equal(out[start:], torch.zeros_like(out[start:])):
        bad.append((-1, start))
    return bad


def _bik(backend):
    return lambda a, b, ends: bik.grouped_matmul(a, b, ends, backend=backend)


def _group_split_by_rows(a, b, ends):
    """A grouped product whose K split follows the group's row count (NOT invariant)."""
    out, start = a.new_zeros(a.shape[0], b.shape[2]), 0
    for g, end in enumerate(ends.tolist()):
        if end > start:
            out[start:end] = split_by_m_matmul(a[start:end], b[g])
        start = end
    return out


def _inputs(gen, s, dtype, n=N, k=K):
    a = randn(gen, s, k, dtype=dtype)
    b = randn(gen, G, n, k, dtype=dtype).transpose(1, 2)  # experts' [G, N, K], no copy
    return a, b


@pytest.mark.parametrize("target", targets("cpu", "interpreter", "gpu-triton"))
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_are_their_own_whatever_the_routing(target, dtype, gen):
    if target.small and dtype != torch.float32:
        pytest.skip("fp32 only in the interpreter (~1 ms a program)")
    sizes = (1, 17, 33) if target.small else (1, 2, 3, 16, 17, 64, 255, 512)
    fn = _bik(target.backend)
    for s in sizes:
        a, b = (t.to(target.device) for t in _inputs(gen, s, dtype))
        for name, layout in skewed_layouts(s).items():
            assert not rows_alone_report(fn, a, b, layout), (s, name)


@pytest.mark.parametrize("target", targets("cpu", "interpreter", "gpu-triton"))
def test_a_row_has_bik_linears_bits(target, gen):
    """The contract: a row's product with its group's matrix is bik.matmul's (bik.linear's)."""
    a, b = (t.to(target.device) for t in _inputs(gen, 9, torch.float32))
    ends = _ends_on([2, 0, 4, 0, 3], target.device)
    out = bik.grouped_matmul(a, b, ends, backend=target.backend)
    for r, g in enumerate([0, 0, 2, 2, 2, 2, 4, 4, 4]):
        assert same_bits(out[r], bik.matmul(a[r:r + 1], b[g], backend=target.backend)[0]), r


@pytest.mark.parametrize("control", ["split by group size", "stock grouped_mm"])
def test_the_harness_rejects_a_product_tiled_by_group_size(control, gen):
    """The negative controls: the same report flags them (stock measured, not assumed)."""
    fn = _group_split_by_rows if control == "split by group size" else \
        (lambda a, b, ends: torch._grouped_mm(a, b, ends))
    found = False
    for s in (3, 17, 64, 255):
        a, b = _inputs(gen, s, torch.float32, n=64, k=256)
        found = found or any(rows_alone_report(fn, a, b, layout)
                             for layout in skewed_layouts(s).values())
    assert found, f"{control}: no row differed; the control no longer shows the test can fail"


@pytest.mark.parametrize("target", targets())
@pytest.mark.parametrize("dtype", DTYPES)
def test_accuracy_against_fp64(target, dtype, gen):
    if target.small and dtype != torch.float32:
        pytest.skip("fp32 only in the interpreter")
    a, b = _inputs(gen, 30, dtype, n=32, k=96)
    ends = _ends([7, 0, 13, 10, 0])
    out = bik.grouped_matmul(a, b, ends, backend=target.backend)
    ref = grouped_matmul_reference(a, b, ends)
    stock = torch._grouped_mm(a, b, ends)
    assert max_err(out, ref) <= accuracy_bound(dtype, stock, ref)
    assert out.dtype == dtype and out.shape == (30, 32)


@pytest.mark.parametrize("target", targets())
def test_out_dtype_and_empty_sizes(target, gen):
    a, b = _inputs(gen, 6, torch.bfloat16)
    ends = _ends([3, 0, 3, 0, 0])
    out = bik.grouped_matmul(a, b, ends, out_dtype=torch.float32, backend=target.backend)
    assert out.dtype == torch.float32
    assert same_bits(out[3], bik.matmul(a[3:4], b[2], out_dtype=torch.float32,
                                        backend=target.backend)[0])
    empty = bik.grouped_matmul(a[:0], b, _ends([0] * G), backend=target.backend)
    assert empty.shape == (0, N)
    zero_k = bik.grouped_matmul(a[:, :0], b[:, :0], ends, backend=target.backend)
    assert torch.equal(zero_k, torch.zeros(6, N, dtype=torch.bfloat16))


def test_nan_rows_stay_in_their_row(gen):
    a, b = _inputs(gen, 8, torch.float32)
    ends = _ends([4, 0, 4, 0, 0])
    clean = bik.grouped_matmul(a, b, ends)
    a[1, 5] = float("nan")
    a[6, 0] = float("inf")
    dirty = bik.grouped_matmul(a, b, ends)
    assert dirty[1].isnan().all() and not dirty[6].isfinite().any()
    keep = [0, 2, 3, 4, 5, 7]
    assert same_bits(dirty[keep], clean[keep])


@pytest.mark.parametrize("bad, match", [
    (lambda a, b, e: (a, b, torch.tensor([3, 2, 8, 8, 8])), r"ends\[1\] = 2 after 3"),
    (lambda a, b, e: (a, b, torch.tensor([3, 3, 9, 9, 9])), r"within the 8 rows of a"),
    (lambda a, b, e: (a, b, torch.tensor([3, 3, 8, 8])), r"one end per group"),
    (lambda a, b, e: (a, b, e.float()), r"int32 or int64"),
    (lambda a, b, e: (a[:, :7], b, e), r"disagree on K"),
    (lambda a, b, e: (a, b[0], e), r"b must be 3-D"),
    (lambda a, b, e: (a, b.double(), e), r"dtype"),
])
def test_bad_input_names_the_op_and_the_value(bad, match, gen):
    a, b = _inputs(gen, 8, torch.float32)
    with pytest.raises((ValueError, TypeError), match=match) as info:
        bik.grouped_matmul(*bad(a, b, _ends([3, 0, 5, 0, 0])))
    assert "bik.grouped_matmul" in str(info.value)


def test_the_cuda_backend_is_refused_by_the_table(gen):
    a, b = _inputs(gen, 4, torch.float32)
    with pytest.raises(bik.BackendUnavailableError, match=r"backend='cuda' does not implement"):
        bik.grouped_matmul(a, b, _ends([4, 0, 0, 0, 0]), backend="cuda")


@pytest.mark.parametrize("target", targets())
def test_opcheck(target, gen):
    a, b = _inputs(gen, 7, torch.float32)
    ends = _ends([2, 0, 5, 0, 0])
    opcheck(torch.ops.bik.grouped_matmul.default, (a, b, ends, None, target.backend))
    a.requires_grad_()
    opcheck(torch.ops.bik.grouped_matmul.default, (a, b.detach().requires_grad_(), ends,
                                                   None, target.backend))


@pytest.mark.parametrize("target", targets("cpu"))
def test_compiled_gives_the_eager_bits(target, gen, fresh_dynamo):
    a, b = _inputs(gen, 11, torch.bfloat16)
    ends = _ends([4, 0, 5, 2, 0])

    def experts(a, b, ends):
        return torch.relu(bik.grouped_matmul(a, b, ends, backend=target.backend)) * 2

    got = torch.compile(experts, fullgraph=True)(a, b, ends)
    assert same_bits(got, experts(a, b, ends))


@pytest.mark.parametrize("target", targets())
def test_backward(target, gen):
    """grad_a rows are their own (a grouped product by b^T); grad_b[g] is a_g^T @ grad_g by
    bik.matmul; both within fp64 autograd's accuracy; empty groups get zero gradients."""
    a, b = _inputs(gen, 9, torch.float32)
    ends = _ends([3, 0, 6, 0, 0])
    u = randn(gen, 9, N)
    a1, b1 = a.clone().requires_grad_(), b.detach().clone().requires_grad_()
    torch.autograd.backward(bik.grouped_matmul(a1, b1, ends, backend=target.backend), u)
    a2, b2 = a.double().requires_grad_(), b.double().detach().requires_grad_()
    torch.autograd.backward(grouped_matmul_reference(a2, b2, ends), u.double())
    assert max_err(a1.grad, a2.grad) < 1e-4 and max_err(b1.grad, b2.grad) < 1e-4
    assert torch.equal(b1.grad[[1, 3, 4]], torch.zeros(3, K, N))
    # a row's input gradient alone: the same bits
    for r, g in ((0, 0), (5, 2)):
        one = a[r:r + 1].clone().requires_grad_()
        ends1 = _ends([0] * g + [1] + [0] * (G - g - 1))
        torch.autograd.backward(bik.grouped_matmul(one, b, ends1, backend=target.backend),
                                u[r:r + 1])
        assert same_bits(one.grad[0], a1.grad[r]), r
    assert same_bits(b1.grad[2], bik.matmul(a[3:9].t().contiguous(), u[3:9],
                                            backend=target.backend))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_ends_stay_on_the_device_and_are_clamped(gen):
    """No host read (a CUDA graph can capture it); ends that decrease or pass S give empty
    groups and zero rows, never a read outside a."""
    from bik.testing.host_reads import forbid_host_reads

    a, b = (t.cuda() for t in _inputs(gen, 8, torch.bfloat16))
    good = torch.tensor([3, 3, 8, 8, 8], device="cuda")
    with forbid_host_reads():
        out = bik.grouped_matmul(a, b, good)
    torch.cuda.synchronize()
    assert same_bits(out[4], bik.matmul(a[4:5], b[2])[0])
    bad = bik.grouped_matmul(a, b, torch.tensor([5, 2, 99, 1, 8], device="cuda"))
    want = torch.cat([bik.matmul(a[:5], b[0]), bik.matmul(a[5:], b[2])])
    assert same_bits(bad, want)
