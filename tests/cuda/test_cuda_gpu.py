"""GPU tests of backend="cuda" (the CUDA C++ kernels of csrc/cuda), skipped without CUDA.

RMSNorm: rows alone vs batched (the bik.testing harness) and bits equal to the CPU backend (the
kernel follows the CPU contract's order), accuracy vs fp64. Sampler: tokens and logprobs equal
to the CPU and Triton backends' bits with every filter; batch invariance with every filter;
verify_draft equal to the CPU's. A launch captured in a CUDA graph replays correctly. The AOT
fatbin path loads and gives the JIT's bits.
"""

from __future__ import annotations

import shutil

import bik
import checks
import pytest
import sampler_inputs
import torch
from bik import configs
from bik.runtime import cuda_jit
from bik.testing import probe_every_position, rows_alone_vs_batched, same_bits
from bik.testing.suites import rms_norm_suite

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.is_available() and not cuda_jit.available(),
                       reason=f"CUDA backend unavailable: {cuda_jit.unavailable_reason()}"),
]

MS = (1, 2, 3, 7, 8, 16, 31, 64, 127, 128, 255, 256, 1000)
HIDDENS = (1, 7, 111, 500, 4096, 8192)


@pytest.mark.parametrize("dtype", checks.DTYPES)
def test_rms_norm_invariance(dtype):
    checks.assert_invariant(rms_norm_suite(device="cuda", dtype=dtype, backend="cuda", ms=MS,
                                          hiddens=(111, 4096, 8192), probe_batch=130))


@pytest.mark.parametrize("dtype", checks.DTYPES)
@pytest.mark.parametrize("hidden", HIDDENS)
def test_rms_norm_bits_equal_cpu_backend(dtype, hidden):
    gen = torch.Generator().manual_seed(hidden)
    scale = torch.logspace(-3, 3, 37)[:, None]
    x = (torch.randn(37, hidden, generator=gen) * scale).to(dtype)
    r = torch.randn(37, hidden, generator=gen).to(dtype)
    w = torch.randn(hidden, generator=gen).to(dtype)
    got = bik.rms_norm(x.cuda(), w.cuda(), 1e-6, backend="cuda").cpu()
    assert same_bits(got, bik.rms_norm(x, w, 1e-6, backend="cpu"))
    out, h = bik.rms_norm(x.cuda(), w.cuda(), 1e-6, residual=r.cuda(), backend="cuda")
    ref_out, ref_h = bik.rms_norm(x, w, 1e-6, residual=r, backend="cpu")
    assert same_bits(h.cpu(), ref_h) and same_bits(out.cpu(), ref_out)


@pytest.mark.parametrize("dtype", checks.DTYPES)
def test_rms_norm_accuracy(dtype):
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(300, 4096, generator=gen).to("cuda", dtype)
    w = torch.randn(4096, generator=gen).to("cuda", dtype)
    x64 = x.double()
    ref = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    indep = torch.nn.functional.rms_norm(x.float(), (4096,), w.float(), 1e-6).to(dtype)

    def err(t):
        return (t.double() - ref).abs().max().item()

    bound = checks.ACCURACY_RATIO[dtype] * err(indep) + checks.ACCURACY_FLOOR * torch.finfo(
        dtype).eps * ref.abs().max().item()
    assert err(bik.rms_norm(x, w, 1e-6, backend="cuda")) <= bound


def test_rms_norm_strided_rows_and_empty():
    gen = torch.Generator().manual_seed(5)
    wide = torch.randn(50, 700, generator=gen).cuda()
    w = torch.randn(500, generator=gen).cuda()
    view = wide[:, 100:600]  # row stride 700, unit stride along H
    assert same_bits(bik.rms_norm(view, w, backend="cuda"),
                     bik.rms_norm(view.contiguous(), w, backend="cuda"))
    assert bik.rms_norm(torch.empty(0, 500, device="cuda"), w, backend="cuda").shape == (0, 500)


def _table(n, v, seed, **kw):
    table = sampler_inputs.requests(n, v, torch.Generator().manual_seed(seed), **kw)
    return {k: x.to("cuda") for k, x in table.items()}


def _sample(table, backend, rows=None):
    idx = slice(None) if rows is None else rows
    return bik.sample(table["logits"][idx], backend=backend,
                      **{k: table[k][idx] for k in sampler_inputs.PARAM_NAMES})


@pytest.mark.parametrize("near_ties", [False, True])
@pytest.mark.parametrize("v", [50, 1000, 40000, 128256])
@pytest.mark.parametrize("filters", ["no_top_p", "all"])
def test_sampler_bits_equal_cpu_and_triton(v, near_ties, filters):
    """fp32 logits, every filter mixed in (top-p too): the same tokens and logprob bits on all
    three backends (the normaliser is bik_exp in the contract's order, and bik_log)."""
    t = _table(300 if v < 10000 else 40, v, v, near_ties=near_ties, filters=filters)
    cuda_out = _sample(t, "cuda")
    cpu_out = _sample({k: x.cpu() for k, x in t.items()}, "cpu")
    triton_out = _sample(t, "triton")
    for out in (cuda_out, triton_out):
        assert torch.equal(out.tokens.cpu(), cpu_out.tokens)
        assert torch.equal(out.logprobs.cpu().view(torch.int32), cpu_out.logprobs.view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sampler_half_logits_equal_upcast(dtype):
    t = _table(200, 3000, 4, filters="no_top_p")
    t["logits"] = t["logits"].to(dtype)
    half = _sample(t, "cuda")
    t["logits"] = t["logits"].float()
    assert torch.equal(half.tokens, _sample(t, "cuda").tokens)
    assert torch.equal(half.tokens.cpu(), _sample({k: x.cpu() for k, x in t.items()},
                                                  "cpu").tokens)


def test_sampler_batch_invariance_every_filter():
    t = _table(1130, 2000, 9, filters="all")
    fn = sampler_inputs.sampler("cuda", t)

    def rows(idx):
        return fn(idx.to("cuda"))

    report = rows_alone_vs_batched(rows, torch.arange(1000)[:, None], MS)
    assert report.ok, report.summary()
    probe = probe_every_position(rows, torch.tensor([[1000]]),
                                             torch.arange(1001, 1130)[:, None])
    assert probe.ok, probe.summary()


def test_sampler_invalid_rows():
    x = torch.randn(6, 40, generator=torch.Generator().manual_seed(2))
    x[1, 7] = float("nan")
    x[2] = float("-inf")
    x[3, 0] = float("inf")
    x[4, :] = float("-inf")
    x[4, 11] = 2.0
    got = bik.sample(x.cuda(), seed=5, position=3, backend="cuda")
    ref = bik.sample(x, seed=5, position=3, backend="cpu")
    assert torch.equal(got.tokens.cpu(), ref.tokens)
    assert got.tokens[1:4].tolist() == [-1, -1, -1] and got.tokens[4] == 11


def test_verify_draft_equals_cpu():
    gen = torch.Generator().manual_seed(3)
    rows, k, v = 32, 4, 500
    logits = torch.randn(rows, k + 1, v, generator=gen) * 2
    drafts = torch.randint(0, v, (rows, k), generator=gen)
    params = {"seed": torch.randint(0, 2**62, (rows,), generator=gen),
              "position": torch.randint(0, 10**6, (rows,), generator=gen),
              "temperature": torch.tensor([0.0, 1.0, 0.6, 1.5])[torch.arange(rows) % 4],
              "top_k": torch.tensor([0, 5, 0, 20])[torch.arange(rows) % 4]}
    target = bik.verify_draft(drafts, k, logits, backend="cpu", **params)
    drafts[:, :2] = target.tokens[:, :2]  # some accepted drafts
    target = bik.verify_draft(drafts, k, logits, backend="cpu", **params)
    got = bik.verify_draft(drafts.cuda(), k, logits.cuda(), backend="cuda",
                           **{n: p.cuda() for n, p in params.items()})
    assert torch.equal(got.num_accepted.cpu(), target.num_accepted)
    assert torch.equal(got.tokens.cpu(), target.tokens)


def test_cuda_graph_capture_of_a_launch():
    """Launches run on torch's current stream: captured into a graph, replay reproduces them."""
    from bik.ops._define import DECLARED
    from bik.ops.rms_norm.cuda import launch_rms_norm

    gen = torch.Generator().manual_seed(8)
    x = torch.randn(64, 4096, generator=gen).cuda()
    w = torch.randn(4096, generator=gen).cuda()
    out = torch.empty_like(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        launch_rms_norm(DECLARED["rms_norm"].Args(x, w, 1e-6), out)  # warm-up: compile, load, stream object
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        launch_rms_norm(DECLARED["rms_norm"].Args(x, w, 1e-6), out)
    x.copy_(torch.randn(64, 4096, generator=gen).cuda())
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert same_bits(out, bik.rms_norm(x, w, 1e-6, backend="cuda"))


def test_backend_resolution():
    x = torch.randn(3, 8, device="cuda")
    assert bik.rms_norm(x, torch.ones(8, device="cuda"), backend="cuda").shape == (3, 8)
    with pytest.raises(bik.BackendUnavailableError, match="backend='cuda'"):
        bik.rms_norm(x.cpu(), torch.ones(8), backend="cuda")
    assert bik.fingerprint("cuda").backends["rms_norm"] == "triton"  # default unchanged


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_aot_fatbin_is_loaded_and_gives_the_jit_bits(tmp_path, monkeypatch):
    from bik.runtime import cuda_aot

    cuda_aot.build_fatbins(cuda_jit.source_dir(), tmp_path, defines=configs.CUDA_DEFINES)
    x = torch.randn(19, 777, device="cuda")
    w = torch.randn(777, device="cuda")
    jit = bik.rms_norm(x, w, backend="cuda")
    monkeypatch.setattr(cuda_jit, "_aot_dir", lambda: tmp_path)
    monkeypatch.setattr(cuda_jit, "_modules", {})
    monkeypatch.setattr(cuda_jit, "_kernels", {})
    cuda_jit._aot_manifest.cache_clear()
    try:
        assert cuda_jit._aot_covers(torch.cuda.get_device_capability())
        assert same_bits(bik.rms_norm(x, w, backend="cuda"), jit)
    finally:
        cuda_jit._aot_manifest.cache_clear()
