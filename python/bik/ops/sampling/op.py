"""bik::sample and bik::verify_draft: a Gumbel-max sampler keyed by (seed, position, token id).

Contract (docs/design.md#sampler): a row's token depends only on its logits, its sampling
parameters, its seed and the absolute position of the token — never on its row, the batch, the
number of earlier calls or the drafter. Noise: Philox4x32-10 with counter (token id, position lo,
position hi, stream 0) and key (seed lo, seed hi), word 0 → u = (2·(bits >> 9) + 1)·2⁻²⁴ →
g = −bik_log(−bik_log(u)); the pick is argmax of z + g under (value desc, index asc). Greedy,
temperature, top-k and min-p tokens are identical on every backend; top-p and the logprobs are
exact within a backend.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from bik.ops._checks import check_float_dtype, check_same_device, check_tensor, register_no_backward
from bik.ops._registry import require_backend, resolve_backend

__all__ = ["SampleOutput", "VerifyOutput", "bik_log_torch", "sample", "verify_draft"]

torch.library.define(
    "bik::sample",
    "(Tensor logits, Tensor seed, Tensor position, Tensor temperature, Tensor top_k, "
    "Tensor top_p, Tensor min_p, str backend) -> (Tensor, Tensor)",
)
torch.library.define(
    "bik::verify_draft",
    "(Tensor draft_tokens, Tensor num_drafts, Tensor logits, Tensor seed, Tensor position, "
    "Tensor temperature, Tensor top_k, Tensor top_p, Tensor min_p, str backend) "
    "-> (Tensor, Tensor, Tensor)",
)

STREAM_SAMPLE = 0  # Philox counter word 3; other values are reserved for future draws
FLT_MIN = 1.1754943508222875e-38


class SampleOutput(NamedTuple):
    tokens: torch.Tensor  # int64 [B]; -1 for an invalid row
    logprobs: torch.Tensor  # fp32 [B]; NaN for an invalid row


class VerifyOutput(NamedTuple):
    num_accepted: torch.Tensor  # int64 [B]
    tokens: torch.Tensor  # int64 [B, K+1]; valid up to num_accepted (inclusive), then -1
    logprobs: torch.Tensor  # fp32 [B, K+1]; -inf past the emitted tokens (token -1)


_LOG_COEFFS = (-0.07866687327623367, 0.12821781635284424, -0.13101640343666077,
               0.14188995957374573, -0.1662759929895401, 0.2000196874141693,
               -0.2500077188014984, 0.33333322405815125, -0.4999999701976776)


def bik_log_torch(x: torch.Tensor) -> torch.Tensor:
    """bik_log (csrc/cpu/sampling.h) with torch's elementwise ops, bit for bit, on any device:
    for fp32 positive normal x. Each op is a separate rounded fp32 op (eager torch, no fusion)."""
    b = x.contiguous().view(torch.int32)
    e = (b >> 23) - 127
    mb = (b & 0x007FFFFF) | 0x3F800000
    big = mb > 0x3FB504F3
    mb = torch.where(big, mb - 0x00800000, mb)
    e = torch.where(big, e + 1, e)
    f = mb.view(torch.float32) - 1.0
    q = f * _LOG_COEFFS[0] + _LOG_COEFFS[1]
    for c in _LOG_COEFFS[2:]:
        q = q * f + c
    p = q * f + 1.0
    lg = f * p
    ef = e.to(torch.float32)
    return ef * 0.693145751953125 + (ef * 1.428606765330187e-06 + lg)


# ---- validation ------------------------------------------------------------------------------

def _row_tensor(op: str, name: str, t, rows: int, dtypes: tuple, device) -> None:
    check_tensor(op, name, t, 1)
    if t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{op}: {name} must have dtype {names}; got "
                        f"{str(t.dtype).removeprefix('torch.')}")
    if t.shape[0] != rows:
        raise ValueError(f"{op}: {name} {list(t.shape)} must have one entry per row ({rows})")
    if t.device != device:
        raise ValueError(f"{op}: {name} is on {t.device} but logits are on {device}")


def _check_params(op: str, rows: int, device, seed, position, temperature, top_k, top_p,
                  min_p, values: bool = True) -> None:
    _row_tensor(op, "seed", seed, rows, (torch.int64,), device)
    _row_tensor(op, "position", position, rows, (torch.int64,), device)
    _row_tensor(op, "temperature", temperature, rows, (torch.float32,), device)
    _row_tensor(op, "top_k", top_k, rows, (torch.int64,), device)
    _row_tensor(op, "top_p", top_p, rows, (torch.float32,), device)
    _row_tensor(op, "min_p", min_p, rows, (torch.float32,), device)
    if not values or rows == 0:
        return
    # One host sync: every value check at once.
    bad = torch.stack([
        (position < 0).any(),
        ~(temperature >= 0).all() | ~torch.isfinite(temperature).all(),
        ~((top_p > 0) & (top_p <= 1)).all(),
        ~((min_p >= 0) & (min_p <= 1)).all(),
    ]).tolist()
    what = ("position must be >= 0", "temperature must be finite and >= 0 (0 = greedy)",
            "top_p must be in (0, 1]", "min_p must be in [0, 1]")
    for flag, msg in zip(bad, what):
        if flag:
            raise ValueError(f"{op}: {msg}")


def _check_sample(op, logits, seed, position, temperature, top_k, top_p, min_p, values=True):
    check_tensor(op, "logits", logits, 2)
    check_float_dtype(op, "logits", logits)
    if logits.shape[1] == 0:
        raise ValueError(f"{op}: logits {list(logits.shape)} has an empty vocabulary (V = 0)")
    _check_params(op, logits.shape[0], logits.device, seed, position, temperature, top_k, top_p,
                  min_p, values)


# ---- the two backends ------------------------------------------------------------------------

def _log_min_p(min_p: torch.Tensor) -> torch.Tensor:
    """bik_log(min_p) (identical on every backend); -inf where min_p == 0 (off). min_p below the
    smallest normal fp32 is raised to it."""
    lg = bik_log_torch(min_p.clamp(min=FLT_MIN))
    return torch.where(min_p > 0, lg, torch.full_like(lg, float("-inf")))


def _topk_threshold(x: torch.Tensor, t_safe: torch.Tensor, greedy: torch.Tensor,
                    top_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(vk, ik) per row: the k-th token in the order (z desc, index asc); a token is kept iff
    z > vk or (z == vk and index <= ik). Exact operations only (IEEE division, sorting,
    counting), so the kept set is the CPU kernel's. Rows with top-k off keep everything."""
    rows, v = x.shape
    vk = torch.full((rows,), float("-inf"), dtype=torch.float32, device=x.device)
    ik = torch.full((rows,), v, dtype=torch.int32, device=x.device)
    on = (top_k > 0) & (top_k < v)
    sel = on.nonzero().flatten()
    if sel.numel() == 0:
        return vk, ik
    xs = x[sel].float()
    zs = torch.where(greedy[sel, None], xs, xs / t_safe[sel, None])
    ks = top_k[sel]
    kth = torch.topk(zs, int(ks.max()), dim=1, sorted=True).values.gather(1, (ks - 1)[:, None])
    ahead = ks - (zs > kth).sum(1)  # tokens of value kth to keep, lowest index first
    eq_count = (zs == kth).to(torch.int32).cumsum(1)
    vk[sel] = kth[:, 0]
    ik[sel] = (eq_count < ahead[:, None]).sum(1).to(torch.int32)
    return vk, ik


def _sample_rows(backend, logits, seed, position, temperature, top_k, top_p, min_p):
    x = logits
    if x.shape[0] > 0 and x.shape[1] > 1 and x.stride(1) != 1:
        x = x.contiguous()
    log_min_p = _log_min_p(min_p)
    if backend == "cpu":
        from bik.ops.sampling.cpu import sample_cpu

        return sample_cpu(x.float(), seed.contiguous(), position.contiguous(),
                          temperature.contiguous(), top_k.contiguous(), top_p.contiguous(),
                          log_min_p.contiguous(), stream=STREAM_SAMPLE)
    if backend == "cuda":  # the CUDA C++ kernels: same interface and outputs as Triton's
        from bik.ops.sampling.cuda import launch_sample
    else:
        from bik.ops.sampling.triton import launch_sample

    rows = x.shape[0]
    greedy = temperature == 0
    t_safe = torch.where(greedy, torch.ones_like(temperature), temperature)
    vk, ik = _topk_threshold(x, t_safe, greedy, top_k)
    key = torch.stack([seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, position & 0xFFFFFFFF,
                       (position >> 32) & 0xFFFFFFFF,
                       torch.full_like(seed, STREAM_SAMPLE)], dim=1).contiguous()
    # The kernels read the logits in their own dtype and upcast in registers (exact).
    m, log_s, bad, part_val, part_idx = launch_sample(
        x, key, temperature.contiguous(), vk, ik, top_p.contiguous(), log_min_p.contiguous())
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


register_no_backward("bik::sample", "bik.sample")
register_no_backward("bik::verify_draft", "bik.verify_draft")


@torch.library.impl("bik::sample", ("cpu", "cuda"))
def _sample_impl(logits, seed, position, temperature, top_k, top_p, min_p, backend):
    op = "bik.sample"
    _check_sample(op, logits, seed, position, temperature, top_k, top_p, min_p)
    require_backend(op, backend, logits.device)
    return _sample_rows(backend, logits, seed, position, temperature, top_k, top_p, min_p)


@torch.library.register_fake("bik::sample")
def _sample_fake(logits, seed, position, temperature, top_k, top_p, min_p, backend):
    _check_sample("bik.sample", logits, seed, position, temperature, top_k, top_p, min_p,
                  values=False)
    rows = logits.shape[0]
    return (logits.new_empty(rows, dtype=torch.int64),
            logits.new_empty(rows, dtype=torch.float32))


def _check_verify(op, draft_tokens, num_drafts, logits, params, values=True):
    check_tensor(op, "logits", logits, 3)
    check_float_dtype(op, "logits", logits)
    check_tensor(op, "draft_tokens", draft_tokens, 2)
    rows, window, vocab = logits.shape
    if vocab == 0:
        raise ValueError(f"{op}: logits {list(logits.shape)} has an empty vocabulary (V = 0)")
    if draft_tokens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{op}: draft_tokens must be int32 or int64, got {draft_tokens.dtype}")
    if window == 0 or tuple(draft_tokens.shape) != (rows, window - 1):
        raise ValueError(f"{op}: logits {list(logits.shape)} must be [B, K+1, V] for "
                         f"draft_tokens {list(draft_tokens.shape)} [B, K]")
    _row_tensor(op, "num_drafts", num_drafts, rows, (torch.int32, torch.int64), logits.device)
    check_same_device(op, logits=logits, draft_tokens=draft_tokens)
    _check_params(op, rows, logits.device, *params, values=values)
    if values and rows > 0 and not ((num_drafts >= 0) & (num_drafts <= window - 1)).all():
        raise ValueError(f"{op}: num_drafts must be in [0, K] = [0, {window - 1}]; got "
                         f"{num_drafts.tolist()}")


@torch.library.impl("bik::verify_draft", ("cpu", "cuda"))
def _verify_impl(draft_tokens, num_drafts, logits, seed, position, temperature, top_k, top_p,
                 min_p, backend):
    op = "bik.verify_draft"
    params = (seed, position, temperature, top_k, top_p, min_p)
    _check_verify(op, draft_tokens, num_drafts, logits, params)
    require_backend(op, backend, logits.device)
    rows, window, vocab = logits.shape
    k = window - 1
    # Target tokens at positions p .. p+K, each exactly as bik.sample would draw it alone.
    rep = [t.repeat_interleave(window) for t in params]
    rep[1] = rep[1] + torch.arange(window, device=logits.device).repeat(rows)
    tokens, logprobs = _sample_rows(backend, logits.reshape(rows * window, vocab), *rep)
    tokens, logprobs = tokens.reshape(rows, window), logprobs.reshape(rows, window)
    j = torch.arange(k, device=logits.device)
    match = (draft_tokens.to(torch.int64) == tokens[:, :k]) & (tokens[:, :k] >= 0) \
        & (j[None, :] < num_drafts.to(torch.int64)[:, None])
    num_accepted = match.to(torch.int64).cumprod(dim=1).sum(dim=1)
    emitted = torch.arange(window, device=logits.device)[None, :] <= num_accepted[:, None]
    tokens = torch.where(emitted, tokens, torch.full_like(tokens, -1))
    logprobs = torch.where(emitted, logprobs, torch.full_like(logprobs, float("-inf")))
    return num_accepted, tokens, logprobs


@torch.library.register_fake("bik::verify_draft")
def _verify_fake(draft_tokens, num_drafts, logits, seed, position, temperature, top_k, top_p,
                 min_p, backend):
    params = (seed, position, temperature, top_k, top_p, min_p)
    _check_verify("bik.verify_draft", draft_tokens, num_drafts, logits, params, values=False)
    rows, window = logits.shape[:2]
    return (logits.new_empty(rows, dtype=torch.int64),
            logits.new_empty(rows, window, dtype=torch.int64),
            logits.new_empty(rows, window, dtype=torch.float32))


# ---- public wrappers -------------------------------------------------------------------------

def _per_row(op: str, name: str, value, rows: int, device, dtype, default):
    """Broadcast a Python scalar (or None → default) to [rows]; tensors pass through as given
    (the op checks their shape and dtype), so a wrong tensor is an error, not a silent cast."""
    if value is None:
        value = default
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{op}: {name} must be a number or a [B] tensor, got "
                        f"{type(value).__name__}")
    if dtype == torch.int64 and not isinstance(value, int):
        raise TypeError(f"{op}: {name} must be an int, got {value!r}")
    return torch.full((rows,), value, dtype=dtype, device=device)


def _params(op, rows, device, seed, position, temperature, top_k, top_p, min_p):
    if seed is None or position is None:
        raise TypeError(f"{op}: seed and position are required (ints or int64 [B] tensors)")
    return (_per_row(op, "seed", seed, rows, device, torch.int64, None),
            _per_row(op, "position", position, rows, device, torch.int64, None),
            _per_row(op, "temperature", temperature, rows, device, torch.float32, 1.0),
            _per_row(op, "top_k", top_k, rows, device, torch.int64, 0),
            _per_row(op, "top_p", top_p, rows, device, torch.float32, 1.0),
            _per_row(op, "min_p", min_p, rows, device, torch.float32, 0.0))


def sample(logits: torch.Tensor, *, seed, position, temperature=None, top_k=None, top_p=None,
           min_p=None, backend: str | None = None) -> SampleOutput:
    """Draw one token per row by Gumbel-max, keyed by (seed, position, token id).

    Args:
        logits: [B, V] fp32/bf16/fp16 (computed in fp32), V >= 1.
        seed, position: int or int64 [B]; position is the absolute index of the token drawn.
        temperature: float or fp32 [B], >= 0 (0 = greedy argmax, lowest index on ties);
            default 1.
        top_k: int or int64 [B] (<= 0 or >= V: off). top_p: (0, 1] (1: off). min_p: [0, 1]
            (0: off). Applied per row in the order top-k, top-p, min-p.
        backend: "triton", "cpu", "cuda" (CUDA C++) or None (by device).

    Returns:
        SampleOutput(tokens int64 [B], logprobs fp32 [B]): the log-probability of each token
        under the tempered, filtered distribution (temperature 1 when greedy). A row whose
        tempered logits hold a NaN or +inf, or that has no finite logit left, gives token -1
        and logprob NaN. A row's token depends only on its own logits, parameters, seed and
        position; greedy, temperature, top-k and min-p tokens are the same on every backend.
    """
    op = "bik.sample"
    check_tensor(op, "logits", logits, 2)
    backend = resolve_backend(op, backend, logits.device)
    params = _params(op, logits.shape[0], logits.device, seed, position, temperature, top_k,
                     top_p, min_p)
    return SampleOutput(*torch.ops.bik.sample(logits, *params, backend))


def verify_draft(draft_tokens: torch.Tensor, num_drafts, logits: torch.Tensor, *, seed,
                 position, temperature=None, top_k=None, top_p=None, min_p=None,
                 backend: str | None = None) -> VerifyOutput:
    """Verify drafted tokens by Gumbel coupling (accept iff the draft equals the target's draw).

    Args:
        draft_tokens: [B, K] int; the first num_drafts[b] of row b are real.
        num_drafts: int or int [B] in [0, K].
        logits: [B, K+1, V], the target's logits for positions position[b] ... position[b] + K.
        seed, position, temperature, top_k, top_p, min_p, backend: as :func:`sample`, per row.

    Returns:
        VerifyOutput(num_accepted int64 [B], tokens int64 [B, K+1], logprobs fp32 [B, K+1]):
        tokens[b, :num_accepted+1] are the accepted drafts followed by the target's own token
        (at the first mismatch, or the bonus token), exactly what :func:`sample` gives one
        position at a time with the same seed, whatever the drafter proposed; after them,
        token -1 with logprob -inf.
    """
    op = "bik.verify_draft"
    check_tensor(op, "logits", logits, 3)
    check_tensor(op, "draft_tokens", draft_tokens, 2)
    backend = resolve_backend(op, backend, logits.device)
    rows = logits.shape[0]
    if not isinstance(num_drafts, torch.Tensor):
        num_drafts = _per_row(op, "num_drafts", num_drafts, rows, logits.device, torch.int64,
                              None)
    params = _params(op, rows, logits.device, seed, position, temperature, top_k, top_p, min_p)
    return VerifyOutput(*torch.ops.bik.verify_draft(draft_tokens, num_drafts, logits, *params,
                                                    backend))
