"""Counters of one engine run and the rates derived from them (``bik dvr`` prints these)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["EngineMetrics"]


@dataclass
class EngineMetrics:
    committed_tokens: int = 0  # streamed to clients (verified, or from unverified requests)
    fast_tokens: int = 0  # tokens the fast path proposed or produced
    fast_passes: int = 0
    prefill_tokens: int = 0
    verify_passes: int = 0
    verify_rows: int = 0  # rows the verifier computed, padding included
    windows: int = 0  # request windows verified
    rollbacks: int = 0  # windows in which a fast-path token was rejected
    rolled_back_tokens: int = 0  # fast-path tokens discarded (recomputed)
    forced_mismatches: int = 0
    drafted: int = 0
    drafts_accepted: int = 0
    drafter_errors: int = 0  # drafter calls that raised (that window went without drafts)
    preemptions: int = 0  # running requests sent back to wait (KV freed, recomputed later)
    wall_s: float = 0.0
    fast_s: float = 0.0
    verify_s: float = 0.0
    prefill_s: float = 0.0
    last_rows: int = 0  # rows of the latest forward (bookkeeping for verify_rows)

    @staticmethod
    def _ratio(a: float, b: float) -> float:
        return a / b if b else 0.0

    def summary(self) -> dict[str, float]:
        """Counters plus: committed and fast-path tokens/s, recompute fraction (rolled-back /
        committed tokens), verifier rows per committed token, rollback rate (per verified
        window), draft acceptance."""
        d = asdict(self)
        d.pop("last_rows")
        d.update(
            committed_tokens_per_s=self._ratio(self.committed_tokens, self.wall_s),
            fast_tokens_per_s=self._ratio(self.fast_tokens, self.fast_s),
            recompute_fraction=self._ratio(self.rolled_back_tokens, self.committed_tokens),
            verify_rows_per_committed=self._ratio(self.verify_rows, self.committed_tokens),
            rollback_rate=self._ratio(self.rollbacks, self.windows),
            draft_acceptance=self._ratio(self.drafts_accepted, self.drafted),
        )
        return d
