"""The host side of the split-vocabulary GPU samplers.

Both GPU backends find the top-k threshold here, with exact operations before the launch
(``topk_threshold``). The CUDA C++ kernels return, per row, the max m, log of the kept mass,
an invalid flag and each vocabulary split's winner, and ``sample_split_vocab`` merges the
splits' winners under (value desc, index asc), a total order, so any split gives the same
token (the Triton sampler does the same merge in its finish kernel).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from bik.ops.sampling.noise import STREAM_SAMPLE


def topk_threshold(x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   max_top_k: int | None):
    """(vk, ik) per row for the greedy-limited ``temperature``: the k-th token in the order
    (z desc, index asc); a token is kept iff z > vk or (z == vk and index <= ik). Exact
    operations only (IEEE division, sorting, counting), so the kept set is the CPU kernel's.
    Rows with top-k off keep everything.

    One ``topk`` of width ``max_top_k`` (the caller's host bound on the rows' top_k) serves
    every row, so nothing is read back; without the bound one host sync finds it."""
    rows, v = x.shape
    greedy = temperature == 0
    t_safe = torch.where(greedy, torch.ones_like(temperature), temperature)
    vk = torch.full((rows,), float("-inf"), dtype=torch.float32, device=x.device)
    ik = torch.full((rows,), v, dtype=torch.int32, device=x.device)
    on = (top_k > 0) & (top_k < v)
    if max_top_k is None:
        max_top_k = int(torch.where(on, top_k, 0).max()) if rows else 0
    width = min(max_top_k, v - 1)  # top_k >= V is off, so no row needs more
    if width <= 0 or rows == 0:
        return vk, ik
    xs = x.float()
    zs = torch.where(greedy[:, None], xs, xs / t_safe[:, None])
    ks = top_k.clamp(1, width)
    kth = torch.topk(zs, width, dim=1, sorted=True).values.gather(1, (ks - 1)[:, None])
    ahead = ks - (zs > kth).sum(1)  # tokens of value kth to keep, lowest index first
    eq_count = (zs == kth).to(torch.int32).cumsum(1)
    vk = torch.where(on, kth[:, 0], vk)
    ik = torch.where(on, (eq_count < ahead[:, None]).sum(1).to(torch.int32), ik)
    return vk, ik


def sample_split_vocab(launch_sample: Callable, x: torch.Tensor, seed: torch.Tensor,
                       position: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                       top_p: torch.Tensor, log_min_p: torch.Tensor,
                       max_top_k: int | None = None):
    """(tokens, logprobs) of bik::sample with the CUDA C++ ``launch_sample``, for the
    greedy-limited temperature and log_min_p (noise.py); with ``max_top_k`` given, nothing is
    read back to the host."""
    rows = x.shape[0]
    greedy = temperature == 0
    t_safe = torch.where(greedy, torch.ones_like(temperature), temperature)
    vk, ik = topk_threshold(x, temperature, top_k, max_top_k)
    key = torch.stack([seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, position & 0xFFFFFFFF,
                       (position >> 32) & 0xFFFFFFFF,
                       torch.full_like(seed, STREAM_SAMPLE)], dim=1).contiguous()
    # The kernels read the logits in their own dtype and upcast in registers (exact).
    m, log_s, bad, part_val, part_idx = launch_sample(x, key, temperature, vk, ik, top_p,
                                                      log_min_p)
    if rows == 0:
        return (torch.empty(0, dtype=torch.int64, device=x.device),
                torch.empty(0, dtype=torch.float32, device=x.device))
    # Merge the splits' winners: the highest value, then the lowest index (a total order).
    top = part_val.max(dim=1).values
    big = torch.full_like(part_idx, 2**31 - 1)
    idx = torch.where(part_val == top[:, None], part_idx, big).min(dim=1).values.to(torch.int64)
    invalid = (bad != 0) | (top == float("-inf"))
    tokens = torch.where(invalid, torch.full_like(idx, -1), idx)
    x_c = x.gather(1, tokens.clamp(min=0)[:, None])[:, 0].float()
    z_c = torch.where(greedy, x_c, x_c / t_safe)  # the kernel's z at the chosen token
    logprobs = (z_c - m) - log_s
    logprobs = torch.where(invalid, torch.full_like(logprobs, float("nan")), logprobs)
    return tokens, logprobs
