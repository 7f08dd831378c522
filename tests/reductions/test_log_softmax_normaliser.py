"""bik.log_softmax on Triton is the sampler's normaliser ("one normaliser contract").

The contract per row x[0..n-1] (fp32 from x's values, rounded once to the output dtype):
m = max x (exact; a NaN in the row, m = +inf or an all -inf row makes the whole row NaN);
e_j = bik_exp(x_j - m); S = the sum of e in the order of ``bik.configs.sampler_chunks(n)`` (G
groups, chunks of C from each group's start folded by halves, chunk sums then group totals
ascending from +0); y_j = (x_j - m) - bik_log(S). That is the sampler's logprob, so
``bik.log_softmax(z).gather(t)`` is ``bik.sample(z).logprobs`` bit for bit.

In the interpreter (TRITON_INTERPRET=1, own process), at sizes it can afford:

* the kernel equals the contract written literally in torch (``reference.log_softmax_reference``,
  on ops/_normaliser.py's transcriptions of bik_exp, bik_log and vocab_sum) bit for bit: one group
  (n not a multiple of 8), eight groups of a few tokens, groups of two chunks (n = 8 * 1100),
  one group of two chunks (n = 1100), -inf entries, NaN / +inf / all -inf rows, and bf16 / fp16
  inputs with their own dtype out and with dtype=float32;
* the tie: for the tokens bik.sample draws at T = 1 (no filter), the gathered log_softmax is the
  sample's logprobs bit for bit; torch.log_softmax (another sum order) gives other bits for some
  of them, so the comparison can fail;
* a row's bits are the same alone and in a batch, and the check fails for the same program
  with its chunk length chosen by the number of rows.

In the plain process: the kernel compiled for sm_90 and sm_80 as launched (without fp fusion)
has only exactly rounded fp32 ops in its PTX (no fma, no approximations), as the sampler's do.
"""

from __future__ import annotations

import bik
import pytest
import torch
from bik.configs import VocabChunks, sampler_chunks
from bik.ops.reductions import reference
from bik.testing import rows_alone_vs_batched, same_bits
from checks import randn
from targets import targets

INTERPRETER = targets("interpreter")


def _rows_with_non_finite(gen, n: int) -> torch.Tensor:
    """Six rows of length n: clean; every third entry -inf; a NaN; a +inf; all -inf; one
    finite entry among -inf."""
    x = randn(gen, 6, n) * 4
    x[1, ::3] = float("-inf")
    x[2, n // 2] = float("nan")
    x[3, n - 1] = float("inf")
    x[4] = float("-inf")
    x[5, 1:] = float("-inf")
    return x


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy: inf - inf
@pytest.mark.parametrize("target", INTERPRETER)
@pytest.mark.parametrize("n", [77, 40, 1100, 8 * 1100])
def test_log_softmax_is_the_literal_contract(target, n, gen, monkeypatch):
    """n = 77: one group (8 does not divide it); 40: eight groups of five tokens; 1100: one
    group of two chunks (the second ragged); 8 * 1100: eight groups of two chunks each. The
    comparison sees the order: the reference summing one group of 16-token chunks instead
    gives other bits at every n (measured: on one or two of the finite rows)."""
    assert sampler_chunks(n).groups == (8 if n % 8 == 0 else 1)
    x = _rows_with_non_finite(gen, n)
    got = bik.log_softmax(x, backend=target.backend)
    assert same_bits(got, reference.log_softmax_reference(x))
    assert got[2:5].isnan().all() and not got[[0, 1, 5]].isnan().any()
    assert got[5, 0] == 0.0 and (got[5, 1:] == float("-inf")).all()
    monkeypatch.setattr(reference, "sampler_chunks", lambda n: VocabChunks(1, 16))
    assert not same_bits(got, reference.log_softmax_reference(x))


@pytest.mark.parametrize("target", INTERPRETER)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_round_the_contract_once(target, dtype, gen):
    """Computed in fp32 from the half values: dtype=float32 is the contract of the upcast rows,
    the input's dtype that result rounded once."""
    x = randn(gen, 3, 8 * 20, dtype=dtype) * 4
    want = reference.log_softmax_reference(x.float())
    assert same_bits(bik.log_softmax(x, dtype=torch.float32, backend=target.backend), want)
    assert same_bits(bik.log_softmax(x, backend=target.backend), want.to(dtype))


@pytest.mark.parametrize("target", INTERPRETER)
@pytest.mark.parametrize("rows, vocab", [(8, 512), (2, 8 * 1100)])
def test_gathered_log_softmax_is_the_samplers_logprob(target, rows, vocab, gen):
    """The issue's tie: the same fp32 logits, no filter, T = 1. The control (torch's
    log_softmax, its own sum order) differed from the sampler on 2 of 8 rows at V = 512 and
    on 1 of 2 at V = 8800 (measured)."""
    z = randn(gen, rows, vocab) * 3
    out = bik.sample(z, seed=11, position=torch.arange(rows), temperature=1.0,
                     backend=target.backend)
    assert (out.tokens >= 0).all()
    t = out.tokens[:, None]
    got = bik.log_softmax(z, backend=target.backend).gather(1, t)[:, 0]
    assert same_bits(got, out.logprobs)
    control = torch.log_softmax(z, 1).gather(1, t)[:, 0]
    assert (control != out.logprobs).sum() >= 1


@pytest.mark.parametrize("target", INTERPRETER)
def test_rows_alone_equal_rows_in_a_batch(target, gen, monkeypatch):
    """torch.equal for every row alone vs inside batches of 1-6 rows (one group of 77 tokens;
    eight groups of 130); then the control: the same program with its chunk length picked by
    the number of rows (16 tokens for one row, the contract's 1024 otherwise) fails."""
    from bik.ops.reductions import triton as triton_reductions

    fn = lambda t: bik.log_softmax(t, backend=target.backend)
    ms = (1, 2, 6)
    pools = [randn(gen, 6, n) * 4 for n in (77, 8 * 130)]
    for pool in pools:
        assert rows_alone_vs_batched(fn, pool, ms).ok
    launch = triton_reductions.launch_softmax

    def launch_with_chunk_by_m(t, out, *, log):
        chunk = 16 if t.shape[0] == 1 else 1024
        monkeypatch.setattr(triton_reductions, "sampler_chunks",
                            lambda n: sampler_chunks(n)._replace(chunk=chunk))
        launch(t, out, log=log)

    monkeypatch.setattr(triton_reductions, "launch_softmax", launch_with_chunk_by_m)
    assert not rows_alone_vs_batched(fn, pools[0], ms).ok


@pytest.mark.parametrize("arch", [90, 80])
def test_compiled_kernel_uses_only_exactly_rounded_ops(arch):
    """The plain process, no GPU: log_softmax_kernel compiled for sm_90 / sm_80 as launched
    (the compile table's cases: every dtype, half -> float, one group and eight, one chunk per
    step and four) has no fma, .approx, ex2, lg2, rcp or div.full in its PTX, the sampler's
    condition for a GPU to keep the interpreter's bits; it has mul.rn / add.rn. Control: the
    same kernel compiled with fp fusion (Triton's default) has fma."""
    pytest.importorskip("triton")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton_compile import launch_like_signature
    from triton_compile_table import _reduction_cases

    def ptx(kernel, args, consts, warps, stages, options):
        sig, constants, attrs = launch_like_signature(kernel, args, consts)
        return triton.compile(ASTSource(kernel, sig, constants, attrs),
                              target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": warps, "num_stages": stages} | options
                              ).asm["ptx"]

    cases = [c for c in _reduction_cases(arch) if c[0].__name__ == "log_softmax_kernel"]
    assert {c[2]["G"] for c in cases} == {1, 8} and {c[2]["NCH"] for c in cases} == {1, 4}
    for *case, options in cases:
        code = ptx(*case, options)
        for banned in ("div.full", ".approx", "fma", "ex2", "lg2", "rcp"):
            assert banned not in code, (banned, case[1]["x_ptr"].dtype, case[1]["N"])
        assert "mul.rn.f32" in code and "add.rn.f32" in code
    assert "fma" in ptx(*cases[0][:-1], {})
