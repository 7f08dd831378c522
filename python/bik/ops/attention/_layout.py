"""What every attention backend receives: one validated call (:class:`Problem`), and the shared
host side of the two GPU launchers (:func:`run_on_gpu`, :func:`splits_per_program`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

# SPLIT aims at about this many programs (two waves of an H200's 132 SMs): a program takes more
# consecutive splits when the (sequence, KV head, tile) items alone come close to it.
SPLIT_PROGRAM_TARGET = 264


def split_workspace(n_splits: int, total_q: int, hq: int, d: int, device):
    """SPLIT's partials (both GPU backends), sized by the host bound max_seqlen_k: pacc
    [n_splits, total_q, Hq, D] and pml [n_splits, 2, total_q, Hq], fp32."""
    return (torch.empty((n_splits, total_q, hq, d), dtype=torch.float32, device=device),
            torch.empty((n_splits, 2, total_q, hq), dtype=torch.float32, device=device))


def splits_per_program(items: int, n_splits: int) -> int:
    """Consecutive splits per SPLIT program for ``items`` (sequence, KV head, query tile)
    triples: at least one, enough that items x runs stays near SPLIT_PROGRAM_TARGET. Speed only:
    every split's partial is computed alone and the fold order is fixed."""
    runs = max(1, min(n_splits, SPLIT_PROGRAM_TARGET // max(items, 1)))
    return -(-n_splits // runs)


def busy_programs(runs: int, tile_splits: list[int]) -> int:
    """How many SPLIT programs have work when ``runs`` programs per tile (grid axis 2, set from
    the host bound) take tiles whose real lengths give ``tile_splits`` splits each: the Triton
    kernel gives run r the splits [r n / runs, (r + 1) n / runs), so min(runs, n) programs of
    a tile work (attention_kernel, which counts them for its ticket the same way)."""
    return sum(sum(r * n // runs < (r + 1) * n // runs for r in range(runs))
               for n in tile_splits)


class Layout(NamedTuple):
    """Where a sequence's keys live: paged (table) or one contiguous run per sequence (base)."""

    table: torch.Tensor | None  # int32 or int64 [B, max_pages] (the caller's), contiguous
    base: torch.Tensor | None  # int64 [B], element offset of key 0 (table is None)
    block_size: int
    stride_page: int
    stride_tok: int
    # A divisor of every base the host knows without reading them (base = index x a stride):
    # it lets a GPU kernel vectorise the contiguous loads. 1 = nothing known.
    base_multiple: int = 1


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


def _int32(t: torch.Tensor) -> torch.Tensor:
    """``t`` as int32, without an aten call when it is already (an engine's metadata is)."""
    return t if t.dtype == torch.int32 else t.to(torch.int32)


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
    launch(q, p.k, p.v, out, lse, cu_q=_int32(p.cu_q), seqlens_k=_int32(p.seqlens_k),
           table=None if lay.table is None else _int32(lay.table), base=lay.base,
           block_size=lay.block_size, stride_page=lay.stride_page, stride_tok=lay.stride_tok,
           base_multiple=lay.base_multiple,
           max_q_len=p.max_q_len, max_k_len=p.max_k_len, scale=p.scale,
           causal=p.causal)
    return out, lse
