"""`bik bench rl`: the cost of `bik rl`'s steps with bik against stock (run it with the venv
`make test-vllm` builds: ``.venv-vllm/bin/bik bench rl``).

Each side runs `bik rl` in its own process (the plugin is process-wide) for ``1 + STEPS``
steps; step 1 (the engine's and the trainer's first calls) is left out, and the table shows the
median of the rest, with min-max, for the rollout, the trainer (forward, backward, AdamW) and
the weight sync, and bik's time relative to stock. The two sides sample other completions
(stock's tokens are not bik's), so the tokens per step are shown too. The issue's targets:
step and rollout <= 1.3x stock, trainer <= 1.5x, sync <= 1 s.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

from rich.console import Console
from rich.table import Table

from bik.cli.common import print_table, progress

STEPS = 3  # timed steps after the first
NOISY = 1.25  # max / min of a side's steps above this: flag the row
PHASES = ("rollout", "trainer", "sync", "step")
TARGETS = {"rollout": 1.3, "trainer": 1.5, "step": 1.3}  # bik / stock; sync: <= 1 s
ARGS = ["--prompts", "4", "--group", "4", "--max-tokens", "16", "--lr", "1e-4"]
plot = None


def _spawn(stock: bool, dtype: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rl.json")
        cmd = [sys.executable, "-m", "bik", "rl", *ARGS, "--steps", str(1 + STEPS),
               "--dtype", dtype, "--json", out] + (["--stock"] if stock else [])
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
        if proc.returncode:
            raise SystemExit(f"bik bench rl: the {'stock' if stock else 'bik'} run failed:\n"
                             f"{proc.stderr[-3000:]}")
        with open(out) as f:
            return json.load(f)["records"]


def run(device, dtype, args) -> list[dict]:
    import importlib.util

    from bik.rl.engine import VLLM_HINT

    if device.type != "cpu":
        raise SystemExit("bik bench rl: vLLM-CPU (--device cpu)")
    if importlib.util.find_spec("vllm") is None:
        raise SystemExit(f"bik bench rl: {VLLM_HINT}")
    dt = {"bf16": "bfloat16", None: "float32", "fp32": "float32"}.get(args.dtype)
    if dt is None:
        raise SystemExit(f"bik bench rl: --dtype fp32 or bf16, got {args.dtype}")
    records, stock = [], {}
    with progress("bik bench rl", 2) as advance:
        for side in ("stock", "bik"):
            steps = _spawn(side == "stock", dt)[1:]
            advance()
            for phase in PHASES:
                times = [s["seconds"][phase] for s in steps]
                rec = {"op": "rl step", "dtype": dt, "config": side, "phase": phase,
                       "steps": len(times), "median_s": statistics.median(times),
                       "min_s": min(times), "max_s": max(times),
                       "noisy": max(times) > NOISY * min(times),
                       "tokens": statistics.median(s["tokens"] for s in steps),
                       "max_abs_dlogprob": max(s["max_abs_dlogprob"] for s in steps)}
                if side == "bik":
                    rec["vs_stock"] = rec["median_s"] / stock[phase]
                    rec["target_met"] = (rec["median_s"] <= 1.0 if phase == "sync"
                                         else rec["vs_stock"] <= TARGETS[phase])
                else:
                    stock[phase] = rec["median_s"]
                records.append(rec)
    return records


def render(records: list[dict], console: Console) -> None:
    table = Table(title=f"bik rl steps, SmolLM2-135M-Instruct {records[0]['dtype']}, 4 prompts x "
                        f"4 completions x 16 tokens, median of {records[0]['steps']} steps, "
                        f"{os.cpu_count()} CPUs")
    for col in ("config", "phase", "median s", "min-max s", "vs stock", "target", "tokens",
                "max |dlogprob|", ""):
        table.add_column(col)
    for r in records:
        target = "" if "target_met" not in r else ("met" if r["target_met"] else "[red]missed")
        table.add_row(r["config"], r["phase"], f"{r['median_s']:.2f}",
                      f"{r['min_s']:.2f}-{r['max_s']:.2f}",
                      f"{r['vs_stock']:.2f}x" if "vs_stock" in r else "1.00x", target,
                      f"{r['tokens']:.0f}", f"{r['max_abs_dlogprob']:.3g}",
                      "[yellow]noisy" if r["noisy"] else "")
    print_table(console, table, keys=2)
