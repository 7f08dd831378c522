"""Every Triton kernel configuration bik can launch on sm_90 / sm_80, compiled without a GPU.

Used by tests/test_triton_compile.py (limits) and tools/triton_compile_report.py (a JSON
record of shared memory, registers and spills per config).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from bik.configs import matmul_config, matmul_split, rms_norm_config
from triton_compile import CompileRecord, Desc, Ptr, compile_kernel

__all__ = ["ARCHS", "ATTENTION_HEADS", "GROUPED_SHAPES", "MATMUL_SHAPES", "REDUCTION_LENGTHS", "RMS_NORM_HIDDENS",
           "SAMPLE_VOCABS", "compile_all", "sampling_kernel_cases"]

ARCHS = (90, 80)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Llama-3-8B projections and the LM head, plus narrow/short shapes that get smaller tiles, and
# a K that splits by 1024 unaligned (ungrouped: no 16-element load alignment).
MATMUL_SHAPES = ((4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336), (128256, 4096),
                 (48, 33), (64, 16), (256, 3001))
RMS_NORM_HIDDENS = (111, 4096, 8192)
# softmax / log_softmax / mean row lengths: odd and short, one chunk, a Llama-3 vocabulary.
REDUCTION_LENGTHS = (111, 4096, 128256)
# (head_dim, q heads, kv heads): Llama-3-8B, Llama-3-70B (per 8-way TP shard: 8 q / 1 kv), MHA.
ATTENTION_HEADS = ((128, 32, 8), (128, 8, 1), (64, 16, 16))


def _matmul_cases(arch: int) -> Iterator[tuple]:
    """Each (dtype, N, K) in both launch modes (FOLD; SPREAD, whose last program per tile folds
    the partials, when K has several splits): tests/test_triton_compile.py checks every mode
    emits one MMA."""
    from bik.ops.matmul.triton import input_precision, matmul_kernel

    seen = set()
    for dtype in DTYPES:
        for n, k in MATMUL_SHAPES:
            cfg = matmul_config(dtype, n, k, f"sm{arch}")
            plan = matmul_split(dtype, n, k)
            multi = plan.n_splits(k) > 1
            for has_bias in (False, True):
                for spread in (False, True) if multi else (False,):
                    # B as a transposed nn.Linear weight (stride_bk = 1): the common layout.
                    key = (dtype, cfg, has_bias, k % 16 == 0, n % 16 == 0, spread, multi)
                    if key in seen:
                        continue
                    seen.add(key)
                    args = {"a_ptr": Ptr(dtype), "b_ptr": Ptr(dtype),
                            "bias_ptr": Ptr(torch.float32), "c_ptr": Ptr(dtype),
                            "ws_ptr": Ptr(torch.float32), "ticket_ptr": Ptr(torch.int32),
                            "M": 4096, "N": n, "K": k,
                            "SPLIT": plan.split, "stride_ab": 0, "stride_am": k,
                            "stride_ak": 1, "stride_bb": 0, "stride_bk": 1, "stride_bn": k,
                            "stride_cb": 0, "stride_cm": n, "stride_cn": 1}
                    consts = {"HAS_BIAS": has_bias, "INPUT_PRECISION": input_precision(dtype),
                              "SPREAD": spread, "MULTI_SPLIT": multi,
                              "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
                              "BLOCK_K": cfg.block_k, "GROUP_M": cfg.group_m}
                    yield matmul_kernel, args, consts, cfg.num_warps, cfg.num_stages
        yield from _persistent_cases(arch, dtype)


def _persistent_cases(arch: int, dtype) -> Iterator[tuple]:
    """PERSISTENT (TMA; Hopper and 16-bit inputs only: bik.ops.matmul.schedule.use_persistent)
    for the aligned shapes, B as a linear layer's [N, K] weight and as a row-major [K, N]
    matrix."""
    from bik.ops.matmul.triton import input_precision, matmul_tma_kernel

    if arch != 90 or dtype == torch.float32:  # use_persistent: Hopper, 16-bit inputs
        return
    for n, k in MATMUL_SHAPES:
        cfg = matmul_config(dtype, n, k, f"sm{arch}")
        plan = matmul_split(dtype, n, k)
        if k % 16 or n % 16 or plan.split % cfg.block_k:
            continue  # TMA refuses these operands: they run FOLD
        for has_bias in (False, True):
            for b_nk in (True, False):
                b_block = (cfg.block_n, cfg.block_k) if b_nk else (cfg.block_k, cfg.block_n)
                args = {"a_desc": Desc(dtype, (cfg.block_m, cfg.block_k)),
                        "b_desc": Desc(dtype, b_block), "bias_ptr": Ptr(torch.float32),
                        "c_ptr": Ptr(dtype), "M": 4096, "N": n, "K": k, "SPLIT": plan.split,
                        "num_programs": 132, "stride_cm": n, "stride_cn": 1}
                consts = {"HAS_BIAS": has_bias, "INPUT_PRECISION": input_precision(dtype),
                          "MULTI_SPLIT": plan.n_splits(k) > 1, "B_NK": b_nk,
                          "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
                          "BLOCK_K": cfg.block_k, "GROUP_M": cfg.group_m}
                yield matmul_tma_kernel, args, consts, cfg.num_warps, cfg.num_stages


# bik::grouped_matmul: a Llama projection (its MMA compared with matmul_kernel's) and
# Qwen3-30B-A3B's expert widths (gate-up [1536, 2048], down [2048, 768]), bf16 and fp32.
GROUPED_SHAPES = ((4096, 4096), (1536, 2048), (2048, 768))


def _grouped_cases(arch: int) -> Iterator[tuple]:
    """bik::grouped_matmul's kernel with bik::matmul's tile and split for each (dtype, N, K),
    B as the transposed [G, N, K] weights of a model's experts."""
    from bik.ops.matmul.triton import input_precision
    from bik.ops.matmul.triton_grouped import grouped_matmul_kernel

    for dtype in (torch.bfloat16, torch.float32):
        for n, k in GROUPED_SHAPES:
            cfg = matmul_config(dtype, n, k, f"sm{arch}")
            plan = matmul_split(dtype, n, k)
            args = {"a_ptr": Ptr(dtype), "b_ptr": Ptr(dtype), "ends_ptr": Ptr(torch.int32),
                    "c_ptr": Ptr(dtype), "S": 4096, "G": 128, "N": n, "K": k,
                    "SPLIT": plan.split, "stride_am": k, "stride_ak": 1, "stride_bg": n * k,
                    "stride_bk": 1, "stride_bn": k, "stride_cm": n, "stride_cn": 1}
            consts = {"INPUT_PRECISION": input_precision(dtype),
                      "MULTI_SPLIT": plan.n_splits(k) > 1, "BLOCK_M": cfg.block_m,
                      "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k}
            yield grouped_matmul_kernel, args, consts, cfg.num_warps, cfg.num_stages


def _rms_norm_cases(arch: int) -> Iterator[tuple]:
    from bik.ops.rms_norm.triton import rms_norm_kernel

    for dtype in DTYPES:
        for hidden in RMS_NORM_HIDDENS:
            cfg = rms_norm_config(dtype, hidden, f"sm{arch}")
            for residual in (False, True):
                args = {"x_ptr": Ptr(dtype), "r_ptr": Ptr(dtype), "w_ptr": Ptr(dtype),
                            "out_ptr": Ptr(dtype), "h_ptr": Ptr(dtype), "H": hidden, "eps": 1e-6,
                            "stride_x": hidden, "stride_r": hidden, "stride_out": hidden, "stride_h": hidden}
                consts = {"HAS_RESIDUAL": residual, "BLOCK_H": cfg.block_h}
                yield rms_norm_kernel, args, consts, cfg.num_warps, 1


def _reduction_cases(arch: int) -> Iterator[tuple]:
    """softmax, mean, and log_softmax (the sampler's normaliser: compiled as launched, without
    fp fusion, so tests/reductions/test_log_softmax_normaliser.py can check its PTX)."""
    from bik.configs import reduction_config
    from bik.ops._normaliser_triton import NO_FUSION
    from bik.ops.reductions.triton import (
        log_softmax_kernel,
        log_softmax_launch_args,
        mean_kernel,
        softmax_kernel,
    )

    for dtype in DTYPES:
        for n in REDUCTION_LENGTHS:
            cfg = reduction_config(n, f"sm{arch}")
            for out_dtype in sorted({dtype, torch.float32}, key=str):  # incl. half -> float
                args = {"x_ptr": Ptr(dtype), "out_ptr": Ptr(out_dtype), "N": n, "stride_x": n,
                            "stride_out": n}
                yield (softmax_kernel, args, {"BLOCK": cfg.block, "ANCHOR": True},
                       cfg.num_warps, 1)
                group_len, meta = log_softmax_launch_args(n, f"sm{arch}")
                warps = meta.pop("num_warps")
                yield (log_softmax_kernel, args | {"GROUP_LEN": group_len}, meta, warps, 1,
                       NO_FUSION)
                args = {"x_ptr": Ptr(dtype), "out_ptr": Ptr(out_dtype), "N": n, "n_f32": float(n),
                            "stride_x": n}
                yield mean_kernel, args, {"BLOCK": cfg.block}, cfg.num_warps, 1


def _attention_cases(arch: int) -> Iterator[tuple]:
    """Llama-style GQA ratios and head dims, paged and contiguous, both launch modes (SPLIT with
    its fused merge)."""
    from bik.configs import attention_config
    from bik.ops.attention.triton import LOG2E, attention_kernel

    i32, f32 = Ptr(torch.int32), Ptr(torch.float32)
    no_fusion = {"enable_fp_fusion": False}
    for dtype in DTYPES:
        for d, hq, hkv in ATTENTION_HEADS:
            g = hq // hkv
            cfg = attention_config(dtype, d, g, f"sm{arch}")
            block_m = max(cfg.block_m, 1 << (g - 1).bit_length())
            for paged in (True, False):
                for fold in (True, False):
                    args = {"q_ptr": Ptr(dtype), "k_ptr": Ptr(dtype), "v_ptr": Ptr(dtype),
                                "out_ptr": Ptr(dtype), "lse_ptr": f32, "pacc_ptr": f32, "pml_ptr": f32,
                                "ticket_ptr": i32, "cu_q_ptr": i32, "seqlens_k_ptr": i32, "table_ptr": i32,
                                "base_ptr": Ptr(torch.int64), "stride_qt": hq * d, "stride_qh": d,
                                "stride_ot": hq * d, "stride_oh": d, "stride_table_b": 64,
                                "stride_page": 16 * hkv * d if paged else 0,
                                "stride_tok": hkv * d, "stride_kvh": d, "block_size": 16, "total_q": 4096,
                                "num_heads_q": hq,
                                "scale_log2e": LOG2E / d**0.5, "num_bh": 8 * hkv,
                                "q_bound": 4096, "k_bound": 131072}
                    consts = {"HKV": hkv, "G": g, "D": d, "BLOCK_M": block_m,
                                  "BLOCK_T": max(1, cfg.block_m // g), "BLOCK_N": cfg.block_n,
                                  "SPLIT": cfg.split, "PAGED": paged, "CAUSAL": True, "FOLD": fold,
                                  "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
                                  "BASE_MULTIPLE": 1 if paged else 16}
                    yield attention_kernel, args, consts, cfg.num_warps, cfg.num_stages, no_fusion
    yield from _kv_write_cases()


def _kv_write_cases() -> Iterator[tuple]:
    """bik::write_kv_cache's GPU copy for every dtype and head layout."""
    from bik.ops.attention.kv_cache_triton import write_block, write_kv_kernel

    for dtype in DTYPES:
        for d, _, hkv in ATTENTION_HEADS:
            args = {"k_cache_ptr": Ptr(dtype), "v_cache_ptr": Ptr(dtype), "k_ptr": Ptr(dtype),
                    "v_ptr": Ptr(dtype), "slots_ptr": Ptr(torch.int64), "n_slots": 1 << 20,
                    "page_size": 16, "stride_kc_page": 16 * hkv * d, "stride_kc_tok": hkv * d,
                    "stride_kc_head": d, "stride_vc_page": 16 * hkv * d, "stride_vc_tok": hkv * d,
                    "stride_vc_head": d, "stride_kt": hkv * d, "stride_kh": d, "stride_kd": 1,
                    "stride_vt": hkv * d, "stride_vh": d, "stride_vd": 1}
            yield (write_kv_kernel, args, {"HKV": hkv, "D": d, "BLOCK": write_block(hkv, d)}, 4,
                   1)


# Sampler vocabularies: small and odd, Llama-3 (128256), and a 256k vocabulary.
SAMPLE_VOCABS = (111, 128256, 262144)


def sampling_kernel_cases(arch: int) -> Iterator[tuple]:
    """The sampler's kernels (top-p passes and finish, the group stats of rows without top-p,
    the pick, the finish) for every logits dtype and vocabulary, compiled exactly as launched
    (no fp fusion), so their PTX can be checked for approximations."""
    from bik.configs import sampler_chunks, sampling_config
    from bik.ops._normaliser_triton import NO_FUSION
    from bik.ops.sampling.triton import finish_kernel, gumbel_pick_kernel
    from bik.ops.sampling.triton_common import _chunks_per_tile
    from bik.ops.sampling.triton_groups import group_mass_kernel, group_max_kernel
    from bik.ops.sampling.triton_top_p import (
        TOP_P_CANDIDATES,
        TOP_P_LANES,
        top_p_finish_kernel,
        top_p_pass_kernel,
    )

    cfg = sampling_config(f"sm{arch}")
    f32, i32, i64 = Ptr(torch.float32), Ptr(torch.int32), Ptr(torch.int64)
    for dtype in DTYPES:
        for v in SAMPLE_VOCABS:
            groups, chunk = sampler_chunks(v)
            splits = -(-v // cfg.split)
            ws = {"ws_f": f32, "FW": 2 * groups + 3 + splits, "ws_i": i32,
                  "IW": groups + 1 + splits}
            row = {"x_ptr": Ptr(dtype), "stride_x": v}
            filters = {"temp_ptr": f32, "vk_ptr": f32, "ik_ptr": i32}
            folds = {"CHUNK": chunk, "LOG2_CHUNK": chunk.bit_length() - 1,
                     "NCH": _chunks_per_tile(f"sm{arch}", chunk)}
            search = {"top_p_ptr": f32, "min_p_ptr": f32} | ws | {
                "probe_ptr": f32, "fstate_ptr": f32, "istate_ptr": i64, "gmass_ptr": f32,
                "cand_ptr": f32, "count_ptr": i32}
            consts = {"G": groups, "LANES": TOP_P_LANES, "CANDIDATES": TOP_P_CANDIDATES,
                      "TOPK": True} | folds
            args = row | {"GROUP_LEN": v // groups, "it": 2} | filters | search | {
                "ticket_ptr": i32, "passes_ptr": i32}
            yield top_p_pass_kernel, args, consts, cfg.num_warps, 1, NO_FUSION
            args = row | {"GROUP_LEN": v // groups, "first": 4, "last": 10} | filters | search | {
                "passes_ptr": i32}
            yield top_p_finish_kernel, args, consts, cfg.num_warps, 1, NO_FUSION
            args = row | {"GROUP_LEN": v // groups} | filters | ws
            yield (group_max_kernel, args, {"G": groups, "BLOCK": cfg.block, "TOPK": True},
                   cfg.num_warps, 1, NO_FUSION)
            args = row | {"GROUP_LEN": v // groups} | filters | {"top_p_ptr": f32,
                                                                 "min_p_ptr": f32} | ws
            yield (group_mass_kernel, args, {"G": groups, "TOPK": True, "PLAIN": False} | folds,
                   cfg.num_warps, 1, NO_FUSION)
            args = row | {"V": v, "seed_ptr": i64, "pos_ptr": i64} | filters | ws
            yield (gumbel_pick_kernel, args, {"G": groups, "SPLIT": cfg.split,
                                              "BLOCK": cfg.block, "TOPK": True},
                   cfg.num_warps, 1, NO_FUSION)
            args = row | {"temp_ptr": f32, "top_p_ptr": f32} | ws | {
                "tokens_ptr": i64, "logprobs_ptr": f32, "n_splits": splits}
            yield (finish_kernel, args, {"G": groups, "SPLITS_P2": 1 << (splits - 1).bit_length(),
                                         "PLAIN": False}, 1, 1, NO_FUSION)


def compile_all(arch: int) -> list[CompileRecord]:
    records = []
    for cases in (_matmul_cases(arch), _grouped_cases(arch), _rms_norm_cases(arch), _reduction_cases(arch),
                  _attention_cases(arch), sampling_kernel_cases(arch)):
        for kernel, args, consts, warps, stages, *options in cases:
            rec = compile_kernel(kernel, args, consts, arch=arch, num_warps=warps,
                                 num_stages=stages, options=options[0] if options else None)
            records.append(rec._replace(config=rec.config | {
                "dtype": str(next(v.dtype for v in args.values()
                                  if isinstance(v, (Ptr, Desc))))[6:],
                "shape": {k: v for k, v in args.items() if k in ("N", "K", "H")}}))
    return records
