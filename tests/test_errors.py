"""Bad input raises ValueError/TypeError naming the op and the offending shape/dtype/device;
an explicit backend that cannot run raises BackendUnavailableError. Nothing falls back."""

import bik
import pytest
import torch
from bik.runtime import cpu_ext
from op_cases import CASES

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason="CPU extension not built")

A = torch.zeros(4, 8)
B = torch.zeros(8, 3)


@pytest.mark.parametrize(
    "call, exc, pattern",
    [
        (lambda: bik.matmul(A, torch.zeros(7, 3)), ValueError, r"bik.matmul: a \[4, 8\] and b \[7, 3\] disagree on K"),
        (lambda: bik.matmul(A, torch.zeros(8)), ValueError, r"bik.matmul: b must be 2-D, got shape \[8\]"),
        (lambda: bik.matmul(torch.tensor(1.0), B), ValueError, "bik.matmul: a must have at least 1 dim"),
        (lambda: bik.matmul(A.double(), B.double()), TypeError, "bik.matmul: a has dtype float64"),
        (lambda: bik.matmul(A.int(), B.int()), TypeError, "bik.matmul: a has dtype int32"),
        (lambda: bik.matmul(A, B.half()), TypeError, r"bik.matmul: a \(float32\) and b \(float16\)"),
        (lambda: bik.matmul(A, B, torch.zeros(4)), ValueError, r"bik.matmul: bias \[4\] does not match N = 3"),
        (lambda: bik.matmul(A, B, torch.zeros(1, 3)), ValueError, r"bik.matmul: bias must be 1-D"),
        (lambda: bik.matmul(A, B, out_dtype=torch.int8), TypeError, "bik.matmul: out_dtype"),
        (lambda: bik.matmul(A, "b"), TypeError, "bik.matmul: b must be a torch.Tensor, got str"),
        (lambda: bik.matmul(A, B, backend="gpu"), ValueError, "bik.matmul: unknown backend 'gpu'"),
        (lambda: bik.linear(A, torch.zeros(3, 7)), ValueError, r"bik.linear: x \[4, 8\] and weight \[3, 7\] disagree on K"),
        (lambda: bik.matmul(A, B, out_dtype="float16"), TypeError, "bik.matmul: out_dtype"),
        (lambda: bik.rms_norm(A, torch.zeros(8), eps=1e39), ValueError, "bik.rms_norm: eps must be finite in fp32"),
        (lambda: bik.bmm(A, B), ValueError, r"bik.bmm: a must be 3-D, got shape \[4, 8\]"),
        (lambda: bik.bmm(torch.zeros(2, 4, 8), torch.zeros(3, 8, 5)), ValueError, "bik.bmm: .* batch size"),
        (lambda: bik.rms_norm(A, torch.zeros(7)), ValueError, r"bik.rms_norm: weight \[7\] does not match the hidden size of x \[4, 8\]"),
        (lambda: bik.rms_norm(A, torch.zeros(8), eps=-1e-6), ValueError, "bik.rms_norm: eps must be finite in fp32 and >= 0"),
        (lambda: bik.rms_norm(A, torch.zeros(8), eps=float("nan")), ValueError, "bik.rms_norm: eps must be finite"),
        (lambda: bik.rms_norm(A, torch.zeros(8), eps=float("inf")), ValueError, "bik.rms_norm: eps must be finite"),
        (lambda: bik.rms_norm(A.double(), torch.zeros(8)), TypeError, "bik.rms_norm: x has dtype float64"),
        (lambda: bik.rms_norm(A, torch.zeros(8), residual=torch.zeros(4, 7)), ValueError, r"bik.rms_norm: residual \[4, 7\] must match x \[4, 8\]"),
        (lambda: bik.rms_norm(A, torch.zeros(8), residual=A.half()), TypeError, "bik.rms_norm: residual .* must have x's dtype"),
    ],
)
def test_bad_input_names_op_and_shapes(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


_DENSE_ONLY = {name: call for case in CASES.values() for name, call in case.sparse.items()}


@pytest.mark.parametrize("name", list(_DENSE_ONLY))
def test_sparse_inputs_name_the_op(name):
    """Before: "Cannot access data pointer ...", "reshape is not implemented for sparse
    tensors", or the dispatcher's NotImplementedError for the SparseCPU key."""
    op = name.split()[0]
    with pytest.raises(TypeError, match=rf"bik.{op}: \w+ must be a dense \(strided\) tensor, "
                                        r"got layout sparse_coo"):
        _DENSE_ONLY[name]()


def test_rms_norm_refuses_a_bool_eps_and_zeros_a_row_whose_square_overflows():
    with pytest.raises(TypeError, match="bik.rms_norm: eps must be a float, got bool"):
        bik.rms_norm(A, torch.ones(8), eps=True)  # torch.ops.bik would take it as 1.0
    x = torch.tensor([[2e19, 1.0, -3.0, 4.0], [1.0, 2.0, 3.0, 4.0]])
    out = bik.rms_norm(x, torch.ones(4))
    assert torch.equal(out[0], torch.zeros(4))  # (2e19)^2 is inf in fp32: rstd = 0
    assert torch.equal(out[1], bik.rms_norm(x[1:], torch.ones(4))[0])  # its neighbour is fine


def test_registered_ops_check_inputs_too():
    with pytest.raises(ValueError, match="bik.matmul: a .* disagree on K"):
        torch.ops.bik.matmul(A, torch.zeros(5, 3), None, None, "cpu")


def test_triton_backend_on_cpu_tensors_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(bik.BackendUnavailableError, match="backend='triton' got CPU tensors"):
        bik.matmul(A, B, backend="triton")
    with pytest.raises(bik.BackendUnavailableError, match="bik.rms_norm: backend='triton'"):
        bik.rms_norm(A, torch.ones(8), backend="triton")


def test_cuda_backend_is_not_built_yet():
    with pytest.raises(bik.BackendUnavailableError, match="backend='cuda'"):
        bik.matmul(A, B, backend="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA for a mixed-device case")
def test_mixed_devices_are_rejected():
    with pytest.raises(ValueError, match="bik.matmul: a is on cpu but b is on cuda"):
        torch.ops.bik.matmul(A, B.cuda(), None, None, "cpu")


def test_mixed_devices_are_rejected_with_meta_tensors():
    """Without a GPU, meta tensors stand in for a second device."""
    with pytest.raises(ValueError, match="bik.matmul: a is on cpu but b is on meta"):
        bik.matmul(A, B.to("meta"))


def test_unavailable_cpu_extension_is_reported(monkeypatch):
    monkeypatch.setattr(cpu_ext, "available", lambda: False)
    monkeypatch.setattr(cpu_ext, "unavailable_reason", lambda: "extension not built")
    with pytest.raises(bik.BackendUnavailableError, match="backend='cpu' is unavailable: extension not built"):
        bik.matmul(A, B)


def test_backward_raises_instead_of_silently_dropping_gradients():
    # matmul, rms_norm and attention_varlen have a backward; the KV-cache attention does not.
    q = torch.randn(3, 4, 16, requires_grad=True)
    k = torch.randn(1, 3, 2, 16)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    out = bik.attention(q, k, k, cache_seqlens=torch.tensor([3]), cu_seqlens_q=cu)
    with pytest.raises(NotImplementedError, match="bik.attention: backward is not impl"):
        out.sum().backward()
    assert q.grad is None


def test_launcher_checks_survive_python_O():
    """The CPU launchers hand raw pointers to C++: their checks are real checks, so under
    ``python -O`` (which strips asserts; the old asserts let this call corrupt the heap) a
    wrong out still raises ValueError naming the launcher."""
    import subprocess
    import sys

    code = ("import torch\n"
            "from bik.ops.matmul.cpu import matmul_f32\n"
            "try:\n"
            "    matmul_f32(torch.randn(8, 64), torch.randn(64, 32), None, torch.empty(2, 2))\n"
            "except ValueError as e:\n"
            "    print('raised:', e)\n")
    proc = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "raised: bik.ops.matmul.cpu.matmul_f32: a [8, 64] @ b [64, 32] needs a contiguous " \
           "out [8, 32]" in proc.stdout
