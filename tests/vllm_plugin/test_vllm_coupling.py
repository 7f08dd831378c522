"""The plugin's speculative-decoding verifier (spec_verify.py) in-process, no engine: Gumbel
coupling emits plain decoding's tokens and logprobs whatever the draft, and what it refuses.
The engine-level promise (every drafter, the real checkpoint) is tests/vllm_plugin/
test_vllm_spec.py."""

from __future__ import annotations

import types

import pytest

vllm = pytest.importorskip("vllm")

import torch
from plugin_inputs import sampling_metadata

from bik.integrations.vllm import spec_verify
from bik.integrations.vllm.sampler import BikSampler, keyed

VOCAB = 64
TEMPERATURE = [0.8, 0.0, 1.0]  # per request: sampled, greedy, sampled
SEED, POSITION = torch.tensor([5, 6, 7]), torch.tensor([40, 3, 17])


def _spec_metadata(drafts: list[list[int]]):
    """vLLM's SpecDecodeMetadata for these drafts, the indices as its model runner lays them."""
    import numpy as np
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    k = np.array([len(d) for d in drafts])
    sampled = np.cumsum(k + 1)
    starts = sampled - (k + 1)
    target = np.concatenate([s + np.arange(n) for s, n in zip(starts, k)]).astype(np.int64)
    return SpecDecodeMetadata(
        draft_token_ids=torch.tensor(sum(drafts, []), dtype=torch.int32),
        num_draft_tokens=k.tolist(), cu_num_draft_tokens=torch.from_numpy(np.cumsum(k)),
        cu_num_sampled_tokens=torch.from_numpy(sampled),
        target_logits_indices=torch.from_numpy(target),
        bonus_logits_indices=torch.from_numpy(sampled - 1),
        logits_indices=torch.arange(int(sampled[-1])))


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]  # cuda: tools/device_check.sh


def _plain(logits: torch.Tensor, lengths: list[int]):
    """Plain decoding's token and logprob at every verify row: each row drawn alone by the
    plugin's sampler, keyed (request seed, request position + row)."""
    tokens, logprobs, row = [], [], 0
    sampler = BikSampler()
    for r, n in enumerate(lengths):
        for i in range(n):
            keys = (SEED[r:r + 1], POSITION[r:r + 1] + i)
            with keyed(sampler, keys):
                out = sampler(logits[row:row + 1].clone(),
                              sampling_metadata([TEMPERATURE[r]], max_num_logprobs=1,
                                                device=logits.device))
            tokens.append(int(out.sampled_token_ids[0, 0]))
            logprobs.append(out.logprobs_tensors.logprobs[0])
            row += 1
    return tokens, logprobs


def _verify(verifier, logits, drafts):
    md = _spec_metadata(drafts)
    with keyed(verifier.sampler, (SEED, POSITION)):
        out = verifier(md, None, logits.clone(), sampling_metadata(
            TEMPERATURE, max_num_logprobs=1, device=logits.device))
    return out, md


def _rows(tokens: list[int], drafts: list[list[int]]) -> list[list[int]]:
    """Plain decoding's tokens split into each request's verify rows."""
    out, at = [], 0
    for d in drafts:
        out.append(tokens[at:at + len(d) + 1])
        at += len(d) + 1
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["exact", "first_wrong", "second_wrong", "random"])
def test_coupling_emits_plain_decodings_tokens_and_logprobs(kind, device):
    """Whatever the drafts, each request's output is plain decoding's tokens up to and including
    the first row whose draft differs (or the bonus row), with plain decoding's logprobs."""
    torch.manual_seed(0)
    lengths = [4, 1, 3]  # k = 3, 0 and 2 drafts
    logits = (torch.randn(sum(lengths), VOCAB) * 2).to(device)
    plain, plain_lp = _plain(logits, lengths)
    rows = _rows(plain, [[0] * (n - 1) for n in lengths])
    drafts = {"exact": [r[:-1] for r in rows],
              "first_wrong": [[(r[0] + 1) % VOCAB, *r[1:-1]] if len(r) > 1 else []
                              for r in rows],
              "second_wrong": [[r[0], (r[1] + 1) % VOCAB, *r[2:-1]] if len(r) > 2
                               else r[:-1] for r in rows],
              "random": [torch.randint(0, VOCAB, (len(r) - 1,)).tolist() for r in rows]}[kind]
    out, _ = _verify(spec_verify.BikRejectionSampler(BikSampler()), logits, drafts)
    width = out.sampled_token_ids.shape[1]
    lp = out.logprobs_tensors.logprobs.view(len(lengths), width, -1)
    for r, (want, draft) in enumerate(zip(rows, drafts)):
        accepted = next((i for i, (d, t) in enumerate(zip(draft, want)) if d != t), len(draft))
        got = out.sampled_token_ids[r].tolist()
        assert out.sampled_token_ids.device == logits.device
        assert got == want[:accepted + 1] + [-1] * (width - accepted - 1), (r, got, want)
        first = sum(lengths[:r])
        for j in range(accepted + 1):
            assert torch.equal(lp[r, j], plain_lp[first + j])
    if kind == "exact":
        assert out.sampled_token_ids.ne(-1).sum() == sum(lengths)


def test_a_verifier_keyed_by_verify_row_is_caught():
    """Control: the same coupling with each row's noise keyed by its place in the verify step
    (position 0 for the row after the newest token), not by absolute position, emits other
    tokens than plain decoding, which the comparison above catches. (vLLM's own ratio rule is
    the control in test_vllm_spec.py, on an engine: its Triton kernels need one.)"""
    torch.manual_seed(0)
    lengths = [4, 1, 3]
    logits = torch.randn(sum(lengths), VOCAB) * 2
    plain, _ = _plain(logits, lengths)
    rows = _rows(plain, [[0] * (n - 1) for n in lengths])
    verifier = spec_verify.BikRejectionSampler(BikSampler())
    md = _spec_metadata([r[:-1] for r in rows])
    with keyed(verifier.sampler, (SEED, torch.zeros_like(POSITION))):
        out = verifier(md, None, logits.clone(), sampling_metadata(TEMPERATURE))
    got = [[t for t in row if t != -1] for row in out.sampled_token_ids.tolist()]
    assert got != rows


def test_accepted_counts_is_the_leading_run_of_matches():
    num_drafts = torch.tensor([3, 0, 2, 1])
    counts = num_drafts + 1
    req = torch.repeat_interleave(torch.arange(4), counts)
    offset = torch.arange(int(counts.sum())) - (torch.cumsum(counts, 0) - counts)[req]
    target = torch.tensor([1, 2, 3, 4, 9, 5, 6, 7, 8, 8])
    draft = torch.tensor([1, 0, 3, 5, 6, 2])  # match, miss, match | - | match, match | miss
    assert spec_verify.accepted_counts(draft, target, num_drafts, req,
                                       offset).tolist() == [1, 0, 2, 0]


@pytest.mark.parametrize("fields, what", [
    ({"method": "eagle3"}, "speculative method 'eagle3'"),
    ({"method": "medusa"}, "speculative method 'medusa'"),
    ({"method": "mtp"}, "speculative method 'mtp'"),
    ({"method": "custom_class"}, "speculative method 'custom_class'"),
    ({"method": "suffix"}, "speculative method 'suffix'"),
    ({"rejection_sample_method": "synthetic"}, "rejection_sample_method='synthetic'"),
    ({"rejection_sample_method": "block"}, "rejection_sample_method='block'"),
    ({"parallel_drafting": True}, "parallel drafting"),
    ({"use_heterogeneous_vocab": True}, "another vocabulary"),
    ({"enable_adaptive_verification": True}, "adaptive verification"),
])
def test_speculative_configs_bik_does_not_serve_are_refused(fields, what):
    config = types.SimpleNamespace(**({"method": "ngram", "rejection_sample_method": "standard",
                                       "parallel_drafting": False,
                                       "use_heterogeneous_vocab": False,
                                       "enable_adaptive_verification": False} | fields))
    with pytest.raises(NotImplementedError, match=f"bik.integrations.vllm: .*{what}"):
        spec_verify.BikRejectionSampler(BikSampler(), config)


def _min_p_on():
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor

    proc = MinPLogitsProcessor.__new__(MinPLogitsProcessor)
    proc.min_p_count = 1
    return LogitsProcessors([proc])


@pytest.mark.parametrize("fields, what", [
    ({"no_penalties": False}, "penalties"),
    ({"bad_words_token_ids": {0: [[3]]}}, "bad_words"),
    ({"allowed_token_ids_mask": torch.zeros(3, VOCAB, dtype=torch.bool)}, "allowed_token_ids"),
    ({"logprob_token_ids": {0: [3]}}, "logprob_token_ids"),
    ({"logitsprocs": "min_p"}, "min_p"),
])
def test_requests_the_verifier_cannot_reproduce_are_refused(fields, what):
    if fields.get("logitsprocs") == "min_p":
        fields = {"logitsprocs": _min_p_on()}
    verifier = spec_verify.BikRejectionSampler(BikSampler())
    md = _spec_metadata([[1], [], [2, 3]])
    with keyed(verifier.sampler, (SEED, POSITION)), \
            pytest.raises(NotImplementedError, match=f"bik.integrations.vllm: .*{what}"):
        verifier(md, None, torch.zeros(6, VOCAB), sampling_metadata(TEMPERATURE, **fields))


@pytest.mark.parametrize("params, what", [
    ({"repetition_penalty": 1.2}, "repetition_penalty=1.2"),
    ({"presence_penalty": 0.5}, "presence_penalty=0.5"),
    ({"frequency_penalty": -0.5}, "frequency_penalty=-0.5"),
    ({"min_p": 0.1}, "min_p=0.1"),
    ({"min_tokens": 3}, "min_tokens=3"),
    ({"logit_bias": {3: 1.0}}, "logit_bias="),
    ({"bad_words": ["x"]}, "bad_words="),
    ({"allowed_token_ids": [1, 2]}, "allowed_token_ids="),
])
def test_a_request_asking_what_the_verifier_cannot_serve_is_refused_at_admission(params, what):
    from vllm import SamplingParams

    with pytest.raises(ValueError, match=f"bik.integrations.vllm: speculative .*{what}"):
        spec_verify.refuse_params(SamplingParams(**params))
    spec_verify.refuse_params(SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=3,
                                             logprobs=2))


def test_draft_kernels_are_bik_or_stock(monkeypatch):
    from bik.integrations.vllm import spec_draft

    monkeypatch.setenv("BIK_VLLM_DRAFT_KERNELS", "fast")
    with pytest.raises(ValueError, match="BIK_VLLM_DRAFT_KERNELS='fast'; expected one of"):
        spec_draft._kernels()
    monkeypatch.setattr(spec_draft, "KERNELS", "stock")
    assert not spec_draft.drafting_on_stock()  # only while the draft model runs
    with spec_draft._flag(spec_draft._ACTIVE):
        assert spec_draft.drafting_on_stock()
    monkeypatch.setattr(spec_draft, "KERNELS", "bik")
    with spec_draft._flag(spec_draft._ACTIVE):
        assert not spec_draft.drafting_on_stock()
