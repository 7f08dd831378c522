// bik CUDA attention over a paged or contiguous KV cache: prefill, chunked prefill, decode and
// verify windows in one kernel, with the contract of attention_plan.cuh (the Triton kernel's:
// fixed SPLIT and BLOCK_N aligned to absolute key positions, a fresh state per split, one fold
// over splits in ascending order, exp2-based softmax, no contraction, natural-log lse).
//
// SIMT fp32 arithmetic (no tensor cores): every score is a d-ascending fp32 dot and every p.v
// sum is key-ascending, each op rounded, so a row's bits depend only on its own limit and the
// absolute positions -- never on its place in the tile, on BLOCK_T, on the GQA packing or on
// which other rows share the program. Rows of a program: `gh` query heads sharing one KV head x
// `block_t` tokens (gh * block_t <= 16), so decode and verify rows share each K/V block load.
//
// Two launch modes with the same bits: FOLD (fold = 1: a program folds every split of its
// tile) and SPLIT (fold = 0: grid z takes runs of consecutive splits, a tile's real splits
// spread over the launched runs, each split reduced alone and its fp32 partial written to
// pml/pacc; then the tile's last program to
// take a ticket folds every partial in ascending order with FOLD's merge_scales / fold2 /
// finalize: one launch, FOLD's bits).
#include "attention_plan.cuh"
#include "bik_convert.cuh"

using bik_attn::i64;

namespace {

constexpr int kBlockN = 32;  // keys per block = lanes of a warp (one key per lane)
constexpr int kRows = 16;    // query rows per program
constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = bik_attn::f_max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Butterfly sum: at each level lane i adds lane i^o; x + y == y + x, so all lanes end with the
// same bits, and the tree is the same for every row.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = bik_attn::add_rn(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

template <int KIND, int D>
__device__ __forceinline__ void attention_body(
    const void* q, const void* kc, const void* vc, void* out, float* lse, float* pacc,
    float* pml, int* tickets, const int* cu_q, const int* seqlens, const int* table,
    const i64* base, i64 sqt, i64 sqh, i64 sot, i64 soh, i64 stable, i64 spage, i64 stok,
    i64 skvh, int block_size, int total_q, int hq, int hkv, int gh, int block_t,
    float scale_log2e, int split, int causal, int fold, int q_bound, int k_bound) {
  constexpr int kPer = kRows * D / kThreads;  // (row, d) accumulators per thread
  __shared__ float qs[kRows][D];
  __shared__ float ks[kBlockN][D + 1];  // +1: lanes read different keys at the same d
  __shared__ float vs[kBlockN][D];
  __shared__ float ps[kRows][kBlockN];
  __shared__ i64 koff[kBlockN];
  __shared__ i64 lim_s[kRows];  // a row's last visible key; -1 for an unused row or no key
  __shared__ bool ok_s[kRows];  // the row is a query of this tile (written even without keys)
  __shared__ i64 qrow_s[kRows];
  __shared__ int head_s[kRows];
  __shared__ float m_run[kRows], l_run[kRows], m_cur[kRows], l_cur[kRows], alpha_s[kRows];

  const int tid = threadIdx.x;
  const int g = hq / hkv;
  const int slices = (g + gh - 1) / gh;
  const int b = blockIdx.x / (hkv * slices);
  const int hk = (blockIdx.x % (hkv * slices)) / slices;
  const int slice = blockIdx.x % slices;
  const int tile = blockIdx.y;
  const i64 q_start = cu_q[b];
  const i64 q_len = cu_q[b + 1] - q_start;
  if (static_cast<i64>(tile) * block_t >= q_len) return;
  const i64 seqlen = seqlens[b];
  if (q_len > q_bound || seqlen > k_bound) {
    // A length past the host bounds the launch (grid, SPLIT workspace) was sized by: a caller
    // error (BIK_DEBUG_CHECKS=1 raises it on the host). The sequence's rows are written NaN by
    // the first split program of each tile, the last tile covering the rows past the grid;
    // nothing is computed, so no partial lands past the workspace.
    if (blockIdx.z != 0) return;
    const i64 t0 = static_cast<i64>(tile) * block_t;
    const i64 t_end = tile == static_cast<int>(gridDim.y) - 1
                          ? q_len : bik::min64(t0 + block_t, q_len);
    const int heads = static_cast<int>(bik::min64(gh, g - slice * gh));
    const float nan = bik::f32_from_bits(0x7FC00000u);
    for (i64 idx = tid; idx < (t_end - t0) * heads * D; idx += kThreads) {
      const i64 row = q_start + t0 + idx / (heads * D);
      const int head = hk * g + slice * gh + static_cast<int>((idx / D) % heads);
      bik_cvt::store_as(out, row * sot + head * soh + idx % D, nan, KIND);
      if (idx % D == 0) lse[row * hq + head] = nan;
    }
    return;
  }
  const i64 kv_end = bik_attn::tile_kv_end(seqlen, q_len, tile, block_t, causal);
  const int n_splits = bik_attn::tile_splits(kv_end, split);
  // SPLIT: run r of the R = gridDim.z runs (sized by the host's bound) takes the tile's real
  // splits [r n / R, (r + 1) n / R), so min(R, n) programs work whatever the bound.
  const int runs = static_cast<int>(gridDim.z), run = static_cast<int>(blockIdx.z);
  const int j_first = fold ? 0 : static_cast<int>(static_cast<i64>(run) * n_splits / runs);
  const int j_end = fold ? n_splits : static_cast<int>(static_cast<i64>(run + 1) * n_splits / runs);
  // A tile without keys (only host metadata that skipped the checks gets here) is finalised
  // from the empty state by run 0 alone, FOLD or SPLIT: rows of NaN, never leftovers.
  if (j_first >= j_end && (n_splits > 0 || run > 0)) return;

  if (tid < kRows) {
    const int r = tid;
    const i64 t = static_cast<i64>(tile) * block_t + r / gh;
    const int hs = slice * gh + r % gh;
    const bool ok = r < gh * block_t && t < q_len && hs < g;
    lim_s[r] = ok ? bik_attn::row_limit(seqlen, q_len, t, causal) : -1;
    ok_s[r] = ok;
    qrow_s[r] = q_start + t;
    head_s[r] = hk * g + hs;
    m_run[r] = bik_attn::neg_inf();
    l_run[r] = 0.0f;
  }
  __syncthreads();
  for (int idx = tid; idx < kRows * D; idx += kThreads) {
    const int r = idx / D;
    const int d = idx % D;
    qs[r][d] = lim_s[r] >= 0
                   ? bik_cvt::load_f32<KIND>(q, qrow_s[r] * sqt + head_s[r] * sqh + d)
                   : 0.0f;
  }

  float acc_run[kPer];
  float acc[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) acc_run[i] = 0.0f;
  const int warp = tid / 32;
  const int lane = tid % 32;

  for (int j = j_first; j < j_end; ++j) {
    const i64 lo = static_cast<i64>(j) * split;
    const i64 hi = bik_attn::min64(lo + split, kv_end);
    if (tid < kRows) {
      m_cur[tid] = bik_attn::neg_inf();
      l_cur[tid] = 0.0f;
    }
#pragma unroll
    for (int i = 0; i < kPer; ++i) acc[i] = 0.0f;
    for (i64 n0 = lo; n0 < hi; n0 += kBlockN) {
      __syncthreads();  // the previous block's readers of ks/vs/ps/koff are done
      if (tid < kBlockN) {
        const i64 pos = n0 + tid;
        koff[tid] = pos < hi ? bik_attn::key_offset(pos, b, table, stable, base, block_size,
                                                    spage, stok) + hk * skvh
                             : -1;
      }
      __syncthreads();
      for (int idx = tid; idx < kBlockN * D; idx += kThreads) {
        const int n = idx / D;
        const int d = idx % D;
        const i64 off = koff[n];
        ks[n][d] = off >= 0 ? bik_cvt::load_f32<KIND>(kc, off + d) : 0.0f;
        vs[n][d] = off >= 0 ? bik_cvt::load_f32<KIND>(vc, off + d) : 0.0f;
      }
      __syncthreads();
      // Scores and the online update: warp w owns rows w, w + 4, ...; lane = key n0 + lane.
      for (int r = warp; r < kRows; r += kWarps) {
        const i64 lim = lim_s[r];
        if (lim < n0) continue;  // the row skips this block entirely (uniform in the warp)
        const bool valid = n0 + lane <= lim;
        float s = bik_attn::neg_inf();
        if (valid) {
          float dot = 0.0f;
#pragma unroll 8
          for (int d = 0; d < D; ++d)
            dot = bik_attn::add_rn(dot, bik_attn::mul_rn(qs[r][d], ks[lane][d]));
          s = bik_attn::mul_rn(dot, scale_log2e);
        }
        const float m_old = m_cur[r];
        const bik_attn::Scales sc = bik_attn::merge_scales(m_old, warp_max(s));
        const float m_safe = sc.m_new == bik_attn::neg_inf() ? 0.0f : sc.m_new;
        const float p = valid ? bik_attn::f_exp2(s - m_safe) : 0.0f;
        const float sum = warp_sum(p);
        ps[r][lane] = p;
        __syncwarp();
        if (lane == 0) {
          l_cur[r] = bik_attn::rescale_add(l_cur[r], sc.a, sum);
          m_cur[r] = sc.m_new;
          alpha_s[r] = sc.a;
        }
      }
      __syncthreads();
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const int idx = tid + i * kThreads;
        const int r = idx / D;
        const int d = idx % D;
        const int nk = bik_attn::keys_in_block(n0, lim_s[r], kBlockN);
        if (nk == 0) continue;
        float pv = 0.0f;
        for (int n = 0; n < nk; ++n)
          pv = bik_attn::add_rn(pv, bik_attn::mul_rn(ps[r][n], vs[n][d]));
        acc[i] = bik_attn::rescale_add(acc[i], alpha_s[r], pv);
      }
    }
    __syncthreads();  // m_cur / l_cur / alpha_s of the last block are final
    if (fold) {
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const int r = (tid + i * kThreads) / D;
        if (lim_s[r] < lo) continue;  // the row does not see split j
        const bik_attn::Scales sc = bik_attn::merge_scales(m_run[r], m_cur[r]);
        acc_run[i] = bik_attn::fold2(acc_run[i], sc.a, acc[i], sc.b);
      }
      __syncthreads();
      if (tid < kRows && lim_s[tid] >= lo) {
        const bik_attn::Scales sc = bik_attn::merge_scales(m_run[tid], m_cur[tid]);
        l_run[tid] = bik_attn::fold2(l_run[tid], sc.a, l_cur[tid], sc.b);
        m_run[tid] = sc.m_new;
      }
    } else {
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const int idx = tid + i * kThreads;
        const int r = idx / D;
        if (lim_s[r] < lo) continue;
        pacc[bik_attn::pacc_index(j, total_q, hq, qrow_s[r], head_s[r], idx % D, D)] = acc[i];
      }
      if (tid < kRows && lim_s[tid] >= lo) {
        pml[bik_attn::pml_index(j, 0, total_q, hq, qrow_s[tid], head_s[tid])] = m_cur[tid];
        pml[bik_attn::pml_index(j, 1, total_q, hq, qrow_s[tid], head_s[tid])] = l_cur[tid];
      }
    }
  }
  if (!fold) {
    // Every thread's partials reach the device before its program's ticket; the tile's last
    // program to take one sees every run's partials and folds them j ascending from the empty
    // state, exactly as the FOLD branch above (the same skips, scales and order).
    __shared__ int last_s;
    __threadfence();
    __syncthreads();
    if (tid == 0) {
      const int busy = n_splits == 0 ? 1 : runs < n_splits ? runs : n_splits;  // runs at work
      const i64 slot = static_cast<i64>(blockIdx.x) * gridDim.y + tile;
      last_s = atomicAdd(tickets + slot, 1) == busy - 1;
      __threadfence();
    }
    __syncthreads();
    if (!last_s) return;
    for (int j = 0; j < n_splits; ++j) {
      const i64 lo = static_cast<i64>(j) * split;
      if (tid < kRows && lim_s[tid] >= lo) {  // split j's (m, l) where FOLD has them
        const i64 at = bik_attn::pml_index(j, 0, total_q, hq, qrow_s[tid], head_s[tid]);
        m_cur[tid] = __ldcg(pml + at);
        l_cur[tid] = __ldcg(pml + bik_attn::pml_index(j, 1, total_q, hq, qrow_s[tid], head_s[tid]));
      }
      __syncthreads();
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const int idx = tid + i * kThreads;
        const int r = idx / D;
        if (lim_s[r] < lo) continue;  // the row does not see split j
        const float acc_j = __ldcg(
            pacc + bik_attn::pacc_index(j, total_q, hq, qrow_s[r], head_s[r], idx % D, D));
        const bik_attn::Scales sc = bik_attn::merge_scales(m_run[r], m_cur[r]);
        acc_run[i] = bik_attn::fold2(acc_run[i], sc.a, acc_j, sc.b);
      }
      __syncthreads();
      if (tid < kRows && lim_s[tid] >= lo) {
        const bik_attn::Scales sc = bik_attn::merge_scales(m_run[tid], m_cur[tid]);
        l_run[tid] = bik_attn::fold2(l_run[tid], sc.a, l_cur[tid], sc.b);
        m_run[tid] = sc.m_new;
      }
      __syncthreads();
    }
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int idx = tid + i * kThreads;
    const int r = idx / D;
    if (!ok_s[r]) continue;
    bik_cvt::store_as(out, qrow_s[r] * sot + head_s[r] * soh + idx % D,
                      bik_attn::finalize_out(acc_run[i], l_run[r]), KIND);
  }
  if (tid < kRows && ok_s[tid])
    lse[qrow_s[tid] * hq + head_s[tid]] = bik_attn::finalize_lse(m_run[tid], l_run[tid]);
}

}  // namespace

// Grid: x = n_seq * Hkv * ceil(G / gh), y = ceil(max_q_len / block_t), z = runs of
// consecutive splits (split mode: sized from the host's bound; each tile's real splits spread
// over them) or 1. Block: 128 threads. Lengths: cu_q int32 [B+1],
// seqlens int32 [B]; keys via table int32 [B, stride_table] (paged) or base int64 [B]
// (contiguous; table null). Split mode: pacc/pml workspaces and tickets int32 [x * y], zeroed.
// q_bound / k_bound: the host bounds the grid and workspace were sized by (a longer sequence
// gets NaN rows).
#define BIK_ATTENTION_ENTRY(NAME, KIND, D)                                                    \
  extern "C" __global__ void __launch_bounds__(kThreads) NAME(                                \
      const void* q, const void* kc, const void* vc, void* out, float* lse, float* pacc,      \
      float* pml, int* tickets, const int* cu_q, const int* seqlens, const int* table,        \
      const i64* base, i64 sqt, i64 sqh, i64 sot, i64 soh, i64 stable, i64 spage, i64 stok,   \
      i64 skvh, int block_size, int total_q, int hq, int hkv, int gh, int block_t,            \
      float scale_log2e, int split, int causal, int fold, int q_bound, int k_bound) {         \
    attention_body<KIND, D>(q, kc, vc, out, lse, pacc, pml, tickets, cu_q, seqlens, table,    \
                            base, sqt, sqh, sot, soh, stable, spage, stok, skvh, block_size,  \
                            total_q, hq, hkv, gh, block_t, scale_log2e, split, causal, fold,  \
                            q_bound, k_bound);                                                \
  }

BIK_ATTENTION_ENTRY(bik_attention_f32_d64, bik_cvt::kF32, 64)
BIK_ATTENTION_ENTRY(bik_attention_f32_d128, bik_cvt::kF32, 128)
BIK_ATTENTION_ENTRY(bik_attention_bf16_d64, bik_cvt::kBF16, 64)
BIK_ATTENTION_ENTRY(bik_attention_bf16_d128, bik_cvt::kBF16, 128)
BIK_ATTENTION_ENTRY(bik_attention_f16_d64, bik_cvt::kF16, 64)
BIK_ATTENTION_ENTRY(bik_attention_f16_d128, bik_cvt::kF16, 128)
