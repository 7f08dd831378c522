"""A bounded soak (tools/soak.py, issue 50, item 5) in CI: 16 seeded random requests, hostile
ones among them (+inf / NaN / -inf biases, seeds outside [0, 2**63), an empty prompt, one past
the context), through one engine with a watchdog on every call: no wedge, every greedy or
seeded request's batched output (tokens, logprobs, finish) equal to its alone run, each hostile
request its defined outcome. The full soak (300 requests, with and without ngram speculation)
is run by hand and committed (bench/results/cpu-soak-vllm-*.json)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

SOAK = Path(__file__).resolve().parents[2] / "tools" / "soak.py"


def test_a_short_soak_has_no_wedge_and_no_mismatch(tmp_path):
    out = tmp_path / "soak.json"
    env = os.environ | {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    proc = subprocess.run([sys.executable, str(SOAK), "--requests", "16", "--seed", "3",
                           "--spec", "off", "--watchdog", "120", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=900, check=False)
    report = json.loads(out.read_text())
    assert report["wedges"] == 0, report.get("wedged_on")
    assert report["mismatches"] == 0, report["first_mismatches"]
    assert not report["unexpected_outcomes"], report["unexpected_outcomes"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    kinds = set(report["outcomes"]["off"])
    assert {"greedy", "seeded"} <= kinds and kinds - {"greedy", "seeded", "unseeded", "n=2",
                                                      "stop"}, kinds  # some hostile ones
