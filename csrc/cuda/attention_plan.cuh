// bik CUDA attention: the position/split index math and the per-row arithmetic that decide the
// bits, as __host__ __device__ helpers. CPU tests compile this header with g++
// (tests/cuda/cuda_host/plan_shim.cpp) and check the schedule and a host replica of the kernel.
// No CUDA or C++ standard headers (NVRTC has none); host builds include <cmath> first.
//
// Contract (docs/design.md#attention, the Triton kernel's): a query at absolute position p sees
// keys 0..lim (lim = p causal, else seqlen - 1), cut into splits [j*SPLIT, (j+1)*SPLIT) aligned
// to absolute positions and blocks of BLOCK_N keys aligned the same way. Each split starts from
// a fresh (m, l, acc) (log2 units); per block: s = (q.k, d ascending, each op rounded) * scale *
// log2 e; m' = max(m, max s); alpha = exp2(m - m'); p = exp2(s - m'); l = l*alpha + tree_sum(p);
// acc = acc*alpha + (sum of p*v over the block's keys, ascending). Splits are folded in
// ascending j by merge_scales; out = acc / l, lse = (m + log2 l) * ln 2.
// A row never touches a key past lim, a block starting past lim or a split starting past lim:
// which keys *other* rows of a tile see cannot change its operations, so prefill, chunked
// prefill, decode and verify give the same bits by construction.
#pragma once

#include "common.cuh"  // BIK_HD, i64, cdiv, min64, the rounded ops add_rn / mul_rn / div_rn

namespace bik_attn {

using bik::add_rn;
using bik::cdiv;
using bik::div_rn;
using bik::i64;
using bik::min64;
using bik::mul_rn;

BIK_HD float neg_inf() { return -bik::inf_f32(); }

BIK_HD float f_max(float a, float b) { return a > b ? a : b; }
BIK_HD float f_exp2(float x) { return exp2f(x); }
BIK_HD float f_log2(float x) { return log2f(x); }

// ---- schedule ---------------------------------------------------------------------------

// Last key index query token t (0-based among the call's q_len new tokens) may see.
BIK_HD i64 row_limit(i64 seqlen, i64 q_len, i64 t, int causal) {
  return causal ? seqlen - q_len + t : seqlen - 1;
}

// Keys a tile of query tokens [tile*block_t, ...) needs: one past its last row's limit.
BIK_HD i64 tile_kv_end(i64 seqlen, i64 q_len, i64 tile, int block_t, int causal) {
  if (!causal) return seqlen;
  const i64 last = min64((tile + 1) * block_t, q_len) - 1;
  return row_limit(seqlen, q_len, last, causal) + 1;
}

// Splits the tile visits ([0, kv_end) cut at multiples of SPLIT), and those one row folds.
BIK_HD int tile_splits(i64 kv_end, int split) {
  return static_cast<int>(cdiv(kv_end, split));
}
BIK_HD int row_splits(i64 lim, int split) {
  return lim < 0 ? 0 : static_cast<int>(lim / split + 1);
}

// Keys of the block starting at n0 that a row with limit lim uses (0 = it skips the block).
BIK_HD int keys_in_block(i64 n0, i64 lim, int block_n) {
  const i64 n = lim - n0 + 1;
  return n <= 0 ? 0 : static_cast<int>(min64(n, block_n));
}

// Element offset of key `pos` of sequence b (plus head * stride_kvh + d by the caller).
BIK_HD i64 key_offset(i64 pos, i64 b, const int* table, i64 stride_table, const i64* base,
                      int block_size, i64 stride_page, i64 stride_tok) {
  if (table)
    return static_cast<i64>(table[b * stride_table + pos / block_size]) * stride_page +
           (pos % block_size) * stride_tok;
  return base[b] + pos * stride_tok;
}

// Partial layout of split mode: pml [n_splits, 2, total_q, Hq], pacc [n_splits, total_q, Hq, D].
BIK_HD i64 pml_index(int j, int which, i64 total_q, int hq, i64 token, int head) {
  return ((static_cast<i64>(j) * 2 + which) * total_q + token) * hq + head;
}
BIK_HD i64 pacc_index(int j, i64 total_q, int hq, i64 token, int head, int d, int head_dim) {
  return ((static_cast<i64>(j) * total_q + token) * hq + head) * head_dim + d;
}

// ---- per-row arithmetic -----------------------------------------------------------------

// Online-softmax / merge rescaling: folding state (m2) into state (m1). An all -inf pair
// gives scales exp2(-inf) = 0 instead of NaN.
struct Scales {
  float m_new;
  float a;  // multiplies the state being folded into
  float b;  // multiplies the incoming state
};

BIK_HD Scales merge_scales(float m1, float m2) {
  Scales s;
  s.m_new = f_max(m1, m2);
  const float m_safe = s.m_new == neg_inf() ? 0.0f : s.m_new;
  s.a = f_exp2(m1 - m_safe);
  s.b = f_exp2(m2 - m_safe);
  return s;
}

// x*a + y*b, each op rounded: the one fold used by both launch modes.
BIK_HD float fold2(float x, float a, float y, float b) {
  return add_rn(mul_rn(x, a), mul_rn(y, b));
}

// acc = acc*alpha + pv and l = l*alpha + sum: the in-split block update.
BIK_HD float rescale_add(float x, float alpha, float y) { return add_rn(mul_rn(x, alpha), y); }

BIK_HD float finalize_out(float acc, float l) { return div_rn(acc, l); }
BIK_HD float finalize_lse(float m, float l) {
  return mul_rn(add_rn(m, f_log2(l)), 0.6931471805599453f);
}

}  // namespace bik_attn
