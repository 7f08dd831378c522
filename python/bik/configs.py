"""Kernel configuration tables: the only knobs that decide a kernel's reduction order.

Every entry is keyed by what the *problem* is (dtype, N, K or hidden size, GPU arch) and
never by the number of rows M, so a row's reduction order cannot change when the batch
grows. There is no runtime autotuning. Changing anything here changes the bits bik
produces, and therefore changes :func:`bik.fingerprint` (it hashes this file).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from bik._dtypes import info
from bik._env import flag

__all__ = [
    "CUDA_ATTENTION_HEAD_DIMS",
    "CUDA_DEFINES",
    "MATMUL_SPLIT_ENV",
    "MATMUL_TP_MAX",
    "SAMPLER_CHUNK",
    "SAMPLER_GREEDY_BELOW",
    "TRITON_ATTENTION_HEAD_DIMS",
    "AttentionConfig",
    "CudaAttentionConfig",
    "CudaMatmulConfig",
    "MatmulConfig",
    "MatmulSplit",
    "RMSNormConfig",
    "ReductionConfig",
    "SamplingConfig",
    "VocabChunks",
    "arch_family",
    "attention_config",
    "cuda_attention_config",
    "cuda_matmul_config",
    "cuda_options",
    "cuda_sm90a_matmul_enabled",
    "matmul_config",
    "matmul_split",
    "matmul_split_mode",
    "matmul_split_rule",
    "reduction_config",
    "rms_norm_config",
    "sampler_chunks",
    "sampling_config",
]


@dataclass(frozen=True)
class MatmulConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int  # tile-order swizzle for L2 reuse; does not affect any element's sum
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class RMSNormConfig:
    block_h: int  # the fixed chunk of the hidden dimension reduced per step
    num_warps: int


@dataclass(frozen=True)
class AttentionConfig:
    block_m: int  # query rows per tile: (G query heads sharing a KV head) x BLOCK_M // G tokens
    block_n: int  # keys per inner block; divides split
    split: int  # the fixed KV split size, aligned to absolute KV positions
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class ReductionConfig:
    block: int  # the fixed chunk of a row (softmax, log_softmax, mean) reduced per step
    num_warps: int



# Base tile per (arch family, dtype). Shared memory per stage is
# (block_m + block_n) * block_k * itemsize; see tests/test_triton_compile.py for the limits.
_MATMUL_BASE = {
    "sm90": {
        "bf16": MatmulConfig(128, 128, 64, 8, num_warps=8, num_stages=3),
        "fp16": MatmulConfig(128, 128, 64, 8, num_warps=8, num_stages=3),
        # FOLD over several K splits holds two fp32 tiles (the split's and the running total)
        # in registers: at 128 x 128 the IEEE fp32 loop spilled (255 registers); 64 x 64 x 16
        # with 8 warps holds both without spills at every K (tests/test_triton_compile.py).
        "fp32": MatmulConfig(64, 64, 16, 8, num_warps=8, num_stages=3),
    },
    "sm80": {
        # 8 warps: two 128 x 128 fp32 tiles in FOLD take 232 registers (4 warps spilled).
        "bf16": MatmulConfig(128, 128, 32, 8, num_warps=8, num_stages=3),
        "fp16": MatmulConfig(128, 128, 32, 8, num_warps=8, num_stages=3),
        "fp32": MatmulConfig(64, 64, 16, 8, num_warps=8, num_stages=3),
    },
    # Small tiles keep TRITON_INTERPRET=1 tests fast; the interpreter is a test vehicle only.
    "interpreter": {
        "bf16": MatmulConfig(16, 32, 16, 4, num_warps=4, num_stages=1),
        "fp16": MatmulConfig(16, 32, 16, 4, num_warps=4, num_stages=1),
        "fp32": MatmulConfig(16, 32, 16, 4, num_warps=4, num_stages=1),
    },
}

_RMS_NORM_MAX_BLOCK = {"sm90": 4096, "sm80": 4096, "interpreter": 64}
# Softmax / log_softmax / mean: the largest chunk of a row reduced per step (lanes of the
# accumulator). Small in the interpreter so that test rows of a few hundred cross many chunks.
_REDUCTION_MAX_BLOCK = {"sm90": 4096, "sm80": 4096, "interpreter": 64}


def arch_family(arch: str) -> str:
    """Map a device arch ('sm90', 'sm86', 'interpreter', ...) to a table row."""
    if arch == "interpreter":
        return "interpreter"
    if arch.startswith("sm") and arch[2:].isdigit():
        major = int(arch[2:-1])
        # Hopper and datacenter Blackwell have >= 228 KiB of shared memory per SM; everything
        # else gets the Ampere tile, which fits 100 KiB parts too.
        return "sm90" if major in (9, 10) else "sm80"
    raise ValueError(f"bik: no kernel table for arch {arch!r}")


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def matmul_config(dtype: torch.dtype, n: int, k: int, arch: str) -> MatmulConfig:
    """The one tile configuration for this (dtype, N, K, arch). M is deliberately absent."""
    base = _MATMUL_BASE[arch_family(arch)][info(dtype).short]
    # Narrow or short problems get narrower tiles; tl.dot needs every dim >= 16.
    return replace(
        base,
        block_n=min(base.block_n, max(16, _pow2_at_least(n))),
        block_k=min(base.block_k, max(16, _pow2_at_least(k))),
    )


# ---- The K-split contract of every matmul backend (docs/design.md, "The matmul K-split") ----
# For output element (m, n) of a [M, K] @ b [K, N] (+ bias [N]):
#   K is cut into G equal groups; each group into splits of S elements from the group's start,
#   the last one ragged. Split partial p = 0; p = p + a*b over the split's k ascending (the
#   in-split order is the backend's: each op rounded on the CPU and CUDA-SIMT fp32, the tile's
#   dot instruction for 16-bit inputs on a GPU). Inside a group: t = p_0; t = t + p_j ascending.
#   Then T = t_0; T = T + t_g ascending; then + bias (fp32); one rounding to the output dtype.
# G and S come from (dtype, K, N of the whole layer) through these constants, never from M,
# never from a shard's N, never from the arch: so one rank of a row-parallel layer (whole
# groups) and CPU vs CUDA fp32 (every K) can give the same bits.
MATMUL_TP_MAX = 8  # G when K allows it: the most ranks a row-parallel layer can be cut over
MATMUL_GROUP_ALIGN = 64  # a group's length is a multiple of this (every table's BLOCK_K divides it)
MATMUL_SPLIT = 1024  # S of an ungrouped K longer than MATMUL_ONE_SPLIT_MAX_K
MATMUL_ONE_SPLIT_MAX_K = 2048  # an ungrouped K up to this long is one split
# "none": the pure data-parallel contract (G = 1, one split of all of K: no split-K at all).
MATMUL_SPLIT_ENV = "BIK_MATMUL_SPLIT"
_MATMUL_SPLIT_MODES = ("fixed", "none")


@dataclass(frozen=True)
class MatmulSplit:
    groups: int  # G: equal groups of K, the unit a row-parallel layer is sharded by
    split: int  # S: split length from each group's start (>= the group: one split per group)

    def group_len(self, k: int) -> int:
        return k // self.groups

    def n_splits(self, k: int) -> int:
        """Splits in all of K (at least one, so K == 0 still writes 0 (+ bias))."""
        return max(1, self.groups * -(-self.group_len(k) // self.split))


def matmul_split_mode() -> str:
    """``fixed`` (the K-split contract, default) or ``none`` (``BIK_MATMUL_SPLIT=none``)."""
    mode = os.environ.get(MATMUL_SPLIT_ENV, "") or "fixed"
    if mode not in _MATMUL_SPLIT_MODES:
        raise ValueError(f"bik: {MATMUL_SPLIT_ENV}={mode!r}; expected one of "
                         f"{', '.join(_MATMUL_SPLIT_MODES)}")
    return mode


def matmul_split_rule() -> tuple[int, int, int, int, int]:
    """matmul_split's constants for C++ callers (csrc/cpu/c_abi.h BikMatmulSplitRule order)."""
    return (MATMUL_TP_MAX, MATMUL_GROUP_ALIGN, MATMUL_SPLIT, MATMUL_ONE_SPLIT_MAX_K,
            int(matmul_split_mode() == "none"))


def matmul_split(dtype: torch.dtype, n: int, k: int) -> MatmulSplit:
    """G and S for the whole problem (dtype, N of the whole layer, K). M is deliberately absent,
    and so is the arch.

    G = MATMUL_TP_MAX when K is a multiple of MATMUL_TP_MAX * MATMUL_GROUP_ALIGN, else 1 (such
    a layer cannot be row-sharded). With G > 1 each group is one split (S = K / G), so the
    two-level fold is a flat ascending fold over the splits, which every kernel implements;
    with G = 1, K up to MATMUL_ONE_SPLIT_MAX_K is one split and longer K splits by MATMUL_SPLIT.
    """
    del dtype, n  # part of the key: a future table may use them (the whole layer's N, never a
    # shard's), never M
    if k < 0:
        raise ValueError(f"bik: matmul K must be >= 0, got {k}")
    if matmul_split_mode() == "none":
        return MatmulSplit(1, max(k, 1))
    if k > 0 and k % (MATMUL_TP_MAX * MATMUL_GROUP_ALIGN) == 0:
        return MatmulSplit(MATMUL_TP_MAX, k // MATMUL_TP_MAX)
    return MatmulSplit(1, max(k, 1) if k <= MATMUL_ONE_SPLIT_MAX_K else MATMUL_SPLIT)


def rms_norm_config(dtype: torch.dtype, hidden: int, arch: str) -> RMSNormConfig:
    """The one reduction tiling for this (dtype, hidden, arch). M is deliberately absent."""
    del dtype  # every dtype is reduced in fp32 with the same tiling
    block = min(_RMS_NORM_MAX_BLOCK[arch_family(arch)], _pow2_at_least(hidden))
    return RMSNormConfig(block_h=block, num_warps=4 if block <= 1024 else 8)


def reduction_config(n: int, arch: str) -> ReductionConfig:
    """The one chunking of a row of length n on this arch (softmax, log_softmax, mean).

    The number of rows is deliberately absent, and so is the dtype: every dtype is reduced in
    fp32 with the same chunks.
    """
    block = min(_REDUCTION_MAX_BLOCK[arch_family(arch)], max(16, _pow2_at_least(n)))
    return ReductionConfig(block=block, num_warps=4 if block <= 1024 else 8)


def config_table() -> dict:
    """Plain-data view of the tables (for the fingerprint and `bik check`)."""
    return {
        "matmul": {arch: {dt: vars(c) for dt, c in row.items()}
                   for arch, row in _MATMUL_BASE.items()},
        "matmul_split": {"mode": matmul_split_mode(), "tp_max": MATMUL_TP_MAX,
                         "group_align": MATMUL_GROUP_ALIGN, "split": MATMUL_SPLIT,
                         "one_split_max_k": MATMUL_ONE_SPLIT_MAX_K},
        "rms_norm_max_block": dict(_RMS_NORM_MAX_BLOCK),
        "reduction_max_block": dict(_REDUCTION_MAX_BLOCK),
        "attention": {arch: {dt: vars(c) for dt, c in row.items()}
                      for arch, row in _ATTENTION_BASE.items()},
        "attention_d128": {arch: {dt: vars(c) for dt, c in row.items()}
                           for arch, row in _ATTENTION_D128.items()},
        "cpu_attention_split": CPU_ATTENTION_SPLIT,
        "sampling": {arch: vars(c) for arch, c in _SAMPLING.items()},
        "sampler_chunks": {"tp_max": MATMUL_TP_MAX, "chunk": SAMPLER_CHUNK},
        "sampler_greedy_below": SAMPLER_GREEDY_BELOW,
        "cuda": cuda_config_table(),
    }


# Per (arch family, dtype): the split size is a constant of the table, never of the length.
# Three stages: the next key block's K and V copies stay in flight while one is computed (the
# key loop's wait leaves 2 pending; tests/test_triton_compile.py), two CTAs per SM still fit.
_ATTENTION_BASE = {
    "sm90": {
        "bf16": AttentionConfig(64, 64, 256, num_warps=4, num_stages=3),
        "fp16": AttentionConfig(64, 64, 256, num_warps=4, num_stages=3),
        "fp32": AttentionConfig(16, 32, 256, num_warps=4, num_stages=3),
    },
    "sm80": {
        "bf16": AttentionConfig(64, 32, 256, num_warps=4, num_stages=3),
        "fp16": AttentionConfig(64, 32, 256, num_warps=4, num_stages=3),
        "fp32": AttentionConfig(16, 32, 256, num_warps=4, num_stages=3),
    },
    # Small splits so interpreter tests cross several splits at lengths of a few dozen.
    "interpreter": {dt: AttentionConfig(16, 16, 32, num_warps=4, num_stages=1)
                    for dt in ("bf16", "fp16", "fp32")},
}
# head_dim 65..128 (Llama's 128): FOLD holds two fp32 BLOCK_M x D accumulators (the running
# fold and the current split). Chosen so that two CTAs share an SM with no spill in either launch
# mode, paged or contiguous (ptxas, tests/test_triton_compile.py): on sm_90 four warps with
# 32-key blocks keep wgmma m64 (224-255 registers, 48 KiB; eight warps with 64-key blocks took
# 184-255 registers, one CTA per SM); on sm_80 (mma.sync for any BLOCK_M) 32-row tiles. fp32's
# 16-row tiles run eight warps.
_ATTENTION_D128 = {
    "sm90": {
        "bf16": AttentionConfig(64, 32, 256, num_warps=4, num_stages=3),
        "fp16": AttentionConfig(64, 32, 256, num_warps=4, num_stages=3),
        "fp32": AttentionConfig(16, 32, 256, num_warps=8, num_stages=3),
    },
    "sm80": {
        "bf16": AttentionConfig(32, 32, 256, num_warps=4, num_stages=3),
        "fp16": AttentionConfig(32, 32, 256, num_warps=4, num_stages=3),
        "fp32": AttentionConfig(16, 32, 256, num_warps=8, num_stages=3),
    },
    "interpreter": _ATTENTION_BASE["interpreter"],
}
# The CPU backend's split size (it uses no tiles).
CPU_ATTENTION_SPLIT = 256


def attention_config(dtype: torch.dtype, head_dim: int, gqa: int, arch: str) -> AttentionConfig:
    """The one attention configuration for (dtype, head_dim, GQA ratio, arch), every q_len."""
    del gqa  # the tile packs G heads x BLOCK_M // G tokens; the table needs no G-specific entry
    family, dt = arch_family(arch), info(dtype).short
    if head_dim <= 64:
        return _ATTENTION_BASE[family][dt]
    if head_dim <= 128:
        return _ATTENTION_D128[family][dt]
    # D = 256: eight warps, and K/V blocks of 32 keys to stay within shared memory.
    base = _ATTENTION_BASE[family][dt]
    if family == "interpreter":
        return replace(base, block_n=32)
    return replace(base, num_warps=8, block_n=32)


@dataclass(frozen=True)
class SamplingConfig:
    block: int  # tokens per step: the stats kernel's max pass and tile, and the pick's chunk
    split: int  # vocabulary entries per pick program (the pick's merge is order-free)
    num_warps: int


# No sampler bit depends on these: the pick is an argmax under a total order, and the top-p and
# logprob sums follow sampler_chunks (the stats kernel folds block // SAMPLER_CHUNK chunks side
# by side, at least one).
# Eight warps: four spilled 12 B in the stats kernel for odd vocabularies (ptxas, sm_90/sm_80).
_SAMPLING = {
    "sm90": SamplingConfig(block=1024, split=16384, num_warps=8),
    "sm80": SamplingConfig(block=1024, split=16384, num_warps=8),
    "interpreter": SamplingConfig(block=64, split=128, num_warps=4),
}


# A temperature below this draws its row greedily (as T = 0), on every backend: the limit of
# Gumbel-max as T -> 0+ (noise of at most ~19.4 T moves no token whose logit is that far below
# the max). Without it x / T overflows fp32 for tiny T and the row came back invalid (-1).
# vLLM treats temperatures below the same 1e-5 as greedy. Compared in fp32.
SAMPLER_GREEDY_BELOW = 1e-5


SAMPLER_CHUNK = 1024  # tokens per chunk of the sampler's normaliser (a power of two)


class VocabChunks(NamedTuple):
    groups: int  # G equal groups of V / G tokens
    chunk: int  # tokens per chunk, from each group's start (the last chunk of a group ragged)


def sampler_chunks(vocab: int) -> VocabChunks:
    """The order of the sampler's normaliser sums (top-p masses, the logprob's normaliser) for a
    vocabulary of ``vocab`` tokens, on every backend: G = MATMUL_TP_MAX groups when it divides
    the vocabulary (a vocab-parallel rank then holds whole groups), else 1; chunks of
    SAMPLER_CHUNK (a power of two) from each group's start, zero-padded, each folded pairwise by
    halves (s[t] += s[t + w], w = C/2 .. 1); chunk sums ascending within a group; group totals
    ascending
    (csrc/cpu/sampling.h, docs/design.md#sampler). Nothing of the batch, the arch or the
    backend."""
    if vocab < 1:
        raise ValueError(f"bik.configs.sampler_chunks: vocab must be >= 1, got {vocab}")
    groups = MATMUL_TP_MAX if vocab % MATMUL_TP_MAX == 0 else 1
    return VocabChunks(groups, SAMPLER_CHUNK)


def sampling_config(arch: str) -> SamplingConfig:
    """The one sampler configuration on this arch (every batch size, every vocabulary)."""
    return _SAMPLING[arch_family(arch)]


# ---- CUDA C++ backend (csrc/cuda) ------------------------------------------------------------
# The tiles are compiled into the kernels (csrc/cuda/matmul.cu, attention.cu); these entries
# name the kernel and carry the knobs that decide a reduction order. Keyed like the Triton
# tables: never by M, never by a sequence length or the batch.

@dataclass(frozen=True)
class CudaMatmulConfig:
    kernel: str  # extern "C" symbol in csrc/cuda/matmul.cu
    block_m: int  # compiled into the kernel; listed for the launcher's grid
    block_n: int
    block_k: int
    threads: int
    split_k: int  # K elements per split (matmul_split): ceil(K / split_k) splits
    source: str = "matmul"  # csrc/cuda/<source>.cu holds ``kernel``


@dataclass(frozen=True)
class CudaAttentionConfig:
    kernel: str  # symbol prefix in csrc/cuda/attention.cu (+ "_d64" / "_d128")
    block_n: int  # keys per block (compiled in: one per lane of a warp)
    split: int  # the fixed KV split size, aligned to absolute KV positions
    rows: int  # query rows per program (compiled in); speed only, never bits
    threads: int


# Compile-time constants of the CUDA C++ kernels, per source file (csrc/cuda/<source>.cu),
# passed as -D<NAME>=<value> by the JIT and the AOT build alike (:func:`cuda_options`): the
# tiles are written here and nowhere else. A plain literal on purpose: setup.py reads it with
# ast.literal_eval to build the AOT fatbins without importing torch.
CUDA_DEFINES = {
    "matmul": {
        # bf16 / fp16 (mma.sync): BM x BN x BK tile, 4 warps of 32 x 64.
        "BIK_MM_TC_BM": 64, "BIK_MM_TC_BN": 128, "BIK_MM_TC_BK": 32, "BIK_MM_TC_THREADS": 128,
        # fp32 (SIMT, IEEE): 4 x 4 outputs per thread.
        "BIK_MM_F32_BM": 64, "BIK_MM_F32_BN": 64, "BIK_MM_F32_BK": 16,
        "BIK_MM_F32_THREADS": 256,
    },
}


def cuda_options(source: str) -> tuple[str, ...]:
    """The -D options ``csrc/cuda/<source>.cu`` is compiled with (JIT, AOT, tests, tools)."""
    return tuple(f"-D{k}={v}" for k, v in sorted(CUDA_DEFINES.get(source, {}).items()))


def _mm_tile(kernel: str, kind: str) -> tuple:
    d = CUDA_DEFINES["matmul"]
    return (kernel, d[f"BIK_MM_{kind}_BM"], d[f"BIK_MM_{kind}_BN"], d[f"BIK_MM_{kind}_BK"],
            d[f"BIK_MM_{kind}_THREADS"])


_CUDA_MATMUL_TILE = {  # (kernel, block_m, block_n, block_k, threads) per dtype
    "bf16": _mm_tile("bik_matmul_bf16", "TC"),
    "fp16": _mm_tile("bik_matmul_f16", "TC"),
    "fp32": _mm_tile("bik_matmul_f32", "F32"),
}
_CUDA_ATTENTION_SPLIT = {"sm90": 256, "sm80": 256}
# The opt-in sm_90a path (csrc/cuda/matmul_sm90.cu: wgmma, one warpgroup per 64 x 128 tile),
# for 16-bit inputs on compute capability 9.0 only, and only with BIK_CUDA_SM90A=1 (off by
# default: docs/design.md "sm_90a matmul" says when it may be turned on). Its bits are its own
# (not the mma.sync kernel's), so the switch is part of cuda_config_table(), hence of
# bik.fingerprint().
SM90A_MATMUL_ENV = "BIK_CUDA_SM90A"
_CUDA_MATMUL_TILE_SM90A = {
    "bf16": ("bik_matmul_sm90_bf16", 64, 128, 32, 128),
    "fp16": ("bik_matmul_sm90_f16", 64, 128, 32, 128),
}


def cuda_sm90a_matmul_enabled() -> bool:
    """True when the environment asks for the sm_90a matmul (``BIK_CUDA_SM90A=1``)."""
    return flag(SM90A_MATMUL_ENV)
CUDA_ATTENTION_HEAD_DIMS = (64, 128)
# The head dims the Triton attention kernel is launched for (D is a compile-time block).
TRITON_ATTENTION_HEAD_DIMS = (16, 32, 64, 128, 256)


def cuda_matmul_config(dtype: torch.dtype, n: int, k: int, arch: str) -> CudaMatmulConfig:
    """The CUDA kernel and K-split for this (dtype, N, K, arch). M is deliberately absent; the
    split is :func:`matmul_split`'s, the same on every arch and backend."""
    arch_family(arch)  # refuses an unknown arch
    key = info(dtype).short
    source = "matmul"
    kernel, bm, bn, bk, threads = _CUDA_MATMUL_TILE[key]
    if arch == "sm90" and key in _CUDA_MATMUL_TILE_SM90A and cuda_sm90a_matmul_enabled():
        source = "matmul_sm90"
        kernel, bm, bn, bk, threads = _CUDA_MATMUL_TILE_SM90A[key]
    return CudaMatmulConfig(kernel, bm, bn, bk, threads, matmul_split(dtype, n, k).split, source)


def cuda_attention_config(dtype: torch.dtype, head_dim: int, gqa: int,
                          arch: str) -> CudaAttentionConfig:
    """The CUDA attention configuration for (dtype, head_dim, GQA ratio, arch), every q_len."""
    del gqa, head_dim  # rows pack G heads x 16 // G tokens; the kernel handles any G
    family = arch_family(arch)
    return CudaAttentionConfig(f"bik_attention_{info(dtype).cuda}",
                               block_n=32, split=_CUDA_ATTENTION_SPLIT[family], rows=16,
                               threads=128)



def cuda_config_table() -> dict:
    """Plain-data view of the CUDA tables (part of :func:`config_table`)."""
    return {"matmul_tile": {dt: list(t) for dt, t in _CUDA_MATMUL_TILE.items()},
            "defines": CUDA_DEFINES,
            "attention_split": dict(_CUDA_ATTENTION_SPLIT),
            "attention_head_dims": list(CUDA_ATTENTION_HEAD_DIMS),
            "sm90a_matmul": {"enabled": cuda_sm90a_matmul_enabled(),
                             "tile": {dt: list(t) for dt, t in _CUDA_MATMUL_TILE_SM90A.items()}}}
