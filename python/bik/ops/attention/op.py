"""bik::attention and bik::attention_varlen (bik::write_kv_cache: kv_cache.py).

Contract (docs/design.md#attention): the output for (sequence, absolute position, head) is
bitwise identical whatever the batch, the sequence's row in it, the other sequences, the
chunking of its own prompt (prefill, chunked prefill, decode, verify windows) and the page size.
Each backend reduces the keys in splits of a fixed size aligned to absolute KV positions and
folds the splits in ascending order with one shared function.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch

from bik.ops._call import call
from bik.ops._checks import check_same_device, check_tensor
from bik.ops._define import DECLARED, define
from bik.ops._native import kernel_for
from bik.ops._registry import documented, resolve_backend
from bik.ops.attention.backward import AUTOGRAD
from bik.ops.attention.checks import (
    AttentionPlan,
    cache_call,
    cache_layout,
    check_qkv,
    scale_for,
    varlen_call,
)
from bik.ops.attention._layout import Layout, Problem

# Every backend module (triton.py, cuda.py, cpu.py) defines the row's entry point
#   run_attention(label, Problem) -> (out [total_q, Hq, D], lse [total_q, Hq] fp32)
# (bik/ops/attention/_layout.py) for a validated problem whose bounds are checked.


class AttentionOutput(NamedTuple):
    out: torch.Tensor  # [total_q, Hq, D], q.dtype
    lse: torch.Tensor  # [total_q, Hq], fp32, natural log of the softmax denominator


# ---- bik::attention (a paged or contiguous KV cache) -------------------------------------------

def _check_attention(op, args):
    """Every check; the record with its host bounds filled in (read from the device once when
    the caller gave none)."""
    bounds = cache_call(op, args)
    return args._replace(max_seqlen_q=bounds.max_seqlen_q, max_seqlen_k=bounds.max_seqlen_k)


def _shapes_attention(op, args):
    """The checks a fake call can make (no device data)."""
    check_qkv(op, args.q, args.k_cache, args.v_cache, 4)
    check_same_device(op, q=args.q, k_cache=args.k_cache, v_cache=args.v_cache,
                      cache_seqlens=args.cache_seqlens, cu_seqlens_q=args.cu_seqlens_q,
                      block_table=args.block_table)
    return args


def _run_attention(label, launch, args):
    layout = cache_layout(args.q, args.k_cache, args.cache_seqlens, args.block_table)
    problem = Problem(args.q, args.k_cache, args.v_cache, layout, args.cu_seqlens_q,
                      args.cache_seqlens, args.max_seqlen_q, args.max_seqlen_k, args.scale,
                      args.causal)
    return launch(label, problem)[0]


def _fake_attention(args):
    return torch.empty_like(args.q, memory_format=torch.contiguous_format)


# The backend sits before the host bounds so that calls may leave the bounds out.
define("attention",
       "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, Tensor cu_seqlens_q, "
       "Tensor? block_table, float scale, bool causal, str backend, int? max_seqlen_q=None, "
       "int? max_seqlen_k=None) -> Tensor",
       check=_check_attention, fake_check=_shapes_attention,
       run=partial(_run_attention, "bik.attention"), fake=_fake_attention,
       native=kernel_for("attention", kernel="attention"))


# ---- bik::attention_varlen (packed K/V, no cache) -----------------------------------------------

def _check_varlen(op, args):
    bounds = varlen_call(op, args)
    return args._replace(max_seqlen_q=bounds.max_seqlen_q, max_seqlen_k=bounds.max_seqlen_k)


def _shapes_varlen(op, args):
    check_qkv(op, args.q, args.k, args.v, 3)
    check_same_device(op, q=args.q, k=args.k, v=args.v, cu_seqlens_q=args.cu_seqlens_q,
                      cu_seqlens_k=args.cu_seqlens_k)
    return args


def _run_varlen(launch, args):
    k, cu_seqlens_k = args.k, args.cu_seqlens_k
    # Clamped so an absurd entry stays outside k rather than wrapping into it (the CPU kernel
    # then refuses it); a sound one is unchanged.
    base = cu_seqlens_k[:-1].to(torch.int64).clamp(-1, k.shape[0]) * k.stride(0)
    layout = Layout(None, base, 1, 0, k.stride(0), k.stride(0))
    seqlens_k = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    return launch("bik.attention_varlen",
                  Problem(args.q, k, args.v, layout, args.cu_seqlens_q, seqlens_k,
                          args.max_seqlen_q, args.max_seqlen_k, args.scale, args.causal))


def _fake_varlen(args):
    q = args.q
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32))


define("attention_varlen",
       "(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, float scale, "
       "bool causal, str backend, int? max_seqlen_q=None, int? max_seqlen_k=None) "
       "-> (Tensor, Tensor)",
       check=_check_varlen, fake_check=_shapes_varlen, run=_run_varlen, fake=_fake_varlen,
       autograd=AUTOGRAD)


# ---- the public functions ----------------------------------------------------------------------

_HOST_METADATA_DOC = """max_seqlen_q, max_seqlen_k: host ints, upper bounds on any sequence's new tokens and
            keys (both or neither). Given, the op reads nothing back from the device, so the
            call can be captured in a CUDA graph; it trusts them (the CPU kernel still checks
            every length and page itself) — check them once per step with
            :func:`plan_attention` or set BIK_DEBUG_CHECKS=1. Larger bounds never change the
            bits. Not given, one host sync per call reads and checks the lengths."""


@documented("attention")
def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
              cache_seqlens: torch.Tensor, cu_seqlens_q: torch.Tensor,
              block_table: torch.Tensor | None = None, scale: float | None = None,
              causal: bool = True, max_seqlen_q: int | None = None,
              max_seqlen_k: int | None = None, backend: str | None = None) -> torch.Tensor:
    """Batch-invariant attention over a KV cache for prefill, chunked prefill, decode and verify.

    Args:
        q: [total_q, Hq, D] packed queries; sequence b owns rows cu_seqlens_q[b]..[b+1]-1,
            at absolute positions cache_seqlens[b] - q_len ... cache_seqlens[b] - 1.
        k_cache, v_cache: paged [num_blocks, block_size, Hkv, D] with ``block_table``
            [B, max_blocks], or contiguous [B, max_len, Hkv, D] without. The queries' own K/V
            must already be written (see :func:`write_kv_cache`). Hq % Hkv == 0 (GQA).
        cache_seqlens: int [B], keys per sequence (including the new tokens).
        cu_seqlens_q: int [B + 1].
        scale: default 1/sqrt(D). causal: mask by absolute position.
        {host_metadata}
        backend: {backends}

    Returns:
        [total_q, Hq, D] in q.dtype. The bits for (sequence, absolute position, head) do not
        depend on the batch, on the sequence's row, on how its tokens were chunked into calls,
        or on the page size.
    """
    op = "bik.attention"
    check_tensor(op, "q", q, 3)
    backend = resolve_backend("attention", backend, q.device)
    return call("attention", q, k_cache, v_cache, cache_seqlens, cu_seqlens_q, block_table,
                scale_for(op, scale, q.shape[-1]), bool(causal), backend, max_seqlen_q,
                max_seqlen_k)


@documented("attention_varlen")
def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                     cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                     scale: float | None = None, causal: bool = True,
                     max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
                     backend: str | None = None) -> AttentionOutput:
    """Packed varlen attention without a cache: q [total_q, Hq, D], k/v [total_k, Hkv, D].

    Query i of sequence b sits at absolute position L_k - L_q + i (bottom-right aligned, as in
    :func:`attention`), so a token's output equals the paged path's bit for bit on the same
    backend. Returns (out [total_q, Hq, D], lse [total_q, Hq] fp32, natural log). Its
    backward (``.backward()`` through out and lse) is batch-invariant too.

    Args:
        {host_metadata}
        backend: {backends}
    """
    op = "bik.attention_varlen"
    check_tensor(op, "q", q, 3)
    backend = resolve_backend("attention_varlen", backend, q.device)
    out, lse = call("attention_varlen", q, k, v, cu_seqlens_q, cu_seqlens_k,
                    scale_for(op, scale, q.shape[-1]), bool(causal), backend, max_seqlen_q,
                    max_seqlen_k)
    return AttentionOutput(out, lse)


def plan_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                   cache_seqlens: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   block_table: torch.Tensor | None = None) -> AttentionPlan:
    """Check one step's :func:`attention` metadata once and return its host bounds.

    Every check a call without host metadata makes (lengths, cu_seqlens_q, pages inside the
    cache), at the cost of one host sync; run it outside CUDA graph capture, once per step, and
    pass ``**plan._asdict()`` to that step's attention calls (every layer shares it).
    """
    op = "bik.plan_attention"
    return cache_call(op, DECLARED["attention"].Args(
        q, k_cache, v_cache, cache_seqlens, cu_seqlens_q, block_table, 1.0, False, None, None))


def plan_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                          cu_seqlens_q: torch.Tensor,
                          cu_seqlens_k: torch.Tensor) -> AttentionPlan:
    """:func:`plan_attention` for :func:`attention_varlen`."""
    op = "bik.plan_attention_varlen"
    return varlen_call(op, DECLARED["attention_varlen"].Args(
        q, k, v, cu_seqlens_q, cu_seqlens_k, 1.0, False, None, None))


for _fn in (attention, attention_varlen):
    if _fn.__doc__:  # None under python -OO
        _fn.__doc__ = _fn.__doc__.replace("{host_metadata}", _HOST_METADATA_DOC)
