"""`bik bench dvr`: what determinism costs in the decode-verify-rollback loop.

Six runs of the same request stream on the same random-weight model: the fast path alone
(ordinary kernels, nothing verified), decoding on bik kernels only (no verifier), the loop with
100% and 10% deterministic traffic, and the loop with 1% and 5% of the fast path's tokens forced
wrong (the overhead curve). ``tokens_per_s`` counts committed tokens over the run's wall time;
``vs_fast`` divides by the fast path's; ``det_outputs_equal_bik_only`` checks that the
deterministic requests' outputs are those of bik-only decoding. Target (on a GPU with
Llama-3.2-1B shapes): the loop at 100% deterministic traffic >= 0.9x the fast path.

``--model smollm2``: the real SmolLM2-135M-Instruct (bik.models.smollm2), its chat prompts
(8 requests, 64 new tokens, greedy, K = 4, N = 4), the first four runs once each, and HF
``generate`` on the same prompts as one left-padded batch (stock torch, sdpa) alongside:
``vs_hf`` divides by its tokens/s. Target (CPU): the loop at 100% deterministic >= 0.8x HF.
"""

from __future__ import annotations

import torch
from rich.console import Console
from rich.table import Table

from bik._dtypes import dtype_name
from bik.cli.common import print_table, progress
from bik.dvr import DVREngine, EngineConfig
from bik.dvr.kernels import BikKernels, FastKernels
from bik.dvr.workload import make_workload, run_workload

RUNS = (  # (name, decode kernels, verify, deterministic fraction, forced mismatch rate)
    ("fast path alone", "fast", False, 1.0, 0.0),
    ("bik kernels only", "bik", False, 1.0, 0.0),
    ("dvr, 100% deterministic", "fast", True, 1.0, 0.0),
    ("dvr, 10% deterministic", "fast", True, 0.1, 0.0),
    # The overhead curve: rollbacks forced at a per-token rate (recompute ~ rate * K / 2).
    ("dvr, 100% det, 1% forced mismatches", "fast", True, 1.0, 0.01),
    ("dvr, 100% det, 5% forced mismatches", "fast", True, 1.0, 0.05),
)


def _model(device, dtype, quick: bool):
    from bik.dvr.model import embedded_model, llama_1b_config, random_model

    if device.type == "cuda" and not quick:
        return random_model(llama_1b_config(), seed=0, dtype=dtype, device=device), "llama-3.2-1b"
    return embedded_model(seed=0, dtype=dtype, device=device), "embedded-tiny"


def _run_once(model, device, dtype, arrivals, config, decode):
    fast = FastKernels() if decode == "fast" else BikKernels()
    engine = DVREngine(model, config, fast_kernels=fast, verify_kernels=BikKernels(),
                       device=device, dtype=dtype)
    outputs = run_workload(engine, arrivals)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return engine.metrics.summary() | {
        "tokens": {rid: out.tokens for rid, out in outputs.items()}}


def _real_model(device, dtype):
    """SmolLM2's bik.dvr model, its tokenizer and the tokenized built-in chat prompts."""
    import transformers

    from bik.cli.dvr import BUILT_IN_PROMPTS, chat_ids
    from bik.dvr.model import load_checkpoint
    from bik.models import smollm2

    path = smollm2.prepare()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, padding_side="left")
    prompts = [chat_ids(tokenizer, t) for t in BUILT_IN_PROMPTS]
    return load_checkpoint(path, dtype=dtype, device=device), path, tokenizer, prompts


def _hf_generate(path, tokenizer, prompts, new_tokens: int, dtype) -> dict:
    """Stock HF generate on the same prompts, one left-padded batch, exactly ``new_tokens``."""
    import time

    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=dtype).eval()
    enc = tokenizer.pad({"input_ids": prompts}, return_tensors="pt")
    kwargs = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False,
              "pad_token_id": tokenizer.pad_token_id}
    with torch.no_grad():
        model.generate(**enc, **kwargs)  # warm-up
        t0 = time.perf_counter()
        model.generate(**enc, **kwargs)
        wall = time.perf_counter() - t0
    return {"op": "dvr", "run": "HF generate (stock, sdpa)", "wall_s": wall,
            "tokens_per_s": len(prompts) * new_tokens / wall}


def bench_dvr(device, dtype, quick: bool, *, window: int = 16, group: int = 8,
              repeats: int = 3, real: bool = False) -> list[dict]:
    """Each run repeated ``repeats`` times after one untimed warm-up; the median-time
    repetition is recorded."""
    on_gpu = device.type == "cuda"
    prompts, runs = (), RUNS
    if real:
        model, path, tokenizer, prompts = _real_model(device, dtype)
        model_name, repeats, window, group, runs = "smollm2-135m-instruct", 1, 4, 4, RUNS[:4]
        num_requests, max_new = (4, (8, 8)) if quick else (8, (64, 64))
    else:
        model, model_name = _model(device, dtype, quick)
        num_requests = 8 if quick else 64 if on_gpu else 32
        max_new = (8, 16) if quick else (96, 128) if on_gpu else (48, 64)
    repeats = 1 if quick else repeats
    records = []
    with progress("bik bench dvr", len(runs)) as advance:
        for i, (name, decode, verify, det, mismatch) in enumerate(runs):
            arrivals = make_workload(vocab_size=model.config.vocab_size, num_requests=num_requests,
                                     seed=0, det_fraction=det, prompt_len=(16, 64),
                                     max_new_tokens=max_new, temperature=0.0, prompts=prompts)
            config = EngineConfig(window=window, group=group, verify=verify,
                                  mismatch_rate=mismatch, num_blocks=num_requests * 16,
                                  block_size=16)
            if i == 0:
                _run_once(model, device, dtype, arrivals, config, decode)  # warm-up
            timed = sorted((_run_once(model, device, dtype, arrivals, config, decode)
                            for _ in range(repeats)), key=lambda s: s["wall_s"])
            s = timed[len(timed) // 2]
            tokens = s.pop("tokens")
            det_ids = [a.request.request_id for a in arrivals if a.request.deterministic]
            s["_det_tokens"] = {rid: tokens[rid] for rid in det_ids}
            records.append({"op": "dvr", "run": name, "model": model_name,
                            "dtype": dtype_name(dtype), "requests": num_requests,
                            "window": window, "group": group, "det_fraction": det,
                            "mismatch_rate": mismatch,
                            "repeats": repeats, "tokens_per_s": s["committed_tokens_per_s"], **s})
            advance()
    fast_rate = records[0]["tokens_per_s"]
    bik_only = records[1]["_det_tokens"]
    for r in records:
        r["vs_fast"] = r["tokens_per_s"] / fast_rate if fast_rate else 0.0
        # Deterministic requests must decode exactly as under bik-only decoding (invariant,
        # so equal to each request decoded alone); the fast path alone may drift.
        det = r.pop("_det_tokens")
        r["det_outputs_equal_bik_only"] = all(det[rid] == bik_only[rid] for rid in det)
    if real:
        hf = _hf_generate(path, tokenizer, prompts, max_new[1], dtype)
        for r in records:
            r["vs_hf"] = r["tokens_per_s"] / hf["tokens_per_s"]
        records.append(hf | {"model": model_name, "dtype": dtype_name(dtype), "vs_hf": 1.0,
                             "vs_fast": hf["tokens_per_s"] / fast_rate if fast_rate else 0.0})
    return records


def _same(ok) -> str:
    """The determinism check's cell: deterministic outputs equal bik-only decoding's."""
    return "" if ok is None else "yes" if ok else "[red]NO"


def render_dvr(records: list[dict], console: Console) -> None:
    table = Table(title=f"bik bench dvr ({records[0]['model']}, {records[0]['dtype']}, "
                        f"K={records[0]['window']}, N={records[0]['group']})")
    real = "vs_hf" in records[0]
    cols = ("run", "tokens/s", "vs fast") + (("vs HF",) if real else ()) + (
        "recompute", "rollback rate", "verify rows / token", "det = bik-only")
    for col in cols:
        table.add_column(col, justify="left" if col == "run" else "right")
    for r in records:
        engine = "recompute_fraction" in r  # the HF row has no engine metrics
        table.add_row(r["run"], f"{r['tokens_per_s']:.1f}", f"{r['vs_fast']:.2f}",
                      *((f"{r['vs_hf']:.2f}",) if real else ()),
                      *((f"{r['recompute_fraction']:.3f}", f"{r['rollback_rate']:.3f}",
                         f"{r['verify_rows_per_committed']:.2f}") if engine else ("",) * 3),
                      _same(r.get("det_outputs_equal_bik_only")))
    print_table(console, table, keys=1)


def run(device, dtype, args) -> list[dict]:
    model = getattr(args, "model", None)
    if model not in (None, "smollm2"):
        raise SystemExit(f"bik bench dvr: --model {model!r}: only 'smollm2' (or none)")
    return bench_dvr(device, dtype, args.quick, real=model == "smollm2")


render = render_dvr
plot = None  # six runs: the table and --json hold them
