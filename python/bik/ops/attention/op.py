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

from bik.ops._checks import check_float_dtype, check_same_device, check_tensor, debug_checks
from bik.ops._direct import direct_ok
from bik.ops._registry import define, documented, implementation, resolve_backend
from bik.ops.attention._layout import Layout, Problem

__all__ = ["AttentionOutput", "AttentionPlan", "attention", "attention_varlen", "plan_attention",
           "plan_attention_varlen", "write_kv_cache"]

# Every backend module (triton.py, cuda.py, cpu.py) defines run_attention(label, Problem)
# (bik/ops/attention/_layout.py).
define("attention",
       "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, Tensor cu_seqlens_q, "
       "Tensor? block_table, float scale, bool causal, str backend, int? max_seqlen_q=None, "
       "int? max_seqlen_k=None) -> Tensor")
define("attention_varlen",
       "(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, float scale, "
       "bool causal, str backend, int? max_seqlen_q=None, int? max_seqlen_k=None) "
       "-> (Tensor, Tensor)")
define("write_kv_cache",
       "(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slot_mapping, "
       "bool validate=True) -> ()")


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


def _scale(op: str, scale: float | None, d: int) -> float:
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


def _cache_layout(op, q, k_cache, cache_seqlens, cu_seqlens_q, block_table):
    """Shape checks of a (paged or contiguous) cache call; (layout, room for keys per sequence).
    Reads no device data."""
    n_seq = cache_seqlens.shape[0]
    _int_vector(op, "cache_seqlens", cache_seqlens)
    _int_vector(op, "cu_seqlens_q", cu_seqlens_q, n_seq + 1)
    _check_some_sequence(op, n_seq, q.shape[0])
    if k_cache.stride(-1) != 1:
        raise ValueError(f"{op}: k_cache/v_cache need unit stride along head_dim")
    if block_table is None:
        if k_cache.shape[0] != n_seq:
            raise ValueError(f"{op}: a contiguous cache {list(k_cache.shape)} needs one row per "
                             f"sequence ({n_seq})")
        base = torch.arange(n_seq, dtype=torch.int64, device=q.device) * k_cache.stride(0)
        return (Layout(None, base, k_cache.shape[1], 0, k_cache.stride(1), k_cache.stride(0)),
                k_cache.shape[1])
    check_tensor(op, "block_table", block_table, 2)
    if block_table.dtype not in (torch.int32, torch.int64) or block_table.shape[0] != n_seq:
        raise ValueError(f"{op}: block_table must be int32/int64 [B={n_seq}, max_blocks], got "
                         f"{list(block_table.shape)} {block_table.dtype}")
    block_size = k_cache.shape[1]
    # The caller's dtype: narrowing an int64 entry here would turn a bad page into another
    # page before the CPU kernel's check could see it (the GPU launchers narrow it).
    layout = Layout(block_table.contiguous(), None, block_size, k_cache.stride(0),
                    k_cache.stride(1))
    return layout, block_table.shape[1] * block_size


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


def _cache_call(op, q, k_cache, v_cache, cache_seqlens, cu_seqlens_q, block_table, scale,
                max_seqlen_q, max_seqlen_k):
    """Every check of a bik::attention call; (layout, bounds). With host metadata it reads no
    device data (unless BIK_DEBUG_CHECKS=1); without, it reads the lengths once."""
    _check_qkv(op, q, k_cache, v_cache, 4)
    check_same_device(op, q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens,
                      cu_seqlens_q=cu_seqlens_q, block_table=block_table)
    _check_scale(op, scale)
    layout, capacity = _cache_layout(op, q, k_cache, cache_seqlens, cu_seqlens_q, block_table)
    given = _given_bounds(op, max_seqlen_q, max_seqlen_k, capacity)
    if given is not None and not debug_checks():
        return layout, given
    cu, lens = _read_lengths(op, cu_seqlens_q, cache_seqlens, q.shape[0], capacity)
    if block_table is not None:
        _check_pages(op, block_table, lens, k_cache.shape[0], k_cache.shape[1])
    return layout, _bounds(op, given, cu, lens)


def _attention_impl(q, k_cache, v_cache, cache_seqlens, cu_seqlens_q, block_table, scale, causal,
                    backend, max_seqlen_q=None, max_seqlen_k=None):
    op = "bik.attention"
    run_attention = implementation("attention", backend, q.device, label=op)
    layout, bounds = _cache_call(op, q, k_cache, v_cache, cache_seqlens, cu_seqlens_q,
                                 block_table, scale, max_seqlen_q, max_seqlen_k)
    problem = Problem(q, k_cache, v_cache, layout, cu_seqlens_q, cache_seqlens, *bounds, scale,
                      causal)
    return run_attention(op, problem)[0]


torch.library.impl("bik::attention", ("cpu", "cuda"))(_attention_impl)


@torch.library.register_fake("bik::attention")
def _attention_fake(q, k_cache, v_cache, cache_seqlens, cu_seqlens_q, block_table, scale, causal,
                    backend, max_seqlen_q=None, max_seqlen_k=None):
    _check_qkv("bik.attention", q, k_cache, v_cache, 4)
    check_same_device("bik.attention", q=q, k_cache=k_cache, v_cache=v_cache,
                      cache_seqlens=cache_seqlens, cu_seqlens_q=cu_seqlens_q,
                      block_table=block_table)
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _varlen_call(op, q, k, v, cu_seqlens_q, cu_seqlens_k, scale, max_seqlen_q, max_seqlen_k):
    """Every check of a bik::attention_varlen call; (seqlens_k on the device, bounds). Reads
    no device data with host metadata (unless BIK_DEBUG_CHECKS=1), else the lengths once."""
    _check_qkv(op, q, k, v, 3)
    check_same_device(op, q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    _check_scale(op, scale)
    _int_vector(op, "cu_seqlens_k", cu_seqlens_k)
    _int_vector(op, "cu_seqlens_q", cu_seqlens_q, cu_seqlens_k.shape[0])
    _check_some_sequence(op, cu_seqlens_k.shape[0] - 1, q.shape[0])
    if k.stride(-1) != 1:
        raise ValueError(f"{op}: k/v need unit stride along head_dim")
    seqlens_k = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    given = _given_bounds(op, max_seqlen_q, max_seqlen_k, k.shape[0])
    if given is not None and not debug_checks():
        return seqlens_k, given
    check_cu_seqlens(op, "cu_seqlens_k", cu_seqlens_k.tolist(), k.shape[0], "total_k")
    cu, lens = _read_lengths(op, cu_seqlens_q, seqlens_k, q.shape[0], k.shape[0])
    return seqlens_k, _bounds(op, given, cu, lens)


@torch.library.impl("bik::attention_varlen", ("cpu", "cuda"))
def _attention_varlen_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, backend,
                           max_seqlen_q=None, max_seqlen_k=None):
    op = "bik.attention_varlen"
    run_attention = implementation("attention_varlen", backend, q.device, label=op)
    seqlens_k, bounds = _varlen_call(op, q, k, v, cu_seqlens_q, cu_seqlens_k, scale,
                                     max_seqlen_q, max_seqlen_k)
    # Clamped so an absurd entry stays outside k rather than wrapping into it (the CPU kernel
    # then refuses it); a sound one is unchanged.
    base = cu_seqlens_k[:-1].to(torch.int64).clamp(-1, k.shape[0]) * k.stride(0)
    layout = Layout(None, base, 1, 0, k.stride(0), k.stride(0))
    return run_attention(op, Problem(q, k, v, layout, cu_seqlens_q, seqlens_k, *bounds, scale,
                                     causal))


@torch.library.register_fake("bik::attention_varlen")
def _attention_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, backend,
                           max_seqlen_q=None, max_seqlen_k=None):
    _check_qkv("bik.attention_varlen", q, k, v, 3)
    check_same_device("bik.attention_varlen", q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q,
                      cu_seqlens_k=cu_seqlens_k)
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32))


def _write_kv_cache_impl(k_cache, v_cache, k, v, slot_mapping, validate=True):
    op = "bik.write_kv_cache"
    _check_kv_write(op, k_cache, v_cache, k, v, slot_mapping)
    if k_cache.numel() and k_cache.data_ptr() == v_cache.data_ptr():  # (not in the fake)
        raise ValueError(f"{op}: k_cache and v_cache are the same memory (v would overwrite k)")
    hkv, d = k_cache.shape[-2], k_cache.shape[-1]
    n_slots = k_cache.numel() // (hkv * d)
    if (validate or debug_checks()) and slot_mapping.numel():
        slots = slot_mapping.long()
        used = torch.sort(torch.where(slots >= 0, slots, -1)).values
        twice = (used[1:] == used[:-1]) & (used[1:] >= 0)
        top, n_twice = torch.stack([slots.max(), twice.sum()]).tolist()  # the one host sync
        if top >= n_slots:
            raise ValueError(f"{op}: slot {top} is outside the cache's {n_slots} slots")
        if n_twice:  # which token's K/V would land there is up to the kernel: refuse
            raise ValueError(f"{op}: slot_mapping names a slot more than once ({n_twice} "
                             f"repeats)")
    if k_cache.device.type != "cpu":
        from bik.ops.attention.kv_cache_triton import write_rows_triton

        write_rows_triton(_paged_view(k_cache), _paged_view(v_cache), k, v, slot_mapping)
        return
    from bik.ops.attention.cpu import write_rows_cpu

    slots = slot_mapping.long()
    # Negative slots mark padding tokens and unchecked slots past the cache are skipped (as
    # the GPU kernel does): both by the C++ copy loop, or here by a mask.
    if all(write_rows_cpu(_paged_view(c), new, slots) for c, new in ((k_cache, k), (v_cache, v))):
        return
    keep = (slots >= 0) & (slots < n_slots)
    rows = slots[keep]
    for cache, new in ((k_cache, k), (v_cache, v)):
        pages = _paged_view(cache)  # a view: the write lands in the caller's cache
        block = pages.shape[1]
        pages[rows // block, rows % block] = new[keep]


torch.library.impl("bik::write_kv_cache", ("cpu", "cuda"))(_write_kv_cache_impl)


def _paged_view(cache: torch.Tensor) -> torch.Tensor:
    """A cache as [pages, tokens per page, Hkv, D] (a contiguous [B, max_len] one is already,
    a [slots, Hkv, D] one has pages of one token), strides kept."""
    return cache if cache.dim() == 4 else cache.unsqueeze(1)


# bik::attention_varlen's backward: ops/attention/backward.py (built from bik::bmm).


def _check_kv_write(op, k_cache, v_cache, k, v, slot_mapping):
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
    _int_vector(op, "slot_mapping", slot_mapping, k.shape[0])
    if k.shape != v.shape or k.shape[1:] != k_cache.shape[-2:] or k_cache.shape != v_cache.shape:
        raise ValueError(f"{op}: k {list(k.shape)} / v {list(v.shape)} must be [tokens, Hkv, D] "
                         f"matching the caches {list(k_cache.shape)}")
    if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
        raise TypeError(f"{op}: new k/v ({k.dtype}) must have the cache dtype ({k_cache.dtype})")
    check_same_device(op, k_cache=k_cache, v_cache=v_cache, k=k, v=v, slot_mapping=slot_mapping)


@torch.library.register_fake("bik::write_kv_cache")
def _write_kv_cache_fake(k_cache, v_cache, k, v, slot_mapping, validate=True):
    _check_kv_write("bik.write_kv_cache", k_cache, v_cache, k, v, slot_mapping)


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
    # No autograd formula: where nothing can observe it (ops/_direct.py) the impl runs without
    # the dispatcher's round trip, which costs more than a decode step's kernel.
    run = _attention_impl if direct_ok(q, k_cache, v_cache, cache_seqlens, cu_seqlens_q,
                                       block_table) else torch.ops.bik.attention
    return run(q, k_cache, v_cache, cache_seqlens, cu_seqlens_q, block_table,
               _scale(op, scale, q.shape[-1]), bool(causal), backend, max_seqlen_q, max_seqlen_k)


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
    out, lse = torch.ops.bik.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                              _scale(op, scale, q.shape[-1]), bool(causal), backend,
                                              max_seqlen_q, max_seqlen_k)
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
    _, bounds = _cache_call(op, q, k_cache, v_cache, cache_seqlens, cu_seqlens_q, block_table,
                            1.0, None, None)
    return bounds


def plan_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                          cu_seqlens_q: torch.Tensor,
                          cu_seqlens_k: torch.Tensor) -> AttentionPlan:
    """:func:`plan_attention` for :func:`attention_varlen`."""
    op = "bik.plan_attention_varlen"
    return _varlen_call(op, q, k, v, cu_seqlens_q, cu_seqlens_k, 1.0, None, None)[1]


def write_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, slot_mapping: torch.Tensor, *,
                   validate: bool = True) -> None:
    """Write new K/V rows [tokens, Hkv, D] into the caches in place.

    Slot s is row ``s`` of the cache viewed as [-1, Hkv, D]: for a paged cache
    s = block * block_size + offset, for a contiguous one s = b * max_len + position.
    Negative slots (padding) are skipped. Pure data movement: it cannot change any bits.
    ``validate`` (default) checks every slot is inside the cache and named once, one host
    sync; with ``validate=False`` nothing is read back (CUDA-graph safe) and a slot past the
    cache is skipped — check the mapping where you build it (or set BIK_DEBUG_CHECKS=1).
    """
    if direct_ok(k_cache, v_cache, k, v, slot_mapping):  # no dispatcher round trip (_direct)
        _write_kv_cache_impl(k_cache, v_cache, k, v, slot_mapping, bool(validate))
    else:
        torch.ops.bik.write_kv_cache(k_cache, v_cache, k, v, slot_mapping, bool(validate))


for _fn in (attention, attention_varlen):
    if _fn.__doc__:  # None under python -OO
        _fn.__doc__ = _fn.__doc__.replace("{host_metadata}", _HOST_METADATA_DOC)
