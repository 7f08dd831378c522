"""SDPA with a padding mask, as bik::attention_varlen: each sequence's real keys and queries
compacted, so its splits start at its own first real key.

HF batches prompts of different lengths with left (or right) padding and hands SDPA a mask
that combines padding and causality: query row j of sequence b sees keys [lo_b, hi_bj]. Run on
the padded layout, a row's attention would be aligned to the padded positions, so its bits would
move with the padding its neighbours forced on it. Here every sequence becomes one varlen
sequence: the queries that see at least one key, and the keys [lo_b, hi_b]; bik's causal rule
(query i of Lq_b sees keys up to Lk_b - Lq_b + i) is the mask's when hi_bj steps with j. A
masked key then contributes nothing at all, as in the sequence alone.

What is served: masks whose rows are, per sequence, one run of keys with a common start and an
end that is either common (no causality, or one query) or steps with the query row (causal),
over a contiguous run of query rows, one sequence per batch row or several packed into one
(a block-diagonal mask, as transformers builds from position_ids restarting per sequence: a
new sequence starts at the row whose keys lie past every key the rows before it saw);
boolean (True = attend) or additive with 0 for attended keys and -inf or the dtype's lowest
value for masked ones; broadcast over heads or equal across them. Anything else is a counted, warned fallback to the stock kernel. Pad queries run the
stock kernel on their own: under left padding they see no key, and their values are torch's
(zeros under a boolean or -inf mask, the average of V under a finite one); under right padding
(a causal ramp, then rows past the sequence's end that see all of its keys) they are torch's
attention over those keys. No real row depends on a pad query.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["MaskNotServed", "PaddedSpans", "padded_spans"]


class PaddedSpans(NamedTuple):
    """Per sequence i, in batch row batch[i]: real query rows [qa[i], qb[i]) and keys
    [lo[i], hi[i]] (host ints). A padded batch has one sequence per batch row; a packed one
    (several sequences in one row, each seeing only its own keys) has several."""

    batch: list[int]
    qa: list[int]
    qb: list[int]
    lo: list[int]
    hi: list[int]
    causal: bool  # bik's bottom-right causal rule on the compacted sequences
    # (b, query rows the stock kernel runs alone): rows that see no key (left padding's pad
    # queries) and right padding's pad queries past a sequence's end. No real row reads them.
    stock_rows: list[tuple[int, list[int]]]


class MaskNotServed(Exception):
    """The mask is not a padding (+ causal) mask bik compacts; the message is the reason."""


def _attended(mask: torch.Tensor) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        raise MaskNotServed("an integer attn_mask")
    lowest = torch.finfo(mask.dtype).min
    keep = mask == 0
    if not bool((keep | (mask == float("-inf")) | (mask == lowest)).all()):
        raise MaskNotServed("an additive attn_mask with values other than 0 and -inf/lowest")
    return keep


def padded_spans(mask: torch.Tensor, nb: int, lq: int, lk: int) -> PaddedSpans:
    """Reads the mask (a host sync on a GPU: eager only) and returns its spans, or raises
    MaskNotServed naming what the mask is."""
    keep = _attended(mask)
    if keep.dim() > 4 or keep.dim() < 2:
        raise MaskNotServed("an attn_mask that is not 2-D to 4-D")
    keep = keep.reshape((1,) * (4 - keep.dim()) + tuple(keep.shape))
    if keep.shape[-1] != lk or keep.shape[-2] not in (1, lq) or keep.shape[0] not in (1, nb):
        raise MaskNotServed("an attn_mask broadcast other than over batch, heads and queries")
    if keep.shape[1] > 1 and not bool((keep == keep[:, :1]).all()):
        raise MaskNotServed("an attn_mask that differs between heads")
    keep = keep[:, 0].expand(nb, lq, lk)  # (HF folds GQA groups into queries: one mask row)
    count = keep.sum(-1)  # [B, Lq]
    pos = torch.arange(lk, device=keep.device)
    big = torch.full_like(pos, lk)
    first = torch.where(keep, pos, big).amin(-1)  # lk where the row is empty
    last = torch.where(keep, pos, -1).amax(-1)
    if not bool((count == 0).logical_or(count == last - first + 1).all()):
        raise MaskNotServed("an attn_mask whose rows are not one run of keys")
    count, first, last = count.tolist(), first.tolist(), last.tolist()
    seqs = [(b, s, _sequence_rows(count[b][s:e], first[b][s:e], last[b][s:e]))
            for b in range(nb) for s, e in _packed_blocks(count[b], first[b], last[b])]
    causal = any(r.kind in ("causal", "tail") for _, _, r in seqs)
    if causal and any(r.kind == "full" for _, _, r in seqs):
        raise MaskNotServed("an attn_mask causal for some sequences and full for others")
    spans = PaddedSpans([], [], [], [], [], causal, [])
    for b, s, r in seqs:
        # Real queries: the ramp when the rows after it are right padding's pad queries.
        padded = r.kind == "tail" or (r.kind == "ambiguous" and causal)
        real = r.ramp if padded else len(r.ends)
        end = r.ends[real - 1] if real else -1
        if real > end - r.start + 1:
            raise MaskNotServed("more real queries than keys in a sequence")
        rest = r.missing + list(range(r.a + real, r.a + len(r.ends)))
        if rest:
            spans.stock_rows.append((b, sorted(s + j for j in rest)))
        for field, value in zip(spans[:5], (b, s + r.a, s + r.a + real, r.start, end)):
            field.append(value)
    return spans


def _packed_blocks(count: list[int], first: list[int], last: list[int]) -> list[tuple[int, int]]:
    """A batch row's query rows [s, e) per sequence: a new sequence starts at a row whose keys
    all lie past every key the rows before it saw (packed sequences, each seeing only its own
    keys; rows that see no key stay with the sequence before them, or the first). Rows whose
    runs overlap (a sliding window) stay one sequence, which _sequence_rows refuses."""
    starts, seen = [0], -1
    for j, (c, f, z) in enumerate(zip(count, first, last)):
        if c and seen >= 0 and f > seen:
            starts.append(j)
        if c:
            seen = max(seen, z)
    return list(zip(starts, starts[1:] + [len(count)]))


class _Rows(NamedTuple):
    kind: str
    a: int  # first query row that sees a key
    ramp: int  # rows from a whose last key steps by one
    start: int  # their common first key
    ends: list[int]  # the last key of each row a, a+1, ...
    missing: list[int]  # rows that see no key


def _sequence_rows(count: list[int], first: list[int], last: list[int]) -> _Rows:
    """One sequence's mask rows. kind: "empty" (no row sees a key), "one" (one row does),
    "causal" (every row's end steps by one), "tail" (a causal ramp, then rows that see the
    ramp's keys: right padding's pad queries), "full" (several rows see one common run of
    several keys), "ambiguous" (several rows see one common key: a full mask, or one real
    query and right padding; the other sequences decide)."""
    rows = [j for j, c in enumerate(count) if c]
    missing = [j for j, c in enumerate(count) if not c]
    if not rows:
        return _Rows("empty", 0, 0, 0, [], missing)
    a, z = rows[0], rows[-1] + 1
    if len(rows) != z - a:
        raise MaskNotServed("an attn_mask whose real query rows are not contiguous")
    if len({first[j] for j in rows}) != 1:
        raise MaskNotServed("an attn_mask whose rows start at different keys")
    ends = [last[j] for j in rows]
    ramp = 1
    while ramp < len(ends) and ends[ramp] == ends[ramp - 1] + 1:
        ramp += 1
    if any(e != ends[ramp - 1] for e in ends[ramp:]):
        raise MaskNotServed("an attn_mask that is neither causal nor full per sequence")
    if len(ends) == 1:
        kind = "one"
    elif ramp == len(ends):
        kind = "causal"
    elif ramp > 1:
        kind = "tail"
    else:  # one common end: a single common key is ambiguous, a longer run is full
        kind = "ambiguous" if ends[0] == first[a] else "full"
    return _Rows(kind, a, ramp, first[a], ends, missing)
