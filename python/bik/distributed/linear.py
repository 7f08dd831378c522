"""Tensor-parallel linear layers whose bits do not depend on the TP degree.

Row parallel: bik's K-split contract (bik.configs.matmul_split, docs/design.md "The matmul
K-split") cuts K into G = MATMUL_TP_MAX groups, each one split summed from zero, and folds the
group totals in ascending order. At TP ranks (TP dividing G) rank r holds the K columns of
groups [r*G/TP, (r+1)*G/TP); it computes those groups' fp32 totals exactly as the single-device
kernel computes them (the same launcher, tiles and split looked up from the whole layer's
shape), an all_gather brings every rank's totals to every rank in rank order, which is
ascending group order, and each rank folds them ``t = t_0; t = t + t_g``, adds the bias and
rounds once: bik.linear(x, weight, bias) on one device, bit for bit. The price is the
all_gather of G/TP fp32 [rows, N] totals per rank instead of an all_reduce of one.

Column parallel: each output element is computed whole on one rank with the layer's tables, so
a shard is the same bits as those columns of the full product by construction.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from bik.configs import MATMUL_GROUP_ALIGN, MATMUL_TP_MAX, matmul_split
from bik.distributed._meta import describe, gather_and_check, group_size_rank
from bik.ops._registry import resolve_backend
from bik.ops.matmul.op import matmul_shard

__all__ = ["column_parallel_linear", "row_parallel_linear"]

_ROW = "bik.distributed.row_parallel_linear"
_COL = "bik.distributed.column_parallel_linear"


def _agree(op, group, x, weight, bias, out_dtype, backend, **extra) -> str:
    """Every rank's description, checked on every rank; the backend every rank will use."""
    try:
        backend = resolve_backend("matmul", backend, x.device, label=op)
    except Exception as exc:  # noqa: BLE001 - reported through the gather, raised everywhere
        backend = f"unavailable: {exc}"
    grads = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, weight, bias))
    gather_and_check(
        op, group, x.device, same=("x", "weight", "bias", "out_dtype", "backend", "grad",
                                   *extra),
        x=describe(x), weight=describe(weight), bias=describe(bias),
        out_dtype=str(out_dtype), backend=backend, grad=grads, **extra)
    if backend.startswith("unavailable"):
        raise ValueError(f"{op}: {backend}")
    if grads:
        raise ValueError(f"{op}: forward only (no autograd); call it under torch.no_grad() or "
                         f"with tensors that do not require grad")
    return backend


def _check_shapes(op, x, weight, bias, n_bias: int) -> None:
    if x.dim() < 1 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"{op}: x {list(x.shape)} and weight {list(weight.shape)} disagree "
                         f"(x [..., K_shard], weight [N, K_shard] for row parallel; x [..., K], "
                         f"weight [N_shard, K] for column parallel)")
    if x.dtype != weight.dtype or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{op}: x is {x.dtype} and weight {weight.dtype}; both must be one of "
                         f"fp32, bf16, fp16")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n_bias
                             or not bias.is_floating_point()):
        raise ValueError(f"{op}: bias {list(bias.shape)} {bias.dtype} must be a float "
                         f"[{n_bias}]")


def _product_fp32(backend, x2, weight, layer, groups: int) -> torch.Tensor:
    """fp32 [groups, rows, N]: entry g = x2[:, g-th K range] @ weight[:, g-th K range].t(), each
    computed with the tables of ``layer`` (one call; the groups are batch entries of strided
    views, no copy)."""
    rows, k = x2.shape
    glen = k // groups
    a = x2.unflatten(1, (groups, glen)).permute(1, 0, 2)  # [groups, rows, glen]
    b = weight.unflatten(1, (groups, glen)).permute(1, 2, 0)  # [groups, glen, N]
    out = torch.empty(groups, rows, weight.shape[0], dtype=torch.float32, device=x2.device)
    matmul_shard(a, b, None, out, layer=layer, backend=backend)
    return out


def row_parallel_linear(x_shard: torch.Tensor, weight_shard: torch.Tensor,
                        bias: torch.Tensor | None = None, *, group=None,
                        out_dtype: torch.dtype | None = None,
                        backend: str | None = None) -> torch.Tensor:
    """``F.linear`` of a layer whose K is sharded over the ranks of ``group``, on every rank.

    Rank r passes its contiguous K shard: ``x_shard = x[..., r*K/TP:(r+1)*K/TP]`` and
    ``weight_shard = weight[:, r*K/TP:(r+1)*K/TP]``; ``bias`` (the whole [N]) is the same on
    every rank. Returns ``[..., N]`` in ``out_dtype`` (default x's), equal on every rank to
    ``bik.linear(x, weight, bias)`` on one device bit for bit, at every TP dividing
    ``bik.configs.MATMUL_TP_MAX``. K must be a multiple of MATMUL_TP_MAX * MATMUL_GROUP_ALIGN
    (512): other layers have one K group and cannot be row-sharded (ValueError). Forward only.
    Mismatched shapes, dtypes, backends or fingerprints across ranks raise ValueError on every
    rank (after one all_gather of metadata), never a hang.
    """
    size, _ = group_size_rank(group)
    out_dtype = out_dtype or x_shard.dtype
    backend = _agree(_ROW, group, x_shard, weight_shard, bias, out_dtype, backend)
    n, k_shard = weight_shard.shape if weight_shard.dim() == 2 else (0, -1)
    _check_shapes(_ROW, x_shard, weight_shard, bias, n)
    k = k_shard * size
    plan = matmul_split(x_shard.dtype, n, k)
    if size > 1 and (plan.groups % size or plan.groups == 1):
        raise ValueError(
            f"{_ROW}: K = {k} cannot be cut over {size} ranks: the K-split contract gives it "
            f"{plan.groups} group(s); a row-parallel K must be a multiple of "
            f"{MATMUL_TP_MAX} x {MATMUL_GROUP_ALIGN} = {MATMUL_TP_MAX * MATMUL_GROUP_ALIGN} "
            f"and the TP degree must divide {MATMUL_TP_MAX}")
    lead = x_shard.shape[:-1]
    x2 = x_shard.reshape(-1, k_shard)
    local = _product_fp32(backend, x2, weight_shard, (n, k), plan.groups // size)
    if size > 1:
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        local = torch.cat(parts)  # [G, rows, N], ascending group order (rank order)
    total = local[0]
    for g in range(1, local.shape[0]):
        total = total + local[g]  # t = t_0; t = t + t_g, ascending, each add rounded
    if bias is not None:
        total = total + bias.to(torch.float32)
    return total.to(out_dtype).reshape(*lead, n)


def column_parallel_linear(x: torch.Tensor, weight_shard: torch.Tensor,
                           bias_shard: torch.Tensor | None = None, *,
                           gather_output: bool = False, group=None,
                           out_dtype: torch.dtype | None = None,
                           backend: str | None = None,
                           layer_n: int | None = None) -> torch.Tensor:
    """``F.linear`` of a layer whose N is sharded over the ranks of ``group``.

    Every rank passes the whole ``x [..., K]`` and its contiguous N shard ``weight_shard =
    weight[r*N/TP:(r+1)*N/TP]`` (and ``bias_shard``, the same rows of the bias). Returns this
    rank's columns ``[..., N/TP]``, or with ``gather_output`` all of ``[..., N]`` on every
    rank; either way the bits of ``bik.linear(x, weight, bias)``'s columns, since an element is
    computed whole on one rank with the whole layer's tables. Forward only; mismatched ranks
    raise ValueError on every rank.

    ``layer_n``: the N of the whole layer when a rank's rows are not an equal slice of it (a
    tensor-parallel model whose ranks replicate KV heads: each holds its q heads' rows and a
    copy of its KV head's); the tables are looked up with it. Not with ``gather_output``.
    """
    size, _ = group_size_rank(group)
    out_dtype = out_dtype or x.dtype
    backend = _agree(_COL, group, x, weight_shard, bias_shard, out_dtype, backend,
                     gather=gather_output, layer_n=layer_n)
    n_shard = weight_shard.shape[0] if weight_shard.dim() == 2 else 0
    _check_shapes(_COL, x, weight_shard, bias_shard, n_shard)
    if layer_n is not None and (gather_output or layer_n < n_shard):
        raise ValueError(f"{_COL}: layer_n = {layer_n} must be >= this rank's {n_shard} rows "
                         f"and cannot be combined with gather_output")
    k = x.shape[-1]
    layer = (n_shard * size if layer_n is None else layer_n, k)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    out = torch.empty(1, x2.shape[0], n_shard, dtype=out_dtype, device=x.device)
    matmul_shard(x2[None], weight_shard.t()[None], bias_shard, out, layer=layer,
                 backend=backend)
    out = out[0]
    if gather_output and size > 1:
        parts = [torch.empty_like(out) for _ in range(size)]
        dist.all_gather(parts, out.contiguous(), group=group)
        out = torch.cat(parts, dim=-1)
    return out.reshape(*lead, out.shape[-1])
