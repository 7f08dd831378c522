"""Backward of bik.attention_varlen on the Triton backend, run by TRITON_INTERPRET=1 (its own
process, as tests/test_triton_interpreter.py; elsewhere skipped).

The backward is bik::bmm on the Triton matmul kernel plus elementwise ops, with the Triton
attention kernel's (out, lse): a sequence's dq/dk/dv keep their bits alone and at every position
among other sequences, and agree with the CPU backend closely.
"""

import attention_backward_cases as abc_
import pytest
import torch
from conftest import INTERPRETER

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(not INTERPRETER, reason="needs TRITON_INTERPRET=1 (own process)"),
]

PROBE = (5, 40)  # 40 keys cross the interpreter's 32-key attention split
NEIGHBOURS = ((1, 7), (9, 9), (0, 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sequence_grads_alone_vs_packed(dtype, gen):
    kw = {"hq": 4, "hkv": 2, "d": 16, "dtype": dtype}
    probe = abc_.make_seq(gen, *PROBE, **kw)
    others = abc_.neighbours(gen, NEIGHBOURS, **kw)
    rep = abc_.alone_vs_packed(abc_.pack_grads("triton"), probe, others,
                               f"attention grads triton {dtype}")
    assert rep.ok, rep.summary()


def test_grads_match_the_cpu_backend_closely(gen):
    seqs = abc_.neighbours(gen, (PROBE, (2, 9)), hq=4, hkv=1, d=16)
    for tri, ref in zip(abc_.pack_grads("triton")(seqs), abc_.pack_grads("cpu")(seqs)):
        for g_tri, g_cpu in zip(tri, ref):
            torch.testing.assert_close(g_tri, g_cpu, rtol=2e-5, atol=2e-5)
