"""The engine's calls into bik's sampler: per-row parameters as tensors, windows padded to one
shape for bik.verify_draft. Every row is drawn with the noise of its own (seed, position), so
padding and grouping change no token. ``backend`` is the backend of the kernels whose logits
are drawn from (:func:`kernels_backend`): a verifier on ``BikKernels(backend="cuda")`` samples
and verifies on "cuda" too, and an explicit backend that cannot run raises."""

from __future__ import annotations

from collections.abc import Sequence

import torch

import bik
from bik.dvr.requests import SamplingParams
from bik.ops.sampling.noise import seed_int64

__all__ = ["kernels_backend", "sample_rows", "verify_windows"]


def kernels_backend(kernels) -> str | None:
    """The backend a kernel set runs bik's ops on (BikKernels.backend); None for a set that
    names none (FastKernels: the sampler picks by device)."""
    return getattr(kernels, "backend", None)


def _param_tensors(params: Sequence[SamplingParams], positions: Sequence[int], device):
    """The sampler's per-row tensors, and its host metadata: SamplingParams checked its values
    on the host, so the op need not read them back to check them again."""
    return {
        "max_top_k": max((max(p.top_k, 0) for p in params), default=0),
        "any_top_p": any(p.top_p < 1 for p in params),  # True is always safe (fp32 rounding)
        "seed": torch.tensor([seed_int64(p.seed) for p in params], dtype=torch.int64,
                             device=device),
        "position": torch.tensor(list(positions), dtype=torch.int64, device=device),
        "temperature": torch.tensor([p.temperature for p in params], dtype=torch.float32,
                                 device=device),
        "top_k": torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
        "top_p": torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
        "min_p": torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
    }


def sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams],
                positions: Sequence[int], *, sample=bik.sample,
                backend: str | None = None) -> tuple[list[int], list[float]]:
    """One token per row of ``logits`` [B, V]; row b is the token at absolute position
    positions[b] of its sequence. ``sample``: the model's sampler (bik.sample's signature);
    ``backend``: passed to it."""
    out = sample(logits, **_param_tensors(params, positions, logits.device), backend=backend)
    return out.tokens.tolist(), out.logprobs.tolist()


def verify_windows(windows: Sequence[torch.Tensor], drafts: Sequence[Sequence[int]],
                   params: Sequence[SamplingParams], positions: Sequence[int], *,
                   verify=bik.verify_draft, backend: str | None = None):
    """Verify each request's proposed tokens against the verifier's logits.

    windows[b]: [len(drafts[b]) + 1, V] logits for positions positions[b] ... onwards.
    Returns per request (num_accepted, tokens, logprobs) where tokens are the accepted
    proposals followed by the verifier's own token at the first mismatch (or the bonus token).
    ``verify``: the model's verifier (bik.verify_draft's signature); ``backend``: passed to it.
    """
    rows = len(windows)
    k_max = max(len(d) for d in drafts)
    vocab = windows[0].shape[-1]
    device = windows[0].device
    logits = torch.zeros((rows, k_max + 1, vocab), dtype=torch.float32, device=device)
    draft_tokens = torch.zeros((rows, k_max), dtype=torch.int64, device=device)
    for b, (w, d) in enumerate(zip(windows, drafts)):
        logits[b, :w.shape[0]] = w
        if d:
            draft_tokens[b, :len(d)] = torch.tensor(list(d), dtype=torch.int64)
    num_drafts = torch.tensor([len(d) for d in drafts], dtype=torch.int64, device=device)
    out = verify(draft_tokens, num_drafts, logits, **_param_tensors(params, positions, device),
                 backend=backend)
    accepted = out.num_accepted.tolist()
    tokens, logprobs = out.tokens.tolist(), out.logprobs.tolist()
    return [(a, tokens[b][:a + 1], logprobs[b][:a + 1]) for b, a in enumerate(accepted)]
