// bik's Gumbel-max sampler on the CPU (contract: docs/design.md#sampler; this header is its
// C++ implementation, mirrored bit for bit by the Triton and CUDA kernels: the noise, the
// filters, the normaliser and the pick, so tokens and logprobs are the same on every backend).
//
// Noise for (seed, position, token id, stream):
//   bits = word 0 of Philox4x32-10(counter = (token_id, pos_lo, pos_hi, stream),
//                                  key     = (seed_lo, seed_hi))      (Random123's round)
//   u    = (2 * (bits >> 9) + 1) * 2^-24          exact in fp32, u in [2^-24, 1 - 2^-24]
//   g    = 0 - bik_log(0 - bik_log(u))            in [-2.8116, 16.6355], always finite
// bik_log(x), x a positive normal fp32, uses only exactly rounded operations (bit manipulation,
// separate multiplies and adds, no FMA: the build has -ffp-contract=off):
//   x = m * 2^e with m in [sqrt(1/2), sqrt(2)), f = m - 1 (exact), q = Horner(C8..C0, f),
//   p = q * f + 1, l = f * p,  bik_log = e * LN2_HI + (e * LN2_LO + l)
// bik_exp(x), x <= 0 (the normaliser's terms exp(z - m)), likewise from exactly rounded ops:
//   x < -86 (-inf included): 0;  k = floor(x * LOG2E + 0.5);  r = (x - k * C1) - k * C2
//   p = ((Horner(E5..E0, r) * (r * r)) + r) + 1;  bik_exp = p * 2^k   (k in [-124, 0]: exact)
// Per row (z = x / T with correctly rounded division, or z = x when T == 0):
//   invalid row (token -1, logprob NaN): a NaN or +inf in z, or no finite z left by the filters
//   top-k (0 < k < V): keep the first k tokens in the order (z desc, index asc)
//   m = max z (top-k, top-p and min-p always keep the max)
//   top-p (p < 1): e_j = bik_exp(z_j - m) over top-k-kept j, S = vocab_sum(e); keep z_j >= v_p
//     where v_p is the largest fp32 v with vocab_sum(e_j [z_j >= v]) >= p * S (bisection on the
//     order key)
//   min-p (log_min_p > -inf): keep z_j >= m + log_min_p (log_min_p = bik_log(min_p), host side)
//   pick: argmax over kept j of (T == 0 ? z_j : z_j + g_j), ties to the lowest index
//   logprob = (z_c - m) - bik_log(vocab_sum(bik_exp(z_j - m) over kept j))
// vocab_sum, the normaliser's order (VocabChunks, bik.configs.sampler_chunks(V)): the vocabulary
// is cut into G equal groups (G = TP_max when it divides V, else 1), each group into chunks of
// C tokens (a power of two) from the group's start, the last one ragged: its missing tokens are
// +0 terms. A chunk's C terms s[t] fold pairwise by halves, w = C/2, C/4, ..., 1:
// s[t] = s[t] + s[t + w] (t < w), and s[0] is the chunk sum. A group's chunk sums are added in
// ascending order from +0, then the group totals in ascending order. A rank holding whole
// groups of the vocabulary computes their totals alone; every GPU kernel runs this order.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "contract.h"
#include "normaliser.h"

namespace bik_cpu {
namespace sampling {

using norm::bik_exp;
using norm::bik_log;
using norm::bits_of;
using norm::f32_from_bits;
using norm::vocab_sum;
using norm::VocabChunks;

constexpr std::uint32_t kPhiloxM0 = 0xD2511F53u, kPhiloxM1 = 0xCD9E8D57u;
constexpr std::uint32_t kPhiloxW0 = 0x9E3779B9u, kPhiloxW1 = 0xBB67AE85u;

struct Words {
  std::uint32_t v[4];
};

static inline Words philox4x32_10(std::uint32_t c0, std::uint32_t c1, std::uint32_t c2,
                                  std::uint32_t c3, std::uint32_t k0, std::uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += kPhiloxW0;
      k1 += kPhiloxW1;
    }
    const std::uint64_t p0 = std::uint64_t(kPhiloxM0) * c0;
    const std::uint64_t p1 = std::uint64_t(kPhiloxM1) * c2;
    const std::uint32_t hi0 = std::uint32_t(p0 >> 32), lo0 = std::uint32_t(p0);
    const std::uint32_t hi1 = std::uint32_t(p1 >> 32), lo1 = std::uint32_t(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
  }
  return Words{{c0, c1, c2, c3}};
}

static inline float bits_to_unit(std::uint32_t bits) {
  // 2 * (bits >> 9) + 1 < 2^24: exact as a float, and the scale by 2^-24 is exact.
  return float(((bits >> 9) << 1) | 1u) * 0x1p-24f;
}

// Negation is written 0 - x (as Triton lowers unary minus): g(u) = +0 where -log(u) = 1.
static inline float gumbel_from_unit(float u) { return 0.0f - bik_log(0.0f - bik_log(u)); }

// The noise's exact extremes over all 2^23 u (tested): g(2^-24) and g(1 - 2^-24).
constexpr float kGumbelMin = -0x1.67e0920000000p+1f;
constexpr float kGumbelMax = 0x1.0a2b240000000p+4f;

static inline float gumbel(std::int64_t seed, std::int64_t position, std::uint32_t token,
                           std::uint32_t stream) {
  const std::uint64_t s = std::uint64_t(seed), p = std::uint64_t(position);
  const Words w = philox4x32_10(token, std::uint32_t(p), std::uint32_t(p >> 32), stream,
                                std::uint32_t(s), std::uint32_t(s >> 32));
  return gumbel_from_unit(bits_to_unit(w.v[0]));
}

// The total order key of a non-NaN fp32: key(a) < key(b) iff a < b (with -0 < +0).
static inline std::int64_t order_key(float v) {
  const std::int32_t b = std::int32_t(bits_of(v));
  return b >= 0 ? b : (b ^ 0x7FFFFFFF);
}

static inline float from_order_key(std::int64_t k) {
  const std::int32_t b = std::int32_t(k);
  return f32_from_bits(std::uint32_t(b >= 0 ? b : (b ^ 0x7FFFFFFF)));
}

struct RowParams {
  std::int64_t seed, position, top_k;
  float temperature, top_p, log_min_p;
  std::uint32_t stream;
};

// Samples one row x[0..V-1] (unit stride). z, e: scratch of V floats; idx: V int32.
static void sample_row(const float* x, idx_t V, const VocabChunks& vc, const RowParams& rp,
                       float* z, float* e,
                       std::int32_t* idx, std::int64_t* token_out, float* logprob_out) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  *token_out = -1;
  *logprob_out = nan;
  const float T = rp.temperature;
  bool bad = false;
  for (idx_t j = 0; j < V; ++j) {
    z[j] = T > 0.0f ? x[j] / T : x[j];
    bad |= (z[j] != z[j]) || z[j] == INFINITY;
  }
  if (bad) return;
  // top-k: the k-th token in (z desc, index asc) is the threshold (vk, ik).
  float vk = -INFINITY;
  idx_t ik = V;  // keep everything
  if (rp.top_k > 0 && rp.top_k < V) {
    for (idx_t j = 0; j < V; ++j) idx[j] = std::int32_t(j);
    auto before = [z](std::int32_t a, std::int32_t b) {
      return z[a] > z[b] || (z[a] == z[b] && a < b);
    };
    std::nth_element(idx, idx + (rp.top_k - 1), idx + V, before);
    ik = idx[rp.top_k - 1];
    vk = z[ik];
  }
  const bool topk_on = ik < V;
  auto kept_k = [&](idx_t j) { return !topk_on || z[j] > vk || (z[j] == vk && j <= ik); };
  float m = -INFINITY;
  for (idx_t j = 0; j < V; ++j)
    if (kept_k(j)) m = z[j] > m ? z[j] : m;
  if (m == -INFINITY) return;  // nothing finite left
  for (idx_t j = 0; j < V; ++j) e[j] = kept_k(j) ? bik_exp(z[j] - m) : 0.0f;
  float v_lo = -INFINITY;
  if (rp.top_p < 1.0f) {
    const float target = rp.top_p * vocab_sum(V, vc, [e](idx_t j) { return e[j]; });
    std::int64_t lo = order_key(-INFINITY), hi = order_key(m) + 1;
    for (int it = 0; it < 32; ++it) {
      const std::int64_t mid = (lo + hi) >> 1;
      const float v = from_order_key(mid);
      const float mass = vocab_sum(V, vc, [e, z, v](idx_t j) { return z[j] >= v ? e[j] : 0.0f; });
      if (mass >= target) lo = mid; else hi = mid;
    }
    v_lo = from_order_key(lo);
  }
  if (rp.log_min_p > -INFINITY) {
    const float v_m = m + rp.log_min_p;
    v_lo = v_m > v_lo ? v_m : v_lo;
  }
  // The pick: argmax of the score under (value desc, index asc); strict > keeps the lowest index.
  // A token with z + kGumbelMax < m + kGumbelMin (each rounded) scores below the max token
  // whatever the noise (fp32 addition is monotone), so it is skipped: the same token results.
  const float floor = m + kGumbelMin;
  float best = -INFINITY;
  idx_t best_j = -1;
  for (idx_t j = 0; j < V; ++j) {
    if (!kept_k(j) || !(z[j] >= v_lo) || z[j] == -INFINITY) continue;
    if (T > 0.0f && z[j] + kGumbelMax < floor) continue;
    const float s = T > 0.0f ? z[j] + gumbel(rp.seed, rp.position, std::uint32_t(j), rp.stream)
                             : z[j];
    if (best_j < 0 || s > best) {
      best = s;
      best_j = j;
    }
  }
  if (best_j < 0) return;
  const float sum =
      vocab_sum(V, vc, [&](idx_t j) { return kept_k(j) && z[j] >= v_lo ? e[j] : 0.0f; });
  *token_out = best_j;
  *logprob_out = (z[best_j] - m) - bik_log(sum);  // sum >= 1: the max token's term is 1
}

// A row's max and normaliser on the caller's vectors (kernels_isa.h row_max / exp_sum_row: exact
// maxima, and the same terms in the same order as vocab_sum of bik_exp, hence the same bits);
// null members: the scalar path for every row.
struct RowVectors {
  float (*row_max)(const float* x, idx_t V, bool* nan) = nullptr;
  float (*exp_sum)(const float* x, idx_t V, float m, idx_t groups, idx_t chunk,
                   float* s) = nullptr;
};

// sample_row for a greedy row without filters (T == 0, top-k, top-p and min-p off), every token
// kept: the first token of the largest z = x (a NaN or +inf: invalid; all -inf: invalid), and
// logprob (z_c - m) - bik_log(vocab_sum(bik_exp(z_j - m))). m is that token's own value, as in
// sample_row (a vector max may hold the other zero of a +-0 maximum). The same token and bits as
// sample_row's sequence, without its copies of the row and its scalar exps. s: vc.chunk floats.
static void greedy_row(const float* x, idx_t V, const VocabChunks& vc, const RowVectors& vec,
                       float* s, std::int64_t* token_out, float* logprob_out) {
  *token_out = -1;
  *logprob_out = std::numeric_limits<float>::quiet_NaN();
  bool nan = false;
  const float top = vec.row_max(x, V, &nan);
  if (nan || top == INFINITY || top == -INFINITY) return;
  idx_t best = 0;
  while (!(x[best] == top)) ++best;  // the first maximal token (-0 == +0)
  const float m = x[best];
  *token_out = best;
  *logprob_out = (x[best] - m) - bik_log(vec.exp_sum(x, V, m, vc.groups, vc.chunk, s));
}

// Rows r0..r1-1 of x [B, V] (row stride sx, unit stride along V). vec (its members null: the
// scalar path for every row) serves the greedy rows without filters.
static void sample_rows(const float* x, idx_t sx, idx_t V, const VocabChunks& vc,
                        const std::int64_t* seed,
                        const std::int64_t* position, const float* temperature,
                        const std::int64_t* top_k, const float* top_p, const float* log_min_p,
                        std::uint32_t stream, std::int64_t* tokens, float* logprobs, idx_t r0,
                        idx_t r1, const RowVectors& vec) {
  // sample_row's scratch (3 V-long rows, zeroed) is made for the first row that needs it: a
  // batch of greedy rows never writes it.
  std::vector<float> z, e;
  std::vector<float> s(static_cast<size_t>(vc.chunk));
  std::vector<std::int32_t> idx;
  for (idx_t r = r0; r < r1; ++r) {
    const RowParams rp{seed[r], position[r], top_k[r], temperature[r], top_p[r], log_min_p[r],
                       stream};
    const bool unfiltered = (rp.top_k <= 0 || rp.top_k >= V) && !(rp.top_p < 1.0f) &&
                            !(rp.log_min_p > -INFINITY);
    if (vec.row_max != nullptr && rp.temperature == 0.0f && unfiltered) {
      greedy_row(x + r * sx, V, vc, vec, s.data(), tokens + r, logprobs + r);
      continue;
    }
    if (z.empty()) {
      z.resize(static_cast<size_t>(V));
      e.resize(static_cast<size_t>(V));
      idx.resize(static_cast<size_t>(V));
    }
    sample_row(x + r * sx, V, vc, rp, z.data(), e.data(), idx.data(), tokens + r, logprobs + r);
  }
}

}  // namespace sampling
}  // namespace bik_cpu
