// RMSNorm (+ fused residual add), bit-identical to bik's CPU path (csrc/cpu/contract.h).
//
// One row per 16-lane group, 8 rows per 128-thread block. Lane l owns the contract's partial
// sum s[l] and adds h[l]^2, h[l + 16]^2, ... in ascending order (16 lanes read 16 consecutive
// elements per step: coalesced); the width-16 shuffle fold adds the pairs (l, l + 8), (l, l + 4),
// (l, l + 2), (l, l + 1) as the CPU does. So every row's bits depend only on that row, and equal
// the CPU backend's for every dtype (the CPU path upcasts to fp32 and rounds back, as here).
// With a residual, h = round(x + r) is stored by the lane that later normalises it, and read
// back by that same lane (program order makes its own store visible).
#include "rms_norm.cuh"

namespace bik {
namespace rms {

constexpr int kRowsPerBlock = 8;

template <class T, class W>
__device__ __forceinline__ void rms_norm_rows(
    const typename T::storage* __restrict__ x, i64 sx, const typename T::storage* __restrict__ r,
    i64 sr, const typename W::storage* __restrict__ w, typename T::storage* out, i64 so,
    typename T::storage* hout, i64 sh, i64 rows, i64 hidden, float eps) {
  const i64 row = i64(blockIdx.x) * kRowsPerBlock + (threadIdx.x >> 4);
  const int lane = threadIdx.x & (kLanes - 1);
  const bool live = row < rows;
  float acc = 0.0f;
  if (live) {
    const typename T::storage* xr = x + row * sx;
    if (r != nullptr) {
      const typename T::storage* rr = r + row * sr;
      typename T::storage* hr = hout + row * sh;
#pragma unroll 8
      for (i64 j = lane; j < hidden; j += kLanes) {
        const typename T::storage h = residual_sum<T>(xr[j], rr[j]);
        hr[j] = h;
        acc = square_step(acc, T::load(h));
      }
    } else {
#pragma unroll 8
      for (i64 j = lane; j < hidden; j += kLanes) acc = square_step(acc, T::load(xr[j]));
    }
  }
  // Every lane of the warp takes part in the shuffles (dead rows add zeros among themselves).
  acc = group_sum_fixed<kLanes>(acc);
  const float total = __shfl_sync(kFullMask, acc, 0, kLanes);
  if (!live) return;
  const float rstd = rstd_of(total, hidden, eps);
  const typename T::storage* src = r != nullptr ? hout + row * sh : x + row * sx;
  typename T::storage* yr = out + row * so;
#pragma unroll 8
  for (i64 j = lane; j < hidden; j += kLanes) {
    yr[j] = T::store(scale(T::load(src[j]), rstd, W::load(w[j])));
  }
}

}  // namespace rms
}  // namespace bik

// bik_rms_norm_<x dtype>_<weight dtype>(x, stride_x, residual or null, stride_r, weight, out,
// stride_out, h_out (null without residual), stride_h, rows, hidden, eps). Strides in elements;
// rows have unit stride along the hidden dim. Grid: ceil(rows / 8) blocks of 128 threads.
#define BIK_RMS_NORM_KERNEL(XN, XT, WN, WT)                                                     \
  extern "C" __global__ void __launch_bounds__(128)                                             \
      bik_rms_norm_##XN##_##WN(const XT::storage* x, bik::i64 sx, const XT::storage* r,         \
                               bik::i64 sr, const WT::storage* w, XT::storage* out,             \
                               bik::i64 so, XT::storage* h, bik::i64 sh, bik::i64 rows,        \
                               bik::i64 hidden, float eps) {                                    \
    bik::rms::rms_norm_rows<XT, WT>(x, sx, r, sr, w, out, so, h, sh, rows, hidden, eps);       \
  }

#define BIK_RMS_NORM_FOR_X(XN, XT)              \
  BIK_RMS_NORM_KERNEL(XN, XT, f32, bik::F32)    \
  BIK_RMS_NORM_KERNEL(XN, XT, bf16, bik::BF16)  \
  BIK_RMS_NORM_KERNEL(XN, XT, f16, bik::F16)

BIK_RMS_NORM_FOR_X(f32, bik::F32)
BIK_RMS_NORM_FOR_X(bf16, bik::BF16)
BIK_RMS_NORM_FOR_X(f16, bik::F16)
