"""bik.attention's Triton kernel when the host metadata is wrong: a length past
``max_seqlen_k`` / ``max_seqlen_q`` (a caller error; BIK_DEBUG_CHECKS=1 raises it on the host,
tests/test_host_metadata.py) must never write past the SPLIT workspace the bound sized, nor
leave a row's output as stale memory. Such a sequence's rows come back NaN, the other rows
keep their bits. Also: a launch too large for the grid is refused by name, and a generous
bound (a captured graph's) still spreads each tile's real splits over the launched programs.

Interpreter (real kernel programs) and GPU; the bodies (tests/attention_checks.py) allocate the
workspace with guard elements after it and pre-fill the output with a sentinel. The CUDA C++
kernel runs the same bodies in tests/cuda/test_cuda_kernels_host.py.
"""

from __future__ import annotations

import collections

import bik
import pytest
import torch
from attention_checks import (BOUND_HEADS, BOUND_SENTINEL, _bound_cache, keyless_sequence,
                              past_key_bound, past_query_bound)
from bik.ops.attention import triton as triton_attention
from targets import targets


@pytest.mark.parametrize("target", targets("interpreter", "gpu-triton"))
def test_a_key_length_past_the_bound_gives_nan_and_never_writes_past_the_workspace(
        target, monkeypatch):
    untouched, out, lse, right = past_key_bound(triton_attention, monkeypatch, "triton",
                                                target.device)
    assert untouched  # no partial past the 2 splits max_seqlen_k = 64 sized
    assert torch.equal(out[0], right[0])  # within the bound: its bits
    assert bool(out[1:].isnan().all()) and bool(lse[1:].isnan().all())


@pytest.mark.parametrize("target", targets("interpreter", "gpu-triton"))
def test_a_query_length_past_the_bound_gives_nan_rows_past_the_grid_too(target):
    out, lse, right = past_query_bound(triton_attention, "triton", target.device)
    assert torch.equal(out[:3], right[:3])
    assert bool(out[3:].isnan().all()) and bool(lse[3:].isnan().all())


@pytest.mark.parametrize("target", targets("interpreter"))
def test_a_launch_past_the_grid_limits_is_refused_by_name(target):
    """Axis 2 holds SPLIT's runs of splits: more than 65535 is refused before any workspace
    or launch (the tensors are tiny; the bound is what sizes the grid)."""
    hq, hkv, d = BOUND_HEADS
    k = v = torch.zeros(1, 16, hkv, d)
    q = torch.zeros(1, hq, d)
    with pytest.raises(ValueError, match="bik.attention \\(triton\\): .* 65535"):
        triton_attention.launch_attention(
            q, k, v, torch.empty_like(q), torch.empty(1, hq),
            cu_q=torch.tensor([0, 1], dtype=torch.int32),
            seqlens_k=torch.tensor([16], dtype=torch.int32),
            table=torch.zeros(1, 1, dtype=torch.int32), base=None, block_size=16,
            stride_page=k.stride(0), stride_tok=k.stride(1), max_q_len=1, max_k_len=2**40,
            scale=d ** -0.5, causal=True, split_mode=True, per_program=1)


# ---- a generous bound still spreads the real splits -------------------------------------------

@pytest.mark.parametrize("bound_splits", [8, 64, 512, 4096])
@pytest.mark.parametrize("real_splits", [1, 3, 5, 40])
@pytest.mark.parametrize("items", [1, 8, 16, 64, 256])
def test_programs_with_work_follow_the_real_lengths(bound_splits, real_splits, items):
    """A launch sized by a bound (a CUDA graph captured at a generous max_seqlen_k) launches
    runs per tile for the bound's splits; the kernel spreads each tile's real splits over those
    runs, so min(two waves, the real splits) programs work. The old rule (the host's splits per
    program applied to the real splits) is the control: at a generous bound it leaves most runs
    idle."""
    from bik.ops.attention._layout import SPLIT_PROGRAM_TARGET, busy_programs, splits_per_program

    real_splits = min(real_splits, bound_splits)
    per = splits_per_program(items, bound_splits)
    runs = -(-bound_splits // per)
    tiles = [real_splits] * items
    want = min(SPLIT_PROGRAM_TARGET, items * real_splits, items * runs)
    assert busy_programs(runs, tiles) >= want
    old = items * -(-real_splits // per)
    if bound_splits >= 8 * real_splits and items in (8, 16) and real_splits > 1:
        assert old < want  # the control: the host's run length starves a generous bound


@pytest.mark.parametrize("target", targets("interpreter", "gpu-triton"))
def test_the_kernel_spreads_the_real_splits_over_the_runs(target, monkeypatch):
    """8 decode rows of 160 keys (5 interpreter splits) launched with max_seqlen_k = 2048 (64
    splits): 16 (sequence, KV head) items get 16 runs of 4 bound splits, and the kernel gives
    each tile's 5 real splits to 5 programs (the ticket increments count them: the last
    program returns its tile's ticket to zero), as busy_programs says; the bits are the true
    bound's."""
    from bik import configs
    from bik.ops.attention._layout import busy_programs

    split = configs.attention_config(torch.float32, BOUND_HEADS[2], 2, "interpreter").split
    if target.device != "cpu":
        split = configs.attention_config(torch.float32, BOUND_HEADS[2], 2, "sm90").split
    lengths = [5 * split] * 8
    k, v, table = _bound_cache(lengths, 4, target.device)
    q = torch.randn(8, BOUND_HEADS[0], BOUND_HEADS[2],
                    generator=torch.Generator().manual_seed(5)).to(target.device)
    meta = {"cache_seqlens": torch.tensor(lengths, dtype=torch.int32, device=target.device),
            "cu_seqlens_q": torch.arange(9, dtype=torch.int32, device=target.device),
            # room for the bound's 2048 keys: pages past the real ones point at page 0
            "block_table": torch.nn.functional.pad(table, (0, 4 * split - table.shape[1]))}
    right = bik.attention(q, k, v, **meta, max_seqlen_q=1, max_seqlen_k=5 * split,
                          backend="triton")
    launches, kernel = [], triton_attention.attention_kernel
    increments = collections.Counter()  # ticket address -> atomic adds on it

    def counting_rmw(builder, op, ptr, val, mask, sem, scope):
        for address, on in zip(ptr.data.ravel().tolist(), mask.data.ravel().tolist()):
            increments[address] += bool(on)
        return atomic_rmw(builder, op, ptr, val, mask, sem, scope)

    class Spy:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                kernel[grid](*args, **kwargs)
                tickets = args[7]
                launches.append((grid, [increments[tickets.data_ptr() + 4 * i]
                                        for i in range(grid[0])], tickets[:grid[0]].clone()))
            return run

    if target.small:  # the interpreter's atomics can be counted; a GPU's are not
        from triton.runtime.interpreter import InterpreterBuilder

        atomic_rmw = InterpreterBuilder.create_atomic_rmw
        monkeypatch.setattr(InterpreterBuilder, "create_atomic_rmw", counting_rmw)
    monkeypatch.setattr(triton_attention, "attention_kernel", Spy())
    monkeypatch.setattr(triton_attention, "use_split_mode", lambda *args: True)
    got = bik.attention(q, k, v, **meta, max_seqlen_q=1, max_seqlen_k=64 * split,
                        backend="triton")
    assert torch.equal(got.cpu(), right.cpu())
    (grid, taken, left), = launches
    assert grid == (16, 1, 16)
    if target.small:
        assert taken == [busy_programs(16, [5])] * 16 == [5] * 16
    assert not left.any()  # every ticket back at zero for the next kernel


@pytest.mark.parametrize("target", targets("interpreter", "gpu-triton"))
def test_a_sequence_without_keys_is_nan_in_both_launch_modes(target):
    """Host metadata can carry a sequence with no keys under a query (nothing checks it
    without BIK_DEBUG_CHECKS): FOLD finalises its rows from the empty state, and so must
    SPLIT, whose runs all have no split (it used to return before any program took a ticket,
    leaving the output's previous contents). The other sequence keeps its bits."""
    (fold, fold_lse), (split, split_lse) = keyless_sequence(triton_attention, target.device)
    assert bool(fold[0].isnan().all()) and bool(split[0].isnan().all())
    assert torch.equal(fold_lse[0].view(torch.int32), split_lse[0].view(torch.int32))
    assert not bool((split_lse == BOUND_SENTINEL).any())
    assert torch.equal(fold[1], split[1])
