"""bik.sample's Triton kernels under TRITON_INTERPRET=1 (own process; see
tests/test_triton_interpreter.py for what the interpreter can and cannot prove), and the
cross-backend promise: the Triton noise equals the CPU noise bit for bit on all 2^23 u values,
and greedy / temperature / top-k / min-p tokens equal the CPU path's token for token.

The interpreter table uses SPLIT = 128 and BLOCK = 64, so vocabularies of a few hundred cross
several pick programs (merged in torch) and several chunks per program.
"""

import bik
import pytest
import sampling_cases as sc
import torch
from bik.ops.sampling import cpu as cpu_sampling
from conftest import INTERPRETER
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(not INTERPRETER, reason="needs TRITON_INTERPRET=1 (own process)"),
]

TRITON = "triton"


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def test_philox_known_answers_and_random_words():
    from bik.ops.sampling.triton import run_noise_part

    for counter, key, want in sc.philox_kat():
        got = run_noise_part("philox", torch.tensor([counter + key]), 1)
        assert tuple(got[0].tolist()) == want
    words = torch.randint(0, 2**32, (3000, 6), generator=torch.Generator().manual_seed(1))
    assert torch.equal(run_noise_part("philox", words, 3000),
                       cpu_sampling.philox4x32_10(words[:, :4], words[:, 4:]))


def test_noise_bit_identical_to_cpu_on_every_u():
    from bik.ops.sampling.triton import run_noise_part

    u = sc.all_units()
    got = run_noise_part("gumbel", u, u.numel())
    assert torch.equal(_bits(got), _bits(cpu_sampling.gumbel_from_unit(u)))
    assert got.min().item() == sc.G_MIN and got.max().item() == sc.G_MAX


def test_bik_log_bit_identical_to_cpu():
    from bik.ops.sampling.triton import run_noise_part

    mant = (torch.arange(2**23, dtype=torch.int32) | (127 << 23)).view(torch.float32)
    for x in (mant * 2.0**-126, mant * 2.0**100):
        assert torch.equal(_bits(run_noise_part("log", x, x.numel())),
                           _bits(cpu_sampling.bik_log(x)))


@pytest.mark.parametrize("near_ties", [False, True], ids=["random", "near_ties"])
@pytest.mark.parametrize("v", [1, 7, 300])
def test_tokens_equal_cpu(near_ties, v, gen):
    """Greedy, temperature, top-k and min-p: the same tokens as the CPU path, and the same
    logprobs up to the backends' exp/log."""
    t = sc.requests(48, v, gen, near_ties=near_ties, filters="top_k_min_p")
    params = {k: t[k] for k in sc.PARAM_NAMES}
    tri = bik.sample(t["logits"], backend=TRITON, **params)
    cpu = bik.sample(t["logits"], backend="cpu", **params)
    assert torch.equal(tri.tokens, cpu.tokens)
    assert torch.allclose(tri.logprobs, cpu.logprobs, atol=1e-5, rtol=1e-5)


def test_top_p_close_to_cpu(gen):
    """top-p sums exp in each backend's order: tokens are not promised equal, but the filter
    keeps what it promises (test_filters) and the logprobs of equal tokens agree closely."""
    t = sc.requests(24, 150, gen)
    params = {k: t[k] for k in sc.PARAM_NAMES}
    tri = bik.sample(t["logits"], backend=TRITON, **params)
    cpu = bik.sample(t["logits"], backend="cpu", **params)
    same = tri.tokens == cpu.tokens
    assert same.float().mean() > 0.9
    assert torch.allclose(tri.logprobs[same], cpu.logprobs[same], atol=1e-5, rtol=1e-5)


def test_large_vocab_many_splits(gen):
    t = sc.requests(4, 2000, gen, filters="top_k_min_p")
    params = {k: t[k] for k in sc.PARAM_NAMES}
    assert torch.equal(bik.sample(t["logits"], backend=TRITON, **params).tokens,
                       bik.sample(t["logits"], backend="cpu", **params).tokens)


def test_batch_invariance(gen):
    sc.check_batch_invariance(TRITON, 150, (1, 3, 11), 6, gen)


def test_greedy(gen):
    sc.check_greedy(TRITON, gen, rows=12)


def test_invalid_rows(gen):
    sc.check_invalid_rows(TRITON, gen)


def test_filters(gen):
    sc.check_filters_keep_what_they_promise(TRITON, gen, rows=24)


def test_drafter_invariance(gen):
    sc.check_drafter_invariance(TRITON, 40, 3, 4, gen, nds=(0, 3))


def test_verify_equals_cpu(gen):
    logits = torch.randn(8, 4, 60, generator=gen)
    drafts = torch.randint(0, 60, (8, 3), generator=gen)
    args = {"seed": 5, "position": torch.arange(8) * 100, "temperature": 0.7, "top_k": 10}
    a = bik.verify_draft(drafts, 3, logits, backend=TRITON, **args)
    b = bik.verify_draft(drafts, 3, logits, backend="cpu", **args)
    assert torch.equal(a.num_accepted, b.num_accepted) and torch.equal(a.tokens, b.tokens)


def test_opcheck(gen):
    sc.check_opcheck(TRITON, gen, filters="top_k_min_p")


@settings(deadline=None, derandomize=True, max_examples=10)
@given(rows=st.integers(1, 9), v=st.integers(1, 400), temperature=st.sampled_from([0.0, 0.3, 1.0]),
       top_k=st.integers(-1, 50), min_p=st.sampled_from([0.0, 0.1]), seed=st.integers(0, 2**62))
def test_hypothesis_triton_equals_cpu(rows, v, temperature, top_k, min_p, seed):
    gen = torch.Generator().manual_seed(seed % 2**31)
    x = torch.randn(rows, v, generator=gen) * 2
    args = {"seed": seed, "position": torch.arange(rows) + seed % 1000, "temperature": temperature,
                "top_k": top_k, "min_p": min_p}
    assert torch.equal(bik.sample(x, backend=TRITON, **args).tokens,
                       bik.sample(x, backend="cpu", **args).tokens)


def test_noise_skip_matches_cpu(gen):
    """Spread-out logits: most chunks skip the noise (below the max token's floor); a token
    just inside the bound in every row. Triton and CPU still agree token for token."""
    x = torch.randn(24, 300, generator=gen) * 12
    x[:, 77] = x.amax(1) + (sc.G_MIN - sc.G_MAX) + 1e-3
    args = {"seed": 3, "position": torch.arange(24) * 5, "temperature": 1.0}
    assert torch.equal(bik.sample(x, backend=TRITON, **args).tokens,
                       bik.sample(x, backend="cpu", **args).tokens)
