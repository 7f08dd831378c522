"""The decode-verify-rollback engine's configuration, what it streams, and its state of one
request (bik.dvr.engine drives them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from bik.dvr.drafter import NgramDrafter
from bik.dvr.requests import Request, RequestOutput

__all__ = ["VERIFIERS", "EngineConfig", "SequenceState", "StreamEvent"]

VERIFIERS = ("exact", "fixed")


@dataclass(frozen=True)
class EngineConfig:
    """window: K unverified tokens that make a request ready; group: N requests per verifier
    pass; verifier "exact" replays just the rows it needs, "fixed" pads every pass to
    N x (K + drafts + 1) rows (LLM-42's fixed shape, for comparison: same output, more rows);
    mismatch_rate: fraction of fast-path tokens of deterministic requests replaced by another
    token (forces rollbacks, for tests and overhead curves); verify False turns the verifier off
    (every request then takes the decode kernels' tokens: the fast path alone, or bik-only
    decoding when the decode kernels are bik's)."""

    window: int = 4
    group: int = 4
    verifier: str = "exact"
    drafter: NgramDrafter | None = None
    mismatch_rate: float = 0.0
    mismatch_seed: int = 0
    block_size: int = 16
    num_blocks: int = 512
    max_running: int = 64
    prefill_chunk: int | None = None
    verify: bool = True

    def __post_init__(self):
        if self.window < 1 or self.group < 1:
            raise ValueError(f"EngineConfig: window (K) and group (N) must be >= 1, got "
                             f"K={self.window}, N={self.group}")
        if self.verifier not in VERIFIERS:
            raise ValueError(f"EngineConfig: verifier must be one of {VERIFIERS}, got "
                             f"{self.verifier!r}")
        if not 0.0 <= self.mismatch_rate <= 1.0:
            raise ValueError(f"EngineConfig: mismatch_rate must be in [0, 1], got "
                             f"{self.mismatch_rate}")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ValueError(f"EngineConfig: prefill_chunk must be >= 1, got "
                             f"{self.prefill_chunk}")
        drafts = getattr(self.drafter, "num_tokens", None) if self.drafter is not None else 0
        if isinstance(drafts, bool) or not isinstance(drafts, int) or drafts < 0:
            raise ValueError(f"EngineConfig: the drafter must have an int num_tokens >= 0 (the "
                             f"most tokens it proposes), got {drafts!r}")
        for name in ("block_size", "num_blocks", "max_running"):  # 0 would never make progress
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig: {name} must be >= 1, got "
                                 f"{getattr(self, name)}")


@dataclass(frozen=True)
class StreamEvent:
    """Tokens a request committed in one step (only committed tokens are ever streamed)."""

    request_id: str
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    finished: bool


@dataclass
class SequenceState:
    """The engine's state of one request: its tokens, how many are committed, its KV."""

    req: Request
    out: RequestOutput
    order: int  # admission order: groups and batches are formed in this order
    tokens: list[int] = field(default_factory=list)  # prompt + committed + unverified
    unverified_logprobs: list[float] = field(default_factory=list)
    committed: int = 0  # generated tokens committed
    kv_len: int = 0  # tokens whose K/V is in the cache
    blocks: list[int] = field(default_factory=list)
    prefill_target: int = 0  # tokens to prefill before sampling: the prompt, or after a
    # preemption the prompt and the committed tokens

    @property
    def prompt_len(self) -> int:
        return len(self.req.prompt)

    @property
    def boundary(self) -> int:  # tokens before the first unverified one
        return self.prompt_len + self.committed

    @property
    def unverified(self) -> int:
        return len(self.tokens) - self.boundary

    @property
    def prefilling(self) -> bool:
        return self.kv_len < self.prefill_target

    def ends_within(self, tokens: list[int]) -> bool:
        """Would these generated tokens (after the committed ones) finish the request?"""
        eos = set(self.req.eos_token_ids)
        return (self.committed + len(tokens) >= self.req.max_new_tokens
                or any(t in eos for t in tokens))
