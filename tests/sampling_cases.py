"""Shared test bodies for bik.sample / bik.verify_draft, run on every backend.

A batch's rows are given as indices into a table of requests (logits + parameters), so the
invariance harness can move requests between rows and batches: fn(idx) samples the requests
idx and returns [M, 2] int64 (token, logprob bits).
"""

from __future__ import annotations

import math

import bik
import torch
from bik.testing import probe_every_position, rows_alone_vs_batched
from torch.library import opcheck

PARAM_NAMES = ("seed", "position", "temperature", "top_k", "top_p", "min_p")
G_MIN, G_MAX = -2.8115408420562744, 16.63553237915039  # noise range over all 2^23 u values


def philox_kat():
    """Random123's published Philox4x32-10 known-answer vectors: (counter, key, output)."""
    return [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
         (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
    ]


def all_units() -> torch.Tensor:
    """Every u the sampler can draw: (2i + 1) * 2^-24, i in [0, 2^23)."""
    return (2 * torch.arange(2**23) + 1).float() * 2.0**-24


def requests(n: int, v: int, gen: torch.Generator, *, near_ties: bool = False,
             filters: str = "all") -> dict:
    """n requests with random logits and a mix of sampling parameters per row."""
    if near_ties:
        # Few distinct values plus 1-ulp neighbours: exact ties and near-ties everywhere.
        base = torch.randint(-3, 4, (n, v), generator=gen).float()
        bump = torch.randint(-1, 2, (n, v), generator=gen).float()
        logits = torch.nextafter(base, base + bump)
    else:
        logits = torch.randn(n, v, generator=gen) * 3
    temps = torch.tensor([0.0, 1.0, 0.7, 1.9, 0.05])
    p = {
        "seed": torch.randint(0, 2**63 - 1, (n,), generator=gen),
        "position": torch.randint(0, 2**40, (n,), generator=gen),
        "temperature": temps[torch.randint(0, len(temps), (n,), generator=gen)],
        "top_k": torch.zeros(n, dtype=torch.int64),
        "top_p": torch.ones(n),
        "min_p": torch.zeros(n),
    }
    if filters != "none":
        k_choices = torch.tensor([0, 1, 3, v - 1, v, v + 5, -2])
        p["top_k"] = k_choices[torch.randint(0, len(k_choices), (n,), generator=gen)]
        p["min_p"] = torch.where(torch.rand(n, generator=gen) < 0.3,
                                 torch.rand(n, generator=gen) * 0.5, torch.zeros(n))
    if filters == "all":
        p["top_p"] = torch.where(torch.rand(n, generator=gen) < 0.3,
                                 torch.rand(n, generator=gen) * 0.9 + 0.05, torch.ones(n))
    return {"logits": logits, **p}


def sampler(backend: str, table: dict):
    """fn(idx [M, 1]) -> [M, 2] int64: the requests idx sampled as one batch."""
    def fn(idx: torch.Tensor) -> torch.Tensor:
        i = idx[:, 0]
        out = bik.sample(table["logits"][i], backend=backend,
                         **{k: table[k][i] for k in PARAM_NAMES})
        return torch.stack([out.tokens, out.logprobs.view(torch.int32).to(torch.int64)], 1)
    return fn


def check_batch_invariance(backend: str, v: int, ms, probe_batch: int, gen, **kw) -> None:
    table = requests(max(ms) + probe_batch + 1, v, gen, **kw)
    fn = sampler(backend, table)
    pool = torch.arange(max(ms))[:, None]
    report = rows_alone_vs_batched(fn, pool, ms, name=f"sample[{backend}]")
    assert report.ok, report.summary()
    probe = torch.tensor([[max(ms)]])
    neighbours = torch.arange(max(ms) + 1, max(ms) + 1 + probe_batch)[:, None]
    report = probe_every_position(fn, probe, neighbours, name=f"sample[{backend}] probe")
    assert report.ok, report.summary()
    # Any permutation of the batch permutes the outputs and nothing else.
    perm = torch.randperm(max(ms), generator=gen)
    assert torch.equal(fn(pool)[perm], fn(pool[perm]))


def check_row_keyed_reference_rejected(gen) -> None:
    """Negative control: the same harness rejects a sampler keyed by the batch row."""
    from bik.testing import row_keyed_sample

    logits = torch.randn(64, 50, generator=gen)

    def fn(idx):
        return row_keyed_sample(logits[idx[:, 0]], seed=7)[:, None]

    report = rows_alone_vs_batched(fn, torch.arange(64)[:, None], (1, 2, 7, 64))
    assert not report.ok and len(report.mismatches) > 10, report.summary()


def check_greedy(backend: str, gen, rows: int = 40) -> None:
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


def check_invalid_rows(backend: str, gen) -> None:
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


def check_filters_keep_what_they_promise(backend: str, gen, rows: int = 200) -> None:
    v = 60
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


def check_drafter_invariance(backend: str, v: int, k: int, rows: int, gen,
                             nds=None) -> None:
    """Several drafters, num_drafts 0..K: emitted tokens/logprobs equal sequential sampling."""
    logits = torch.randn(rows, k + 1, v, generator=gen) * 2
    params = {"seed": torch.randint(0, 2**62, (rows,), generator=gen),
                  "position": torch.randint(0, 10**6, (rows,), generator=gen),
                  "temperature": torch.tensor([0.0, 1.0, 0.6, 1.5])[torch.arange(rows) % 4],
                  "top_k": torch.tensor([0, 5, 0, 20])[torch.arange(rows) % 4]}
    seq = [bik.sample(logits[:, j], backend=backend,
                      **(params | {"position": params["position"] + j})) for j in range(k + 1)]
    target = torch.stack([s.tokens for s in seq], 1)
    target_lp = torch.stack([s.logprobs for s in seq], 1)
    q = logits + torch.randn(logits.shape, generator=gen) * 0.5
    same_noise = torch.stack([bik.sample(q[:, j], backend=backend,
                                         **(params | {"position": params["position"] + j})
                                         ).tokens for j in range(k)], 1)
    drafters = {
        "random": torch.randint(0, v, (rows, k), generator=gen),
        "target": target[:, :k],
        "perturbed": torch.where(torch.rand(rows, k, generator=gen) < 0.3,
                                 (target[:, :k] + 1) % v, target[:, :k]),
        "same_noise_q": same_noise,
    }
    for name, drafts in drafters.items():
        for nd in range(k + 1) if nds is None else nds:
            out = bik.verify_draft(drafts, nd, logits, backend=backend, **params)
            acc = out.num_accepted
            assert ((acc >= 0) & (acc <= nd)).all()
            match = (drafts == target[:, :k]).long().cumprod(1)[:, :nd].sum(1)
            assert torch.equal(acc, match), name
            emitted = torch.arange(k + 1)[None, :] <= acc[:, None]
            assert torch.equal(out.tokens[emitted], target[emitted]), (name, nd)
            assert torch.equal(out.logprobs[emitted].view(torch.int32),
                               target_lp[emitted].view(torch.int32)), (name, nd)
            assert (out.tokens[~emitted] == -1).all()
            assert (out.logprobs[~emitted] == float("-inf")).all()
            if name == "target":
                assert torch.equal(acc, torch.full_like(acc, nd))


def check_opcheck(backend: str, gen, filters: str = "all") -> None:
    t = requests(5, 37, gen, filters=filters)
    args = [t[k] for k in PARAM_NAMES]
    opcheck(torch.ops.bik.sample.default, (t["logits"], *args, backend))
    opcheck(torch.ops.bik.sample.default, (t["logits"].to(torch.bfloat16), *args, backend))
    logits3 = torch.randn(5, 4, 37, generator=gen)
    drafts = torch.randint(0, 37, (5, 3), generator=gen)
    nd = torch.tensor([0, 1, 2, 3, 3])
    opcheck(torch.ops.bik.verify_draft.default, (drafts, nd, logits3, *args, backend))
