"""SDPA with padding masks under the front ends (mode/_masks.py): each sequence's real queries
and keys are compacted into one bik::attention_varlen sequence, so a row's bits are those of its
sequence alone, whatever the padding in its own or other rows.

Shapes as HF builds them: left padding, causal prefill, a chunk after a cache (Lq < Lk), decode
(Lq = 1); boolean masks and additive ones (-inf or the dtype's lowest value), 2-D or 4-D,
broadcast over heads or not. Stock SDPA is measured to fail the same check; masks that are not
padding are counted fallbacks; rows that see no key keep stock's values.
"""

from __future__ import annotations

import contextlib
import warnings

import bik
import pytest
import torch
import torch.nn.functional as F
from bik.runtime import cpu_ext

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason=cpu_ext.unavailable_reason())

H, HKV, D = 4, 2, 16
LOWEST = torch.finfo(torch.float32).min


def _mode_inference():
    stack = contextlib.ExitStack()
    stack.enter_context(torch.inference_mode())  # the mode then sees aten SDPA itself
    stack.enter_context(bik.batch_invariant_mode())
    return stack


FRONTS = {"mode": bik.batch_invariant_mode, "enable": bik.enabled,
          "mode-inference": _mode_inference}


def _sequences(lens, extra, seed=0):
    """Per sequence: (q [1, H, n_q, D], k, v [1, HKV, n, D]) with n_q = n - extra[i] <= n (the
    last queries of a sequence whose first keys are a cache)."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, H, n - e, D, generator=gen), torch.randn(1, HKV, n, D, generator=gen),
             torch.randn(1, HKV, n, D, generator=gen)) for n, e in zip(lens, extra)]


def _left_padded(seqs, lk, lq, kind):
    """The batch HF would build: every sequence left-padded to lk keys and lq queries, and the
    mask of padding & bottom-right causality, as ``kind`` (bool, -inf or lowest)."""
    def pad(t, length):
        return torch.cat([torch.zeros(1, t.shape[1], length - t.shape[2], D), t], 2)

    q = torch.cat([pad(s[0], lq) for s in seqs])
    k = torch.cat([pad(s[1], lk) for s in seqs])
    v = torch.cat([pad(s[2], lk) for s in seqs])
    key = torch.arange(lk)
    rows = []
    for s in seqs:
        n = s[1].shape[2]
        query_pos = torch.arange(lq) + (lk - lq)  # key index each query row stands at
        rows.append((key[None] >= lk - n) & (key[None] <= query_pos[:, None]))
    mask = torch.stack(rows)[:, None]  # [B, 1, lq, lk]
    if kind != "bool":
        mask = torch.zeros(mask.shape).masked_fill(~mask, float("-inf") if kind == "-inf"
                                                   else LOWEST)
    return q, k, v, mask


def _alone(s):
    q, k, v = s
    with torch.no_grad(), bik.batch_invariant_mode():
        if q.shape[2] == k.shape[2]:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        # a chunk after a cache: bottom-right causal, as bik and the mask align it
        lq, lk = q.shape[2], k.shape[2]
        keep = torch.arange(lk)[None] <= torch.arange(lq)[:, None] + (lk - lq)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)


def _rows_equal_alone(front, seqs, lk, lq, kind):
    q, k, v, mask = _left_padded(seqs, lk, lq, kind)
    with torch.no_grad(), front():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return [torch.equal(out[i, :, lq - s[0].shape[2]:], _alone(s)[0]) for i, s in enumerate(seqs)]


CASES = {  # name: (lens, extra, lk, lq)
    "prefill": ((5, 9, 3), (0, 0, 0), 11, 11),
    "chunk": ((6, 9, 4), (3, 6, 1), 12, 3),  # 3 new tokens each after caches of 3, 6, 1
    "decode": ((7, 12, 2), (6, 11, 1), 13, 1),
}


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("kind", ["bool", "-inf", "lowest"])
@pytest.mark.parametrize("case", CASES)
def test_left_padded_rows_equal_their_sequence_alone(front, kind, case):
    lens, extra, lk, lq = CASES[case]
    seqs = _sequences(lens, extra)
    bik.reset_mode_stats()
    for more in (0, 3):  # more padding (of queries too in a prefill): the same bits
        more_q = more if case == "prefill" else 0
        assert _rows_equal_alone(FRONTS[front], seqs, lk + more, lq + more_q, kind) == [True] * 3
    assert bik.mode_stats().fallbacks == {}


def test_stock_sdpa_fails_the_same_check():
    """The negative control, measured: stock CPU SDPA's rows move with the padding."""
    failures = 0
    for lens, extra, lk, lq in CASES.values():
        seqs = _sequences(lens, extra)
        q, k, v, mask = _left_padded(seqs, lk, lq, "bool")
        with torch.no_grad():
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        failures += sum(not torch.equal(out[i, :, lq - s[0].shape[2]:], _alone(s)[0])
                        for i, s in enumerate(seqs))
    assert failures > 0


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("kind", ["bool", "-inf", "lowest"])
def test_rows_that_see_no_key_keep_stocks_values(kind, front):
    """Left padding's pad queries see no key: torch's values (zeros, or V's average under a
    finite mask), computed by the stock kernel on those rows alone."""
    seqs = _sequences((4, 8), (0, 0))
    q, k, v, mask = _left_padded(seqs, 8, 8, kind)
    with torch.no_grad():
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        with FRONTS[front]():
            got = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert torch.equal(got[0, :, :4], want[0, :, :4])
    torch.testing.assert_close(got, want)


def test_mask_broadcasts_2d_and_over_heads():
    seqs = _sequences((6,), (0,))
    q, k, v, mask = _left_padded(seqs, 9, 9, "bool")
    want = _alone(seqs[0])[0]
    with torch.no_grad(), bik.batch_invariant_mode():
        for m in (mask[0, 0], mask.expand(1, H, 9, 9).contiguous()):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
            assert torch.equal(out[0, :, 3:], want)


@pytest.mark.parametrize("mask_name, reason", [
    ("random", "one run of keys"),
    ("bias", "values other than 0"),
    ("per-head", "differs between heads"),
    ("sliding-window", "start at different keys"),
    ("causal-then-full", "neither causal nor full"),
    ("causal-and-bidirectional", "causal for some sequences and full for others"),
])
def test_other_masks_are_counted_fallbacks(mask_name, reason):
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, H, 6, D, generator=gen) for _ in range(3))
    if mask_name == "random":
        mask = torch.rand(2, 1, 6, 6, generator=gen) > 0.5
        mask[..., 0] = True
    elif mask_name == "bias":
        mask = torch.randn(2, 1, 6, 6, generator=gen)
    elif mask_name == "per-head":
        mask = torch.ones(2, H, 6, 6, dtype=torch.bool).tril()
        mask[:, 1, :, 0] = False
        mask[:, 1, 0, 0] = True
    elif mask_name == "causal-and-bidirectional":  # not right padding: every row is real
        mask = torch.stack([torch.ones(6, 6, dtype=torch.bool).tril(),
                            torch.ones(6, 6, dtype=torch.bool)])[:, None]
    elif mask_name == "sliding-window":  # each query sees its 3 latest keys
        mask = torch.ones(6, 6, dtype=torch.bool).tril().triu(-2)[None, None].repeat(2, 1, 1, 1)
    else:  # rows 2.. see keys 0..4: not a ramp, nor a ramp then a constant end
        mask = torch.ones(6, 6, dtype=torch.bool).tril()[None, None].repeat(2, 1, 1, 1)
        mask[:, :, 2:, :5] = True
    with torch.no_grad():
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    bik.reset_mode_stats()
    with torch.no_grad(), bik.batch_invariant_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore", bik.BatchInvarianceWarning)
        got = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.equal(got, want)  # the stock kernel ran
    assert any(reason in key for key in bik.mode_stats().fallbacks), bik.mode_stats()


def _split_by_length(q, k, v, mask):
    """A deliberately batch-dependent SDPA: keys summed in 3 chunks whose size follows the
    padded length, so padding moves the chunk boundaries (split-KV by load)."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool \
        else scores + mask
    p = (scores - scores.amax(-1, keepdim=True)).exp()
    size = -(-k.shape[2] // 3)
    chunks = [slice(c, c + size) for c in range(0, k.shape[2], size)]
    num = sum(p[..., c] @ v[:, :, c] for c in chunks)
    return num / sum(p[..., c].sum(-1, keepdim=True) for c in chunks)


def _right_padded(seqs, length, kind):
    """Causal prefill with right padding (scoring, training): each sequence's keys and queries
    first, then pads; pad queries see every real key of their sequence."""
    def pad(t):
        return torch.cat([t, torch.zeros(1, t.shape[1], length - t.shape[2], D)], 2)

    q, k, v = (torch.cat([pad(s[i]) for s in seqs]) for i in range(3))
    key, row = torch.arange(length)[None], torch.arange(length)[:, None]
    mask = torch.stack([(key < s[1].shape[2]) & (key <= row) for s in seqs])[:, None]
    if kind != "bool":
        mask = torch.zeros(mask.shape).masked_fill(~mask, float("-inf") if kind == "-inf"
                                                   else LOWEST)
    return q, k, v, mask


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("kind", ["bool", "-inf"])
def test_right_padded_rows_equal_their_sequence_alone(front, kind):
    """Real rows: their sequence's bits alone, whatever the padding (one sequence of length 1,
    whose mask alone would also read as a full one). Pad queries: stock's values (close).
    A deliberately batch-dependent reference fails the same check (stock SDPA did too on the
    machines this was written on; on some CPUs it is measured not to)."""
    seqs = _sequences((5, 9, 1), (0, 0, 0))
    reference_failures = 0
    bik.reset_mode_stats()
    for length in (11, 14):
        q, k, v, mask = _right_padded(seqs, length, kind)
        with torch.no_grad():
            want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            with FRONTS[front]():
                got = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        for i, s in enumerate(seqs):
            n = s[0].shape[2]
            assert torch.equal(got[i, :, :n], _alone(s)[0]), (length, i)
            causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
            alone = _split_by_length(*s, causal)
            reference_failures += not torch.equal(_split_by_length(q, k, v, mask)[i, :, :n],
                                                  alone[0])
        torch.testing.assert_close(got, want)
    assert bik.mode_stats().fallbacks == {}
    assert reference_failures > 0


def _packed(rows_of_seqs, kind):
    """Each batch row: its sequences packed one after another, zero-padded to the longest
    row, with transformers' block-diagonal causal mask (a packed row's pad queries see no
    key)."""
    width = max(sum(s[1].shape[2] for s in row) for row in rows_of_seqs)
    qs, ks, vs, masks = [], [], [], []
    for row in rows_of_seqs:
        lens = [s[1].shape[2] for s in row]
        pad = width - sum(lens)
        qs.append(torch.cat([s[0] for s in row] + [torch.zeros(1, H, pad, D)], 2))
        ks.append(torch.cat([s[1] for s in row] + [torch.zeros(1, HKV, pad, D)], 2))
        vs.append(torch.cat([s[2] for s in row] + [torch.zeros(1, HKV, pad, D)], 2))
        block = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)]
                          + [torch.full((pad,), -1)])
        keep = (block[:, None] == block[None, :]) & (block[:, None] >= 0)
        masks.append(keep & torch.ones(width, width, dtype=torch.bool).tril())
    mask = torch.stack(masks)[:, None]
    if kind != "bool":
        mask = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    return torch.cat(qs), torch.cat(ks), torch.cat(vs), mask


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("kind", ["bool", "-inf"])
def test_packed_rows_equal_their_sequence_alone(front, kind):
    """Several sequences packed into one batch row (a trainer's packed batch: a block-diagonal
    causal mask): each block is one varlen sequence with its own bits alone, whatever it is
    packed with. The deliberately batch-dependent reference fails the same check."""
    seqs = _sequences((5, 9, 1, 7, 3), (0, 0, 0, 0, 0))
    rows = [[seqs[0], seqs[1], seqs[2]], [seqs[3], seqs[4]]]
    q, k, v, mask = _packed(rows, kind)
    bik.reset_mode_stats()
    with torch.no_grad():
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        with FRONTS[front]():
            got = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    reference_failures = 0
    for b, row in enumerate(rows):
        at = 0
        for s in row:
            n = s[0].shape[2]
            assert torch.equal(got[b, :, at:at + n], _alone(s)[0]), (b, at)
            causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
            reference_failures += not torch.equal(
                _split_by_length(q, k, v, mask)[b, :, at:at + n], _split_by_length(*s, causal)[0])
            at += n
    torch.testing.assert_close(got, want, equal_nan=True)  # pad rows: stock's values
    assert bik.mode_stats().fallbacks == {}
    assert reference_failures > 0


def _grads_of(front, q, k, v, upstream, **sdpa):
    """(out, (dq, dk, dv)) of SDPA under ``front`` (None: stock) for the upstream gradient."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with (FRONTS[front] if front else contextlib.nullcontext)(), warnings.catch_warnings():
        warnings.simplefilter("ignore", bik.BatchInvarianceWarning)
        out = F.scaled_dot_product_attention(*leaves, enable_gqa=True, **sdpa)
        out.backward(upstream)
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("front", ["mode", "enable"])
@pytest.mark.parametrize("padding", ["left", "right"])
def test_a_padded_batchs_gradients_are_each_sequences_alone(front, padding):
    """While autograd records, a padded batch's forward and backward both run per sequence:
    every real row's output and every real query's, key's and value's gradient has the bits
    of its sequence alone (the upstream gradient of pad rows is zero, as a trainer's masked
    loss gives). The deliberately batch-dependent reference's gradients fail the same check
    (stock SDPA's pass it at these sizes on the machine this was written on)."""
    seqs = _sequences((4, 6, 9), (0, 0, 0))
    if padding == "left":
        q, k, v, mask = _left_padded(seqs, 9, 9, "bool")
    else:
        q, k, v, mask = _right_padded(seqs, 9, "bool")
    gen = torch.Generator().manual_seed(5)
    ups = [torch.randn(s[0].shape, generator=gen) for s in seqs]

    def real(t, i):  # sequence i's rows of a padded [B, H, L, ...] tensor
        n = seqs[i][1].shape[2]
        return t[i, :, -n:] if padding == "left" else t[i, :, :n]

    upstream = torch.zeros(q.shape)
    for i, u in enumerate(ups):
        real(upstream, i).copy_(u[0])
    bik.reset_mode_stats()
    out, grads = _grads_of(front, q, k, v, upstream, attn_mask=mask)
    stats = bik.mode_stats()
    backward = "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"
    assert any(key.startswith(backward) for key in stats.routed), stats.routed
    if front == "enable":  # (the mode also records the pad rows' own stock SDPA: its backward)
        assert not any("scaled_dot_product" in key for key in stats.fallbacks), stats.fallbacks
    _, stock_grads = _grads_of(None, q, k, v, upstream, attn_mask=mask)
    reference = _reference_grads(q, k, v, upstream, mask)
    reference_differs = 0
    for i, (seq, u) in enumerate(zip(seqs, ups)):
        alone_out, alone = _grads_of(front, *seq, u, is_causal=True)
        assert torch.equal(real(out, i), alone_out[0]), i
        for name, g, a in zip("qkv", grads, alone):
            assert torch.equal(real(g, i), a[0]), (i, name)
        n = seq[0].shape[2]
        causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
        reference_alone = _reference_grads(*seq, u, causal)
        reference_differs += any(not torch.equal(real(g, i), a[0])
                                 for g, a in zip(reference, reference_alone))
    for g, want in zip(grads, stock_grads):
        torch.testing.assert_close(g, want)
    assert reference_differs > 0


def _reference_grads(q, k, v, upstream, mask):
    """(dq, dk, dv) of the batch-dependent _split_by_length, its GQA heads folded back."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    _split_by_length(*leaves, mask).backward(upstream)
    return [t.grad for t in leaves]