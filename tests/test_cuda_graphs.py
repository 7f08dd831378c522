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
