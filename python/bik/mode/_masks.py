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
over a contiguous run of query rows; boolean (True = attend) or additive with 0 for attended
keys and -inf or the dtype's lowest value for masked ones; broadcast over heads or equal across
them. Anything else is a counted, warned fallback to the stock kernel. Query rows that see no
key (the pad queries of left padding) run the stock kernel on their own: their values are
torch's (zeros under a boolean or -inf mask, the average of V under a finite one) and no real
row depends on them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["MaskNotServed", "PaddedSpans", "padded_spans"]


class PaddedSpans(NamedTuple):
    """Per sequence b: real query rows [qa[b], qb[b]) and keys [lo[b], hi[b]] (host ints)."""

    qa: list[int]
    qb: list[int]
    lo: list[int]
    hi: list[int]
    causal: bool  # bik's bottom-right causal rule on the compacted sequences
    empty_rows: list[tuple[int, list[int]]]  # (b, query rows that see no key)


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
    qa, qb, lo, hi, empty = [], [], [], [], []
    kinds = set()
    for b in range(nb):
        rows = [j for j in range(lq) if count[b][j]]
        missing = [j for j in range(lq) if not count[b][j]]
        if missing:
            empty.append((b, missing))
        if not rows:
            qa.append(0), qb.append(0), lo.append(0), hi.append(-1)
            continue
        a, z = rows[0], rows[-1] + 1
        if len(rows) != z - a:
            raise MaskNotServed("an attn_mask whose real query rows are not contiguous")
        starts = {first[b][j] for j in rows}
        if len(starts) != 1:
            raise MaskNotServed("an attn_mask whose rows start at different keys")
        ends = [last[b][j] for j in rows]
        if z - a > 1:
            if all(e == ends[-1] for e in ends):
                kinds.add("full")
            elif all(ends[i] == ends[-1] - (len(ends) - 1 - i) for i in range(len(ends))):
                kinds.add("causal")
            else:
                raise MaskNotServed("an attn_mask that is neither causal nor full per sequence")
        if z - a > ends[-1] - first[b][a] + 1:
            raise MaskNotServed("more real queries than keys in a sequence")
        qa.append(a), qb.append(z), lo.append(first[b][a]), hi.append(ends[-1])
    if len(kinds) > 1:
        raise MaskNotServed("an attn_mask causal for some sequences and full for others")
    return PaddedSpans(qa, qb, lo, hi, "causal" in kinds, empty)
