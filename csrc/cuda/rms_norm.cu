// RMSNorm (+ fused residual add), bit-identical to bik's CPU path (csrc/cpu/contract.h).
//
// The contract's 16 lane sums s[l] (h[l]^2, h[l + 16]^2, ... added in ascending order, then
// folded (l, l + 8), (l, l + 4), (l, l + 2), (l, l + 1)) are spread over the threads of a row
// group by the load width VEC (elements per load): thread q of the group's 16 / VEC threads owns
// lanes q·VEC ... q·VEC + VEC - 1 and, at step i, loads elements 16 i + q·VEC ... in one load.
// So each lane still adds its own elements in ascending order, whatever VEC is:
//   VEC = 16 bytes / element size (4 fp32, 8 bf16/fp16): 16-byte loads and stores, 4 or 2
//     threads per row (bik_rms_norm_vec_*; the launcher picks it when every row, the weight and
//     the hidden size are aligned to a vector);
//   VEC = 1: 16 threads per row, 2- or 4-byte accesses (bik_rms_norm_*; any alignment).
// The fold's pairs (l, l + w) with w >= VEC are in different threads: a butterfly of xor
// shuffles with distance w / VEC. Both partners compute add(s[l], s[l + w]), and fp32 addition
// is commutative, so every thread of the group ends with the same bits, and thread 0's tree is
// exactly the contract's. Pairs with w < VEC are in one thread's registers. So every row's bits
// depend only on that row and equal the CPU backend's for every dtype and both instances.
// With a residual, h = round(x + r) is stored by the thread that later normalises it and read
// back by that same thread (program order makes its own store visible).
#include "rms_norm.cuh"

namespace bik {
namespace rms {

// VEC consecutive elements, moved by one load or store (16 bytes for the vector instance).
template <class S, int VEC>
struct alignas(sizeof(S) * VEC) Pack {
  S v[VEC];
};

template <class S, int VEC>
__device__ __forceinline__ Pack<S, VEC> load_pack(const S* p) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const Pack<S, VEC>*>(p);
#else
  Pack<S, VEC> out;  // the host build (tests): no aliasing through a cast
  std::memcpy(&out, p, sizeof(out));
  return out;
#endif
}

template <class S, int VEC>
__device__ __forceinline__ void store_pack(S* p, const Pack<S, VEC>& v) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<Pack<S, VEC>*>(p) = v;
#else
  std::memcpy(p, &v, sizeof(v));
#endif
}

// The contract's fold of the 16 lane sums, of which this thread holds s[0 .. VEC-1] (lanes
// q·VEC ...): returns s[0] of the fold in every thread of the row group.
template <int VEC>
__device__ __forceinline__ float fold_lanes(float (&s)[VEC]) {
#pragma unroll
  for (int w = kLanes / 2; w >= VEC; w >>= 1) {
#pragma unroll
    for (int v = 0; v < VEC; ++v) s[v] = add_rn(s[v], __shfl_xor_sync(0xFFFFFFFFu, s[v], w / VEC));
  }
#pragma unroll
  for (int w = VEC / 2; w >= 1; w >>= 1) {
#pragma unroll
    for (int v = 0; v < w; ++v) s[v] = add_rn(s[v], s[v + w]);
  }
  return s[0];
}

template <class T, class W, int VEC>
__device__ __forceinline__ void rms_norm_rows(
    const typename T::storage* __restrict__ x, i64 sx, const typename T::storage* __restrict__ r,
    i64 sr, const typename W::storage* __restrict__ w, typename T::storage* out, i64 so,
    typename T::storage* hout, i64 sh, i64 rows, i64 hidden, float eps) {
  typedef typename T::storage S;
  typedef Pack<S, VEC> P;
  constexpr int kGroup = kLanes / VEC;  // threads per row
  const i64 row = i64(blockIdx.x) * (blockDim.x / kGroup) + threadIdx.x / kGroup;
  const int first = int(threadIdx.x % kGroup) * VEC;  // this thread's first lane
  const bool live = row < rows;
  float s[VEC];
#pragma unroll
  for (int v = 0; v < VEC; ++v) s[v] = 0.0f;
  if (live) {
    const S* xr = x + row * sx;
    if (r != nullptr) {
      const S* rr = r + row * sr;
      S* hr = hout + row * sh;
#pragma unroll 4
      for (i64 j = first; j < hidden; j += kLanes) {
        const P xv = load_pack<S, VEC>(xr + j), rv = load_pack<S, VEC>(rr + j);
        P hv;
#pragma unroll
        for (int v = 0; v < VEC; ++v) {
          hv.v[v] = residual_sum<T>(xv.v[v], rv.v[v]);
          s[v] = square_step(s[v], T::load(hv.v[v]));
        }
        store_pack<S, VEC>(hr + j, hv);
      }
    } else {
#pragma unroll 4
      for (i64 j = first; j < hidden; j += kLanes) {
        const P xv = load_pack<S, VEC>(xr + j);
#pragma unroll
        for (int v = 0; v < VEC; ++v) s[v] = square_step(s[v], T::load(xv.v[v]));
      }
    }
  }
  // Every thread of the warp takes part in the shuffles (dead rows fold zeros among themselves).
  const float total = fold_lanes<VEC>(s);
  if (!live) return;
  const float rstd = rstd_of(total, hidden, eps);
  const S* src = r != nullptr ? hout + row * sh : x + row * sx;
  S* yr = out + row * so;
#pragma unroll 4
  for (i64 j = first; j < hidden; j += kLanes) {
    const P hv = load_pack<S, VEC>(src + j);
    const Pack<typename W::storage, VEC> wv = load_pack<typename W::storage, VEC>(w + j);
    P yv;
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      yv.v[v] = T::store(scale(T::load(hv.v[v]), rstd, W::load(wv.v[v])));
    }
    store_pack<S, VEC>(yr + j, yv);
  }
}

// A row per block of kRowThreads threads, for decode-sized batches where the instances above
// leave the GPU nearly idle (2 to 16 threads per row, each walking the whole row with
// dependent loads). The block loads the row (and adds the residual) into shared memory with
// every thread, coalesced; then threads 0-15 each sum their contract lane from shared memory
// in ascending order, warp 0 folds the 16 lane sums with the same xor butterfly as VEC = 1
// (the partners of lanes 16-31 hold zeros among themselves), and every thread scales and
// stores. Same lane sums, same fold, same scale: the contract's bits (hidden <= kRowMaxHidden).
constexpr int kRowThreads = 128;
constexpr int kRowMaxHidden = 8192;  // fp32: 32 KB of static shared memory

template <class T, class W>
__device__ __forceinline__ void rms_norm_row_block(
    const typename T::storage* __restrict__ x, i64 sx, const typename T::storage* __restrict__ r,
    i64 sr, const typename W::storage* __restrict__ w, typename T::storage* out, i64 so,
    typename T::storage* hout, i64 sh, i64 rows, i64 hidden, float eps) {
  typedef typename T::storage S;
  __shared__ S hs[kRowMaxHidden];
  __shared__ float rstd_s;
  const i64 row = blockIdx.x;
  const int tid = threadIdx.x;
  if (row >= rows) return;  // the whole block leaves together
  const S* xr = x + row * sx;
  for (i64 j = tid; j < hidden; j += kRowThreads) {
    if (r != nullptr) {
      hs[j] = residual_sum<T>(xr[j], r[row * sr + j]);
      hout[row * sh + j] = hs[j];
    } else {
      hs[j] = xr[j];
    }
  }
  __syncthreads();
  if (tid < 32) {
    float s[1] = {0.0f};
    if (tid < kLanes) {
      for (i64 j = tid; j < hidden; j += kLanes) s[0] = square_step(s[0], T::load(hs[j]));
    }
    const float total = fold_lanes<1>(s);
    if (tid == 0) rstd_s = rstd_of(total, hidden, eps);
  }
  __syncthreads();
  const float rstd = rstd_s;
  S* yr = out + row * so;
  for (i64 j = tid; j < hidden; j += kRowThreads) {
    yr[j] = T::store(scale(T::load(hs[j]), rstd, W::load(w[j])));
  }
}

}  // namespace rms
}  // namespace bik

// bik_rms_norm_row_<x dtype>_<weight dtype>: a row per block of 128 threads (the same
// parameters; hidden <= 8192; grid = rows).
#define BIK_RMS_NORM_ROW_KERNEL(NAME, XT, WT)                                                  \
  extern "C" __global__ void __launch_bounds__(bik::rms::kRowThreads)                          \
      NAME(const XT::storage* x, bik::i64 sx, const XT::storage* r, bik::i64 sr,                \
           const WT::storage* w, XT::storage* out, bik::i64 so, XT::storage* h, bik::i64 sh,    \
           bik::i64 rows, bik::i64 hidden, float eps) {                                         \
    bik::rms::rms_norm_row_block<XT, WT>(x, sx, r, sr, w, out, so, h, sh, rows, hidden, eps);  \
  }

// bik_rms_norm_<x dtype>_<weight dtype> (VEC = 1) and bik_rms_norm_vec_<x dtype>_<weight dtype>
// (VEC = 16 bytes / x's element size) (x, stride_x, residual or null, stride_r, weight, out,
// stride_out, h_out (null without residual), stride_h, rows, hidden, eps). Strides in elements;
// rows have unit stride along the hidden dim. Block: a multiple of 32 threads, 16 / VEC per row
// (python/bik/ops/rms_norm/cuda.py). The vector instance needs hidden, the strides and the
// pointers aligned to VEC elements (the weight to VEC of its own elements).
#define BIK_RMS_NORM_KERNEL(NAME, VEC, XT, WT)                                                  \
  extern "C" __global__ void __launch_bounds__(128)                                             \
      NAME(const XT::storage* x, bik::i64 sx, const XT::storage* r, bik::i64 sr,                \
           const WT::storage* w, XT::storage* out, bik::i64 so, XT::storage* h, bik::i64 sh,    \
           bik::i64 rows, bik::i64 hidden, float eps) {                                         \
    bik::rms::rms_norm_rows<XT, WT, VEC>(x, sx, r, sr, w, out, so, h, sh, rows, hidden, eps);  \
  }

#define BIK_RMS_NORM_PAIR(XN, XT, WN, WT)                                                  \
  BIK_RMS_NORM_KERNEL(bik_rms_norm_##XN##_##WN, 1, XT, WT)                                 \
  BIK_RMS_NORM_KERNEL(bik_rms_norm_vec_##XN##_##WN, int(16 / sizeof(XT::storage)), XT, WT) \
  BIK_RMS_NORM_ROW_KERNEL(bik_rms_norm_row_##XN##_##WN, XT, WT)

#define BIK_RMS_NORM_FOR_X(XN, XT)            \
  BIK_RMS_NORM_PAIR(XN, XT, f32, bik::F32)    \
  BIK_RMS_NORM_PAIR(XN, XT, bf16, bik::BF16)  \
  BIK_RMS_NORM_PAIR(XN, XT, f16, bik::F16)

BIK_RMS_NORM_FOR_X(f32, bik::F32)
BIK_RMS_NORM_FOR_X(bf16, bik::BF16)
BIK_RMS_NORM_FOR_X(f16, bik::F16)
