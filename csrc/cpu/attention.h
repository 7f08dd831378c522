// CPU attention with a fixed KV split (bik::attention / bik::attention_varlen, backend "cpu").
//
// The spec is the Python reference, bik.ops.attention.reference.attention_cpu_reference; this
// kernel gives its bits (tests/attention/test_attention_cpu_kernel.py checks it bitwise). Per
// query row (token at absolute position P of sequence b, query head h, KV head h / G) and per
// split [lo, hi) = [j*SPLIT, min((j+1)*SPLIT, L)), j ascending, from a fresh state:
//     s[c]  = (sum_d q[d]*k[c,d], d ascending, the matmul contract's sequence) * sl2e
//             sl2e = fp32(scale * log2 e);  s[c] = -inf where causal and c > P
//     m_j   = max_c s[c] (NaN if any s is NaN);  ms = m_j == -inf ? 0 : m_j
//     p[c]  = exp2f(s[c] - ms)                       (exp2f: the libm's, as unary_f32)
//     l_j   = sum_c p[c]*1      and  acc_j[d] = sum_c p[c]*v[c,d]   (c ascending, from +0,
//             each op rounded: the matmul contract with b = ones and b = v)
//   folded into (m, l, acc) = (-inf, 0, 0) by merge:
//     mn = max(m, m_j) (NaN-propagating);  mns = mn == -inf ? 0 : mn
//     a = exp2f(m - mns);  b = exp2f(m_j - mns);  l = l*a + l_j*b;  acc = acc*a + acc_j*b
//   and finally out = acc / l,  lse = (m + log2f(l)) * fp32(ln 2).
//
// How, without changing those bits:
// - Rows of one (sequence, KV head) go in chunks of Q; s and acc_j are matmul_tile calls (the
//   matmul kernel itself), so each element is the contract's sequence whatever the chunk.
// - A split's keys are read in place when evenly spaced, else (pages) copied to a buffer first.
// - Keys past every row of the chunk (causal, c > max P) are not multiplied: for them
//   p = exp2f(-inf - ms), which is +0 (or NaN when ms is NaN, in which case l_j and acc_j are
//   NaN already), and adding p*1 or p*v leaves l_j and acc_j unchanged (they are never -0)
//   unless v[c,d] is inf or NaN, where 0*v = NaN: such columns are set to NaN, as the
//   reference's sum would make them. A split no row can see is such a tail as a whole.
// - Work items are (sequence, KV head, up to kItemRows rows); threads take whole items, and a
//   row's arithmetic never depends on its item or chunk, so the thread count changes speed only.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "contract.h"

namespace bik_cpu {
namespace attn {

// The ISA's matmul tile (kernels_isa.h matmul_tile; the last argument, a packed B, is null).
// Its K (D or a split's keys) is always one K split (split argument 0).
using TileFn = void (*)(const float*, idx_t, idx_t, const float*, idx_t, idx_t, const float*,
                        float*, idx_t, idx_t, idx_t, idx_t, idx_t, idx_t, idx_t, idx_t, idx_t,
                        float*, const float*);
// The same tile with a bf16 B (its bit patterns), widened while packing: the bits of the fp32
// tile on B widened first, which is how a bf16 cache is read in place.
using TileBf16Fn = void (*)(const float*, idx_t, idx_t, const std::uint16_t*, idx_t, idx_t,
                            const float*, float*, idx_t, idx_t, idx_t, idx_t, idx_t, idx_t, idx_t,
                            idx_t, idx_t, float*, const float*);
struct Tiles {
  TileFn f32;
  TileBf16Fn bf16;
  void operator()(const float* a, idx_t sam, idx_t sak, const float* b, idx_t sbk, idx_t sbn,
                  float* c, idx_t ldc, idx_t M, idx_t N, idx_t K, idx_t kc, idx_t nc,
                  float* ws) const {
    f32(a, sam, sak, b, sbk, sbn, nullptr, c, ldc, 0, M, 0, N, K, 0, kc, nc, ws, nullptr);
  }
  void operator()(const float* a, idx_t sam, idx_t sak, const std::uint16_t* b, idx_t sbk,
                  idx_t sbn, float* c, idx_t ldc, idx_t M, idx_t N, idx_t K, idx_t kc, idx_t nc,
                  float* ws) const {
    bf16(a, sam, sak, b, sbk, sbn, nullptr, c, ldc, 0, M, 0, N, K, 0, kc, nc, ws, nullptr);
  }
};

struct Problem {
  const float* q;  // q[tok, h, d] at q + tok*sq_tok + h*sq_head + d
  idx_t sq_tok, sq_head;
  const void* k;  // key t of sequence b, KV head h: k + koff[b*koff_row + t] + h*s_head (+ d)
  const void* v;  // same offsets as k; both fp32, or bf16 bit patterns when kv_bf16
  const idx_t* koff;  // [B, koff_row] element offset of each key (pages need not be contiguous)
  idx_t koff_row, s_head;
  const idx_t* cu_q;    // [B + 1]
  const idx_t* lens_k;  // [B], sequence b has lens_k[b] keys (>= its q_len, <= koff_row)
  idx_t B, hq, hkv, d, split;
  float sl2e;
  bool causal;
  float* out;  // [total_q, hq, d] contiguous
  float* lse;  // [total_q, hq] contiguous
  bool kv_bf16;
};

struct Item {
  idx_t b, hk, r0, r1;  // rows r0..r1-1 of (sequence b, KV head hk); row r = token r/G, head r%G
};

constexpr idx_t kItemRows = 256;  // rows per work item (speed only)
constexpr idx_t kChunk = 64;      // rows per score tile inside an item (speed only)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Floats of an item's own buffers (a multiple of 16, so the tile scratch after them stays
// 64-byte aligned); a worker's workspace is this plus the tile's scratch.
static inline size_t own_floats(const Problem& p) {
  const size_t I = size_t(kItemRows), C = size_t(kChunk), d = size_t(p.d);
  return (2 * I * d + 2 * I + C * d + C * size_t(p.split) + 3 * C + 2 * size_t(p.split) * d +
          2 * d + 15) / 16 * 16;
}

// inf or NaN: exponent bits all ones (an fp32, or a bf16's bit pattern).
static inline bool nonfinite(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  return (~u & 0x7f800000u) == 0u;
}
static inline bool nonfinite(std::uint16_t h) { return (~h & 0x7f80u) == 0u; }

// True if any of x[0..n-1] is inf or NaN; integer ops, vectorizable.
template <class T>
static inline bool any_nonfinite(const T* x, idx_t n) {
  bool any = false;
  for (idx_t i = 0; i < n; ++i) any |= nonfinite(x[i]);
  return any;
}

// sums[r] = ((0 + s[r,0]) + s[r,1]) + ... + s[r,n-1] for rows r < C of s [C, n]: each row's
// sum in key order (the matmul contract with b = ones), eight rows' chains interleaved.
static void row_sums(const float* s, idx_t C, idx_t n, float* sums) {
  idx_t r0 = 0;
  for (; r0 + 8 <= C; r0 += 8) {
    float a[8] = {};
    for (idx_t c = 0; c < n; ++c)
      for (int j = 0; j < 8; ++j) a[j] = a[j] + s[(r0 + j) * n + c];
    for (int j = 0; j < 8; ++j) sums[r0 + j] = a[j];
  }
  for (; r0 < C; ++r0) {
    float a = 0.0f;
    for (idx_t c = 0; c < n; ++c) a = a + s[r0 * n + c];
    sums[r0] = a;
  }
}

// One work item on K/V elements of type T (float, or a bf16's bits: read in place, widened
// where the tile packs them). ws: own_floats() + the tile's scratch, 64-byte aligned.
template <class T>
static void run_item(const Problem& p, const Tiles& tile, idx_t kc, idx_t nc, const Item& it,
                     float* ws) {
  const idx_t g = p.hq / p.hkv, d = p.d, split = p.split;
  const idx_t q0 = p.cu_q[it.b], t = p.cu_q[it.b + 1] - q0;
  const idx_t* koff = p.koff + it.b * p.koff_row;
  const idx_t L = p.lens_k[it.b];
  const idx_t R = it.r1 - it.r0;
  float* qb = ws;                      // [R, d] the item's query rows
  float* acc = qb + kItemRows * d;     // [R, d] running state
  float* m = acc + kItemRows * d;      // [R]
  float* l = m + kItemRows;            // [R]
  float* accj = l + kItemRows;         // [chunk, d]
  float* S = accj + kChunk * d;        // [chunk, nk] scores, then p
  float* mj = S + kChunk * split;      // [chunk]
  float* lj = mj + kChunk;             // [chunk]
  float* pm = lj + kChunk;             // [chunk] a masked key's p per row
  T* kbuf = reinterpret_cast<T*>(pm + kChunk);  // [split, d] a split's keys when they are not
  T* vbuf = reinterpret_cast<T*>(pm + kChunk + split * d);  // evenly spaced (pages), else unused
  idx_t* last_bad = reinterpret_cast<idx_t*>(pm + kChunk + 2 * split * d);  // [d]
  float* tile_ws = ws + own_floats(p);

  for (idx_t r = 0; r < R; ++r) {
    const idx_t row = it.r0 + r;
    const float* src = p.q + (q0 + row / g) * p.sq_tok + (it.hk * g + row % g) * p.sq_head;
    std::copy(src, src + d, qb + r * d);
    m[r] = kNegInf;
    l[r] = 0.0f;
    std::fill(acc + r * d, acc + (r + 1) * d, 0.0f);
  }
  const idx_t pos0 = L - t;  // position of token 0 of this call; row r is at pos0 + r / g
  const T* kh = static_cast<const T*>(p.k) + it.hk * p.s_head;
  const T* vh = static_cast<const T*>(p.v) + it.hk * p.s_head;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // Keys [lo, kv_hi) are visible to some row of rows [.., r1); [kv_hi, hi) to none of them.
  auto visible_end = [&](idx_t lo, idx_t hi, idx_t r1) {
    return p.causal ? std::min(hi, std::max(lo, pos0 + (it.r0 + r1 - 1) / g + 1)) : hi;
  };

  for (idx_t lo = 0; lo < L; lo += split) {
    const idx_t hi = std::min(lo + split, L);
    const idx_t kv_item = visible_end(lo, hi, R);
    // The split's keys as rows of stride ks: in place when evenly spaced, else copied (exact).
    const idx_t ks0 = kv_item - lo > 1 ? koff[lo + 1] - koff[lo] : d;
    bool even = true;
    for (idx_t c = lo + 1; c < kv_item && even; ++c) even = koff[c] - koff[c - 1] == ks0;
    const T* ksp = kbuf;
    const T* vsp = vbuf;
    idx_t ks = d;
    if (kv_item > lo && even) {
      ksp = kh + koff[lo];
      vsp = vh + koff[lo];
      ks = ks0;
    } else {
      for (idx_t c = lo; c < kv_item; ++c) {
        std::copy(kh + koff[c], kh + koff[c] + d, kbuf + (c - lo) * d);
        std::copy(vh + koff[c], vh + koff[c] + d, vbuf + (c - lo) * d);
      }
    }
    // Non-finite values past the first chunk's visible keys: last_bad[dd] is the last key in
    // [kv_first, hi) whose v[., dd] is inf or NaN (or -1); rare, so first a quick check.
    const idx_t kv_first = visible_end(lo, hi, std::min(kChunk, R));
    bool tail_bad = false;
    for (idx_t c = kv_first; c < hi && !tail_bad; ++c) tail_bad = any_nonfinite(vh + koff[c], d);
    if (tail_bad) {
      std::fill(last_bad, last_bad + d, idx_t(-1));
      for (idx_t c = kv_first; c < hi; ++c)
        for (idx_t dd = 0; dd < d; ++dd)
          if (nonfinite(vh[koff[c] + dd])) last_bad[dd] = c;
    }
    for (idx_t c0 = 0; c0 < R; c0 += kChunk) {
      const idx_t C = std::min(kChunk, R - c0);
      const idx_t kv_hi = visible_end(lo, hi, c0 + C);
      const idx_t nk = kv_hi - lo;
      if (nk > 0)  // S[C, nk] = q[C, d] @ k[lo:kv_hi]^T
        tile(qb + c0 * d, d, 1, ksp, 1, ks, S, nk, C, nk, d, kc, nc, tile_ws);
      for (idx_t r = 0; r < C; ++r) {
        float* s = S + r * nk;
        const idx_t pos = pos0 + (it.r0 + c0 + r) / g;
        const idx_t vis = p.causal ? std::min(nk, std::max<idx_t>(0, pos + 1 - lo)) : nk;
        float mx = kNegInf;
        bool has_nan = false;
        for (idx_t c = 0; c < vis; ++c) {
          const float x = s[c] * p.sl2e;
          s[c] = x;
          mx = x > mx ? x : mx;
          has_nan |= x != x;
        }
        const float mjr = has_nan ? nan : mx;
        const float ms = mjr == kNegInf ? 0.0f : mjr;
        for (idx_t c = 0; c < vis; ++c) s[c] = std::exp2(s[c] - ms);
        pm[r] = std::exp2(kNegInf - ms);  // a masked key's p: +0, or NaN if ms is NaN
        for (idx_t c = vis; c < nk; ++c) s[c] = pm[r];
        mj[r] = mjr;
      }
      row_sums(S, C, nk, lj);
      if (kv_hi < hi)  // the tail adds pm (+0 or NaN) hi - kv_hi times: once is the same
        for (idx_t r = 0; r < C; ++r) lj[r] = lj[r] + pm[r];
      if (nk > 0)  // acc_j[C, d] = p[C, nk] @ v[lo:kv_hi]
        tile(S, nk, 1, vsp, ks, 1, accj, d, C, d, nk, kc, nc, tile_ws);
      else
        std::fill(accj, accj + C * d, 0.0f);
      if (tail_bad && kv_hi < hi)  // 0 * v[c, dd] is NaN where v is inf or NaN
        for (idx_t dd = 0; dd < d; ++dd)
          if (last_bad[dd] >= kv_hi)
            for (idx_t r = 0; r < C; ++r) accj[r * d + dd] = nan;
      for (idx_t r = 0; r < C; ++r) {  // merge (the reference's merge_partial)
        const idx_t ri = c0 + r;
        const float mo = m[ri], mjr = mj[r];
        const float mn = (mo != mo || mjr != mjr) ? nan : (mjr > mo ? mjr : mo);
        const float mns = mn == kNegInf ? 0.0f : mn;
        const float a = std::exp2(mo - mns), b = std::exp2(mjr - mns);
        l[ri] = l[ri] * a + lj[r] * b;
        float* ar = acc + ri * d;
        const float* jr = accj + r * d;
        for (idx_t dd = 0; dd < d; ++dd) ar[dd] = ar[dd] * a + jr[dd] * b;
        m[ri] = mn;
      }
    }
  }
  const float ln2 = static_cast<float>(0.6931471805599453);
  for (idx_t r = 0; r < R; ++r) {
    const idx_t row = it.r0 + r, tok = q0 + row / g, h = it.hk * g + row % g;
    float* o = p.out + (tok * p.hq + h) * d;
    for (idx_t dd = 0; dd < d; ++dd) o[dd] = acc[r * d + dd] / l[r];
    p.lse[tok * p.hq + h] = (m[r] + std::log2(l[r])) * ln2;
  }
}

// The metadata the kernel follows, checked before anything is read through it (O(B + keys)):
// "" if it is sound, else what is wrong. The op trusts host metadata its caller passes (no
// device reads), so on the CPU this is what keeps a bad length or page from reading outside
// q, k, v or out. k_extent: the floats of k (and of v) from p.k on, as its shape reaches.
static std::string check_metadata(const Problem& p, idx_t total_q, idx_t k_extent) {
  const auto at = [](idx_t b) { return "sequence " + std::to_string(b); };
  if (p.cu_q[0] != 0 || p.cu_q[p.B] != total_q)  // cu_q has B + 1 >= 1 entries
    return "cu_seqlens_q must start at 0 and end at total_q = " + std::to_string(total_q);
  const idx_t last = (p.hkv - 1) * p.s_head + p.d;  // floats read from a key's offset on
  for (idx_t b = 0; b < p.B; ++b) {
    const idx_t q_len = p.cu_q[b + 1] - p.cu_q[b], L = p.lens_k[b];
    if (q_len < 0) return "cu_seqlens_q must never decrease (" + at(b) + ")";
    if (L < q_len)
      return at(b) + " has " + std::to_string(L) + " keys < q_len " + std::to_string(q_len) +
             "; its new tokens' K/V must already be in the cache";
    if (L > p.koff_row)
      return at(b) + " has " + std::to_string(L) + " keys but max_seqlen_k is " +
             std::to_string(p.koff_row);
    const idx_t* koff = p.koff + b * p.koff_row;
    for (idx_t t = 0; t < L; ++t)
      if (koff[t] < 0 || koff[t] > k_extent - last)  // not koff + last: it could overflow
        return at(b) + ": key " + std::to_string(t) +
               " lies outside the cache (a block_table entry out of range?)";
  }
  return "";
}

// Work items, a sequence's last rows first (in a causal prefill they see the most keys), and
// the multiply-adds of the whole call (for the thread policy).
static std::vector<Item> make_items(const Problem& p, double* macs) {
  std::vector<Item> items;
  const idx_t g = p.hq / p.hkv;
  *macs = 0;
  for (idx_t b = 0; b < p.B; ++b) {
    const idx_t rows = (p.cu_q[b + 1] - p.cu_q[b]) * g;
    for (idx_t r1 = rows; r1 > 0; r1 -= kItemRows)
      for (idx_t hk = 0; hk < p.hkv; ++hk)
        items.push_back({b, hk, std::max<idx_t>(0, r1 - kItemRows), r1});
    *macs += 2.0 * double(rows) * double(p.hkv) * double(p.lens_k[b]) *
             double(p.d);
  }
  return items;
}

// Runs the items on nt threads, each taking the next item in turn; ws holds nt slices of
// per_worker floats (a multiple of 16). Which thread runs an item never changes its bits.
static void run_items(const Problem& p, const Tiles& tile, idx_t kc, idx_t nc,
                      const std::vector<Item>& items, int nt, float* ws, size_t per_worker) {
  std::atomic<size_t> next{0};
  parallel_run(nt, [&](int id) {
    for (size_t i = next++; i < items.size(); i = next++) {
      float* mine = ws + per_worker * size_t(id);
      if (p.kv_bf16)
        run_item<std::uint16_t>(p, tile, kc, nc, items[i], mine);
      else
        run_item<float>(p, tile, kc, nc, items[i], mine);
    }
  });
}

}  // namespace attn
}  // namespace bik_cpu
