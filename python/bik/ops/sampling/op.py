"""bik::sample and bik::verify_draft: a Gumbel-max sampler keyed by (seed, position, token id).

Contract (docs/design.md#sampler): a row's token depends only on its logits, its sampling
parameters, its seed and the absolute position of the token — never on its row, the batch, the
number of earlier calls or the drafter. Noise: Philox4x32-10 with counter (token id, position lo,
position hi, stream 0) and key (seed lo, seed hi), word 0 → u = (2·(bits >> 9) + 1)·2⁻²⁴ →
g = −bik_log(−bik_log(u)); the pick is argmax of z + g under (value desc, index asc). The
normaliser (top-p, logprobs) is bik_exp summed in the order of bik.configs.sampler_chunks, and
bik_log: tokens and logprobs are identical on every backend, with every filter.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from bik._dtypes import dtype_name
from bik.ops._checks import check_float_dtype, check_same_device, check_tensor, debug_checks
from bik.ops._call import call
from bik.ops._define import define
from bik.ops._registry import documented, resolve_backend
from bik.ops.sampling.noise import seed_int64

# Every backend module (triton.py, cuda.py, cpu.py) defines the row's entry point
#   sample_rows(x [B, V], seed, position, temperature, top_k, top_p, min_p, max_top_k,
#               any_top_p) -> (tokens int64 [B], logprobs fp32 [B])
# for validated, contiguous per-row parameters as the caller gave them (each backend applies
# noise.greedy_limit and noise.log_min_p: the Triton kernels inside, as they load); x has unit
# stride along V and any supported dtype. Host metadata: max_top_k, the caller's bound on the
# rows' top_k, or None (given, the backend reads nothing back from the device); any_top_p,
# False when no row has top_p < 1 (a backend may then skip the top-p search), or None.


class SampleOutput(NamedTuple):
    tokens: torch.Tensor  # int64 [B]; -1 for an invalid row
    logprobs: torch.Tensor  # fp32 [B]; NaN for an invalid row


class VerifyOutput(NamedTuple):
    num_accepted: torch.Tensor  # int64 [B]
    tokens: torch.Tensor  # int64 [B, K+1]; valid up to num_accepted (inclusive), then -1
    logprobs: torch.Tensor  # fp32 [B, K+1]; -inf past the emitted tokens (token -1)


# ---- validation ------------------------------------------------------------------------------

def _row_tensor(op: str, name: str, t, rows: int, dtypes: tuple, device) -> None:
    check_tensor(op, name, t, 1)
    if t.dtype not in dtypes:
        names = ", ".join(dtype_name(d) for d in dtypes)
        raise TypeError(f"{op}: {name} must have dtype {names}; got "
                        f"{dtype_name(t.dtype)}")
    if t.shape[0] != rows:
        raise ValueError(f"{op}: {name} {list(t.shape)} must have one entry per row ({rows})")
    if t.device != device:
        raise ValueError(f"{op}: {name} is on {t.device} but logits are on {device}")


def check_row_params(op: str, rows: int, vocab: int, device, seed, position, temperature, top_k,
                  top_p, min_p, values: bool = True, max_top_k: int | None = None,
                  any_top_p: bool | None = None) -> None:
    """Check the per-row parameters of ``rows`` rows of a ``vocab``-token vocabulary (their
    dtypes, shapes and devices; with ``values``, their values, in one host sync); ValueError or
    TypeError naming ``op`` and the parameter."""
    _row_tensor(op, "seed", seed, rows, (torch.int64,), device)
    _row_tensor(op, "position", position, rows, (torch.int64,), device)
    _row_tensor(op, "temperature", temperature, rows, (torch.float32,), device)
    _row_tensor(op, "top_k", top_k, rows, (torch.int64,), device)
    _row_tensor(op, "top_p", top_p, rows, (torch.float32,), device)
    _row_tensor(op, "min_p", min_p, rows, (torch.float32,), device)
    if max_top_k is not None and (isinstance(max_top_k, bool) or max_top_k < 0):
        raise ValueError(f"{op}: max_top_k must be an int >= 0 (0: no row uses top-k), got "
                         f"{max_top_k!r}")
    if any_top_p is not None and not isinstance(any_top_p, bool):
        raise TypeError(f"{op}: any_top_p must be a bool or None, got {any_top_p!r}")
    if not values or rows == 0:
        return
    # One host sync: every value check at once.
    active_k = torch.where((top_k > 0) & (top_k < vocab), top_k, 0)  # others: top-k off
    bad = torch.stack([
        (position < 0).any(),
        ~(temperature >= 0).all() | ~torch.isfinite(temperature).all(),
        ~((top_p > 0) & (top_p <= 1)).all(),
        ~((min_p >= 0) & (min_p <= 1)).all(),
        (active_k > (max_top_k if max_top_k is not None else active_k)).any(),
        (top_p < 1).any() & (any_top_p is False),
    ]).tolist()
    what = ("position must be >= 0", "temperature must be finite and >= 0 (0 = greedy)",
            "top_p must be in (0, 1]", "min_p must be in [0, 1]",
            (f"a row's top_k exceeds the host metadata max_top_k={max_top_k} "
             f"(BIK_DEBUG_CHECKS found it)"),
            ("a row has top_p < 1 but the host metadata says any_top_p=False "
             "(BIK_DEBUG_CHECKS found it)"))
    for flag, msg in zip(bad, what):
        if flag:
            raise ValueError(f"{op}: {msg}")


def _row_params(args) -> tuple:
    """The per-row parameters of a sample or verify_draft record, in their schema order."""
    return args.seed, args.position, args.temperature, args.top_k, args.top_p, args.min_p


def _check_sample(op, args, values: bool):
    logits = args.logits
    check_tensor(op, "logits", logits, 2)
    check_float_dtype(op, "logits", logits)
    if logits.shape[1] == 0:
        raise ValueError(f"{op}: logits {list(logits.shape)} has an empty vocabulary (V = 0)")
    check_row_params(op, logits.shape[0], logits.shape[1], logits.device, *_row_params(args),
                     values, args.max_top_k, args.any_top_p)
    return args


def _checks_values(max_top_k) -> bool:
    """Whether a call checks its parameter values (one host sync): unless the caller passed
    host metadata (max_top_k; any_top_p alone reads nothing either way) and vouches for them,
    or BIK_DEBUG_CHECKS asks anyway."""
    return max_top_k is None or debug_checks()


# ---- the impls: each backend (triton, cpu, cuda) through the (op, backend) table ----------

def _draw(sample_rows, logits, params, max_top_k, any_top_p):
    """Rows of ``logits`` drawn with their ``params`` (seed, position, ... in schema order)."""
    x = logits
    if x.shape[0] > 0 and x.shape[1] > 1 and x.stride(1) != 1:
        x = x.contiguous()
    return sample_rows(x, *(t.contiguous() for t in params), max_top_k, any_top_p)


def _sample_rows(sample_rows, args):
    return _draw(sample_rows, args.logits, _row_params(args), args.max_top_k, args.any_top_p)


def _check_sample_call(op, args):
    return _check_sample(op, args, _checks_values(args.max_top_k))


def _shapes_sample(op, args):
    return _check_sample(op, args, values=False)


def _fake_sample(args):
    rows = args.logits.shape[0]
    return (args.logits.new_empty(rows, dtype=torch.int64),
            args.logits.new_empty(rows, dtype=torch.float32))


define("sample",
       "(Tensor logits, Tensor seed, Tensor position, Tensor temperature, Tensor top_k, "
       "Tensor top_p, Tensor min_p, str backend, int? max_top_k=None, bool? any_top_p=None) "
       "-> (Tensor, Tensor)",
       check=_check_sample_call, fake_check=_shapes_sample, run=_sample_rows,
       fake=_fake_sample)


def check_verify(op, draft_tokens, num_drafts, logits, params, values=True, max_top_k=None,
                 vocab: int | None = None, any_top_p: bool | None = None):
    """verify_draft's argument checks (``vocab``: the whole vocabulary when ``logits`` holds a
    shard of it; default its last dimension)."""
    check_tensor(op, "logits", logits, 3)
    check_float_dtype(op, "logits", logits)
    check_tensor(op, "draft_tokens", draft_tokens, 2)
    rows, window, width = logits.shape
    vocab = width if vocab is None else vocab
    if vocab == 0:
        raise ValueError(f"{op}: logits {list(logits.shape)} has an empty vocabulary (V = 0)")
    if draft_tokens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{op}: draft_tokens must be int32 or int64, got {draft_tokens.dtype}")
    if window == 0 or tuple(draft_tokens.shape) != (rows, window - 1):
        raise ValueError(f"{op}: logits {list(logits.shape)} must be [B, K+1, V] for "
                         f"draft_tokens {list(draft_tokens.shape)} [B, K]")
    _row_tensor(op, "num_drafts", num_drafts, rows, (torch.int32, torch.int64), logits.device)
    check_same_device(op, logits=logits, draft_tokens=draft_tokens)
    check_row_params(op, rows, vocab, logits.device, *params, values=values, max_top_k=max_top_k,
                     any_top_p=any_top_p)
    if values and rows > 0 and not ((num_drafts >= 0) & (num_drafts <= window - 1)).all():
        raise ValueError(f"{op}: num_drafts must be in [0, K] = [0, {window - 1}]; got "
                         f"{num_drafts.tolist()}")


def _check_verify_call(op, args):
    check_verify(op, args.draft_tokens, args.num_drafts, args.logits, _row_params(args),
                 _checks_values(args.max_top_k), args.max_top_k, any_top_p=args.any_top_p)
    return args


def _shapes_verify(op, args):
    check_verify(op, args.draft_tokens, args.num_drafts, args.logits, _row_params(args),
                 values=False)
    return args


def _run_verify(sample_rows, args):
    logits = args.logits
    rows, window, vocab = logits.shape
    tokens, logprobs = _draw(sample_rows, logits.reshape(rows * window, vocab),
                             window_rows(_row_params(args), window), args.max_top_k,
                             args.any_top_p)
    return accept_drafts(args.draft_tokens, args.num_drafts, tokens.reshape(rows, window),
                         logprobs.reshape(rows, window))


def window_rows(params, window: int) -> list[torch.Tensor]:
    """Per-row parameters (seed, position, ...) of B rows repeated for the B x window rows of
    their verify windows, the positions counting up p .. p + window - 1: each window row is
    drawn exactly as bik.sample would draw that position alone."""
    rows = params[0].shape[0]
    rep = [t.repeat_interleave(window) for t in params]
    rep[1] = rep[1] + torch.arange(window, device=rep[1].device).repeat(rows)
    return rep


def accept_drafts(draft_tokens, num_drafts, tokens, logprobs):
    """(num_accepted, tokens, logprobs) of verify_draft from the target's draws tokens /
    logprobs [B, K+1]: drafts are accepted while they equal the target's tokens (Gumbel
    coupling), then the target's own token is emitted; -1 / -inf past it."""
    k = tokens.shape[1] - 1
    j = torch.arange(k, device=tokens.device)
    match = (draft_tokens.to(torch.int64) == tokens[:, :k]) & (tokens[:, :k] >= 0) \
        & (j[None, :] < num_drafts.to(torch.int64)[:, None])
    num_accepted = match.to(torch.int64).cumprod(dim=1).sum(dim=1)
    emitted = torch.arange(k + 1, device=tokens.device)[None, :] <= num_accepted[:, None]
    tokens = torch.where(emitted, tokens, torch.full_like(tokens, -1))
    logprobs = torch.where(emitted, logprobs, torch.full_like(logprobs, float("-inf")))
    return num_accepted, tokens, logprobs


def _fake_verify(args):
    logits = args.logits
    rows, window = logits.shape[:2]
    return (logits.new_empty(rows, dtype=torch.int64),
            logits.new_empty(rows, window, dtype=torch.int64),
            logits.new_empty(rows, window, dtype=torch.float32))


define("verify_draft",
       "(Tensor draft_tokens, Tensor num_drafts, Tensor logits, Tensor seed, Tensor position, "
       "Tensor temperature, Tensor top_k, Tensor top_p, Tensor min_p, str backend, "
       "int? max_top_k=None, bool? any_top_p=None) -> (Tensor, Tensor, Tensor)",
       check=_check_verify_call, fake_check=_shapes_verify, run=_run_verify, fake=_fake_verify)


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
    if dtype == torch.int64:
        value = _int64(op, name, value)
    return torch.full((rows,), value, dtype=dtype, device=device)


def _int64(op: str, name: str, value: int) -> int:
    """A Python int as the int64 the kernels read; a seed is 64 bits (:func:`seed_int64`)."""
    if name == "seed":
        return seed_int64(value, op)
    if not -(2**63) <= value < 2**63:
        raise ValueError(f"{op}: {name} must fit in int64, got {value}")
    return value


def row_params(op, rows, device, seed, position, temperature, top_k, top_p, min_p):
    """The six per-row tensors (seed, position, temperature, top_k, top_p, min_p) of ``rows``
    rows from ints / floats / tensors as :func:`sample` takes them (defaults for None)."""
    if seed is None or position is None:
        raise TypeError(f"{op}: seed and position are required (ints or int64 [B] tensors)")
    return (_per_row(op, "seed", seed, rows, device, torch.int64, None),
            _per_row(op, "position", position, rows, device, torch.int64, None),
            _per_row(op, "temperature", temperature, rows, device, torch.float32, 1.0),
            _per_row(op, "top_k", top_k, rows, device, torch.int64, 0),
            _per_row(op, "top_p", top_p, rows, device, torch.float32, 1.0),
            _per_row(op, "min_p", min_p, rows, device, torch.float32, 0.0))


@documented("sample")
def sample(logits: torch.Tensor, *, seed, position, temperature=None, top_k=None, top_p=None,
           min_p=None, max_top_k: int | None = None, any_top_p: bool | None = None,
           backend: str | None = None) -> SampleOutput:
    """Draw one token per row by Gumbel-max, keyed by (seed, position, token id).

    Args:
        logits: [B, V] fp32/bf16/fp16 (computed in fp32), V >= 1.
        seed, position: int or int64 [B]; position is the absolute index of the token drawn.
        temperature: float or fp32 [B], >= 0 (0 = greedy argmax, lowest index on ties);
            below 1e-5 (``bik.configs.SAMPLER_GREEDY_BELOW``) the row is greedy too, the
            limit as T -> 0+; default 1.
        top_k: int or int64 [B] (<= 0 or >= V: off). top_p: (0, 1] (1: off). min_p: [0, 1]
            (0: off). Applied per row in the order top-k, top-p, min-p.
        max_top_k: host metadata, an int >= every row's top_k that is on (0: no row uses
            top-k). Given, the op reads nothing back from the device (CUDA-graph safe) and
            trusts the parameters: their value checks (one host sync otherwise) are skipped
            unless BIK_DEBUG_CHECKS=1. A larger bound never changes a token.
        any_top_p: host metadata, False when no row has top_p < 1: the GPU backends then
            launch no top-p pass (4 launches for a temperature-only call on Triton). Not
            checked unless the values are (a wrong False is caught by BIK_DEBUG_CHECKS=1);
            None (default) or True never changes a token.
        backend: {backends}

    Returns:
        SampleOutput(tokens int64 [B], logprobs fp32 [B]): the log-probability of each token
        under the tempered, filtered distribution (temperature 1 when greedy). A row whose
        tempered logits hold a NaN or +inf, or that has no finite logit left, gives token -1
        and logprob NaN. A row's token depends only on its own logits, parameters, seed and
        position; tokens and logprobs are the same bits on every backend.
    """
    op = "bik.sample"
    check_tensor(op, "logits", logits, 2)
    backend = resolve_backend("sample", backend, logits.device)
    params = row_params(op, logits.shape[0], logits.device, seed, position, temperature, top_k,
                     top_p, min_p)
    return SampleOutput(*call("sample", logits, *params, backend, max_top_k, any_top_p))


@documented("verify_draft")
def verify_draft(draft_tokens: torch.Tensor, num_drafts, logits: torch.Tensor, *, seed,
                 position, temperature=None, top_k=None, top_p=None, min_p=None,
                 max_top_k: int | None = None, any_top_p: bool | None = None,
                 backend: str | None = None) -> VerifyOutput:
    """Verify drafted tokens by Gumbel coupling (accept iff the draft equals the target's draw).

    Args:
        draft_tokens: [B, K] int; the first num_drafts[b] of row b are real.
        num_drafts: int or int [B] in [0, K].
        logits: [B, K+1, V], the target's logits for positions position[b] ... position[b] + K.
        seed, position, temperature, top_k, top_p, min_p, max_top_k, any_top_p: as
            :func:`sample`, per row (with max_top_k, num_drafts is not checked either).
        backend: {backends}

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
    backend = resolve_backend("verify_draft", backend, logits.device)
    rows = logits.shape[0]
    if not isinstance(num_drafts, torch.Tensor):
        num_drafts = _per_row(op, "num_drafts", num_drafts, rows, logits.device, torch.int64,
                              None)
    params = row_params(op, rows, logits.device, seed, position, temperature, top_k, top_p, min_p)
    return VerifyOutput(*call("verify_draft", draft_tokens, num_drafts, logits, *params,
                              backend, max_top_k, any_top_p))
