"""Expert parallelism whose bits do not depend on how many ranks hold the experts.

The usual expert-parallel combine has each rank weight and sum its own experts' outputs per
token and all-reduces the partial sums: a token's experts are then added in an order set by
which rank holds which expert and by the collective, not in the slot order a trainer sums in.
Here every rank keeps the tokens (as after an all-gather of the batch) and the experts of its
contiguous slice; the (token, slot) pairs are sorted by expert exactly as on one device
(:func:`bik.moe.sort_pairs`), so rank r's experts own one contiguous block of the sorted pairs;
each rank computes its block's expert rows (:func:`bik.moe.expert_rows`: every row depends on
its pair alone, so these are the one-device rows), an all_gather of the raw bytes brings every
block to every rank in rank order, which is sorted order, and every rank combines the rows as
one device does (:func:`bik.moe.combine`): ``bik.moe.experts`` on one device, bit for bit, on
every rank, at any number of ranks dividing the experts.

Run it under ``bik.enable()`` (as ``bik.moe.experts`` is), with a process-group timeout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from bik.distributed._meta import describe, gather_and_check, group_size_rank
from bik.moe import combine, expert_rows, sort_pairs

__all__ = ["expert_parallel_experts"]

_OP = "bik.distributed.expert_parallel_experts"


def _all_gather_rows(rows: torch.Tensor, counts: list[int], group) -> torch.Tensor:
    """Every rank's rows, in rank order: padded to the longest block and gathered as bytes (a
    copy of the bits, whatever the backend supports: gloo takes no int16 / bf16)."""
    width = max(counts)
    if width == 0:
        return rows
    padded = rows.new_zeros((width, rows.shape[1]))
    padded[:rows.shape[0]] = rows
    raw = padded.view(torch.uint8)
    blocks = [torch.empty_like(raw) for _ in counts]
    dist.all_gather(blocks, raw.contiguous(), group=group)
    return torch.cat([b[:c] for b, c in zip(blocks, counts)]).view(rows.dtype)


def expert_parallel_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                            w13_shard: torch.Tensor, w2_shard: torch.Tensor, *, experts: int,
                            group=None) -> torch.Tensor:
    """``bik.moe.experts(x, ids, weights, w13, w2)`` with the experts sharded over the ranks of
    ``group``: rank r holds experts ``[r E / W, (r + 1) E / W)`` (``w13_shard`` [E / W, 2I, H],
    ``w2_shard`` [E / W, H, I]); every rank passes the same x [T, H], ids and weights [T, k].
    Returns the one-device result [T, H] on every rank. A collective: the ranks first agree on
    shapes, dtypes and bik's fingerprint (a mismatch raises ValueError on every rank)."""
    size, rank = group_size_rank(group)
    bad = None
    if experts % size:
        bad = f"{experts} experts do not split over {size} ranks"
    elif w13_shard.dim() != 3 or w2_shard.dim() != 3 or \
            w13_shard.shape[0] != experts // size or w2_shard.shape[0] != experts // size:
        bad = (f"rank {rank} holds w13 {list(w13_shard.shape)}, w2 {list(w2_shard.shape)}; "
               f"expected {experts // size} experts each")
    gather_and_check(_OP, group, x.device,
                     same=("x", "ids", "weights", "w13", "w2", "experts", "bad"),
                     x=describe(x), ids=describe(ids), weights=describe(weights),
                     w13=describe(w13_shard), w2=describe(w2_shard), experts=experts,
                     bad=bad is not None)
    if bad is not None:
        raise ValueError(f"{_OP}: {bad}")
    per = experts // size
    pairs = sort_pairs(x, ids, weights, experts)
    bounds = [0] + pairs.ends[per - 1::per].tolist()  # each rank's block of the sorted pairs
    lo, hi = bounds[rank], bounds[rank + 1]
    local_ends = pairs.ends[rank * per:(rank + 1) * per] - lo
    if hi > lo:
        rows = expert_rows(pairs.selected[lo:hi], local_ends, w13_shard, w2_shard)
    else:
        rows = torch.zeros((0, w2_shard.shape[1]), dtype=w2_shard.dtype, device=x.device)
    counts = [b - a for a, b in zip(bounds, bounds[1:])]
    return combine(_all_gather_rows(rows, counts, group), pairs, x.shape[0], x.dtype)
