"""Launcher for the CUDA C++ matmul (csrc/cuda/matmul.cu): checks, plan, launch; no torch in C++.

The bits of an output element are fixed by :func:`bik.configs.cuda_matmul_config` (dtype, N,
K, arch): the compiled tile, and the K-split length ``split_k``. K is cut into
``ceil(K / split_k)`` splits, each summed from zero in its own fp32 accumulator and folded in
ascending order (csrc/cuda/matmul_plan.cuh). How the splits are scheduled follows the work
size only and never changes a bit: SPREAD (few output tiles, i.e. decode-sized M: one program
per (tile, split) writes fp32 partials, ``bik_matmul_reduce`` folds them) or FOLD (one program
per tile computes the splits one after another, each into a fresh accumulator).
On compute capability 9.0 with ``BIK_CUDA_SM90A=1`` the 16-bit kernels are the opt-in wgmma
ones of csrc/cuda/matmul_sm90.cu (same contract, same plan, same reduce).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from bik._arch import device_arch
from bik._dtypes import DTYPES, info
from bik.configs import CudaMatmulConfig, cuda_matmul_config, cuda_options
from bik.ops.matmul.schedule import spread_bytes, use_spread
from bik.runtime import cuda_jit
from bik.runtime.cuda_jit import I32, I64, PTR

_REDUCE_THREADS = 256
_INT32_MAX = 2**31 - 1

_STRIDES = [(f"s{t}{d}", I64) for t, dims in (("a", "bmk"), ("b", "bkn"), ("c", "bmn"))
            for d in dims]
_MATMUL = [("a", PTR), ("b", PTR), ("bias", PTR), ("c", PTR), ("ws", PTR), ("m", I32),
           ("n", I32), ("k", I32), *_STRIDES, ("split_len", I32), ("spread", I32),
           ("out_kind", I32), ("vec", I32)]
# csrc/cuda/matmul.cu (one kernel per input dtype, and SPREAD's fold) and matmul_sm90.cu.
KERNELS = {
    **cuda_jit.declare("matmul", [f"bik_matmul_{t.cuda}" for t in DTYPES], _MATMUL),
    **cuda_jit.declare("matmul_sm90", [f"bik_matmul_sm90_{t.cuda}" for t in DTYPES
                                       if t.dtype != torch.float32], _MATMUL),
    **cuda_jit.declare("matmul", ["bik_matmul_reduce"],
                       [("ws", PTR), ("bias", PTR), ("c", PTR), ("batch", I32), ("m", I32),
                        ("n", I32), ("n_splits", I32), *_STRIDES[6:], ("out_kind", I32)]),
}


class MatmulLaunch(NamedTuple):
    """What :func:`launch_matmul` will run (computed without a GPU, for tests and benches)."""

    config: CudaMatmulConfig
    n_splits: int
    spread: bool
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    workspace: tuple[int, ...] | None  # fp32 [batch, n_splits, M, N] when spread


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def plan_matmul(dtype: torch.dtype, batch: int, m: int, n: int, k: int, arch: str, *,
                spread: bool | None = None, layer: tuple[int, int] | None = None,
                split: int | None = None) -> MatmulLaunch:
    """The launch for out[batch, M, N] = a[batch, M, K] @ b[batch, K, N] on ``arch``.
    ``layer``: the (N, K) the config is looked up with (default this call's; a shard of a
    sharded layer passes the layer's). ``split``: an explicit K-split length (tests)."""
    for name, size in (("M", m), ("N", n), ("K", k)):
        if size > _INT32_MAX:
            raise ValueError(f"bik: backend='cuda' matmul needs {name} < 2**31, got {size}")
    cfg = cuda_matmul_config(dtype, *(layer or (n, k)), arch)
    if split is not None:
        if split < 1:
            raise ValueError(f"bik: backend='cuda' matmul split must be >= 1, got {split}")
        cfg = dataclasses.replace(cfg, split_k=split)
    n_splits = max(1, _cdiv(k, cfg.split_k))
    tiles = batch * _cdiv(m, cfg.block_m) * _cdiv(n, cfg.block_n)
    itemsize = torch.empty((), dtype=dtype).element_size()
    spread = use_spread(tiles, n_splits, **spread_bytes(batch, m, n, k, n_splits, itemsize)) \
        if spread is None else bool(spread) and n_splits > 1
    if n_splits > 65535:
        raise ValueError(f"bik: backend='cuda' matmul: K = {k} gives {n_splits} splits (max 65535)")
    return MatmulLaunch(cfg, n_splits, spread, (tiles, n_splits if spread else 1, 1),
                        (cfg.threads, 1, 1), (batch, n_splits, m, n) if spread else None)


# Which operands may use 16-byte loads (csrc/cuda/matmul.cu kVec*). Loads decide speed only.
VEC_A, VEC_B_K, VEC_B_N = 1, 2, 4


def _aligned(t: torch.Tensor, *strides_and_sizes: tuple[int, int]) -> bool:
    """16-byte aligned base, and every (stride, size) pair steps in multiples of 8 elements
    (a size of 1 never steps)."""
    return t.data_ptr() % 16 == 0 and all(size <= 1 or stride % 8 == 0
                                          for stride, size in strides_and_sizes)


def load_flags(a: torch.Tensor, b: torch.Tensor) -> int:
    """kVec* flags for a [B, M, K] and b [B, K, N] (16-bit dtypes; 0 for fp32)."""
    if a.element_size() != 2:
        return 0
    nb, m, k = a.shape
    n = b.shape[2]
    flags = 0
    if a.stride(2) == 1 and k % 8 == 0 and _aligned(a, (a.stride(1), m), (a.stride(0), nb)):
        flags |= VEC_A
    if b.stride(1) == 1 and k % 8 == 0 and _aligned(b, (b.stride(2), n), (b.stride(0), nb)):
        flags |= VEC_B_K
    elif b.stride(2) == 1 and n % 8 == 0 and _aligned(b, (b.stride(1), k), (b.stride(0), nb)):
        flags |= VEC_B_N
    return flags


def launch_matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                  out: torch.Tensor, *, layer: tuple[int, int] | None = None,
                  split: int | None = None, spread: bool | None = None) -> None:
    """out[B, M, N] = a[B, M, K] @ b[B, K, N] (+ bias[N]) on torch's current stream.

    Shapes and dtypes are validated by the caller (bik.ops.matmul); any strides are accepted
    (batch stride 0 broadcasts b); ``out`` is written, not read. ``spread`` None = by work
    size (the bits do not depend on it).
    """
    nb, m, k = a.shape
    n = b.shape[2]
    if nb == 0 or m == 0 or n == 0:
        return
    plan = plan_matmul(a.dtype, nb, m, n, k, device_arch(a.device), spread=spread, layer=layer,
                       split=split)
    bias32 = None if bias is None else bias.to(torch.float32).contiguous()  # exact upcast
    name = plan.config.kernel
    ws = None
    if plan.spread:
        ws = torch.empty(plan.workspace, dtype=torch.float32, device=a.device)
    strides = [s for t in (a, b, out) for s in t.stride()]
    kind = info(out.dtype).cuda_kind
    cuda_jit.launch_kernel(KERNELS, name, plan.grid, plan.block, 0, a, b, bias32, out, ws, m, n,
                           k, *strides, plan.config.split_k, int(plan.spread), kind,
                           load_flags(a, b), device=a.device,
                           options=cuda_options(KERNELS[name].source))
    if plan.spread:
        blocks = min(_cdiv(nb * m * n, _REDUCE_THREADS), 1 << 20)  # grid-stride beyond
        cuda_jit.launch_kernel(KERNELS, "bik_matmul_reduce", (blocks, 1, 1),
                               (_REDUCE_THREADS, 1, 1), 0, ws, bias32, out, nb, m, n,
                               plan.n_splits, *strides[6:], kind, device=a.device,
                               options=cuda_options("matmul"))


# bik::bmm's entry: the same kernel (the CPU backend alone runs bmm on another bf16 sequence).
launch_bmm = launch_matmul
