"""The Triton sampler in a handful of launches: what one bik.sample call costs the host.

A decode step samples once per step, so at B = 1 the sampler's time is its launches and the
torch ops around them, not its arithmetic. Counted per call (tests/launch_count.py: the
launches, and the aten ops the call issues itself): with temperature only and the host
metadata an engine has (max_top_k = 0, any_top_p = False) at most 6 launches and 8 aten ops;
with top-p 0.9 on SmolLM2's real next-token logits (bench/data, tools/make_sampler_fixture.py)
at most 6 + 2 P launches, P <= 4 the passes the search took. Each call's tokens and logprobs
are the CPU backend's, bit for bit. Controls: without any_top_p the search's launches are
counted (the counter sees launches), and with a Python-float temperature the broadcast is
counted (it sees aten ops).
"""

from __future__ import annotations

from pathlib import Path

import bik
import pytest
import torch
from launch_count import count_calls
from targets import targets

pytestmark = pytest.mark.parametrize("target", targets("interpreter", "gpu-triton"))

FIXTURE = Path(__file__).parents[2] / "bench" / "data" / "smollm2-logits-bf16.safetensors"


def _rows(device, rows: int, **overrides) -> dict:
    params = {"seed": torch.arange(rows) + 7, "position": torch.arange(rows) + 40,
              "temperature": torch.full((rows,), 0.8),
              "top_k": torch.zeros(rows, dtype=torch.int64),
              "top_p": torch.ones(rows), "min_p": torch.zeros(rows)} | overrides
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in params.items()}


def _same_as_cpu(x, params, out, **metadata):
    want = bik.sample(x.cpu(), **{k: v.cpu() if isinstance(v, torch.Tensor) else v
                                  for k, v in params.items()}, **metadata, backend="cpu")
    assert torch.equal(out.tokens.cpu(), want.tokens)
    assert torch.equal(out.logprobs.cpu().view(torch.int32), want.logprobs.view(torch.int32))


def test_temperature_only_is_four_launches_and_four_allocations(target, gen):
    x = (torch.randn(3, 1000, generator=gen) * 3).to(target.device)
    params = _rows(target.device, 3)
    bik.sample(x, **params, max_top_k=0, any_top_p=False, backend="triton")  # compiled, cached
    with count_calls() as calls:
        out = bik.sample(x, **params, max_top_k=0, any_top_p=False, backend="triton")
    assert len(calls.launches) <= 6 and calls.aten_ops <= 8, (calls.launches, calls.aten)
    assert calls.launches == ["group_max_kernel", "group_mass_kernel", "gumbel_pick_kernel",
                              "finish_kernel"]
    assert set(calls.aten) == {"aten::empty"}, calls.aten
    _same_as_cpu(x, params, out)

    # Controls: the counter sees the top-p search's launches when the host does not rule it
    # out, and a scalar parameter's broadcast (one aten::full).
    with count_calls() as unknown:
        again = bik.sample(x, **params, max_top_k=0, backend="triton")
    assert "top_p_pass_kernel" in unknown.launches and len(unknown.launches) > 6
    assert torch.equal(again.tokens, out.tokens)
    with count_calls() as scalar:
        bik.sample(x, **(params | {"temperature": 0.8}), max_top_k=0, any_top_p=False,
                   backend="triton")
    assert scalar.aten["aten::full"] == 1 and scalar.aten_ops == calls.aten_ops + 1


def test_top_p_on_real_logits_takes_few_passes_and_launches(target, monkeypatch):
    """Row 0 of the SmolLM2 fixture (49152 tokens) at T = 1, top-p 0.9."""
    from safetensors.torch import load_file
    from bik.ops.sampling import triton as sampler

    x = load_file(FIXTURE)["logits"][:1].to(target.device)
    params = _rows(target.device, 1, temperature=torch.ones(1), top_p=torch.full((1,), 0.9))
    taken = []
    search = sampler.launch_top_p_stats
    monkeypatch.setattr(sampler, "launch_top_p_stats",
                        lambda *a, **k: taken.append(search(*a, **k)) or taken[-1])
    with count_calls() as calls:
        out = bik.sample(x, **params, max_top_k=0, backend="triton")
    passes = int(taken[0].max())
    assert 2 <= passes <= 4, passes
    assert len(calls.launches) <= 6 + 2 * passes, calls.launches
    _same_as_cpu(x, params, out, max_top_k=0)
