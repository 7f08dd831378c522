"""The backward of matmul and rms_norm on the Triton kernels, run by TRITON_INTERPRET=1 (its own
process, as tests/test_triton_interpreter.py; elsewhere skipped).

The backward is built from bik's forward kernels, so this proves that the input gradients
(grad_a, grad_x) of a row keep the forward's row invariance on the Triton backend, with the
same limits as the forward interpreter tests (a dot that treats every row of a tile alike).
"""

import backward_cases as bc
import bik
import pytest
import torch
from conftest import INTERPRETER

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(not INTERPRETER, reason="needs TRITON_INTERPRET=1 (own process)"),
]

MS = (1, 2, 3, 17)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_grad_a_rows_invariant(dtype, gen):
    rep = bc.linear_grad_a_report("triton", dtype, MS, 40, 33, gen)
    assert rep.ok, rep.summary()


@pytest.mark.parametrize("fused", [False, True])
def test_rms_norm_grad_x_rows_invariant(fused, gen):
    rep = bc.rms_norm_grad_x_report("triton", torch.float32, MS, 111, gen, fused=fused)
    assert rep.ok, rep.summary()


def test_bmm_grad_a_rows_invariant(gen):
    rep = bc.bmm_grad_a_report("triton", torch.float32, (1, 2, 5), 2, 24, 20, gen)
    assert rep.ok, rep.summary()


def test_weight_grads_match_the_cpu_backend_closely(gen):
    x, w = torch.randn(9, 40, generator=gen), torch.randn(33, 40, generator=gen)
    b, u = torch.randn(33, generator=gen), torch.randn(9, 33, generator=gen)
    grads = {}
    for backend in ("cpu", "triton"):
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        bik.linear(*leaves, backend=backend).backward(u)
        grads[backend] = [t.grad for t in leaves]
    for g_cpu, g_tri in zip(grads["cpu"], grads["triton"]):
        torch.testing.assert_close(g_tri, g_cpu, rtol=1e-5, atol=1e-5)
