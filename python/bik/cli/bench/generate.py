"""`bik bench generate`: a real model's greedy generate() under each front end vs stock, on the
CPU: what batch invariance costs end to end.

The model is transformers' LlamaForCausalLM with SmolLM2-135M-Instruct's architecture (30 layers,
hidden 576, intermediate 1536, 9 query / 3 KV heads, vocab 49152) and seeded random weights:
time depends on the shapes and the number of calls, not on the weights' values, and every
run generates exactly ``--new-tokens`` tokens. 8 prompts of 16 tokens in one batch, eager
attention, bf16 by default (``--quick``: 2 layers, 2 prompts, 4 tokens, no compiled run).
Each configuration runs once to warm up (and to compile, for the
compiled one), then ``REPEATS`` times; the table shows the median, the spread and the ratio to
stock.
"""

from __future__ import annotations

import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

import bik
from bik.cli.common import print_table, progress

REPEATS = 3
NOISY = 1.15  # max / min of the repeats above this: flag the row
SMOLLM2_135M = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
                "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
                "tie_word_embeddings": True}
QUICK = {**SMOLLM2_135M, "num_hidden_layers": 2, "vocab_size": 512}


def _model(dtype: torch.dtype, quick: bool):
    import transformers

    config = transformers.LlamaConfig(**(QUICK if quick else SMOLLM2_135M),
                                      attn_implementation="eager")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config).to(dtype).eval()


def _generate(model, ids, new_tokens: int):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                          pad_token_id=0)


def _configs(quick: bool) -> dict:
    """name -> (front end or None, compiled)."""
    configs = {"stock": (None, False), "bik.enable()": (bik.enabled, False),
               "batch_invariant_mode()": (bik.batch_invariant_mode, False)}
    if not quick:  # compiling takes a minute even for the 2-layer model: not a smoke test
        configs["batch_invariant_mode() + torch.compile"] = (bik.batch_invariant_mode, True)
    return configs


class _Run:
    def __init__(self, model, front=None, compiled: bool = False):
        self.model, self.front, self.compiled = model, front, compiled

    def __call__(self, ids, new_tokens):
        forward = self.model.forward
        if self.compiled:
            self.model.forward = torch.compile(forward, dynamic=True)
        try:
            with torch.no_grad():
                if self.front is None:
                    return self._timed(ids, new_tokens)
                with self.front():
                    return self._timed(ids, new_tokens)
        finally:
            self.model.forward = forward
            if self.compiled:
                torch._dynamo.reset()

    def _timed(self, ids, new_tokens):
        t0 = time.perf_counter()
        _generate(self.model, ids, new_tokens)  # warm-up (and compile)
        first = time.perf_counter() - t0
        times = []
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            _generate(self.model, ids, new_tokens)
            times.append(time.perf_counter() - t0)
        return first, times


def run(device, dtype, args) -> list[dict]:
    if device.type != "cpu":
        raise SystemExit("bik bench generate: a CPU benchmark (--device cpu)")
    quick = args.quick
    dtype = torch.bfloat16 if args.dtype is None else dtype
    new_tokens = 4 if quick else 64
    model = _model(dtype, quick)
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(3, model.config.vocab_size, (2 if quick else 8, 16), generator=gen)
    records = []
    configs = _configs(quick)
    with progress("bik bench generate", len(configs)) as advance:
        for name, (front, compiled) in configs.items():
            first, times = _Run(model, front, compiled)(ids, new_tokens)
            records.append({"op": "generate", "config": name, "first_s": first,
                            "median_s": statistics.median(times), "min_s": min(times),
                            "max_s": max(times), "noisy": max(times) > NOISY * min(times),
                            "prompts": ids.shape[0], "new_tokens": new_tokens,
                            "dtype": str(dtype).removeprefix("torch."),
                            "threads": torch.get_num_threads()})
            advance()
    base = records[0]["median_s"]
    for r in records:
        r["ratio"] = r["median_s"] / base
    return records


def render(records: list[dict], console: Console) -> None:
    r0 = records[0]
    table = Table(title=f"HF generate, SmolLM2-135M architecture, {r0['prompts']} prompts x "
                        f"{r0['new_tokens']} tokens, {r0['dtype']}, {r0['threads']} threads")
    for col in ("config", "first run s", "median s", "min-max s", "vs stock", ""):
        table.add_column(col, justify="left" if col in ("config", "") else "right")
    for r in records:
        table.add_row(r["config"], f"{r['first_s']:.1f}", f"{r['median_s']:.2f}",
                      f"{r['min_s']:.2f}-{r['max_s']:.2f}", f"{r['ratio']:.2f}x",
                      "noisy" if r["noisy"] else "")
    print_table(console, table, keys=1)


plot = None
