"""One vLLM-CPU engine on SmolLM2-135M-Instruct, the checks of tests/vllm_plugin/test_vllm_plugin.py
run on it, a JSON line of results on stdout. A process per engine: bik's plugin is
process-wide (BIK_VLLM is read when vLLM loads its plugins), so stock and bik runs cannot
share one.

    python tests/vllm_plugin/vllm_case.py DTYPE CASE[,CASE...] [--chunked] [--processed]

--processed starts the engine with logprobs_mode="processed_logprobs" (the log_softmax of the
tempered logits the draw saw), vLLM's default being raw_logprobs.

Cases: batch (8 prompts alone vs in one batch, greedy, logprobs), needle (prompt 0 among 1,
3, 15 others), prefix (a long prompt cold, then hot from the prefix cache), seeded (T = 0.8
with a seed per request, alone vs batched), resumed (T = 0.8, seeded: the prompt plus the
first half of its sampled tokens, fed back as a prompt, goes on with the second half),
trainer (the engine's logprobs of its sampled tokens against those Hugging Face transformers
computes as a trainer does, in this process: under bik.enable() when the plugin is on, stock
when it is off). Tokens and logprobs are compared exactly.

Prompt 0 of batch, needle and seeded is LONG (294 tokens), the others short (4-11 tokens), with
or without --chunked. The long prompt is what makes stock vLLM fail on an AVX2 CPU too: vLLM's
CPU attention splits a decode row's KV across threads (VLLM_CPU_ATTN_SPLIT_KV, on by default),
and where it splits depends on the other rows of the step. Measured on an AVX2 CPU (AMD EPYC,
no AVX-512, 2 threads, vllm-cpu 0.32.0, fp32): vLLM's oneDNN GEMM gave every row the same bits
at every M up to 2048 for all of SmolLM2's weight shapes, and its attention kernel gave a
decode row other bits alone than among other rows once the row's context was 130 tokens or
more (64 or fewer: equal). So with 8 short prompts stock vLLM was invariant there (batch 0/0,
needle all equal); with the long prompt first it gave logprobs_differ 1 and needle {1, 3, 15}
all unequal, and with VLLM_CPU_ATTN_SPLIT_KV=0 it was invariant again (0/0, all equal).
Earlier runs on an AVX-512 Xeon failed stock vLLM with the short prompts alone, so there
another kernel depends on the batch as well (not measured here).
"""

from __future__ import annotations

import itertools
import os
import sys

from bik._env import flag

from case_io import emit

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,",
           "def fib(n):", "Explain gravity to a child.", "The quick brown fox",
           "Translate 'hello' to German:", "My favourite food is"]
LONG = ("Here is a story about a lighthouse keeper who counted the ships that passed each night "
        "and wrote their names in a book. ") * 12 + "The keeper's favourite ship was"
# BIK_TEST_FULL=1 (`make test-all`) decodes 24 tokens per request; CI 12: the steps past 12 are
# more decode steps of the same kind (every context already past the 130 tokens where stock
# vLLM's attention split moves), and decode steps are most of an engine's time here.
NEW_TOKENS = 24 if flag("BIK_TEST_FULL") else 12


def _outputs(llm, prompts, params):
    """(tokens, logprobs of the chosen tokens) per prompt, in prompt order."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids),
             [next(iter(d.values())).logprob for d in o.outputs[0].logprobs]) for o in outs]


def _differ(alone, together):
    return {"tokens_differ": sum(a[0] != b[0] for a, b in zip(alone, together)),
            "logprobs_differ": sum(a[1] != b[1] for a, b in zip(alone, together))}


def _resumed(llm) -> dict:
    """A seeded request's second half drawn again from a prompt that ends with its first half:
    equal where the noise is keyed by position, not by how many steps the request ran."""
    from vllm import SamplingParams, TokensPrompt

    def params(n):
        return SamplingParams(temperature=0.8, seed=7, max_tokens=n, logprobs=1, ignore_eos=True)

    first = llm.generate([PROMPTS[0]], params(NEW_TOKENS), use_tqdm=False)[0]
    tokens = list(first.outputs[0].token_ids)
    half = NEW_TOKENS // 2
    prompt = TokensPrompt(prompt_token_ids=list(first.prompt_token_ids) + tokens[:half])
    (rest,) = _outputs(llm, [prompt], params(NEW_TOKENS - half))
    logprobs = [next(iter(d.values())).logprob for d in first.outputs[0].logprobs]
    return {"tokens_equal": rest[0] == tokens[half:], "logprobs_equal": rest[1] == logprobs[half:]}


def _trainer(llm, dtype: str, processed: bool) -> dict:
    """Greedy and seeded requests (T = 0, 1.0, 0.7, 1.0, and in processed mode 0.8 with top-k
    50 and top-p 0.9) in one batch with their logprobs; then each prompt + completion through
    transformers' LlamaForCausalLM in train mode with grad enabled, the trainer's log_softmax
    gathered at the sampled tokens: of the fp32 logits in raw mode (vLLM's default), of the
    fp32 logits divided by the request's T (T > 0) in processed mode, the tokens the draw
    dropped at -inf (ops/sampling/kept.py) for the filtered request. One sequence per forward
    ("alone"), all in one right-padded batch with its attention mask ("padded"), and all packed
    into one row with position_ids restarting per sequence ("packed"; no cache, as trainers
    run, so transformers builds its block-diagonal mask). "bf16_division" is the trap: the
    logits divided by T before the upcast."""
    import torch
    import transformers
    from bik.models import smollm2
    from bik.ops.sampling.kept import kept_tokens
    from vllm import SamplingParams

    requests = [(0.0, None, 0, 1.0), (1.0, 3, 0, 1.0), (0.7, 5, 0, 1.0), (1.0, 11, 0, 1.0)]
    if processed:
        requests.append((0.8, 13, 50, 0.9))
    params = [SamplingParams(temperature=t, seed=s, top_k=k or -1, top_p=p,
                             max_tokens=NEW_TOKENS, logprobs=0, ignore_eos=True)
              for t, s, k, p in requests]
    outs = llm.generate(PROMPTS[:len(requests)], params, use_tqdm=False)
    model = transformers.LlamaForCausalLM.from_pretrained(
        str(smollm2.cache_dir()), dtype=getattr(torch, dtype))
    model.train()
    seqs = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]

    def logprobs(logits, b):  # one request's rows of logits -> its trainer logprobs
        t, _, k, p = requests[b]
        z = logits.float() / t if processed and t > 0 else logits.float()
        if processed and (k or p < 1):
            z = z.masked_fill(~kept_tokens(z, torch.full((len(z),), k),
                                           torch.full((len(z),), p)), float("-inf"))
        return torch.log_softmax(z, -1)

    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    padded = model(ids, attention_mask=mask).logits
    starts = [0, *itertools.accumulate(map(len, seqs))]
    packed = model(torch.tensor([sum(seqs, [])]), use_cache=False,
                   position_ids=torch.cat([torch.arange(len(s)) for s in seqs])[None]).logits
    result = {name: {"equal": 0, "max_abs": 0.0} for name in ("alone", "padded", "packed")}
    result |= {"total": 0, "grad": bool(padded.requires_grad), "processed": processed,
               "filtered": 0, "bf16_division": {"equal": 0, "total": 0}}
    for b, out in enumerate(outs):
        prompt, tokens = list(out.prompt_token_ids), list(out.outputs[0].token_ids)
        engine = torch.tensor([d[t].logprob for d, t in zip(out.outputs[0].logprobs, tokens)])
        logits = model(torch.tensor([seqs[b]])).logits
        at = torch.tensor(tokens)[:, None]
        rows = slice(len(prompt) - 1, len(seqs[b]) - 1)
        packed_rows = slice(starts[b] + rows.start, starts[b] + rows.stop)
        for name, lg in (("alone", logits[0, rows]), ("padded", padded[b, rows]),
                         ("packed", packed[0, packed_rows])):
            trainer = logprobs(lg, b).gather(1, at)[:, 0].detach()
            result[name]["equal"] += int((trainer == engine).sum())
            result[name]["max_abs"] = max(result[name]["max_abs"],
                                          float((trainer - engine).abs().max()))
        t = requests[b][0]
        if processed and t not in (0.0, 1.0) and logits.dtype == torch.bfloat16 and \
                requests[b][2:] == (0, 1.0):
            trap = torch.log_softmax((logits[0, rows] / t).float(), -1)
            result["bf16_division"]["equal"] += int((trap.gather(1, at)[:, 0] == engine).sum())
            result["bf16_division"]["total"] += len(tokens)
        result["filtered"] += len(tokens) if requests[b][2:] != (0, 1.0) else 0
        result["total"] += len(tokens)
    return result


def main() -> None:
    dtype, cases = sys.argv[1], sys.argv[2].split(",")
    chunked, processed = "--chunked" in sys.argv, "--processed" in sys.argv
    from bik.models import smollm2
    from vllm import LLM, SamplingParams

    engine = {"max_model_len": 1024, "enforce_eager": True, "seed": 0}
    if processed:
        engine["logprobs_mode"] = "processed_logprobs"
    if chunked:  # every prompt longer than 32 tokens is prefilled in chunks
        engine |= {"enable_chunked_prefill": True, "max_num_batched_tokens": 32}
    llm = LLM(model=str(smollm2.cache_dir()), dtype=dtype, **engine)
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=1)
    result = {"dtype": dtype, "chunked": chunked, "bik": os.environ.get("BIK_VLLM", "")}
    prompts = [LONG, *PROMPTS[1:]]
    if "batch" in cases:
        alone = [_outputs(llm, [p], greedy)[0] for p in prompts]
        result["batch"] = _differ(alone, _outputs(llm, prompts, greedy))
        result["answer"] = alone[0][0]
    if "needle" in cases:
        alone = _outputs(llm, [prompts[0]], greedy)[0]
        others = (prompts[1:] * 3)[:15]
        result["needle"] = {n: _outputs(llm, [prompts[0], *others[:n]], greedy)[0] == alone
                            for n in (1, 3, 15)}
    if "prefix" in cases:
        cold = _outputs(llm, [LONG], greedy)[0]
        hot = _outputs(llm, [LONG], greedy)[0]  # its first full blocks now come from the cache
        result["prefix"] = {"equal": cold == hot, "cold": cold}
    if "seeded" in cases:
        params = [SamplingParams(temperature=0.8, seed=100 + i, max_tokens=NEW_TOKENS, logprobs=1)
                  for i in range(len(prompts))]
        alone = [_outputs(llm, [p], sp)[0] for p, sp in zip(prompts, params)]
        result["seeded"] = _differ(alone, _outputs(llm, prompts, params))
    if "resumed" in cases:
        result["resumed"] = _resumed(llm)
    if "trainer" in cases:
        import time

        t0 = time.perf_counter()
        result["trainer"] = _trainer(llm, dtype, processed)
        result["trainer"]["seconds"] = round(time.perf_counter() - t0, 1)
    emit(result)


if __name__ == "__main__":
    main()
