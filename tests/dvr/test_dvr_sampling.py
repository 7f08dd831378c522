"""The engine's sampler (bik.dvr.sampling): it draws on the verifier's backend."""

from __future__ import annotations

import functools

import bik
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

