"""The CUDA C++ kernels' declarations (``KERNELS`` in bik/ops/<op>/cuda.py) against the sources.

A declaration is the one Python statement of a kernel's ABI: its ``extern "C"`` name, its .cu
file and its parameters' kinds, which the launcher packs its arguments by
(``cuda_jit.launch_kernel``) and the host build dispatches on. Here each one is held to the
compiled signature: kernels_host.cpp is built by g++ from the real sources with the declared
names (a name the sources lack does not compile) and reports every parameter's kind from the
function's type. test_cuda_compile.py checks the other direction (every kernel NVRTC compiles
is declared).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bik.runtime import cuda_jit
from cuda_host_build import declared_kernels

_LETTER = {cuda_jit.PTR: "p", cuda_jit.I32: "i", cuda_jit.I64: "l", cuda_jit.F32: "f"}


def _compiled_kinds(host_lib, name: str) -> str | None:
    found = host_lib.kernel_kinds(name.encode())
    return None if found is None else found.decode()


def test_every_op_with_a_cuda_backend_declares_its_kernels():
    declared = declared_kernels()
    by_source = {decl.source for decl in declared.values()}
    assert by_source == {"attention", "matmul", "matmul_sm90", "rms_norm", "sampling"}
    assert len(declared) == 48  # RMSNorm: scalar, vector and block-per-row x 9 dtype pairs


def test_declarations_match_the_compiled_signatures(host_lib):
    wrong = {}
    for name, decl in declared_kernels().items():
        expected = "".join(_LETTER[k] for k in decl.kinds)
        compiled = _compiled_kinds(host_lib, name)
        if compiled != expected:
            wrong[name] = (expected, compiled)
    assert not wrong, wrong


def test_the_check_sees_every_kind(host_lib):
    """Control: the compiled kinds tell a pointer from an int64 and an int32 from a float, so a
    declaration with one kind swapped would not match."""
    decl = declared_kernels()["bik_rms_norm_f32_f32"]
    compiled = _compiled_kinds(host_lib, "bik_rms_norm_f32_f32")
    assert compiled == "plplpplplllf"
    swapped = list(decl.kinds)
    swapped[1] = cuda_jit.PTR  # stride_x declared as a pointer
    assert "".join(_LETTER[k] for k in swapped) != compiled
    assert set(_compiled_kinds(host_lib, "bik_attention_bf16_d64")) == {"p", "l", "i", "f"}
    assert _compiled_kinds(host_lib, "bik_no_such_kernel") is None


def test_pack_follows_the_declaration():
    decl = declared_kernels()["bik_matmul_reduce"]
    args = (torch.zeros(1), None, torch.zeros(1), 1, 2, 3, 4, 5, 6, 7, 0)
    packed = cuda_jit.pack("bik_matmul_reduce", decl, args)
    assert [type(v) for v in packed[3:]] == [np.int32] * 4 + [np.int64] * 3 + [np.int32]
    assert packed[1] is None and packed[0] is args[0]


@pytest.mark.parametrize(("at", "value", "match"), [
    (None, None, r"bik_matmul_reduce \(matmul.cu\) takes 11 arguments \(ws, bias, c, batch"),
    (3, 1.5, r"argument 3 \(batch\) is an int32, got float"),
    (7, cuda_jit.i32(1), r"argument 7 \(scb\) is an int64, got int32"),
    (0, 3, r"argument 0 \(ws\) is a pointer \(tensor or None\), got int"),
    (4, torch.zeros(1), r"argument 4 \(m\) is an int32, got Tensor"),
])
def test_pack_names_the_kernel_and_the_bad_argument(at, value, match):
    decl = declared_kernels()["bik_matmul_reduce"]
    args = [torch.zeros(1), None, torch.zeros(1), 1, 2, 3, 4, 5, 6, 7, 0]
    if at is None:
        args.pop()
    else:
        args[at] = value
    with pytest.raises(TypeError, match=match):
        cuda_jit.pack("bik_matmul_reduce", decl, args)


def test_launch_kernel_refuses_an_undeclared_name():
    with pytest.raises(ValueError, match="bik_nope is not declared"):
        cuda_jit.launch_kernel({}, "bik_nope", (1, 1, 1), (1, 1, 1), 0, device=torch.device("cpu"))
