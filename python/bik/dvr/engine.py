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

import itertools
import operator
import random
import time
import warnings
from dataclasses import dataclass, field

import torch

from bik.dvr.blocks import BlockPool, blocks_for
from bik.dvr.drafter import NgramDrafter
from bik.dvr.metrics import EngineMetrics
from bik.dvr.requests import Request, RequestOutput, Status
from bik.dvr.sampling import sample_rows, verify_windows
from bik.dvr.step import KVCache, build_step

__all__ = ["DVREngine", "EngineConfig", "StreamEvent"]

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
class _Sequence:
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


class DVREngine:
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
        self._waiting: list[_Sequence] = []
        self._running: list[_Sequence] = []
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
        self._waiting.append(_Sequence(req, out, order=-1, tokens=list(req.prompt),
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

    # ---- scheduling ---------------------------------------------------------------------

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

    def _step_blocks(self, seq: _Sequence) -> int:
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

    def _preempt(self, seq: _Sequence) -> None:
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

    def _is_ready(self, seq: _Sequence) -> bool:
        if not seq.req.deterministic or seq.prefilling or not self.config.verify:
            return False
        unverified = seq.tokens[seq.boundary:]
        return len(unverified) >= self.config.window or (
            bool(unverified) and seq.ends_within(unverified))

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
                                        sample=self.model.sample)
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
                                [len(s.tokens) for s in group], sample=self.model.sample)
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

    def _verify_ready(self) -> None:
        ready = sorted((s for s in self._running if self._is_ready(s)), key=lambda s: s.order)
        waiting_det = [s for s in self._running if s.req.deterministic and self.config.verify
                       and not s.prefilling and not self._is_ready(s)]
        if not ready or (len(ready) < self.config.group and waiting_det):
            return  # wait for a full group while more requests can still become ready
        for start in range(0, len(ready), self.config.group):
            self._verify_group(ready[start:start + self.config.group])

    def _verify_group(self, group: list[_Sequence]) -> None:
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
                                  [s.boundary for s in group], verify=self.model.verify_draft)
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

    def _drafts(self, seq: _Sequence, unverified: list[int]) -> list[int]:
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
            dummy = _Sequence(spans[0][0].req, RequestOutput("dummy"), order=-1,
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

    def _commit(self, seq: _Sequence, toks: list[int], lps: list[float]) -> None:
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

    def _finish(self, seq: _Sequence, reason: str, status: Status) -> None:
        self.pool.free(seq.blocks)
        seq.blocks.clear()
        seq.out.status, seq.out.finish_reason = status, reason
