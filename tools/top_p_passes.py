"""How many passes the Triton top-p search takes on SmolLM2-135M's real next-token logits.

The count depends on the logits alone (every probe's mass is exact), so the interpreter's count
is the GPU's. On a CPU machine run it with TRITON_INTERPRET=1 (about a minute a row):

    TRITON_INTERPRET=1 .venv/bin/python tools/top_p_passes.py OUT.json [--rows-per-prompt N]

Each row's cut is also checked against reference.top_p_cut (the contract read literally).
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

PROMPTS = ("The capital of France is", "def fibonacci(n):",
           "Once upon a time, in a small village,", "The three laws of thermodynamics state that",
           "Translate to German: I like apples.", "1, 2, 3, 5, 8, 13,")
SETTINGS = ((0.7, 0.9), (1.0, 0.9), (1.0, 0.95))  # (temperature, top_p)


def main() -> None:
    from bik.configs import sampler_chunks
    from bik.models.smollm2 import load
    from bik.ops.sampling import reference
    from bik.ops.sampling.triton_top_p import TOP_P_PASSES, top_p_cut

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--rows-per-prompt", type=int, default=1,
                    help="the last N positions of each prompt (default 1)")
    args = ap.parse_args()
    model, tok = load()
    with torch.no_grad():
        x = torch.cat([model(tok(p, return_tensors="pt").input_ids).logits[0,
                                                                           -args.rows_per_prompt:]
                       for p in PROMPTS]).float()
    results = []
    for temperature, top_p in SETTINGS:
        z = x / temperature
        t0 = time.time()
        cut, _, passes = top_p_cut(z, top_p)
        exact = torch.equal(cut, reference.top_p_cut(z, top_p, *sampler_chunks(z.shape[1])))
        results.append({"temperature": temperature, "top_p": top_p, "passes": passes.tolist(),
                        "cut_is_the_contracts": exact,
                        "kept_tokens": (z >= cut[:, None]).sum(1).tolist()})
        print(results[-1], f"{time.time() - t0:.0f} s", flush=True)
    record = {"what": "Triton top-p search passes per row (bisection: 34)", "model": "SmolLM2-135M-Instruct",
              "vocab": x.shape[1], "rows": x.shape[0], "max_passes": TOP_P_PASSES,
              "prompts": PROMPTS, "torch": torch.__version__, "host": platform.node(),
              "date": time.strftime("%Y-%m-%d"), "results": results}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
