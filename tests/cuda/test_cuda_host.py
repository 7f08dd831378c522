"""The CUDA kernels' element math, compiled for the host (g++), against bik's CPU path, bit for bit.

csrc/cuda/*.cuh put the index and per-element math in __host__ __device__ helpers, so a machine
without a GPU runs the very code the kernels inline: Philox, u, bik_log and the Gumbel noise
(against csrc/cpu/sampling.h, in another translation unit so nothing is folded), the storage
conversions (against torch's), and RMSNorm's lane/fold order (against the CPU backend's rows).
A build with FMA contraction is the negative control: it must disagree.
"""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import bik
import pytest
import torch
from bik.runtime import cpu_ext, cuda_jit
from bik.testing import same_bits
from cuda_host_build import CPU_SRC, cached_build

HERE = Path(__file__).resolve().parent / "cuda_host"
GXX = shutil.which("g++") or shutil.which("c++")

pytestmark = pytest.mark.skipif(GXX is None, reason="no host C++ compiler")


def _commands(out: Path, cuda_flags) -> list[list[str]]:
    """host_check.cpp (the CPU path) always without contraction; host_cuda.cpp (the CUDA
    helpers) with ``cuda_flags``; linked into ``out``."""
    common = [GXX, "-O2", "-std=c++17", "-Wall", "-Wextra", "-Werror", "-Wno-unused-function",
              "-fPIC", "-I", str(CPU_SRC), "-I", str(cuda_jit.source_dir())]
    cmds, objs = [], []
    for src, flags in (("host_check.cpp", ["-ffp-contract=off"]), ("host_cuda.cpp", cuda_flags)):
        obj = out.with_name(f"{out.stem}_{src}.o")
        cmds.append([*common, *flags, "-c", str(HERE / src), "-o", str(obj)])
        objs.append(str(obj))
    return [*cmds, [GXX, "-shared", *objs, "-o", str(out)]]


def _build(name: str, *cuda_flags: str) -> ctypes.CDLL:
    """The library of :func:`_commands` (g++, or the disk cache of an identical build)."""
    lib = ctypes.CDLL(str(cached_build(name, GXX, lambda out: _commands(out, cuda_flags))))
    lib.bik_host_noise_mismatches.restype = ctypes.c_int64
    lib.bik_host_noise_mismatches.argtypes = [ctypes.c_int64, ctypes.c_uint64]
    lib.bik_host_unit_mismatches.restype = ctypes.c_int64
    lib.bik_host_philox_word0.restype = ctypes.c_uint32
    lib.bik_host_philox_word0.argtypes = [ctypes.c_uint32] * 6
    lib.bik_host_rms_norm.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                      ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                      ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p]
    lib.bik_cuda_emulate_sample.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                            ctypes.c_int64, *[ctypes.c_void_p] * 6,
                                            ctypes.c_int64, ctypes.c_int64,
                                            *[ctypes.c_void_p] * 3]
    lib.bik_cuda_top_p_cut.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                       ctypes.c_int64, ctypes.c_float, ctypes.c_int,
                                       ctypes.c_void_p, ctypes.c_void_p]
    lib.bik_cuda_exp.restype = ctypes.c_float
    lib.bik_cuda_exp.argtypes = [ctypes.c_float]
    lib.bik_cuda_vocab_sum.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                       ctypes.c_int64, ctypes.c_void_p]
    for name in ("bik_host_f32_to_bf16", "bik_host_f32_to_f16", "bik_host_f16_to_f32"):
        getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    return lib


@pytest.fixture(scope="module")
def host():
    return _build("host.so", "-ffp-contract=off")


def test_noise_matches_cpu_path(host):
    assert host.bik_host_noise_mismatches(1_000_000, 20261130) == 0


def test_every_unit_value_matches_cpu_path(host):
    """All 2^23 u (and their Gumbel values) and bik_log over ~28M fp32 inputs."""
    assert host.bik_host_unit_mismatches() == 0


def test_fma_contraction_is_detected():
    """Negative control: the same helpers built with contraction (a*b+c -> fma) disagree with
    the CPU path, so the comparisons above can fail, and the no-FMA policy is needed."""
    info = Path("/proc/cpuinfo")
    if " fma " not in (info.read_text() if info.exists() else ""):
        pytest.skip("the host CPU has no FMA")
    lib = _build("fma.so", "-ffp-contract=fast", "-mfma")
    assert lib.bik_host_unit_mismatches() > 0


@pytest.mark.parametrize(("counter", "key", "word0"), [
    ((0, 0, 0, 0), (0, 0), 0x6627E8D5),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, 0x408F276D),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0), 0xD16CFE09),
])
def test_philox_known_answers(host, counter, key, word0):
    assert host.bik_host_philox_word0(*counter, *key) == word0


def _special_f32(gen) -> torch.Tensor:
    bits = torch.randint(-(2**31), 2**31, (1 << 20,), generator=gen, dtype=torch.int64)
    edge = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 65504.0, 65519.99,
                         65520.0, 6.1035156e-05, 6.0e-08, 2.9802322e-08, 1e-45, 3.4e38,
                         -1.5, 0.33333334], dtype=torch.float32)
    return torch.cat([bits.to(torch.int32).view(torch.float32), edge])


def test_conversions_match_torch(host, gen):
    x = _special_f32(gen)
    n = x.numel()
    for fn, dtype in (("bik_host_f32_to_bf16", torch.bfloat16),
                      ("bik_host_f32_to_f16", torch.float16)):
        got = torch.empty(n, dtype=torch.int16)
        getattr(host, fn)(x.data_ptr(), n, got.data_ptr())
        want = x.to(dtype)
        # NaN payloads are not promised (torch's own differ by CPU instruction set): NaN -> NaN.
        assert torch.isnan(got.view(dtype)).equal(torch.isnan(want))
        keep = ~torch.isnan(want)
        assert torch.equal(got[keep], want.view(torch.int16)[keep]), fn
    halves = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    up = torch.empty(halves.numel(), dtype=torch.float32)
    host.bik_host_f16_to_f32(halves.data_ptr(), halves.numel(), up.data_ptr())
    want = halves.view(torch.float16).float()
    keep = ~torch.isnan(want)
    assert torch.isnan(up).equal(~keep)
    assert torch.equal(up.view(torch.int32)[keep], want.view(torch.int32)[keep])


_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _host_rms(host, x, w, eps, residual=None):
    rows, hidden = x.shape
    y = torch.empty_like(x)
    h = torch.empty_like(x)
    host.bik_host_rms_norm(_CODES[x.dtype], x.data_ptr(),
                           None if residual is None else residual.data_ptr(), rows, hidden,
                           w.data_ptr(), eps, y.data_ptr(), h.data_ptr())
    return y, h


@pytest.mark.skipif(not cpu_ext.available(), reason="CPU backend not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [1, 7, 16, 111, 500, 4096])
def test_rms_norm_order_equals_cpu_backend(host, gen, dtype, hidden):
    """The kernel's lane chains and fold, run on the host, give the CPU backend's bits."""
    scale = torch.logspace(-3, 3, 19)[:, None]
    x = (torch.randn(19, hidden, generator=gen) * scale).to(dtype)
    r = torch.randn(19, hidden, generator=gen).to(dtype)
    w = torch.randn(hidden, generator=gen)
    eps = 1e-6
    y, _ = _host_rms(host, x, w, eps)
    assert torch.equal(y.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       bik.rms_norm(x, w, eps, backend="cpu").view(y.view(
                           torch.int16 if dtype != torch.float32 else torch.int32).dtype))
    y2, h2 = _host_rms(host, x, w, eps, residual=r)
    out, h = bik.rms_norm(x, w, eps, residual=r, backend="cpu")
    assert torch.equal(h2, h) and same_bits(y2, out)


@pytest.mark.skipif(not cpu_ext.available(), reason="CPU backend not built")
def test_rms_norm_order_is_visible(host, gen):
    """Negative control: one sequential chain (a different order) differs from the 16 lanes on
    some rows, so the equality above tests the order, not just the formula."""
    x = torch.randn(64, 4096, generator=gen)
    w = torch.ones(4096)
    y, _ = _host_rms(host, x, w, 1e-6)
    exact = (x.double() ** 2).sum(1).float()  # another order: the exact sum, rounded once
    other = (x * (1.0 / torch.sqrt(exact / 4096 + 1e-6))[:, None]) * w
    assert not torch.equal(other, y)


def _emulated_sample(host, table, split, threads):
    """The CUDA sampler's (tokens, logprobs) computed on the host by the kernels' helpers, with
    the inputs the ops layer prepares for the kernels (top-k threshold, log min-p, Philox key)
    and its logprob (z_c - m) - log_s."""
    from bik import configs
    from bik.ops.sampling import noise, split_vocab

    x = table["logits"].float().contiguous()
    temp, top_k = table["temperature"], table["top_k"]
    greedy = temp == 0
    t_safe = torch.where(greedy, torch.ones_like(temp), temp)
    vk, ik = split_vocab.topk_threshold(x, temp, top_k, None)
    seed, pos = table["seed"], table["position"]
    key = torch.stack([seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, pos & 0xFFFFFFFF,
                       (pos >> 32) & 0xFFFFFFFF, torch.full_like(seed, noise.STREAM_SAMPLE)],
                      dim=1).contiguous()
    log_min_p = noise.log_min_p(table["min_p"]).contiguous()
    rows, v = x.shape
    tokens = torch.empty(rows, dtype=torch.int64)
    m, log_s = torch.empty(rows), torch.empty(rows)
    groups, _ = configs.sampler_chunks(v)
    host.bik_cuda_emulate_sample(x.data_ptr(), rows, v, v // groups, key.data_ptr(),
                                 temp.contiguous().data_ptr(), vk.contiguous().data_ptr(),
                                 ik.contiguous().data_ptr(), table["top_p"].contiguous().data_ptr(),
                                 log_min_p.data_ptr(), split, threads, tokens.data_ptr(),
                                 m.data_ptr(), log_s.data_ptr())
    invalid = tokens < 0
    x_c = x.gather(1, tokens.clamp(min=0)[:, None])[:, 0]
    z_c = torch.where(greedy, x_c, x_c / t_safe)
    logprobs = torch.where(invalid, float("nan"), (z_c - m) - log_s)
    return tokens, logprobs


@pytest.mark.skipif(not cpu_ext.available(), reason="CPU backend not built")
@pytest.mark.parametrize(("v", "split", "threads"), [(50, 16384, 512), (1000, 64, 16),
                                                     (3001, 16384, 512), (3001, 100, 32),
                                                     (8 * 1300, 16384, 512)])
@pytest.mark.parametrize("near_ties", [False, True])
def test_sampler_kernel_logic_gives_cpu_bits(host, v, split, threads, near_ties):
    """The stats kernel's exact pass and its normaliser in the kernel's layout (a chunk per
    warp, 32 registers per lane), the pick kernel's loop body, in the kernels' work split
    (splits x threads, then the (value desc, index asc) merge): the CPU backend's tokens and
    logprobs bit for bit, with every filter (top-p included), temperatures and greedy rows.
    V = 8 * 1300: eight groups of ragged chunks."""
    import sampler_inputs

    table = sampler_inputs.requests(120, v, torch.Generator().manual_seed(v + split),
                                    near_ties=near_ties)
    table["logits"][7, 3] = float("nan")  # an invalid row
    assert (table["top_p"] < 1).any()
    want = bik.sample(table["logits"], backend="cpu",
                      **{k: table[k] for k in sampler_inputs.PARAM_NAMES})
    tokens, logprobs = _emulated_sample(host, table, split, threads)
    assert tokens[7] == -1
    assert torch.equal(tokens, want.tokens), (tokens != want.tokens).nonzero().flatten()[:10]
    assert torch.equal(logprobs.view(torch.int32), want.logprobs.view(torch.int32))


def _host_top_p_cut(host, x: torch.Tensor, top_p: float, passes: int = 10):
    from bik import configs

    x = x.float().contiguous()
    rows, v = x.shape
    cut, kept_mass = torch.empty(rows), torch.empty(rows)
    groups, _ = configs.sampler_chunks(v)
    host.bik_cuda_top_p_cut(x.data_ptr(), rows, v, v // groups, top_p, passes, cut.data_ptr(),
                            kept_mass.data_ptr())
    return cut, kept_mass


def test_top_p_search_finds_the_contracts_cut(host):
    """The stats kernel's probe search (row_cut) with the normaliser in the kernel's layout:
    v_p = reference.top_p_cut (the contract read literally) and the kept mass = the literal sum,
    bit for bit, on wide-tailed rows, near ties and 390 tokens tied at the cut (signed zeros
    mixed: more than the candidates buffer, so the splits run to one key). Cutting that search
    two passes short leaves another cut (caught)."""
    from bik import configs
    from bik.ops.sampling import reference
    from bik.ops._normaliser import bik_exp_torch

    gen = torch.Generator().manual_seed(16)
    v = 2000
    wide = torch.randn(4, v, generator=gen) * 2
    wide[:, :20] += torch.rand(4, 20, generator=gen) * 8
    base = torch.randint(-3, 4, (3, v), generator=gen).float()
    near = torch.nextafter(base, base + torch.randint(-1, 2, (3, v), generator=gen).float())
    tied = torch.full((1, v), -6.0)
    tied[:, :10] = 3.0
    tied[:, 10:400] = 0.0
    tied[:, 10:400:2] = -0.0
    groups, chunk = configs.sampler_chunks(v)
    for x, top_p in ((wide, 0.5), (wide, 0.95), (near, 0.9), (tied, 0.9)):
        cut, kept_mass = _host_top_p_cut(host, x, top_p)
        want = reference.top_p_cut(x, top_p, groups, chunk)
        assert torch.equal(cut, want)
        terms = bik_exp_torch(x - x.amax(1, keepdim=True))
        kept = torch.where(x >= want[:, None], terms, 0.0)
        assert torch.equal(kept_mass, reference.vocab_sum(kept, groups, chunk))
    short, _ = _host_top_p_cut(host, tied, 0.9, passes=7)  # it takes 9
    assert not torch.equal(short, reference.top_p_cut(tied, 0.9, groups, chunk))


def test_normaliser_pieces_equal_the_cpu_backend(host):
    """bik_exp over [-90, 0] and the normaliser's sum in the kernel's layout (one group and
    eight, whole and ragged chunks): the CPU backend's bits."""
    from bik import configs
    from bik.ops.sampling import cpu as cpu_sampling

    x = torch.linspace(-90.0, 0.0, 20001)
    got = torch.tensor([host.bik_cuda_exp(float(v)) for v in x])
    assert torch.equal(got.view(torch.int32), cpu_sampling.bik_exp(x).view(torch.int32))
    gen = torch.Generator().manual_seed(2)
    for v in (1, 300, 2400, 8 * 1030 + 8):
        terms = (torch.rand(3, v, generator=gen)
                 * torch.logspace(-6, 6, v)[torch.randperm(v, generator=gen)]).contiguous()
        groups, _ = configs.sampler_chunks(v)
        out = torch.empty(3)
        host.bik_cuda_vocab_sum(terms.data_ptr(), 3, v, v // groups, out.data_ptr())
        assert torch.equal(out.view(torch.int32), cpu_sampling.vocab_sum(terms).view(torch.int32))
