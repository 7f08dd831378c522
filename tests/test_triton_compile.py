"""Every Triton kernel config in bik's tables compiles for sm_90 and sm_80 without a GPU, fits
the per-block shared memory (triton.compile does not check it) and does not spill."""

import pytest
from triton_compile_table import ARCHS, compile_all

pytest.importorskip("triton")

# Spill budget in bytes (spill stores + stack frame of the real cubin) per kernel. Matmul, norms
# and reductions do not spill. The attention kernels keep two fp32 accumulators (the running
# fold and the current split) and measured at most 24 B of stack on some fp32 / sm_80 configs.
# A change that spills more must raise these deliberately (and say why in its commit).
# The sampler's top-p pass kernel (16 thresholds probed per pass, each with its own chunk fold,
# the candidate buffer's compaction, and the deciding program's pick among G x 256 candidates)
# spills up to 56 B at 128 registers (8 warps, sm_90, G = 8; none on sm_80): a few words per
# thread. Its fallback, top_p_finish_kernel (one program walking every group for the passes a
# row still needs after the spread ones; it returns at once for rows of real logits), keeps
# the decision's state live across the group loop: up to 136 B (sm_80, G = 8).
SPILL_BUDGET = {"attention_kernel": 32, "top_p_pass_kernel": 56, "top_p_finish_kernel": 136}


@pytest.fixture(scope="module", params=ARCHS, ids=lambda a: f"sm{a}")
def records(request):
    return compile_all(request.param)


def test_every_config_compiles(records):
    kernels = {r.kernel for r in records}
    hopper = {"matmul_tma_kernel"} if records[0].arch == 90 else set()
    assert kernels == {"matmul_kernel", "grouped_matmul_kernel", "rms_norm_kernel", "softmax_kernel",
                       "log_softmax_kernel", "mean_kernel",
                       "attention_kernel", "top_p_pass_kernel", "top_p_finish_kernel",
                       "group_max_kernel", "group_mass_kernel", "gumbel_pick_kernel",
                       "finish_kernel", "write_kv_kernel"} | hopper
    assert len(records) >= 20


def test_shared_memory_fits(records):
    over = [r for r in records if not r.fits]
    assert not over, over


def _aligned(r) -> bool:
    """K and N multiples of 16 elements: what every real layer has, and what vector loads need."""
    shape = r.config.get("shape", {})
    return shape.get("K", 16) % 16 == 0 and shape.get("N", 16) % 16 == 0


def test_no_spills(records):
    """No spills for aligned problems. Unaligned matmul K or N (here K = 33 and K = 3001, which
    split by 1024) load element by element, and some of those configs spill (at K = 3001 the
    16-bit FOLD holds two 128 x 128 fp32 tiles, a split's and the running total): slower,
    never other bits; tools/triton_compile_report.py records them."""
    spilled = [r for r in records if _aligned(r)
               and max(r.spill_stores, r.stack) + r.local > SPILL_BUDGET.get(r.kernel, 0)]
    assert not spilled, spilled
    assert any(not _aligned(r) for r in records)  # the unaligned cases still compile


def test_registers_within_hardware_limit(records):
    assert all(0 < r.registers <= 255 for r in records)


def test_every_matmul_mode_emits_one_mma_instruction(records):
    """Instruction identity: for one (dtype, N, K) every launch mode (FOLD with one or several
    splits, SPREAD, and on sm_90 PERSISTENT with either B layout) and bias variant emits the
    same single tensor-core instruction, so a split's products meet the same hardware sum
    whichever mode ran it (the K loop steps BLOCK_K from each split's start in all of them).
    16-bit inputs use exactly one MMA (wgmma on sm_90); IEEE fp32 uses none."""
    by_problem = {}
    for r in records:
        if r.kernel in ("matmul_kernel", "matmul_tma_kernel"):
            key = (r.config["dtype"], r.config["shape"]["N"], r.config["shape"]["K"])
            by_problem.setdefault(key, set()).add(r.mma)
    modes = {r.config["SPREAD"] for r in records if r.kernel == "matmul_kernel"}
    assert modes == {True, False}
    persistent = {(r.config["dtype"], r.config["shape"]["N"], r.config["shape"]["K"])
                  for r in records if r.kernel == "matmul_tma_kernel"}
    assert (records[0].arch == 90) == bool(persistent)
    assert persistent <= set(by_problem)
    for (dtype, n, k), mmas in by_problem.items():
        assert len(mmas) == 1, (dtype, n, k, mmas)
        (mma,) = mmas
        assert len(mma) == (0 if dtype == "float32" else 1), (dtype, n, k, mma)
        if dtype != "float32" and records[0].arch == 90:
            assert mma[0].startswith("wgmma.mma_async"), mma


def test_grouped_matmul_meets_the_matmul_instruction(records):
    """bik::grouped_matmul's tiles are bik::matmul's: for a (dtype, N, K) both compile, the same
    single MMA (none for IEEE fp32), one pipelined K loop per tile, K stages in flight where K
    is 16-aligned; a row therefore meets bik.linear's sums."""
    mma = {(r.config["dtype"], r.config["shape"]["N"], r.config["shape"]["K"]): r.mma
           for r in records if r.kernel == "matmul_kernel"}
    grouped = [r for r in records if r.kernel == "grouped_matmul_kernel"]
    assert {r.config["dtype"] for r in grouped} == {"bfloat16", "float32"}
    shared = 0
    for r in grouped:
        key = (r.config["dtype"], r.config["shape"]["N"], r.config["shape"]["K"])
        assert len(r.mma) == (0 if key[0] == "float32" else 1), (key, r.mma)
        if key in mma:
            shared += 1
            assert r.mma == mma[key], (key, r.mma, mma[key])
        assert len(r.dot_loops) == 1 and r.dot_loops[0] >= 1, (key, r.dot_loops)
    assert shared >= 2  # one shape in both tables, per dtype


def test_hopper_persistent_matmul_loads_through_tma(records):
    """PERSISTENT (the large-M path, 16-bit inputs) loads A and B with TMA
    (cp.async.bulk.tensor) on every aligned Llama shape and both B layouts; its per-tile K loop
    is pipelined (shared memory holds several stages)."""
    if records[0].arch != 90:
        pytest.skip("sm_90 only")
    tma = [r for r in records if r.kernel == "matmul_tma_kernel"]
    assert tma and all(r.tma for r in tma)
    assert {r.config["B_NK"] for r in tma} == {True, False}
    assert {r.config["dtype"] for r in tma} == {"bfloat16", "float16"}
    big = [r for r in tma if r.config["BLOCK_K"] == 64]
    assert big and all(r.shared >= 3 * (128 + 128) * 64 * 2 for r in big)


def test_hopper_matmul_pipelines(records):
    """On sm_90 the 16-bit matmul keeps several K stages in flight (shared > one stage) when
    the strides are 16-aligned, as they are for every Llama projection."""
    if records[0].arch != 90:
        pytest.skip("sm_90 only")
    big = [r for r in records if r.kernel == "matmul_kernel" and r.config["dtype"] != "float32"
           and r.config["BLOCK_K"] == 64 and r.config["shape"]["K"] % 16 == 0]
    assert big and all(r.shared >= 3 * (128 + 128) * 64 * 2 for r in big)


def test_matmul_runs_one_pipelined_k_loop_per_tile(records):
    """Every matmul mode walks a tile's K in one loop (its TTGIR holds one scf.for with the dot,
    tools/triton_compile.dot_loops), splits included: FOLD and PERSISTENT fold each split's
    partial where it ends instead of draining the pipeline and refilling it per split (a loop
    per split counts two). The pointer kernels keep async copies in flight while the dot waits
    wherever K is 16-aligned (unaligned K loads element by element)."""
    mm = [r for r in records if r.kernel in ("matmul_kernel", "matmul_tma_kernel")]
    assert any(r.config["MULTI_SPLIT"] for r in mm)
    many = [(r.kernel, r.config, r.dot_loops) for r in mm if len(r.dot_loops) != 1]
    assert not many, many
    stalled = [(r.config, r.dot_loops) for r in mm if r.kernel == "matmul_kernel"
               and r.config["shape"]["K"] % 16 == 0 and r.dot_loops[0] < 1]
    assert not stalled, stalled


def test_attention_keeps_the_next_key_block_in_flight(records):
    """Every attention config walks its keys in one loop across its splits, and the loop's wait
    leaves the next block's K and V copies pending (>= 2 copies in flight) while a block is
    computed: the contiguous cache's base is loaded before the loop and a paged cache's
    page-table entries a block ahead, so no K / V address waits on a load of its own
    iteration (before: a wait to zero at the top of every block)."""
    att = [(r.config, r.dot_loops) for r in records if r.kernel == "attention_kernel"]
    assert att and {c["PAGED"] for c, _ in att} == {True, False}
    stalled = [(c, loops) for c, loops in att if len(loops) != 1 or loops[0] < 2]
    assert not stalled, stalled


def test_dot_loops_counts_a_loop_per_split():
    """The control: a loop per split inside a loop over splits (today's SPREAD-free FOLD before
    it was one loop) reads as two dot loops, each waiting with its copies drained to 1."""
    from triton_compile import dot_loops

    ttgir = """
    %0 = scf.for %k = %a to %b step %c iter_args(%acc = %z) -> (t) : i32 {
      %w = ttg.async_wait %x {num = 1 : i32}
      %d = ttng.warp_group_dot %p, %q, %acc
      scf.yield %d
    }
    %1 = scf.for %s = %a to %b step %c iter_args(%t = %0) -> (t) : i32 {
      %2 = scf.for %k = %a to %b step %c iter_args(%acc = %z) -> (t) : i32 {
        %w = ttg.async_wait %x {num = 1 : i32}
        %d = ttng.warp_group_dot %p, %q, %acc
        %e = scf.if %f -> (t) {
          scf.yield %d
        } else {
          scf.yield %acc
        }
        scf.yield %e
      }
      %w0 = ttg.async_wait {num = 0 : i32}
      scf.yield %2
    }
    """
    assert dot_loops(ttgir) == (1, 1)


def test_attention_runs_two_ctas_per_sm(records):
    """Decode attention fills the GPU only with several CTAs per SM: every attention config
    (head_dim 64 and 128, Llama GQA ratios, paged and contiguous, FOLD and SPLIT with its fused
    merge) leaves room for two, by registers and by shared memory."""
    att = [r for r in records if r.kernel == "attention_kernel"]
    assert {r.config["D"] for r in att} == {64, 128}
    one = [(r.config, r.registers, r.shared) for r in att if r.ctas_per_sm < 2]
    assert not one, one


def test_attention_modes_emit_one_mma_instruction(records):
    """A token's attention bits are the same in a prefill (FOLD) and a decode step (SPLIT) only
    if both launch modes of one config multiply with the same tensor-core instructions; on
    sm_90 16-bit tiles that is wgmma (BLOCK_M = 64 at four warps)."""
    by_config = {}
    for r in records:
        if r.kernel == "attention_kernel":
            c = r.config
            key = (c["dtype"], c["D"], c["G"], c["BLOCK_M"], c["BLOCK_N"])
            by_config.setdefault(key, set()).add(r.mma)
    for key, mmas in by_config.items():
        assert len(mmas) == 1, (key, mmas)
        (mma,) = mmas
        if key[0] != "float32" and records[0].arch == 90:
            assert mma and all(m.startswith("wgmma.mma_async") for m in mma), (key, mma)
