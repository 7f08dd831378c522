// The fp32 fma sequence of contract.h written literally in scalar C++ (runs on any CPU, no FMA
// instruction: doubles and an error-free sum): what the Fma32 kernels (kernels_isa.h) must equal
// bit for bit, and the start-up self-test's judge. ops/matmul/reference.py writes the same
// sequence in torch.
#pragma once

#include <cmath>
#include <limits>

#include "contract.h"

namespace bik_cpu {
namespace fma_ref {

// p + a*b rounded once to nearest even (C's fmaf, written out). The product of two floats is
// exact in double (24 + 24 <= 53 bits) and so is the sum's error (TwoSum), but rounding the
// double sum to float rounds twice, which goes wrong exactly when that sum lands on the midpoint
// of two floats while the exact value is not there: then the error's sign picks the side.
inline float step(float p, float a, float b) {
  const double prod = double(a) * double(b);
  const double s = prod + double(p);
  const float r = float(s);
  if (!std::isfinite(s) || double(r) == s) return r;  // inf / NaN, or exact: one rounding
  const double bb = s - prod;
  const double err = (prod - (s - bb)) + (double(p) - bb);
  if (err == 0.0) return r;
  // the two floats around s (2^128 stands for the one past the largest)
  const float toward = s > double(r) ? std::numeric_limits<float>::infinity()
                                     : -std::numeric_limits<float>::infinity();
  const float other = std::nextafter(r, toward);
  auto wide = [](float f) {
    return std::isinf(f) ? std::copysign(0x1p128, double(f)) : double(f);
  };
  if (s != (wide(r) + wide(other)) / 2) return r;
  const bool up = err > 0;  // the exact value is past the midpoint on err's side
  const bool r_is_upper = wide(r) > wide(other);
  return up == r_is_upper ? r : other;
}

// c[m, n] of contract.h's fp32 fma sequence for a[M, K], b[K, N] (fp32, element strides), split
// length `split` (0 or >= K: one split), optional bias.
inline void matmul(const float* a, idx_t sam, idx_t sak, const float* b, idx_t sbk, idx_t sbn,
                   const float* bias, float* c, idx_t ldc, idx_t M, idx_t N, idx_t K,
                   idx_t split) {
  matmul_loops(a, sam, sak, b, sbk, sbn, bias, c, ldc, M, N, K, split, step,
               [](float p, idx_t) { return p; });
}

}  // namespace fma_ref
}  // namespace bik_cpu
