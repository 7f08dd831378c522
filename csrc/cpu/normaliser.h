// The one normaliser of bik's CPU kernels: bik_exp, bik_log and vocab_sum's order, shared by
// the sampler (sampling.h: top-p's masses, the logprob) and log_softmax (kernels_isa.h:
// log_softmax_rows), so a token's log_softmax entry and its sampled logprob are the same bits. The sequences are
// written in sampling.h's header comment and docs/design.md#sampler; every GPU kernel runs them.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "contract.h"

namespace bik_cpu {
namespace norm {

static inline float f32_from_bits(std::uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

static inline std::uint32_t bits_of(float f) {
  std::uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// Natural log of a positive normal fp32 (max error 2 ulp vs fp64 over the sampler's domain,
// measured in tests/sampling/test_sampling_noise.py). Only exactly rounded ops, so every backend that follows
// this sequence gets the same bits.
static inline float bik_log(float x) {
  std::uint32_t b = bits_of(x);
  std::int32_t e = std::int32_t(b >> 23) - 127;
  std::uint32_t mb = (b & 0x007FFFFFu) | 0x3F800000u;  // m in [1, 2)
  if (mb > 0x3FB504F3u) {                              // m > sqrt(2): use m / 2, e + 1
    mb -= 0x00800000u;
    e += 1;
  }
  const float f = f32_from_bits(mb) - 1.0f;  // exact (Sterbenz)
  float q = -0x1.4238320000000p-4f;
  q = q * f + 0x1.0697100000000p-3f;
  q = q * f + -0x1.0c52540000000p-3f;
  q = q * f + 0x1.2297340000000p-3f;
  q = q * f + -0x1.5488820000000p-3f;
  q = q * f + 0x1.99a3ec0000000p-3f;
  q = q * f + -0x1.0002060000000p-2f;
  q = q * f + 0x1.55554e0000000p-2f;
  q = q * f + -0x1.fffffe0000000p-2f;
  const float p = q * f + 1.0f;
  const float l = f * p;
  const float ef = float(e);
  return ef * 0x1.62e4000000000p-1f + (ef * 0x1.7f7d1c0000000p-20f + l);
}

// exp(x) for x <= 0 (and -inf) from exactly rounded operations (Cody-Waite reduction by ln 2,
// a degree-7 polynomial with Moshier's Cephes expf coefficients, an exact scale by 2^k). Below
// -86 the result is 0: the sampler adds it to a sum >= 1, where exp(-86) ~ 4e-38 is far under
// half an ulp, and no subnormal ever appears (a GPU flushing them gives the same bits).
static inline float bik_exp(float x) {
  if (!(x >= -86.0f)) return 0.0f;
  const float k = std::floor(x * 0x1.715476p+0f + 0.5f);
  const float r = (x - k * 0x1.630000p-1f) - k * -0x1.bd0106p-13f;
  float q = 0x1.a0d2cep-13f;
  q = q * r + 0x1.6e879cp-10f;
  q = q * r + 0x1.111210p-7f;
  q = q * r + 0x1.555382p-5f;
  q = q * r + 0x1.555554p-3f;
  q = q * r + 0x1.000000p-1f;
  const float p = (q * (r * r) + r) + 1.0f;
  return p * f32_from_bits(std::uint32_t(std::int32_t(k) + 127) << 23);
}

struct VocabChunks {
  idx_t groups, chunk;
};

// The normaliser's order (sampling.h's header): G groups of V / G tokens, chunks of `chunk` from
// each group's start. fill(c0, n, s) writes the chunk's n <= chunk terms into s[0..n).
// s: scratch of `chunk` floats. Always inlined, so a caller compiled for a wider ISA
// (kernels_isa.h) folds with its vectors and inlines its fill.
template <class Fill>
static inline __attribute__((always_inline)) float vocab_sum_chunks(idx_t V, const VocabChunks& vc, const Fill& fill, float* s) {
  const idx_t group_len = V / vc.groups;
  float total = 0.0f;
  for (idx_t g = 0; g < vc.groups; ++g) {
    const idx_t g_end = (g + 1) * group_len;
    float group_total = 0.0f;
    for (idx_t c0 = g * group_len; c0 < g_end; c0 += vc.chunk) {
      // The zero padding of a ragged chunk is implicit: s[t] + (+0) is s[t] (terms are >= +0),
      // so a step only adds the pairs whose second term exists. Same bits, O(n) work.
      idx_t n = std::min(c0 + vc.chunk, g_end) - c0;
      fill(c0, n, s);
      for (idx_t w = vc.chunk / 2; w >= 1; w >>= 1) {
        if (n <= w) continue;
        for (idx_t t = 0; t + w < n; ++t) s[t] = s[t] + s[t + w];
        n = w;
      }
      group_total = group_total + s[0];
    }
    total = total + group_total;
  }
  return total;
}

// The sum of term(j), j = 0..V-1.
template <class Term>
static inline float vocab_sum(idx_t V, const VocabChunks& vc, const Term& term) {
  std::vector<float> s(static_cast<size_t>(vc.chunk));
  const auto fill = [&term](idx_t c0, idx_t n, float* d) {
    for (idx_t t = 0; t < n; ++t) d[t] = term(c0 + t);
  };
  return vocab_sum_chunks(V, vc, fill, s.data());
}

}  // namespace norm
}  // namespace bik_cpu
