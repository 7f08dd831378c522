"""Backward of bik.attention_varlen: test bodies shared by the CPU and interpreter tests.

A packed call is described by a list of ``Seq`` (one sequence's q/k/v and the upstream gradients
of its out and lse); ``pack_grads`` runs forward + backward on any list of them and returns each
sequence's (dq, dk, dv). ``alone_vs_packed`` puts one sequence alone and then at every position
among neighbours of other lengths and compares its gradient bits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import bik
import torch
from bik.testing import InvarianceReport, same_bits
from bik.testing.controls import splits_for_rows


class Seq(NamedTuple):
    q: torch.Tensor  # [t, Hq, D]
    k: torch.Tensor  # [L, Hkv, D]
    v: torch.Tensor  # [L, Hkv, D]
    grad_out: torch.Tensor  # [t, Hq, D]
    grad_lse: torch.Tensor  # [t, Hq] fp32


def make_seq(gen, t: int, length: int, hq: int = 4, hkv: int = 2, d: int = 16,
             dtype=torch.float32) -> Seq:
    def r(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen).to(dt)

    return Seq(r(t, hq, d), r(length, hkv, d), r(length, hkv, d), r(t, hq, d),
               r(t, hq, dt=torch.float32))


def _cu(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(list(lengths)).cumsum(0).tolist()], dtype=torch.int32)


PackGrads = Callable[[Sequence[Seq]], list]


def pack_grads(backend: str, causal: bool = True, scale: float | None = None) -> PackGrads:
    """fn(seqs) -> [(dq, dk, dv) per sequence] of bik.attention_varlen on the packed call."""

    def fn(seqs):
        leaves = [torch.cat([getattr(s, n) for s in seqs]).requires_grad_() for n in "qkv"]
        device = leaves[0].device
        out, lse = bik.attention_varlen(
            *leaves, cu_seqlens_q=_cu(s.q.shape[0] for s in seqs).to(device),
            cu_seqlens_k=_cu(s.k.shape[0] for s in seqs).to(device), scale=scale,
            causal=causal, backend=backend)
        torch.autograd.backward((out, lse), (torch.cat([s.grad_out for s in seqs]),
                                             torch.cat([s.grad_lse for s in seqs])))
        return _split(seqs, *(t.grad for t in leaves))

    return fn


def _split(seqs, dq, dk, dv):
    res, q0, k0 = [], 0, 0
    for s in seqs:
        t, length = s.q.shape[0], s.k.shape[0]
        res.append((dq[q0:q0 + t], dk[k0:k0 + length], dv[k0:k0 + length]))
        q0, k0 = q0 + t, k0 + length
    return res


def alone_vs_packed(fn: PackGrads, seq: Seq, neighbours: Sequence[Seq],
                    name: str) -> InvarianceReport:
    """seq's (dq, dk, dv) alone vs at every position among ``neighbours``, bit for bit."""
    alone = fn([seq])[0]
    mismatches = []
    for j in range(len(neighbours) + 1):
        got = fn([*neighbours[:j], seq, *neighbours[j:]])[j]
        if not all(same_bits(g, a) for g, a in zip(got, alone)):
            mismatches.append((len(neighbours) + 1, j))
    return InvarianceReport(name, len(neighbours) + 1, tuple(mismatches))


def plain_attention(seq_q, k, v, causal: bool, scale: float):
    """softmax(scale q k^T) v and logsumexp for one sequence in the inputs' dtype (autograd)."""
    t, hq, _ = seq_q.shape
    length, hkv = k.shape[0], k.shape[1]
    kk, vv = (x.repeat_interleave(hq // hkv, 1).transpose(0, 1) for x in (k, v))
    s = (seq_q.transpose(0, 1) @ kk.transpose(1, 2)) * scale  # [Hq, t, L]
    if causal:
        pos = torch.arange(length)
        s = s.masked_fill(pos[None, None, :] > pos[length - t:][None, :, None], float("-inf"))
    return (s.softmax(-1) @ vv).transpose(0, 1), torch.logsumexp(s, -1).T


def plain_grads(seqs: Sequence[Seq], dtype, causal: bool = True) -> list:
    """(dq, dk, dv) per sequence by stock autograd through ``plain_attention`` in ``dtype``."""
    res = []
    for s in seqs:
        q, k, v = (x.to(dtype).requires_grad_() for x in s[:3])
        out, lse = plain_attention(q, k, v, causal, 1.0 / math.sqrt(q.shape[-1]))
        torch.autograd.backward((out, lse.to(dtype)), (s.grad_out.to(dtype),
                                                       s.grad_lse.to(dtype)))
        res.append((q.grad, k.grad, v.grad))
    return res


def split_by_pack_grads(seqs: Sequence[Seq]) -> list:
    """A deliberately batch-dependent backward (NOT invariant): bik's formulas in fp32 torch
    ops, but dK and dV sum over a sequence's query rows in a number of chunks chosen by how
    many sequences share the call (in the style of a split-K heuristic)."""
    splits = splits_for_rows(len(seqs))
    res = []
    for s in seqs:
        q, k, v = (x.float().detach().requires_grad_(False) for x in s[:3])
        scale = 1.0 / math.sqrt(q.shape[-1])
        g = q.shape[1] // k.shape[1]
        kk, vv = (x.repeat_interleave(g, 1).transpose(0, 1) for x in (k, v))
        out, lse = plain_attention(q, k, v, True, scale)
        p = torch.exp((q.transpose(0, 1) @ kk.transpose(1, 2)) * scale - lse.T[..., None])
        length, t = k.shape[0], q.shape[0]
        pos = torch.arange(length)
        p = p.masked_fill(pos[None, None, :] > pos[length - t:][None, :, None], 0.0)
        do = s.grad_out.float().transpose(0, 1)
        dp = do @ vv.transpose(1, 2)
        di = (do * out.transpose(0, 1)).sum(-1, keepdim=True)
        ds = p * (dp - di + s.grad_lse.T[..., None]) * scale

        def chunked(a, b):  # a^T b over dim 1 (query rows), in `splits` partial sums
            parts = [x.transpose(1, 2) @ y for x, y in zip(a.tensor_split(splits, 1),
                                                             b.tensor_split(splits, 1))]
            return sum(parts[1:], parts[0])

        dk = chunked(ds, q.transpose(0, 1)).reshape(k.shape[1], g, length, -1).sum(1)
        dv = chunked(p, do).reshape(k.shape[1], g, length, -1).sum(1)
        res.append(((ds @ kk).transpose(0, 1), dk.transpose(0, 1), dv.transpose(0, 1)))
    return res


def neighbours(gen, shapes, **kw) -> list[Seq]:
    return [make_seq(gen, t, length, **kw) for t, length in shapes]


# Sequence shapes (q_len, k_len): the probe crosses several bik attention splits in the
# interpreter (32 keys) and its neighbours have other lengths, decode and prefill alike.
PROBE = (19, 45)
NEIGHBOURS = ((1, 7), (45, 45), (3, 70), (0, 5))
