// The bf16 dot contract of contract.h written literally in scalar C++ (runs on any CPU): what
// the vdpbf16ps kernel (matmul_bf16_dot.h) must equal bit for bit, and the start-up self-test's
// judge. ops/matmul/reference.py writes the same sequence in torch.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "contract.h"

namespace bik_cpu {
namespace dot_ref {

inline float bf16_value(std::uint16_t h) {
  const std::uint32_t u = std::uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Denormals in: a bf16 with a zero exponent field is read as a zero of its sign.
inline float daz(std::uint16_t h) {
  if ((h & 0x7f80u) == 0) return (h & 0x8000u) ? -0.0f : 0.0f;
  return bf16_value(h);
}

// One step: p + a*b with the product exact, one round to nearest even at fp32's precision with
// an unbounded exponent, then a result below 2^-126 in magnitude flushed to a zero of its sign.
// In double: the product of two bf16 values is exact, and rounding p + a*b to double and then
// to 24 bits equals rounding it once (53 >= 2 * 24 + 2).
// s (a double holding a sum of two values of at most 24 significant bits, or rounded from one:
// the same, since 53 >= 2 * 24 + 2) rounded once to nearest even at 24 bits with an unbounded
// exponent, then flushed to a zero of its sign below 2^-126.
inline float round_flush(double s) {
  if (!(std::fabs(s) < 0x1p-100)) return float(s);  // normal, inf or NaN: float() rounds once
  if (s == 0.0) return float(s);
  // Round to 24 bits with room below fp32's exponent range: scaling by 2^200 is exact.
  const double r = double(float(s * 0x1p200)) * 0x1p-200;
  if (std::fabs(r) < 0x1p-126) return s < 0 ? -0.0f : 0.0f;
  return float(r);
}

inline float step(float p, std::uint16_t a, std::uint16_t b) {
  return round_flush(double(p) + double(daz(a)) * double(daz(b)));
}

// c[m, n] of contract.h's bf16 dot sequence for a[M, K], b[K, N] (bf16 bits, element strides),
// split length `split` (0 or >= K: one split), optional fp32 bias.
inline void matmul(const std::uint16_t* a, idx_t sam, idx_t sak, const std::uint16_t* b, idx_t sbk,
                   idx_t sbn, const float* bias, float* c, idx_t ldc, idx_t M, idx_t N, idx_t K,
                   idx_t split) {
  // an odd split ends with its last pair's zero half: a -0 partial becomes +0
  matmul_loops(a, sam, sak, b, sbk, sbn, bias, c, ldc, M, N, K, split, step,
               [](float p, idx_t len) { return len % 2 == 1 ? step(p, 0, 0) : p; });
}

}  // namespace dot_ref
}  // namespace bik_cpu
