"""The sampler's normaliser contract (docs/design.md#sampler, "The normaliser"): bik_exp and the
vocabulary-chunk summation order, on each backend this machine runs.

Targets: the CPU backend (csrc/cpu/sampling.h through bik/ops/sampling/cpu.py) and the Triton
kernels under TRITON_INTERPRET=1 (their own process), through test entry points that run the
kernels' own code (sampling_test_kernels.py): ``run_noise_part("exp")`` and ``vocab_sum`` (the
stats kernels' ``group_mass`` on given terms). On each: bik_exp is within 1 ulp of fp64, 0 below
-86, and gives the bits of its torch replica; vocab_sum gives the bits of the literal
transcription in bik/ops/sampling/reference.py for vocabularies with one group and with TP_max
groups, with whole and ragged chunks, and a rank holding whole groups computes their totals
alone. A flat sum and torch.sum give other bits on the same terms (the order is what the tests
pin). The sampler's logprobs are the literal contract's bits (reference.logprob), and a top-p
row's kept set is the largest v whose mass, in this order, reaches top_p * S.
"""

from __future__ import annotations

import bik
import pytest
import torch
from bik import configs
from bik.ops.sampling import cpu as cpu_sampling
from bik.ops.sampling import reference
from bik.ops._normaliser import bik_exp_torch
from targets import targets


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def _exp(target, x: torch.Tensor) -> torch.Tensor:
    if target.backend == "cpu":
        return cpu_sampling.bik_exp(x)
    from sampling_test_kernels import run_noise_part

    return run_noise_part("exp", x, x.shape[0])


def _vocab_sum(target, terms: torch.Tensor) -> torch.Tensor:
    if target.backend == "cpu":
        return cpu_sampling.vocab_sum(terms)
    from sampling_test_kernels import vocab_sum

    return vocab_sum(terms)


def _spread_terms(gen, rows: int, v: int) -> torch.Tensor:
    """Positive terms over twelve decades, in random order: any change of summation order shows
    in the bits."""
    mags = torch.logspace(-6, 6, v)[torch.randperm(v, generator=gen)]
    return (torch.rand(rows, v, generator=gen) * mags).float()


@pytest.mark.parametrize("target", targets())
def test_bik_exp_accuracy_range_and_torch_replica(target, gen):
    x = torch.cat([torch.linspace(-90.0, 0.0, 400_001 if target.small else 2_000_001),
                   -torch.rand(50_000, generator=gen) * 1e-3,
                   torch.tensor([-0.0, 0.0, float("-inf"), -86.0, -85.99999, -86.00001])])
    got = _exp(target, x)
    assert torch.equal(_bits(got), _bits(bik_exp_torch(x)))
    if target.backend != "cpu":
        assert torch.equal(_bits(got), _bits(cpu_sampling.bik_exp(x)))
    live = x >= -86.0
    ref = torch.exp(x.double())
    ulp = 2.0 ** (torch.floor(torch.log2(ref[live])) - 23)
    worst = ((got[live].double() - ref[live]).abs() / ulp).max().item()
    assert worst <= 1.0, worst  # measured: 0.97 ulp
    assert (got[~live] == 0).all() and got[x == 0].eq(1.0).all()
    assert (got[live] >= 2.0**-126).all()  # never a subnormal (a GPU flushing them agrees)
    order = torch.argsort(x)
    assert (got[order].diff() >= 0).all()  # monotone


@pytest.mark.parametrize("target", targets())
@pytest.mark.parametrize("v", [1, 33, 300, 1025, 2400, 8 * 1024, 8 * 1030 + 8])
def test_vocab_sum_is_the_literal_order(target, v, gen):
    """V = 1 .. 1025: one group (V not a multiple of 8, or 1024 < V); 2400 and 8·1030 + 8: eight
    groups with ragged chunks; 8·1024: eight groups of whole chunks."""
    terms = _spread_terms(gen, 3, v)
    groups, chunk = configs.sampler_chunks(v)
    assert groups == (configs.MATMUL_TP_MAX if v % configs.MATMUL_TP_MAX == 0 else 1)
    got = _vocab_sum(target, terms)
    assert torch.equal(_bits(got), _bits(reference.vocab_sum(terms, groups, chunk)))
    if v > 1:  # the order matters on these terms: a flat sum or torch's tree gives other bits
        flat = torch.zeros(3)
        for j in range(v):
            flat = flat + terms[:, j]
        assert not torch.equal(got, flat) or not torch.equal(got, terms.sum(1))


@pytest.mark.parametrize("target", targets())
def test_vocab_sum_with_small_chunks(target, monkeypatch, gen):
    """Chunks of 16 over a 200-token vocabulary: many chunks per group and a ragged last one."""
    monkeypatch.setattr(configs, "SAMPLER_CHUNK", 16)
    terms = _spread_terms(gen, 4, 200)
    assert configs.sampler_chunks(200) == (8, 16)
    got = _vocab_sum(target, terms)
    assert torch.equal(_bits(got), _bits(reference.vocab_sum(terms, 8, 16)))
    assert not torch.equal(got, reference.vocab_sum(terms, 1, 16))  # grouping changes bits


def test_a_rank_holding_whole_groups_computes_their_totals():
    """The vocab-parallel property: the totals of a rank's groups, computed from its shard alone
    (one group each, the same chunks), folded in ascending group order, are the full sum."""
    gen = torch.Generator().manual_seed(7)
    v = 8 * 777
    terms = _spread_terms(gen, 5, v)
    groups, chunk = configs.sampler_chunks(v)
    ext = cpu_sampling.cpu_ext.require()
    totals = []
    for g in range(groups):
        shard = terms[:, g * (v // groups):(g + 1) * (v // groups)].contiguous()
        out = torch.empty(5)
        ext.vocab_sum_f32(shard.data_ptr(), 5, shard.shape[1], 1, chunk, out.data_ptr())
        totals.append(out)
    folded = torch.zeros(5)
    for t in totals:
        folded = folded + t
    assert torch.equal(_bits(folded), _bits(cpu_sampling.vocab_sum(terms)))


@pytest.mark.parametrize("target", targets())
def test_logprobs_are_the_literal_contract(target, gen):
    """Rows without top-p: the kept set is known exactly (top-k by (z desc, index asc), min-p
    from bik_log), and the logprob is (z_c - m) - bik_log(vocab_sum(bik_exp(z - m))) bit for
    bit."""
    rows, v = (6, 300) if target.small else (16, 3000)
    logits = torch.randn(rows, v, generator=gen) * 3
    temperature = torch.tensor([1.0, 0.7, 1.9, 0.3] * (rows // 4) + [1.0] * (rows % 4))
    top_k = torch.tensor([0, 5, 0, 40] * (rows // 4) + [0] * (rows % 4))
    out = bik.sample(logits, seed=11, position=torch.arange(rows), temperature=temperature,
                     top_k=top_k, backend=target.backend)
    z = logits / temperature[:, None]
    kept = torch.ones_like(z, dtype=torch.bool)
    for r in range(rows):
        if top_k[r] > 0:
            kept[r] = False
            kept[r, torch.argsort(-z[r], stable=True)[:top_k[r]]] = True
    groups, chunk = configs.sampler_chunks(v)
    ref = reference.logprob(z, kept, out.tokens, groups, chunk)
    assert torch.equal(_bits(out.logprobs), _bits(ref))


@pytest.mark.parametrize("target", targets())
def test_top_p_keeps_the_contract_set(target, gen):
    """top-p at T = 1: the kept set is z >= v_p, v_p the largest logit whose mass (the contract's
    sum of bik_exp(z - m) over z >= v_p) reaches top_p * S, found here by bisection over the
    row's distinct values (reference.top_p_cut). The drawn token is in that set and its
    logprob is the literal contract's over exactly that set."""
    rows, v = (4, 200) if target.small else (12, 2000)
    logits = torch.randn(rows, v, generator=gen) * 2
    top_p = 0.8
    out = bik.sample(logits, seed=5, position=torch.arange(rows), top_p=top_p,
                     backend=target.backend)
    groups, chunk = configs.sampler_chunks(v)
    kept = logits >= reference.top_p_cut(logits, top_p, groups, chunk)[:, None]
    assert kept.gather(1, out.tokens[:, None]).all()
    ref = reference.logprob(logits, kept, out.tokens, groups, chunk)
    assert torch.equal(_bits(out.logprobs), _bits(ref))


@pytest.mark.parametrize("vocab", [64, 100, 8 * 1024, 8 * 3000])
def test_group_totals_torch_fold_to_the_kernels_sum(vocab, gen):
    """noise.group_totals_torch (a vocab-parallel rank's groups, any device): its G totals
    folded ascending from +0 are the CPU kernel's vocab_sum and the literal transcription's,
    bit for bit; any contiguous run of whole groups gives the same totals alone."""
    from bik.ops._normaliser import group_totals_torch

    groups, chunk = configs.sampler_chunks(vocab)
    terms = _spread_terms(gen, 5, vocab)
    totals = group_totals_torch(terms, vocab // groups, chunk)
    folded = torch.zeros(5)
    for g in range(groups):
        folded = folded + totals[:, g]
    assert torch.equal(_bits(folded), _bits(cpu_sampling.vocab_sum(terms)))
    assert torch.equal(_bits(folded), _bits(reference.vocab_sum(terms, groups, chunk)))
    if groups > 1:
        half = terms[:, vocab // 2:]
        assert torch.equal(group_totals_torch(half, vocab // groups, chunk),
                           totals[:, groups // 2:])


@pytest.mark.parametrize("v", [1, 17, 1000, 49152, 50257])
def test_greedy_rows_on_vectors_give_the_scalar_sequence(v, gen):
    """The CPU sampler's unfiltered greedy rows run on the ISA's vectors (argmax, then the
    normaliser of kernels_isa.h exp_sum_row): the tokens and logprob bits of sample_row's scalar
    sequence (isa="scalar") and of the literal contract, on rows with ties, -0/+0 maxima, -inf
    entries, an all -inf row and NaN / +inf rows (invalid); filtered greedy rows and sampled
    rows keep the scalar path either way."""
    rows = 10
    x = torch.randn(rows, v, generator=gen) * 4
    x[1, v // 2:] = x[1].max()  # a tie: the lowest index wins
    x[2] = float("-inf")
    x[3, v // 3] = float("nan")
    x[4, -1] = float("inf")
    x[5, ::2] = float("-inf")
    x[6] = 0.0
    x[6, v // 2:] = -0.0  # +0 first, then -0: the same max, the first index
    x[7, 0] = -0.0  # a -0 maximum first
    x[7, 1:] = -x[7, 1:].abs() - 1
    x[7, -1] = 0.0
    zeros = torch.zeros(rows, dtype=torch.int64)
    temperature = torch.zeros(rows)
    temperature[8] = 1.0  # a sampled row
    top_k = zeros.clone()
    top_k[9] = 3  # a filtered greedy row
    args = (x, torch.arange(rows), torch.arange(rows), temperature, top_k, torch.ones(rows),
            torch.full((rows,), float("-inf")))
    fast = cpu_sampling.sample_cpu(*args)
    scalar = cpu_sampling.sample_cpu(*args, isa="scalar")
    assert torch.equal(fast[0], scalar[0]) and torch.equal(_bits(fast[1]), _bits(scalar[1]))
    valid = ~(x.isnan() | (x == float("inf"))).any(1) & (x.amax(1) > float("-inf"))
    assert valid[[0, 1, 6, 7]].all() and not valid[[2, 3, 4]].any()
    assert torch.equal(fast[0] >= 0, valid) and torch.equal(fast[1].isnan(), ~valid)
    greedy = [r for r in range(8) if valid[r]]
    want = torch.stack([torch.nonzero(x[r] == x[r].max())[0, 0] for r in greedy])
    assert torch.equal(fast[0][greedy], want)
    kept = torch.ones_like(x, dtype=torch.bool)
    ref = reference.logprob(x[greedy], kept[greedy], want, *configs.sampler_chunks(v))
    assert torch.equal(_bits(fast[1][greedy]), _bits(ref))
