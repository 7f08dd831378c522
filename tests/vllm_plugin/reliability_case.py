"""One vLLM-CPU engine on SmolLM2-135M-Instruct (fp32, in this process) and the hostile inputs
of issue 50, a JSON line of results on stdout (tests/vllm_plugin/test_vllm_reliability.py).

    python tests/vllm_plugin/reliability_case.py plain|spec

plain (no speculation): the REQUESTS alone (the reference), then each hostile request in a
batch beside all of them: a greedy and a seeded request with a +inf logit bias, the same with
a NaN bias, and an ordinary -inf ban; then the REQUESTS again (the engine still serving).

spec (a draft model proposing 3 tokens: the checkpoint's first 2 layers with a NaN final
norm, so every draft logit is NaN): the REQUESTS in one batch; then the same with the drafter
raising at every step, and with it proposing ids past the vocabulary (the proposer's method
replaced in this process). Each output should be the plain engine's.
"""

from __future__ import annotations

import sys

from case_io import emit
from spec_case import truncated_checkpoint

# (prompt, temperature, seed): greedy and seeded rows, logprobs compared too
REQUESTS = [("The capital of France is", 0.0, None), ("1, 2, 3, 4, 5, 6,", 0.8, 7),
            ("def fib(n):", 1.0, 11), ("The quick brown fox", 0.7, 13)]
NEW_TOKENS = 8
HOSTILE = {"+inf greedy": (0.0, None, float("inf")), "+inf seeded": (0.8, 5, float("inf")),
           "nan greedy": (0.0, None, float("nan")), "nan seeded": (0.8, 5, float("nan")),
           "-inf ban": (0.0, None, float("-inf"))}


def _params(temperature, seed, bias=None):
    from vllm import SamplingParams

    return SamplingParams(temperature=temperature, seed=seed, max_tokens=NEW_TOKENS, logprobs=0,
                          ignore_eos=True, logit_bias=None if bias is None else {11: bias})


def _generate(llm, requests) -> list[dict]:
    outs = llm.generate([p for p, *_ in requests], [_params(*r[1:]) for r in requests],
                        use_tqdm=False)
    return [{"tokens": list(o.outputs[0].token_ids), "finish": o.outputs[0].finish_reason,
             "logprobs": [d[t].logprob for d, t in zip(o.outputs[0].logprobs or [],
                                                         o.outputs[0].token_ids)]}
            for o in outs]


def _plain(llm) -> dict:
    alone = [_generate(llm, [r])[0] for r in REQUESTS]
    result = {"alone": alone, "hostile": {}}
    for kind, (t, seed, bias) in HOSTILE.items():
        got = _generate(llm, REQUESTS + [("Hello there", t, seed, bias)])
        result["hostile"][kind] = {"others_equal_alone": got[:-1] == alone,
                                   "finish": got[-1]["finish"], "tokens": got[-1]["tokens"]}
    result["serving_after"] = [_generate(llm, [r])[0] for r in REQUESTS] == alone
    return result


def _spec(llm) -> dict:
    from vllm.v1.spec_decode.draft_model import DraftModelProposer

    result = {"nan_drafter": _generate(llm, REQUESTS)}
    propose = DraftModelProposer.propose

    def raising(self, *args, **kwargs):
        raise RuntimeError("a drafter that fails")

    def past_the_vocabulary(self, *args, **kwargs):
        return propose(self, *args, **kwargs).fill_(10**6)

    for name, replacement in (("raising_drafter", raising),
                              ("out_of_vocabulary_drafter", past_the_vocabulary)):
        DraftModelProposer.propose = replacement
        try:
            result[name] = _generate(llm, REQUESTS)
        finally:
            DraftModelProposer.propose = propose
    return result


def main() -> None:
    import torch
    from safetensors.torch import load_file, save_file
    from vllm import LLM

    from bik.models import smollm2

    mode = sys.argv[1]
    engine = {"max_model_len": 512, "enforce_eager": True, "seed": 0}
    if mode == "spec":
        draft = truncated_checkpoint(smollm2.cache_dir(), 2)
        weights = load_file(draft / "model.safetensors")
        weights["model.norm.weight"] = torch.full_like(weights["model.norm.weight"],
                                                       float("nan"))
        save_file(weights, draft / "model.safetensors")
        engine["speculative_config"] = {"method": "draft_model", "model": str(draft),
                                        "num_speculative_tokens": 3}
    llm = LLM(model=str(smollm2.cache_dir()), dtype="float32", **engine)
    emit(_plain(llm) if mode == "plain" else _spec(llm))


if __name__ == "__main__":
    main()
