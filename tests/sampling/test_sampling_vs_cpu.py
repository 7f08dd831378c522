"""The cross-backend promise: tokens and logprobs equal the CPU path's, bit for bit, with every
filter (greedy, temperature, top-k, top-p, min-p).

Targets: the Triton kernels run on the CPU by TRITON_INTERPRET=1 (their own process; see
tests/matmul/test_matmul.py for what the interpreter can and cannot prove), compared with
the CPU backend on random and near-tie logits, vocabularies of 1 to 2000, and by hypothesis;
on a GPU (where there is one) the Triton and CUDA C++ kernels, up to Llama-3's vocabulary.
The normaliser (top-p masses, the logprob) is bik_exp summed in the contract's written order
and bik_log, so it has the CPU's bits too (test_sampling_normaliser.py). verify_draft accepts
and emits what the CPU's does. (The noise's bit identity: test_sampling_noise.py.)

The interpreter table uses SPLIT = 128 and BLOCK = 64, so vocabularies of a few hundred cross
several pick programs (merged in torch) and several chunks per program.
"""

from __future__ import annotations

import bik
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sampler_inputs import PARAM_NAMES, requests
from targets import targets


def _equals_cpu(target, t: dict) -> None:
    """The target's tokens and logprob bits are the CPU backend's for the requests t."""
    params = {k: t[k] for k in PARAM_NAMES}
    got = bik.sample(t["logits"].to(target.device), backend=target.backend,
                     **{k: p.to(target.device) for k, p in params.items()})
    cpu = bik.sample(t["logits"], backend="cpu", **params)
    assert torch.equal(got.tokens.cpu(), cpu.tokens)
    assert torch.equal(got.logprobs.cpu().view(torch.int32), cpu.logprobs.view(torch.int32))


# On a GPU the same tests run the Triton and CUDA C++ kernels with real concurrency: the (row,
# normaliser group) programs of a pass and the ticket that picks the row's deciding program.
_KERNELS = targets("interpreter", "gpu-triton", "gpu-cuda")


@pytest.mark.parametrize("target", _KERNELS)
@pytest.mark.parametrize("near_ties", [False, True], ids=["random", "near_ties"])
@pytest.mark.parametrize("v", [1, 7, 300, 512])
def test_tokens_equal_cpu(target, near_ties, v, gen):
    """Greedy, temperature, top-k and min-p: the CPU path's tokens and logprobs (V = 512: the
    normaliser's 8 groups, each a program of its own in the kernels)."""
    _equals_cpu(target, requests(48, v, gen, near_ties=near_ties, filters="top_k_min_p"))


@pytest.mark.parametrize("target", _KERNELS)
@pytest.mark.parametrize("near_ties", [False, True], ids=["random", "near_ties"])
@pytest.mark.parametrize("v", [150, 160])
def test_top_p_equals_cpu(target, near_ties, v, gen):
    """Every filter mixed in, top-p included: the CPU path's tokens and logprobs (rows with
    and without top-p side by side; at V = 160, 8 normaliser groups)."""
    t = requests(24, v, gen, near_ties=near_ties)
    assert (t["top_p"] < 1).any()
    _equals_cpu(target, t)


@pytest.mark.parametrize("target", targets("gpu-triton", "gpu-cuda"))
@pytest.mark.parametrize("v", [49152, 128256])
def test_real_vocab_sizes_equal_cpu(target, v, gen):
    """SmolLM2's and Llama-3's vocabularies, 64 rows (several waves of (row, group) programs
    per pass), every filter mixed in: the CPU path's bits."""
    t = requests(64, v, gen)
    assert (t["top_p"] < 1).any()
    _equals_cpu(target, t)


@pytest.mark.parametrize("target", targets("interpreter"))
def test_large_vocab_many_splits(target, gen):
    t = requests(4, 2000, gen, filters="top_k_min_p")
    params = {k: t[k] for k in PARAM_NAMES}
    got = bik.sample(t["logits"], backend=target.backend, **params)
    cpu = bik.sample(t["logits"], backend="cpu", **params)
    assert torch.equal(got.tokens, cpu.tokens)
    assert torch.equal(got.logprobs.view(torch.int32), cpu.logprobs.view(torch.int32))


@pytest.mark.parametrize("target", targets("interpreter"))
def test_verify_equals_cpu(target, gen):
    logits = torch.randn(8, 4, 60, generator=gen)
    drafts = torch.randint(0, 60, (8, 3), generator=gen)
    args = {"seed": 5, "position": torch.arange(8) * 100, "temperature": 0.7, "top_k": 10}
    a = bik.verify_draft(drafts, 3, logits, backend=target.backend, **args)
    b = bik.verify_draft(drafts, 3, logits, backend="cpu", **args)
    assert torch.equal(a.num_accepted, b.num_accepted) and torch.equal(a.tokens, b.tokens)


@pytest.mark.parametrize("target", targets("interpreter"))
@settings(deadline=None, derandomize=True, max_examples=10)
@given(rows=st.integers(1, 9), v=st.integers(1, 400), temperature=st.sampled_from([0.0, 0.3, 1.0]),
       top_k=st.integers(-1, 50), min_p=st.sampled_from([0.0, 0.1]), seed=st.integers(0, 2**62))
def test_hypothesis_tokens_equal_cpu(target, rows, v, temperature, top_k, min_p, seed):
    gen = torch.Generator().manual_seed(seed % 2**31)
    x = torch.randn(rows, v, generator=gen) * 2
    args = {"seed": seed, "position": torch.arange(rows) + seed % 1000, "temperature": temperature,
            "top_k": top_k, "min_p": min_p}
    assert torch.equal(bik.sample(x, backend=target.backend, **args).tokens,
                       bik.sample(x, backend="cpu", **args).tokens)
