"""Inputs the in-process plugin tests share."""

from __future__ import annotations

import dataclasses


def sampling_metadata(temperature, top_k=None, top_p=None, max_num_logprobs=None,
                      device="cpu", **fields):
    """vLLM's SamplingMetadata for rows at these temperatures (0: greedy), nothing else on
    unless ``fields`` sets it; its tensors on ``device``, as vLLM's model runner keeps them."""
    import torch
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    rows = len(temperature)
    zeros = torch.zeros(rows)
    md = SamplingMetadata(
        temperature=torch.tensor(temperature, device=device), all_greedy=max(temperature) == 0,
        all_random=min(temperature) > 0, top_p=top_p, top_k=top_k, generators={},
        max_num_logprobs=max_num_logprobs, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=zeros, presence_penalties=zeros, repetition_penalties=zeros,
        output_token_ids=[], allowed_token_ids_mask=None, bad_words_token_ids={},
        logitsprocs=LogitsProcessors())
    return dataclasses.replace(md, **fields)
