"""The engine's scheduling: which requests run in a step, the KV blocks each may take in it,
and which are preempted when the pool cannot hold them (a mixin of bik.dvr.engine.DVREngine).

Each step first reserves the blocks its running requests may take in it (a prefill chunk; or a
decode, a verifier pass over tokens and drafts and the decode after it); waiting requests are
admitted while that fits, and when the running requests' growth does not, the latest admitted
are preempted: blocks freed, unverified tokens dropped, back at the front of the queue.
"""

from __future__ import annotations

from bik.dvr.blocks import blocks_for
from bik.dvr.requests import Request, Status
from bik.dvr.sequence import SequenceState

__all__ = ["Scheduler"]


class Scheduler:
    """Needs of the engine: config (EngineConfig), pool (BlockPool), metrics (EngineMetrics),
    _waiting and _running (lists of SequenceState) and _admitted (admissions so far)."""

    def _lookahead(self) -> int:
        """KV rows past a request's tokens one verifier pass may write: its drafts, or the
        fixed shape's padding."""
        if not self.config.verify:
            return 0
        drafts = self.config.drafter.num_tokens if self.config.drafter else 0
        return self.config.window + drafts + 1 if self.config.verifier == "fixed" else drafts

    def _max_kv(self, req: Request) -> int:
        return len(req.prompt) + req.max_new_tokens + self._lookahead()

    def _dummy_blocks(self) -> int:
        """Blocks the fixed-shape verifier's dummy requests hold during a pass."""
        if self.config.verifier != "fixed" or not self.config.verify:
            return 0
        return (self.config.group - 1) * blocks_for(self._lookahead(), self.config.block_size)

    def _step_blocks(self, seq: SequenceState) -> int:
        """Blocks ``seq`` may add in one step: a prefill chunk; or, once prefilled, a decoded
        token, a verifier pass over its tokens and drafts and a decode after it."""
        if seq.prefilling and self.config.prefill_chunk is not None \
                and seq.kv_len + self.config.prefill_chunk < seq.prefill_target:
            rows = seq.kv_len + self.config.prefill_chunk
        else:
            rows = min(len(seq.tokens) + 1 + self._lookahead(), self._max_kv(seq.req))
        return max(0, blocks_for(rows, self.config.block_size) - len(seq.blocks))

    def _admit(self) -> None:
        """Admit waiting requests while this step's blocks fit, then preempt the latest
        admitted running requests until the running ones' fit (add_request checked that a
        request alone always fits)."""
        reserve = self._dummy_blocks() if self.config.verify else 0
        budget = self.pool.num_free - reserve - sum(self._step_blocks(s) for s in self._running)
        while self._waiting and len(self._running) < self.config.max_running:
            need = self._step_blocks(self._waiting[0])
            if need > budget and self._running:
                break  # it waits for blocks to come back
            seq = self._waiting.pop(0)
            seq.order = self._admitted
            self._admitted += 1
            seq.out.status = Status.RUNNING
            self._running.append(seq)
            budget -= need
        while budget < 0 and len(self._running) > 1:
            victim = max(self._running, key=lambda s: s.order)
            budget += self._step_blocks(victim) + len(victim.blocks)
            self._preempt(victim)

    def _preempt(self, seq: SequenceState) -> None:
        """Free a running request's KV and send it back to the front of the queue; it will
        prefill its prompt and committed tokens again (unverified ones are dropped)."""
        self._running.remove(seq)
        self.pool.free(seq.blocks)
        seq.blocks.clear()
        del seq.tokens[seq.boundary:]
        seq.unverified_logprobs.clear()
        seq.kv_len = 0
        seq.prefill_target = len(seq.tokens)
        seq.out.status = Status.WAITING
        self._waiting.insert(0, seq)
        self.metrics.preemptions += 1

    def _is_ready(self, seq: SequenceState) -> bool:
        if not seq.req.deterministic or seq.prefilling or not self.config.verify:
            return False
        unverified = seq.tokens[seq.boundary:]
        return len(unverified) >= self.config.window or (
            bool(unverified) and seq.ends_within(unverified))
