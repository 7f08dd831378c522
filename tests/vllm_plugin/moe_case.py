"""One vLLM-CPU engine on a tiny random mixture-of-experts model (moe_models.py), the checks of
tests/vllm_plugin/test_vllm_moe.py run on it, a JSON line of results on stdout (a process per
engine: the plugin is process-wide).

    python tests/vllm_plugin/moe_case.py MODEL_DIR DTYPE [--chunked] [--ngram] [--experts IMPL]

The engine runs with logprobs_mode="processed_logprobs". Requests: REQUESTS prompts, each with
its own temperature (0, 0.7 or 1.0) and seed. Results:

* batch: each request alone against all of them in one batch: tokens and logprobs;
* prefix: the first request again (its prompt's blocks now in the prefix cache);
* digest: a hash of every request's tokens and logprobs in the batch (--ngram: with vLLM's
  ngram speculation, which must change nothing);
* trainer: every request's prompt + completion through transformers (the same directory,
  train mode, grad on, experts_implementation="grouped_mm", transformers' default, or IMPL
  with --experts, the engine then run with BIK_MOE_EXPERTS=IMPL by the test) under
  bik.enable() when the plugin is on, stock when it is off; the log_softmax of the fp32 logits
  divided by the request's T (T > 0) at the sampled tokens, one sequence per forward
  ("alone"), right-padded ("padded") and packed into one row ("packed"), compared exactly with
  the engine's logprobs;
* trainer_grouped_mm (with --experts): the same with a grouped_mm trainer, the control.
"""

from __future__ import annotations

import itertools
import os
import sys

from case_io import emit
from vllm_case import PROMPTS

NEW_TOKENS = 12
# 32 requests in a batch (prompts reused with other temperatures and seeds): a step's MoE
# layer then sees every expert's group at several sizes.
REQUESTS = [(PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)), (0.0, 0.7, 1.0)[i % 3],
             100 + i) for i in range(32)]


def _params(t: float, seed: int):
    from vllm import SamplingParams

    return SamplingParams(temperature=t, seed=seed, max_tokens=NEW_TOKENS, logprobs=0,
                          ignore_eos=True)


def _generate(llm, requests):
    outs = llm.generate([p for p, _, _ in requests], [_params(t, s) for _, t, s in requests],
                        use_tqdm=False)
    return [(list(o.prompt_token_ids), list(o.outputs[0].token_ids),
             [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


def _trainer(model_dir: str, dtype: str, requests, outs, experts: str = "grouped_mm") -> dict:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), experts_implementation=experts)
    model.train()
    seqs = [prompt + tokens for prompt, tokens, _ in outs]
    width = max(map(len, seqs))
    padded = model(torch.tensor([s + [0] * (width - len(s)) for s in seqs]),
                   attention_mask=torch.tensor([[1] * len(s) + [0] * (width - len(s))
                                                for s in seqs])).logits
    starts = [0, *itertools.accumulate(map(len, seqs))]
    packed = model(torch.tensor([sum(seqs, [])]), use_cache=False,
                   position_ids=torch.cat([torch.arange(len(s)) for s in seqs])[None]).logits
    result = {name: {"equal": 0, "max_abs": 0.0} for name in ("alone", "padded", "packed")}
    result |= {"total": 0, "grad": bool(padded.requires_grad)}
    for b, (prompt, tokens, engine) in enumerate(outs):
        t = requests[b][1]
        rows = slice(len(prompt) - 1, len(seqs[b]) - 1)
        alone = model(torch.tensor([seqs[b]])).logits[0, rows]
        at = torch.tensor(tokens)[:, None]
        for name, lg in (("alone", alone), ("padded", padded[b, rows]),
                         ("packed", packed[0, starts[b] + rows.start:starts[b] + rows.stop])):
            z = lg.float() / t if t > 0 else lg.float()
            trainer = torch.log_softmax(z, -1).gather(1, at)[:, 0].detach()
            result[name]["equal"] += int((trainer == torch.tensor(engine)).sum())
            result[name]["max_abs"] = max(result[name]["max_abs"],
                                          float((trainer - torch.tensor(engine)).abs().max()))
        result["total"] += len(tokens)
    return result


def main() -> None:
    model_dir, dtype = sys.argv[1], sys.argv[2]
    chunked = "--chunked" in sys.argv
    import hashlib
    import json

    from vllm import LLM

    engine = {"max_model_len": 512, "enforce_eager": True, "seed": 0,
              "logprobs_mode": "processed_logprobs"}
    if chunked:
        engine |= {"enable_chunked_prefill": True, "max_num_batched_tokens": 32}
    if "--ngram" in sys.argv:
        engine["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3,
                                        "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    llm = LLM(model=model_dir, dtype=dtype, **engine)
    result = {"dtype": dtype, "bik": os.environ.get("BIK_VLLM", "")}
    alone = [_generate(llm, [r])[0] for r in REQUESTS]
    together = _generate(llm, REQUESTS)
    result["batch"] = {
        "tokens_differ": sum(a[1] != b[1] for a, b in zip(alone, together)),
        "logprobs_differ": sum(a[2] != b[2] for a, b in zip(alone, together)),
        "requests": len(REQUESTS)}
    result["prefix"] = _generate(llm, REQUESTS[:1])[0] == alone[0]
    result["tokens"] = [a[1] for a in alone[:4]]
    result["digest"] = hashlib.sha256(json.dumps([o[1:] for o in together]).encode()).hexdigest()
    experts = sys.argv[sys.argv.index("--experts") + 1] if "--experts" in sys.argv else \
        "grouped_mm"
    result["trainer"] = _trainer(model_dir, dtype, REQUESTS, together, experts)
    if experts != "grouped_mm":
        result["trainer_grouped_mm"] = _trainer(model_dir, dtype, REQUESTS, together)
    emit(result)


if __name__ == "__main__":
    main()
