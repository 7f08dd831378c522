"""bik.sample's promises on each backend: batch invariance, greedy, invalid rows, the filters.

Targets: the CPU backend and the Triton kernels run on the CPU by TRITON_INTERPRET=1 (their own
process; see tests/matmul/test_matmul.py for what the interpreter can and cannot prove),
each at the sizes it affords. A row's token and logprob bits are the same alone and inside any
batch (the M sweep, a probe at every position among neighbours with other filters and
temperatures, any permutation), on random and on near-tie logits; the same harness rejects a
sampler keyed by the batch row (negative control); the CPU's thread count changes no bit.
Greedy is the first maximal token, and half-precision logits sample as their fp32 upcast;
invalid rows give token -1 / logprob NaN and leave their neighbours alone; top-k, min-p and
top-p keep what they promise.
"""

from __future__ import annotations

import math

import bik
import pytest
import torch
from bik.ops._normaliser import bik_log_torch
from bik.ops.sampling import cpu as cpu_sampling
from bik.testing import probe_every_position, rows_alone_vs_batched
from sampler_inputs import requests, sampler
from targets import targets


def _invariance_sizes(target, near_ties: bool):
    """(vocabulary, batch sizes, probe batch). The interpreter's vocabulary of 150 crosses two
    pick programs (SPLIT = 128)."""
    if near_ties:
        return (33, (1, 2, 5), 3) if target.small else (33, (1, 2, 5, 17, 64), 20)
    if target.small:
        return 150, (1, 3, 11), 6
    return 100, (1, 2, 3, 4, 7, 8, 16, 31, 64, 127, 128, 255, 256, 300), 40


@pytest.mark.parametrize("target", targets())
@pytest.mark.parametrize("near_ties", [False, True], ids=["random", "near_ties"])
def test_batch_invariance(target, near_ties, gen):
    v, ms, probe_batch = _invariance_sizes(target, near_ties)
    table = requests(max(ms) + probe_batch + 1, v, gen, near_ties=near_ties)
    fn = sampler(target.backend, table)
    pool = torch.arange(max(ms))[:, None]
    report = rows_alone_vs_batched(fn, pool, ms, name=f"sample[{target}]")
    assert report.ok, report.summary()
    probe = torch.tensor([[max(ms)]])
    neighbours = torch.arange(max(ms) + 1, max(ms) + 1 + probe_batch)[:, None]
    report = probe_every_position(fn, probe, neighbours, name=f"sample[{target}] probe")
    assert report.ok, report.summary()
    # Any permutation of the batch permutes the outputs and nothing else.
    perm = torch.randperm(max(ms), generator=gen)
    assert torch.equal(fn(pool)[perm], fn(pool[perm]))


def test_row_keyed_reference_is_rejected(gen):
    """Negative control: the same harness rejects a sampler keyed by the batch row."""
    from bik.testing import row_keyed_sample

    logits = torch.randn(64, 50, generator=gen)

    def fn(idx):
        return row_keyed_sample(logits[idx[:, 0]], seed=7)[:, None]

    report = rows_alone_vs_batched(fn, torch.arange(64)[:, None], (1, 2, 7, 64))
    assert not report.ok and len(report.mismatches) > 10, report.summary()


@pytest.mark.parametrize("target", targets("cpu"))
def test_threads_do_not_change_bits(target, gen):
    t = requests(600, 1000, gen)  # B*V >= 4 * 2**17: the kernel really uses several threads
    args = [t["seed"], t["position"], t["temperature"], t["top_k"], t["top_p"],
            bik_log_torch(t["min_p"].clamp(min=1e-30)).where(t["min_p"] > 0,
                                                             torch.tensor(-math.inf))]
    one = cpu_sampling.sample_cpu(t["logits"], *args, num_threads=1)
    for threads in (2, 3, 4):
        many = cpu_sampling.sample_cpu(t["logits"], *args, num_threads=threads)
        assert torch.equal(one[0], many[0]) and torch.equal(one[1].view(torch.int32),
                                                            many[1].view(torch.int32))


@pytest.mark.parametrize("target", targets())
def test_greedy(target, gen):
    backend, rows = target.backend, 12 if target.small else 40
    x = torch.randint(-2, 3, (rows, 33), generator=gen).float()  # many exact ties
    x[3] = 1.0  # a row that is all ties
    out = bik.sample(x, seed=1, position=0, temperature=0.0, backend=backend)
    ref = torch.stack([(row == row.max()).nonzero()[0, 0] for row in x])
    assert torch.equal(out.tokens, ref)
    assert torch.allclose(out.logprobs, torch.log_softmax(x, 1).gather(1, ref[:, None])[:, 0],
                          atol=1e-6)
    for dtype in (torch.bfloat16, torch.float16):
        xh = torch.randn(rows // 2, 70, generator=gen).to(dtype)
        for t in (0.0, 0.8):
            a = bik.sample(xh, seed=3, position=5, temperature=t, top_k=9, backend=backend)
            b = bik.sample(xh.float(), seed=3, position=5, temperature=t, top_k=9,
                           backend=backend)
            assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)


@pytest.mark.parametrize("target", targets())
def test_invalid_rows(target, gen):
    backend = target.backend
    x = torch.randn(6, 40, generator=gen)
    x[1, 7] = float("nan")
    x[2] = float("-inf")
    x[3, 0] = float("inf")
    x[4, :] = float("-inf")
    x[4, 11] = 2.0  # a single finite token: always chosen, logprob 0
    out = bik.sample(x, seed=5, position=3, backend=backend)
    assert out.tokens[1:4].tolist() == [-1, -1, -1]
    assert torch.isnan(out.logprobs[1:4]).all()
    assert out.tokens[4] == 11 and out.logprobs[4] == 0.0
    for r in (0, 5):  # neighbours unaffected
        alone = bik.sample(x[r:r + 1], seed=5, position=3, backend=backend)
        assert alone.tokens[0] == out.tokens[r] and alone.logprobs[0] == out.logprobs[r]
    # The filters always keep the max, so only a row without a finite logit is all-masked:
    y = torch.full((1, 5), float("-inf"))
    assert bik.sample(y, seed=0, position=0, top_k=2, backend=backend).tokens.item() == -1


@pytest.mark.parametrize("target", targets())
def test_filters_keep_what_they_promise(target, gen):
    backend, rows, v = target.backend, 24 if target.small else 200, 60
    x = torch.randn(rows, v, generator=gen) * 2
    x[:, 10] = x[:, 11]  # a tie to exercise the top-k boundary
    pos = torch.arange(rows)
    for k in (1, 2, 5):
        tok = bik.sample(x, seed=2, position=pos, top_k=k, backend=backend).tokens
        rank = torch.stack([(x[r] > x[r, tok[r]]).sum() + ((x[r] == x[r, tok[r]])
                            & (torch.arange(v) < tok[r])).sum() for r in range(rows)])
        assert (rank < k).all()
    # min_p: chosen token's probability >= min_p * max probability (at T = 1, in fp64).
    tok = bik.sample(x, seed=2, position=pos, min_p=0.3, backend=backend).tokens
    chosen = x.gather(1, tok[:, None])[:, 0].double()
    assert (chosen - x.double().amax(1) >= math.log(0.3) - 1e-5).all()
    # top_p: the chosen token lies in the nucleus (ties at the boundary kept).
    p = 0.6
    tok = bik.sample(x, seed=2, position=pos, top_p=p, backend=backend).tokens
    probs = torch.softmax(x.double(), 1)
    chosen_p = probs.gather(1, tok[:, None])
    mass_above = (probs * (probs > chosen_p)).sum(1)
    assert (mass_above < p + 1e-6).all()
    # top_k = 1 is greedy whatever the temperature.
    g = bik.sample(x, seed=9, position=pos, top_k=1, temperature=3.0, backend=backend).tokens
    assert torch.equal(g, x.argmax(1))
