"""What the CPU's AMX bf16 instruction computes: tdpbf16ps against a written-down model.

Not part of bik's kernels: evidence for the contract decision docs/design.md describes ("bf16
on AMX"). Compiles a small probe with g++ (-mamx-tile -mamx-bf16; Linux, which must grant the
tile data state), runs one tdpbf16ps per case on a 16 x 16 fp32 tile (row 0 x column 0 is the
element checked, K = 32 bf16 terms), and compares each result bit for bit with MODEL:

    E = +0, then E = E + a[2i]*b[2i] for i ascending; O the same for the odd terms
    a[2i+1]*b[2i+1]; result = acc + (E + O). Each product exact; each add's exact sum
    rounded once to fp32 (nearest even), overflowing to inf, and flushed to a zero of its sign
    below 2^-126 (judged after rounding); bf16 inputs and acc with a zero exponent field read as
    zeros of their sign.

Usage: python tools/amx_probe.py [--random N]. Prints the hand-made cases (each chosen so that
a plainer model fails it), then N random cases over wide exponents; exit status 1 on any
mismatch, 2 where the CPU or the compiler cannot run AMX.
"""

from __future__ import annotations

import argparse
import math
import random
import struct
import subprocess
import sys
import tempfile
from fractions import Fraction
from pathlib import Path

PROBE = r"""
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdint>
#include <cstdio>
#include <cstring>
struct Cfg { uint8_t palette, start, rsv[14]; uint16_t colsb[16]; uint8_t rows[16]; };
int main() {
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */)) return 2;
  Cfg cfg{};
  cfg.palette = 1;
  for (int t = 0; t < 3; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  _tile_loadconfig(&cfg);
  unsigned acc;
  while (scanf("%x", &acc) == 1) {
    alignas(64) uint32_t C[16][16] = {};
    alignas(64) uint16_t A[16][32] = {}, B[16][32] = {};
    C[0][0] = acc;
    for (int k = 0; k < 32; ++k) { unsigned w; scanf("%x", &w); A[0][k] = uint16_t(w); }
    for (int k = 0; k < 32; ++k) { unsigned w; scanf("%x", &w); B[k / 2][k % 2] = uint16_t(w); }
    _tile_loadd(0, C, 64);
    _tile_loadd(1, A, 64);
    _tile_loadd(2, B, 64);
    _tile_dpbf16ps(0, 1, 2);
    _tile_stored(0, C, 64);
    printf("%08x\n", C[0][0]);
  }
  _tile_release();
}
"""

def _bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def _bf16(x: float) -> int:
    return _bits(x) >> 16  # the cases' values are bf16 numbers


def _value(bits: int, width: int) -> Fraction | float:
    """An fp32 (width 32) or bf16 (16) bit pattern as an exact Fraction, a zero exponent field
    read as zero; inf or NaN as a float."""
    exp_bits, man_bits = (8, 23) if width == 32 else (8, 7)
    sign = -1 if bits >> (width - 1) else 1
    e = (bits >> man_bits) & ((1 << exp_bits) - 1)
    m = bits & ((1 << man_bits) - 1)
    if e == 255:
        return float("nan") if m else sign * float("inf")
    if e == 0:
        return Fraction(0) if sign > 0 else -0.0  # -0.0 (a float) stands for a negative zero
    return sign * Fraction((1 << man_bits) | m) * Fraction(2) ** (e - 127 - man_bits)


def _fp32(x):
    """The exact x rounded once to fp32: nearest even, inf past the largest, +-0 below 2^-126
    (after rounding); an inf or NaN (a float) passes."""
    if isinstance(x, float) or x == 0:
        return x
    e = math.floor(math.log2(abs(x)))
    while abs(x) >= Fraction(2) ** (e + 1):
        e += 1
    while abs(x) < Fraction(2) ** e:
        e -= 1
    r = Fraction(round(x / Fraction(2) ** (e - 23))) * Fraction(2) ** (e - 23)  # ties to even
    if abs(r) >= Fraction(2) ** 128:
        return math.copysign(math.inf, r)
    if abs(r) < Fraction(2) ** -126:
        return Fraction(0) if r > 0 else -0.0  # flushed to a zero of its sign
    return r


def _is_zero(x) -> bool:
    return x == 0  # Fraction(0), or the float -0.0


def _neg(x) -> bool:
    return (isinstance(x, float) and math.copysign(1.0, x) < 0) or (not isinstance(x, float)
                                                                    and x < 0)


def model(acc: int, a: list[int], b: list[int]) -> int:
    """MODEL (module docstring) on bit patterns: acc fp32, a and b 32 bf16 words each."""
    def exact(x):  # a finite value as a Fraction (a -0.0 as 0)
        return Fraction(0) if _is_zero(x) else x

    def add(x, y):
        if _is_zero(x) and _is_zero(y):  # IEEE: -0 only from -0 + -0
            return -0.0 if _neg(x) and _neg(y) else Fraction(0)
        if (isinstance(x, float) and not _is_zero(x)) or (isinstance(y, float)
                                                          and not _is_zero(y)):
            return float(x) + float(y)  # inf or NaN involved
        return _fp32(exact(x) + exact(y))

    def mul(x, y):
        if (isinstance(x, float) and not _is_zero(x)) or (isinstance(y, float)
                                                          and not _is_zero(y)):
            return float(x) * float(y)  # inf or NaN involved (inf * 0 is NaN)
        if _is_zero(x) or _is_zero(y):
            return -0.0 if _neg(x) != _neg(y) else Fraction(0)
        return x * y

    prods = [mul(_value(x, 16), _value(y, 16)) for x, y in zip(a, b)]
    chains = []
    for start in (0, 1):
        total = Fraction(0)
        for p in prods[start::2]:
            total = add(total, p)
        chains.append(total)
    out = add(_value(acc, 32), add(chains[0], chains[1]))
    if isinstance(out, float):
        return _bits(out) if not math.isnan(out) else 0x7FC00000
    return _bits(float(out))


def cases() -> dict[str, tuple[float, dict[int, tuple[float, float]]]]:
    """(acc, {k: (a[k], b[k])}) chosen so that a plainer model fails each."""
    p = 2.0**24
    return {
        "one chain per parity (not one fp32 chain)": (0.0, {0: (1, p), 1: (1, 1), 2: (1, -p)}),
        "each parity rounds in fp32 (not exact)": (0.0, {0: (1, p), 2: (1, 1), 4: (1, -p)}),
        "acc + (E + O), not (acc + E) + O": (p, {0: (1, 1), 1: (1, 1)}),
        "a chain is sequential, not a tree": (0.0, {0: (1, p), 4: (1, 1), 6: (1, -p)}),
        "E + O rounds before acc": (1.0, {0: (1, -1), 1: (2.0**-15, 2.0**-15)}),
        "ties to even": (1.0 + 2**-23, {0: (1, 2.0**-24)}),
        "a denormal acc reads as zero": (2.0**-140, {}),
        "results below 2^-126 flush": (0.0, {0: (2.0**-64, 2.0**-63)}),
        "-0 acc plus -0 terms is +0": (-0.0, {0: (-1.0, 0.0)}),
        "a flushed result keeps its sign": (-2.0**-125, {0: (1.5 * 2.0**-63, 2.0**-63)}),
    }


def _line(acc: int, a: list[int], b: list[int]) -> str:
    return " ".join(f"{w:x}" for w in [acc, *a, *b])


def _random_case(rng: random.Random) -> tuple[int, list[int], list[int]]:
    def word() -> int:
        e = rng.choice([0, 1, 2, 60, 63, 64, 100, 120, 126, 127, 128, 131, 150, 190, 250])
        return (rng.getrandbits(1) << 15) | (e << 7) | rng.getrandbits(7)

    acc = (rng.getrandbits(1) << 31) | (rng.choice([0, 1, 100, 127, 150, 200]) << 23) \
        | rng.getrandbits(23)
    return acc, [word() for _ in range(32)], [word() for _ in range(32)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--random", type=int, default=20000, help="random cases after the named ones")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "probe.cpp", Path(tmp) / "probe"
        src.write_text(PROBE)
        built = subprocess.run(["g++", "-O2", "-mamx-tile", "-mamx-bf16", str(src), "-o",
                                str(exe)], capture_output=True, text=True)
        if built.returncode:
            print("cannot build the probe:", built.stderr[-2000:])
            return 2
        named = {}
        for name, (acc, terms) in cases().items():
            a, b = [0] * 32, [0] * 32
            for k, (x, y) in terms.items():
                a[k], b[k] = _bf16(x), _bf16(y)
            named[name] = (_bits(acc), a, b)
        rng = random.Random(0)
        rand = [_random_case(rng) for _ in range(args.random)]
        todo = list(named.values()) + rand
        run = subprocess.run([str(exe)], input="\n".join(_line(*c) for c in todo) + "\n",
                             capture_output=True, text=True)
        if run.returncode == 2 or not run.stdout:
            print("this CPU or kernel does not grant AMX tiles")
            return 2
    got = [int(w, 16) for w in run.stdout.split()]
    bad = 0
    for (name, case), g in zip(named.items(), got):
        want = model(*case)
        bad += g != want and not (g & 0x7fffffff > 0x7f800000 and want & 0x7fffffff > 0x7f800000)
        print(f"{'ok ' if g == want else 'BAD'} {name}: tdpbf16ps {g:08x}, model {want:08x}")
    nan = lambda w: (w & 0x7fffffff) > 0x7f800000  # noqa: E731 - NaN payloads not modelled
    rbad = sum(g != model(*c) and not (nan(g) and nan(model(*c)))
               for c, g in zip(rand, got[len(named):]))
    print(f"random cases: {len(rand) - rbad} of {len(rand)} equal the model bit for bit "
          f"(NaN = NaN)")
    return 1 if bad or rbad else 0


if __name__ == "__main__":
    sys.exit(main())
