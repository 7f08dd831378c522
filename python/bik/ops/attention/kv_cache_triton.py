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
from bik.runtime.triton_launch import launch


@triton.jit
def write_kv_kernel(k_cache_ptr, v_cache_ptr, k_ptr, v_ptr, slots_ptr, n_slots, page_size,
                    stride_kc_page, stride_kc_tok, stride_kc_head, stride_vc_page, stride_vc_tok,
                    stride_vc_head, stride_kt, stride_kh, stride_kd, stride_vt, stride_vh,
                    stride_vd, HKV: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + tok).to(tl.int64)
    if (slot >= 0) & (slot < n_slots):  # negative: padding; past the cache: never written
        page = slot // page_size
        within = slot % page_size
        kc = k_cache_ptr + page * stride_kc_page + within * stride_kc_tok
        vc = v_cache_ptr + page * stride_vc_page + within * stride_vc_tok
        offs = tl.arange(0, BLOCK)
        for start in range(0, HKV * D, BLOCK):
            i = start + offs
            ok = i < HKV * D
            h = i // D
            d = i % D
            kx = tl.load(k_ptr + tok * stride_kt + h * stride_kh + d * stride_kd, mask=ok)
            vx = tl.load(v_ptr + tok * stride_vt + h * stride_vh + d * stride_vd, mask=ok)
            tl.store(kc + h * stride_kc_head + d, kx, mask=ok)
            tl.store(vc + h * stride_vc_head + d, vx, mask=ok)


def write_block(hkv: int, d: int) -> int:
    """Elements one program copies per step (speed only: a pure copy)."""
    return min(1024, 1 << (hkv * d - 1).bit_length())


def write_rows_triton(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, slots: torch.Tensor) -> None:
    """Slot ``slots[t]`` (page s // page_size, row s % page_size) of each cache = token t of
    k / v, for slots in [0, n_slots); other tokens are skipped. Caches [pages, page_size, Hkv,
    D], any strides with unit stride along D; nothing is read on the host."""
    tokens, hkv, d = k.shape
    if tokens == 0 or hkv * d == 0:
        return
    n_slots = k_cache.shape[0] * k_cache.shape[1]
    launch(write_kv_kernel, (tokens,), k_cache, v_cache, k, v, slots, n_slots, k_cache.shape[1],
           *k_cache.stride()[:3], *v_cache.stride()[:3], *k.stride(),
           *v.stride(), HKV=hkv, D=d, BLOCK=write_block(hkv, d))
