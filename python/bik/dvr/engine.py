"""The decode-verify-rollback engine (after LLM-42), with bik kernels as the verifier.

One ``step()``:
1. prefill admitted requests (deterministic ones on the verifier's kernels, so their first token
   is committed at once; the others on the fast path);
2. verify: a deterministic request is *ready* when it holds ``window`` (K) unverified tokens or
   its unverified tokens end it (EOS / max tokens). Groups of up to ``group`` (N) ready requests
   are replayed in one forward on the verifier's kernels, each as [last committed token,
   unverified tokens, drafter tokens]; bik.verify_draft keeps the tokens up to the first
   mismatch and appends the verifier's own token; the verifier has overwritten the fast path's
   KV in the same slots, and the KV past the kept tokens is freed;
3. decode every other running request one token with the fast kernels.

Before those, the step reserves the KV blocks each running request may take in it; when the pool
cannot hold them, the latest admitted requests are preempted (their blocks freed, their
unverified tokens dropped) and wait to be recomputed: prompt and committed tokens prefilled
again, which on bik kernels gives the same logits, so the output does not change.

Because bik's kernels are batch-invariant, the verifier's logits for a token do not depend on
the group, the window or the padding, so every deterministic request's committed output is
the request decoded alone on bik kernels (bik.dvr.reference.reference_decode), token for token
and logprob for logprob. Design and measured overheads: docs/design.md (decode-verify-rollback).
"""

from __future__ import annotations

import random
import time

import torch

from bik.dvr.blocks import BlockPool, blocks_for
from bik.dvr.metrics import EngineMetrics
from bik.dvr.requests import Request, RequestOutput, Status
from bik.dvr.sampling import kernels_backend, sample_rows
from bik.dvr.scheduler import Scheduler
from bik.dvr.sequence import EngineConfig, SequenceState, StreamEvent
from bik.dvr.step import KVCache, build_step
from bik.dvr.verifier import Verifier

__all__ = ["DVREngine", "EngineConfig", "StreamEvent"]


class DVREngine(Scheduler, Verifier):
    """Continuous batching with a fast path and a batch-invariant verifier.

    model: bik.dvr.model.LlamaModel; fast_kernels: the ordinary kernels that decode;
    verify_kernels: bik kernels (bik.dvr.kernels.BikKernels) for prefill of deterministic
    requests and for verification.
    """

    def __init__(self, model, config: EngineConfig, *, fast_kernels, verify_kernels,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        self.model, self.config = model, config
        self.fast, self.verifier = fast_kernels, verify_kernels
        self.device = torch.device(device)
        self.cache = KVCache.allocate(model.config, config.num_blocks, config.block_size, dtype,
                                      self.device)
        self.pool = BlockPool(config.num_blocks)
        self.metrics = EngineMetrics()
        self._waiting: list[SequenceState] = []
        self._running: list[SequenceState] = []
        self._outputs: dict[str, RequestOutput] = {}
        self._admitted = 0
        self._rng = random.Random(config.mismatch_seed)
        self._events: list[StreamEvent] = []
        self._started: float | None = None

    # ---- client API -------------------------------------------------------------------------

    def add_request(self, req: Request) -> RequestOutput:
        if req.request_id in self._outputs:
            raise ValueError(f"DVREngine: request id {req.request_id!r} already submitted")
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in req.prompt):
            raise ValueError(f"DVREngine: request {req.request_id!r} has prompt tokens outside "
                             f"[0, {vocab})")
        context = self.model.config.max_position_embeddings
        if len(req.prompt) + req.max_new_tokens > context:
            raise ValueError(f"DVREngine: request {req.request_id!r} needs positions up to "
                             f"{len(req.prompt) + req.max_new_tokens} (prompt "
                             f"{len(req.prompt)} + max_new_tokens {req.max_new_tokens}), past "
                             f"the model's context of {context}")
        need = blocks_for(self._max_kv(req), self.config.block_size) + self._dummy_blocks()
        if need > self.config.num_blocks:
            raise ValueError(
                f"DVREngine: request {req.request_id!r} can never fit: prompt "
                f"{len(req.prompt)} + max_new_tokens {req.max_new_tokens} may need {need} KV "
                f"blocks of {self.config.block_size} tokens, the pool has "
                f"{self.config.num_blocks}")
        out = RequestOutput(req.request_id)
        self._outputs[req.request_id] = out
        self._waiting.append(SequenceState(req, out, order=-1, tokens=list(req.prompt),
                                       prefill_target=len(req.prompt)))
        return out

    def cancel(self, request_id: str) -> None:
        """Stop a request now: its unverified tokens are dropped, its KV blocks freed; what it
        committed stays in its output."""
        for queue in (self._waiting, self._running):
            for seq in queue:
                if seq.req.request_id == request_id:
                    queue.remove(seq)
                    self._finish(seq, "cancelled", Status.CANCELLED)
                    return
        raise KeyError(f"DVREngine.cancel: no waiting or running request {request_id!r}")

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def outputs(self) -> dict[str, RequestOutput]:
        return self._outputs

    def step(self) -> list[StreamEvent]:
        """One scheduling step; returns what was committed in it."""
        if self._started is None:
            self._started = time.perf_counter()
        self._events = []
        self._admit()
        self._prefill()
        self._verify_ready()
        self._decode()
        self.metrics.wall_s = time.perf_counter() - self._started
        return self._events

    def run(self) -> dict[str, RequestOutput]:
        while self.has_work:
            self.step()
        return self._outputs

    # ---- prefill and decode -------------------------------------------------------------

    def _prefill(self) -> None:
        todo = [s for s in self._running if s.prefilling]
        for det in (True, False):
            group = [s for s in todo if (s.req.deterministic and self.config.verify) == det]
            if not group:
                continue
            kernels = self.verifier if det else self.fast
            spans = []
            for seq in group:
                end = seq.prefill_target if self.config.prefill_chunk is None else min(
                    seq.prefill_target, seq.kv_len + self.config.prefill_chunk)
                spans.append((seq, seq.tokens[seq.kv_len:end]))
            t0 = time.perf_counter()
            logits = self._forward(kernels, spans, last_only=True)
            done = [(i, seq) for i, (seq, _) in enumerate(spans) if not seq.prefilling]
            if done:
                rows = torch.tensor([i for i, _ in done], device=logits.device)
                toks, lps = sample_rows(logits.index_select(0, rows),
                                        [s.req.sampling for _, s in done],
                                        [len(s.tokens) for _, s in done],
                                        sample=self.model.sample,
                                        backend=kernels_backend(kernels))
                for (_, seq), tok, lp in zip(done, toks, lps):
                    seq.tokens.append(tok)
                    self._commit(seq, [tok], [lp])
            self.metrics.prefill_s += time.perf_counter() - t0
            self.metrics.prefill_tokens += sum(len(t) for _, t in spans)

    def _decode(self) -> None:
        group = [s for s in self._running if not s.prefilling and not self._is_ready(s)]
        if not group:
            return
        t0 = time.perf_counter()
        logits = self._forward(self.fast, [(s, [s.tokens[-1]]) for s in group], last_only=True)
        toks, lps = sample_rows(logits, [s.req.sampling for s in group],
                                [len(s.tokens) for s in group], sample=self.model.sample,
                                backend=kernels_backend(self.fast))
        for seq, tok, lp in zip(group, toks, lps):
            if seq.req.deterministic and self.config.verify:
                # An invalid fast-path row (-1) goes on as a placeholder token: verification
                # accepts a token only if it is the bik draw, so the output cannot change.
                tok = self._maybe_corrupt(max(tok, 0))
                seq.tokens.append(tok)
                seq.unverified_logprobs.append(lp)
            else:
                seq.tokens.append(tok)
                self._commit(seq, [tok], [lp])
        self.metrics.fast_s += time.perf_counter() - t0
        self.metrics.fast_tokens += len(group)
        self.metrics.fast_passes += 1

    def _maybe_corrupt(self, tok: int) -> int:
        rate = self.config.mismatch_rate
        if rate > 0 and self._rng.random() < rate:
            self.metrics.forced_mismatches += 1
            vocab = self.model.config.vocab_size
            return (tok + 1 + self._rng.randrange(vocab - 1)) % vocab if vocab > 1 else tok
        return tok

    # ---- forward and bookkeeping --------------------------------------------------------

    def _forward(self, kernels, spans, *, last_only: bool, rows_wanted=None) -> torch.Tensor:
        """Feed each sequence's span of new tokens at its next positions; write their K/V."""
        q_lens, kv_lens, tokens, positions, block_lists = [], [], [], [], []
        for seq, span in spans:
            start = seq.kv_len
            seq.kv_len = start + len(span)
            self.pool.grow(seq.blocks, seq.kv_len, self.config.block_size)
            q_lens.append(len(span))
            kv_lens.append(seq.kv_len)
            tokens.extend(span)
            positions.extend(range(start, seq.kv_len))
            block_lists.append(seq.blocks)
        step = build_step(q_lens, kv_lens, block_lists, self.config.block_size, self.device)
        if last_only:
            ends, acc = [], 0
            for n in q_lens:
                acc += n
                ends.append(acc - 1)
            rows_wanted = ends
        logits_rows = None if rows_wanted is None else torch.tensor(
            rows_wanted, dtype=torch.int64, device=self.device)
        self.metrics.last_rows = sum(q_lens)
        return self.model.forward(
            torch.tensor(tokens, dtype=torch.int64, device=self.device),
            torch.tensor(positions, dtype=torch.int64, device=self.device),
            step, self.cache, kernels, logits_rows)

    def _commit(self, seq: SequenceState, toks: list[int], lps: list[float]) -> None:
        """Append verified (or unverifiable) tokens to the stream; finish on EOS, max tokens,
        or an invalid row (token -1: the request ends with reason "invalid_logits")."""
        eos = set(seq.req.eos_token_ids)
        take, reason = len(toks), None
        for i, t in enumerate(toks):
            if t < 0:  # the sampler's invalid row (NaN / +inf logits): end here, never a token
                take, reason = i, "invalid_logits"
                break
            if seq.committed + i + 1 >= seq.req.max_new_tokens:
                take, reason = i + 1, "length"
                break
            if t in eos:
                take, reason = i + 1, "eos"
                break
        toks, lps = toks[:take], lps[:take]
        if reason is not None:  # tokens past the end were never valid
            del seq.tokens[seq.boundary + take:]
        seq.committed += take
        seq.out.tokens.extend(toks)
        seq.out.logprobs.extend(lps)
        self.metrics.committed_tokens += take
        if reason is not None:
            self._running.remove(seq)
            self._finish(seq, reason, Status.FINISHED)
        self._events.append(StreamEvent(seq.req.request_id, tuple(toks), tuple(lps),
                                        reason is not None))

    def _finish(self, seq: SequenceState, reason: str, status: Status) -> None:
        self.pool.free(seq.blocks)
        seq.blocks.clear()
        seq.out.status, seq.out.finish_reason = status, reason
