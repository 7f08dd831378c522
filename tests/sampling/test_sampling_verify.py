"""bik.verify_draft: verification by Gumbel coupling (docs/design.md#sampler).

Targets: the CPU backend and the Triton kernels run on the CPU by TRITON_INTERPRET=1 (their own
process), each at the sizes it affords. Whatever the drafter (random, the target's own tokens,
perturbed ones, a drafter sampling q with the same noise) and for every num_drafts, the accepted
count is the length of the matching prefix and the emitted tokens and logprob bits equal
sequential bik.sample at positions p .. p + K (drafter invariance). On the CPU (2 * 10^5 draws):
a same-noise drafter is accepted at the coupling's exact rate, within 5 sigma, and above the
paper's (1 - TV) / (1 + TV) bound.
"""

from __future__ import annotations

import math

import bik
import pytest
import torch
from targets import targets


@pytest.mark.parametrize("target", targets())
def test_drafter_invariance(target, gen):
    """Several drafters, num_drafts 0..K: emitted tokens/logprobs equal sequential sampling."""
    backend = target.backend
    # (vocabulary, K, rows, the num_drafts tried: None = every one in 0..K)
    v, k, rows, nds = (40, 3, 4, (0, 3)) if target.small else (50, 4, 64, None)
    logits = torch.randn(rows, k + 1, v, generator=gen) * 2
    params = {"seed": torch.randint(0, 2**62, (rows,), generator=gen),
              "position": torch.randint(0, 10**6, (rows,), generator=gen),
              "temperature": torch.tensor([0.0, 1.0, 0.6, 1.5])[torch.arange(rows) % 4],
              "top_k": torch.tensor([0, 5, 0, 20])[torch.arange(rows) % 4]}
    seq = [bik.sample(logits[:, j], backend=backend,
                      **(params | {"position": params["position"] + j})) for j in range(k + 1)]
    target_tokens = torch.stack([s.tokens for s in seq], 1)
    target_lp = torch.stack([s.logprobs for s in seq], 1)
    q = logits + torch.randn(logits.shape, generator=gen) * 0.5
    same_noise = torch.stack([bik.sample(q[:, j], backend=backend,
                                         **(params | {"position": params["position"] + j})
                                         ).tokens for j in range(k)], 1)
    drafters = {
        "random": torch.randint(0, v, (rows, k), generator=gen),
        "target": target_tokens[:, :k],
        "perturbed": torch.where(torch.rand(rows, k, generator=gen) < 0.3,
                                 (target_tokens[:, :k] + 1) % v, target_tokens[:, :k]),
        "same_noise_q": same_noise,
    }
    for name, drafts in drafters.items():
        for nd in range(k + 1) if nds is None else nds:
            out = bik.verify_draft(drafts, nd, logits, backend=backend, **params)
            acc = out.num_accepted
            assert ((acc >= 0) & (acc <= nd)).all()
            match = (drafts == target_tokens[:, :k]).long().cumprod(1)[:, :nd].sum(1)
            assert torch.equal(acc, match), name
            emitted = torch.arange(k + 1)[None, :] <= acc[:, None]
            assert torch.equal(out.tokens[emitted], target_tokens[emitted]), (name, nd)
            assert torch.equal(out.logprobs[emitted].view(torch.int32),
                               target_lp[emitted].view(torch.int32)), (name, nd)
            assert (out.tokens[~emitted] == -1).all()
            assert (out.logprobs[~emitted] == float("-inf")).all()
            if name == "target":
                assert torch.equal(acc, torch.full_like(acc, nd))


@pytest.mark.parametrize("target", targets("cpu"))
def test_coupling_acceptance_rate(target, gen):
    """Same-noise drafts from q are accepted with probability sum_i 1/sum_j max(p_j/p_i,
    q_j/q_i); the measured rate over n draws is within 5 sigma of it."""
    n, v = 200_000, 6
    lp = torch.tensor([0.5, -1.0, 1.5, 0.0, -0.5, 0.8])
    lq = torch.tensor([0.9, -0.2, 1.0, -0.6, 0.3, 0.8])
    p, q = torch.softmax(lp.double(), 0), torch.softmax(lq.double(), 0)
    exact = sum(1 / torch.maximum(p / p[i], q / q[i]).sum() for i in range(v)).item()
    pos = torch.arange(n) * 7
    drafts = bik.sample(lq.expand(n, -1), seed=42, position=pos, backend=target.backend).tokens
    logits = torch.stack([lp.expand(n, -1), torch.zeros(n, v)], 1)
    out = bik.verify_draft(drafts[:, None], 1, logits, seed=42, position=pos,
                           backend=target.backend)
    rate = out.num_accepted.double().mean().item()
    sigma = math.sqrt(exact * (1 - exact) / n)
    assert abs(rate - exact) < 5 * sigma, (rate, exact, sigma)
    tv = 0.5 * (p - q).abs().sum().item()
    assert exact >= (1 - tv) / (1 + tv) - 1e-12  # the paper's lower bound
