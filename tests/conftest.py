"""Shared test setup.

* ``gpu`` tests skip without CUDA.
* Selections (the tables below): ``slow`` marks the slowest tests (``-m "not slow"`` is the
  developer loop, `make test-fast`), ``quick`` a few-minute subset (`make test-quick`: house
  rules, registry, errors, the harness, and per op one invariance test on the CPU with its
  negative control); ``xdist_group`` keeps the tests sharing an expensive fixture on one
  pytest-xdist worker (`make test` runs ``-n 2 --dist loadgroup``); slow tests are moved to the
  front so that the workers start them first. An entry that names a file whose tests were all
  collected but matches none of them fails the run (a renamed test must not drop out silently).
* In the TRITON_INTERPRET=1 process, the interpreter's ``tl.dot`` is replaced by a fixed-tree
  fp32 dot (see _tree_dot), and its fp32 -> bf16 cast by torch's. Triton 3.6's interpreter computes bf16 dots
  on raw bit patterns, truncates fp32 -> bf16 where GPUs round to nearest even, and does fp32
  dots with numpy/OpenBLAS, whose bits depend on the operand shapes (a 1-row product differs
  from the same row inside a 16-row one; measured on triton 3.6). None of that is what a
  GPU does. With the replacements the interpreter runs bik's real kernel programs — indexing,
  masking, strides, tile loop order, bias, casts — with a dot that, like the hardware's,
  treats every row of a tile alike.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

# OpenMP threads that wait by sleeping, not spinning (read when torch loads libgomp, so before
# `import torch`; inherited by every process a test spawns). Bits do not depend on it, only
# speed: with two pytest-xdist workers on two cores (or anything else running), each worker's
# pool spinning at its barriers starves the other's. Measured on the 2-core machine: two
# processes of bik.linear + bik.rms_norm calls 89 s each spinning, 5.7 s each passive.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _interpreter_f32(handle) -> np.ndarray:
    import triton.language as tl

    data = handle.data
    if handle.dtype.scalar == tl.bfloat16:  # stored as uint16 bit patterns
        return (data.astype(np.uint32) << 16).view(np.float32)
    return data.astype(np.float32)


def _pairwise_sum(x: np.ndarray, axis: int) -> np.ndarray:
    """Sum over ``axis`` by a fixed pairwise tree (pairs (0,1), (2,3), ..., then recurse)."""
    x = np.moveaxis(x, axis, 0)
    while x.shape[0] > 1:
        if x.shape[0] % 2:
            x = np.concatenate([x, np.zeros_like(x[:1])])
        x = x[0::2] + x[1::2]
    return x[0]


def _tree_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    """acc + (a @ b) where each output's K_BLOCK products are summed by one fixed pairwise
    tree in fp32: every row of the tile is treated alike (as by a tensor-core instruction),
    and the K step is visible in the bits (as on the hardware), so a BLOCK_K that followed M
    would show up as a batch dependence."""
    from triton.runtime.interpreter import TensorHandle

    a32, b32 = _interpreter_f32(a), _interpreter_f32(b)
    products = a32[..., :, :, None] * b32[..., None, :, :]  # [.., M, K, N], each rounded
    acc = d.data.astype(np.float32) + _pairwise_sum(products, axis=-2)
    return TensorHandle(acc.astype(np.float32), d.dtype.scalar)


def _patch_bf16_cast(original):
    def cast_impl(self, src, dst_type):
        import triton.language as tl
        from triton.runtime.interpreter import TensorHandle

        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rne = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
            return TensorHandle(rne.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        return original(self, src, dst_type)

    return cast_impl


def _patch_lang_once_per_launch() -> None:
    """Speed only: Triton 3.6's interpreter re-patches ``triton.language`` (inspect.getmembers
    over tl, tl.core, tl.math and the tensor class) at every call of a ``@triton.jit`` helper
    from inside a kernel, though the launch already patched those modules and nothing restores
    them before the launch ends; the sampler's helpers made that ~half of the interpreter
    process. Here a helper call skips the re-patch when every language module in its globals
    is already patched by the current launch, and patches as before otherwise (the first
    launch-level patch of each launch always runs). Re-patching an already patched module sets
    equivalent wrappers (builtins once wrapped are no longer builtins, and the core and tensor
    patches depend on the module only), so the kernels run exactly as before."""
    import inspect
    import threading

    import triton.language as tl
    from triton.runtime import interpreter as ti

    original, run = ti._patch_lang, ti.GridExecutor.__call__
    state = threading.local()

    @functools.cache
    def langs_of(fn) -> frozenset:
        return frozenset(id(v) for v in fn.__globals__.values()
                         if inspect.ismodule(v) and v in (tl, tl.core))

    def patch_lang(fn):
        patched = getattr(state, "patched", None)
        langs = langs_of(fn)
        if patched is not None and langs and langs <= patched:
            return ti._LangPatchScope()  # nothing to undo: the launch's scope restores all
        scope = original(fn)
        if patched is not None:
            patched |= langs
        return scope

    def launch(self, *args, **kwargs):
        outer, state.patched = getattr(state, "patched", None), set()
        try:
            return run(self, *args, **kwargs)
        finally:
            state.patched = outer

    ti._patch_lang = patch_lang
    ti.GridExecutor.__call__ = launch


if INTERPRETER:
    import triton
    from triton.runtime.interpreter import InterpreterBuilder

    InterpreterBuilder.create_dot = _tree_dot
    InterpreterBuilder.cast_impl = _patch_bf16_cast(InterpreterBuilder.cast_impl)
    if triton.__version__ == "3.6.0":  # the interpreter structure the patch was written for
        _patch_lang_once_per_launch()


# ---- selections ------------------------------------------------------------------------------
# Patterns match node ids (rootdir-relative); ``*`` is the only wildcard. Times: the plain or interpreter
# process, serially, on the 2-core CI machine with cold build caches (docs/testing.md).

# More than ~5 s each (or a fixture of more than ~30 s): out of `make test-fast`.
SLOW = (
    # Plain process.
    "tests/test_triton_compile.py::*",  # compile_all per arch: ~50-100 s each
    "tests/sampling/test_sampling_kernel_code.py::*",  # Triton compiles, up to 25 s each
    "tests/cuda/test_cuda_compile.py::test_nvrtc_compiles_within_budgets*",  # fixture ~2 min
    "tests/cuda/test_cuda_compile.py::test_nvcc_compiles_without_spills*",
    "tests/cuda/test_cuda_compile.py::test_every_compiled_kernel_is_declared*",
    "tests/cuda/test_cuda_compile.py::test_aot_build_produces_fatbins",
    "tests/cuda/test_cuda_compile.py::test_matmul_tile_comes_from_configs_only",
    "tests/cuda/test_cuda_compile.py::test_exact_kernels_have_no_fma_or_approximations*",
    "tests/cuda/test_cuda_compile.py::test_rms_norm_vector_instance_moves_16_bytes*",
    "tests/cuda/test_cuda_compile.py::test_disk_cache_roundtrip",
    "tests/cuda/test_cuda_sm90_host.py::test_sm90a_build_uses_hgmma_and_sm80_build_traps",
    "tests/distributed/*",  # gloo worlds of 1-4 spawned processes, ~10-30 s a degree
    "tests/models/test_smollm2.py::test_hf_generate_left_padded_batch_equals_each_prompt_alone*",
    "tests/models/test_smollm2.py::test_bik_demo_real_runs",
    "tests/models/test_smollm2.py::test_bench_dvr_on_smollm2_quick",
    "tests/mode/test_hf_llama_front_ends.py::*compiled*",  # Inductor: 3-30 s each
    "tests/mode/test_compile.py::test_mode_compiled_training_step_is_row_invariant",
    "tests/mode/test_torch_semantics.py::test_opinfo_samples_aot_eager*",
    "tests/attention/test_attention.py::test_torch_compile_fullgraph_keeps_bits*",
    "tests/sampling/test_sampling_noise.py::test_bik_log_accuracy_and_torch_replica*",
    "tests/sampling/test_sampling_distribution.py::test_distribution_chi_square*",
    "tests/vllm_plugin/test_vllm_plugin.py::*",  # a vLLM engine each (.venv-vllm)
    # Interpreter process.
    "tests/test_program_order.py::test_sampler_top_p_passes_*",  # 5 top-p draws: ~15 s
    "tests/sampling/test_sampling_vs_cpu.py::test_top_p_equals_cpu[160-*-interpreter]",
    "tests/sampling/test_sampling_vs_cpu.py::test_top_p_equals_cpu[150-near_ties-interpreter]",
    "tests/sampling/test_sampling_vs_cpu.py::test_tokens_equal_cpu[512-*-interpreter]",
    "tests/sampling/test_sampling_top_p_search.py::test_near_ties_are_the_contracts*",
    "tests/sampling/test_sampling_top_p_search.py::test_cut_and_mass_are_the_contracts_in_a_few"
    "_passes[0.95-*",
    "tests/sampling/test_sampling_top_p_search.py::test_each_pass_runs_one_program_per_normaliser"
    "_group[2000-*",
    "tests/sampling/test_sampling_verify.py::test_drafter_invariance[interpreter]",
    "tests/sampling/test_sampling.py::test_filters_keep_what_they_promise[interpreter]",
    "tests/sampling/test_sampling_normaliser.py::test_top_p_keeps_the_contract_set[interpreter]",
    "tests/test_host_metadata.py::test_too_small_a_max_top_k_changes_tokens[interpreter]",
    "tests/sampling/test_sampling_launches.py::test_top_p_on_real_logits_takes_few_passes_and"
    "_launches[interpreter]",  # one 49152-token row's top-p search: ~15 s
    "tests/test_host_metadata.py::test_sample_and_verify_with_max_top_k_read_nothing"
    "[interpreter]",
    "tests/attention/test_attention.py::test_hypothesis_chunking[interpreter]",
    "tests/attention/test_attention.py::test_chunking_gqa_ratios[interpreter-split-*",
    "tests/attention/test_attention.py::test_same_check_rejects_a_split_size_chosen_by_length"
    "[interpreter]",
    "tests/attention/test_attention.py::test_random_neighbours_and_rows[interpreter-split-*",
)

# `make test-quick`: a few minutes, the plain process only.
QUICK = (
    "tests/test_house_rules.py::*",
    "tests/test_registry.py::*",
    "tests/test_errors.py::*",
    "tests/test_harness.py::*",  # split-by-M matmul / RMSNorm and stock fp32 torch.mm rejected
    # One invariance test per op on the CPU, with its negative control.
    "tests/matmul/test_matmul.py::test_matmul_rows_invariant[*-cpu]",
    "tests/matmul/test_matmul.py::test_bmm_rows_and_entries_invariant[*-cpu]",
    "tests/matmul/test_grouped_matmul.py::test_a_row_has_bik_linears_bits[cpu]",
    "tests/matmul/test_grouped_matmul.py::test_the_harness_rejects_a_product_tiled_by_group*",
    "tests/rms_norm/test_rms_norm.py::test_rms_norm_rows_invariant[*-cpu]",
    "tests/rms_norm/test_rms_norm.py::test_fused_add_rms_norm_equals_unfused[*-cpu]",
    "tests/reductions/test_reductions.py::test_rows_invariant_over_m_sweep[*-cpu]",
    "tests/reductions/test_reductions.py::test_harness_rejects_a_sum_split_by_m*",
    "tests/attention/test_attention.py::test_prefill_chunks_decode_verify_same_bits[cpu-*",
    "tests/attention/test_attention.py::test_*_is_rejected",
    "tests/attention/test_attention.py::test_paged_contiguous_and_varlen_agree[cpu-*",
    "tests/attention/test_attention_backward.py::test_decode_row_grads_alone_vs_packed*",
    "tests/attention/test_attention_backward.py::test_batch_dependent_backward_is_caught*",
    "tests/sampling/test_sampling.py::test_batch_invariance[*-cpu]",
    "tests/sampling/test_sampling.py::test_row_keyed_reference_is_rejected",
    "tests/sampling/test_sampling_verify.py::test_drafter_invariance[cpu]",
    "tests/mode/test_silu.py::test_stock_silu_is_not_row_invariant",
    "tests/mode/test_silu.py::test_silu_rows_invariant_and_close_to_stock*",
)

# Tests sharing a module-scoped fixture too costly to build twice go to one xdist worker
# (--dist loadgroup, scheduled by pytest_xdist_make_scheduler below): Triton's compiles of one
# arch (test_sampling_kernel_code compiles the sampler kernels compile_all compiles, and meets
# them in Triton's cache), the NVRTC + nvcc fixture of test_cuda_compile, and the vLLM engine
# of test_vllm_plugin's bik_fp32 fixture.
GROUPS = {
    "tests/test_triton_compile.py::*[sm90]": "triton-sm90",
    "tests/test_triton_compile.py::*[sm80]": "triton-sm80",
    "tests/sampling/test_sampling_kernel_code.py::*-90]": "triton-sm90",
    "tests/sampling/test_sampling_kernel_code.py::*-80]": "triton-sm80",
    "tests/cuda/test_cuda_compile.py::test_nvrtc_compiles_within_budgets*": "cuda-compile",
    "tests/cuda/test_cuda_compile.py::test_nvcc_compiles_without_spills*": "cuda-compile",
    "tests/cuda/test_cuda_compile.py::test_every_compiled_kernel_is_declared*": "cuda-compile",
    # One gloo world per degree runs that degree's scenarios (tests/distributed/tp_world.py).
    "tests/distributed/test_tp_linear.py::*[1]": "gloo-1",
    "tests/distributed/test_tp_linear.py::*[2]": "gloo-2",
    "tests/distributed/test_tp_linear.py::*[4]": "gloo-4",
    # .venv-vllm (`make test-vllm`): the tests reading the bik fp32 engine's results.
    "tests/vllm_plugin/test_vllm_plugin.py::test_plugin_fp32_alone_equals_batched": "vllm-fp32",
    "tests/vllm_plugin/test_vllm_plugin.py::test_plugin_prefix_cache_cold_equals_hot": "vllm-fp32",
    "tests/vllm_plugin/test_vllm_plugin.py::test_plugin_seeded_sampling_*": "vllm-fp32",
    "tests/vllm_plugin/test_vllm_plugin.py::test_plugin_chunked_prefill_equals_one_prefill":
        "vllm-fp32",
    "tests/vllm_plugin/test_vllm_plugin.py::test_trainer_logprobs_equal_the_engines_fp32":
        "vllm-fp32",
}


def _group(nodeid: str) -> str | None:
    return next((g for p, g in GROUPS.items() if _matches(nodeid, (p,))), None)


@pytest.hookimpl(optionalhook=True)  # xdist's hook: unknown where xdist is not loaded
def pytest_xdist_make_scheduler(config, log):
    """--dist loadgroup with each test's group looked up in GROUPS by the controller.

    pytest-xdist 3.8's loadgroup learns a test's group from a ``@group`` suffix its workers
    write into ``item._nodeid``, which pytest 9.2 no longer reads (pytest-dev/pytest-xdist#1386):
    every group was ignored, and each worker built the fixtures the groups exist to share (the
    Triton compiles of an arch twice: ~190 s of the plain process's worker time). Here the
    controller's scheduler, xdist's own LoadScopeScheduling, takes the group from the node id
    (a ``@group`` suffix where xdist still writes one); an ungrouped test is its own unit, as
    in loadgroup."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.rfind("@") > nodeid.rfind("]"):
                return nodeid.rsplit("@", 1)[1]
            return _group(nodeid) or nodeid

    return GroupScheduling(config, log)


@functools.cache
def _regex(pattern: str) -> re.Pattern:
    return re.compile(".*".join(map(re.escape, pattern.split("*"))))


def _matches(nodeid: str, patterns) -> bool:
    return any(_regex(p).fullmatch(nodeid) for p in patterns)


def _check_tables(config, items) -> None:
    """Every table entry names an existing file, and matches a test whenever its file's tests
    were all collected (no ``file::test`` argument narrowed them)."""
    if any("::" in str(arg) for arg in config.args):
        return
    root = Path(config.rootpath)
    files = {item.nodeid.split("::", 1)[0] for item in items}
    stale = []
    for pattern in (*SLOW, *QUICK, *GROUPS):
        path = pattern.split("::", 1)[0]
        if "*" in path:
            continue
        if not (root / path).is_file():
            stale.append(f"{pattern} (no such file)")
        elif path in files and not any(_matches(i.nodeid, (pattern,)) for i in items):
            stale.append(pattern)
    if stale:
        raise pytest.UsageError("tests/conftest.py: selection entries that match no test: "
                                + ", ".join(stale))


@pytest.hookimpl(tryfirst=True)  # before -m deselects by these marks
def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if _matches(item.nodeid, SLOW):
            item.add_marker(pytest.mark.slow)
        if _matches(item.nodeid, QUICK):
            item.add_marker(pytest.mark.quick)
        group = _group(item.nodeid)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    _check_tables(config, items)


class _SlowFirst:
    @pytest.hookimpl(trylast=True)  # after pytest's own reordering by fixture scope
    def pytest_collection_modifyitems(self, items):
        """Slow tests first (in their order): xdist workers start the long ones early, so no
        worker is left alone with a long test at the end."""
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_configure(config):
    config.pluginmanager.register(_SlowFirst(), "bik-slow-first")


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches and bik's counters empty before, and no front end left on after (the
    front-end tests under tests/mode/)."""
    import bik

    torch._dynamo.reset()
    bik.reset_mode_stats()
    yield
    torch._dynamo.reset()
    assert not bik.is_enabled() and not bik.is_batch_invariant_mode_enabled()
