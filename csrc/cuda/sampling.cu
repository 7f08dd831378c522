// bik's Gumbel-max sampler on CUDA: the same specification as csrc/cpu/sampling.h and the
// Triton kernels (docs/design.md#sampler), in the Triton backend's three steps:
//
// * bik_sample_group_max_<t> (a 512-thread block per (row, normaliser group)): each group's max
//   over the top-k-kept tokens (exact) and invalid flag; the row's m is the max of its groups'.
// * bik_sample_pass_<t> (a block per (row, group), one launch per pass of top-p's probe search,
//   sampling.cuh cut_step: a few passes of 16 exact masses each, not 32 bisection passes): each
//   block sums its group; the row's last block folds the group totals, steps the search and
//   writes min-p's threshold m + log_min_p (one rounded add), the cut and bik_log of the kept
//   mass for the logprob. Rows without top-p take pass 0 only: the mass at min-p's bound. Every
//   mass is the normaliser's sum (bik_exp(z - m) over vocabulary chunks of 1024, a chunk per
//   warp in the contract's pairwise fold, chunk sums then group totals ascending): exactly
//   rounded ops only, so the CPU path's bits.
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

constexpr int kMaxChunks = 2048;  // normaliser chunks per group (the launcher checks)

// The normaliser's sum over the top-k-kept tokens with z >= threshold of bik_exp(z - m) in groups
// [g_lo, g_hi) of group_len tokens: warp w takes chunks w, w + warps, ... (sampling.cuh: lane l
// holds tokens l + 32 i); thread g adds group g_lo + g's chunk sums in ascending order; thread 0
// adds the group totals in ascending order. Every thread of the block calls it and gets the
// total.
template <class T>
__device__ float vocab_mass(const typename T::storage* xr, i64 g_lo, i64 g_hi, i64 group_len,
                            float temperature, float vk, i64 ik, float threshold, float m,
                            float* sums, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const i64 per_group = cdiv(group_len, kSamplerChunk), groups = g_hi - g_lo;
  __syncthreads();  // sums and scratch may still be read by the previous call
  for (i64 q = warp; q < groups * per_group; q += warps) {
    const i64 g = g_lo + q / per_group, g_end = (g + 1) * group_len;
    const i64 c0 = g * group_len + (q % per_group) * kSamplerChunk;
    // The fold's first step (registers i and i + 16) is taken as the second half arrives, so
    // only half the chunk is live at once: the same pairs in the same order.
    float s[kChunkRegs];
    auto term = [=](int i) {
      const i64 j = c0 + lane + 32 * i;
      return j < g_end ? normaliser_term(z_at<T>(xr, j, temperature), j, vk, ik, threshold, m)
                       : 0.0f;
    };
#pragma unroll
    for (int i = 0; i < kChunkRegs / 2; ++i) s[i] = term(i);
#pragma unroll
    for (int i = 0; i < kChunkRegs / 2; ++i) s[i] = add_rn(s[i], term(i + kChunkRegs / 2));
    float c = fold_registers_after_first_step(s);
#pragma unroll
    for (int w = 16; w >= 1; w >>= 1) c = add_rn(c, __shfl_xor_sync(kFullMask, c, w));
    if (lane == 0) sums[q] = c;
  }
  __syncthreads();
  if (threadIdx.x < groups) {
    float t = 0.0f;
    for (i64 c = 0; c < per_group; ++c) t = add_rn(t, sums[threadIdx.x * per_group + c]);
    scratch[threadIdx.x] = t;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float t = 0.0f;
    for (i64 g = 0; g < groups; ++g) t = add_rn(t, scratch[g]);
    scratch[31] = t;
  }
  __syncthreads();
  return scratch[31];
}

constexpr int kMaxGroups = 32;  // normaliser groups per row (the launcher checks 31)
constexpr int kProbeRound = 128;  // chunks whose probe sums are held in shared memory at once

// Shared state of the top-p probe passes (11.8 KB).
struct ProbeShared {
  float chunk_sums[kProbeRound * kProbeLanes];
  float group_totals[kMaxGroups * kProbeLanes];
  float masses[kProbeLanes];
  float cand[kTopPCandidates];
  int count;
};
// A row without top-p sums its group with chunk_sums as vocab_mass's buffer.
static_assert(kProbeRound * kProbeLanes >= kMaxChunks, "chunk_sums holds a group's chunk sums");

// One probe pass over groups [g_lo, g_hi). Their chunks go by rounds of kProbeRound: in a round,
// warp w takes chunks w, w + warps, ... in the normaliser's layout (sampling.cuh: lane l holds
// tokens l + 32 i) and writes each probe's chunk sum; then thread g * kProbeLanes + k adds
// group g's chunk sums of the round for probe k to its running group total, in ascending
// order. A probe above the chunk's largest kept z gets +0 without a fold (and a chunk below
// every probe without an exp): the same sums (a dropped token's z is -inf, its term +0).
// Thread k < kProbeLanes adds the group totals in ascending order. The bracket's kept finite
// tokens are counted and the first kTopPCandidates stored (in whatever order the atomics give:
// the search needs the set only).
template <class T>
__device__ i64 probe_masses(const typename T::storage* xr, i64 g_lo, i64 g_hi, i64 group_len,
                            float temperature, float vk, i64 ik, float m,
                            const float (&probes)[kProbeLanes], float lo_v, float hi_v,
                            bool collect, float (&masses)[kProbeLanes], ProbeShared& sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const i64 per_group = cdiv(group_len, kSamplerChunk), groups = g_hi - g_lo;
  const i64 chunks = groups * per_group;
  const i64 slot = threadIdx.x, slot_g = slot / kProbeLanes;
  float lowest = probes[0];
#pragma unroll
  for (int k = 1; k < kProbeLanes; ++k) lowest = probes[k] < lowest ? probes[k] : lowest;
  __syncthreads();  // the previous pass's candidates and masses are read
  if (threadIdx.x == 0) sh.count = 0;
  if (slot_g < groups) sh.group_totals[slot] = 0.0f;
  for (i64 r0 = 0; r0 < chunks; r0 += kProbeRound) {
    const i64 r_end = r0 + kProbeRound < chunks ? r0 + kProbeRound : chunks;
    for (i64 q = r0 + warp; q < r_end; q += warps) {
      const i64 g = g_lo + q / per_group, g_end = (g + 1) * group_len;
      const i64 c0 = g * group_len + (q % per_group) * kSamplerChunk;
      float z[kChunkRegs], s[kChunkRegs];
      float z_hi = -inf_f32();
#pragma unroll
      for (int i = 0; i < kChunkRegs; ++i) {
        const i64 j = c0 + lane + 32 * i;
        const float zj = j < g_end ? z_at<T>(xr, j, temperature) : -inf_f32();
        const bool kept = j < g_end && kept_k(zj, j, vk, ik);
        z[i] = kept ? zj : -inf_f32();
        if (kept && zj > z_hi) z_hi = zj;
        if (collect && kept && zj > -inf_f32() && zj >= lo_v && zj < hi_v) {
          const int at = atomicAdd(&sh.count, 1);
          if (at < kTopPCandidates) sh.cand[at] = zj;
        }
      }
#pragma unroll
      for (int w = 16; w >= 1; w >>= 1) z_hi = fmaxf(z_hi, __shfl_xor_sync(kFullMask, z_hi, w));
      float* out = sh.chunk_sums + (q - r0) * kProbeLanes;
      if (lowest > z_hi) {  // below every probe (most chunks once the bracket nears m): +0s
        if (lane < kProbeLanes) out[lane] = 0.0f;
        continue;  // warp-uniform, as every branch below
      }
      float e[kChunkRegs];  // a dropped token's z is -inf: its term is +0
#pragma unroll
      for (int i = 0; i < kChunkRegs; ++i) e[i] = bik_exp(sub_rn(z[i], m));
#pragma unroll
      for (int k = 0; k < kProbeLanes; ++k) {
        const float t = probes[k];
        float sum = 0.0f;
        if (!(t > z_hi)) {
#pragma unroll
          for (int i = 0; i < kChunkRegs; ++i) s[i] = z[i] >= t ? e[i] : 0.0f;
          sum = fold_registers(s);
#pragma unroll
          for (int w = 16; w >= 1; w >>= 1) sum = add_rn(sum, __shfl_xor_sync(kFullMask, sum, w));
        }
        if (lane == k) out[k] = sum;
      }
    }
    __syncthreads();
    if (slot_g < groups) {
      const i64 first = slot_g * per_group > r0 ? slot_g * per_group : r0;
      const i64 last = (slot_g + 1) * per_group < r_end ? (slot_g + 1) * per_group : r_end;
      const int k = int(slot % kProbeLanes);
      float t = sh.group_totals[slot];
      for (i64 q = first; q < last; ++q) t = add_rn(t, sh.chunk_sums[(q - r0) * kProbeLanes + k]);
      sh.group_totals[slot] = t;
    }
    __syncthreads();
  }
  if (threadIdx.x < kProbeLanes) {
    float t = 0.0f;
    for (i64 g = 0; g < groups; ++g) t = add_rn(t, sh.group_totals[g * kProbeLanes + threadIdx.x]);
    sh.masses[threadIdx.x] = t;
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < kProbeLanes; ++k) masses[k] = sh.masses[k];
  return sh.count;
}

// Group g's max over the top-k-kept tokens and its invalid flag (NaN or +inf in z): grid
// (rows, G). A max is exact in any order, so the row's m is the max of its groups'.
template <class T>
__device__ void group_max(const typename T::storage* x, i64 sx, i64 group_len,
                          const float* temperature, const float* vk, const i32* ik, float* gmax,
                          i32* gbad) {
  __shared__ float scratch[32];
  const i64 row = blockIdx.x, g = blockIdx.y, at = row * gridDim.y + g;
  const typename T::storage* xr = x + row * sx;
  float mx = -inf_f32();
  bool bad = false;
  for (i64 j = g * group_len + threadIdx.x; j < (g + 1) * group_len; j += blockDim.x)
    stats_consider(z_at<T>(xr, j, temperature[row]), j, vk[row], ik[row], mx, bad);
  const float m = block_max(mx, scratch);
  const float any_bad = block_max(bad ? 1.0f : 0.0f, scratch);
  if (threadIdx.x == 0) {
    gmax[at] = m;
    gbad[at] = any_bad > 0.0f ? 1 : 0;
  }
}

// A row's results: its max, cut, log of the kept mass (norm >= 1: the max token's term is 1)
// and invalid flag.
__device__ void write_row_stats(i64 row, float m_safe, float v_lo, float norm, bool is_bad,
                                float* m_out, float* vlo_out, float* logs_out, i32* bad_out) {
  m_out[row] = m_safe;
  vlo_out[row] = v_lo;
  logs_out[row] = bik_log(is_bad ? 1.0f : norm);
  bad_out[row] = is_bad ? 1 : 0;
}

// Pass `it` of the row statistics, one block per (row, normaliser group g), grid (rows, G).
// Each block sums its group in the contract's order: a row without top-p (pass 0 only) its mass
// at min-p's bound; a top-p row the masses at the search's kProbeLanes probes, collecting its
// group's bracket tokens (sampling.cuh cut_step). Then a ticket per row (atomicAdd after
// __threadfence); the row's last block of the pass folds the G group masses in ascending order
// from +0 -- the contract's fold of group totals, so the single-block sums -- steps the search
// (state kept in global memory between launches; the scan of the G x 256 buffered candidates
// spread over its threads, not one) and writes the row's results. A settled row
// returns at once, so kTopPPasses launches serve every row without a host sync.
template <class T>
__device__ void sample_pass(const typename T::storage* x, i64 sx, i64 group_len, int it,
                            const float* temperature, const float* vk_in, const i32* ik_in,
                            const float* top_p_in, const float* log_min_p_in, const float* gmax,
                            const i32* gbad, CutState* state, float* gmass, float* cand,
                            i64* counts, i32* tickets, float* m_out, float* vlo_out,
                            float* logs_out, i32* bad_out) {
  __shared__ float scratch[32];
  __shared__ ProbeShared sh;
  __shared__ int last;
  const i64 row = blockIdx.x, g = blockIdx.y, groups = gridDim.y, at = row * groups + g;
  const float top_p = top_p_in[row];
  const bool plain = !(top_p < 1.0f);
  if (plain && it > 0) return;
  float m = -inf_f32();
  bool bad = false;
  for (i64 k = 0; k < groups; ++k) {
    m = fmaxf(m, gmax[row * groups + k]);
    bad = bad || gbad[row * groups + k] != 0;
  }
  const bool is_bad = bad || m == -inf_f32();
  const float m_safe = is_bad ? 0.0f : m;
  const float v_m = add_rn(m_safe, log_min_p_in[row]);
  CutState st;
  if (!plain) {
    if (it == 0)
      cut_start(st, m_safe, v_m);
    else
      st = state[row];
    if (!cut_open(st)) return;
  }
  const typename T::storage* xr = x + row * sx;
  const float temp = temperature[row], vk = vk_in[row];
  const i64 ik = ik_in[row];
  const bool collect = !plain && cut_collects(it, group_len);
  float masses[kProbeLanes];
  i64 n = 0;
  if (plain) {  // the chunk sums go to the probe round's buffer (kMaxChunks floats)
    masses[0] = vocab_mass<T>(xr, g, g + 1, group_len, temp, vk, ik, v_m, m_safe,
                              sh.chunk_sums, scratch);
  } else {
    n = probe_masses<T>(xr, g, g + 1, group_len, temp, vk, ik, m_safe, st.probes,
                        from_order_key(st.lo), from_order_key(st.hi), collect, masses, sh);
  }
  if (threadIdx.x == 0) {
    for (int k = 0; k < kProbeLanes; ++k) gmass[at * kProbeLanes + k] = plain && k ? 0.0f : masses[k];
    counts[at] = n;
  }
  const i64 stored = n < kTopPCandidates ? n : kTopPCandidates;
  for (i64 i = threadIdx.x; i < stored; i += blockDim.x) cand[at * kTopPCandidates + i] = sh.cand[i];
  __threadfence();  // this block's masses and candidates, before its ticket
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(&tickets[row], 1) == (it + 1) * int(groups) - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  __shared__ CutState decided;
  if (threadIdx.x == 0) {
    float total[kProbeLanes];
    for (int k = 0; k < kProbeLanes; ++k) total[k] = 0.0f;
    for (i64 q = 0; q < groups; ++q)  // group totals in ascending order from +0
      for (int k = 0; k < kProbeLanes; ++k)
        total[k] = add_rn(total[k], __ldcg(gmass + (row * groups + q) * kProbeLanes + k));
    if (plain) {
      write_row_stats(row, m_safe, v_m, total[0], is_bad, m_out, vlo_out, logs_out, bad_out);
    } else {
      cut_narrow(st, it, top_p, total);
      decided = st;
    }
  }
  if (plain) return;  // the whole block: plain is the row's
  __syncthreads();
  // The candidate scan over every buffer of the row, spread over the block (a thread per
  // slot); cut_next turns its result into the next probes (sampling.cuh).
  __shared__ int inside, held;
  __shared__ float picked[kProbeLanes];
  if (threadIdx.x == 0) inside = 0, held = 1;
  __syncthreads();
  const float lo_v = from_order_key(decided.lo), hi_v = from_order_key(decided.hi);
  const float* row_cand = cand + row * groups * kTopPCandidates;
  for (i64 i = threadIdx.x; i < groups * kTopPCandidates; i += blockDim.x) {
    const i64 count = read_cg(counts + row * groups + i / kTopPCandidates);
    if (i % kTopPCandidates == 0 && count > kTopPCandidates) held = 0;  // every writer: 0
    if (i % kTopPCandidates >= count) continue;
    const float c = read_cg(row_cand + i);
    if (!(c >= lo_v && c < hi_v)) continue;
    const int at = atomicAdd(&inside, 1);
    if (at < kProbeLanes) picked[at] = c;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  st = decided;
  cut_next(st, collect, held != 0, inside, picked);
  state[row] = st;
  float v_lo, norm;
  cut_result(st, v_m, v_lo, norm);
  write_row_stats(row, m_safe, v_lo, norm, is_bad, m_out, vlo_out, logs_out, bad_out);
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

// bik_sample_group_max_<t>(x, stride_x, group_len, temperature, vk, ik, gmax [rows, G] fp32,
//                          gbad [rows, G] int32): grid (rows, G), block 512; group_len = V / G
//                          (bik.configs.sampler_chunks), at most kMaxChunks chunks a group.
// bik_sample_pass_<t>(x, stride_x, group_len, it, temperature, vk, ik, top_p, log_min_p, gmax,
//                     gbad, state [rows, kCutStateBytes], gmass [rows, G, kProbeLanes] fp32,
//                     cand [rows, G, kTopPCandidates] fp32, counts [rows, G] int64 (zeroed),
//                     tickets [rows] int32 (zeroed), m_out, v_lo_out, log_s_out, bad_out):
//                     grid (rows, G), block 512, launched for it = 0 .. kTopPPasses - 1.
// bik_gumbel_pick_<t>(x, stride_x, V, key [rows, 5] int64, temperature, vk, ik, v_lo, m,
//                     part_val [rows, n_splits], part_idx, n_splits, split_size):
//                     grid (rows, n_splits), block 512.
#define BIK_SAMPLING_KERNELS(TN, TT)                                                            \
  extern "C" __global__ void __launch_bounds__(512) bik_sample_group_max_##TN(                 \
      const TT::storage* x, bik::i64 sx, bik::i64 group_len, const float* temperature,         \
      const float* vk, const bik::i32* ik, float* gmax, bik::i32* gbad) {                       \
    bik::sampling::group_max<TT>(x, sx, group_len, temperature, vk, ik, gmax, gbad);           \
  }                                                                                             \
  extern "C" __global__ void __launch_bounds__(512) bik_sample_pass_##TN(                      \
      const TT::storage* x, bik::i64 sx, bik::i64 group_len, int it, const float* temperature, \
      const float* vk, const bik::i32* ik, const float* top_p, const float* log_min_p,         \
      const float* gmax, const bik::i32* gbad, void* state, float* gmass, float* cand,         \
      bik::i64* counts, bik::i32* tickets, float* m_out, float* vlo_out, float* logs_out,      \
      bik::i32* bad_out) {                                                                      \
    bik::sampling::sample_pass<TT>(x, sx, group_len, it, temperature, vk, ik, top_p,           \
                                   log_min_p, gmax, gbad,                                      \
                                   static_cast<bik::sampling::CutState*>(state), gmass, cand,  \
                                   counts, tickets, m_out, vlo_out, logs_out, bad_out);        \
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
