"""The Triton top-p search (ops/sampling/triton_top_p.py): the contract's cut in a few passes.

In the interpreter process (and on a GPU where there is one). The kernel's cut v_p is compared with reference.top_p_cut (the
contract read literally: the largest value of the row whose normaliser-order mass reaches
top_p * S) and its log of the kept mass with the literal sum, bit for bit; the number of passes
it took is read back. Rows whose cut ties more tokens than the lanes probe take the split
passes to the end, and cutting those short is caught (the bound is needed). Each pass runs one
program per (row, normaliser group). bik.sample's
tokens and logprobs with top-p against the CPU: test_sampling_vs_cpu.py.
"""

from __future__ import annotations

import pytest
import torch
from bik import configs
from bik.ops.sampling import reference
from bik.ops._normaliser import bik_exp_torch, bik_log_torch
from targets import targets

pytestmark = pytest.mark.parametrize("target", targets("interpreter", "gpu-triton"))

V = 2000  # 8 normaliser groups of 250 tokens


def _search(target, logits: torch.Tensor, top_p: float, passes: int | None = None):
    """(v_p, log of the kept mass, passes taken) from the kernel on the target's device."""
    from bik.ops.sampling.triton_top_p import TOP_P_PASSES
    from top_p_passes import top_p_cut  # tools/: the search alone, on given logits

    out = top_p_cut(logits.to(target.device), top_p, passes=passes or TOP_P_PASSES)
    return tuple(t.cpu() for t in out)


def _expected(logits: torch.Tensor, top_p: float):
    """(v_p, bik_log of the mass kept by z >= v_p) from the literal contract."""
    groups, chunk = configs.sampler_chunks(logits.shape[1])
    cut = reference.top_p_cut(logits, top_p, groups, chunk)
    terms = bik_exp_torch(logits - logits.amax(1, keepdim=True))
    kept = torch.where(logits >= cut[:, None], terms, 0.0)
    return cut, bik_log_torch(reference.vocab_sum(kept, groups, chunk))


def _llm_like(gen: torch.Generator, rows: int) -> torch.Tensor:
    """A few strong tokens over a wide Gaussian tail."""
    x = torch.randn(rows, V, generator=gen) * 2
    x[:, :20] += torch.rand(rows, 20, generator=gen) * 8
    return x


@pytest.mark.parametrize("top_p", [0.5, 0.95])
def test_cut_and_mass_are_the_contracts_in_a_few_passes(target, top_p, gen):
    """LLM-like rows: the contract's v_p and kept mass exactly, in at most 6 passes (the
    bisection took 32 + 2)."""
    x = _llm_like(gen, 4)
    cut, log_s, passes = _search(target, x, top_p)
    want_cut, want_log_s = _expected(x, top_p)
    assert torch.equal(cut, want_cut)
    assert torch.equal(log_s.view(torch.int32), want_log_s.view(torch.int32))
    assert int(passes.max()) <= 6, passes


def test_near_ties_are_the_contracts(target, gen):
    """Few distinct values and their 1-ulp neighbours, in every group."""
    base = torch.randint(-3, 4, (3, V), generator=gen).float()
    x = torch.nextafter(base, base + torch.randint(-1, 2, (3, V), generator=gen).float())
    cut, log_s, _ = _search(target, x, 0.9)
    want_cut, want_log_s = _expected(x, 0.9)
    assert torch.equal(cut, want_cut)
    assert torch.equal(log_s.view(torch.int32), want_log_s.view(torch.int32))


def test_ties_beyond_the_lanes_take_every_split_pass(target):
    """390 tokens tie at the cut (signed zeros mixed: two keys), more than the lanes can probe,
    so the probes never become candidates: the split passes narrow the key bracket to one key,
    within TOP_P_PASSES. Stopping a pass short of that leaves another cut (caught)."""
    from bik.ops.sampling.triton_top_p import TOP_P_LANES, TOP_P_PASSES

    x = torch.full((1, V), -6.0)
    x[:, :10] = 3.0
    x[:, 10:400] = 0.0
    x[:, 10:400:2] = -0.0
    assert 390 // 2 > TOP_P_LANES
    cut, log_s, passes = _search(target, x, 0.9)
    want_cut, want_log_s = _expected(x, 0.9)
    assert torch.equal(cut, want_cut) and float(want_cut) == 0.0
    assert torch.equal(log_s.view(torch.int32), want_log_s.view(torch.int32))
    assert 3 < int(passes) <= TOP_P_PASSES
    short, _, _ = _search(target, x, 0.9, passes=int(passes) - 2)
    assert not torch.equal(short, want_cut)


def test_a_small_vocabulary_is_settled_by_its_first_buffer(target, gen):
    """V <= TOP_P_CANDIDATES: pass 0 already holds every token, so the next pass probes the
    candidates of the bracket and ends the search (2 passes, 3 if more than LANES remain)."""
    x = torch.randn(4, 200, generator=gen) * 3
    cut, _, passes = _search(target, x, 0.9)
    assert torch.equal(cut, _expected(x, 0.9)[0])
    assert int(passes.max()) <= 3, passes


@pytest.mark.parametrize("vocab", [V, V + 1])
def test_each_pass_runs_one_program_per_normaliser_group(target, vocab, gen, monkeypatch):
    """The search is spread over the row's normaliser groups (8 at V = 2000; one when 8 does not
    divide V): TOP_P_SPREAD_PASSES launches of B x G programs, the last to arrive at each pass
    deciding for its row, then one launch of a program per row for the passes a row may still
    need; the cut is still the contract's."""
    from bik.ops.sampling import triton_top_p

    grids = []

    def spy(name):
        kernel = getattr(triton_top_p, name)

        class Spy:
            def __getitem__(self, grid):
                grids.append((name, grid))
                return kernel[grid]

        monkeypatch.setattr(triton_top_p, name, Spy())

    spy("top_p_pass_kernel")
    spy("top_p_finish_kernel")
    x = torch.randn(3, vocab, generator=gen) * 2
    x[:, :20] += 6
    cut, _, _ = _search(target, x, 0.9)
    groups = configs.sampler_chunks(vocab).groups
    assert groups == (8 if vocab == V else 1)
    assert grids == ([("top_p_pass_kernel", (3, groups))] * triton_top_p.TOP_P_SPREAD_PASSES
                     + [("top_p_finish_kernel", (3,))])
    assert torch.equal(cut, _expected(x, 0.9)[0])
