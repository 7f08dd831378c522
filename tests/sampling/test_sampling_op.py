"""bik::sample and bik::verify_draft as registered ops, and the tooling around them.

Targets: the CPU backend and the Triton kernels run on the CPU by TRITON_INTERPRET=1 (their own
process) for opcheck (the schema, fake and real paths agree; in the interpreter with top-p off,
which costs it most), an empty batch, and .backward() raising NotImplementedError naming the op.
Backend-free, in the plain process: every input error names its argument and bound,
torch.compile(fullgraph=True) keeps bik.sample as one custom op with the same bits, and
`bik bench sample --quick` on the CPU reports identical rows.
"""

from __future__ import annotations

import bik
import pytest
import torch
from sampler_inputs import PARAM_NAMES, requests
from targets import targets
from torch.library import opcheck


@pytest.mark.parametrize("target", targets())
def test_opcheck(target, gen):
    t = requests(5, 37, gen, filters="top_k_min_p" if target.small else "all")
    args = [t[k] for k in PARAM_NAMES]
    opcheck(torch.ops.bik.sample.default, (t["logits"], *args, target.backend))
    opcheck(torch.ops.bik.sample.default, (t["logits"].to(torch.bfloat16), *args,
                                           target.backend))
    logits3 = torch.randn(5, 4, 37, generator=gen)
    drafts = torch.randint(0, 37, (5, 3), generator=gen)
    nd = torch.tensor([0, 1, 2, 3, 3])
    opcheck(torch.ops.bik.verify_draft.default, (drafts, nd, logits3, *args, target.backend))


@pytest.mark.parametrize("target", targets())
def test_empty_batch(target):
    out = bik.sample(torch.randn(0, 10), seed=0, position=0, backend=target.backend)
    assert out.tokens.shape == (0,) and out.logprobs.shape == (0,)


@pytest.mark.parametrize("target", targets())
def test_backward_raises(target):
    x = torch.randn(2, 5, requires_grad=True)
    out = bik.sample(x, seed=0, position=0, backend=target.backend)
    with pytest.raises(NotImplementedError, match="bik.sample: backward"):
        out.logprobs.sum().backward()


def test_errors():
    x = torch.randn(3, 10)
    ok = {"seed": 0, "position": 0}
    with pytest.raises(ValueError, match=r"bik.sample: logits .* empty vocabulary"):
        bik.sample(torch.randn(3, 0), **ok)
    with pytest.raises(ValueError, match="must be 2-D"):
        bik.sample(torch.randn(10), **ok)
    with pytest.raises(TypeError, match="dtype float64"):
        bik.sample(x.double(), **ok)
    for bad in (0.0, 1.5, -0.1, float("nan")):
        with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
            bik.sample(x, top_p=bad, **ok)
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="temperature must be finite and >= 0"):
            bik.sample(x, temperature=bad, **ok)
    with pytest.raises(ValueError, match=r"min_p must be in \[0, 1\]"):
        bik.sample(x, min_p=1.5, **ok)
    with pytest.raises(ValueError, match=r"seed \[2\] must have one entry per row \(3\)"):
        bik.sample(x, seed=torch.tensor([1, 2]), position=0)
    with pytest.raises(TypeError, match="seed must have dtype int64; got int32"):
        bik.sample(x, seed=torch.tensor([1, 2, 3], dtype=torch.int32), position=0)
    with pytest.raises(TypeError, match="position must have dtype int64; got float32"):
        bik.sample(x, seed=0, position=torch.zeros(3))
    with pytest.raises(ValueError, match="position must be 1-D"):
        bik.sample(x, seed=0, position=torch.zeros(3, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="position must be >= 0"):
        bik.sample(x, seed=0, position=-1)
    with pytest.raises(TypeError, match="seed and position are required"):
        bik.sample(x, seed=None, position=0)
    logits3, drafts = torch.randn(3, 4, 10), torch.zeros(3, 3, dtype=torch.int64)
    for nd in (-1, 4):
        with pytest.raises(ValueError, match=r"num_drafts must be in \[0, K\] = \[0, 3\]"):
            bik.verify_draft(drafts, nd, logits3, **ok)
    with pytest.raises(ValueError, match=r"must be \[B, K\+1, V\]"):
        bik.verify_draft(torch.zeros(3, 2, dtype=torch.int64), 0, logits3, **ok)
    with pytest.raises(TypeError, match="draft_tokens must be int32 or int64"):
        bik.verify_draft(drafts.float(), 0, logits3, **ok)
    with pytest.raises(ValueError, match="empty vocabulary"):
        bik.verify_draft(drafts, 0, torch.randn(3, 4, 0), **ok)
    with pytest.raises(ValueError, match="unknown backend"):
        bik.sample(x, backend="gpu", **ok)


@pytest.mark.parametrize("target", targets())
def test_every_64_bit_seed_is_accepted_with_its_bits(target):
    """Seeds in [0, 2**64) (random.getrandbits(64)): one >= 2**63 draws what the int64 of the
    same bits draws, as a tensor; 2**64 and -1 are errors naming the op. Before, 2**63 raised
    torch's unnamed int64 overflow error."""
    x = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    draw = lambda seed: bik.sample(x, seed=seed, position=5, temperature=1.0,
                                   backend=target.backend).tokens
    for seed in (0, 2**63 - 1, 2**63, 2**64 - 1):
        bits = seed - 2**64 if seed >= 2**63 else seed
        assert torch.equal(draw(seed), draw(torch.full((3,), bits, dtype=torch.int64)))
    assert not torch.equal(torch.stack([draw(s) for s in range(2**63, 2**63 + 8)]),
                           torch.stack([draw(s) for s in range(8)]))  # the high bit matters
    for bad in (2**64, -1):
        with pytest.raises(ValueError, match=r"bik.sample: seed must be in \[0, 2\*\*64\)"):
            draw(bad)
    with pytest.raises(ValueError, match="bik.sample: top_k must fit in int64"):
        bik.sample(x, seed=1, position=0, top_k=2**63, backend=target.backend)


@pytest.mark.parametrize("target", targets())
def test_a_tiny_temperature_draws_greedily(target):
    """0 < T < 1e-5 draws as T = 0 (the limit of Gumbel-max as T -> 0+), on every backend, in
    sample and verify_draft. Before, T = 1e-40 overflowed x / T and the row came back invalid
    (token -1, logprob NaN). From 1e-5 on the row is tempered: a near-tie is then decided by
    the noise, so some seed draws the other token."""
    x = torch.tensor([[1.0, 3.0, 3.0 - 1e-6, -2.0], [0.5, -1.0, 2.0, 2.0]])
    greedy = bik.sample(x, seed=9, position=3, temperature=0.0, backend=target.backend)
    assert greedy.tokens.tolist() == [1, 2]
    for t in (1e-40, 1e-20, 9.99e-6):
        out = bik.sample(x, seed=9, position=3, temperature=t, backend=target.backend)
        assert torch.equal(out.tokens, greedy.tokens)
        assert torch.equal(out.logprobs, greedy.logprobs)
    verified = bik.verify_draft(torch.tensor([[1]]), torch.tensor([1]), x[None, :2], seed=9,
                                position=3, temperature=1e-30, backend=target.backend)
    assert verified.num_accepted.tolist() == [1] and verified.tokens.tolist() == [[1, 2]]
    # Row 1 ties exactly at 2.0: tempered (T = 1e-5), the noise picks 2 or 3 by seed.
    tempered = {int(bik.sample(x[1:], seed=s, position=3, temperature=1e-5,
                               backend=target.backend).tokens) for s in range(8)}
    assert tempered == {2, 3}


def test_torch_compile_fullgraph_keeps_the_op():
    """bik.sample traces as one custom op under torch.compile(fullgraph=True), same bits."""
    torch._dynamo.reset()
    x, pos = torch.randn(4, 50), torch.arange(4)

    def f(x, pos):
        return bik.sample(x, seed=3, position=pos, temperature=0.7, top_k=5)

    ops = []

    def capture(gm, example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    got = torch.compile(f, fullgraph=True, backend=capture)(x, pos)
    assert "bik.sample" in ops
    want = f(x, pos)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.logprobs, want.logprobs)
    torch._dynamo.reset()


def test_bench_sample_quick(tmp_path):
    import json

    from bik.cli.main import main

    path = tmp_path / "sample.json"
    assert main(["bench", "sample", "--quick", "--device", "cpu", "--json", str(path)]) == 0
    records = json.loads(path.read_text())["records"]
    assert records and all(r["bik_rows_identical"] for r in records)
