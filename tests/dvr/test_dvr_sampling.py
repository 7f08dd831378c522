"""The engine's sampler (bik.dvr.sampling): it draws on the verifier's backend, and
SamplingParams' knobs (min_p here) reach bik.sample / bik.verify_draft unchanged."""

from __future__ import annotations

import functools

import bik
import pytest
import torch
from bik.dvr import DVREngine, EngineConfig, Request, SamplingParams, reference_decode
from bik.dvr.kernels import BikKernels, FastKernels
from bik.dvr.model import embedded_model
from bik.dvr.sampling import sample_rows, verify_windows


@functools.cache
def model():
    return embedded_model(seed=0)


def _spy(monkeypatch, name):
    """Wrap bik.<name> so each call's backend is recorded; the call goes through unchanged."""
    real, seen = getattr(bik, name), []

    def wrapper(*args, **kwargs):
        seen.append(kwargs.get("backend"))
        return real(*args, **kwargs)

    monkeypatch.setattr(bik, name, wrapper)
    return seen


def _run(verify_kernels, req, **cfg):
    eng = DVREngine(model(), EngineConfig(num_blocks=64, block_size=8, **cfg),
                    fast_kernels=FastKernels(), verify_kernels=verify_kernels)
    eng.add_request(req)
    return eng.run()[req.request_id]


def test_the_verifier_samples_and_verifies_on_its_kernels_backend(monkeypatch):
    """A verifier on BikKernels(backend="cpu") used to draw its first token and verify its
    windows with backend=None (the device's default): the sampler ignored the verifier's
    backend. Now every bik.sample of a deterministic prefill and every bik.verify_draft of a
    verifier pass gets it; the fast path's draws (FastKernels name no backend) get None."""
    samples, verifies = _spy(monkeypatch, "sample"), _spy(monkeypatch, "verify_draft")
    req = Request("r", (3, 1, 4, 1, 5), 6, SamplingParams(temperature=0.8, seed=11))
    out = _run(BikKernels(backend="cpu"), req, window=2, group=1, mismatch_rate=0.5)
    assert verifies and set(verifies) == {"cpu"}
    assert samples[0] == "cpu"  # the deterministic prefill's token, on the verifier's kernels
    assert set(samples[1:]) <= {None}  # fast-path decodes
    samples.clear()
    ref = reference_decode(model(), req, BikKernels(backend="cpu"))
    assert samples and set(samples) == {"cpu"}
    assert (out.tokens, out.logprobs) == (ref.tokens, ref.logprobs)


def test_sample_rows_and_verify_windows_pass_their_backend_through(monkeypatch):
    samples, verifies = _spy(monkeypatch, "sample"), _spy(monkeypatch, "verify_draft")
    logits = torch.randn(2, 16, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.7, seed=1), SamplingParams()]
    sample_rows(logits, params, [3, 4], sample=bik.sample, backend="cpu")
    verify_windows([logits, logits[:1]], [[5], []], params, [3, 4], verify=bik.verify_draft,
                   backend="cpu")
    assert samples == ["cpu"] and verifies == ["cpu"]


def test_min_p_leaves_one_candidate_and_the_draw_is_that_token():
    """Token 0 is e^5 ~ 148 times likelier than each other token: min_p 0.5 removes every
    other one, so every seed draws token 0 with logprob 0; without min_p some seeds do not."""
    logits = torch.zeros(64, 16)
    logits[:, 0] = 5.0
    positions = list(range(64))
    on = [SamplingParams(temperature=1.0, seed=s, min_p=0.5) for s in range(64)]
    off = [SamplingParams(temperature=1.0, seed=s) for s in range(64)]
    toks, lps = sample_rows(logits, on, positions)
    assert toks == [0] * 64 and lps == [0.0] * 64
    assert set(sample_rows(logits, off, positions)[0]) != {0}
    # verify_windows: the draft 0 is accepted at every seed under min_p, and so is the bonus
    windows = [logits[:2]] * 64
    verdicts = verify_windows(windows, [[0]] * 64, on, positions)
    assert all(v == (1, [0, 0], [0.0, 0.0]) for v in verdicts)


def _bik_sample_decode(req, kernels):
    """req decoded alone with bik.sample called directly at (seed, position, min_p): each
    position's logits from a prefill of everything before it."""
    from bik.dvr.step import KVCache, build_step

    m, p, tokens, out = model(), req.sampling, list(req.prompt), []
    while len(out) < req.max_new_tokens:
        blocks = list(range(len(tokens) // 8 + 1))
        cache = KVCache.allocate(m.config, len(blocks), 8, torch.float32, "cpu")
        step = build_step([len(tokens)], [len(tokens)], [blocks], 8, "cpu")
        logits = m.forward(torch.tensor(tokens), torch.arange(len(tokens)), step, cache, kernels,
                           torch.tensor([len(tokens) - 1]))
        s = bik.sample(logits, seed=p.seed, position=len(tokens), temperature=p.temperature,
                       top_k=p.top_k, top_p=p.top_p, min_p=p.min_p)
        out.append((s.tokens.item(), s.logprobs.item()))
        tokens.append(out[-1][0])
    return [t for t, _ in out], [lp for _, lp in out]


def test_dvr_output_with_min_p_is_bik_sample_at_the_same_seed_position_and_min_p():
    """min_p reaches bik.sample / bik.verify_draft: the engine's committed tokens and logprobs
    (windows verified, forced rollbacks) equal bik.sample's at each (seed, position, min_p),
    and they are not the tokens drawn without min_p."""
    kernels = BikKernels()
    sampling = SamplingParams(temperature=1.5, seed=5, min_p=0.3)
    req = Request("m", (7, 8, 9), 12, sampling)
    out = _run(kernels, req, window=3, group=1, mismatch_rate=0.4)
    assert (out.tokens, out.logprobs) == _bik_sample_decode(req, kernels)
    plain = Request("m", (7, 8, 9), 12, SamplingParams(temperature=1.5, seed=5))
    assert _run(kernels, plain, window=3, group=1).tokens != out.tokens


@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan"), float("inf"), True, "0.5"])
def test_a_min_p_outside_0_1_is_refused(value):
    with pytest.raises(ValueError, match=r"SamplingParams: min_p must be in \[0, 1\], got "):
        SamplingParams(min_p=value)
    for ok in (0, 0.0, 0.25, 1.0):
        assert SamplingParams(min_p=ok).min_p == ok
