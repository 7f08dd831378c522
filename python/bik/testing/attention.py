"""Attention invariance scenarios: one sequence's tokens scheduled in different ways.

``attn(q, k_cache, v_cache, cache_seqlens, cu_seqlens_q, block_table) -> out`` is any function
with :func:`bik.attention`'s calling convention (the tests pass bik's backends and the
deliberately length-adaptive reference :func:`bik.testing.controls.length_adaptive_attention`).
Every comparison is of bit patterns (:func:`bik.testing.harness.same_bits`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from bik.testing.harness import InvarianceReport, same_bits

__all__ = ["PagedBatch", "Request", "chunking_report", "make_request", "neighbours_report",
           "pack_paged", "page_size_report", "run_chunks"]

AttnFn = Callable[..., torch.Tensor]


class Request(NamedTuple):
    """One request: its queries, keys and values for every position 0..L-1."""

    q: torch.Tensor  # [L, Hq, D]
    k: torch.Tensor  # [L, Hkv, D]
    v: torch.Tensor  # [L, Hkv, D]


class PagedBatch(NamedTuple):
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    cache_seqlens: torch.Tensor


def make_request(gen: torch.Generator, length: int, hq: int, hkv: int, d: int,
                  dtype: torch.dtype, device="cpu") -> Request:
    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    return Request(randn(length, hq, d), randn(length, hkv, d), randn(length, hkv, d))


def pack_paged(seqs: Sequence[Request], lengths: Sequence[int], page_size: int,
               gen: torch.Generator) -> PagedBatch:
    """Write each sequence's first ``lengths[b]`` keys into a shared paged cache whose pages are
    handed out in a random order (so no sequence gets contiguous or aligned pages)."""
    hkv, d = seqs[0].k.shape[1:]
    pages = [-(-max(length, 1) // page_size) for length in lengths]
    total = sum(pages) + 3  # a few pages nobody owns
    k_cache = torch.zeros(total, page_size, hkv, d, dtype=seqs[0].k.dtype, device=seqs[0].k.device)
    v_cache = torch.zeros_like(k_cache)
    order = torch.randperm(total, generator=gen)
    table = torch.zeros(len(seqs), max(pages), dtype=torch.int32)
    used = 0
    for b, (seq, length) in enumerate(zip(seqs, lengths)):
        table[b, : pages[b]] = order[used: used + pages[b]]
        used += pages[b]
        pos = torch.arange(length)
        slot = table[b, pos // page_size].long() * page_size + pos % page_size
        k_cache.view(-1, hkv, d)[slot.to(k_cache.device)] = seq.k[:length]
        v_cache.view(-1, hkv, d)[slot.to(k_cache.device)] = seq.v[:length]
    device = seqs[0].k.device
    return PagedBatch(k_cache, v_cache, table.to(device),
                      torch.tensor(lengths, dtype=torch.int32, device=device))


def run_chunks(attn: AttnFn, seq: Request, chunk: int, page_size: int,
                gen: torch.Generator) -> torch.Tensor:
    """All tokens of ``seq`` computed in calls of ``chunk`` new tokens each (1 = decode)."""
    length = seq.q.shape[0]
    outs = []
    for start in range(0, length, chunk):
        end = min(start + chunk, length)
        cache = pack_paged([seq], [end], page_size, gen)
        cu = torch.tensor([0, end - start], dtype=torch.int32, device=seq.q.device)
        outs.append(attn(seq.q[start:end], cache.k_cache, cache.v_cache, cache.cache_seqlens, cu,
                         cache.block_table))
    return torch.cat(outs)


def _token_report(name: str, reference: torch.Tensor, got: torch.Tensor, tag) -> InvarianceReport:
    bad = tuple((tag, t) for t in range(reference.shape[0]) if not same_bits(got[t], reference[t]))
    return InvarianceReport(name, reference.shape[0], bad)


def chunking_report(attn: AttnFn, seq: Request, chunks: Sequence[int], *, page_size: int = 16,
                    seed: int = 0, name: str = "attention") -> list[InvarianceReport]:
    """One prefill of the whole sequence vs chunked prefill / decode (chunk 1) / verify windows:
    every token's output must have the same bits."""
    gen = torch.Generator().manual_seed(seed)
    whole = run_chunks(attn, seq, seq.q.shape[0], page_size, gen)
    return [_token_report(f"{name} chunks of {c} vs one prefill (L={seq.q.shape[0]})", whole,
                          run_chunks(attn, seq, c, page_size, gen), c) for c in chunks]


def page_size_report(attn: AttnFn, seq: Request, page_sizes: Sequence[int], *, seed: int = 0,
                     name: str = "attention") -> list[InvarianceReport]:
    gen = torch.Generator().manual_seed(seed)
    length = seq.q.shape[0]
    ref = run_chunks(attn, seq, length, page_sizes[0], gen)
    return [_token_report(f"{name} page size {p} vs {page_sizes[0]} (L={length})", ref,
                          run_chunks(attn, seq, length, p, gen), p) for p in page_sizes[1:]]


def neighbours_report(attn: AttnFn, seq: Request, q_len: int, neighbours: Sequence[Request],
                      neighbour_q_lens: Sequence[int], *, page_size: int = 16, seed: int = 0,
                      name: str = "attention") -> InvarianceReport:
    """The last ``q_len`` tokens of ``seq`` alone vs inside a batch with the neighbours (each
    with its own q_len), at every row position of the batch."""
    gen = torch.Generator().manual_seed(seed)
    length = seq.q.shape[0]

    def run(batch: list[Request], q_lens: list[int]) -> list[torch.Tensor]:
        lengths = [s.q.shape[0] for s in batch]
        cache = pack_paged(batch, lengths, page_size, gen)
        q = torch.cat([s.q[len_ - ql:] for s, len_, ql in zip(batch, lengths, q_lens)])
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                          device=q.device)
        out = attn(q, cache.k_cache, cache.v_cache, cache.cache_seqlens, cu, cache.block_table)
        return list(out.split(q_lens))

    alone = run([seq], [q_len])[0]
    bad = []
    for row in range(len(neighbours) + 1):
        batch = list(neighbours[:row]) + [seq] + list(neighbours[row:])
        q_lens = list(neighbour_q_lens[:row]) + [q_len] + list(neighbour_q_lens[row:])
        if not same_bits(run(batch, q_lens)[row], alone):
            bad.append((len(batch), row))
    return InvarianceReport(f"{name} q_len={q_len} among {len(neighbours)} neighbours (L={length})",
                            len(neighbours) + 1, tuple(bad))
