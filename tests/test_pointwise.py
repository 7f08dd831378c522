"""bik.ops._pointwise: each output a pure function of its input value, and the measurements
of torch's CPU kernels its module docstring states, re-measured on the running torch.

Position: a value is put at every index of tensors of length 1 .. 67 (SIMD bodies of 8 and 16
floats and every tail) at storage offsets 0 .. 7, each tensor one call, and its bits compared
with the value's alone (a length-1 call).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import bik
import pytest
import torch
import torch.nn.functional as F
from bik.ops._pointwise import LOG2E, exp2_f32, exp_f32, sigmoid_f32, silu_f32
from bik.runtime import cpu_ext

needs_ext = pytest.mark.skipif(not cpu_ext.available(), reason=cpu_ext.unavailable_reason())
# torch's "default" CPU kernel is scalar everywhere: no SIMD body, nothing to differ.
needs_simd = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() == "DEFAULT",
                                reason="torch runs its scalar CPU kernels here")


def _values() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.cat([torch.randn(120, generator=gen) * 10,
                      torch.rand(120, generator=gen) * 180 - 100,
                      torch.randn(40, generator=gen) * 0.01,
                      torch.tensor([0.0, -0.0, 88.7, 88.8, -87.3, -103.0, -104.0, 1e-30])])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def lengths_where_bits_move(fn, max_len: int = 67) -> list[int]:
    """The lengths n at which some value's bits, computed inside a length-n call, differ from
    the value computed alone."""
    vals = _values()
    alone = _bits(torch.cat([fn(v.reshape(1)) for v in vals]))
    moved = []
    for n in range(1, max_len + 1):
        for shift in range(n):  # the values start at index `shift` of the first call
            off = shift % 8
            calls = (shift + len(vals) + n - 1) // n
            buf = torch.randn(off + calls * n, generator=torch.Generator().manual_seed(n))
            buf[off + shift:off + shift + len(vals)] = vals
            out = torch.cat([fn(buf[off + c * n:off + (c + 1) * n]) for c in range(calls)])
            if not torch.equal(_bits(out[shift:shift + len(vals)]), alone):
                moved.append(n)
                break
    return moved


def test_torch_exp_is_position_independent_here():
    """The finding in the module's docstring: torch.exp runs its tail as a partial vector, so
    a value's bits do not move with its index or the tensor's length (silu_f32 relies on it)."""
    assert lengths_where_bits_move(torch.exp) == []


@needs_simd
@pytest.mark.parametrize("fn", [torch.exp2, torch.sigmoid, F.silu], ids=lambda f: f.__name__)
def test_torch_exp2_sigmoid_and_silu_move_with_position(fn):
    """Negative control (measured, torch 2.13 on AVX2: every length from 16 on)."""
    assert lengths_where_bits_move(fn) != []


@needs_ext
@pytest.mark.parametrize("fn", [exp_f32, exp2_f32], ids=lambda f: f.__name__)
def test_bik_exp_bits_do_not_move_with_position(fn):
    assert lengths_where_bits_move(fn) == []


@pytest.mark.parametrize("fn", [sigmoid_f32, silu_f32], ids=lambda f: f.__name__)
def test_bik_silu_bits_do_not_move_with_position(fn):
    assert lengths_where_bits_move(fn) == []


def test_silu_f32_has_silus_gradient():
    """The front ends' function layer runs silu above autograd: its gradient is autograd's
    through silu_f32's ops (an exp autograd cannot see gave a wrong one)."""
    x = (4 * torch.randn(5, 40, generator=torch.Generator().manual_seed(3))).requires_grad_()
    silu_f32(x).sum().backward()
    s = torch.sigmoid(x.detach().double())
    torch.testing.assert_close(x.grad.double(), s * (1 + x.detach().double() * (1 - s)),
                               rtol=1e-5, atol=1e-6)


_SCALAR_RUN = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from bik.ops._pointwise import exp_f32, silu_f32
x = torch.load(sys.argv[2])
torch.save({"torch.exp2": torch.exp2(x), "exp_f32": exp_f32(x), "silu_f32": silu_f32(x)},
           sys.argv[3])
"""


@needs_ext
@needs_simd
def test_bik_pointwise_bits_do_not_depend_on_torch_simd_kernels(tmp_path):
    """The same bits when torch runs its scalar CPU kernels (ATEN_CPU_CAPABILITY=default):
    exp_f32 by construction, silu_f32 as measured of torch.exp. torch.exp2's differing shows
    the subprocess did run them."""
    gen = torch.Generator().manual_seed(1)
    x = torch.cat([torch.randn(20000, generator=gen) * 10,
                   torch.rand(20000, generator=gen) * 180 - 100])
    torch.save(x, tmp_path / "x.pt")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    package_parent = str(Path(bik.__file__).resolve().parents[1])
    subprocess.run([sys.executable, "-c", _SCALAR_RUN, package_parent, str(tmp_path / "x.pt"),
                    str(tmp_path / "out.pt")], env=env, check=True, timeout=300)
    scalar = torch.load(tmp_path / "out.pt")
    assert not torch.equal(_bits(scalar["torch.exp2"]), _bits(torch.exp2(x)))
    assert torch.equal(_bits(scalar["exp_f32"]), _bits(exp_f32(x)))
    assert torch.equal(_bits(scalar["silu_f32"]), _bits(silu_f32(x)))


@needs_ext
def test_exp_f32_is_close_to_exp_and_right_at_the_edges():
    x = _values()
    torch.testing.assert_close(exp_f32(x), torch.exp(x.double()).float(), rtol=3e-7,
                               atol=3e-45)  # subnormal results: 2 of their units
    inf, nan = float("inf"), float("nan")
    edges = torch.tensor([inf, -inf, nan, 3e38, -3e38, 200.0, -200.0, 0.0, -0.0])
    want = torch.tensor([inf, 0.0, nan, inf, 0.0, inf, 0.0, 1.0, 1.0])
    assert torch.equal(_bits(exp_f32(edges)), _bits(want))


@needs_ext
def test_exp_f32_finite_bits_are_the_unclamped_formula():
    """The clamp of x * log2(e) to +-200 changed only non-finite and overflowing inputs."""
    gen = torch.Generator().manual_seed(2)
    x = torch.cat([torch.randn(5000, generator=gen) * 30, torch.tensor([-138.0, 138.0, 88.0])])
    t = x.double() * LOG2E
    hi = t.float()
    lo = (t - hi.double()).float()
    assert torch.equal(_bits(exp_f32(x)), _bits(exp2_f32(hi) * (1.0 + lo * 0.6931471805599453)))


def test_silu_f32_is_close_to_torch_silu():
    x = _values()
    torch.testing.assert_close(silu_f32(x), F.silu(x.double()).float(), rtol=4e-7, atol=1e-30)
    assert silu_f32(torch.tensor([float("inf")])).item() == float("inf")
