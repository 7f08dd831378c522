"""Scenarios run on every rank of a gloo world by tp_world.run_world (one process per rank).

Data comes from one seeded generator, so every rank builds the same full tensors and takes its
own shard; the single-device result (bik.linear on the full tensors) is computed on every rank
and compared with torch.equal.
"""

from __future__ import annotations

import contextlib
import re

import bik
import torch
import torch.distributed as dist
import torch.nn.functional as F
from bik.distributed import column_parallel_linear, row_parallel_linear

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (leading dims of x, N, K): K = 8 groups of 64, 192 and 512 (none a multiple of the CPU
# kernel's K block), odd N, 1-row and 3-D inputs.
ROW_SHAPES = (((7,), 48, 512), ((1,), 77, 1536), ((2, 3), 40, 4096))


def _full(dtype, lead, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    return x, w, b


def _k_shard(t, rank, world):
    k = t.shape[-1] // world
    return t[..., rank * k:(rank + 1) * k]


@contextlib.contextmanager
def split_lookups():
    """The (N, K) of every K-split lookup the CPU matmul launcher makes inside the block."""
    from bik.ops.matmul import cpu as cpu_matmul

    seen = []
    original = cpu_matmul.matmul_split

    def recording(dtype, n, k):
        seen.append((n, k))
        return original(dtype, n, k)

    cpu_matmul.matmul_split = recording
    try:
        yield seen
    finally:
        cpu_matmul.matmul_split = original


def row_parallel_equals_one_device(rank, world):
    """Every dtype, shape, with and without bias; the kernel tables are the whole layer's."""
    with split_lookups() as seen:
        for dtype in DTYPES:
            for i, (lead, n, k) in enumerate(ROW_SHAPES):
                x, w, b = _full(dtype, lead, n, k, seed=i)
                for bias in (None, b):
                    seen.clear()
                    got = row_parallel_linear(_k_shard(x, rank, world), _k_shard(w, rank, world),
                                              bias)
                    assert seen and set(seen) == {(n, k)}, (seen, n, k)  # never the shard's K
                    want = bik.linear(x, w, bias)
                    assert got.dtype == want.dtype and got.shape == want.shape
                    assert torch.equal(got, want), (rank, world, dtype, lead, n, k, bias is None)


def column_parallel_equals_one_device(rank, world):
    with split_lookups() as seen:
        for dtype in DTYPES:
            for i, (lead, k) in enumerate((((5,), 3000), ((2, 2), 576), ((1,), 4096))):
                n = 96
                x, w, b = _full(dtype, lead, n, k, seed=10 + i)
                rows = slice(rank * n // world, (rank + 1) * n // world)
                want = bik.linear(x, w, b)
                seen.clear()
                mine = column_parallel_linear(x, w[rows], b[rows])
                assert set(seen) == {(n, k)}, seen  # the layer's N, not the shard's
                assert torch.equal(mine, want[..., rows]), (rank, dtype, lead, k)
                whole = column_parallel_linear(x, w[rows], b[rows], gather_output=True)
                assert torch.equal(whole, want), (rank, dtype, lead, k)


def _raises_everywhere(pattern, fn):
    try:
        fn()
    except ValueError as exc:
        assert re.search(pattern, str(exc)), str(exc)
    else:
        raise AssertionError(f"no ValueError matching {pattern!r}")


def invalid_sharding_raises_on_every_rank(rank, world):
    """Each case raises on every rank after the metadata all_gather (so no rank is left in a
    collective), and the group stays usable: a valid call afterwards still works."""
    x, w, b = _full(torch.float32, (3,), 16, 576, seed=20)  # K = 576: one group
    _raises_everywhere(r"K = 576 cannot be cut over \d ranks",
                       lambda: row_parallel_linear(_k_shard(x, rank, world),
                                                   _k_shard(w, rank, world)))
    x, w, b = _full(torch.float32, (3,), 16, 4096, seed=21)
    xs, ws = _k_shard(x, rank, world), _k_shard(w, rank, world)
    bad_k = xs[..., :-64] if rank == world - 1 else xs  # one rank's shard is short
    _raises_everywhere(r"ranks disagree on x: rank 0: \(\(3, \d+\)",
                       lambda: row_parallel_linear(bad_k, ws if rank != world - 1
                                                   else ws[:, :-64]))
    bad_dtype = xs.bfloat16() if rank == 0 else xs
    _raises_everywhere(r"ranks disagree on x", lambda: row_parallel_linear(bad_dtype, ws))
    _raises_everywhere(r"ranks disagree on bias",
                       lambda: row_parallel_linear(xs, ws, b if rank == 0 else None))
    _raises_everywhere(r"x \[3, \d+\] and weight \[16, 1\] disagree",
                       lambda: row_parallel_linear(xs, ws[:, :1]))
    _raises_everywhere(r"forward only",
                       lambda: row_parallel_linear(xs.requires_grad_(), ws))
    assert torch.equal(row_parallel_linear(xs.detach(), ws), bik.linear(x, w))


def stock_row_parallel_differs_from_one_device(rank, world):
    """Negative control, measured: F.linear on each shard + all_reduce(SUM) (the usual row
    parallel layer) does not give F.linear's single-device bits, while bik's does."""
    differs = 0
    for i, (lead, n, k) in enumerate(ROW_SHAPES):
        x, w, b = _full(torch.float32, lead, n, k, seed=30 + i)
        part = F.linear(_k_shard(x, rank, world), _k_shard(w, rank, world))
        dist.all_reduce(part)
        stock = part + b
        differs += not torch.equal(stock, F.linear(x, w, b))
        assert torch.equal(row_parallel_linear(_k_shard(x, rank, world),
                                               _k_shard(w, rank, world), b), bik.linear(x, w, b))
    assert differs > 0, "stock row parallel matched one device on every shape here"


# ---- the sharded DVR model -------------------------------------------------------------------

def sharded_dvr_model_equals_one_device(rank, world):
    """Logits of a prefill and decode steps, solo-decoded tokens and logprobs, and the DVR
    engine's deterministic outputs at TP = world equal the unsharded model's, on every rank."""
    from bik.dvr.model import embedded_tp_config
    from bik.dvr.tp import TensorParallelLlama, supported_degrees

    cfg = embedded_tp_config()
    assert supported_degrees(cfg) == [1, 2, 4, 8]  # 4 KV heads: replicated at TP = 8
    if world > 1:  # the demo model (2 KV heads of 16: o_proj K = 64) cannot be sharded
        from bik.dvr import embedded_model

        _raises_everywhere(r"cannot shard this model over \d ranks: .*o_proj .*K = 64 .*"
                           r"\(supported: \[1\]\)",
                           lambda: TensorParallelLlama(embedded_model()))
    _sharded_model_equals_one_device(cfg, rank, world)


def replicated_kv_heads_equal_one_device(rank, world):
    """TP above the KV heads: 8 q / 2 KV heads (each KV head on TP / 2 ranks, the per-rank GQA
    ratio TP / 2 times smaller) and 8 q / 1 KV head: the unsharded model's bits."""
    import dataclasses

    from bik.dvr.model import embedded_tp_config

    for kv_heads in (2, 1):
        cfg = dataclasses.replace(embedded_tp_config(), num_key_value_heads=kv_heads)
        _sharded_model_equals_one_device(cfg, rank, world)


def _sharded_model_equals_one_device(cfg, rank, world):
    from bik.dvr import (
        BikKernels,
        DVREngine,
        EngineConfig,
        FastKernels,
        KVCache,
        Request,
        SamplingParams,
        build_step,
        random_model,
        reference_decode,
    )
    from bik.dvr.tp import TensorParallelLlama
    from bik.dvr.workload import make_workload, run_workload

    full = random_model(cfg, seed=0)
    tp = TensorParallelLlama(full)
    hkv = cfg.num_key_value_heads
    assert tp.config.num_key_value_heads == max(hkv // world, 1)
    vocab_cols = slice(rank * cfg.vocab_size // world, (rank + 1) * cfg.vocab_size // world)
    bik_k = BikKernels()
    # One packed step: a 9-token prefill and a 1-token decode of another sequence. A rank's
    # logits are its vocabulary shard.
    logits, lookups = {}, {}
    for kernels in (bik_k, FastKernels()):
        for name, model in (("full", full), ("tp", tp)):
            cache = KVCache.allocate(model.config, 8, 8, torch.float32, "cpu")
            step = build_step([9, 1], [9, 5], [[0, 1], [2]], 8, "cpu")
            toks = torch.tensor([5, 9, 11, 3, 7, 1, 2, 4, 8, 6])
            pos = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 4])
            with split_lookups() as seen:
                out = model.forward(toks, pos, step, cache, kernels)
            logits[kernels.name, name] = out if name == "tp" else out[:, vocab_cols]
            lookups[kernels.name, name] = set(seen)
    assert torch.equal(logits["bik", "tp"], logits["bik", "full"]), (rank, world)
    # Every kernel table a rank looks up is the whole layer's (replicated KV rows included).
    assert lookups["bik", "tp"] == lookups["bik", "full"], lookups
    if world > 1:  # negative control, measured: the stock sharded layers change the logits
        assert not torch.equal(logits["fast", "tp"], logits["fast", "full"]), (rank, world)
    req = Request("solo", (3, 17, 29, 4), 8, SamplingParams(0.8, seed=5))
    solo_full, solo_tp = reference_decode(full, req, bik_k), reference_decode(tp, req, bik_k)
    assert (solo_tp.tokens, solo_tp.logprobs) == (solo_full.tokens, solo_full.logprobs)
    arrivals = make_workload(vocab_size=cfg.vocab_size, num_requests=4, seed=1,
                             det_fraction=0.75, prompt_len=(1, 12), max_new_tokens=(4, 10),
                             temperature=0.8, arrival_spread=3)
    outs = {}
    for name, model in (("full", full), ("tp", tp)):
        engine = DVREngine(model, EngineConfig(window=3, group=2, block_size=8, num_blocks=64),
                           fast_kernels=FastKernels(), verify_kernels=bik_k)
        outs[name] = run_workload(engine, arrivals)
    for a in arrivals:
        if a.request.deterministic:
            got, want = outs["tp"][a.request.request_id], outs["full"][a.request.request_id]
            assert (got.tokens, got.logprobs) == (want.tokens, want.logprobs), a.request


# ---- vocab-parallel sampling -----------------------------------------------------------------

def _v_shard(t, rank, world):
    v = t.shape[-1] // world
    return t[..., rank * v:(rank + 1) * v]


def _bits_equal(a, b) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def _sampling_rows(vocab, seed):
    """Logits [12, vocab] and per-row parameters covering every path: tempered, greedy, the
    greedy limit, min-p, top-k, top-p, NaN / +inf / all -inf rows, a row whose finite logits lie
    on one rank only, and exact ties across the shard boundaries (the lowest id must win)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(12, vocab, generator=g) * 3
    x[1, vocab // 3] = float("nan")
    x[2, vocab - 1] = float("inf")
    x[3] = float("-inf")
    x[4, : vocab - vocab // 8] = float("-inf")  # finite only in the last group
    x[5, :] = 0.25  # every token tied: greedy takes id 0, sampling is pure noise
    top = x[6].max() + 1
    x[6, vocab // 2 - 1] = x[6, vocab - 2] = x[6, 1] = top  # ties in several shards
    x[7, vocab // 2] = x[7, vocab // 2 - 1] = top  # tie across the middle boundary
    temperature = torch.tensor([1.0, 1.0, 0.7, 1.0, 0.8, 1.0, 0.0, 0.0, 1e-7, 0.5, 1.3, 0.9])
    min_p = torch.tensor([0.0] * 9 + [0.2, 0.0, 0.05])
    top_k = torch.tensor([0] * 10 + [5, 0])
    top_p = torch.tensor([1.0] * 11 + [0.6])
    params = {"seed": torch.arange(12) * 7919 + seed, "position": torch.arange(12) * 31 + 2**33,
              "temperature": temperature, "min_p": min_p, "top_k": top_k, "top_p": top_p}
    return x, params


def vocab_parallel_sample_equals_one_device(rank, world):
    """Tokens and logprob bits equal bik.sample on the whole rows, every dtype and path; the
    verify window too. Negative controls, measured: noise keyed by the shard's own index and
    a normaliser folded per rank first give other tokens / logprob bits."""
    from bik.distributed import vocab_parallel_sample, vocab_parallel_verify_draft
    from bik.ops._normaliser import bik_exp_torch, group_totals_torch

    for vocab, dtype in ((64, torch.float32), (24_000, torch.float32), (24_000, torch.bfloat16),
                         (8 * 1536, torch.float16)):
        x, params = _sampling_rows(vocab, seed=vocab)
        x = x.to(dtype)
        want = bik.sample(x, **params)
        got = vocab_parallel_sample(_v_shard(x, rank, world), **params)
        assert torch.equal(got.tokens, want.tokens), (rank, vocab, dtype, got.tokens, want.tokens)
        assert _bits_equal(got.logprobs, want.logprobs), (rank, vocab, dtype)
    assert want.tokens[3] == -1 and want.tokens[6] == 1 and want.tokens[7] == vocab // 2 - 1
    # verify_draft: windows of 3 positions, drafts partly right.
    x, params = _sampling_rows(8 * 512, seed=3)
    windows = x[:8].reshape(4, 2, -1)
    rows = {k: v[:4] for k, v in params.items()}
    solo = bik.verify_draft(torch.zeros(4, 1, dtype=torch.int64), 0, windows, **rows)
    drafts = solo.tokens[:, :1].clamp(min=0)
    drafts[0] += 1  # a wrong draft
    want = bik.verify_draft(drafts, 1, windows, **rows)
    got = vocab_parallel_verify_draft(drafts, 1, _v_shard(windows, rank, world), **rows)
    for a, b in zip(got[:2], want[:2]):
        assert torch.equal(a, b), (rank, got, want)
    assert _bits_equal(got.logprobs, want.logprobs)
    if world == 1:
        return
    # Negative control 1: noise keyed by the shard's local index (what a sampler unaware of its
    # shard offset does) draws other tokens.
    x, params = _sampling_rows(24_000, seed=11)
    local = bik.sample(_v_shard(x, rank, world), **params)
    best = torch.stack([local.tokens, torch.full_like(local.tokens, rank)], 1)
    every = [torch.empty_like(best) for _ in range(world)]
    dist.all_gather(every, best)
    want = bik.sample(x, **params)
    assert any(int(e[0, 0]) + int(e[0, 1]) * (24_000 // world) != int(want.tokens[0])
               for e in every), "local-id noise matched one device"
    # Negative control 2: the normaliser folded per rank first (each rank's groups, then the
    # ranks) instead of group by group gives other logprob bits on some row.
    z = x.float() / params["temperature"].clamp(min=1e-5)[:, None]
    m = torch.where(torch.isnan(z), float("-inf"), z).amax(1)
    terms = torch.where(torch.isfinite(z), bik_exp_torch(z - m[:, None]), 0.0)
    totals = group_totals_torch(_v_shard(terms, rank, world), 24_000 // 8, 1024)
    per_rank = torch.zeros(totals.shape[0])
    for g in range(totals.shape[1]):
        per_rank = per_rank + totals[:, g]
    right = group_totals_torch(terms, 24_000 // 8, 1024)
    one_device = torch.zeros(right.shape[0])
    for g in range(right.shape[1]):
        one_device = one_device + right[:, g]
    dist.all_reduce(per_rank)
    ok = torch.isfinite(one_device)
    assert not torch.equal(per_rank[ok], one_device[ok]), "per-rank folding matched one device"


def vocab_parallel_sample_refuses_on_every_rank(rank, world):
    from bik.distributed import vocab_parallel_sample

    x, params = _sampling_rows(8 * 64, seed=5)
    shard = _v_shard(x, rank, world)
    _raises_everywhere(r"vocabulary of 100 tokens cannot be split over \d ranks: .* 1 group",
                       lambda: vocab_parallel_sample(torch.zeros(2, 100 // world), seed=1,
                                                     position=0))
    _raises_everywhere(r"ranks disagree on params",
                       lambda: vocab_parallel_sample(shard, **{**params, "seed": params["seed"]
                                                               + rank}))
    _raises_everywhere(r"ranks disagree on logits",
                       lambda: vocab_parallel_sample(shard[:, :32] if rank else shard, **params))
    # A parameter error on one rank only is raised on every rank (no rank left waiting).
    _raises_everywhere(r"ranks disagree on problem: rank 0: None, rank 1: ValueError: .*top_p must be in",
                       lambda: vocab_parallel_sample(shard, **{**params, "top_p": 1.5 if rank
                                                               else params["top_p"]}))
    _raises_everywhere(r"top_p must be in",
                       lambda: vocab_parallel_sample(shard, **{**params, "top_p": 1.5}))
    assert torch.equal(vocab_parallel_sample(shard, **params).tokens,
                       bik.sample(x, **params).tokens)


# ---- the runner's own control (tests/distributed/test_tp_linear.py) -------------------------

def _moe_inputs(dtype, seed, experts=16, top_k=4, tokens=13, hidden=64, inter=32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    probs = torch.softmax(torch.randn(tokens, experts, generator=g), -1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    ids[0] = torch.arange(top_k)  # token 0's experts all on rank 0's shard
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).to(dtype)
    return x, ids, weights.to(dtype), w13, w2


def _expert_shard(t, rank, world):
    per = t.shape[0] // world
    return t[rank * per:(rank + 1) * per]


def expert_parallel_equals_one_device(rank, world):
    """Experts sharded over the ranks give bik.moe.experts on one device, fp32 and bf16, with
    every token's experts on one rank (token 0) or spread; then a batch whose pairs all land on
    rank 0's experts (the other ranks' blocks empty)."""
    import bik.moe
    from bik.distributed import expert_parallel_experts

    with bik.enabled(), torch.no_grad():
        for dtype, seed in ((torch.float32, 1), (torch.bfloat16, 2)):
            x, ids, weights, w13, w2 = _moe_inputs(dtype, seed)
            want = bik.moe.experts(x, ids, weights, w13, w2)
            got = expert_parallel_experts(x, ids, weights, _expert_shard(w13, rank, world),
                                          _expert_shard(w2, rank, world), experts=16)
            assert _bits_equal(got, want), (dtype, rank)
        ids = ids % (16 // world)  # every pair on rank 0's experts
        got = expert_parallel_experts(x, ids, weights, _expert_shard(w13, rank, world),
                                      _expert_shard(w2, rank, world), experts=16)
        assert _bits_equal(got, bik.moe.experts(x, ids, weights, w13, w2))


def stock_expert_parallel_differs_from_one_device(rank, world):
    """The usual combine (each rank's experts weighted and summed per token, the partials
    all-reduced) measured against one device: some token's bits differ (fp32, 4 of 16 experts
    a token)."""
    import bik.moe

    with bik.enabled(), torch.no_grad():
        x, ids, weights, w13, w2 = _moe_inputs(torch.float32, 3)
        want = bik.moe.experts(x, ids, weights, w13, w2)
        per = 16 // world
        partial = torch.zeros_like(x)
        for slot in range(ids.shape[1]):
            for t in range(x.shape[0]):
                e = int(ids[t, slot])
                if e // per == rank:
                    rows = bik.moe.expert_rows(x[t:t + 1], torch.tensor(
                        [0] * e + [1] * (16 - e), dtype=torch.int32), w13, w2)
                    partial[t] += rows[0] * weights[t, slot]
        dist.all_reduce(partial)
    assert not _bits_equal(partial, want)


def expert_parallel_refuses_on_every_rank(rank, world):
    from bik.distributed import expert_parallel_experts

    x, ids, weights, w13, w2 = _moe_inputs(torch.float32, 4)
    _raises_everywhere(r"expert_parallel_experts: 15 experts do not split",
                       lambda: expert_parallel_experts(x, ids, weights, w13[:7], w2[:7],
                                                       experts=15))
    mine = _expert_shard(w13, rank, world)[: 1 if rank else None]  # rank 1 holds one expert
    _raises_everywhere(r"expert_parallel_experts: .*w13",
                       lambda: expert_parallel_experts(x, ids, weights, mine,
                                                       _expert_shard(w2, rank, world),
                                                       experts=16))


def control_passes(rank, world):
    dist.barrier()


def control_fails_on_the_last_rank(rank, world):
    assert rank != world - 1, f"rank {rank} of {world} fails on purpose"


def control_never_reached(rank, world):
    raise AssertionError("ran after a failed scenario")
