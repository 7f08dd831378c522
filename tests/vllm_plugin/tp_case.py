"""One vLLM-CPU engine at a tensor-parallel degree on a model directory, four requests (greedy,
T = 1.0 / 0.7 / 1.0 seeded) with processed logprobs, a JSON line of results on stdout:

    python tests/vllm_plugin/tp_case.py MODEL_DIR TP

Run by tests/vllm_plugin/test_vllm_tp.py, with BIK_VLLM set or not (the plugin is
process-wide). TP > 1 runs vLLM's multiprocessing executor: each rank a process, bound to one
core each (VLLM_CPU_OMP_THREADS_BIND); its worker processes are spawned, hence the main guard.
"""

from __future__ import annotations

import sys

from case_io import emit

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "def fib(n):", "Explain gravity to a child."]
REQUESTS = ((0.0, None), (1.0, 3), (0.7, 5), (1.0, 11))  # (temperature, seed)
NEW_TOKENS = 12


def _row_parallel_calls(worker) -> int:
    """In each worker: the row-parallel layers the plugin folded (0 with the plugin off)."""
    del worker
    import os

    if os.environ.get("BIK_VLLM") != "1":
        return 0
    from bik.integrations.vllm import linear

    return linear.ROW_PARALLEL_CALLS[0]


def main() -> None:
    model_dir, tp = sys.argv[1], int(sys.argv[2])
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype="float32", tensor_parallel_size=tp,
              distributed_executor_backend="mp" if tp > 1 else None, enforce_eager=True,
              seed=0, max_model_len=512, logprobs_mode="processed_logprobs")
    params = [SamplingParams(temperature=t, seed=s, max_tokens=NEW_TOKENS, logprobs=0,
                             ignore_eos=True) for t, s in REQUESTS]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    result = [{"prompt": list(o.prompt_token_ids), "tokens": list(o.outputs[0].token_ids),
               "logprobs": [d[t].logprob for d, t in zip(o.outputs[0].logprobs,
                                                         o.outputs[0].token_ids)]}
              for o in outs]
    stats = {"row_parallel_calls": llm.collective_rpc(_row_parallel_calls)}
    emit({"requests": result, "stats": stats}, stats=False)


if __name__ == "__main__":
    main()
