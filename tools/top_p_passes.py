"""How many passes the Triton top-p search takes on SmolLM2-135M's real next-token logits.

The count depends on the logits alone (every probe's mass is exact), so the interpreter's count
is the GPU's. On a CPU machine run it with TRITON_INTERPRET=1 (about a minute a row):

    TRITON_INTERPRET=1 .venv/bin/python tools/top_p_passes.py OUT.json [--rows-per-prompt N]

Each row's cut is also checked against reference.top_p_cut (the contract read literally).
:func:`top_p_cut` (the search alone, on given logits) is also what
tests/sampling/test_sampling_top_p_search.py runs; it lives here, not in the shipped package,
because only this tool and the tests call it.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
from bik._arch import device_arch
from bik.configs import sampler_chunks, sampling_config
from bik.ops._normaliser_triton import NO_FUSION
from bik.ops.sampling.triton_common import Workspace, _chunks_per_tile
from bik.ops.sampling.triton_groups import launch_group_max
from bik.ops.sampling.triton_top_p import TOP_P_PASSES, launch_top_p_stats

PROMPTS = ("The capital of France is", "def fibonacci(n):",
           "Once upon a time, in a small village,", "The three laws of thermodynamics state that",
           "Translate to German: I like apples.", "1, 2, 3, 5, 8, 13,")
SETTINGS = ((0.7, 0.9), (1.0, 0.9), (1.0, 0.95))  # (temperature, top_p)


def top_p_cut(logits: torch.Tensor, top_p: float, *, passes: int = TOP_P_PASSES):
    """(v_p, bik_log of the kept mass, passes taken) per row of fp32 logits [B, V] at T = 1,
    top-k and min-p off; ``passes`` below TOP_P_PASSES cuts the search short (a control)."""
    b, v = logits.shape
    dev = logits.device
    cfg = sampling_config(device_arch(dev))
    groups, chunk = sampler_chunks(v)
    ws = Workspace.allocate(b, groups, 1, dev)
    ones = torch.ones(b, dtype=torch.float32, device=dev)
    launch_group_max(logits, ones, None, None, ws, block=cfg.block, num_warps=cfg.num_warps,
                     options=NO_FUSION)
    taken = launch_top_p_stats(logits, ones, None, None, ones * top_p, ones * 0, ws,
                               chunk=chunk, nch=_chunks_per_tile(device_arch(dev), chunk),
                               num_warps=cfg.num_warps, options=NO_FUSION, passes=passes)
    return ws.column("v_lo"), ws.column("log_s"), taken


def main() -> None:
    from bik.models.smollm2 import load
    from bik.ops.sampling import reference

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
