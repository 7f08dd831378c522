"""What every attention backend receives: one validated call (:class:`Problem`), and the shared
host side of the two GPU launchers (:func:`run_on_gpu`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

__all__ = ["Layout", "Problem", "run_on_gpu"]


class Layout(NamedTuple):
    """Where a sequence's keys live: paged (table) or one contiguous run per sequence (base)."""

    table: torch.Tensor | None  # int32 or int64 [B, max_pages] (the caller's), contiguous
    base: torch.Tensor | None  # int64 [B], element offset of key 0 (table is None)
    block_size: int
    stride_page: int
    stride_tok: int


class Problem(NamedTuple):
    """One attention call after the op's checks. Every backend module defines
    ``run_attention(label, problem) -> (out [total_q, Hq, D] in q.dtype, lse [total_q, Hq] fp32)``.
    """

    q: torch.Tensor  # [total_q, Hq, D]
    k: torch.Tensor  # the keys as laid out by ``layout`` (cache or varlen)
    v: torch.Tensor
    layout: Layout
    cu_q: torch.Tensor  # cu_seqlens_q on the device
    seqlens_k: torch.Tensor  # the key counts on the device
    max_q_len: int  # host bounds: no sequence has more queries / keys (the launch grid)
    max_k_len: int
    scale: float
    causal: bool


def run_on_gpu(label: str, backend: str, head_dims: tuple[int, ...], launch: Callable,
               p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate the outputs and call a GPU ``launch_attention`` (Triton or CUDA C++: the same
    calling convention), after checking the head dims that backend compiles."""
    total_q, hq, d = p.q.shape
    if d not in head_dims:
        raise ValueError(f"{label}: backend={backend!r} supports head_dim in {head_dims}, "
                         f"got {d}")
    q = p.q if p.q.stride(-1) == 1 else p.q.contiguous()
    out = torch.empty((total_q, hq, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((total_q, hq), dtype=torch.float32, device=q.device)
    lay = p.layout
    launch(q, p.k, p.v, out, lse, cu_q=p.cu_q.to(torch.int32),
           seqlens_k=p.seqlens_k.to(torch.int32),
           table=None if lay.table is None else lay.table.to(torch.int32), base=lay.base,
           block_size=lay.block_size, stride_page=lay.stride_page, stride_tok=lay.stride_tok,
           max_q_len=p.max_q_len, max_k_len=p.max_k_len, scale=p.scale,
           causal=p.causal)
    return out, lse
