"""GRPO steps on SmolLM2 with a vLLM engine sampling and a Hugging Face trainer learning, and
per step how far the trainer's logprobs of the sampled tokens are from the engine's."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from bik.rl import engine, task
from bik.rl.trainer import Trainer, advantages, grpo_loss


@dataclass(frozen=True)
class RLConfig:
    steps: int = 2
    prompts: int = 4
    group: int = 4  # completions per prompt
    max_tokens: int = 16
    temperature: float = 1.0
    dtype: str = "float32"  # the engine's and the trainer's forward
    engine_dtype: str | None = None  # None: dtype (another one is refused)
    lr: float = 1e-5
    seed: int = 0
    bik: bool = True
    top_k: int = 0  # top-k / top-p: the trainer's logprobs are of the same filtered distribution
    top_p: float = 1.0
    min_p: float = 0.0  # refused: vLLM's min-p is its own torch code, which the trainer lacks


# request seeds are non-negative signed 64-bit integers: vLLM seeds a torch generator with them
# (and reads -1 as "none"); the plugin refuses the rest (integrations/vllm/sampler.py)
SEED_LIMIT = 2**63


def _whole(name: str, value, least: int) -> None:
    if type(value) is not int or value < least:  # bool and float refused too
        raise ValueError(f"bik rl: {name} must be an integer >= {least}, got {value!r}")


def _real(name: str, value, *, low: float, high: float = math.inf, low_open: bool = False,
          high_open: bool = False) -> None:
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
          and (value > low if low_open else value >= low)
          and (value < high if high_open else value <= high))
    if not ok:
        bounds = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ValueError(f"bik rl: {name} must be a finite number in {bounds}, got {value!r}")


def check_config(cfg: RLConfig) -> None:
    """ValueError naming the first field ``bik rl`` cannot run with, and its value."""
    for name in ("steps", "prompts", "group", "max_tokens"):
        _whole(name, getattr(cfg, name), 1)
    _whole("top_k", cfg.top_k, 0)
    _whole("seed", cfg.seed, 0)
    last = cfg.seed + 1000 * (cfg.steps - 1) + cfg.prompts * cfg.group - 1  # run()'s seeds
    if last >= SEED_LIMIT:
        raise ValueError(f"bik rl: seed {cfg.seed} gives request seeds up to {last}, past "
                         f"2**63 - 1 (a request's seed is seed + 1000 * step + its index)")
    _real("temperature", cfg.temperature, low=0.0, low_open=True)
    _real("lr", cfg.lr, low=0.0)
    _real("top_p", cfg.top_p, low=0.0, high=1.0, low_open=True)
    _real("min_p", cfg.min_p, low=0.0, high=1.0)
    if cfg.min_p > 0.0:
        raise ValueError(f"bik rl: min_p={cfg.min_p} is refused (vLLM applies min-p with its own "
                         f"torch code before the draw, which the trainer does not replay); "
                         f"use top-k / top-p, or temperature only")
    if cfg.dtype not in ("float32", "bfloat16"):
        raise ValueError(f"bik rl: dtype must be float32 or bfloat16, got {cfg.dtype!r}")
    if cfg.engine_dtype not in (None, cfg.dtype):
        raise ValueError(f"bik rl: the engine's dtype {cfg.engine_dtype} is not the trainer's "
                         f"{cfg.dtype}: their logprobs would be of two models")
    if type(cfg.bik) is not bool:
        raise ValueError(f"bik rl: bik must be True or False, got {cfg.bik!r}")


def check_fingerprints(trainer_digest: str, engine_digests: list[str]) -> None:
    """RuntimeError naming both digests when an engine worker's bik is not the trainer's (other
    kernels or tables: other bits), or when no worker reported one."""
    if not engine_digests:
        raise RuntimeError("bik rl: the engine reported no bik fingerprint (no worker answered): "
                           "its bits cannot be checked against the trainer's")
    other = sorted({d for d in engine_digests if d != trainer_digest})
    if other:
        raise RuntimeError(f"bik rl: the engine's bik fingerprint {', '.join(other)} is not the "
                           f"trainer's {trainer_digest}: their logprobs would differ")


def compare(trainer: list[torch.Tensor], engine_lps: list[torch.Tensor]) -> dict:
    """max |trainer - engine| over the sampled tokens, and KL(engine || trainer) estimated on
    them (k3 = mean(exp(d) - 1 - d), d = trainer - engine: >= 0, 0 iff every d is 0)."""
    d = torch.cat([t.detach() - e for t, e in zip(trainer, engine_lps)]).double()
    equal = int((d == 0).sum())
    return {"tokens": d.numel(), "tokens_equal": equal,
            "max_abs_dlogprob": float(d.abs().max()) if d.numel() else 0.0,
            "kl": float((torch.exp(d) - 1 - d).mean()) if d.numel() else 0.0}


def run(cfg: RLConfig, model_dir: str, log=print) -> list[dict]:
    """``cfg.steps`` GRPO steps; one record per step."""
    check_config(cfg)
    import transformers

    import bik

    llm = engine.start(model_dir, cfg.dtype, bik_on=cfg.bik)
    if cfg.bik:
        if not bik.is_enabled():  # the plugin enables it; a trainer without the plugin too
            bik.enable()
        check_fingerprints(bik.fingerprint("cpu").digest, engine.fingerprints(llm))
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    trainer = Trainer(model_dir, cfg.dtype, cfg.lr)
    problems = task.problems(cfg.prompts, cfg.seed)
    prompts = [task.prompt_ids(tokenizer, p) for p in problems]
    records = []
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        rollouts = engine.sample(llm, prompts, group=cfg.group, max_tokens=cfg.max_tokens,
                                 temperature=cfg.temperature, seed=cfg.seed + 1000 * step,
                                 top_k=cfg.top_k, top_p=cfg.top_p)
        t1 = time.perf_counter()
        rewards = [task.reward(problems[r.prompt], r.text) for r in rollouts]
        seqs = [r.prompt_ids + r.token_ids for r in rollouts]
        lps = trainer.logprobs(seqs, [r.token_ids for r in rollouts],
                               [cfg.temperature] * len(seqs), top_k=cfg.top_k, top_p=cfg.top_p)
        gap = compare(lps, [r.logprobs for r in rollouts])
        loss = grpo_loss(lps, [r.logprobs for r in rollouts], advantages(rewards, cfg.group))
        grad_digest, grad_norm = trainer.step(loss)
        t2 = time.perf_counter()
        updated = trainer.weights()
        engine.push(llm, updated, trainer.expected())
        t3 = time.perf_counter()
        record = {"step": step + 1, "bik": cfg.bik, "dtype": cfg.dtype,
                  "reward_mean": sum(rewards) / len(rewards), "loss": float(loss.detach()),
                  **gap, "grad_digest": grad_digest, "grad_norm": grad_norm,
                  "seconds": {"rollout": round(t1 - t0, 3), "trainer": round(t2 - t1, 3),
                              "sync": round(t3 - t2, 3), "step": round(t3 - t0, 3)}}
        if not math.isfinite(record["loss"]):
            raise RuntimeError(f"bik rl: step {step + 1}: the loss is {record['loss']}")
        log(record)
        records.append(record)
    return records

