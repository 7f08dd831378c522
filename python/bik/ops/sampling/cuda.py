"""Launcher for the CUDA C++ sampler (csrc/cuda/sampling.cu).

``launch_sample`` returns per row the max, log of the kept mass, the invalid flag and each
vocabulary split's winner; split_vocab.sample_split_vocab merges them in torch (the Triton
sampler does the same in its finish kernel). Both kernels use only exactly rounded
operations: the pick (noise, filters, argmax) and the stats (top-p masses and the logprob's
normaliser in the contract's order, bik.configs.sampler_chunks), so tokens and logprobs are
the CPU path's and the Triton kernels'. The split size and block width never change a bit.
"""

from __future__ import annotations

import torch

from bik._dtypes import DTYPES, info
from bik.configs import sampler_chunks
from bik.ops.sampling.noise import greedy_limit, log_min_p
from bik.ops.sampling.split_vocab import sample_split_vocab
from bik.runtime import cuda_jit
from bik.runtime.cuda_jit import F32, I32, I64, PTR

THREADS = 512
SPLIT = 16384  # vocabulary entries per pick block
# The kernels' compiled constants (csrc/cuda/sampling.cuh / .cu; a test reads them there).
COMPILED_CHUNK = 1024  # kSamplerChunk
MAX_CHUNKS = 2048  # kMaxChunks: normaliser chunks per group
PROBE_LANES = 16  # kProbeLanes
CANDIDATES = 256  # kTopPCandidates
PASSES = 10  # kTopPPasses: launches of the pass kernel (settled rows return at once)
CUT_STATE_BYTES = 128  # kCutStateBytes

# csrc/cuda/sampling.cu: three kernels per logits dtype (suffix _f32, _bf16, _f16).
_ROW_FILTERS = [("temperature", PTR), ("vk", PTR), ("ik", PTR)]
KERNELS = {
    **cuda_jit.declare("sampling", [f"bik_sample_group_max_{t.cuda}" for t in DTYPES],
                       [("x", PTR), ("stride_x", I64), ("group_len", I64), *_ROW_FILTERS,
                        ("gmax", PTR), ("gbad", PTR)]),
    **cuda_jit.declare("sampling", [f"bik_sample_pass_{t.cuda}" for t in DTYPES],
                       [("x", PTR), ("stride_x", I64), ("group_len", I64), ("it", I32),
                        *_ROW_FILTERS, ("top_p", PTR), ("log_min_p", PTR), ("gmax", PTR),
                        ("gbad", PTR), ("state", PTR), ("gmass", PTR), ("cand", PTR),
                        ("counts", PTR), ("tickets", PTR), ("m_out", PTR), ("vlo_out", PTR),
                        ("logs_out", PTR), ("bad_out", PTR)]),
    **cuda_jit.declare("sampling", [f"bik_gumbel_pick_{t.cuda}" for t in DTYPES],
                       [("x", PTR), ("stride_x", I64), ("vocab", I64), ("key", PTR),
                        *_ROW_FILTERS, ("vlo", PTR), ("m", PTR), ("part_val", PTR),
                        ("part_idx", PTR), ("n_splits", I32), ("split_size", I32)]),
}


def launch_sample(logits: torch.Tensor, key: torch.Tensor, temperature: torch.Tensor,
                  vk: torch.Tensor, ik: torch.Tensor, top_p: torch.Tensor,
                  log_min_p: torch.Tensor):
    """Run the group max, the pass kernel's PASSES launches (the row statistics, one block per
    (row, normaliser group)) and the pick. logits [B, V] (unit stride along V); key int64 [B, 5]
    (seed lo, seed hi, position lo, position hi, stream); per-row fp32 temperature, top-k
    threshold (vk fp32, ik int32), top_p and log_min_p, all contiguous. Returns (m, log_s, bad,
    part_val, part_idx) like the Triton launcher."""
    b, v = logits.shape
    dev = logits.device
    n_splits = (v + SPLIT - 1) // SPLIT
    m = torch.empty(b, dtype=torch.float32, device=dev)
    v_lo = torch.empty(b, dtype=torch.float32, device=dev)
    log_s = torch.empty(b, dtype=torch.float32, device=dev)
    bad = torch.empty(b, dtype=torch.int32, device=dev)
    part_val = torch.empty(b, n_splits, dtype=torch.float32, device=dev)
    part_idx = torch.empty(b, n_splits, dtype=torch.int32, device=dev)
    if b == 0:
        return m, log_s, bad, part_val, part_idx
    if v > 1 and logits.stride(1) != 1:
        raise ValueError("cuda sample: logits must have unit stride along V")
    expect = {"key": (key, torch.int64), "temperature": (temperature, torch.float32),
              "vk": (vk, torch.float32), "ik": (ik, torch.int32), "top_p": (top_p, torch.float32),
              "log_min_p": (log_min_p, torch.float32)}
    for name, (t, dtype) in expect.items():
        if t.dtype != dtype or not t.is_contiguous() or t.shape[0] != b:
            raise ValueError(f"cuda sample: {name} must be a contiguous {dtype} tensor per row")
    if n_splits > 65535:
        raise ValueError(f"cuda sample: V = {v} needs more than 65535 splits of {SPLIT}")
    groups, chunk = sampler_chunks(v)
    if chunk != COMPILED_CHUNK:
        raise ValueError(f"cuda sample: the kernels are compiled for normaliser chunks of "
                         f"{COMPILED_CHUNK}; bik.configs.SAMPLER_CHUNK is {chunk}")
    if -(-(v // groups) // chunk) > MAX_CHUNKS:
        raise ValueError(f"cuda sample: V = {v} needs more than {MAX_CHUNKS} normaliser chunks "
                         f"of {chunk} per group")
    suffix = info(logits.dtype).cuda
    stride, glen = logits.stride(0), v // groups
    gmax = torch.empty(b, groups, dtype=torch.float32, device=dev)
    gbad = torch.empty(b, groups, dtype=torch.int32, device=dev)
    cuda_jit.launch_kernel(KERNELS, f"bik_sample_group_max_{suffix}", (b, groups, 1),
                           (THREADS, 1, 1), 0, logits, stride, glen, temperature, vk, ik, gmax,
                           gbad, device=dev)
    state = torch.empty(b, CUT_STATE_BYTES, dtype=torch.uint8, device=dev)
    gmass = torch.empty(b, groups, PROBE_LANES, dtype=torch.float32, device=dev)
    cand = torch.empty(b, groups, CANDIDATES, dtype=torch.float32, device=dev)
    counts = torch.zeros(b, groups, dtype=torch.int64, device=dev)
    tickets = torch.zeros(b, dtype=torch.int32, device=dev)
    for it in range(PASSES):
        cuda_jit.launch_kernel(KERNELS, f"bik_sample_pass_{suffix}", (b, groups, 1),
                               (THREADS, 1, 1), 0, logits, stride, glen, it, temperature, vk, ik,
                               top_p, log_min_p, gmax, gbad, state, gmass, cand, counts, tickets,
                               m, v_lo, log_s, bad, device=dev)
    cuda_jit.launch_kernel(KERNELS, f"bik_gumbel_pick_{suffix}", (b, n_splits, 1),
                           (THREADS, 1, 1), 0, logits, stride, v, key, temperature, vk, ik, v_lo,
                           m, part_val, part_idx, n_splits, SPLIT, device=dev)
    return m, log_s, bad, part_val, part_idx


def sample_rows(x, seed, position, temperature, top_k, top_p, min_p, max_top_k=None,
                any_top_p=None):
    """The op's entry point on this backend (see bik/ops/sampling/op.py). The top-p launches
    run whatever ``any_top_p`` says (rows without top-p return at once)."""
    del any_top_p
    return sample_split_vocab(launch_sample, x, seed, position, greedy_limit(temperature),
                              top_k, top_p, log_min_p(min_p), max_top_k)
