"""The CUDA C++ sampler's real kernels (csrc/cuda/sampling.cu), run on the CPU.

The ``host`` fixture (conftest.py) routes the launcher's launches to the g++ build of the
kernels (tests/cuda/cuda_host/kernels_host.cpp: one CTA at a time, threads as fibers), so
bik.sample(backend="cuda") runs the group max kernel, the pass kernel's launches (one block per
(row, normaliser group), the row's last block deciding through its ticket) and the pick as
written. Tokens and logprobs must be the CPU backend's bits. Not covered here: real
concurrency between the blocks of a pass (the GPU tests cover it) and the GPU's own arithmetic
(the PTX check in test_cuda_compile.py).
"""

from __future__ import annotations

import re

import pytest
import torch
from bik import configs
from bik.ops.sampling import cuda as cuda_sampling
from bik.ops.sampling import reference
from bik.ops._normaliser import bik_exp_torch
from sampler_inputs import requests, sampler


def _launch_plan(host, rows: int, groups: int) -> None:
    names = [k.rsplit("_", 1)[0] for k in host]
    assert names == (["bik_sample_group_max"] + ["bik_sample_pass"] * cuda_sampling.PASSES
                     + ["bik_gumbel_pick"]), names
    assert set(host.grids[:-1]) == {(rows, groups, 1)}, host.grids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [400, 401])
@pytest.mark.parametrize("near_ties", [False, True])
def test_sampler_kernels_give_the_cpu_backends_bits(host, dtype, vocab, near_ties):
    """Rows with and without top-p, top-k and min-p mixed, at a vocabulary of 4 normaliser
    groups (the fixture's TP_max) and of one: the CPU's tokens and logprob bits."""
    gen = torch.Generator().manual_seed(vocab + near_ties)
    table = requests(12, vocab, gen, near_ties=near_ties)
    table["logits"] = table["logits"].to(dtype)
    table["top_p"][:4] = torch.tensor([0.5, 0.9, 0.95, 0.3])
    idx = torch.arange(12)[:, None]
    got = sampler("cuda", table)(idx)
    assert torch.equal(got, sampler("cpu", table)(idx))
    _launch_plan(host, 12, configs.sampler_chunks(vocab).groups)


def test_a_short_search_is_caught(host, monkeypatch):
    """1500 tokens one ulp apart straddle the cut, so the bracket must narrow to one ulp
    (9 passes, the last probing the candidates): with every pass the CUDA kernels give the
    CPU's logprobs, two passes fewer other ones. These rows' masses also tell the group fold's
    order apart (the group totals folded in descending order give other bits), so the equality
    checks that order too."""
    x = torch.full((2, 2000), -6.0)
    x[:, :10] = 3.0
    chain = torch.full((1500,), 0.5)
    for i in range(1, 1500):
        chain[i] = torch.nextafter(chain[i - 1], torch.tensor(1.0))
    x[0, 10:1510], x[1, 10:1510] = chain, chain.flip(0)
    table = {"logits": x, "seed": torch.tensor([1, 2]), "position": torch.tensor([5, 6]),
             "temperature": torch.ones(2), "top_k": torch.zeros(2, dtype=torch.int64),
             "top_p": torch.full((2,), 0.9), "min_p": torch.zeros(2)}
    idx = torch.arange(2)[:, None]
    want = sampler("cpu", table)(idx)
    assert torch.equal(sampler("cuda", table)(idx), want)
    monkeypatch.setattr(cuda_sampling, "PASSES", cuda_sampling.PASSES - 2)
    assert not torch.equal(sampler("cuda", table)(idx)[:, 1], want[:, 1])

    groups, chunk = configs.sampler_chunks(2000)
    assert groups == 4
    terms = bik_exp_torch(x - x.amax(1, keepdim=True))
    flipped = terms.view(2, groups, -1).flip(1).reshape(2, -1)
    assert not torch.equal(reference.vocab_sum(terms, groups, chunk),
                           reference.vocab_sum(flipped, groups, chunk))


def test_launcher_constants_are_the_kernels():
    """The launcher sizes its buffers and counts its launches with the kernels' constants."""
    from cuda_host_build import SRC

    text = (SRC / "sampling.cuh").read_text() + (SRC / "sampling.cu").read_text()
    compiled = {name: int(value) for name, value in
                re.findall(r"constexpr (?:int|i64) (k\w+) = (\d+);", text)}
    assert {name: compiled[c] for name, c in (
        ("COMPILED_CHUNK", "kSamplerChunk"), ("MAX_CHUNKS", "kMaxChunks"),
        ("PROBE_LANES", "kProbeLanes"), ("CANDIDATES", "kTopPCandidates"),
        ("PASSES", "kTopPPasses"), ("CUT_STATE_BYTES", "kCutStateBytes"))} == {
        name: getattr(cuda_sampling, name) for name in (
            "COMPILED_CHUNK", "MAX_CHUNKS", "PROBE_LANES", "CANDIDATES", "PASSES",
            "CUT_STATE_BYTES")}
