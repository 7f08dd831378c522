"""The compiled mode's C++ products: a graph compiled under batch_invariant_mode() with grad off
calls ``bik_native::matmul`` / ``bmm`` (csrc/native/native_cpu.cpp) where it would call
``bik::matmul`` / ``bmm`` on the CPU backend. They must be bik's ops bit for bit, served or not,
and appear only where the Python op would have no work to do (grad off, not exporting, CPU)."""

import bik
import pytest
import torch
import torch.nn.functional as F
from bik.ops import _native
from bik.runtime import cpu_ext
from bik.testing import rows_alone_vs_batched, same_bits
from torch._inductor.utils import run_and_get_code

pytestmark = [
    pytest.mark.skipif(not cpu_ext.available(), reason="CPU extension not built"),
    pytest.mark.skipif(not _native.ready(), reason="no C++ dispatcher kernels"),
]


@pytest.fixture(autouse=True)
def _fresh(fresh_dynamo):
    yield


def _graph_ops(fn, *args) -> list[str]:
    ops = []

    def capture(gm, example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    torch.compile(fn, fullgraph=True, backend=capture)(*args)
    return ops


def _model(x, w, b, w2):
    h = F.linear(x, w, b)
    scores = torch.matmul(h.unsqueeze(0), h.unsqueeze(0).transpose(1, 2))  # a bmm
    return F.linear(h, w2), scores


def _inputs(gen, dtype=torch.float32):
    return tuple(t.to(dtype) for t in (torch.randn(6, 40, generator=gen),
                                       torch.randn(24, 40, generator=gen),
                                       torch.randn(24, generator=gen),
                                       torch.randn(8, 24, generator=gen)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_no_grad_graph_calls_the_cpp_products_with_bik_bits(dtype, gen):
    args = _inputs(gen, dtype)
    with torch.no_grad(), bik.batch_invariant_mode():
        ops = _graph_ops(_model, *args)
        torch._dynamo.reset()
        got, code = run_and_get_code(torch.compile(_model, fullgraph=True), *args)
        want = _model(*args)  # eager under the mode: bik's Python route
    assert ops.count("bik_native.matmul") == 2 and ops.count("bik_native.bmm") == 1, ops
    assert "bik.matmul" not in ops and "bik.bmm" not in ops
    assert "torch.ops.bik_native.matmul.default" in "".join(code)
    assert same_bits(got[0], want[0]) and same_bits(got[1], want[1])


def test_a_compiled_no_grad_graph_is_batch_invariant(gen):
    _, w, b, w2 = _inputs(gen)
    pool = torch.randn(16, 40, generator=gen)
    fn = lambda x: F.linear(F.linear(x, w, b), w2)
    with torch.no_grad():
        assert not rows_alone_vs_batched(torch.compile(fn), pool, (1, 4, 16)).ok  # stock
        torch._dynamo.reset()
        with bik.batch_invariant_mode():
            report = rows_alone_vs_batched(torch.compile(fn, fullgraph=True), pool, (1, 4, 16))
    assert report.ok, report.summary()


def test_grad_on_export_and_opt_out_keep_bik_ops(gen, tmp_path, monkeypatch):
    args = _inputs(gen)
    with bik.batch_invariant_mode():  # grad on: the op with bik's backward
        ops = _graph_ops(_model, *args)
    assert "bik.matmul" in ops and "bik_native.matmul" not in ops, ops

    class M(torch.nn.Module):
        def forward(self, x, w, b, w2):
            return _model(x, w, b, w2)

    with torch.no_grad(), bik.batch_invariant_mode():  # an exported program stays portable
        program = torch.export.export(M(), args)
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert "bik.matmul.default" in targets and not any("bik_native" in t for t in targets)

    torch._dynamo.reset()
    monkeypatch.setenv("BIK_ENABLE_NATIVE", "0")
    with torch.no_grad(), bik.batch_invariant_mode():
        ops = _graph_ops(_model, *args)
    assert "bik.matmul" in ops and "bik_native.matmul" not in ops, ops


def _cases(gen):
    a, b = torch.randn(5, 12, generator=gen), torch.randn(12, 7, generator=gen)
    bias = torch.randn(7, generator=gen)
    return {
        "served": (a, b, bias, None),
        "served bf16": (a.bfloat16(), b.bfloat16(), bias.bfloat16(), None),
        "fp32 bias on bf16": (a.bfloat16(), b.bfloat16(), bias, None),
        "out_dtype fp32": (a.bfloat16(), b.bfloat16(), None, torch.float32),
        "no rows": (a[:0], b, None, None),
    }


@pytest.mark.parametrize("name", ["served", "served bf16", "fp32 bias on bf16",
                                  "out_dtype fp32", "no rows"])
def test_the_cpp_matmul_is_bik_matmul_served_or_not(name, gen):
    a, b, bias, out_dtype = _cases(gen)[name]
    got = torch.ops.bik_native.matmul(a, b, bias, out_dtype)
    want = torch.ops.bik.matmul(a, b, bias, out_dtype, "cpu")
    assert got.dtype == want.dtype and same_bits(got, want)
    batched = torch.ops.bik_native.bmm(a.unsqueeze(0).expand(2, -1, -1),
                                     b.unsqueeze(0).expand(2, -1, -1), out_dtype)
    assert same_bits(batched, torch.ops.bik.bmm(a.expand(2, -1, -1), b.expand(2, -1, -1),
                                                out_dtype, "cpu"))


def test_bad_input_gets_bik_matmuls_error(gen):
    a, b = torch.randn(5, 12, generator=gen), torch.randn(11, 7, generator=gen)
    with pytest.raises(ValueError, match=r"bik.matmul: a \[5, 12\] and b \[11, 7\]"):
        torch.ops.bik_native.matmul(a, b, None, None)
    with pytest.raises(ValueError, match="bik.bmm"):
        torch.ops.bik_native.bmm(a.unsqueeze(0), b.unsqueeze(0), None)
