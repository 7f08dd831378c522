"""What a client submits to the decode-verify-rollback engine and what it gets back."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from enum import Enum

__all__ = ["Request", "RequestOutput", "SamplingParams", "Status"]


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling, applied by bik.sample / bik.verify_draft.

    temperature 0 is greedy. top_k <= 0 (or >= V), top_p 1 and min_p 0 are off; they filter in
    that order (bik.sample). The noise is keyed by (seed, absolute position, token id), so a
    rolled-back position is re-drawn with the same noise and needs no RNG state.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    min_p: float = 0.0

    def __post_init__(self):
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"SamplingParams: temperature must be finite and >= 0, got "
                             f"{self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams: top_p must be in (0, 1], got {self.top_p}")
        if (isinstance(self.min_p, bool) or not isinstance(self.min_p, (int, float))
                or not 0 <= self.min_p <= 1):
            raise ValueError(f"SamplingParams: min_p must be in [0, 1], got {self.min_p!r}")
        for name, lo, hi in (("seed", 0, 2**64), ("top_k", -(2**63), 2**63)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value < hi:
                raise ValueError(f"SamplingParams: {name} must be an int in [{lo}, {hi}), got "
                                 f"{value!r}")


@dataclass(frozen=True)
class Request:
    """A generation request. ``deterministic`` requests are verified on bik kernels, so their
    output equals the request decoded alone; the others take the fast path's tokens as is."""

    request_id: str
    prompt: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    deterministic: bool = True
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if len(self.prompt) == 0:
            raise ValueError(f"Request {self.request_id!r}: empty prompt")
        if self.max_new_tokens < 1:
            raise ValueError(f"Request {self.request_id!r}: max_new_tokens must be >= 1, got "
                             f"{self.max_new_tokens}")
        object.__setattr__(self, "prompt", _token_ids(self.request_id, "prompt", self.prompt))
        object.__setattr__(self, "eos_token_ids",
                           _token_ids(self.request_id, "eos_token_ids", self.eos_token_ids))


def _token_ids(request_id: str, name: str, tokens) -> tuple[int, ...]:
    """Token ids as ints, refusing what ``int()`` would silently change (3.7 -> 3, a string's
    characters, bools); the vocabulary bound is checked by the engine, which knows it."""
    if isinstance(tokens, (str, bytes)):
        raise TypeError(f"Request {request_id!r}: {name} must be token ids, got a string")
    out = []
    for t in tokens:
        try:
            token = operator.index(t)  # ints and integer scalars; not floats
        except TypeError:
            token = None
        if token is None or isinstance(t, bool):
            raise TypeError(f"Request {request_id!r}: {name} holds {t!r}, not a token id")
        if token < 0:
            raise ValueError(f"Request {request_id!r}: {name} holds a negative token id {t}")
        out.append(token)
    return tuple(out)


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    CANCELLED = "cancelled"


@dataclass
class RequestOutput:
    """The committed (streamed) part of a request: tokens and their log-probabilities."""

    request_id: str
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "eos", "length", "cancelled" or "invalid_logits"
