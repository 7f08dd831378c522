"""How the K splits of a matmul are scheduled on a GPU (Triton and CUDA alike): speed only.

Every launch mode runs the same per-split inner loop and folds the splits in the same ascending
order (bik.configs.matmul_split), so the choice never changes a bit: SPREAD gives each (tile,
split) its own program, writes fp32 partials and folds them in a second kernel; FOLD has one
program per tile compute its splits one after another, adding each to a running total;
PERSISTENT (Triton on Hopper) runs FOLD's per-tile work in one program per SM that loops over
the tiles, loading through TMA.
"""

from __future__ import annotations

import functools

import torch

from bik.configs import arch_family

# SPREAD while the output tiles alone would not fill one wave of an H200's 132 SMs.
SPREAD_MAX_TILES = 132


def use_spread(tiles: int, n_splits: int, *, workspace_bytes: int = 0,
               weight_bytes: int | None = None) -> bool:
    """Spread the K splits over programs when the output tiles alone leave the GPU idle, and
    only while SPREAD's fp32 partials (``workspace_bytes``: written once, read back once) are
    smaller than the weights (``weight_bytes``, read once either way): past that, the
    workspace traffic costs more than the idle SMs (Llama-3-8B's N = K = 4096 layer at M = 512:
    8 splits of 512 x 4096 fp32 partials are 67 MB each way against 34 MB of bf16 weights).
    Either choice gives the same bits; this decides speed and workspace only."""
    small = weight_bytes is None or workspace_bytes < weight_bytes
    return n_splits > 1 and tiles < SPREAD_MAX_TILES and small


def spread_bytes(batch: int, m: int, n: int, k: int, n_splits: int,
                 itemsize: int) -> dict[str, int]:
    """use_spread's bytes model for out[batch, M, N] = a[batch, M, K] @ b[batch, K, N]."""
    return {"workspace_bytes": batch * n_splits * m * n * 4,
            "weight_bytes": batch * k * n * itemsize}


# PERSISTENT's program count in the interpreter: a few, so that programs take several tiles.
INTERPRETER_PROGRAMS = 3


def use_persistent(arch: str, dtype: torch.dtype, tiles: int) -> bool:
    """PERSISTENT (TMA loads, one program per SM looping over the tiles) on Hopper-class GPUs
    for 16-bit inputs once the output tiles fill a wave: the large-M path. (IEEE fp32 runs no
    tensor-core instruction, and its transposed-B tile spilled in this mode on sm_90.) Either
    choice gives the same bits."""
    return (dtype in (torch.bfloat16, torch.float16) and arch.startswith("sm")
            and arch_family(arch) == "sm90" and tiles >= SPREAD_MAX_TILES)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def persistent_programs(device: torch.device, tiles: int) -> int:
    """PERSISTENT's grid: one program per SM (cached per device), never more than the tiles."""
    if device.type != "cuda":
        return max(1, min(tiles, INTERPRETER_PROGRAMS))
    return max(1, min(tiles, _sm_count(device.index if device.index is not None
                                       else torch.cuda.current_device())))
