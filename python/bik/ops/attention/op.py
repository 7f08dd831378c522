"""bik::attention, bik::attention_varlen and bik::write_kv_cache.

Contract (docs/design.md#attention): the output for (sequence, absolute position, head) is
bitwise identical whatever the batch, the sequence's row in it, the other sequences, the
chunking of its own prompt (prefill, chunked prefill, decode, verify windows) and the page size.
Each backend reduces the keys in splits of a fixed size aligned to absolute KV positions and
folds the splits in ascending order with one shared function.
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import torch

from bik.ops._checks import check_float_dtype, check_same_device, check_tensor
from bik.ops._registry import define, documented, implementation, resolve_backend
from bik.ops.attention._layout import Layout, Problem

__all__ = ["AttentionOutput", "attention", "attention_varlen", "write_kv_cache"]

# Every backend module (triton.py, cuda.py, cpu.py) defines run_attention(label, Problem)
# (bik/ops/attention/_layout.py).
define("attention",
       "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, Tensor cu_seqlens_q, "
       "Tensor? block_table, float scale, bool causal, str backend) -> Tensor")
define("attention_varlen",
       "(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, float scale, "
       "bool causal, str backend) -> (Tensor, Tensor)")
define("write_kv_cache",
       "(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slot_mapping) -> ()")


class AttentionOutput(NamedTuple):
    out: torch.Tensor  # [total_q, Hq, D], q.dtype
    lse: torch.Tensor  # [total_q, Hq], fp32, natural log of the softmax denominator


def _int_vector(op: str, name: str, t, length: int | None = None) -> None:
    check_tensor(op, name, t, 1)
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{op}: {name} must be int32 or int64, got {t.dtype}")
    if length is not None and t.shape[0] != length:
        raise ValueError(f"{op}: {name} {list(t.shape)} must have {length} entries")


def _check_qkv(op: str, q, k, v, kv_rank: int) -> tuple[int, int, int]:
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


def _host_lengths(op: str, cu_q, seqlens_k, total_q: int, capacity) -> tuple[list, list]:
    """Copy the lengths to the host once and check them (bad lengths would read out of bounds)."""
    cu = cu_q.tolist()
    lens = seqlens_k.tolist()
    check_cu_seqlens(op, "cu_seqlens_q", cu, total_q, "total_q")
    for b, length in enumerate(lens):
        q_len = cu[b + 1] - cu[b]
        if length < q_len:
            raise ValueError(f"{op}: sequence {b} has cache_seqlens {length} < q_len {q_len}; "
                             f"its new tokens' K/V must already be in the cache")
        if capacity is not None and length > capacity(b):
            raise ValueError(f"{op}: sequence {b} has {length} keys but room for {capacity(b)}")
    return cu, lens


def _scale(scale: float | None, d: int) -> float:
    return 1.0 / math.sqrt(d) if scale is None else float(scale)


def _check_scale(op: str, scale: float) -> None:
    if not math.isfinite(scale):
        raise ValueError(f"{op}: scale must be finite, got {scale}")


def _cache_layout(op, q, k_cache, cache_seqlens, cu_seqlens_q, block_table):
    """Validate a (paged or contiguous) cache call; return (layout, cu, lens)."""
    n_seq = cache_seqlens.shape[0]
    _int_vector(op, "cache_seqlens", cache_seqlens)
    _int_vector(op, "cu_seqlens_q", cu_seqlens_q, n_seq + 1)
    if k_cache.stride(-1) != 1:
        raise ValueError(f"{op}: k_cache/v_cache need unit stride along head_dim")
    if block_table is None:
        if k_cache.shape[0] != n_seq:
            raise ValueError(f"{op}: a contiguous cache {list(k_cache.shape)} needs one row per "
                             f"sequence ({n_seq})")
        max_len = k_cache.shape[1]
        base = torch.arange(n_seq, dtype=torch.int64, device=q.device) * k_cache.stride(0)
        layout = Layout(None, base, max_len, 0, k_cache.stride(1))
        capacity = lambda b: max_len
        cu, lens = _host_lengths(op, cu_seqlens_q, cache_seqlens, q.shape[0], capacity)
        return layout, cu, lens
    check_tensor(op, "block_table", block_table, 2)
    if block_table.dtype not in (torch.int32, torch.int64) or block_table.shape[0] != n_seq:
        raise ValueError(f"{op}: block_table must be int32/int64 [B={n_seq}, max_blocks], got "
                         f"{list(block_table.shape)} {block_table.dtype}")
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    capacity = lambda b: block_table.shape[1] * block_size
    cu, lens = _host_lengths(op, cu_seqlens_q, cache_seqlens, q.shape[0], capacity)
    # One vectorised check (one host sync) over the pages each sequence actually uses.
    pages = torch.tensor([-(-n // block_size) for n in lens], device=block_table.device)
    used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < pages[:, None]
    outside = used & ((block_table < 0) | (block_table >= num_blocks))
    bad_rows = outside.any(dim=1).nonzero().flatten().tolist()
    if bad_rows:
        b = bad_rows[0]
        raise ValueError(f"{op}: block_table row {b} points outside the cache's {num_blocks} "
                         f"blocks: {block_table[b, : int(pages[b])].tolist()}")
    table = block_table.to(torch.int32).contiguous()
    return Layout(table, None, block_size, k_cache.stride(0), k_cache.stride(1)), cu, lens


@torch.library.impl("bik::attention", ("cpu", "cuda"))
def _attention_impl(q, k_cache, v_cache, cache_seqlens, cu_seqlens_q, block_table, scale, causal,
                    backend):
    op = "bik.attention"
    _check_qkv(op, q, k_cache, v_cache, 4)
    check_same_device(op, q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens,
                      cu_seqlens_q=cu_seqlens_q, block_table=block_table)
    _check_scale(op, scale)
    run_attention = implementation("attention", backend, q.device, label=op)
    layout, cu, lens = _cache_layout(op, q, k_cache, cache_seqlens, cu_seqlens_q, block_table)
    problem = Problem(q, k_cache, v_cache, layout, cu, lens, cu_seqlens_q, cache_seqlens, scale,
                      causal)
    return run_attention(op, problem)[0]


@torch.library.register_fake("bik::attention")
def _attention_fake(q, k_cache, v_cache, cache_seqlens, cu_seqlens_q, block_table, scale, causal,
                    backend):
    _check_qkv("bik.attention", q, k_cache, v_cache, 4)
    check_same_device("bik.attention", q=q, k_cache=k_cache, v_cache=v_cache,
                      cache_seqlens=cache_seqlens, cu_seqlens_q=cu_seqlens_q,
                      block_table=block_table)
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.impl("bik::attention_varlen", ("cpu", "cuda"))
def _attention_varlen_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, backend):
    op = "bik.attention_varlen"
    _check_qkv(op, q, k, v, 3)
    check_same_device(op, q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    _check_scale(op, scale)
    run_attention = implementation("attention_varlen", backend, q.device, label=op)
    _int_vector(op, "cu_seqlens_k", cu_seqlens_k)
    _int_vector(op, "cu_seqlens_q", cu_seqlens_q, cu_seqlens_k.shape[0])
    if k.stride(-1) != 1:
        raise ValueError(f"{op}: k/v need unit stride along head_dim")
    cu_k = cu_seqlens_k.tolist()
    check_cu_seqlens(op, "cu_seqlens_k", cu_k, k.shape[0], "total_k")
    seqlens_k = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    cu, lens = _host_lengths(op, cu_seqlens_q, seqlens_k, q.shape[0], None)
    base = cu_seqlens_k[:-1].to(torch.int64) * k.stride(0)
    layout = Layout(None, base, 1, 0, k.stride(0))
    return run_attention(op, Problem(q, k, v, layout, cu, lens, cu_seqlens_q, seqlens_k, scale,
                                     causal))


@torch.library.register_fake("bik::attention_varlen")
def _attention_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, backend):
    _check_qkv("bik.attention_varlen", q, k, v, 3)
    check_same_device("bik.attention_varlen", q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q,
                      cu_seqlens_k=cu_seqlens_k)
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32))


@torch.library.impl("bik::write_kv_cache", ("cpu", "cuda"))
def _write_kv_cache_impl(k_cache, v_cache, k, v, slot_mapping):
    op = "bik.write_kv_cache"
    _check_kv_write(op, k_cache, v_cache, k, v, slot_mapping)
    slots = slot_mapping.long()
    keep = slots >= 0  # negative slots mark padding tokens, which are not written
    hkv, d = k_cache.shape[-2], k_cache.shape[-1]
    n_slots = k_cache.numel() // (hkv * d)
    if slots.numel() and int(slots.max()) >= n_slots:
        raise ValueError(f"{op}: slot {int(slots.max())} is outside the cache's {n_slots} slots")
    for cache, new in ((k_cache, k), (v_cache, v)):
        flat = cache.view(-1, hkv, d)  # a view: the write lands in the caller's cache
        flat.index_copy_(0, slots[keep], new[keep])


# bik::attention_varlen's backward: ops/attention/backward.py (built from bik::bmm).


def _check_kv_write(op, k_cache, v_cache, k, v, slot_mapping):
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(op, name, t)
        if t.dim() not in (3, 4) or not t.is_contiguous():
            raise ValueError(f"{op}: {name} must be a contiguous [num_blocks, block_size, Hkv, D] "
                             f"or [B, max_len, Hkv, D] cache, got {list(t.shape)}")
    check_tensor(op, "k", k, 3)
    check_tensor(op, "v", v, 3)
    _int_vector(op, "slot_mapping", slot_mapping, k.shape[0])
    if k.shape != v.shape or k.shape[1:] != k_cache.shape[-2:] or k_cache.shape != v_cache.shape:
        raise ValueError(f"{op}: k {list(k.shape)} / v {list(v.shape)} must be [tokens, Hkv, D] "
                         f"matching the caches {list(k_cache.shape)}")
    if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
        raise TypeError(f"{op}: new k/v ({k.dtype}) must have the cache dtype ({k_cache.dtype})")
    check_same_device(op, k_cache=k_cache, v_cache=v_cache, k=k, v=v, slot_mapping=slot_mapping)


@torch.library.register_fake("bik::write_kv_cache")
def _write_kv_cache_fake(k_cache, v_cache, k, v, slot_mapping):
    _check_kv_write("bik.write_kv_cache", k_cache, v_cache, k, v, slot_mapping)


@documented("attention")
def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
              cache_seqlens: torch.Tensor, cu_seqlens_q: torch.Tensor,
              block_table: torch.Tensor | None = None, scale: float | None = None,
              causal: bool = True, backend: str | None = None) -> torch.Tensor:
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
        backend: {backends}

    Returns:
        [total_q, Hq, D] in q.dtype. The bits for (sequence, absolute position, head) do not
        depend on the batch, on the sequence's row, on how its tokens were chunked into calls,
        or on the page size. One host sync per call reads the lengths.
    """
    op = "bik.attention"
    check_tensor(op, "q", q, 3)
    backend = resolve_backend("attention", backend, q.device)
    return torch.ops.bik.attention(q, k_cache, v_cache, cache_seqlens, cu_seqlens_q, block_table,
                                   _scale(scale, q.shape[-1]), bool(causal), backend)


@documented("attention_varlen")
def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                     cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                     scale: float | None = None, causal: bool = True,
                     backend: str | None = None) -> AttentionOutput:
    """Packed varlen attention without a cache: q [total_q, Hq, D], k/v [total_k, Hkv, D].

    Query i of sequence b sits at absolute position L_k - L_q + i (bottom-right aligned, as in
    :func:`attention`), so a token's output equals the paged path's bit for bit on the same
    backend. Returns (out [total_q, Hq, D], lse [total_q, Hq] fp32, natural log). Its
    backward (``.backward()`` through out and lse) is batch-invariant too.

    Args:
        backend: {backends}
    """
    op = "bik.attention_varlen"
    check_tensor(op, "q", q, 3)
    backend = resolve_backend("attention_varlen", backend, q.device)
    out, lse = torch.ops.bik.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                              _scale(scale, q.shape[-1]), bool(causal), backend)
    return AttentionOutput(out, lse)


def write_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write new K/V rows [tokens, Hkv, D] into the caches in place.

    Slot s is row ``s`` of the cache viewed as [-1, Hkv, D]: for a paged cache
    s = block * block_size + offset, for a contiguous one s = b * max_len + position.
    Negative slots (padding) are skipped. Pure data movement: it cannot change any bits.
    """
    torch.ops.bik.write_kv_cache(k_cache, v_cache, k, v, slot_mapping)
