// Row reductions for bik's CPU backend: softmax and mean over rows of fp32 (log_softmax is the
// sampler's normaliser: normaliser.h, instantiated per ISA in kernels_isa.h).
// The numerics contract (the exact per-row sequence) is written in contract.h; this file is its
// implementation. Compiled once (baseline ISA): the kernels are scalar in form, and whatever the
// compiler vectorizes keeps each lane's sequence, because -ffp-contract=off and no fast-math
// forbid reassociation and fusion (setup.py).
// No include guard needed beyond #pragma once; included by bindings.cpp after contract.h.
#pragma once

#include <cmath>

#include "contract.h"
#include "normaliser.h"

namespace bik_cpu {
namespace red {

constexpr int kLanes = 16;

// The fixed fold of the 16 lane sums: for w = 8, 4, 2, 1: s[l] = s[l] + s[l + w], l < w.
static inline float fold16(float* s) {
  for (int w = 8; w >= 1; w >>= 1)
    for (int l = 0; l < w; ++l) s[l] = s[l] + s[l + w];
  return s[0];
}

// Row maximum, NaN if the row holds a NaN. max is exact, so its order does not matter.
static inline float row_max(const float* x, idx_t n) {
  float m = -INFINITY;
  bool nan = false;
  for (idx_t j = 0; j < n; ++j) {
    const float v = x[j];
    m = v > m ? v : m;
    nan |= v != v;
  }
  return nan ? NAN : m;
}

// softmax of rows m0..m1-1 of x [M, n] (unit stride along n) into y. (log_softmax runs the
// sampler's normaliser instead: normaliser.h.)
static void softmax_rows(const float* x, idx_t sxm, float* y, idx_t sym, idx_t m0, idx_t m1,
                         idx_t n) {
  for (idx_t r = m0; r < m1; ++r) {
    const float* xr = x + r * sxm;
    float* yr = y + r * sym;
    const float mx = row_max(xr, n);
    float s[kLanes] = {};
    for (idx_t j = 0; j < n; ++j) {
      const float e = std::exp(xr[j] - mx);  // expf: a pure function of its argument
      yr[j] = e;                             // kept for the division below
      s[j % kLanes] = s[j % kLanes] + e;
    }
    const float sum = fold16(s);
    for (idx_t j = 0; j < n; ++j) yr[j] = yr[j] / sum;
  }
}

// mean of rows m0..m1-1 of x [M, n] (unit stride along n) into y[M] (stride 1).
static void mean_rows(const float* x, idx_t sxm, float* y, idx_t m0, idx_t m1, idx_t n) {
  const float count = static_cast<float>(n);
  for (idx_t r = m0; r < m1; ++r) {
    const float* xr = x + r * sxm;
    float s[kLanes] = {};
    idx_t j = 0;
    for (; j + kLanes <= n; j += kLanes)
      for (int l = 0; l < kLanes; ++l) s[l] = s[l] + xr[j + l];
    for (int l = 0; j + l < n; ++l) s[l] = s[l] + xr[j + l];  // the tail: only its own lanes
    y[r] = fold16(s) / count;
  }
}

// Below this many elements per thread one thread does the work (speed only, never bits).
constexpr idx_t kMinElemsPerThread = idx_t(1) << 17;

}  // namespace red
}  // namespace bik_cpu
