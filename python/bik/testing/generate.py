"""HF ``generate`` the way HF users batch, each prompt alone vs in a left-padded batch: the
end-to-end check `tests/models/` and `bik demo --real` run on the real checkpoint.

Greedy decoding; per prompt, the tokens and the per-step logprobs of the prompt alone (batch 1,
no padding) are compared bit for bit with its row of the batch, over the alone run's length
(it may stop at EOS while the batch pads on).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["PromptResult", "alone_vs_left_padded"]


@dataclass(frozen=True)
class PromptResult:
    prompt: str
    alone: str  # decoded answers
    batched: str
    tokens_equal: bool
    logprobs_equal: bool  # bit for bit

    @property
    def same(self) -> bool:
        return self.tokens_equal and self.logprobs_equal


def _generate(model, tokenizer, texts, new_tokens):
    enc = tokenizer(list(texts), return_tensors="pt", padding=True)
    out = model.generate(**enc, max_new_tokens=new_tokens, do_sample=False, output_scores=True,
                         return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id)
    return out.sequences[:, enc.input_ids.shape[1]:], torch.stack(out.scores, 1).float()


def alone_vs_left_padded(model, tokenizer, prompts: Sequence[str], *, new_tokens: int,
                         front: Callable[[], contextlib.AbstractContextManager] | None = None
                         ) -> list[PromptResult]:
    """Each chat prompt generated alone and in one left-padded batch, under ``front`` (e.g.
    ``bik.batch_invariant_mode``; None: stock)."""
    if tokenizer.padding_side != "left":
        raise ValueError("alone_vs_left_padded: the tokenizer must pad on the left "
                         f"(padding_side={tokenizer.padding_side!r})")
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p in prompts]
    results = []
    with torch.no_grad(), (front or contextlib.nullcontext)():
        tokens, scores = _generate(model, tokenizer, texts, new_tokens)
        for i, (prompt, text) in enumerate(zip(prompts, texts)):
            alone_tokens, alone_scores = _generate(model, tokenizer, [text], new_tokens)
            n = alone_tokens.shape[1]
            results.append(PromptResult(
                prompt=prompt,
                alone=tokenizer.decode(alone_tokens[0], skip_special_tokens=True).strip(),
                batched=tokenizer.decode(tokens[i], skip_special_tokens=True).strip(),
                tokens_equal=torch.equal(alone_tokens[0], tokens[i, :n]),
                logprobs_equal=torch.equal(alone_scores[0].log_softmax(-1),
                                           scores[i, :n].log_softmax(-1))))
    return results
