"""Elementwise functions whose bits must not depend on an element's position in the tensor.

Each output here is a pure function of its input value, on every device, whatever the tensor's
length, the element's offset or the batch it came in. Measured on torch 2.13's CPU kernels
(AVX2; ``tests/test_pointwise.py`` re-measures on the running torch):

- ``torch.exp2``, ``torch.sigmoid`` and ``F.silu`` round their SIMD body and their scalar tail
  differently: from a length of 16 on, an element's bits depend on where it sits, and 3.5-5.5%
  of values differ between the AVX2 and the scalar (``ATEN_CPU_CAPABILITY=default``) kernels.
- ``torch.exp`` does not: its vectorised map runs the tail as a partial vector, so no length or
  offset moves a value's bits, and it gave the scalar kernel's bits on all 800k values tried.

Two exps follow, each for a reason:

- :func:`exp_f32` / :func:`exp2_f32`, inside bik's ops (attention's and the softmaxes'
  backward): on CPU tensors the CPU extension's exp2f (libm's, one scalar call per element),
  a sequence bik fixes itself; without the extension they raise RuntimeError with its build
  hint, never fall back to torch (whose exp gives other bits). On CUDA every element runs the
  same instruction sequence, so torch's kernels serve.
- :func:`silu_f32` / :func:`sigmoid_f32`, the front ends' SiLU and its backward: torch.exp, as
  measured above. The function layer runs silu above autograd and torch.compile traces it, so
  it must stay torch ops: autograd cannot differentiate through an extension call (the
  gradient came out wrong) and Dynamo cannot trace one.
"""

from __future__ import annotations

import torch

from bik.ops._checks import require, require_cpu
from bik.runtime import cpu_ext

__all__ = ["LN2", "LOG2E", "exp2_f32", "exp_f32", "silu_f32", "sigmoid_f32", "unary_f32"]

# log2(e) and ln(2) as the nearest doubles. Every exp bik computes is exp2(x * LOG2E) with the
# product formed on the host in fp64 (attention's scale * LOG2E, rounded to fp32 once) or in
# fp64 here (exp_f32). The sampler's exp (ops/sampling/noise.py, EXP_LOG2E) is another
# function: a fixed fp32 polynomial whose constant is LOG2E rounded to fp32.
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# |x * LOG2E| beyond this: exp2 is already 0 or inf in fp32; clamping keeps hi finite so that
# lo is 0, not inf - inf (which made exp_f32(+-inf) NaN).
_EXP2_ARG_LIMIT = 200.0


def unary_f32(fn: str, x: torch.Tensor) -> torch.Tensor:
    """exp2 or log2 of a CPU fp32 tensor elementwise via libm's exp2f / log2f."""
    ext = cpu_ext.require()
    require_cpu("bik.ops._pointwise.unary_f32", x=x)
    require(x.dtype == torch.float32, "bik.ops._pointwise.unary_f32", "x must be fp32")
    x = x.contiguous()
    out = torch.empty_like(x)
    ext.unary_f32(x.data_ptr(), out.data_ptr(), x.numel(), fn)
    return out


def exp2_f32(x: torch.Tensor) -> torch.Tensor:
    """2**x for an fp32 tensor (CPU: the extension's exp2f; CUDA: torch.exp2)."""
    if x.device.type != "cpu":
        return torch.exp2(x)
    return unary_f32("exp2", x)


def exp_f32(x: torch.Tensor) -> torch.Tensor:
    """e**x for an fp32 tensor (CPU: within about 1.5 ulp: x * log2(e) is formed in fp64 and
    split into hi (fp32) + lo, and e**x = 2**hi * (1 + lo * ln 2), |lo| <= 2**-24 |hi|;
    CUDA: torch.exp)."""
    if x.device.type != "cpu":
        return torch.exp(x)
    cpu_ext.require()  # before the fp64 work: the build hint, not unary_f32's later
    t = (x.double() * LOG2E).clamp(-_EXP2_ARG_LIMIT, _EXP2_ARG_LIMIT)
    hi = t.float()
    lo = (t - hi.double()).float()
    return exp2_f32(hi) * (1.0 + lo * LN2)


def sigmoid_f32(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + e**-x) for an fp32 tensor, from the same exp as :func:`silu_f32`: the front
    ends' silu backward and sigmoid (a router's scores)."""
    return 1.0 / (1.0 + torch.exp(-x))


def silu_f32(x: torch.Tensor) -> torch.Tensor:
    """silu(x) = x / (1 + e**-x) for an fp32 tensor: the one SiLU of bik's front ends and of
    bik.dvr's SwiGLU. torch.exp is position-independent (module docstring) and the add and the
    division are correctly rounded, so each output is a pure function of its input (stock CPU
    silu is not). Differentiable by autograd and traceable by torch.compile."""
    return x / (1.0 + torch.exp(-x))
