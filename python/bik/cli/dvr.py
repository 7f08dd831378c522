"""`bik dvr`: run a decode-verify-rollback workload and check it is deterministic.

The run decodes a synthetic request stream with the fast path (ordinary torch kernels) and a
verifier on bik kernels, prints the engine's metrics, then decodes every deterministic request
alone on bik kernels and compares: the verdict is "deterministic" only when every output equals
its solo reference token for token and logprob for logprob.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from rich.progress import Progress
from rich.table import Table

from bik.cli.common import (
    DTYPES,
    end_spawned_rank,
    fraction,
    make_console,
    non_negative_float,
    non_negative_int,
    output_path,
    pick_device,
    positive_int,
    run_metadata,
    write_json,
)
from bik.dvr import DVREngine, EngineConfig, NgramDrafter, reference_decode
from bik.dvr.kernels import BikKernels, FastKernels
from bik.dvr.workload import make_workload, run_workload

__all__ = ["add_dvr_arguments", "load_model", "run_dvr"]


def _model_arg(text: str) -> str:
    """--model: 'smollm2' or an existing checkpoint directory (argparse's error otherwise)."""
    if text != "smollm2" and not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is neither 'smollm2' nor a checkpoint "
                                         f"directory")
    return text


def add_dvr_arguments(p) -> None:
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--dtype", default="fp32", choices=tuple(DTYPES))
    p.add_argument("--model", metavar="DIR", default=None, type=_model_arg,
                   help="a Hugging Face Llama checkpoint directory, or 'smollm2' for the real "
                        "SmolLM2-135M-Instruct (make checkpoint; default: the embedded tiny "
                        "model)")
    p.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                   help="a text prompt (repeatable; needs a checkpoint with a tokenizer, whose "
                        "chat template is applied; default there: a few built-in ones)")
    p.add_argument("--requests", type=positive_int, default=12)
    p.add_argument("--max-new-tokens", type=positive_int, default=24)
    p.add_argument("--det-fraction", type=fraction, default=0.75)
    p.add_argument("--temperature", type=non_negative_float, default=0.8)
    p.add_argument("--top-k", type=non_negative_int, default=0)
    p.add_argument("--min-p", type=fraction, default=0.0,
                   help="min-p filter in [0, 1]: keep tokens with probability >= min_p times "
                        "the top one's (0: off)")
    p.add_argument("-K", "--window", type=positive_int, default=4,
                   help="unverified tokens per window")
    p.add_argument("-N", "--group", type=positive_int, default=4, help="requests per verifier pass")
    p.add_argument("--verifier", choices=("exact", "fixed"), default="exact")
    p.add_argument("--drafter", type=non_negative_int, default=0, metavar="TOKENS",
                   help="prompt-lookup drafter proposing up to TOKENS tokens (0: off)")
    p.add_argument("--mismatch-rate", type=fraction, default=0.2,
                   help="fraction of fast-path tokens replaced, to force rollbacks")
    p.add_argument("--arrival-spread", type=non_negative_int, default=8,
                   help="requests arrive over the first this-many steps")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--no-verdict", action="store_true", help="skip the solo reference decode")
    p.add_argument("--tp", type=positive_int, default=1,
                   help="tensor-parallel ranks: spawns this many gloo processes (CPU); the "
                        "verdict compares with the unsharded model on one device (default "
                        "model with --tp > 1: a small one that shards over 2, 4 and 8 ranks)")
    p.add_argument("--json", metavar="PATH", type=output_path)


def load_model(path: str | None, device: torch.device, dtype: torch.dtype, seed: int = 0,
               tp: int = 1):
    from bik.dvr.model import embedded_model, embedded_tp_config, load_checkpoint, random_model

    if path is None:  # the demo model, or with --tp a small one that shards over 2, 4 and 8
        if tp > 1:
            return random_model(embedded_tp_config(), seed=seed, dtype=dtype, device=device)
        return embedded_model(seed=seed, dtype=dtype, device=device)
    if path == "smollm2":
        from bik.models import smollm2

        path = smollm2.prepare()
    return load_checkpoint(path, dtype=dtype, device=device)


BUILT_IN_PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.",
                    "Give me three tips for learning Python.", "Why is the sky blue?")


def _quiet_console():
    from rich.console import Console

    return Console(file=open(os.devnull, "w"))


def _tokenizer(model: str | None, prompts):
    """The checkpoint's tokenizer (text prompts in, answers out), or None for token ids."""
    if model is None:
        if prompts:
            raise SystemExit("bik dvr: --prompt needs --model (a checkpoint with a tokenizer)")
        return None
    from pathlib import Path

    if not (Path(model) / "tokenizer.json").is_file() and \
            not (Path(model) / "tokenizer_config.json").is_file():
        if prompts:
            raise SystemExit(f"bik dvr: --prompt needs a tokenizer; {model} has none")
        return None
    import transformers

    return transformers.AutoTokenizer.from_pretrained(model)


def chat_ids(tokenizer, text: str) -> list[int]:
    if tokenizer.chat_template:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                  add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    return tokenizer(text).input_ids


def _print_answers(console, tokenizer, texts, arrivals, outputs) -> dict[str, str]:
    """Prints and returns each request's decoded answer; request i asked texts[i % len(texts)]
    (make_workload's order)."""
    table = Table(title="answers")
    table.add_column("request")
    table.add_column("det")
    table.add_column("prompt", overflow="fold")
    table.add_column("answer", overflow="fold")
    answers = {}
    for i, a in enumerate(arrivals):
        req = a.request
        answer = tokenizer.decode(outputs[req.request_id].tokens, skip_special_tokens=True)
        answers[req.request_id] = answer.strip()
        table.add_row(req.request_id, "yes" if req.deterministic else "no",
                      texts[i % len(texts)], answers[req.request_id])
    console.print(table)
    return answers


def _verdict(model, arrivals, outputs, device, dtype, progress) -> dict:
    kernels = BikKernels()
    det = [a.request for a in arrivals if a.request.deterministic]
    mismatched = []
    task = progress.add_task("solo references", total=len(det))
    for req in det:
        ref = reference_decode(model, req, kernels, device=device, dtype=dtype)
        out = outputs[req.request_id]
        if out.tokens != ref.tokens or out.logprobs != ref.logprobs:
            mismatched.append(req.request_id)
        progress.advance(task)
    return {"deterministic_requests": len(det), "mismatched": mismatched,
            "deterministic": not mismatched}


def run_dvr(args) -> int:
    if args.model == "smollm2":  # resolved once: the model and its tokenizer
        from bik.models import smollm2

        args.model = str(smollm2.prepare())
    if args.tp > 1:
        return _spawn_tp(args)
    return _run_dvr(args)


def _spawn_tp(args) -> int:
    """args.tp processes on one gloo group, each running _run_dvr on its shard; rank 0 reports
    and its exit status is the command's."""
    import tempfile

    import torch.multiprocessing as mp

    if pick_device(args.device).type != "cpu":
        raise SystemExit("bik dvr --tp: runs its ranks on the CPU (gloo) in this version")
    with tempfile.TemporaryDirectory() as tmp:
        rc_file = os.path.join(tmp, "rc")
        mp.start_processes(_tp_rank, args=(args, os.path.join(tmp, "pg"), rc_file),
                           nprocs=args.tp, join=True, start_method="spawn")
        with open(rc_file) as f:
            return int(f.read())


def _tp_rank(rank: int, args, init_file: str, rc_file: str) -> None:
    import datetime
    import sys

    import torch.distributed as dist

    torch.set_num_threads(max(1, torch.get_num_threads() // args.tp))
    # Rank 0's verdict decodes on one device while the others wait: a long timeout.
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=args.tp, timeout=datetime.timedelta(minutes=30))
    try:
        try:
            rc = _run_dvr(args, rank=rank)
        except ValueError as exc:  # e.g. a model whose heads do not divide: every rank raises
            if rank == 0:
                print(f"bik dvr --tp {args.tp}: {exc}", file=sys.stderr)
            rc = 2
        dist.barrier()
        if rank == 0:
            with open(rc_file, "w") as f:
                f.write(str(rc))
    finally:
        dist.destroy_process_group()
    end_spawned_rank()


def _run_dvr(args, *, rank: int | None = None) -> int:
    """One run; with ``rank`` (inside _tp_rank) on this rank's shard of the model, and only
    rank 0 prints, writes JSON and computes the verdict (on the unsharded model)."""
    device = pick_device(args.device)
    dtype = DTYPES[args.dtype]
    console = make_console() if not rank else _quiet_console()
    full = load_model(args.model, device, dtype, args.seed, tp=args.tp)
    model = full
    if rank is not None:
        from bik.dvr.tp import TensorParallelLlama

        model = TensorParallelLlama(full)
    tokenizer = _tokenizer(args.model, args.prompt)
    texts = (args.prompt or BUILT_IN_PROMPTS) if tokenizer is not None else ()
    cfg = model.config
    eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, tuple) else (
        () if cfg.eos_token_id is None else (cfg.eos_token_id,))
    arrivals = make_workload(
        vocab_size=cfg.vocab_size, num_requests=args.requests, seed=args.seed,
        det_fraction=args.det_fraction, max_new_tokens=(max(1, args.max_new_tokens // 2),
                                                        args.max_new_tokens),
        temperature=args.temperature, top_k=args.top_k, min_p=args.min_p,
        eos_token_ids=eos,
        arrival_spread=args.arrival_spread, repetitive=args.drafter > 0,
        prompts=[chat_ids(tokenizer, t) for t in texts])
    config = EngineConfig(window=args.window, group=args.group, verifier=args.verifier,
                          drafter=NgramDrafter(num_tokens=args.drafter) if args.drafter else None,
                          mismatch_rate=args.mismatch_rate, mismatch_seed=args.seed)
    engine = DVREngine(model, config, fast_kernels=FastKernels(), verify_kernels=BikKernels(),
                       device=device, dtype=dtype)
    budget = sum(a.request.max_new_tokens for a in arrivals)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("decode-verify-rollback", total=budget)

        def on_step(events):
            progress.advance(task, sum(len(e.tokens) for e in events))

        outputs = run_workload(engine, arrivals, on_step)
        verdict = None if args.no_verdict or rank else _verdict(full, arrivals, outputs,
                                                                device, dtype, progress)
    if rank:
        return 0
    summary = engine.metrics.summary()
    console.print(f"[bold]bik dvr[/]: {len(arrivals)} requests "
                  f"({sum(a.request.deterministic for a in arrivals)} deterministic), "
                  f"K={args.window}, N={args.group}, {args.verifier} verifier, forced mismatch "
                  f"rate {args.mismatch_rate}, {engine.fast.name} fast path, "
                  f"{engine.verifier.name} verifier, {device} {args.dtype}"
                  + (f", TP = {args.tp} (gloo)" if args.tp > 1 else ""))
    table = Table()
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    console.print(table)
    answers = None
    if tokenizer is not None:
        answers = _print_answers(console, tokenizer, texts, arrivals, outputs)
    if verdict is not None:
        if verdict["deterministic"]:
            console.print(f"[bold green]deterministic[/]: all {verdict['deterministic_requests']}"
                          f" deterministic outputs equal their solo bik reference"
                          + (" on one device (unsharded)" if args.tp > 1 else "")
                          + ", token for token and logprob for logprob")
        else:
            console.print(f"[bold red]NOT deterministic[/]: {verdict['mismatched']} differ from "
                          f"their solo reference")
    if args.json:
        write_json(args.json, {"meta": run_metadata(device), "args": vars(args),
                               "metrics": summary, "verdict": verdict, "answers": answers})
    return 0 if verdict is None or verdict["deterministic"] else 1
