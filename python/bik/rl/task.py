"""The verifiable task of ``bik rl``: two-number sums, rewarded 1 when the completion's last
integer is the answer (the model often restates the question first: "26 + 28 = 54")."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

_INTEGER = re.compile(r"-?\d+")


@dataclass(frozen=True)
class Problem:
    question: str
    answer: int


def problems(count: int, seed: int = 0) -> list[Problem]:
    """``count`` sums a + b with a, b in [2, 49], the same for the same seed."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        a, b = rng.randint(2, 49), rng.randint(2, 49)
        out.append(Problem(f"What is {a} + {b}? Reply with the number only.", a + b))
    return out


def reward(problem: Problem, completion: str) -> float:
    """1.0 when the completion's last integer is the answer, else 0.0."""
    found = _INTEGER.findall(completion)
    return float(bool(found) and int(found[-1]) == problem.answer)


def prompt_ids(tokenizer, problem: Problem) -> list[int]:
    """The question as one user turn of the checkpoint's chat template, ready to answer."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": problem.question}],
                                        add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5: a dict
