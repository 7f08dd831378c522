"""The distribution bik.sample draws from, by statistical tests on 10^6 draws.

Target: the CPU backend (10^6 rows are beyond the interpreter; the Triton tokens equal the CPU's
where the contract promises it: test_sampling_vs_cpu.py). One row per draw (positions
0 .. 10^6 - 1): at seven (temperature, top-k, top-p, min-p) settings the counts pass a
chi-square test against the exact fp64 filtered distribution (bik/ops/sampling/reference.py),
no filtered-out token is drawn, and the logprobs are that distribution's; the same test rejects
a sampler that ignores the temperature (negative control: it has power); a -inf token is never
drawn at T = 0.05, 1 and 50.
"""

from __future__ import annotations

import math

import bik
import pytest
import torch
from bik.ops.sampling.reference import filtered_probs
from targets import targets

N_DRAWS = 1_000_000
# Per chi-square test, the probability that a correct sampler fails (a fixed seed makes the
# outcome deterministic; this is the chance that a given seed is unlucky).
FALSE_FAILURE = 1e-9


def _chi2_sf(stat: float, df: int) -> float:
    """Survival function of the chi-square distribution with integer df (exact series)."""
    half = stat / 2
    if df % 2 == 0:
        term, total = 1.0, 1.0
        for i in range(1, df // 2):
            term *= half / i
            total += term
        return math.exp(-half) * total
    total = math.erfc(math.sqrt(half))
    term = math.sqrt(half) * math.exp(-half) / math.sqrt(math.pi) * 2
    for i in range(1, (df + 1) // 2):
        total += term
        term *= half / (i + 0.5)
    return total


DISTRIBUTION_CASES = [  # (temperature, top_k, top_p, min_p)
    (1.0, 0, 1.0, 0.0), (0.5, 0, 1.0, 0.0), (2.5, 0, 1.0, 0.0), (1.0, 3, 1.0, 0.0),
    (0.8, 0, 0.7, 0.0), (1.3, 0, 1.0, 0.2), (1.0, 5, 0.9, 0.05),
]


@pytest.mark.parametrize("target", targets("cpu"))
@pytest.mark.parametrize("case", DISTRIBUTION_CASES, ids=str)
def test_distribution_chi_square(target, case):
    """10^6 draws (one row per draw: positions 0..10^6-1) match the categorical exactly."""
    t, top_k, top_p, min_p = case
    logits = torch.tensor([1.2, -0.3, 0.4, 2.0, -1.1, 0.9, 0.0, -2.2])
    probs = filtered_probs(logits, t, top_k, top_p, min_p)
    out = bik.sample(logits.expand(N_DRAWS, -1), seed=1234, position=torch.arange(N_DRAWS),
                     temperature=t, top_k=top_k, top_p=top_p, min_p=min_p,
                     backend=target.backend)
    counts = torch.bincount(out.tokens, minlength=len(logits)).double()
    kept = probs > 0
    assert counts[~kept].sum() == 0, "a filtered-out token was drawn"
    expected = probs[kept] * N_DRAWS
    stat = float(((counts[kept] - expected) ** 2 / expected).sum())
    sf = _chi2_sf(stat, int(kept.sum()) - 1)
    assert sf > FALSE_FAILURE, (stat, sf)
    # logprobs are the log of the filtered, tempered probabilities.
    lp = out.logprobs[:1000].double()
    assert torch.allclose(lp, probs.log()[out.tokens[:1000]], atol=1e-5)


@pytest.mark.parametrize("target", targets("cpu"))
def test_chi_square_has_power(target):
    """The same test rejects a sampler that ignores the temperature (draws at T=1 vs T=0.8)."""
    logits = torch.tensor([1.2, -0.3, 0.4, 2.0, -1.1, 0.9, 0.0, -2.2])
    probs = filtered_probs(logits, 0.8, 0, 1.0, 0.0)
    out = bik.sample(logits.expand(N_DRAWS, -1), seed=1, position=torch.arange(N_DRAWS),
                     backend=target.backend)
    counts = torch.bincount(out.tokens, minlength=8).double()
    stat = float(((counts - probs * N_DRAWS) ** 2 / (probs * N_DRAWS)).sum())
    assert _chi2_sf(stat, 7) < FALSE_FAILURE


@pytest.mark.parametrize("target", targets("cpu"))
@pytest.mark.parametrize("temperature", [0.05, 1.0, 50.0])
def test_masked_token_never_chosen(target, temperature):
    """-inf tokens compete with finite ones of similar value (so the noise decides between the
    finite ones), and in the second half top_k = 3 removes the largest finite logits too."""
    v = 16
    logits = torch.empty(v)
    logits[::2] = float("-inf")
    logits[1::2] = torch.linspace(0.5, -1.0, v // 2)  # tokens 1, 3, 5 hold the top 3
    top_k = torch.where(torch.arange(N_DRAWS) < N_DRAWS // 2, 0, 3)
    out = bik.sample(logits.expand(N_DRAWS, -1), seed=99, position=torch.arange(N_DRAWS),
                     temperature=temperature, top_k=top_k, backend=target.backend)
    assert (out.tokens % 2 == 1).all()
    assert torch.isfinite(out.logprobs).all()
    second = out.tokens[N_DRAWS // 2:]
    assert set(second.unique().tolist()) <= {1, 3, 5}
    # the draw is not degenerate: several finite tokens are drawn in the unfiltered half
    assert out.tokens[: N_DRAWS // 2].unique().numel() >= (2 if temperature < 0.1 else 5)
