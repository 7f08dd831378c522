"""vLLM's RMSNorm (plain and fused with the residual add) on ``bik.rms_norm``.

vLLM computes RMSNorm through its IR ops ``vllm.ir.ops.rms_norm`` / ``fused_add_rms_norm``,
each dispatched to the first implementation in a per-op priority list that the platform sets:
on CUDA ``vllm_c`` (``_C::rms_norm``, whose block size follows the number of tokens) or, when
Inductor compiles, ``native`` (torch ops that Inductor fuses its own way); on the CPU
``native``. This module registers a ``bik`` implementation of both ops (``bik.rms_norm`` with
a weight of ones, then the weight multiplied as Hugging Face's Llama does) through vLLM's own
``register_impl`` and puts it first in the platform's default priority, so one code path
serves the CPU and CUDA. A ``variance_size`` override (RMS over a prefix of the row) is not
bik's contract: those calls keep vLLM's native implementation, whose mean reaches bik's
mean through ``bik.enable()`` in eager code.

The functions below carry vLLM's exact signatures (``register_impl`` compares the schemas),
so this module must not use postponed annotations.
"""

import torch
from torch import Tensor

import bik
from bik.integrations.vllm import spec_draft

__all__ = ["CALLS", "PROVIDER", "install"]

PROVIDER = "bik"
CALLS = [0]  # bik.rms_norm calls from vLLM's IR ops in this process
_OPS = ("rms_norm", "fused_add_rms_norm")


_ONES: dict = {}  # (hidden, dtype, device) -> ones: bik.rms_norm's weight, made once


def _ones(x: Tensor) -> Tensor:
    """A weight of ones (the model's weight is applied after, as Hugging Face does). On the
    CPU in fp32 whatever x's dtype: 1.0 is exact in every dtype, so the bits are the same, and
    the CPU kernel reads an fp32 weight without converting it; on CUDA in x's dtype."""
    dtype = torch.float32 if x.device.type == "cpu" else x.dtype
    key = (x.shape[-1], dtype, x.device)
    ones = _ONES.get(key)
    if ones is None:
        ones = _ONES[key] = torch.ones(x.shape[-1], dtype=dtype, device=x.device)
    return ones


def _times_weight(out: Tensor, weight: Tensor | None) -> Tensor:
    """Hugging Face's Llama rounding points: the normalised rows rounded to x's dtype, then
    times the weight in that dtype (``weight * hidden.to(input_dtype)``), so a trainer under
    bik.enable() gets the engine's bits in bf16 too. In fp32 this is bik's one rounding of
    (h * rstd) * weight; a layer without a weight (has_weight=False) keeps the rows."""
    if weight is None:
        return out
    return (weight * out).to(out.dtype)


def rms_norm(x: Tensor, weight: Tensor | None, epsilon: float,
             variance_size: int | None = None) -> Tensor:
    CALLS[0] += 1
    return _times_weight(bik.rms_norm(x, _ones(x), epsilon), weight)


def fused_add_rms_norm(x: Tensor, x_residual: Tensor, weight: Tensor | None, epsilon: float,
                       variance_size: int | None = None) -> tuple[Tensor, Tensor]:
    CALLS[0] += 1
    out, h = bik.rms_norm(x, _ones(x), epsilon, residual=x_residual)
    return _times_weight(out, weight), h


def _rms_norm_args(x: Tensor, weight: Tensor | None, epsilon: float,
                   variance_size: int | None = None) -> bool:
    # A fast-path draft model's norms step aside to vLLM's next provider.
    return (variance_size is None or variance_size == x.shape[-1]) and \
        not spec_draft.drafting_on_stock()


def _fused_args(x: Tensor, x_residual: Tensor, weight: Tensor | None, epsilon: float,
                variance_size: int | None = None) -> bool:
    return (variance_size is None or variance_size == x.shape[-1]) and \
        x_residual.dtype == x.dtype and not spec_draft.drafting_on_stock()


def _bik_first(default):
    """Wraps a platform's get_default_ir_op_priority: bik ahead of the platform's choices."""

    def priority(vllm_config):
        config = default(vllm_config)
        for name in _OPS:
            chosen = [p for p in getattr(config, name) if p != PROVIDER]
            setattr(config, name, [PROVIDER, *chosen])
        return config

    priority.bik_first = True
    return priority


def _warn_unless_first(op) -> None:
    """Wraps an IR op's set_default (each worker calls it once): an explicit priority that
    puts another provider first (``ir_op_priority`` in the engine arguments) wins over the
    platform default, so say that this op is not on bik."""
    set_default = op.set_default

    def checked(priority):
        set_default(priority)
        first = op.get_priority()[:1]
        if first != [PROVIDER]:
            from bik.integrations.vllm import guard

            guard.unrouted(f"ir.{op.name}:{first[0] if first else 'none'}")

    op.set_default = checked


def install() -> None:
    from vllm import ir
    from vllm.platforms import current_platform

    impls = {"rms_norm": (rms_norm, _rms_norm_args),
             "fused_add_rms_norm": (fused_add_rms_norm, _fused_args)}
    for name, (fn, supports) in impls.items():
        op = getattr(ir.ops, name)
        if PROVIDER not in op.impls:
            op.register_impl(PROVIDER, supports_args=supports)(fn)
            _warn_unless_first(op)
    platform = type(current_platform)
    default = platform.get_default_ir_op_priority
    if not getattr(default, "bik_first", False):
        platform.get_default_ir_op_priority = staticmethod(_bik_first(default))
