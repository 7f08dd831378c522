"""bik::write_kv_cache on a GPU: one Triton program per token copies its K/V rows.

Pure data movement, so it cannot change a bit. It exists for what it does not do: dropping the
padding tokens (negative slots) with boolean indexing would be a ``nonzero``, a device-to-host
sync that CUDA graph capture forbids. The kernel skips such a token itself (and any slot past
the cache) and reads nothing back. On the CPU the op indexes with torch (the data is on the
host already).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["write_block", "write_kv_kernel", "write_rows_triton"]


@triton.jit
def write_kv_kernel(k_cache_ptr, v_cache_ptr, k_ptr, v_ptr, slots_ptr, n_slots, stride_kt,
                    stride_kh, stride_kd, stride_vt, stride_vh, stride_vd, HKV: tl.constexpr,
                    D: tl.constexpr, BLOCK: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + tok).to(tl.int64)
    if (slot >= 0) & (slot < n_slots):  # negative: padding; past the cache: never written
        offs = tl.arange(0, BLOCK)
        for start in range(0, HKV * D, BLOCK):
            i = start + offs
            ok = i < HKV * D
            h = i // D
            d = i % D
            kx = tl.load(k_ptr + tok * stride_kt + h * stride_kh + d * stride_kd, mask=ok)
            vx = tl.load(v_ptr + tok * stride_vt + h * stride_vh + d * stride_vd, mask=ok)
            tl.store(k_cache_ptr + slot * (HKV * D) + i, kx, mask=ok)
            tl.store(v_cache_ptr + slot * (HKV * D) + i, vx, mask=ok)


def write_block(hkv: int, d: int) -> int:
    """Elements one program copies per step (speed only: a pure copy)."""
    return min(1024, triton.next_power_of_2(hkv * d))


def write_rows_triton(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, slots: torch.Tensor) -> None:
    """Row ``slots[t]`` of each cache (viewed as [-1, Hkv, D]) = token t of k / v, for slots
    in [0, n_slots); other tokens are skipped. Caches contiguous; nothing read on the host."""
    tokens, hkv, d = k.shape
    if tokens == 0 or hkv * d == 0:
        return
    n_slots = k_cache.numel() // (hkv * d)
    block = write_block(hkv, d)
    write_kv_kernel[(tokens,)](k_cache, v_cache, k, v, slots, n_slots, *k.stride(), *v.stride(),
                               HKV=hkv, D=d, BLOCK=block)
