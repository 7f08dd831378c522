"""Prompt-lookup (n-gram) drafting: propose the tokens that followed the latest earlier
occurrence of the sequence's last n tokens.

The drafter only proposes. The verifier accepts a drafted token iff it equals the target's
Gumbel-max choice at that position (bik.verify_draft), so the output is the same with or
without a drafter, whatever it proposes; a good drafter only saves forward passes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["NgramDrafter"]


@dataclass(frozen=True)
class NgramDrafter:
    """Match the last ``max_ngram`` .. ``min_ngram`` tokens, longest first; propose up to
    ``num_tokens`` tokens that followed the most recent earlier match."""

    num_tokens: int = 4
    max_ngram: int = 3
    min_ngram: int = 1

    def __post_init__(self):
        if self.num_tokens < 1 or not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"NgramDrafter: need num_tokens >= 1 and 1 <= min_ngram <= "
                             f"max_ngram, got {self}")

    def propose(self, tokens: Sequence[int], limit: int | None = None) -> list[int]:
        """Draft tokens to follow ``tokens`` (at most ``limit``, default num_tokens)."""
        want = self.num_tokens if limit is None else min(limit, self.num_tokens)
        n_tok = len(tokens)
        if want <= 0:
            return []
        for n in range(min(self.max_ngram, n_tok - 1), self.min_ngram - 1, -1):
            tail = list(tokens[n_tok - n:])
            for start in range(n_tok - n - 1, -1, -1):  # most recent earlier match first
                if list(tokens[start:start + n]) == tail:
                    follow = tokens[start + n:start + n + want]
                    if follow:
                        return list(follow)
        return []
