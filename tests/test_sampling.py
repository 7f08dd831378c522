"""bik.sample / bik.verify_draft on the CPU backend, the noise's building blocks, the sampled
distribution, and the sm_90 / sm_80 code of the Triton pick kernel (compiled, not run).

The Triton kernels run under the interpreter in tests/test_sampling_interpreter.py, which also
compares them with the CPU path token for token and the noise bit for bit on all 2^23 u values.
"""

import math
import re

import bik
import numpy as np
import pytest
import sampling_cases as sc
import torch
from bik.ops.sampling import bik_log_torch
from bik.ops.sampling import cpu as cpu_sampling

CPU = "cpu"
N_DRAWS = 1_000_000
# Per chi-square test, the probability that a correct sampler fails (a fixed seed makes the
# outcome deterministic; this is the chance that a given seed is unlucky).
FALSE_FAILURE = 1e-9


def test_philox_known_answers():
    for counter, key, want in sc.philox_kat():
        got = cpu_sampling.philox4x32_10(torch.tensor([counter]), torch.tensor([key]))
        assert tuple(got[0].tolist()) == want


def test_noise_over_every_u_is_finite_and_in_range():
    g = cpu_sampling.gumbel_from_unit(sc.all_units())
    assert torch.isfinite(g).all()
    assert g.min().item() == sc.G_MIN and g.max().item() == sc.G_MAX
    # Monotone in u (the map from bits to noise preserves order, so no u is special).
    assert (g[1:] >= g[:-1]).all()
    ref = -np.log(-np.log(sc.all_units().double().numpy()))
    assert np.abs(g.double().numpy() - ref).max() < 1e-6


def _ulp_error(got: torch.Tensor, x: torch.Tensor) -> float:
    exact = np.log(x.double().numpy())
    ulp = np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
    return float((np.abs(got.double().numpy() - exact) / ulp).max())


def _log_domain() -> list[torch.Tensor]:
    """The sampler's log inputs (every u and every -log(u)) and every mantissa at several
    exponents, including the smallest and largest normal binades."""
    u = sc.all_units()
    mant = (torch.arange(2**23, dtype=torch.int32) | (127 << 23)).view(torch.float32)
    return [u, -cpu_sampling.bik_log(u)] + [mant * 2.0**e for e in (-126, -20, -1, 0, 1, 60, 127)]


def test_bik_log_accuracy_and_torch_replica():
    worst = 0.0
    for x in _log_domain():
        got = cpu_sampling.bik_log(x)
        worst = max(worst, _ulp_error(got, x))
        # The torch replica (used for min_p on every backend) gives the same bits.
        assert torch.equal(bik_log_torch(x).view(torch.int32), got.view(torch.int32))
    assert worst < 2.0, worst  # measured: 1.64 ulp
    assert cpu_sampling.bik_log(torch.tensor([1.0])).item() == 0.0


def _chi2_sf(stat: float, df: int) -> float:
    """Survival function of the chi-square distribution with integer df (exact series)."""
    half = stat / 2
    if df % 2 == 0:
        term, total = 1.0, 1.0
        for i in range(1, df // 2):
            term *= half / i
            total += term
        return math.exp(-half) * total
    total = math.erfc(math.sqrt(half))
    term = math.sqrt(half) * math.exp(-half) / math.sqrt(math.pi) * 2
    for i in range(1, (df + 1) // 2):
        total += term
        term *= half / (i + 0.5)
    return total


def _expected(logits: torch.Tensor, t: float, top_k: int, top_p: float, min_p: float):
    """The tempered, filtered distribution in fp64 (top-k, then top-p with ties kept, min-p)."""
    z = logits.double() / t
    keep = torch.ones_like(z, dtype=torch.bool)
    if 0 < top_k < len(z):
        keep &= torch.zeros_like(keep).scatter(0, torch.argsort(-z, stable=True)[:top_k], True)
    p = torch.softmax(z.masked_fill(~keep, -math.inf), 0)
    if top_p < 1:
        order = torch.argsort(-p, stable=True)
        cut = int((torch.cumsum(p[order], 0) >= top_p).nonzero()[0, 0])
        keep &= p >= p[order[cut]]
    p = torch.softmax(z.masked_fill(~keep, -math.inf), 0)
    keep &= p >= min_p * p.max()
    return torch.softmax(z.masked_fill(~keep, -math.inf), 0)


DISTRIBUTION_CASES = [  # (temperature, top_k, top_p, min_p)
    (1.0, 0, 1.0, 0.0), (0.5, 0, 1.0, 0.0), (2.5, 0, 1.0, 0.0), (1.0, 3, 1.0, 0.0),
    (0.8, 0, 0.7, 0.0), (1.3, 0, 1.0, 0.2), (1.0, 5, 0.9, 0.05),
]


@pytest.mark.parametrize("case", DISTRIBUTION_CASES, ids=str)
def test_distribution_chi_square(case):
    """10^6 draws (one row per draw: positions 0..10^6-1) match the categorical exactly."""
    t, top_k, top_p, min_p = case
    logits = torch.tensor([1.2, -0.3, 0.4, 2.0, -1.1, 0.9, 0.0, -2.2])
    probs = _expected(logits, t, top_k, top_p, min_p)
    out = bik.sample(logits.expand(N_DRAWS, -1), seed=1234, position=torch.arange(N_DRAWS),
                     temperature=t, top_k=top_k, top_p=top_p, min_p=min_p, backend=CPU)
    counts = torch.bincount(out.tokens, minlength=len(logits)).double()
    kept = probs > 0
    assert counts[~kept].sum() == 0, "a filtered-out token was drawn"
    expected = probs[kept] * N_DRAWS
    stat = float(((counts[kept] - expected) ** 2 / expected).sum())
    sf = _chi2_sf(stat, int(kept.sum()) - 1)
    assert sf > FALSE_FAILURE, (stat, sf)
    # logprobs are the log of the filtered, tempered probabilities.
    lp = out.logprobs[:1000].double()
    assert torch.allclose(lp, probs.log()[out.tokens[:1000]], atol=1e-5)


def test_chi_square_has_power():
    """The same test rejects a sampler that ignores the temperature (draws at T=1 vs T=0.8)."""
    logits = torch.tensor([1.2, -0.3, 0.4, 2.0, -1.1, 0.9, 0.0, -2.2])
    probs = _expected(logits, 0.8, 0, 1.0, 0.0)
    out = bik.sample(logits.expand(N_DRAWS, -1), seed=1, position=torch.arange(N_DRAWS),
                     backend=CPU)
    counts = torch.bincount(out.tokens, minlength=8).double()
    stat = float(((counts - probs * N_DRAWS) ** 2 / (probs * N_DRAWS)).sum())
    assert _chi2_sf(stat, 7) < FALSE_FAILURE


@pytest.mark.parametrize("temperature", [0.05, 1.0, 50.0])
def test_masked_token_never_chosen(temperature):
    """-inf tokens compete with finite ones of similar value (so the noise decides between the
    finite ones), and in the second half top_k = 3 removes the largest finite logits too."""
    v = 16
    logits = torch.empty(v)
    logits[::2] = float("-inf")
    logits[1::2] = torch.linspace(0.5, -1.0, v // 2)  # tokens 1, 3, 5 hold the top 3
    top_k = torch.where(torch.arange(N_DRAWS) < N_DRAWS // 2, 0, 3)
    out = bik.sample(logits.expand(N_DRAWS, -1), seed=99, position=torch.arange(N_DRAWS),
                     temperature=temperature, top_k=top_k, backend=CPU)
    assert (out.tokens % 2 == 1).all()
    assert torch.isfinite(out.logprobs).all()
    second = out.tokens[N_DRAWS // 2:]
    assert set(second.unique().tolist()) <= {1, 3, 5}
    # the draw is not degenerate: several finite tokens are drawn in the unfiltered half
    assert out.tokens[: N_DRAWS // 2].unique().numel() >= (2 if temperature < 0.1 else 5)


def test_batch_invariance(gen):
    sc.check_batch_invariance(CPU, 100, (1, 2, 3, 4, 7, 8, 16, 31, 64, 127, 128, 255, 256, 300),
                              40, gen)


def test_batch_invariance_near_ties(gen):
    sc.check_batch_invariance(CPU, 33, (1, 2, 5, 17, 64), 20, gen, near_ties=True)


def test_row_keyed_reference_is_rejected(gen):
    sc.check_row_keyed_reference_rejected(gen)


def test_threads_do_not_change_bits(gen):
    t = sc.requests(600, 1000, gen)  # B*V >= 4 * 2**17: the kernel really uses several threads
    args = [t["seed"], t["position"], t["temperature"], t["top_k"], t["top_p"],
            bik_log_torch(t["min_p"].clamp(min=1e-30)).where(t["min_p"] > 0,
                                                             torch.tensor(-math.inf))]
    one = cpu_sampling.sample_cpu(t["logits"], *args, num_threads=1)
    for threads in (2, 3, 4):
        many = cpu_sampling.sample_cpu(t["logits"], *args, num_threads=threads)
        assert torch.equal(one[0], many[0]) and torch.equal(one[1].view(torch.int32),
                                                            many[1].view(torch.int32))


def test_greedy(gen):
    sc.check_greedy(CPU, gen)


def test_invalid_rows(gen):
    sc.check_invalid_rows(CPU, gen)


def test_filters(gen):
    sc.check_filters_keep_what_they_promise(CPU, gen)


def test_seed_and_position_change_the_draw(gen):
    x = torch.zeros(1, 1000)
    draws = {bik.sample(x, seed=s, position=p, backend=CPU).tokens.item()
             for s in (0, 1, 2**40) for p in (0, 1, 2**33)}
    assert len(draws) == 9


def test_drafter_invariance(gen):
    sc.check_drafter_invariance(CPU, 50, 4, 64, gen)


def test_coupling_acceptance_rate(gen):
    """Same-noise drafts from q are accepted with probability sum_i 1/sum_j max(p_j/p_i,
    q_j/q_i); the measured rate over n draws is within 5 sigma of it."""
    n, v = 200_000, 6
    lp = torch.tensor([0.5, -1.0, 1.5, 0.0, -0.5, 0.8])
    lq = torch.tensor([0.9, -0.2, 1.0, -0.6, 0.3, 0.8])
    p, q = torch.softmax(lp.double(), 0), torch.softmax(lq.double(), 0)
    exact = sum(1 / torch.maximum(p / p[i], q / q[i]).sum() for i in range(v)).item()
    pos = torch.arange(n) * 7
    drafts = bik.sample(lq.expand(n, -1), seed=42, position=pos, backend=CPU).tokens
    logits = torch.stack([lp.expand(n, -1), torch.zeros(n, v)], 1)
    out = bik.verify_draft(drafts[:, None], 1, logits, seed=42, position=pos, backend=CPU)
    rate = out.num_accepted.double().mean().item()
    sigma = math.sqrt(exact * (1 - exact) / n)
    assert abs(rate - exact) < 5 * sigma, (rate, exact, sigma)
    tv = 0.5 * (p - q).abs().sum().item()
    assert exact >= (1 - tv) / (1 + tv) - 1e-12  # the paper's lower bound


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


def test_empty_batch():
    out = bik.sample(torch.randn(0, 10), seed=0, position=0, backend=CPU)
    assert out.tokens.shape == (0,) and out.logprobs.shape == (0,)


def test_opcheck(gen):
    sc.check_opcheck(CPU, gen)


def test_backward_raises():
    x = torch.randn(2, 5, requires_grad=True)
    out = bik.sample(x, seed=0, position=0, backend=CPU)
    with pytest.raises(NotImplementedError, match="bik.sample: backward"):
        out.logprobs.sum().backward()


@pytest.mark.parametrize("arch", [90, 80])
def test_pick_kernel_code_has_no_approximation_or_fma(arch):
    """The compiled noise + pick kernel (what greedy, temperature, top-k and min-p tokens come
    from) uses only exactly rounded fp32 ops: no div.full, no .approx, no fma."""
    pytest.importorskip("triton")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton_compile import launch_like_signature
    from triton_compile_table import sampling_kernel_cases

    picks = [c for c in sampling_kernel_cases(arch) if c[0].__name__ == "gumbel_pick_kernel"]
    assert {str(c[1]["x_ptr"].dtype) for c in picks} >= {"torch.float32", "torch.bfloat16",
                                                       "torch.float16"}
    for kernel, args, consts, warps, stages, options in picks:  # every dtype and vocab size
        sig, constants, attrs = launch_like_signature(kernel, args, consts)
        ptx = triton.compile(ASTSource(kernel, sig, constants, attrs),
                             target=GPUTarget("cuda", arch, 32),
                             options={"num_warps": warps, "num_stages": stages} | options
                             ).asm["ptx"]
        for banned in ("div.full", ".approx", "fma", "ex2", "lg2", "rcp"):
            assert banned not in ptx, banned
        assert re.search(r"div\.rn\.f32", ptx) and re.search(r"mul\.hi\.u32", ptx)


def test_bench_sample_quick(tmp_path):
    import json

    from bik.cli.main import main

    path = tmp_path / "sample.json"
    assert main(["bench", "sample", "--quick", "--device", "cpu", "--json", str(path)]) == 0
    records = json.loads(path.read_text())["records"]
    assert records and all(r["bik_rows_identical"] for r in records)


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


def test_noise_skip_bound_is_exact(gen):
    """The kernels skip the noise of tokens below m + G_MIN - G_MAX; a token just above the
    bound must still be able to win, and peaked rows must give the unskipped token: compared
    with an fp64 brute force over the CPU noise."""
    from bik.ops.sampling.cpu import philox4x32_10

    v, rows = 64, 4000
    x = torch.randn(rows, v, generator=gen) * 12  # spread: most tokens are skippable
    x[:, 5] = x.amax(1) + (sc.G_MIN - sc.G_MAX) + 1e-3  # just inside the bound
    pos = torch.arange(rows)
    got = bik.sample(x, seed=11, position=pos, backend=CPU).tokens
    tok = torch.arange(v).repeat(rows)
    p = pos.repeat_interleave(v)
    words = philox4x32_10(torch.stack([tok, p & 0xFFFFFFFF, p >> 32, torch.zeros_like(p)], 1),
                          torch.tensor([[11, 0]]).expand(rows * v, 2))[:, 0]
    u = ((words >> 9) * 2 + 1).float() * 2.0**-24
    g = cpu_sampling.gumbel_from_unit(u).reshape(rows, v)
    assert torch.equal(got, (x + g).argmax(1))
