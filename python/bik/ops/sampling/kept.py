"""The tokens bik.sample keeps, in torch: what a processed logprobs row needs.

For tempered fp32 logits z (T applied; min-p's -inf already in z, as vLLM applies it), the
sampler keeps top-k's first k tokens in the order (z desc, index asc), then the tokens with
z >= v_p, top-p's cut: the largest fp32 v whose mass vocab_sum(bik_exp(z_j - m) [z_j >= v])
reaches p * S (docs/design.md#sampler). bik.sample does not return the set, so this finds it
again from the contract with exact operations and the normaliser's order: top-k with
``split_vocab.topk_threshold`` (the GPU samplers' host side), the cut by the CPU kernel's 32
bisection steps on the fp32 order key, each mass a ``vocab_sum_torch``. Since v_p is defined
by the contract, any correct search gives the same set, hence
``bik.log_softmax(z.masked_fill(~kept, -inf))`` at the drawn token = bik.sample's logprob
(tested on every backend). Cost: 32 normaliser sums over the rows with top-p on.
"""

from __future__ import annotations

import torch

from bik.configs import sampler_chunks
from bik.ops._normaliser import bik_exp_torch, vocab_sum_torch
from bik.ops.sampling.split_vocab import topk_threshold

_SEARCH_STEPS = 32  # the CPU kernel's: the order key's range is below 2^33


def _key(v: torch.Tensor) -> torch.Tensor:
    b = v.contiguous().view(torch.int32)
    return torch.where(b >= 0, b, b ^ 0x7FFFFFFF).to(torch.int64)


def _from_key(k: torch.Tensor) -> torch.Tensor:
    b = k.to(torch.int32)
    return torch.where(b >= 0, b, b ^ 0x7FFFFFFF).view(torch.float32)


def kept_tokens(z: torch.Tensor, top_k: torch.Tensor | None = None,
                top_p: torch.Tensor | None = None) -> torch.Tensor:
    """bool [B, V]: the tokens bik.sample keeps for tempered fp32 logits z [B, V] (finite
    rows with a finite max), top_k int64 [B] (<= 0 or >= V: off) and top_p fp32 [B] (1: off)."""
    rows, vocab = z.shape
    device = z.device
    top_k = torch.zeros(rows, dtype=torch.int64, device=device) if top_k is None else top_k
    top_p = torch.ones(rows, dtype=torch.float32, device=device) if top_p is None else top_p
    ones = torch.ones(rows, dtype=torch.float32, device=device)
    vk, ik = topk_threshold(z, ones, top_k, None)
    index = torch.arange(vocab, device=device)
    kept = (z > vk[:, None]) | ((z == vk[:, None]) & (index <= ik[:, None]))
    on = top_p < 1
    if not bool(on.any()):
        return kept
    zp, kp = z[on], kept[on]
    m = torch.where(kp, zp, float("-inf")).amax(1, keepdim=True)
    terms = torch.where(kp, bik_exp_torch(zp - m), 0.0)
    groups, chunk = sampler_chunks(vocab)
    target = top_p[on] * vocab_sum_torch(terms, groups, chunk)  # one rounded fp32 multiply
    lo = _key(torch.full_like(m[:, 0], float("-inf")))
    hi = _key(m[:, 0]) + 1
    for _ in range(_SEARCH_STEPS):
        mid = (lo + hi) >> 1
        mass = vocab_sum_torch(torch.where(zp >= _from_key(mid)[:, None], terms, 0.0),
                               groups, chunk)
        reaches = mass >= target
        lo, hi = torch.where(reaches, mid, lo), torch.where(reaches, hi, mid)
    kept[on] = kp & (zp >= _from_key(lo)[:, None])
    return kept
