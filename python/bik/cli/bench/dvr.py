"""`bik bench dvr`: what determinism costs in the decode-verify-rollback loop.

Six runs of the same request stream on the same random-weight model: the fast path alone
(ordinary kernels, nothing verified), decoding on bik kernels only (no verifier), the loop with
100% and 10% deterministic traffic, and the loop with 1% and 5% of the fast path's tokens forced
wrong (the overhead curve). ``tokens_per_s`` counts committed tokens over the run's wall time;
``vs_fast`` divides by the fast path's; ``det_outputs_equal_bik_only`` checks that the
deterministic requests' outputs are those of bik-only decoding. Target (on a GPU with
Llama-3.2-1B shapes): the loop at 100% deterministic traffic >= 0.9x the fast path.
"""

from __future__ import annotations

import torch
from rich.console import Console
from rich.table import Table

from bik._dtypes import dtype_name
from bik.dvr import DVREngine, EngineConfig
from bik.dvr.kernels import BikKernels, FastKernels
from bik.dvr.workload import make_workload, run_workload

__all__ = ["bench_dvr", "plot", "render", "render_dvr", "run"]

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


def bench_dvr(device, dtype, quick: bool, *, window: int = 16, group: int = 8,
              repeats: int = 3) -> list[dict]:
    """Each run repeated ``repeats`` times after one untimed warm-up; the median-time
    repetition is recorded."""
    model, model_name = _model(device, dtype, quick)
    on_gpu = device.type == "cuda"
    num_requests = 8 if quick else 64 if on_gpu else 32
    max_new = (8, 16) if quick else (96, 128) if on_gpu else (48, 64)
    repeats = 1 if quick else repeats
    records = []
    for i, (name, decode, verify, det, mismatch) in enumerate(RUNS):
        arrivals = make_workload(vocab_size=model.config.vocab_size, num_requests=num_requests,
                                 seed=0, det_fraction=det, prompt_len=(16, 64),
                                 max_new_tokens=max_new, temperature=0.0)
        config = EngineConfig(window=window, group=group, verify=verify,
                              mismatch_rate=mismatch, num_blocks=num_requests * 16,
                              block_size=16)
        if i == 0:
            _run_once(model, device, dtype, arrivals, config, decode)  # warm-up
        runs = sorted((_run_once(model, device, dtype, arrivals, config, decode)
                       for _ in range(repeats)), key=lambda s: s["wall_s"])
        s = runs[len(runs) // 2]
        tokens = s.pop("tokens")
        det_ids = [a.request.request_id for a in arrivals if a.request.deterministic]
        s["_det_tokens"] = {rid: tokens[rid] for rid in det_ids}
        records.append({"op": "dvr", "run": name, "model": model_name,
                        "dtype": dtype_name(dtype), "requests": num_requests,
                        "window": window, "group": group, "det_fraction": det,
                        "mismatch_rate": mismatch,
                        "repeats": repeats, "tokens_per_s": s["committed_tokens_per_s"], **s})
    fast_rate = records[0]["tokens_per_s"]
    bik_only = records[1]["_det_tokens"]
    for r in records:
        r["vs_fast"] = r["tokens_per_s"] / fast_rate if fast_rate else 0.0
        # Deterministic requests must decode exactly as under bik-only decoding (invariant,
        # so equal to each request decoded alone); the fast path alone may drift.
        det = r.pop("_det_tokens")
        r["det_outputs_equal_bik_only"] = all(det[rid] == bik_only[rid] for rid in det)
    return records


def render_dvr(records: list[dict], console: Console) -> None:
    table = Table(title=f"bik bench dvr ({records[0]['model']}, {records[0]['dtype']}, "
                        f"K={records[0]['window']}, N={records[0]['group']})")
    for col in ("run", "tokens/s", "vs fast", "recompute", "rollback rate",
                "verify rows / token"):
        table.add_column(col, justify="left" if col == "run" else "right")
    for r in records:
        table.add_row(r["run"], f"{r['tokens_per_s']:.1f}", f"{r['vs_fast']:.2f}",
                      f"{r['recompute_fraction']:.3f}", f"{r['rollback_rate']:.3f}",
                      f"{r['verify_rows_per_committed']:.2f}")
    console.print(table)


def run(device, dtype, args) -> list[dict]:
    return bench_dvr(device, dtype, args.quick)


render = render_dvr
plot = None  # six runs: the table and --json hold them
