"""sampler inputs shared by tests/sampling/ and the CUDA backend tests.

A batch's rows are given as indices into a table of requests (logits + parameters), so the
invariance harness can move requests between rows and batches: ``sampler(backend, table)(idx)``
samples the requests idx and returns [M, 2] int64 (token, logprob bits).
"""

from __future__ import annotations

import bik
import torch

__all__ = ["PARAM_NAMES", "requests", "sampler"]

PARAM_NAMES = ("seed", "position", "temperature", "top_k", "top_p", "min_p")


def requests(n: int, v: int, gen: torch.Generator, *, near_ties: bool = False,
             filters: str = "all") -> dict:
    """n requests with random logits and a mix of sampling parameters per row.

    filters: "all" (top-k, top-p and min-p mixed in), "none" (every filter off), anything else
    (e.g. "top_k_min_p", "no_top_p"): top-k and min-p mixed in, top-p off."""
    if near_ties:
        # Few distinct values plus 1-ulp neighbours: exact ties and near-ties everywhere.
        base = torch.randint(-3, 4, (n, v), generator=gen).float()
        bump = torch.randint(-1, 2, (n, v), generator=gen).float()
        logits = torch.nextafter(base, base + bump)
    else:
        logits = torch.randn(n, v, generator=gen) * 3
    temps = torch.tensor([0.0, 1.0, 0.7, 1.9, 0.05])
    p = {
        "seed": torch.randint(0, 2**63 - 1, (n,), generator=gen),
        "position": torch.randint(0, 2**40, (n,), generator=gen),
        "temperature": temps[torch.randint(0, len(temps), (n,), generator=gen)],
        "top_k": torch.zeros(n, dtype=torch.int64),
        "top_p": torch.ones(n),
        "min_p": torch.zeros(n),
    }
    if filters != "none":
        k_choices = torch.tensor([0, 1, 3, v - 1, v, v + 5, -2])
        p["top_k"] = k_choices[torch.randint(0, len(k_choices), (n,), generator=gen)]
        p["min_p"] = torch.where(torch.rand(n, generator=gen) < 0.3,
                                 torch.rand(n, generator=gen) * 0.5, torch.zeros(n))
    if filters == "all":
        p["top_p"] = torch.where(torch.rand(n, generator=gen) < 0.3,
                                 torch.rand(n, generator=gen) * 0.9 + 0.05, torch.ones(n))
    return {"logits": logits, **p}


def sampler(backend: str, table: dict):
    """fn(idx [M, 1]) -> [M, 2] int64: the requests idx sampled as one batch."""
    def fn(idx: torch.Tensor) -> torch.Tensor:
        i = idx[:, 0]
        out = bik.sample(table["logits"][i], backend=backend,
                         **{k: table[k][i] for k in PARAM_NAMES})
        return torch.stack([out.tokens, out.logprobs.view(torch.int32).to(torch.int64)], 1)
    return fn
