// RMSNorm's per-row arithmetic and reduction order (docs/design.md#rmsnorm), __host__ __device__.
//
// The CUDA kernel reproduces the CPU contract (csrc/cpu/contract.h) exactly:
//   s[l] = +0 for l = 0..15;  for j ascending: s[j % 16] = s[j % 16] + h[j] * h[j]
//   fold w = 8, 4, 2, 1: s[l] = s[l] + s[l + w] (l < w);  mean = s[0] / (float)H
//   rstd = 1 / sqrt(mean + eps);  y[j] = (h[j] * rstd) * w[j]   (each op rounded to fp32)
// In the kernel, lane l of a 16-lane group owns s[l] and adds h[l], h[l + 16], ... in order;
// the fold is a width-16 shuffle tree with exactly these pairs. rms_norm_row_host below runs the
// same helpers in the same order on the CPU: tests compare it with bik's CPU backend.
#pragma once

#include "common.cuh"

namespace bik {
namespace rms {

constexpr int kLanes = 16;  // the contract's lane count: one 16-lane group per row

BIK_HD float square_step(float acc, float h) { return add_rn(acc, mul_rn(h, h)); }

BIK_HD float rstd_of(float total, i64 hidden, float eps) {
  const float mean = div_rn(total, float(hidden));
  return div_rn(1.0f, sqrt_rn(add_rn(mean, eps)));
}

BIK_HD float scale(float h, float rstd, float w) { return mul_rn(mul_rn(h, rstd), w); }

// h = x + residual in fp32, rounded to the storage type (the value normalised and returned).
template <class T>
BIK_HD typename T::storage residual_sum(typename T::storage x, typename T::storage r) {
  return T::store(add_rn(T::load(x), T::load(r)));
}

#if !defined(__CUDACC_RTC__)
// Host emulation of one row, in the kernel's order (lane chains, then the 8, 4, 2, 1 fold).
template <class T, class W>
inline void rms_norm_row_host(const typename T::storage* h, const typename W::storage* w,
                              i64 hidden, float eps, typename T::storage* y) {
  float s[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    s[l] = 0.0f;
    for (i64 j = l; j < hidden; j += kLanes) s[l] = square_step(s[l], T::load(h[j]));
  }
  for (int width = kLanes / 2; width >= 1; width >>= 1)
    for (int l = 0; l < width; ++l) s[l] = add_rn(s[l], s[l + width]);
  const float rstd = rstd_of(s[0], hidden, eps);
  for (i64 j = 0; j < hidden; ++j) y[j] = T::store(scale(T::load(h[j]), rstd, W::load(w[j])));
}
#endif

}  // namespace rms
}  // namespace bik
