"""Launcher for the CUDA C++ attention (csrc/cuda/attention.cu), same contract as Triton's.

Same calling convention as :func:`bik.ops.attention.triton.launch_attention`. Bits are
fixed by :func:`bik.configs.cuda_attention_config` (split size, keys per block) and the
absolute key positions; the packing of rows into programs (``gh`` heads x ``block_t`` tokens),
the number of head slices, the launch mode (FOLD, or SPLIT with its merge fused) and SPLIT's
splits per program decide speed only (csrc/cuda/attention_plan.cuh explains why).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from bik._arch import device_arch
from bik._dtypes import DTYPES
from bik.configs import CUDA_ATTENTION_HEAD_DIMS, CudaAttentionConfig, cuda_attention_config
from bik.ops._pointwise import LOG2E
from bik.ops.attention._layout import Problem, run_on_gpu, split_workspace, splits_per_program
from bik.runtime import cuda_jit
from bik.runtime.cuda_jit import F32, I32, I64, PTR

# csrc/cuda/attention.cu: bik_attention_<dtype>_d<head dim>, one parameter list.
KERNELS = cuda_jit.declare(
    "attention", [f"bik_attention_{t.cuda}_d{d}" for t in DTYPES for d in CUDA_ATTENTION_HEAD_DIMS],
    [("q", PTR), ("k", PTR), ("v", PTR), ("out", PTR), ("lse", PTR), ("pacc", PTR),
     ("pml", PTR), ("tickets", PTR), ("cu_q", PTR), ("seqlens_k", PTR), ("table", PTR),
     ("base", PTR), ("stride_q_tok", I64), ("stride_q_head", I64), ("stride_o_tok", I64),
     ("stride_o_head", I64), ("stride_table", I64), ("stride_page", I64), ("stride_tok", I64),
     ("stride_kv_head", I64), ("block_size", I32), ("total_q", I32), ("hq", I32), ("hkv", I32),
     ("gh", I32), ("block_t", I32), ("scale_log2e", F32), ("split", I32), ("causal", I32),
     ("fold", I32), ("q_bound", I32), ("k_bound", I32)])


class AttentionLaunch(NamedTuple):
    config: CudaAttentionConfig
    kernel: str
    gh: int  # query heads per program (of the G sharing a KV head)
    block_t: int  # query tokens per program
    n_splits: int  # splits of the longest sequence
    split_mode: bool
    per_program: int  # SPLIT: consecutive splits per program at the bound (sets the runs)
    grid: tuple[int, int, int]
    block: tuple[int, int, int]


def use_split_mode(total_q: int, num_heads_q: int, n_splits: int, per_program: int) -> bool:
    """Decode/verify-sized work spreads the splits over programs (bits are equal either way);
    not when one program would hold all of a tile's splits anyway."""
    return n_splits > per_program and total_q * num_heads_q * n_splits <= (1 << 20)


def plan_attention(dtype: torch.dtype, *, n_seq: int, total_q: int, hq: int, hkv: int, d: int,
                   max_q_len: int, max_k_len: int, arch: str,
                   split_mode: bool | None = None) -> AttentionLaunch:
    if d not in CUDA_ATTENTION_HEAD_DIMS:
        raise ValueError(f"bik: backend='cuda' attention supports head_dim in "
                         f"{CUDA_ATTENTION_HEAD_DIMS}, got {d}")
    g = hq // hkv
    cfg = cuda_attention_config(dtype, d, g, arch)
    gh = min(g, cfg.rows)
    block_t = cfg.rows // gh
    slices = -(-g // gh)
    n_splits = max(1, -(-max_k_len // cfg.split))
    tiles = max(1, -(-max_q_len // block_t))
    per = splits_per_program(n_seq * hkv * slices * tiles, n_splits)
    split = use_split_mode(total_q, hq, n_splits, per) if split_mode is None else bool(split_mode)
    if tiles > 65535 or n_splits > 65535:
        raise ValueError(f"bik: backend='cuda' attention: q_len {max_q_len} / {max_k_len} keys "
                         f"exceed the launch grid")
    grid = (n_seq * hkv * slices, tiles, -(-n_splits // per) if split else 1)
    return AttentionLaunch(cfg, f"{cfg.kernel}_d{d}", gh, block_t, n_splits, split, per, grid,
                           (cfg.threads, 1, 1))


def launch_attention(q, k, v, out, lse, *, cu_q, seqlens_k, table, base, block_size,
                     stride_page: int, stride_tok: int, max_q_len: int, max_k_len: int,
                     scale: float, causal: bool, split_mode: bool | None = None,
                     base_multiple: int = 1) -> None:
    """Run the kernel(s) on torch's current stream. Key ``pos`` of sequence b lives at element
    ``table[b, pos // block_size] * stride_page + (pos % block_size) * stride_tok`` (paged) or
    ``base[b] + pos * stride_tok``, plus ``h * k.stride(-2) + d``; v likewise.

    ``cu_q`` int32 [B+1], ``seqlens_k`` int32 [B], ``table`` int32 [B, max_pages] or None,
    ``base`` int64 [B] when ``table`` is None. q and k/v need unit stride along head_dim.
    ``base_multiple`` (Triton's alignment hint) is not needed: this kernel loads each key's row
    through its own offset.
    """
    del base_multiple
    total_q, hq, d = q.shape
    hkv = k.shape[-2]
    n_seq = seqlens_k.shape[0]
    if total_q == 0 or n_seq == 0:
        return
    if q.stride(-1) != 1 or k.stride(-1) != 1 or out.stride(-1) != 1 or not lse.is_contiguous():
        raise ValueError("bik: backend='cuda' attention needs unit stride along head_dim")
    plan = plan_attention(q.dtype, n_seq=n_seq, total_q=total_q, hq=hq, hkv=hkv, d=d,
                          max_q_len=max_q_len, max_k_len=max_k_len, arch=device_arch(q.device),
                          split_mode=split_mode)
    paged = table is not None
    table = table.to(torch.int32).contiguous() if paged else None
    base = None if paged else base.to(torch.int64).contiguous()
    cu_q = cu_q.to(torch.int32).contiguous()
    seqlens_k = seqlens_k.to(torch.int32).contiguous()
    if plan.split_mode:
        pacc, pml = split_workspace(plan.n_splits, total_q, hq, d, q.device)
        tickets = torch.zeros(plan.grid[0] * plan.grid[1], dtype=torch.int32, device=q.device)
    else:
        pacc = pml = tickets = None
    cuda_jit.launch_kernel(
        KERNELS, plan.kernel, plan.grid, plan.block, 0, q, k, v, out, lse, pacc, pml, tickets,
        cu_q, seqlens_k, table, base, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        table.stride(0) if paged else 0, stride_page, stride_tok, k.stride(-2), block_size,
        total_q, hq, hkv, plan.gh, plan.block_t, scale * LOG2E, plan.config.split, int(causal),
        int(not plan.split_mode), max_q_len, max_k_len, device=q.device)



def run_attention(label: str, p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's entry point on this backend (see bik/ops/attention/_layout.py)."""
    return run_on_gpu(label, "cuda", CUDA_ATTENTION_HEAD_DIMS, launch_attention, p)
