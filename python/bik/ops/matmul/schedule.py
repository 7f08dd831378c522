"""How the K splits of a matmul are scheduled on a GPU (Triton and CUDA alike): speed only.

Both launch modes run the same per-split inner loop and fold the splits in the same ascending
order (bik.configs.matmul_split), so the choice never changes a bit: SPREAD gives each (tile,
split) its own program, writes fp32 partials and folds them in a second kernel; FOLD has one
program per tile compute its splits one after another, adding each to a running total.
"""

from __future__ import annotations

__all__ = ["SPREAD_MAX_TILES", "use_spread"]

# SPREAD while the output tiles alone would not fill one wave of an H200's 132 SMs.
SPREAD_MAX_TILES = 132


def use_spread(tiles: int, n_splits: int) -> bool:
    """Spread the K splits over programs when the output tiles alone leave the GPU idle.
    Either choice gives the same bits; this decides speed and workspace only."""
    return n_splits > 1 and tiles < SPREAD_MAX_TILES
