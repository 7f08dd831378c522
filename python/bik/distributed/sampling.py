"""Vocab-parallel sampling: bik.sample's tokens and logprobs from logits sharded by vocabulary,
without gathering the logits.

Rank r of TP holds the columns [r V/TP, (r+1) V/TP) of the logits [B, V] (what a column-parallel
LM head leaves it). The contract (docs/design.md, "sampler") is built so that a shard can do its
part alone and a few small collectives finish it, bit for bit:

1. *Tempering and validity* are elementwise. The row max m (over finite and -inf z) and the
   invalid flag (a NaN or +inf anywhere) are all-reduced (MAX) before any exp.
2. *min-p* needs only m: keep z >= m + bik_log(min_p).
3. *The pick*: the noise is keyed by the global token id (shard offset + local index), so each
   rank scores its tokens exactly as one device would, and picks its best (score, global id)
   under (value desc, index asc). That order is total, so the best of the ranks' bests is the
   one-device token: one all_gather of each rank's best.
4. *The normaliser*: the vocabulary is G = TP_max groups (bik.configs.sampler_chunks), so a rank
   holds G/TP whole groups and computes their totals in the contract's order; the same
   all_gather brings every rank's totals in rank order (ascending group order), and every rank
   folds them ascending from +0: the one-device sum. logprob = (z_c - m) - bik_log(sum).

Rows with top-k on or top-p < 1 gather their logits (their rows only, exactly) and run bik.sample
on the whole row: top-k's threshold and top-p's cut need the whole distribution. A
vocabulary that G does not divide (G = 1) cannot be vocab-parallel: ValueError on every rank.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from bik.configs import MATMUL_TP_MAX, sampler_chunks
from bik.distributed._meta import describe, gather_and_check, group_size_rank
from bik.ops._registry import resolve_backend
from bik.ops._normaliser import bik_exp_torch, bik_log_torch, group_totals_torch
from bik.ops.sampling.noise import GUMBEL_MAX, GUMBEL_MIN, greedy_limit, gumbel_torch, log_min_p
from bik.ops.sampling.op import (
    SampleOutput,
    VerifyOutput,
    accept_drafts,
    check_row_params,
    check_verify,
    row_params,
    sample,
    window_rows,
)

__all__ = ["vocab_parallel_sample", "vocab_parallel_verify_draft"]

_SAMPLE = "bik.distributed.vocab_parallel_sample"
_VERIFY = "bik.distributed.vocab_parallel_verify_draft"
_NO_ID = 2**62  # a rank with no candidate in a row reports this id (and score -inf)


def _values_digest(tensors) -> str:
    """A digest of the tensors' values: the ranks must sample the same rows the same way."""
    h = hashlib.blake2b(digest_size=8)
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _agree(op, group, logits, build, **extra):
    """Build the rows' parameters (``build()``), gather every rank's description and check it on
    every rank; an error building them on any rank is raised on every rank."""
    try:
        params, problem = build(), None
    except (TypeError, ValueError) as exc:
        params, problem = None, f"{type(exc).__name__}: {exc}"
    gather_and_check(op, group, logits.device, same=("logits", "problem", "params", *extra),
                     logits=describe(logits), problem=problem,
                     params=None if params is None else _values_digest(params), **extra)
    if problem is not None:
        raise (TypeError if problem.startswith("TypeError") else ValueError)(
            problem.split(": ", 1)[1])
    return params


def _check_vocab(op, size: int, width: int) -> int:
    vocab = width * size
    groups = sampler_chunks(vocab).groups
    if size > 1 and (groups == 1 or groups % size):
        raise ValueError(
            f"{op}: a vocabulary of {vocab} tokens cannot be split over {size} ranks: the "
            f"normaliser's order cuts it into {groups} group(s); vocab-parallel sampling needs "
            f"V a multiple of {MATMUL_TP_MAX} and the TP degree dividing {MATMUL_TP_MAX}")
    return vocab


def _local_best(z, kept, greedy, m, seed, position, offset: int):
    """Per row: this shard's best (score, global id, z there) under (value desc, index asc),
    score = z (greedy) or z + g. Noise is computed only where it can matter: a token with
    fl(z + G_MAX) < fl(m + G_MIN) scores below the max token whatever its noise (the kernels'
    skip rule; the token is the same)."""
    rows, width = z.shape
    neg_inf = torch.full_like(z, float("-inf"))
    noisy = kept & ~greedy[:, None] & (z + GUMBEL_MAX >= (m + GUMBEL_MIN)[:, None])
    r, c = noisy.nonzero(as_tuple=True)
    score = neg_inf.index_put((r, c), z[r, c] + gumbel_torch(seed[r], position[r], c + offset))
    score = torch.where(kept & greedy[:, None], z, score)
    top = score.amax(1) if width else torch.full((rows,), float("-inf"), device=z.device)
    cols = torch.arange(width, device=z.device)
    idx = torch.where(score == top[:, None], cols, width).amin(1) if width else \
        torch.zeros(rows, dtype=torch.int64, device=z.device)
    z_best = z.gather(1, idx.clamp(max=max(width - 1, 0))[:, None])[:, 0]
    gid = torch.where(top == float("-inf"), _NO_ID, idx + offset)
    return top, gid, z_best


def _sample_shard(group, size: int, rank: int, x, params, backend, max_top_k):
    """(tokens, logprobs) of the rows of x [B, V/TP] (this rank's columns), every rank alike."""
    seed, position, temperature, _, _, min_p = params  # top-k / top-p: _whole_rows
    rows, width = x.shape
    vocab = width * size
    dev = x.device
    temperature = greedy_limit(temperature)
    greedy = temperature == 0
    xf = x.float()
    z = torch.where(greedy[:, None], xf,
                    xf / torch.where(greedy, 1.0, temperature)[:, None])  # IEEE division
    bad = (torch.isnan(z) | (z == float("inf"))).any(1)
    m = torch.where(torch.isnan(z), float("-inf"), z).amax(1)
    stats = torch.stack([m, bad.float()])
    if size > 1:
        dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=group)
    m, bad = stats[0], stats[1] > 0
    lmp = log_min_p(min_p)
    v_lo = torch.where(lmp > float("-inf"), m + lmp, float("-inf"))
    kept = (z >= v_lo[:, None]) & (z != float("-inf"))
    top, gid, z_best = _local_best(z, kept, greedy, m, seed, position, rank * width)
    groups, chunk = sampler_chunks(vocab)
    terms = torch.where(kept, bik_exp_torch(z - m[:, None]), 0.0)
    totals = group_totals_torch(terms, vocab // groups, chunk)  # this rank's G/TP groups
    # fp64 carries every value exactly: fp32 scores and sums, ids < 2^53.
    mine = torch.cat([torch.stack([top, gid, z_best], 1).double(), totals.double()], 1)
    if size > 1:
        parts = [torch.empty_like(mine) for _ in range(size)]
        dist.all_gather(parts, mine.contiguous(), group=group)
        every = torch.stack(parts)  # [TP, B, 3 + G/TP], rank order
    else:
        every = mine[None]
    best = every[:, :, 0].amax(0)
    at_best = every[:, :, 0] == best[None]
    gids = torch.where(at_best, every[:, :, 1], float(_NO_ID))
    winner = gids.argmin(0)  # the rank with the lowest id among the best scores
    token = gids.amin(0).to(torch.int64)
    z_c = every[:, :, 2].gather(0, winner[None])[0].float()
    group_sums = every[:, :, 3:].permute(1, 0, 2).reshape(rows, groups).float()
    total = torch.zeros(rows, dtype=torch.float32, device=dev)
    for g in range(groups):
        total = total + group_sums[:, g]  # ascending group order, each add rounded
    logprob = (z_c - m) - bik_log_torch(total)
    invalid = bad | (m == float("-inf")) | (best == float("-inf"))
    tokens = torch.where(invalid, -1, token)
    logprobs = torch.where(invalid, float("nan"), logprob)
    _whole_rows(group, size, x, params, vocab, backend, max_top_k, tokens, logprobs)
    return tokens, logprobs


def _whole_rows(group, size, x, params, vocab, backend, max_top_k, tokens, logprobs) -> None:
    """Rows whose filters need the whole distribution (top-k on, top-p < 1) gather their logits
    (those rows only) and take bik.sample's draw, in place."""
    top_k, top_p = params[3], params[4]
    need = (((top_k > 0) & (top_k < vocab)) | (top_p < 1)).nonzero()[:, 0]
    if need.numel() == 0:
        return
    mine = x.index_select(0, need).contiguous()
    parts = [torch.empty_like(mine) for _ in range(size)]
    if size > 1:
        dist.all_gather(parts, mine, group=group)
    else:
        parts = [mine]
    sub = [t.index_select(0, need) for t in params]
    out = sample(torch.cat(parts, 1), seed=sub[0], position=sub[1], temperature=sub[2],
                 top_k=sub[3], top_p=sub[4], min_p=sub[5], max_top_k=max_top_k,
                 backend=backend)
    tokens[need], logprobs[need] = out.tokens, out.logprobs


def vocab_parallel_sample(logits_shard: torch.Tensor, *, seed, position, temperature=None,
                          top_k=None, top_p=None, min_p=None, group=None,
                          max_top_k: int | None = None, any_top_p: bool | None = None,
                          backend: str | None = None) -> SampleOutput:
    """:func:`bik.sample` of logits whose vocabulary is sharded over the ranks of ``group``.

    Rank r passes ``logits_shard = logits[:, r*V/TP:(r+1)*V/TP]`` ([B, V/TP], fp32/bf16/fp16)
    and the same per-row parameters as every other rank (as bik.sample takes them). Returns on
    every rank ``bik.sample(logits, ...)``'s tokens (global ids) and logprobs, bit for bit.
    Rows with neither top-k nor top-p move three small collectives (a [2, B] all_reduce, a
    [B, 3 + G/TP] all_gather and the agreement check), never their logits; rows with top-k on
    or top-p < 1 gather their own logits (exactly) and are drawn by bik.sample (``backend`` and
    ``max_top_k``: its arguments for those rows; the parameter values are checked here, with
    ``any_top_p`` if given; the rows to gather are found on the device either way). V must be
    a multiple of bik.configs.MATMUL_TP_MAX and TP must divide it. Mismatched shapes or parameters across ranks raise ValueError on every rank.
    Reads the rows to gather back to the host (not CUDA-graph capturable).
    """
    size, rank = group_size_rank(group)

    def build():
        if logits_shard.dim() != 2 or not logits_shard.is_floating_point():
            raise ValueError(f"{_SAMPLE}: logits_shard must be a float [B, V/TP] tensor, got "
                             f"{list(logits_shard.shape)} {logits_shard.dtype}")
        vocab = _check_vocab(_SAMPLE, size, logits_shard.shape[1])
        params = row_params(_SAMPLE, logits_shard.shape[0], logits_shard.device, seed, position,
                            temperature, top_k, top_p, min_p)
        check_row_params(_SAMPLE, logits_shard.shape[0], vocab, logits_shard.device, *params,
                         max_top_k=max_top_k, any_top_p=any_top_p)
        return params

    params = _agree(_SAMPLE, group, logits_shard, build)
    backend = resolve_backend("sample", backend, logits_shard.device)
    return SampleOutput(*_sample_shard(group, size, rank, logits_shard, params, backend,
                                       max_top_k))


def vocab_parallel_verify_draft(draft_tokens: torch.Tensor, num_drafts,
                                logits_shard: torch.Tensor, *, seed, position, temperature=None,
                                top_k=None, top_p=None, min_p=None, group=None,
                                max_top_k: int | None = None, any_top_p: bool | None = None,
                                backend: str | None = None) -> VerifyOutput:
    """:func:`bik.verify_draft` of logits [B, K+1, V] sharded by vocabulary as in
    :func:`vocab_parallel_sample` (rank r passes ``logits[..., r*V/TP:(r+1)*V/TP]``): every
    window row is drawn by the vocab-parallel sampler at its position, then drafts are accepted
    while they equal those tokens. Returns bik.verify_draft's result on every rank, bit for bit.
    """
    size, rank = group_size_rank(group)

    def build():
        if logits_shard.dim() != 3 or not logits_shard.is_floating_point():
            raise ValueError(f"{_VERIFY}: logits_shard must be a float [B, K+1, V/TP] tensor, "
                             f"got {list(logits_shard.shape)} {logits_shard.dtype}")
        rows, width = logits_shard.shape[0], logits_shard.shape[2]
        vocab = _check_vocab(_VERIFY, size, width)
        nd = num_drafts
        if not isinstance(nd, torch.Tensor):
            if isinstance(nd, bool) or not isinstance(nd, int):
                raise TypeError(f"{_VERIFY}: num_drafts must be an int or an int [B] tensor, "
                                f"got {type(nd).__name__}")
            nd = torch.full((rows,), nd, dtype=torch.int64, device=logits_shard.device)
        params = row_params(_VERIFY, rows, logits_shard.device, seed, position, temperature,
                            top_k, top_p, min_p)
        check_verify(_VERIFY, draft_tokens, nd, logits_shard, params, max_top_k=max_top_k,
                     vocab=vocab, any_top_p=any_top_p)
        return (*params, nd, draft_tokens)

    *params, nd, drafts = _agree(_VERIFY, group, logits_shard, build)
    backend = resolve_backend("verify_draft", backend, logits_shard.device)
    rows, window, width = logits_shard.shape
    tokens, logprobs = _sample_shard(group, size, rank, logits_shard.reshape(rows * window, width),
                                     window_rows(params, window), backend, max_top_k)
    return VerifyOutput(*accept_drafts(drafts, nd, tokens.reshape(rows, window),
                                       logprobs.reshape(rows, window)))
