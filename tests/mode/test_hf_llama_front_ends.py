"""A real client under every front end, eager and compiled: HF LlamaForCausalLM (random
weights, intermediate size 176 so that vector tails run), next-token logits of each prompt
alone equal its row in a batch of 8, bit for bit.

Prompts are one token long: that is where stock CPU fp32 is measured not invariant (a row at
M = 1 differs from the same row at M >= 4), and the stock compiled model is shown to fail the
same check. Equal-length prompts, no padding (padding: docs/integration.md).
"""

import bik
import pytest
import torch
from bik.runtime import cpu_ext
from bik.testing import rows_alone_vs_batched
from test_hf_llama import VOCAB
from test_hf_llama import make_model as make_llama

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason="CPU extension not built")

FRONT_ENDS = {"mode": bik.batch_invariant_mode, "enabled": bik.enabled}


def make_model(attention: str):
    return make_llama(attention=attention, intermediate_size=176)  # 176: vector tails


def prompts(n: int = 8, length: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3000 + length)
    return torch.randint(3, VOCAB, (n, length), generator=gen)


def logits_fn(model, compiled: bool):
    forward = (torch.compile(model, fullgraph=True, dynamic=False) if compiled else model)
    return lambda ids: forward(input_ids=ids, use_cache=False).logits[:, -1]


@pytest.fixture(autouse=True)
def _fresh(fresh_dynamo):
    yield


# Under torch.compile, transformers (with torch < 2.14) always hands SDPA an explicit causal
# mask: the compiled graph runs stock SDPA with it, and the call reaches bik at run time (the
# dispatch layer, or enable()'s override), which compacts the mask (mode/_masks.py).
CONFIGS = [("eager", False), ("sdpa", False), ("eager", True), ("sdpa", True)]


@pytest.mark.parametrize("attention,compiled", CONFIGS,
                         ids=["eager-attention", "sdpa", "eager-attention-compiled",
                              "sdpa-compiled"])
@pytest.mark.parametrize("front", FRONT_ENDS)
def test_logits_alone_equal_their_row_in_a_batch_of_8(front, attention, compiled):
    model = make_model(attention)
    with torch.no_grad(), FRONT_ENDS[front]():
        fn = logits_fn(model, compiled)
        report = rows_alone_vs_batched(fn, prompts(), (1, 8), name=f"llama {front}")
        stats = bik.mode_stats()
    assert report.ok, report
    if not compiled or front == "enabled":  # compiled graphs under the mode are not counted
        assert stats.routed and not stats.fallbacks, stats


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_stock_fails_the_same_check(compiled):
    """Measured here: at prompt length 1 all 8 rows differ alone vs in the batch of 8."""
    with torch.no_grad():
        report = rows_alone_vs_batched(logits_fn(make_model("eager"), compiled), prompts(),
                                       (1, 8), name="stock llama")
    assert not report.ok


@pytest.mark.parametrize("front", FRONT_ENDS)
def test_compiled_logits_equal_eager_logits(front):
    """Values, not just invariance: the compiled model under a front end agrees with the
    eager one under it (Inductor may round its fused elementwise ops differently) and with
    stock torch."""
    model = make_model("eager")
    ids = prompts()
    with torch.no_grad():
        stock = model(input_ids=ids, use_cache=False).logits
        with FRONT_ENDS[front]():
            eager = logits_fn(model, False)(ids)
            compiled = logits_fn(model, True)(ids)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(compiled, stock[:, -1], rtol=1e-4, atol=1e-5)
