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
    from bik.dvr.model import embedded_tp_config
    from bik.dvr.tp import TensorParallelLlama, supported_degrees
    from bik.dvr.workload import make_workload, run_workload

    cfg = embedded_tp_config()
    assert supported_degrees(cfg) == [1, 2, 4]  # 4 KV heads: no replication
    if world > 1:  # the demo model (2 KV heads of 16: o_proj K = 64) cannot be sharded
        from bik.dvr import embedded_model

        _raises_everywhere(r"cannot shard this model over \d ranks: .*o_proj .*K = 64 .*"
                           r"\(supported: \[1\]\)",
                           lambda: TensorParallelLlama(embedded_model()))
    full = random_model(cfg, seed=0)
    tp = TensorParallelLlama(full)
    assert tp.config.num_key_value_heads == 4 // world
    bik_k = BikKernels()
    # One packed step: a 9-token prefill and a 1-token decode of another sequence.
    logits = {}
    for kernels in (bik_k, FastKernels()):
        for name, model in (("full", full), ("tp", tp)):
            cache = KVCache.allocate(model.config, 8, 8, torch.float32, "cpu")
            step = build_step([9, 1], [9, 5], [[0, 1], [2]], 8, "cpu")
            toks = torch.tensor([5, 9, 11, 3, 7, 1, 2, 4, 8, 6])
            pos = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 4])
            logits[kernels.name, name] = model.forward(toks, pos, step, cache, kernels)
    assert torch.equal(logits["bik", "tp"], logits["bik", "full"]), (rank, world)
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
