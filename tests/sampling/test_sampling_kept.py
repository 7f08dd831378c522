"""ops/sampling/kept.py: the tokens bik.sample keeps, found again in torch (what a processed
logprobs row needs). On every target: ``bik.log_softmax`` of the logits with the rest at -inf,
at the drawn token, is bik.sample's logprob bit for bit, with top-k, top-p and both; top-p's
cut is the literal contract's (reference.top_p_cut). Controls: the unfiltered log_softmax gives
other logprobs, and a cut that drops the boundary token another set."""

from __future__ import annotations

import pytest
import torch
from bik import configs
from bik.ops.sampling import reference
from bik.ops.sampling.kept import kept_tokens
from targets import targets

import bik


def _rows(vocab: int, gen):
    z = torch.randn(16, vocab, generator=gen) * 3
    z[3, : vocab // 2] = float("-inf")  # min-p's -inf, applied before the draw
    top_k = torch.tensor([0, 5, 50, 0, 1, vocab, 0, 20] * 2)
    top_p = torch.tensor([1.0, 1.0, 0.9, 0.5, 1.0, 0.3, 0.95, 0.8] * 2)
    return z, top_k, top_p


@pytest.mark.parametrize("target", targets())
def test_filtered_log_softmax_at_the_draw_is_the_samplers_logprob(target, gen):
    vocab = 300 if target.small else 49152
    z, top_k, top_p = _rows(vocab, gen)
    out = bik.sample(z.to(target.device), seed=torch.arange(16), position=torch.arange(16) * 3,
                     temperature=1.0, top_k=top_k, top_p=top_p, backend=target.backend)
    tokens, logprobs = out.tokens.cpu(), out.logprobs.cpu()
    kept = kept_tokens(z, top_k, top_p)
    assert kept.gather(1, tokens[:, None]).all()
    filtered = bik.log_softmax(z.masked_fill(~kept, float("-inf")), -1)
    assert torch.equal(filtered.gather(1, tokens[:, None])[:, 0], logprobs)
    unfiltered = bik.log_softmax(z, -1).gather(1, tokens[:, None])[:, 0]
    assert not torch.equal(unfiltered, logprobs)  # the control: the filter matters


def test_top_p_cut_is_the_literal_contracts(gen):
    z = torch.randn(6, 2000, generator=gen) * 2
    for p in (0.3, 0.9, 0.99):
        kept = kept_tokens(z, None, torch.full((6,), p))
        cut = reference.top_p_cut(z, p, *configs.sampler_chunks(2000))
        assert torch.equal(kept, z >= cut[:, None]), p
        assert not torch.equal(kept, z > cut[:, None])  # the control: the boundary token counts

