"""`bik demo --real`: HF generate on the real SmolLM2-135M-Instruct (bik.models.smollm2), 8 chat
prompts each alone and in one left-padded batch, the way HF users batch: stock torch vs
bik.batch_invariant_mode(), and the answers where stock's differ.

bf16 and HF's default (sdpa) attention by default. Measured on the CPU (issue 13): stock gave
3 of 8 prompts other tokens in the batch; bik none. Takes a few minutes on 2 cores.
"""

from __future__ import annotations

import torch
from rich.table import Table

import bik
from bik.cli.common import make_console, print_table

PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.",
           "Give me three tips for learning Python.", "Why is the sky blue?",
           "What is 12 times 7?", "Name three primary colors.",
           "How do I boil an egg?", "Translate 'good morning' into Spanish.")


def run_demo_real(args) -> int:
    import transformers

    from bik.models import smollm2
    from bik.testing.generate import alone_vs_left_padded

    transformers.utils.logging.disable_progress_bar()
    console = make_console()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    path = smollm2.prepare()
    model = transformers.LlamaForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=args.attention).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, padding_side="left")
    runs = {}
    for name, front in (("stock", None), ("bik", bik.batch_invariant_mode)):
        with console.status(f"{name}: {len(PROMPTS)} prompts alone, then batched"):
            runs[name] = alone_vs_left_padded(model, tokenizer, PROMPTS,
                                              new_tokens=args.new_tokens, front=front)
    table = Table(title=f"SmolLM2-135M-Instruct, {args.dtype}, {args.attention} attention: "
                        f"each prompt alone vs in a left-padded batch of {len(PROMPTS)}")
    for col in ("prompt", "stock tokens", "stock logprob bits", "bik tokens",
                "bik logprob bits"):
        table.add_column(col)
    mark = lambda ok: "same" if ok else "[red]differ"
    for s, b in zip(runs["stock"], runs["bik"]):
        table.add_row(s.prompt, mark(s.tokens_equal), mark(s.logprobs_equal),
                      mark(b.tokens_equal), mark(b.logprobs_equal))
    print_table(console, table, keys=1)
    for s in runs["stock"]:
        if not s.tokens_equal:
            console.print(f"[bold]{s.prompt}[/]\n  stock alone:   {s.alone}\n"
                          f"  stock batched: {s.batched}")
    bik_same = all(r.same for r in runs["bik"])
    console.print(f"stock: {sum(not r.tokens_equal for r in runs['stock'])} of {len(PROMPTS)} "
                  f"prompts got other tokens in the batch; bik: "
                  f"{'every prompt its own bits' if bik_same else '[red]bits changed (bug)'}")
    return 0 if bik_same else 1
