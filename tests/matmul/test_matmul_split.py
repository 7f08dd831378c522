"""bik's matmul K-split contract (bik.configs.matmul_split, docs/design.md "The matmul K-split").

* The plan: G and S follow (dtype, K, the layer's N) and never M or the arch; groups start on
  MATMUL_GROUP_ALIGN; a G-group layer splits at its group boundaries; ``BIK_MATMUL_SPLIT=none``
  is the one-split contract and is part of the fingerprint. The C rule the dispatcher kernels
  use (csrc/cpu/c_abi.h) is the Python rule for every K.
* Row-parallel shards: the G group partials, each computed alone on its K range (what one rank
  of a row-parallel layer holds), folded in ascending order, are the full product's bits.
* Triton (interpreter): SPREAD (one program per (tile, split), fp32 partials, the last folds),
  FOLD (splits in order inside a program) and PERSISTENT (TMA loads, programs looping over the
  tiles; both B layouts) give the same bits at every M; rows stay invariant in all three; a
  split picked by M is caught by the same check.
"""

from __future__ import annotations

import inspect
import subprocess
import sys

import bik
import pytest
import torch
from bik import configs
from bik.configs import MatmulSplit, matmul_split
from bik.ops.matmul.cpu import launch_matmul
from bik.ops.matmul.reference import matmul_contract_reference, split_ranges
from bik.runtime import cpu_ext
from bik.testing.harness import rows_alone_vs_batched, same_bits
from targets import targets

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ---- the plan ------------------------------------------------------------------------------


def test_plan_takes_no_m_and_no_arch():
    assert list(inspect.signature(matmul_split).parameters) == ["dtype", "n", "k"]


@pytest.mark.parametrize("k,groups,split", [
    (0, 1, 1), (1, 1, 1), (576, 1, 576), (1536, 8, 192), (2048, 8, 256), (2049, 1, 1024),
    (3000, 1, 1024), (4096, 8, 512), (14336, 8, 1792), (28672, 8, 3584), (5000, 1, 1024)])
def test_plan_of_known_shapes(k, groups, split):
    for dtype in DTYPES:
        for n in (1, 576, 4096, 128256):
            assert matmul_split(dtype, n, k) == MatmulSplit(groups, split)


def test_groups_are_whole_splits_on_the_alignment():
    for k in range(0, 20000, 64):
        plan = matmul_split(torch.bfloat16, 4096, k)
        groups = split_ranges(k, plan)
        flat = [r for g in groups for r in g]
        assert [kk for lo, hi in flat for kk in range(lo, hi)] == list(range(k))
        if plan.groups > 1:
            assert plan.groups == configs.MATMUL_TP_MAX and all(len(g) == 1 for g in groups)
            assert all(g[0][0] % configs.MATMUL_GROUP_ALIGN == 0 for g in groups)
        assert plan.n_splits(k) == len(flat)


@pytest.mark.skipif(not cpu_ext.available(), reason=cpu_ext.unavailable_reason())
def test_c_rule_of_the_dispatcher_kernels_is_the_python_rule(monkeypatch):
    ext = cpu_ext.require()
    for mode in ("fixed", "none"):
        monkeypatch.setenv(configs.MATMUL_SPLIT_ENV, mode)
        rule = list(configs.matmul_split_rule())
        for k in range(40000):
            assert ext.matmul_split_len(k, rule) == matmul_split(torch.float32, 8, k).split, k


def test_none_mode_is_one_split_and_changes_the_fingerprint(monkeypatch):
    fixed = configs.config_table()
    monkeypatch.setenv(configs.MATMUL_SPLIT_ENV, "none")
    assert matmul_split(torch.bfloat16, 4096, 4096) == MatmulSplit(1, 4096)
    assert matmul_split(torch.bfloat16, 4096, 0) == MatmulSplit(1, 1)
    assert configs.config_table() != fixed
    monkeypatch.setenv(configs.MATMUL_SPLIT_ENV, "sometimes")
    with pytest.raises(ValueError, match="BIK_MATMUL_SPLIT='sometimes'"):
        matmul_split(torch.float32, 8, 8)


_NONE_CHILD = """
import torch, bik
from bik.configs import MatmulSplit
from bik.ops.matmul.reference import matmul_contract_reference
g = torch.Generator().manual_seed(0)
a, b = torch.randn(3, 4096, generator=g), torch.randn(4096, 20, generator=g)
from bik.runtime import cpu_ext
one = matmul_contract_reference(a, b, None, MatmulSplit(1, 4096), fma=cpu_ext.fp32_fma())
assert torch.equal(bik.matmul(a, b, backend="cpu"), one)
with bik.enabled():
    assert torch.equal(torch.mm(a, b), one)
print(bik.fingerprint())
"""


@pytest.mark.skipif(not cpu_ext.available(), reason=cpu_ext.unavailable_reason())
def test_none_mode_runs_the_data_parallel_contract_in_a_process():
    """``BIK_MATMUL_SPLIT=none`` set before import: bik.matmul and the dispatcher kernels under
    bik.enable() both give the one-split bits, and bik.fingerprint() differs from the default."""
    runs = {}
    for mode in ("none", "fixed"):
        done = subprocess.run([sys.executable, "-c", _NONE_CHILD if mode == "none" else
                               "import bik; print(bik.fingerprint())"],
                              env={**_env(), configs.MATMUL_SPLIT_ENV: mode},
                              capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[mode] = done.stdout.strip().splitlines()[-1]
    assert runs["none"] != runs["fixed"]


def _env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k != configs.MATMUL_SPLIT_ENV}


# ---- the contract on the CPU backend -------------------------------------------------------


@pytest.mark.skipif(not cpu_ext.available(), reason=cpu_ext.unavailable_reason())
@pytest.mark.parametrize("dtype", DTYPES)
def test_group_partials_of_shards_fold_to_the_full_product(dtype):
    """What a row-parallel rank holds: K / G columns of x and W per group. Each group's partial
    computed alone (one split, from zero), folded in ascending group order, + bias, rounded
    once: the unsharded bik.linear bits. A fold in another order (what a reduction tree over
    ranks does) gives other bits, so the comparison can fail."""
    g = torch.Generator().manual_seed(5)
    k, n = 4096, 48
    x = torch.randn(7, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    plan = matmul_split(dtype, n, k)
    glen = plan.group_len(k)

    def group_partial(i):  # the layer's split (one per group), not the shard's own plan
        out = torch.empty(1, 7, n)
        launch_matmul(x[None, :, i * glen:(i + 1) * glen], w[None, :, i * glen:(i + 1) * glen]
                      .transpose(1, 2), None, out, split=plan.split)
        return out[0]

    parts = [group_partial(i) for i in range(plan.groups)]
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    full = bik.linear(x, w, bias, backend="cpu")
    assert same_bits((total + bias.float()).to(dtype), full)
    tree = ((parts[0] + parts[1]) + (parts[2] + parts[3])) + ((parts[4] + parts[5])
                                                              + (parts[6] + parts[7]))
    if dtype == torch.float32:
        assert not same_bits(tree + bias.float(), full)


@pytest.mark.skipif(not cpu_ext.available(), reason=cpu_ext.unavailable_reason())
def test_cpu_backend_is_the_literal_contract_at_llama_widths():
    g = torch.Generator().manual_seed(6)
    for k in (1536, 4096, 3000):
        a, w = torch.randn(3, k, generator=g), torch.randn(20, k, generator=g)
        plan = matmul_split(torch.float32, 20, k)
        assert same_bits(bik.linear(a, w, backend="cpu"),
                         matmul_contract_reference(a, w.t(), None, plan,
                                                   fma=cpu_ext.fp32_fma()))


# ---- Triton: SPREAD == FOLD (interpreter) --------------------------------------------------


@pytest.fixture
def small_splits(monkeypatch):
    """Test-sized K meets groups (4 of a multiple of 16) and splits of 32."""
    monkeypatch.setattr(configs, "MATMUL_TP_MAX", 4)
    monkeypatch.setattr(configs, "MATMUL_GROUP_ALIGN", 16)
    monkeypatch.setattr(configs, "MATMUL_SPLIT", 32)
    monkeypatch.setattr(configs, "MATMUL_ONE_SPLIT_MAX_K", 32)


@pytest.mark.parametrize("target", targets("interpreter"))
@pytest.mark.parametrize("k", [64, 100])  # 4 groups of 16; splits of 32 with a ragged last
def test_triton_spread_equals_fold_at_every_m(target, small_splits, k):
    from bik.ops.matmul import triton as triton_matmul

    plan = matmul_split(torch.float32, 40, k)
    assert plan.n_splits(k) == 4
    g = torch.Generator().manual_seed(k)
    pool = torch.randn(33, k, generator=g)
    w = torch.randn(40, k, generator=g)
    bias = torch.randn(40, generator=g)

    def run(x, spread):
        out = torch.empty(1, x.shape[0], 40)
        triton_matmul.launch_matmul(x[None], w.t()[None], bias, out, spread=spread)
        return out[0]

    for spread in (True, False):
        report = rows_alone_vs_batched(lambda x, s=spread: run(x, s), pool, (1, 2, 17, 33),
                                       name=f"triton spread={spread} K={k}")
        assert report.ok, report.summary()
    assert same_bits(run(pool, True), run(pool, False))
    # FOLD's one K loop with splits that do not end on BLOCK_K steps (40 = 16 + 16 + 8): the
    # split's short last step, then the next split's first, as SPREAD's loop per split.
    odd = [torch.empty(1, 33, 40) for _ in range(2)]
    for out, spread in zip(odd, (True, False)):
        triton_matmul.launch_matmul(pool[None], w.t()[None], bias, out, split=40, spread=spread)
    assert same_bits(odd[0], odd[1])
    if k == 100:
        # The splits are real: one split over all of K gives other bits. (At K = 64 each split
        # is one BLOCK_K step, and the interpreter's dot adds its step sum to acc, so there
        # the fold and one long split coincide.)
        one = torch.empty(1, 33, 40)
        triton_matmul.launch_matmul(pool[None], w.t()[None], bias, one, split=k)
        assert not same_bits(one[0], run(pool, False))


@pytest.mark.parametrize("target", targets("interpreter"))
def test_triton_spread_returns_its_tickets_to_zero(target, small_splits):
    """SPREAD folds in the launch: each tile's last program to take a ticket (a counter of
    bik.runtime.counters' per-stream buffer) folds the partials and sets the ticket back to 0,
    so the next SPREAD finds it at zero. Control: a ticket left at 1 makes its tile fold before
    every partial is written (the fold reads a workspace still holding NaN), and the output
    changes; the counters then stay off zero."""
    from bik.ops.matmul import triton as triton_matmul
    from bik.runtime.counters import zeroed_counters

    g = torch.Generator().manual_seed(3)
    x, w, bias = torch.randn(5, 100, generator=g), torch.randn(40, 100, generator=g), None

    def run(spread):
        out = torch.empty(1, 5, 40)
        triton_matmul.launch_matmul(x[None], w.t()[None], bias, out, spread=spread)
        return out[0]

    fold = run(False)
    tickets = zeroed_counters(x.device, 1)
    for _ in range(3):  # each call starts from the zeros the last one left
        assert same_bits(run(True), fold)
        assert not tickets.any()
    real_empty = torch.empty
    try:  # the workspace as NaN, then a stale ticket on tile 0
        torch.empty = lambda *a, **k: real_empty(*a, **k).fill_(float("nan"))
        tickets[0] = 1
        assert not same_bits(run(True), fold)
    finally:
        torch.empty = real_empty
        tickets.zero_()


class _Launches:
    """Counts the launches of a Triton kernel (kernel[grid](...)) and runs them."""

    def __init__(self, kernel):
        self.kernel, self.count = kernel, 0

    def __getitem__(self, grid):
        self.count += 1
        return self.kernel[grid]


@pytest.mark.parametrize("target", targets("interpreter"))
@pytest.mark.parametrize("k", [64, 100])
@pytest.mark.parametrize("b_layout", ["weight", "row_major"])
def test_triton_persistent_equals_fold_at_every_m(target, small_splits, monkeypatch, k,
                                                   b_layout):
    """PERSISTENT (the Hopper large-M path: TMA descriptors, 3 programs looping over the tiles
    here) gives FOLD's and SPREAD's bits at every M, with B as a linear weight's [N, K]
    transposed view or a row-major [K, N]; rows stay invariant in it."""
    from bik.ops.matmul import triton as triton_matmul

    tma = _Launches(triton_matmul.matmul_tma_kernel)
    monkeypatch.setattr(triton_matmul, "matmul_tma_kernel", tma)
    g = torch.Generator().manual_seed(k)
    pool = torch.randn(70, k, generator=g)
    w = torch.randn(40, k, generator=g)
    b = w.t() if b_layout == "weight" else w.t().contiguous()
    bias = torch.randn(40, generator=g)

    def run(x, mode):
        out = torch.empty(1, x.shape[0], 40)
        triton_matmul.launch_matmul(x[None], b[None], bias, out, spread=mode == "spread",
                                    persistent=mode == "persistent")
        return out[0]

    report = rows_alone_vs_batched(lambda x: run(x, "persistent"), pool, (1, 2, 17, 70),
                                   name=f"triton persistent K={k}")
    assert report.ok, report.summary()
    assert tma.count > 0  # TMA took these operands
    persistent = run(pool, "persistent")
    assert same_bits(persistent, run(pool, "fold"))
    assert same_bits(persistent, run(pool, "spread"))


@pytest.mark.parametrize("target", targets("interpreter"))
def test_triton_persistent_refuses_what_tma_cannot_load(target, small_splits, monkeypatch):
    """Operands TMA cannot take (a split not on a BLOCK_K boundary, an unaligned row stride,
    several batch entries, an expanded operand whose rows repeat with stride 0) run FOLD
    instead, with its bits; an operand TMA takes does launch it (the check can see both)."""
    from bik.ops.matmul import triton as triton_matmul

    tma = _Launches(triton_matmul.matmul_tma_kernel)
    monkeypatch.setattr(triton_matmul, "matmul_tma_kernel", tma)
    g = torch.Generator().manual_seed(3)
    for x, w, nb in ((torch.randn(5, 20, generator=g), torch.randn(40, 20, generator=g), 1),
                     (torch.randn(5, 35, generator=g), torch.randn(40, 35, generator=g), 1),
                     (torch.randn(5, 64, generator=g), torch.randn(40, 64, generator=g), 2),
                     (torch.randn(1, 64, generator=g).expand(5, 64),
                      torch.randn(40, 64, generator=g), 1),
                     (torch.randn(5, 64, generator=g),
                      torch.randn(1, 64, generator=g).expand(40, 64), 1)):
        a, b = x[None].expand(nb, -1, -1), w.t()[None].expand(nb, -1, -1)
        outs = []
        for persistent in (True, False):
            out = torch.empty(nb, 5, 40)
            triton_matmul.launch_matmul(a, b, None, out, persistent=persistent)
            outs.append(out)
        assert same_bits(*outs)
    assert tma.count == 0
    out = torch.empty(1, 5, 40)
    triton_matmul.launch_matmul(torch.randn(1, 5, 64, generator=g),
                                torch.randn(40, 64, generator=g).t()[None], None, out,
                                persistent=True)
    assert tma.count == 1


@pytest.mark.parametrize("target", targets("interpreter"))
def test_triton_split_picked_by_m_is_caught(target, small_splits):
    """Negative control: the same Triton program with its split length picked by M fails the
    invariance check it passes above."""
    from bik.ops.matmul import triton as triton_matmul

    g = torch.Generator().manual_seed(1)
    pool, w = torch.randn(8, 100, generator=g), torch.randn(40, 100, generator=g)

    def linear_split_by_m(x):
        out = torch.empty(1, x.shape[0], 40)
        triton_matmul.launch_matmul(x[None], w.t()[None], None, out,
                                    split=32 if x.shape[0] == 1 else 64)
        return out[0]

    assert not rows_alone_vs_batched(linear_split_by_m, pool, (1, 8), name="split by M").ok


def test_spread_only_while_its_workspace_is_smaller_than_the_weights():
    """SPREAD's fp32 partials cost a write and a read; past the weights' bytes FOLD is taken
    (speed only: every mode gives the same bits). Llama-3-8B's 4096 x 4096 bf16 layer with 8
    splits: SPREAD at M = 8 and 64, FOLD at M = 256 and 512 (67 MB of partials each way at 512
    against 34 MB of weights), in the bytes model and in the CUDA launch plan."""
    from bik.ops.matmul.cuda import plan_matmul
    from bik.ops.matmul.schedule import spread_bytes, use_spread

    model = spread_bytes(1, 512, 4096, 4096, 8, 2)
    assert model == {"workspace_bytes": 8 * 512 * 4096 * 4, "weight_bytes": 4096 * 4096 * 2}
    for m, spread in ((8, True), (64, True), (256, False), (512, False)):
        assert use_spread(4, 8, **spread_bytes(1, m, 4096, 4096, 8, 2)) is spread, m
    assert not use_spread(200, 8)  # tiles enough to fill the GPU: FOLD, whatever the bytes
    launch = {m: plan_matmul(torch.bfloat16, 1, m, 4096, 4096, "sm90") for m in (8, 512)}
    assert launch[8].n_splits > 1 and launch[8].spread and not launch[512].spread
