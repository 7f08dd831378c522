"""Validation of bik's attention calls (ops/attention/op.py, kv_cache.py, backward.py): shapes,
dtypes and devices from the tensors' metadata, and the sequence lengths and pages read back from
the device once per call unless the caller passes host metadata (:class:`AttentionPlan`)."""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import torch

from bik.ops._checks import check_float_dtype, check_same_device, check_tensor, debug_checks
from bik.ops.attention._layout import Layout


def int_vector(op: str, name: str, t, length: int | None = None) -> None:
    check_tensor(op, name, t, 1)
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{op}: {name} must be int32 or int64, got {t.dtype}")
    if length is not None and t.shape[0] != length:
        raise ValueError(f"{op}: {name} {list(t.shape)} must have {length} entries")


def check_qkv(op: str, q, k, v, kv_rank: int) -> tuple[int, int, int]:
    """Shapes and dtypes of q [total_q, Hq, D] against k/v; returns (Hq, Hkv, D)."""
    check_tensor(op, "q", q, 3)
    check_tensor(op, "k", k, kv_rank)
    check_tensor(op, "v", v, kv_rank)
    check_float_dtype(op, "q", q)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{op}: {name} ({t.dtype}) must have q's dtype ({q.dtype})")
    if k.shape != v.shape or k.stride() != v.stride():
        raise ValueError(f"{op}: k {list(k.shape)} and v {list(v.shape)} must have the same "
                         f"shape and strides")
    hq, d = q.shape[1], q.shape[2]
    hkv, dk = k.shape[-2], k.shape[-1]
    if dk != d:
        raise ValueError(f"{op}: head_dim of q ({d}) and k/v ({dk}) differ")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"{op}: q heads ({hq}) must be a multiple of k/v heads ({hkv})")
    return hq, hkv, d


def check_cu_seqlens(op: str, name: str, cu: list[int], total: int, total_name: str) -> None:
    """A host copy of cu_seqlens must start at 0, never decrease and end at the packed total."""
    if cu[0] != 0 or any(b < a for a, b in itertools.pairwise(cu)) or cu[-1] != total:
        raise ValueError(f"{op}: {name} must start at 0, never decrease and end at "
                         f"{total_name} = {total}; got {cu}")


def _read_lengths(op: str, cu_q, seqlens_k, total_q: int, capacity: int) -> tuple[list, list]:
    """Copy the lengths to the host once and check them (bad lengths would read out of bounds)."""
    cu = cu_q.tolist()
    lens = seqlens_k.tolist()
    check_cu_seqlens(op, "cu_seqlens_q", cu, total_q, "total_q")
    for b, length in enumerate(lens):
        q_len = cu[b + 1] - cu[b]
        if length < q_len:
            raise ValueError(f"{op}: sequence {b} has cache_seqlens {length} < q_len {q_len}; "
                             f"its new tokens' K/V must already be in the cache")
        if length > capacity:
            raise ValueError(f"{op}: sequence {b} has {length} keys but room for {capacity}")
    return cu, lens


def _check_some_sequence(op: str, n_seq: int, total_q: int) -> None:
    """Queries need a sequence to belong to (a shape check: the GPU launchers return at once
    for B = 0, which would leave the output unwritten)."""
    if n_seq < 1 and total_q > 0:
        raise ValueError(f"{op}: {total_q} queries but no sequence (cu_seqlens needs >= 2 "
                         f"entries)")


def scale_for(op: str, scale: float | None, d: int) -> float:
    if d < 1:
        raise ValueError(f"{op}: head_dim must be >= 1, got {d}")
    return 1.0 / math.sqrt(d) if scale is None else float(scale)


def _check_scale(op: str, scale: float) -> None:
    if not math.isfinite(scale):
        raise ValueError(f"{op}: scale must be finite, got {scale}")


class AttentionPlan(NamedTuple):
    """Host metadata for one step's attention calls (see :func:`plan_attention`)."""

    max_seqlen_q: int  # no sequence has more new tokens
    max_seqlen_k: int  # no sequence has more keys (new tokens included)


def _given_bounds(op: str, max_seqlen_q, max_seqlen_k, capacity: int):
    """The caller's host metadata, checked against the shapes (no device data): None when it
    passed none. Both or neither: one alone would still need a read for the other."""
    if max_seqlen_q is None and max_seqlen_k is None:
        return None
    if max_seqlen_q is None or max_seqlen_k is None:
        raise ValueError(f"{op}: pass both max_seqlen_q and max_seqlen_k (host ints) or "
                         f"neither; got max_seqlen_q={max_seqlen_q}, "
                         f"max_seqlen_k={max_seqlen_k}")
    if not 0 <= max_seqlen_q <= max_seqlen_k:
        raise ValueError(f"{op}: need 0 <= max_seqlen_q <= max_seqlen_k; got max_seqlen_q="
                         f"{max_seqlen_q}, max_seqlen_k={max_seqlen_k}")
    if max_seqlen_k > capacity:
        raise ValueError(f"{op}: max_seqlen_k={max_seqlen_k} exceeds the room for {capacity} "
                         f"keys per sequence")
    return AttentionPlan(max_seqlen_q, max_seqlen_k)


def _bounds(op: str, given: AttentionPlan | None, cu: list[int], lens: list[int]):
    """The launch bounds: the caller's (checked against the lengths read in debug mode), else
    the lengths' own maxima."""
    q_max = max((b - a for a, b in itertools.pairwise(cu)), default=0)
    k_max = max(lens, default=0)
    if given is None:
        return AttentionPlan(q_max, k_max)
    if q_max > given.max_seqlen_q or k_max > given.max_seqlen_k:
        raise ValueError(f"{op}: the host metadata max_seqlen_q={given.max_seqlen_q} / "
                         f"max_seqlen_k={given.max_seqlen_k} is below the lengths' maxima "
                         f"{q_max} / {k_max} (BIK_DEBUG_CHECKS found it)")
    return given


def _cache_capacity(op, q, k_cache, cache_seqlens, cu_seqlens_q, block_table) -> int:
    """Shape checks of a (paged or contiguous) cache call; the room for keys per sequence.
    Reads no device data."""
    n_seq = cache_seqlens.shape[0]
    int_vector(op, "cache_seqlens", cache_seqlens)
    int_vector(op, "cu_seqlens_q", cu_seqlens_q, n_seq + 1)
    _check_some_sequence(op, n_seq, q.shape[0])
    if k_cache.stride(-1) != 1:
        raise ValueError(f"{op}: k_cache/v_cache need unit stride along head_dim")
    if block_table is None:
        if k_cache.shape[0] != n_seq:
            raise ValueError(f"{op}: a contiguous cache {list(k_cache.shape)} needs one row per "
                             f"sequence ({n_seq})")
        return k_cache.shape[1]
    check_tensor(op, "block_table", block_table, 2)
    if block_table.dtype not in (torch.int32, torch.int64) or block_table.shape[0] != n_seq:
        raise ValueError(f"{op}: block_table must be int32/int64 [B={n_seq}, max_blocks], got "
                         f"{list(block_table.shape)} {block_table.dtype}")
    return block_table.shape[1] * k_cache.shape[1]


def cache_layout(q, k_cache, cache_seqlens, block_table) -> Layout:
    """Where each sequence's keys lie in a checked (paged or contiguous) cache."""
    if block_table is None:
        base = torch.arange(cache_seqlens.shape[0], dtype=torch.int64,
                            device=q.device) * k_cache.stride(0)
        return Layout(None, base, k_cache.shape[1], 0, k_cache.stride(1), k_cache.stride(0))
    # The caller's dtype: narrowing an int64 entry here would turn a bad page into another
    # page before the CPU kernel's check could see it (the GPU launchers narrow it).
    return Layout(block_table.contiguous(), None, k_cache.shape[1], k_cache.stride(0),
                  k_cache.stride(1))


def _check_pages(op: str, block_table, lens: list[int], num_blocks: int, block_size: int):
    """Every page a sequence uses lies inside the cache: one vectorised check (one host sync)."""
    pages = torch.tensor([-(-n // block_size) for n in lens], device=block_table.device)
    used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < pages[:, None]
    outside = used & ((block_table < 0) | (block_table >= num_blocks))
    bad_rows = outside.any(dim=1).nonzero().flatten().tolist()
    if bad_rows:
        b = bad_rows[0]
        raise ValueError(f"{op}: block_table row {b} points outside the cache's {num_blocks} "
                         f"blocks: {block_table[b, : int(pages[b])].tolist()}")


def cache_call(op, args) -> AttentionPlan:
    """Every check of a bik::attention call (its record); its bounds. With host metadata it
    reads no device data (unless BIK_DEBUG_CHECKS=1); without, it reads the lengths once."""
    q, k_cache, v_cache, block_table = args.q, args.k_cache, args.v_cache, args.block_table
    cache_seqlens, cu_seqlens_q = args.cache_seqlens, args.cu_seqlens_q
    check_qkv(op, q, k_cache, v_cache, 4)
    check_same_device(op, q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens,
                      cu_seqlens_q=cu_seqlens_q, block_table=block_table)
    _check_scale(op, args.scale)
    capacity = _cache_capacity(op, q, k_cache, cache_seqlens, cu_seqlens_q, block_table)
    given = _given_bounds(op, args.max_seqlen_q, args.max_seqlen_k, capacity)
    if given is not None and not debug_checks():
        return given
    cu, lens = _read_lengths(op, cu_seqlens_q, cache_seqlens, q.shape[0], capacity)
    if block_table is not None:
        _check_pages(op, block_table, lens, k_cache.shape[0], k_cache.shape[1])
    return _bounds(op, given, cu, lens)


def varlen_call(op, args):
    """Every check of a bik::attention_varlen call (its record); its bounds. Reads no device
    data with host metadata (unless BIK_DEBUG_CHECKS=1), else the lengths once."""
    q, k, v, cu_seqlens_q, cu_seqlens_k = args.q, args.k, args.v, args.cu_seqlens_q, \
        args.cu_seqlens_k
    check_qkv(op, q, k, v, 3)
    check_same_device(op, q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    _check_scale(op, args.scale)
    int_vector(op, "cu_seqlens_k", cu_seqlens_k)
    int_vector(op, "cu_seqlens_q", cu_seqlens_q, cu_seqlens_k.shape[0])
    _check_some_sequence(op, cu_seqlens_k.shape[0] - 1, q.shape[0])
    if k.stride(-1) != 1:
        raise ValueError(f"{op}: k/v need unit stride along head_dim")
    given = _given_bounds(op, args.max_seqlen_q, args.max_seqlen_k, k.shape[0])
    if given is not None and not debug_checks():
        return given
    seqlens_k = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    check_cu_seqlens(op, "cu_seqlens_k", cu_seqlens_k.tolist(), k.shape[0], "total_k")
    cu, lens = _read_lengths(op, cu_seqlens_q, seqlens_k, q.shape[0], k.shape[0])
    return _bounds(op, given, cu, lens)


def check_kv_write(op, k_cache, v_cache, k, v, slot_mapping):
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(op, name, t)
        if t.dim() not in (3, 4) or (t.numel() and t.stride(-1) != 1):
            raise ValueError(f"{op}: {name} must be a [num_blocks, block_size, Hkv, D] or "
                             f"[B, max_len, Hkv, D] cache with unit stride along D, got "
                             f"{list(t.shape)} strides {list(t.stride())}")
        if any(st < 0 for st in t.stride()):
            raise ValueError(f"{op}: {name} has a negative stride {list(t.stride())}")
    check_tensor(op, "k", k, 3)
    check_tensor(op, "v", v, 3)
    int_vector(op, "slot_mapping", slot_mapping, k.shape[0])
    if k.shape != v.shape or k.shape[1:] != k_cache.shape[-2:] or k_cache.shape != v_cache.shape:
        raise ValueError(f"{op}: k {list(k.shape)} / v {list(v.shape)} must be [tokens, Hkv, D] "
                         f"matching the caches {list(k_cache.shape)}")
    if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
        raise TypeError(f"{op}: new k/v ({k.dtype}) must have the cache dtype ({k_cache.dtype})")
    check_same_device(op, k_cache=k_cache, v_cache=v_cache, k=k, v=v, slot_mapping=slot_mapping)
