"""Launcher for the CPU Gumbel-max sampler (csrc/cpu/sampling.h in ``bik._cpu_kernels``).

The C++ code holds the whole per-row sequence (tempering, top-k, top-p, min-p, noise, pick,
logprob) written in sampling.h; rows are independent and threads split rows only, so a row's
token and logprob do not depend on the batch. Also exposes the noise's building blocks
(Philox4x32-10, bik_log, the Gumbel map) elementwise for tests and cross-backend checks.
"""

from __future__ import annotations

import torch

from bik.configs import sampler_chunks
from bik.ops._checks import require, require_cpu
from bik.ops.sampling.noise import STREAM_SAMPLE, greedy_limit
from bik.runtime import cpu_ext


def sample_cpu(logits: torch.Tensor, seed: torch.Tensor, position: torch.Tensor,
               temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
               log_min_p: torch.Tensor, *, stream: int = 0,
               num_threads: int | None = None, isa: str = "auto",
               min_p_raw: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens int64 [B], logprobs fp32 [B] for fp32 logits [B, V] (V >= 1) and per-row params:
    seed/position/top_k int64 [B], temperature/top_p/log_min_p fp32 [B] (contiguous).
    ``num_threads`` and ``isa`` change speed only: ``isa`` picks the vectors of the normaliser
    of greedy rows without filters ("scalar": sampling.h's scalar sequence for every row).
    ``min_p_raw``: ``log_min_p`` holds min_p itself, and the kernel takes noise.log_min_p of it
    (the same bik_log, the same bits), reading nothing back here."""
    ext = cpu_ext.require()
    fn = "bik.ops.sampling.cpu.sample_cpu"
    require_cpu(fn, logits=logits, seed=seed, position=position, temperature=temperature,
                top_k=top_k, top_p=top_p, log_min_p=log_min_p)
    require(logits.dim() == 2, fn, "logits must be 2-D")
    b, v = logits.shape
    require(logits.dtype == torch.float32 and v >= 1, fn, "logits must be fp32 [B, V >= 1]")
    if b > 0 and v > 1 and logits.stride(1) != 1:
        logits = logits.contiguous()
    tokens = torch.empty(b, dtype=torch.int64)
    logprobs = torch.empty(b, dtype=torch.float32)
    args = [seed, position, temperature, top_k, top_p, log_min_p]
    for t, dt in zip(args, (torch.int64, torch.int64, torch.float32, torch.int64,
                            torch.float32, torch.float32)):
        require(t.dtype == dt and t.shape == (b,) and t.is_contiguous(), fn,
                f"every row parameter must be a contiguous [{b}] tensor of its dtype")
    if b == 0:
        return tokens, logprobs
    groups, chunk = sampler_chunks(v)
    ext.sample_f32(logits.data_ptr(), logits.stride(0), b, v, groups, chunk,
                   *(t.data_ptr() for t in args),
                   int(stream), tokens.data_ptr(), logprobs.data_ptr(),
                   torch.get_num_threads() if num_threads is None else num_threads, isa,
                   min_p_raw)
    return tokens, logprobs


def _elementwise(fn: str, x: torch.Tensor, out: torch.Tensor, n: int) -> torch.Tensor:
    cpu_ext.require().sampling_elementwise(fn, x.data_ptr(), out.data_ptr(), n)
    return out


def philox4x32_10(counter: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Philox4x32-10 words [n, 4] (int64 holding uint32) for counters [n, 4] and keys [n, 2]
    given as integer tensors with values in [0, 2^32)."""
    words = torch.cat([counter, key], dim=1).to(torch.int64)
    u32 = words.to(torch.int32).contiguous()  # two's complement keeps the low 32 bits
    out = torch.empty(counter.shape[0], 4, dtype=torch.int32)
    _elementwise("philox", u32, out, counter.shape[0])
    return out.to(torch.int64) & 0xFFFFFFFF


def vocab_sum(terms: torch.Tensor) -> torch.Tensor:
    """fp32 [B]: the normaliser's sum of fp32 terms [B, V] per row, in the contract's order
    (``sampler_chunks(V)``; csrc/cpu/sampling.h vocab_sum)."""
    fn = "bik.ops.sampling.cpu.vocab_sum"
    require_cpu(fn, terms=terms)
    require(terms.dim() == 2 and terms.dtype == torch.float32 and terms.shape[1] >= 1, fn,
            "terms must be fp32 [B, V >= 1]")
    terms = terms.contiguous()
    b, v = terms.shape
    out = torch.empty(b, dtype=torch.float32)
    cpu_ext.require().vocab_sum_f32(terms.data_ptr(), b, v, *sampler_chunks(v), out.data_ptr())
    return out


def bik_exp(x: torch.Tensor) -> torch.Tensor:
    """bik_exp of fp32 values <= 0 (sampling.h), elementwise."""
    require_cpu("bik.ops.sampling.cpu.bik_exp", x=x)
    require(x.dtype == torch.float32, "bik.ops.sampling.cpu.bik_exp", "x must be fp32")
    x = x.contiguous()
    return _elementwise("exp", x, torch.empty_like(x), x.numel())


def bik_log(x: torch.Tensor) -> torch.Tensor:
    """bik_log of fp32 positive normal values (sampling.h), elementwise."""
    require_cpu("bik.ops.sampling.cpu.bik_log", x=x)
    require(x.dtype == torch.float32, "bik.ops.sampling.cpu.bik_log", "x must be fp32")
    x = x.contiguous()
    return _elementwise("log", x, torch.empty_like(x), x.numel())


def gumbel_from_unit(u: torch.Tensor) -> torch.Tensor:
    """-bik_log(-bik_log(u)) elementwise for fp32 u in (0, 1)."""
    require_cpu("bik.ops.sampling.cpu.gumbel_from_unit", u=u)
    require(u.dtype == torch.float32, "bik.ops.sampling.cpu.gumbel_from_unit", "u must be fp32")
    u = u.contiguous()
    return _elementwise("gumbel", u, torch.empty_like(u), u.numel())


def sample_rows(x, seed, position, temperature, top_k, top_p, min_p, max_top_k=None,
                any_top_p=None):
    """The op's entry point on this backend (see bik/ops/sampling/op.py)."""
    del max_top_k, any_top_p  # the kernel reads each row's filters itself: no host metadata
    # min_p's bik_log in the kernel: noise.log_min_p's ~80 µs of torch ops, and no read-back
    return sample_cpu(x.float(), seed, position, greedy_limit(temperature), top_k, top_p,
                      min_p.float().contiguous(), stream=STREAM_SAMPLE, min_p_raw=True)
