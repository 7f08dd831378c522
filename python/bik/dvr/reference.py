"""The ground truth of a deterministic request: decoded alone, one token per forward, on bik
kernels. It shares nothing with the engine but the model, the kernels and the sampler."""

from __future__ import annotations

import torch

from bik.dvr.blocks import blocks_for
from bik.dvr.requests import Request, RequestOutput, Status
from bik.dvr.sampling import kernels_backend, sample_rows
from bik.dvr.step import KVCache, build_step

__all__ = ["reference_decode"]


def reference_decode(model, req: Request, kernels, *, block_size: int = 16,
                     device: torch.device | str = "cpu",
                     dtype: torch.dtype = torch.float32) -> RequestOutput:
    """Prefill the prompt whole, then decode one token at a time, stopping at EOS or
    max_new_tokens, exactly as the request's sampling parameters say, sampling on the kernels'
    backend (bik.dvr.sampling.kernels_backend)."""
    device = torch.device(device)
    total = len(req.prompt) + req.max_new_tokens
    blocks = list(range(blocks_for(total, block_size)))
    cache = KVCache.allocate(model.config, len(blocks), block_size, dtype, device)
    tokens = list(req.prompt)
    out = RequestOutput(req.request_id, status=Status.FINISHED)
    span_start = 0
    while True:
        span = tokens[span_start:]
        step = build_step([len(span)], [len(tokens)], [blocks], block_size, device)
        logits = model.forward(
            torch.tensor(span, dtype=torch.int64, device=device),
            torch.arange(span_start, len(tokens), dtype=torch.int64, device=device),
            step, cache, kernels, torch.tensor([len(span) - 1], device=device))
        (tok,), (lp,) = sample_rows(logits, [req.sampling], [len(tokens)],
                                   sample=model.sample, backend=kernels_backend(kernels))
        out.tokens.append(tok)
        out.logprobs.append(lp)
        span_start = len(tokens)
        tokens.append(tok)
        if tok in req.eos_token_ids:
            out.finish_reason = "eos"
            return out
        if len(out.tokens) >= req.max_new_tokens:
            out.finish_reason = "length"
            return out
