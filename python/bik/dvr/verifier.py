"""The engine's verify-and-rollback step: groups of ready deterministic requests replayed in
one forward on the verifier's kernels (exact rows, or LLM-42's fixed shape), their proposals
kept up to the first mismatch by bik.verify_draft, the KV past them freed (a mixin of
bik.dvr.engine.DVREngine)."""

from __future__ import annotations

import itertools
import operator
import time
import warnings

from bik.dvr.requests import RequestOutput
from bik.dvr.sampling import kernels_backend, verify_windows
from bik.dvr.sequence import SequenceState

__all__ = ["Verifier"]


class Verifier:
    """Needs of the engine: model, config, verifier (the verifier's kernels), pool, metrics,
    _running, _is_ready (bik.dvr.scheduler.Scheduler), _forward and _commit."""

    def _verify_ready(self) -> None:
        ready = sorted((s for s in self._running if self._is_ready(s)), key=lambda s: s.order)
        waiting_det = [s for s in self._running if s.req.deterministic and self.config.verify
                       and not s.prefilling and not self._is_ready(s)]
        if not ready or (len(ready) < self.config.group and waiting_det):
            return  # wait for a full group while more requests can still become ready
        for start in range(0, len(ready), self.config.group):
            self._verify_group(ready[start:start + self.config.group])

    def _verify_group(self, group: list[SequenceState]) -> None:
        t0 = time.perf_counter()
        proposals = []
        for seq in group:
            unverified = seq.tokens[seq.boundary:]
            drafts = self._drafts(seq, unverified)
            proposals.append(unverified + drafts)
            self.metrics.drafted += len(drafts)
        # Rows: the last committed token, then every proposal (whose logits score the next).
        spans = [(seq, [seq.tokens[seq.boundary - 1]] + prop)
                 for seq, prop in zip(group, proposals)]
        for seq, _ in spans:  # the verifier rewrites the fast path's KV from the boundary on
            seq.kv_len = seq.boundary - 1
        logits, rows = self._verifier_forward(spans)
        windows = [logits[r0:r0 + len(span)] for (r0, (_, span)) in zip(rows, spans)]
        verdicts = verify_windows(windows, proposals, [s.req.sampling for s in group],
                                  [s.boundary for s in group], verify=self.model.verify_draft,
                                  backend=kernels_backend(self.verifier))
        for seq, prop, (accepted, toks, lps) in zip(group, proposals, verdicts):
            fast = seq.unverified
            self.metrics.windows += 1
            self.metrics.drafts_accepted += max(0, accepted - fast)
            if accepted < fast:
                self.metrics.rollbacks += 1
                self.metrics.rolled_back_tokens += fast - accepted
            del seq.tokens[seq.boundary:]
            seq.tokens.extend(toks)
            seq.unverified_logprobs.clear()
            # KV is valid for the boundary token and the accepted proposals, which the
            # verifier fed with the committed context; the rest is discarded.
            seq.kv_len = seq.boundary + accepted
            self.pool.shrink(seq.blocks, seq.kv_len, self.config.block_size)
            self._commit(seq, toks, lps)
        self.metrics.verify_s += time.perf_counter() - t0
        self.metrics.verify_passes += 1

    def _drafts(self, seq: SequenceState, unverified: list[int]) -> list[int]:
        drafter = self.config.drafter
        if drafter is None or seq.ends_within(unverified):
            return []
        # At most num_tokens: the step's block reservation and the fixed shape count on it.
        room = min(seq.req.max_new_tokens - seq.committed - len(unverified) - 1,
                   drafter.num_tokens)
        if room <= 0:
            return []
        try:  # a copy of the tokens, and never more than room read from what it returns
            proposed = drafter.propose(list(seq.tokens), limit=room)
            drafts = [operator.index(t) for t in itertools.islice(proposed, room)]
            if any(isinstance(t, bool) for t in drafts):
                raise TypeError("a draft token is a bool")
        except Exception as exc:  # noqa: BLE001 - a drafter's failure must not stop a step
            self.metrics.drafter_errors += 1
            if self.metrics.drafter_errors == 1:
                warnings.warn(f"DVREngine: the drafter raised for request "
                              f"{seq.req.request_id!r} ({type(exc).__name__}: {exc}); that "
                              f"window is verified without drafts (counted in "
                              f"metrics.drafter_errors, warned once)", RuntimeWarning,
                              stacklevel=5)
            return []
        vocab = self.model.config.vocab_size
        return drafts if all(0 <= t < vocab for t in drafts) else []  # a bad draft: none

    def _verifier_forward(self, spans):
        """The verifier's pass; returns (logits of the real rows, first row of each span)."""
        if self.config.verifier == "exact":
            logits = self._forward(self.verifier, spans, last_only=False)
        else:
            logits = self._fixed_shape_forward(spans)
        rows, r0 = [], 0
        for _, span in spans:
            rows.append(r0)
            r0 += len(span)
        self.metrics.verify_rows += self.metrics.last_rows
        return logits, rows

    def _fixed_shape_forward(self, spans):
        """LLM-42's fixed shape: every request padded with dummy tokens to R rows and dummy
        requests up to N, R = K + drafts + 1. The dummy rows write K/V past the request's
        window (freed right after) or into scratch blocks; bik's kernels make them harmless."""
        drafts = self.config.drafter.num_tokens if self.config.drafter else 0
        width = self.config.window + drafts + 1
        padded = [(seq, span + [0] * (width - len(span))) for seq, span in spans]
        dummies = []
        for _ in range(self.config.group - len(spans)):
            dummy = SequenceState(spans[0][0].req, RequestOutput("dummy"), order=-1,
                              tokens=[0] * width)
            dummies.append(dummy)
            padded.append((dummy, dummy.tokens))
        keep = [i * width + j for i, (_, span) in enumerate(spans) for j in range(len(span))]
        try:
            logits = self._forward(self.verifier, padded, last_only=False, rows_wanted=keep)
        finally:
            for dummy in dummies:
                self.pool.free(dummy.blocks)
        return logits
