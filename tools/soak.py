"""A soak of the vLLM plugin with a watchdog (issue 50): a seeded random mix of requests through
one engine, hostile ones among them, every call watched.

    .venv-vllm/bin/python tools/soak.py --requests 300 --spec both --json soak.json

One engine per speculation setting (``off``, ``ngram``; ``both`` runs the two), SmolLM2 fp32,
the plugin on, in this process. The requests (``--seed`` decides them): greedy, seeded (seeds
anywhere in [0, 2**63), both ends included), unseeded, n = 2, logprobs, stop strings, and
hostile ones: a +inf, a NaN or a -inf logit bias, seeds past 64 bits, an empty prompt, a
prompt longer than the context. They go through in batches of random sizes; then every request
whose output is its own (greedy or seeded, not hostile) runs alone on the engine without
speculation, and its batched output (tokens, logprobs, finish reason) must equal that bit for
bit. Unseeded requests draw their seed from a global generator: they are checked to finish,
not compared. Each hostile request must get its own defined outcome: refused when its
parameters are made or when vLLM admits it (a ValueError naming it), ended alone with
``finish_reason="error"`` (nothing to draw), or served (a -inf ban). A call that does not return
within ``--watchdog`` seconds writes the report with a wedge and ends the process (status 3).

The report: requests served, outcomes by kind, wedges, mismatches (with the first few named).
Exit status 0 only with no wedge and no mismatch.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import sys
import threading
import time

NEW_TOKENS = 10
MAX_MODEL_LEN = 256
PROMPTS = ["The capital of France is", "1, 2, 3, 4, 5, 6,", "def fib(n):", "Hello,",
           "The quick brown fox jumps over the lazy dog. The quick brown fox",
           "Write a haiku about the sea.", "Explain gravity to a child.", "My favourite food is"]
# hostile kind -> what it must get: "refused" (a ValueError when made or admitted), "error"
# (finish_reason "error"), "served" (an ordinary output)
HOSTILE = {"+inf bias": "error", "nan bias": "error", "-inf bias": "served",
           "seed 2**63": "refused", "seed -2": "refused", "empty prompt": "refused",
           "prompt past the context": "refused"}


def expected(kind: str, setting: str) -> str:
    """A hostile request's outcome: with speculation vLLM refuses a logit bias at admission."""
    return "refused" if setting != "off" and kind.endswith("bias") else HOSTILE[kind]


def _request(rng: random.Random, i: int) -> dict:
    """One request's description (plain data: the report names it)."""
    prompt = rng.choice(PROMPTS) + " " * (i % 3)
    if rng.random() < 0.15:
        kind = rng.choice(sorted(HOSTILE))
        req = {"id": i, "kind": kind, "prompt": prompt, "temperature": rng.choice([0.0, 0.8]),
               "seed": rng.getrandbits(63), "n": 1, "logprobs": None, "stop": None, "bias": None}
        if kind.endswith("bias"):
            req["bias"] = {"+inf bias": "inf", "nan bias": "nan", "-inf bias": "-inf"}[kind]
        elif kind == "seed 2**63":
            req["seed"] = 2**63
        elif kind == "seed -2":
            req["seed"] = -2
        elif kind == "empty prompt":
            req["prompt"] = ""
        else:
            req["prompt"] = "word " * (MAX_MODEL_LEN + 8)
        return req
    kind = rng.choice(["greedy", "seeded", "seeded", "unseeded", "n=2", "stop"])
    seed = rng.choice([0, 2**63 - 1, rng.getrandbits(63), rng.getrandbits(20)])
    return {"id": i, "kind": kind, "prompt": prompt,
            "temperature": 0.0 if kind == "greedy" else rng.choice([0.7, 1.0]),
            "seed": None if kind in ("greedy", "unseeded") else seed,
            "n": 2 if kind == "n=2" else 1, "logprobs": rng.choice([None, 0, 2]),
            "stop": ["\n", "."] if kind == "stop" else None, "bias": None}


def _params(req: dict):
    from vllm import SamplingParams

    bias = None if req["bias"] is None else {11: float(req["bias"])}
    return SamplingParams(temperature=req["temperature"], seed=req["seed"], n=req["n"],
                          max_tokens=NEW_TOKENS, logprobs=req["logprobs"], stop=req["stop"],
                          logit_bias=bias)


def _output(out) -> list[dict]:
    return [{"tokens": list(o.token_ids), "finish": o.finish_reason,
             "logprobs": None if o.logprobs is None else
             [{str(t): lp.logprob for t, lp in sorted(d.items())} for d in o.logprobs]}
            for o in out.outputs]


class Watchdog:
    """Ends the process (status 3) with the report written when a call overruns."""

    def __init__(self, seconds: float, report: dict, path: str | None):
        self.seconds, self.report, self.path = seconds, report, path

    def run(self, what: str, fn):
        def fire():
            self.report["wedges"] += 1
            self.report["wedged_on"] = what
            _write(self.report, self.path)
            print(f"soak: WEDGED: {what} did not return in {self.seconds} s", flush=True)
            os._exit(3)

        timer = threading.Timer(self.seconds, fire)
        timer.daemon = True
        timer.start()
        try:
            return fn()
        finally:
            timer.cancel()


def _refusals() -> tuple[type, ...]:
    """What a refused request raises: ValueError, or vLLM's client error (a 4xx)."""
    from vllm.exceptions import VLLMClientError

    return ValueError, VLLMClientError


def _write(report: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1, default=str)


def _through_engine(llm, watchdog, requests, rng, setting: str, outcomes) -> dict:
    """Every request in batches of random sizes; returns id -> outputs of the servable ones."""
    served: dict[int, list[dict]] = {}
    pending = []
    for req in requests:
        try:
            params = _params(req)
        except ValueError:  # refused where its parameters are made
            outcomes[req["kind"]]["refused"] += 1
            continue
        pending.append((req, params))
    rng.shuffle(pending)
    i = 0
    while i < len(pending):
        size = rng.randint(1, 12)
        batch, i = pending[i:i + size], i + size
        ok = [b for b in batch if b[0]["kind"] not in HOSTILE
              or expected(b[0]["kind"], setting) != "refused"]
        for req, params in (b for b in batch if b not in ok):  # alone: vLLM refuses at add
            try:
                watchdog.run(f"{setting}: request {req['id']} ({req['kind']})",
                             lambda: llm.generate([req["prompt"]], [params], use_tqdm=False))
                outcomes[req["kind"]]["served"] += 1
            except _refusals():
                outcomes[req["kind"]]["refused"] += 1
        if not ok:
            continue
        outs = watchdog.run(f"{setting}: a batch of {len(ok)}", lambda: llm.generate(
            [r["prompt"] for r, _ in ok], [p for _, p in ok], use_tqdm=False))
        for (req, _), out in zip(ok, outs):
            served[req["id"]] = _output(out)
            finish = {o["finish"] for o in served[req["id"]]}
            outcomes[req["kind"]]["error" if finish == {"error"} else "served"] += 1
    return served


def run(args) -> dict:
    from vllm import LLM

    from bik.models import smollm2

    rng = random.Random(args.seed)
    requests = [_request(rng, i) for i in range(args.requests)]
    report = {"requests": len(requests), "seed": args.seed, "spec": args.spec, "served": 0,
              "outcomes": {}, "wedges": 0, "mismatches": 0, "first_mismatches": [],
              "unexpected_outcomes": [], "seconds": 0.0}
    watchdog = Watchdog(args.watchdog, report, args.json)
    t0 = time.perf_counter()
    settings = ["off", "ngram"] if args.spec == "both" else [args.spec]
    engines = {}
    for setting in settings:
        engine = {"max_model_len": MAX_MODEL_LEN, "enforce_eager": True, "seed": 0}
        if setting == "ngram":
            engine["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3,
                                            "prompt_lookup_min": 2, "prompt_lookup_max": 4}
        engines[setting] = LLM(model=str(smollm2.cache_dir()), dtype="float32", **engine)
    batched = {}
    for setting, llm in engines.items():
        outcomes = collections.defaultdict(collections.Counter)
        batched[setting] = _through_engine(llm, watchdog, requests, random.Random(args.seed + 1),
                                           setting, outcomes)
        report["outcomes"][setting] = {k: dict(v) for k, v in sorted(outcomes.items())}
        report["served"] += len(batched[setting])
    reference = engines.get("off") or next(iter(engines.values()))
    for req in requests:
        own = req["kind"] in ("greedy", "seeded", "n=2", "stop")
        if req["kind"] in HOSTILE:
            for setting, outcomes in report["outcomes"].items():
                got = {k for k, v in outcomes.get(req["kind"], {}).items() if v}
                if got - {expected(req["kind"], setting)}:
                    report["unexpected_outcomes"].append(f"{setting}: {req['kind']} got {got}")
        if not own:
            continue
        alone = watchdog.run(f"alone: request {req['id']}", lambda: _output(
            reference.generate([req["prompt"]], [_params(req)], use_tqdm=False)[0]))
        for setting in engines:
            if batched[setting].get(req["id"]) != alone:
                report["mismatches"] += 1
                if len(report["first_mismatches"]) < 5:
                    report["first_mismatches"].append({"setting": setting, **req})
    report["unexpected_outcomes"] = sorted(set(report["unexpected_outcomes"]))
    report["seconds"] = round(time.perf_counter() - t0, 1)
    return report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--spec", choices=("off", "ngram", "both"), default="both")
    p.add_argument("--watchdog", type=float, default=300.0, help="seconds a call may take")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    os.environ.setdefault("BIK_VLLM", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    report = run(args)
    try:
        from bik.cli.common import run_metadata
        import torch

        report["meta"] = run_metadata(torch.device("cpu"))
    except Exception as exc:  # noqa: BLE001 - the report matters more than its metadata
        report["meta"] = {"error": str(exc)}
    _write(report, args.json)
    print("SOAK " + json.dumps({k: v for k, v in report.items() if k != "meta"}, default=str))
    bad = report["wedges"] or report["mismatches"] or report["unexpected_outcomes"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
