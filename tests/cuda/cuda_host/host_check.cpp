// The CPU path's sampler math (csrc/cpu/sampling.h) against the CUDA kernels' (host_cuda.cpp,
// another translation unit), for tests/cuda/test_cuda_host.py (loaded with ctypes).
#include <cstdint>
#include <cstring>

#include "sampling.h"

extern "C" {
float bik_cuda_gumbel(std::uint64_t seed, std::uint64_t pos, std::uint32_t token,
                      std::uint32_t stream);
float bik_cuda_bits_to_unit(std::uint32_t bits);
float bik_cuda_gumbel_from_unit(float u);
float bik_cuda_log(float x);
std::uint32_t bik_host_philox_word0(std::uint32_t c0, std::uint32_t c1, std::uint32_t c2,
                                    std::uint32_t c3, std::uint32_t k0, std::uint32_t k1);
}

namespace {

std::uint64_t splitmix(std::uint64_t& s) {
  std::uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

bool differ(float a, float b) {
  return bik_cpu::sampling::bits_of(a) != bik_cpu::sampling::bits_of(b);
}

}  // namespace

extern "C" {

// Mismatches between the CUDA and CPU noise (and Philox word 0) over n pseudo-random (seed,
// position, token, stream), seeds and positions over the full 64-bit range.
std::int64_t bik_host_noise_mismatches(std::int64_t n, std::uint64_t state) {
  namespace s = bik_cpu::sampling;
  std::int64_t bad = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const std::uint64_t seed = splitmix(state), pos = splitmix(state) >> (i % 64);
    const std::uint32_t token = std::uint32_t(splitmix(state)) >> (i % 17);
    const std::uint32_t stream = i % 5 == 0 ? 1u : 0u;
    const auto w = s::philox4x32_10(token, std::uint32_t(pos), std::uint32_t(pos >> 32), stream,
                                    std::uint32_t(seed), std::uint32_t(seed >> 32));
    bad += w.v[0] != bik_host_philox_word0(token, std::uint32_t(pos), std::uint32_t(pos >> 32),
                                           stream, std::uint32_t(seed),
                                           std::uint32_t(seed >> 32));
    bad += differ(bik_cuda_gumbel(seed, pos, token, stream),
                  s::gumbel(std::int64_t(seed), std::int64_t(pos), token, stream));
  }
  return bad;
}

// Mismatches of u and the Gumbel value over all 2^23 u, and of bik_log over every 7th mantissa
// at a spread of exponents.
std::int64_t bik_host_unit_mismatches() {
  namespace s = bik_cpu::sampling;
  std::int64_t bad = 0;
  for (std::uint32_t k = 0; k < (1u << 23); ++k) {
    const std::uint32_t bits = k << 9;
    const float u = s::bits_to_unit(bits);
    bad += differ(bik_cuda_bits_to_unit(bits), u);
    bad += differ(bik_cuda_gumbel_from_unit(u), s::gumbel_from_unit(u));
  }
  for (std::uint32_t e = 1; e < 255; e += 11) {
    for (std::uint32_t m = 0; m < (1u << 23); m += 7) {
      const float x = s::f32_from_bits((e << 23) | m);
      bad += differ(bik_cuda_log(x), s::bik_log(x));
    }
  }
  return bad;
}

}  // extern "C"
