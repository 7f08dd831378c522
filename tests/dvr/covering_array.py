"""A pairwise covering array over the decode-verify-rollback engine's settings (every pair of factor
values appears in some case, far fewer cases than the product), for tests/dvr/test_dvr_engine.py."""

from __future__ import annotations

import itertools

FACTORS = {
    "window": (1, 4, 16),
    "group": (1, 2, 8),
    "verifier": ("exact", "fixed"),
    "drafter": (0, 3),
    "mismatch_rate": (0.0, 0.3, 1.0),
    "temperature": (0.0, 0.9),
    "arrival_seed": (0, 1, 2),
}


def pairwise(factors: dict[str, tuple]) -> list[dict]:
    """Greedy covering array: repeatedly take the combination (in product order) that covers
    the most still-uncovered value pairs. Deterministic, so test ids are stable."""
    names = list(factors)
    uncovered = {((a, va), (b, vb)) for a, b in itertools.combinations(names, 2)
                 for va in factors[a] for vb in factors[b]}
    candidates = [dict(zip(names, values)) for values in itertools.product(*factors.values())]
    cases = []
    pairs = list(itertools.combinations(names, 2))

    def gain(c, todo):
        return sum(((a, c[a]), (b, c[b])) in todo for a, b in pairs)

    while uncovered:
        best = max(candidates, key=lambda c: gain(c, uncovered))
        uncovered -= {((a, best[a]), (b, best[b])) for a, b in pairs}
        cases.append(best)
    return cases


CASES = pairwise(FACTORS)


def case_id(case: dict) -> str:
    return (f"K{case['window']}-N{case['group']}-{case['verifier']}-d{case['drafter']}-"
            f"m{case['mismatch_rate']}-T{case['temperature']}-a{case['arrival_seed']}")
