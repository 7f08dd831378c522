// bik's Gumbel-max sampler on CUDA: the same specification as csrc/cpu/sampling.h and the
// Triton kernels (docs/design.md#sampler), in the Triton backend's three steps:
//
// * bik_sample_stats_<t> (one 512-thread block per row): row max m over the top-k-kept tokens
//   (exact), the invalid flag, top-p's threshold by 32 bisection steps on the fp32 order key
//   (lane l of 512 sums exp(z - m) of tokens l, l + 512, ... in order, then a fixed block
//   tree), min-p's threshold m + log_min_p (one rounded add), and log of the kept mass for the
//   logprob. expf/logf: exact within this backend, close to the others.
// * bik_gumbel_pick_<t> (blocks of rows x vocabulary splits): z = x / T (correctly rounded), the
//   keep mask from exact thresholds, score z + g with g from sampling.cuh (bit-identical to the
//   CPU noise), and the split's winner under (value desc, index asc). Only exactly rounded ops:
//   with top-p off the token equals the CPU path's and Triton's.
// * the ops layer merges the splits' winners in torch (a total order: any merge is the same).
#include "sampling.cuh"

namespace bik {
namespace sampling {

// Lane 0 ends with the warp's max (max is exact: any tree gives the same value).
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int w = 16; w >= 1; w >>= 1) v = fmaxf(v, __shfl_down_sync(kFullMask, v, w));
  return v;
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const float t = warp_max(lane < warps ? scratch[lane] : -inf_f32());
    if (lane == 0) scratch[0] = t;
  }
  __syncthreads();
  return scratch[0];
}

template <class T>
__device__ __forceinline__ float z_at(const typename T::storage* xr, i64 j, float temperature) {
  return tempered(T::load(xr[j]), temperature);
}

// Sum over the top-k-kept tokens with z >= threshold of exp(z - m): fixed lanes, fixed tree.
template <class T>
__device__ float kept_mass(const typename T::storage* xr, i64 V, float temperature, float vk,
                           i64 ik, float threshold, float m, float* scratch) {
  float acc = 0.0f;
  for (i64 j = threadIdx.x; j < V; j += blockDim.x) {
    const float z = z_at<T>(xr, j, temperature);
    if (kept_k(z, j, vk, ik) && z >= threshold) acc = add_rn(acc, expf(sub_rn(z, m)));
  }
  return block_sum_fixed(acc, scratch);
}

template <class T>
__device__ void sample_stats(const typename T::storage* x, i64 sx, i64 V,
                             const float* temperature, const float* vk_in, const i32* ik_in,
                             const float* top_p_in, const float* log_min_p_in, float* m_out,
                             float* vlo_out, float* logs_out, i32* bad_out) {
  __shared__ float scratch[32];
  const i64 row = blockIdx.x;
  const typename T::storage* xr = x + row * sx;
  const float temp = temperature[row], vk = vk_in[row], top_p = top_p_in[row];
  const i64 ik = ik_in[row];
  float mx = -inf_f32();
  bool bad = false;
  for (i64 j = threadIdx.x; j < V; j += blockDim.x) {
    stats_consider(z_at<T>(xr, j, temp), j, vk, ik, mx, bad);
  }
  const float m = block_max(mx, scratch);
  const bool is_bad = block_max(bad ? 1.0f : 0.0f, scratch) > 0.0f || m == -inf_f32();
  const float m_safe = is_bad ? 0.0f : m;

  float v_lo = -inf_f32();
  if (top_p < 1.0f) {
    const float target =
        mul_rn(top_p, kept_mass<T>(xr, V, temp, vk, ik, -inf_f32(), m_safe, scratch));
    i64 lo = order_key(-inf_f32()), hi = order_key(m_safe) + 1;
    for (int it = 0; it < 32; ++it) {
      const i64 mid = (lo + hi) >> 1;
      const bool ok =
          kept_mass<T>(xr, V, temp, vk, ik, from_order_key(mid), m_safe, scratch) >= target;
      lo = ok ? mid : lo;
      hi = ok ? hi : mid;
    }
    v_lo = from_order_key(lo);
  }
  const float v_m = add_rn(m_safe, log_min_p_in[row]);
  v_lo = v_m > v_lo ? v_m : v_lo;
  const float norm = kept_mass<T>(xr, V, temp, vk, ik, v_lo, m_safe, scratch);
  if (threadIdx.x == 0) {
    m_out[row] = m_safe;
    vlo_out[row] = v_lo;
    logs_out[row] = logf(is_bad ? 1.0f : norm);
    bad_out[row] = is_bad ? 1 : 0;
  }
}

constexpr i32 kNoIndex = 0x7FFFFFFF;

// Lane 0 ends with the warp's best (value desc, index asc): a total order, so the tree shape is
// free.
__device__ __forceinline__ void warp_best(float& best_v, i32& best_i) {
#pragma unroll
  for (int w = 16; w >= 1; w >>= 1) {
    const float ov = __shfl_down_sync(kFullMask, best_v, w);
    const i32 oi = __shfl_down_sync(kFullMask, best_i, w);
    if (better(ov, oi, best_v, best_i)) {
      best_v = ov;
      best_i = oi;
    }
  }
}

template <class T>
__device__ void gumbel_pick(const typename T::storage* x, i64 sx, i64 V, const i64* key,
                            const float* temperature, const float* vk_in, const i32* ik_in,
                            const float* vlo_in, const float* m_in, float* part_val,
                            i32* part_idx, i32 n_splits, i32 split_size) {
  __shared__ float s_val[32];
  __shared__ i32 s_idx[32];
  const i64 row = blockIdx.x;
  const i32 split = blockIdx.y;
  const typename T::storage* xr = x + row * sx;
  const i64* k = key + row * 5;
  PickRow p;
  p.temperature = temperature[row];
  p.vk = vk_in[row];
  p.v_lo = vlo_in[row];
  p.floor = add_rn(m_in[row], kGumbelMin);  // the max token's lowest possible score
  p.ik = ik_in[row];
  p.seed = u64(k[0]) | (u64(k[1]) << 32);
  p.position = u64(k[2]) | (u64(k[3]) << 32);
  p.stream = u32(k[4]);
  const i64 begin = i64(split) * split_size;
  const i64 end = begin + split_size < V ? begin + split_size : V;
  float best_v = -inf_f32();
  i32 best_i = kNoIndex;
  for (i64 j = begin + threadIdx.x; j < end; j += blockDim.x) {
    pick_consider(p, T::load(xr[j]), j, best_v, best_i);
  }
  // Block argmax under (value desc, index asc): warps, then warp 0 over the warps' winners.
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  warp_best(best_v, best_i);
  if (lane == 0) {
    s_val[warp] = best_v;
    s_idx[warp] = best_i;
  }
  __syncthreads();
  if (warp == 0) {
    best_v = lane < warps ? s_val[lane] : -inf_f32();
    best_i = lane < warps ? s_idx[lane] : kNoIndex;
    warp_best(best_v, best_i);
    if (lane == 0) {
      part_val[row * n_splits + split] = best_v;
      part_idx[row * n_splits + split] = best_i;
    }
  }
}

}  // namespace sampling
}  // namespace bik

// bik_sample_stats_<t>(x, stride_x, V, temperature, vk, ik, top_p, log_min_p, m_out, v_lo_out,
//                      log_s_out, bad_out): grid (rows), block 512.
// bik_gumbel_pick_<t>(x, stride_x, V, key [rows, 5] int64, temperature, vk, ik, v_lo, m,
//                     part_val [rows, n_splits], part_idx, n_splits, split_size):
//                     grid (rows, n_splits), block 512.
#define BIK_SAMPLING_KERNELS(TN, TT)                                                            \
  extern "C" __global__ void __launch_bounds__(512) bik_sample_stats_##TN(                     \
      const TT::storage* x, bik::i64 sx, bik::i64 V, const float* temperature, const float* vk, \
      const bik::i32* ik, const float* top_p, const float* log_min_p, float* m_out,            \
      float* vlo_out, float* logs_out, bik::i32* bad_out) {                                     \
    bik::sampling::sample_stats<TT>(x, sx, V, temperature, vk, ik, top_p, log_min_p, m_out,    \
                                    vlo_out, logs_out, bad_out);                               \
  }                                                                                             \
  extern "C" __global__ void __launch_bounds__(512) bik_gumbel_pick_##TN(                      \
      const TT::storage* x, bik::i64 sx, bik::i64 V, const bik::i64* key,                       \
      const float* temperature, const float* vk, const bik::i32* ik, const float* vlo,         \
      const float* m, float* part_val, bik::i32* part_idx, bik::i32 n_splits,                  \
      bik::i32 split_size) {                                                                    \
    bik::sampling::gumbel_pick<TT>(x, sx, V, key, temperature, vk, ik, vlo, m, part_val,       \
                                   part_idx, n_splits, split_size);                            \
  }

BIK_SAMPLING_KERNELS(f32, bik::F32)
BIK_SAMPLING_KERNELS(bf16, bik::BF16)
BIK_SAMPLING_KERNELS(f16, bik::F16)
