"""A decode step — write_kv_cache, attention, sample, verify_draft — captured in a CUDA graph
with host metadata, replayed on new data, gives the eager call's bits (GPU only; the device
check runs it). tests/test_host_metadata.py proves on the CPU that these calls read nothing
back; this proves capture accepts them and replay computes the same thing."""

from __future__ import annotations

import bik
import pytest
import torch

pytestmark = pytest.mark.gpu

B, BLOCK, PAGES, HQ, HKV, D, V, K = 4, 16, 4, 8, 2, 64, 1000, 3


def _static(gen):
    """The graph's static inputs on the GPU: a paged cache and one decode token per sequence."""
    dev = "cuda"
    kc, vc = (torch.randn(B * PAGES, BLOCK, HKV, D, generator=gen).to(dev) for _ in "kv")
    table = torch.arange(B * PAGES, dtype=torch.int32).reshape(B, PAGES).to(dev)
    lens = torch.tensor([5, 33, 64, 17], dtype=torch.int32, device=dev)
    return {
        "kc": kc, "vc": vc, "table": table, "lens": lens,
        "cu": torch.arange(B + 1, dtype=torch.int32, device=dev),
        "q": torch.empty(B, HQ, D, device=dev), "k": torch.empty(B, HKV, D, device=dev),
        "v": torch.empty(B, HKV, D, device=dev),
        "slots": (table[:, 0].long() * BLOCK + lens.long() - 1),
        "logits": torch.empty(B, V, device=dev), "window": torch.empty(B, K + 1, V, device=dev),
        "drafts": torch.zeros(B, K, dtype=torch.int64, device=dev),
        "seed": torch.arange(B, dtype=torch.int64, device=dev) + 7,
        "position": lens.long() - 1,
        "top_k": torch.tensor([0, 20, 50, 0], device=dev),
    }


def _step(s, backend):
    bik.write_kv_cache(s["kc"], s["vc"], s["k"], s["v"], s["slots"], validate=False)
    out = bik.attention(s["q"], s["kc"], s["vc"], cache_seqlens=s["lens"], cu_seqlens_q=s["cu"],
                        block_table=s["table"], max_seqlen_q=1, max_seqlen_k=PAGES * BLOCK,
                        backend=backend)
    params = {"seed": s["seed"], "position": s["position"], "temperature": 0.8,
              "top_k": s["top_k"], "max_top_k": 50, "backend": backend}
    drawn = bik.sample(s["logits"], **params)
    verified = bik.verify_draft(s["drafts"], torch.full_like(s["seed"], K), s["window"],
                                **params)
    return (out, *drawn, *verified)


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_captured_decode_step_replays_with_eager_bits(backend):
    gen = torch.Generator().manual_seed(0)
    s = _static(gen)
    base_k, base_v = s["kc"].clone(), s["vc"].clone()

    def new_inputs():
        for name in ("q", "k", "v", "logits", "window"):
            s[name].copy_(torch.randn(s[name].shape, generator=gen))
        s["drafts"].copy_(torch.randint(0, V, (B, K), generator=gen))
        s["kc"].copy_(base_k)
        s["vc"].copy_(base_v)

    new_inputs()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (JIT compiles, allocator) off the capture stream
        for _ in range(2):
            _step(s, backend)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _step(s, backend)
    for _ in range(3):
        new_inputs()
        graph.replay()
        replayed = [t.clone() for t in captured]
        cache_after = s["kc"].clone()
        s["kc"].copy_(base_k)  # the same inputs, run eagerly
        s["vc"].copy_(base_v)
        eager = _step(s, backend)
        torch.cuda.synchronize()
        assert torch.equal(cache_after, s["kc"])
        for got, want in zip(replayed, eager):
            assert torch.equal(got, want)


LONG_PAGES = 64  # 1024 keys a sequence: several KV splits in every backend's config


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_captured_split_attention_and_top_p_replay_with_other_lengths(backend, monkeypatch):
    """The ticketed paths in a graph: SPLIT attention (KV spread over programs, the last of a
    tile's programs folding the partials) over lengths that span several splits, and a
    sampler with top-p rows (its passes), captured once with a generous bound and replayed
    with other lengths and other top-p values than at capture: each replay gives the eager
    call's bits (the tickets are zeroed per call, so a replay starts from zero)."""
    from bik.ops.attention import cuda as cuda_attention
    from bik.ops.attention import triton as triton_attention

    for module in (triton_attention, cuda_attention):
        monkeypatch.setattr(module, "use_split_mode", lambda *args: True)
    gen, dev = torch.Generator().manual_seed(1), "cuda"
    kc, vc = (torch.randn(B * LONG_PAGES, BLOCK, HKV, D, generator=gen).to(dev) for _ in "kv")
    table = torch.arange(B * LONG_PAGES, dtype=torch.int32).reshape(B, LONG_PAGES).to(dev)
    s = {"lens": torch.tensor([300, 1000, 17, 640], dtype=torch.int32, device=dev),
         "q": torch.empty(B, HQ, D, device=dev), "logits": torch.empty(B, V, device=dev),
         "seed": torch.arange(B, dtype=torch.int64, device=dev) + 3,
         "position": torch.zeros(B, dtype=torch.int64, device=dev),
         "top_p": torch.tensor([1.0, 0.9, 0.5, 0.95], device=dev)}
    cu = torch.arange(B + 1, dtype=torch.int32, device=dev)

    def step():
        out = bik.attention(s["q"], kc, vc, cache_seqlens=s["lens"], cu_seqlens_q=cu,
                            block_table=table, max_seqlen_q=1,
                            max_seqlen_k=LONG_PAGES * BLOCK, backend=backend)
        drawn = bik.sample(s["logits"], seed=s["seed"], position=s["position"],
                           temperature=0.8, top_p=s["top_p"], max_top_k=0, backend=backend)
        return (out, *drawn)

    def new_inputs():
        s["q"].copy_(torch.randn(B, HQ, D, generator=gen))
        s["logits"].copy_(torch.randn(B, V, generator=gen) * 3)
        s["lens"].copy_(torch.randint(1, LONG_PAGES * BLOCK + 1, (B,), generator=gen))
        s["position"].copy_(s["lens"].long() - 1)
        s["top_p"].copy_(torch.rand(B, generator=gen) * 0.7 + 0.3)

    new_inputs()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for _ in range(3):
        new_inputs()
        graph.replay()
        replayed = [t.clone() for t in captured]
        eager = step()
        torch.cuda.synchronize()
        for got, want in zip(replayed, eager):
            assert torch.equal(got, want)
