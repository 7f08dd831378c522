"""The sampler's noise and its building blocks (docs/design.md#sampler, "Noise", "bik_log").

Targets: the CPU backend (csrc/cpu/sampling.h, elementwise through bik/ops/sampling/cpu.py) and
the Triton kernels run on the CPU by TRITON_INTERPRET=1 (their own process), through the
elementwise test kernel ``run_noise_part`` (sampling_test_kernels.py). On each: Philox4x32-10
gives Random123's published known answers (Triton also the CPU's words on random inputs); the
Gumbel map over all 2^23 u the
sampler can draw is finite, monotone, within [G_MIN, G_MAX] and within 1e-6 of fp64 (Triton:
bit-identical to the CPU's); bik_log is within 2 ulp of fp64 and gives the bits of its torch
replica bik_log_torch, which min-p uses on every backend (Triton: and the CPU's). The pick skips
the noise of tokens that cannot win, exactly: its tokens equal the unskipped brute force of
bik/ops/sampling/reference.py (Triton: and the CPU's tokens). Seed and position change the draw.
"""

from __future__ import annotations

import bik
import numpy as np
import pytest
import torch
from bik.ops.sampling import cpu as cpu_sampling
from bik.ops.sampling import reference
from bik.ops._normaliser import bik_log_torch
from targets import targets

G_MIN, G_MAX = -2.8115408420562744, 16.63553237915039  # noise range over all 2^23 u values

# Random123's published Philox4x32-10 known-answer vectors: (counter, key, output).
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def all_units() -> torch.Tensor:
    """Every u the sampler can draw: (2i + 1) * 2^-24, i in [0, 2^23)."""
    return (2 * torch.arange(2**23) + 1).float() * 2.0**-24


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def _noise_part(target, fn: str, x: torch.Tensor) -> torch.Tensor:
    """On the target's backend, elementwise: "philox" (x: [n, 6] counter words then key words,
    uint32 values in int64; gives [n, 4]), "log" (bik_log) or "gumbel" (the map u -> g)."""
    if target.backend == "cpu":
        if fn == "philox":
            return cpu_sampling.philox4x32_10(x[:, :4], x[:, 4:])
        return {"log": cpu_sampling.bik_log, "gumbel": cpu_sampling.gumbel_from_unit}[fn](x)
    from sampling_test_kernels import run_noise_part

    return run_noise_part(fn, x, x.shape[0])


@pytest.mark.parametrize("target", targets())
def test_philox_known_answers(target):
    for counter, key, want in PHILOX_KAT:
        got = _noise_part(target, "philox", torch.tensor([counter + key]))
        assert tuple(got[0].tolist()) == want
    if target.backend != "cpu":
        words = torch.randint(0, 2**32, (3000, 6), generator=torch.Generator().manual_seed(1))
        assert torch.equal(_noise_part(target, "philox", words),
                           cpu_sampling.philox4x32_10(words[:, :4], words[:, 4:]))


@pytest.mark.parametrize("target", targets())
def test_noise_over_every_u_is_finite_and_in_range(target):
    u = all_units()
    g = _noise_part(target, "gumbel", u)
    assert torch.isfinite(g).all()
    assert g.min().item() == G_MIN and g.max().item() == G_MAX
    # Monotone in u (the map from bits to noise preserves order, so no u is special).
    assert (g[1:] >= g[:-1]).all()
    ref = -np.log(-np.log(u.double().numpy()))
    assert np.abs(g.double().numpy() - ref).max() < 1e-6
    if target.backend != "cpu":
        assert torch.equal(_bits(g), _bits(cpu_sampling.gumbel_from_unit(u)))


def _ulp_error(got: torch.Tensor, x: torch.Tensor) -> float:
    exact = np.log(x.double().numpy())
    ulp = np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
    return float((np.abs(got.double().numpy() - exact) / ulp).max())


def _log_domain(target) -> list[torch.Tensor]:
    """The sampler's log inputs (every u and every -log(u)) and every mantissa at several
    exponents, including the smallest and largest normal binades. The interpreter (~2 s a
    binade) takes two binades, the smallest and a large one."""
    mant = (torch.arange(2**23, dtype=torch.int32) | (127 << 23)).view(torch.float32)
    if target.small:
        return [mant * 2.0**e for e in (-126, 100)]
    u = all_units()
    return [u, -cpu_sampling.bik_log(u)] + [mant * 2.0**e for e in (-126, -20, -1, 0, 1, 60, 127)]


@pytest.mark.parametrize("target", targets())
def test_bik_log_accuracy_and_torch_replica(target):
    worst = 0.0
    for x in _log_domain(target):
        got = _noise_part(target, "log", x)
        worst = max(worst, _ulp_error(got, x))
        # The torch replica (used for min_p on every backend) gives the same bits.
        assert torch.equal(_bits(bik_log_torch(x)), _bits(got))
        if target.backend != "cpu":
            assert torch.equal(_bits(got), _bits(cpu_sampling.bik_log(x)))
    assert worst < 2.0, worst  # measured: 1.64 ulp
    assert _noise_part(target, "log", torch.tensor([1.0])).item() == 0.0


@pytest.mark.parametrize("target", targets())
def test_noise_skip_bound_is_exact(target, gen):
    """The kernels skip the noise of tokens below m + G_MIN - G_MAX; a token just above the
    bound must still be able to win, and peaked rows must give the unskipped token: compared
    with a brute force over the reference noise (every token's noise computed). In the
    interpreter the vocabulary crosses several pick programs (SPLIT = 128, BLOCK = 64), most of
    whose chunks skip, and the tokens also equal the CPU path's."""
    rows, v, just_inside, seed, step = (24, 300, 77, 3, 5) if target.small else (4000, 64, 5, 11, 1)
    x = torch.randn(rows, v, generator=gen) * 12  # spread: most tokens are skippable
    x[:, just_inside] = x.amax(1) + (G_MIN - G_MAX) + 1e-3  # just inside the bound
    pos = torch.arange(rows) * step
    got = bik.sample(x, seed=seed, position=pos, temperature=1.0, backend=target.backend).tokens
    assert torch.equal(got, reference.gumbel_max(x, seed, pos))
    if target.backend != "cpu":
        assert torch.equal(got, bik.sample(x, seed=seed, position=pos, temperature=1.0,
                                           backend="cpu").tokens)


@pytest.mark.parametrize("target", targets())
def test_seed_and_position_change_the_draw(target):
    x = torch.zeros(1, 1000)
    draws = {bik.sample(x, seed=s, position=p, backend=target.backend).tokens.item()
             for s in (0, 1, 2**40) for p in (0, 1, 2**33)}
    assert len(draws) == 9


def test_torch_noise_is_the_kernels_noise(gen):
    """noise.gumbel_torch (what a vocab-parallel rank computes for its token ids, on any device)
    gives Random123's known answers and the CPU kernel's Philox words and noise bits."""
    from bik.ops.sampling.noise import gumbel_torch, philox4x32_10_torch

    for counter, key, want in PHILOX_KAT:
        words = philox4x32_10_torch(*(torch.tensor(w) for w in counter + key))
        assert tuple(int(w) for w in words) == want
    words = torch.randint(0, 2**32, (20_000, 6), generator=gen)
    got = torch.stack(philox4x32_10_torch(*words.unbind(1)), 1)
    assert torch.equal(got, cpu_sampling.philox4x32_10(words[:, :4], words[:, 4:]))
    position = torch.tensor([0, 7, 2**32 + 5, 2**62])
    for seed in (0, 99, 2**63 - 1, 2**64 - 3):
        want = reference.noise(seed, position, 4096)
        as_int64 = seed - 2**64 if seed >= 2**63 else seed
        got = gumbel_torch(torch.tensor([[as_int64]]), position[:, None],
                           torch.arange(4096)[None])
        assert torch.equal(_bits(got), _bits(want)), seed
