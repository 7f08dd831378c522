"""When the front ends and bik's public functions skip torch.ops.bik (ops/_call.py), and that
they stay correct when they do not: the direct path must never hide an op from a tracer, a
fake tensor, another dispatch mode, or autograd."""

import bik
import pytest
import torch
from bik.ops._call import direct_ok
from bik.runtime import cpu_ext
from bik.testing import same_bits
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason="CPU extension not built")


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_direct_for_plain_tensors_and_not_when_autograd_must_record():
    x, w = torch.randn(2, 4), torch.randn(4, 3, requires_grad=True)
    assert direct_ok(x) and direct_ok(x, None)
    assert not direct_ok(x, w)  # grad enabled and w requires grad
    with torch.no_grad():
        assert direct_ok(x, w)


def test_not_direct_for_fake_tensors_or_under_another_mode():
    with FakeTensorMode() as fake:
        assert not direct_ok(fake.from_tensor(torch.randn(2, 4)))
    with _Recorder():
        assert not direct_ok(torch.randn(2, 2))


def test_another_dispatch_mode_still_sees_bik_matmul(gen):
    a, b = torch.randn(3, 8, generator=gen), torch.randn(8, 5, generator=gen)
    with _Recorder() as rec:
        out = bik.matmul(a, b)
    assert "bik.matmul.default" in rec.ops
    assert same_bits(out, torch.ops.bik.matmul(a, b, None, None, "cpu"))


def test_below_an_override_requires_grad_inputs_go_direct(gen):
    """Inside bik.enable()'s kernel autograd is below us: the direct path is taken even for
    inputs that require grad, and the stock formula (recorded above) gives the gradient."""
    seen = {}
    real = direct_ok

    def spy(*tensors):
        seen.setdefault("calls", []).append(real(*tensors))
        return seen["calls"][-1]

    x = torch.randn(3, 8, generator=gen)
    w = torch.randn(5, 8, generator=gen, requires_grad=True)
    import bik.ops._call as kernels

    kernels.direct_ok, saved = spy, kernels.direct_ok
    try:
        with bik.enabled():
            y = torch.nn.functional.linear(x, w)
            y.sum().backward()
    finally:
        kernels.direct_ok = saved
    assert seen["calls"] and all(seen["calls"])
    assert same_bits(y.detach(), bik.linear(x, w.detach()))
    torch.testing.assert_close(w.grad, torch.ones(3, 5).t() @ x)
