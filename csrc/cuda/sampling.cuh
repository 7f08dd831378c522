// The sampler's element math (docs/design.md#sampler), __host__ __device__: Philox4x32-10, the
// unit value u, bik_log, the Gumbel noise and the fp32 order key. The same sequence of exactly
// rounded operations as csrc/cpu/sampling.h, so the noise is bit-identical to the CPU path (the
// CPU tests compile this header with g++ next to sampling.h and compare them).
#pragma once

#include "common.cuh"

#if !defined(__CUDACC_RTC__)
#include <cmath>
#endif

namespace bik {
namespace sampling {

constexpr u32 kPhiloxM0 = 0xD2511F53u, kPhiloxM1 = 0xCD9E8D57u;
constexpr u32 kPhiloxW0 = 0x9E3779B9u, kPhiloxW1 = 0xBB67AE85u;
// The noise's exact extremes over all 2^23 u (same constants as the CPU path and Triton).
constexpr float kGumbelMin = -2.8115408420562744f;
constexpr float kGumbelMax = 16.63553237915039f;

BIK_HD u32 mulhi32(u32 a, u32 b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return u32((u64(a) * u64(b)) >> 32);
#endif
}

// Word 0 of Philox4x32-10 (Random123's round); the sampler uses only word 0.
BIK_HD u32 philox_word0(u32 c0, u32 c1, u32 c2, u32 c3, u32 k0, u32 k1) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    const u32 hi0 = mulhi32(kPhiloxM0, c0), lo0 = kPhiloxM0 * c0;
    const u32 hi1 = mulhi32(kPhiloxM1, c2), lo1 = kPhiloxM1 * c2;
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += kPhiloxW0;
    k1 += kPhiloxW1;
  }
  return c0;
}

// u = (2 * (bits >> 9) + 1) * 2^-24: exact (a 24-bit odd integer times a power of two).
BIK_HD float bits_to_unit(u32 bits) {
  return mul_rn(float(((bits >> 9) << 1) | 1u), 5.9604644775390625e-08f);
}

// Natural log of a positive normal fp32 from exactly rounded operations (see sampling.h).
BIK_HD float bik_log(float x) {
  const u32 b = bits_of(x);
  i32 e = i32(b >> 23) - 127;
  u32 mb = (b & 0x007FFFFFu) | 0x3F800000u;
  if (mb > 0x3FB504F3u) {
    mb -= 0x00800000u;
    e += 1;
  }
  const float f = sub_rn(f32_from_bits(mb), 1.0f);
  float q = -0.07866687327623367f;
  q = add_rn(mul_rn(q, f), 0.12821781635284424f);
  q = add_rn(mul_rn(q, f), -0.13101640343666077f);
  q = add_rn(mul_rn(q, f), 0.14188995957374573f);
  q = add_rn(mul_rn(q, f), -0.1662759929895401f);
  q = add_rn(mul_rn(q, f), 0.2000196874141693f);
  q = add_rn(mul_rn(q, f), -0.2500077188014984f);
  q = add_rn(mul_rn(q, f), 0.33333322405815125f);
  q = add_rn(mul_rn(q, f), -0.4999999701976776f);
  const float p = add_rn(mul_rn(q, f), 1.0f);
  const float l = mul_rn(f, p);
  const float ef = float(e);
  return add_rn(mul_rn(ef, 0.693145751953125f), add_rn(mul_rn(ef, 1.428606765330187e-06f), l));
}

// exp(x) for x <= 0 from exactly rounded operations (see sampling.h): 0 below -86, never a
// subnormal (so flushing them changes nothing).
BIK_HD float bik_exp(float x) {
  if (!(x >= -86.0f)) return 0.0f;
#if defined(__CUDA_ARCH__)
  const float k = floorf(add_rn(mul_rn(x, 1.4426950216293335f), 0.5f));
#else
  const float k = std::floor(add_rn(mul_rn(x, 1.4426950216293335f), 0.5f));
#endif
  const float r = sub_rn(sub_rn(x, mul_rn(k, 0.693359375f)), mul_rn(k, -0.00021219444170128554f));
  float q = add_rn(mul_rn(r, 0.00019875691214110702f), 0.001398199936375022f);
  q = add_rn(mul_rn(q, r), 0.008333452045917511f);
  q = add_rn(mul_rn(q, r), 0.04166579619050026f);
  q = add_rn(mul_rn(q, r), 0.1666666567325592f);
  q = add_rn(mul_rn(q, r), 0.5f);
  const float p = add_rn(add_rn(mul_rn(q, mul_rn(r, r)), r), 1.0f);
  return mul_rn(p, f32_from_bits(u32(i32(k) + 127) << 23));
}

// 0 - bik_log(0 - bik_log(u)): negation as a subtraction from +0, as on the other backends.
BIK_HD float gumbel_from_unit(float u) { return sub_rn(0.0f, bik_log(sub_rn(0.0f, bik_log(u)))); }

// The noise of token `token` at absolute position `position` for `seed` (counter = (token,
// pos lo, pos hi, stream), key = (seed lo, seed hi)).
BIK_HD float gumbel(u64 seed, u64 position, u32 token, u32 stream) {
  const u32 bits = philox_word0(token, u32(position), u32(position >> 32), stream, u32(seed),
                                u32(seed >> 32));
  return gumbel_from_unit(bits_to_unit(bits));
}

// fp32 total order key (non-NaN): key(a) < key(b) iff a < b, with -0 < +0.
BIK_HD i64 order_key(float v) {
  const i32 b = i32(bits_of(v));
  return b >= 0 ? i64(b) : i64(b ^ 0x7FFFFFFF);
}

BIK_HD float from_order_key(i64 k) {
  const i32 b = i32(k);
  return f32_from_bits(u32(b >= 0 ? b : (b ^ 0x7FFFFFFF)));
}

// z = x / T (correctly rounded), or x itself for greedy rows (T == 0).
BIK_HD float tempered(float x, float temperature) {
  return temperature > 0.0f ? div_rn(x, temperature) : x;
}

// top-k keep rule for the k-th token (vk, ik) in the order (z desc, index asc).
BIK_HD bool kept_k(float z, i64 j, float vk, i64 ik) { return z > vk || (z == vk && j <= ik); }

// (value desc, index asc): true when candidate (v, j) beats (bv, bj). A total order for
// non-NaN values, so any split of the vocabulary and any merge order pick the same token.
BIK_HD bool better(float v, i64 j, float bv, i64 bj) { return v > bv || (v == bv && j < bj); }

// ---- the normaliser (docs/design.md#sampler): vocabulary chunks in the kernel's layout ------
// A chunk of kSamplerChunk tokens is one warp's: lane l holds tokens l + 32 i in register i, so
// the contract's pairwise fold by halves is fold_registers (w = 512 ... 32: registers i and
// i + w / 32 of one lane) and then the lanes (w = 16 ... 1: an xor-shuffle butterfly, equal to
// lane 0's tree because fp32 addition is commutative).
constexpr i64 kSamplerChunk = 1024;  // bik.configs.SAMPLER_CHUNK (the launcher checks)
constexpr int kChunkRegs = int(kSamplerChunk / 32);

// One step of the fold: s[i] = s[i] + s[i + W] for i < W (a constant trip count, unrolled, so
// the registers stay registers).
template <int W>
BIK_HD void fold_step(float (&s)[kChunkRegs]) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int i = 0; i < W; ++i) s[i] = add_rn(s[i], s[i + W]);
}

// The steps after the first (w = 256 ... 32 in tokens): s[0 .. 15] hold s[i] + s[i + 16].
BIK_HD float fold_registers_after_first_step(float (&s)[kChunkRegs]) {
  fold_step<8>(s);
  fold_step<4>(s);
  fold_step<2>(s);
  fold_step<1>(s);
  return s[0];
}

BIK_HD float fold_registers(float (&s)[kChunkRegs]) {
  static_assert(kChunkRegs == 32, "fold_registers is written for 32 registers per lane");
  fold_step<16>(s);
  return fold_registers_after_first_step(s);
}

// A token's normaliser term: bik_exp(z - m) when top-k keeps it and z >= threshold, else +0.
BIK_HD float normaliser_term(float z, i64 j, float vk, i64 ik, float threshold, float m) {
  return kept_k(z, j, vk, ik) && z >= threshold ? bik_exp(sub_rn(z, m)) : 0.0f;
}

// ---- top-p's probe search (docs/design.md#sampler, "Triton's top-p search": the same search) --
// v_p is defined by exact masses only, and a probe's exact mass says on which side of it v_p
// lies, so each pass over the row probes kProbeLanes thresholds and narrows a key bracket
// [lo, hi) with M(lo) >= target > M(hi). Pass 0: a grid below m, min-p's bound and -inf (S).
// Later passes split the bracket's keys kProbeLanes + 1 ways while collecting the bracket's kept
// finite tokens (the first kTopPCandidates), or, once that collection held the whole bracket
// and at most kProbeLanes of its tokens lie in the narrowed one, probe exactly their values (M
// changes only at kept tokens' values, so v_p is one of them) and end. The probes decide the
// pass count, never the cut: the bisection's v_p, the CPU's bits.
constexpr int kProbeLanes = 16;
constexpr i64 kTopPCandidates = 256;
// Pass 0, the splits that take any bracket of 2^32 + 1 keys to one (17^8 > 2^32 + 1), and one
// candidates pass.
constexpr int kTopPPasses = 10;

// The search's state between passes. The multi-CTA kernel keeps it in global memory between
// its launches (bik_sample_pass_<t>), row_cut in registers.
struct CutState {
  float probes[kProbeLanes];  // the thresholds the next pass probes
  i64 lo, hi;                 // the key bracket: M(lo) >= target > M(hi)
  float target, lo_mass, mass_min_p;
  i32 final;   // the probes are every kept token of the bracket: the next pass ends the search
  i32 passes;  // passes taken
};
constexpr i64 kCutStateBytes = 128;  // per row in the launcher's buffer
static_assert(sizeof(CutState) <= kCutStateBytes, "CutState outgrew its buffer");

// A value another block may have written during this launch: read past L1 on the device.
template <class V>
BIK_HD V read_cg(const V* p) {
#if defined(__CUDA_ARCH__)
  return __ldcg(p);
#else
  return *p;
#endif
}

// Before pass 0: a grid below m, min-p's bound v_m and -inf (whose mass is S).
BIK_HD void cut_start(CutState& st, float m_safe, float v_m) {
  for (int k = 0; k < kProbeLanes - 2; ++k)
    st.probes[k] = sub_rn(m_safe, mul_rn(0.45f, float((k + 1) * (k + 1))));
  st.probes[kProbeLanes - 2] = v_m;
  st.probes[kProbeLanes - 1] = -inf_f32();
  st.lo = order_key(-inf_f32());
  st.hi = order_key(m_safe) + 1;
  st.target = st.lo_mass = st.mass_min_p = 0.0f;
  st.final = 0;
  st.passes = 0;
}

BIK_HD bool cut_open(const CutState& st) { return st.lo + 1 < st.hi; }

// Collect the bracket's tokens in pass `it` when a buffer of kTopPCandidates can hold a whole
// share (group_len tokens each) of pass 0's bracket, the whole row.
BIK_HD bool cut_collects(int it, i64 share) { return it > 0 || share <= kTopPCandidates; }

// After pass it, masses[k] = M(probes[k]): narrow the bracket (the first half of cut_step).
BIK_HD void cut_narrow(CutState& st, int it, float top_p, const float (&masses)[kProbeLanes]) {
  if (it == 0) {
    st.target = mul_rn(top_p, masses[kProbeLanes - 1]);
    st.lo_mass = masses[kProbeLanes - 1];  // M(-inf) = S
    st.mass_min_p = masses[kProbeLanes - 2];
  }
  st.passes = it + 1;
  for (int k = 0; k < kProbeLanes; ++k) {
    const i64 key = order_key(st.probes[k]);
    if (masses[k] >= st.target) {
      if (key > st.lo) {
        st.lo = key;
        st.lo_mass = masses[k];
      }
    } else if (key < st.hi) {
      st.hi = key;
    }
  }
  if (st.final) st.hi = st.lo + 1;
}

// The second half: the next probes from the scan of the narrowed bracket's candidates. held:
// every buffer held its whole share; inside: the candidates in [lo, hi); picked[0 ..
// min(inside, kProbeLanes)): those candidates in any order (the probes are a set: the bracket
// update takes the largest key whose mass reaches the target and the smallest below it, and
// equal values have equal masses). When they are all there, they are the probes and the next
// pass ends the search; else keys evenly through [lo, hi).
BIK_HD void cut_next(CutState& st, bool collect, bool held, i64 inside, const float* picked) {
  st.final = collect && held && inside <= kProbeLanes ? 1 : 0;
  const float lo_v = from_order_key(st.lo);
  for (int k = 0; k < kProbeLanes; ++k) {
    if (st.final)  // -0 becomes +0 (the bisection's largest key)
      st.probes[k] = k < inside ? add_rn(picked[k], 0.0f) : lo_v;
    else
      st.probes[k] = from_order_key(st.lo + (st.hi - st.lo) * (k + 1) / (kProbeLanes + 1));
  }
}

// One thread's whole step (the host emulation's row_cut): the pass collected (when collect) the
// bracket's kept finite tokens into `buffers` buffers, buffer b holding counts[b] of them, its
// first kTopPCandidates at cand + b * kTopPCandidates (any order: the set matters; on the device
// other blocks wrote them, so they are read past L1). The CUDA pass kernel runs cut_narrow and
// cut_next around a scan spread over its block (sampling.cu decide_block).
BIK_HD void cut_step(CutState& st, int it, float top_p, const float (&masses)[kProbeLanes],
                     bool collect, const float* cand, const i64* counts, int buffers) {
  cut_narrow(st, it, top_p, masses);
  const float lo_v = from_order_key(st.lo), hi_v = from_order_key(st.hi);
  bool held = true;
  i64 inside = 0;
  float picked[kProbeLanes];
  for (int b = 0; b < buffers; ++b) {
    const i64 count = read_cg(counts + b);
    held = held && count <= kTopPCandidates;
    const i64 stored = count < kTopPCandidates ? count : kTopPCandidates;
    for (i64 i = 0; i < stored; ++i) {
      const float c = read_cg(cand + b * kTopPCandidates + i);
      if (!(c >= lo_v && c < hi_v)) continue;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
      for (int k = 0; k < kProbeLanes; ++k) picked[k] = inside == k ? c : picked[k];
      ++inside;
    }
  }
  cut_next(st, collect, held, inside, picked);
}

// The row's cut v_lo (top-p's v_p, then min-p's bound v_m) and the kept mass norm.
BIK_HD void cut_result(const CutState& st, float v_m, float& v_lo, float& norm) {
  const float v_p = from_order_key(st.lo);
  norm = v_p >= v_m ? st.lo_mass : st.mass_min_p;
  v_lo = v_m > v_p ? v_m : v_p;
}

// The whole search in one place (the host emulation in tests): mass(v): the normaliser's sum
// over the top-k-kept tokens with z >= v. probe(probes, lo_v, hi_v, collect, masses): each
// probe's mass(v) into masses, and, when collect, the number of kept finite tokens with z in
// [lo_v, hi_v), the first kTopPCandidates of them (any order) in cand. passes < kTopPPasses
// cuts the search short (a test's control).
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class Mass, class Probe>
BIK_HD void row_cut(const Mass& mass, const Probe& probe, i64 V, float m_safe, float top_p,
                    float log_min_p, const float* cand, float& v_lo, float& norm,
                    int passes = kTopPPasses) {
  const float v_m = add_rn(m_safe, log_min_p);
  if (!(top_p < 1.0f)) {
    v_lo = v_m;
    norm = mass(v_lo);
    return;
  }
  CutState st;
  cut_start(st, m_safe, v_m);
  float masses[kProbeLanes];
  for (int it = 0; it < passes && cut_open(st); ++it) {
    const bool collect = cut_collects(it, V);
    const i64 n = probe(st.probes, from_order_key(st.lo), from_order_key(st.hi), collect, masses);
    cut_step(st, it, top_p, masses, collect, cand, &n, 1);
  }
  cut_result(st, v_m, v_lo, norm);
}

#if !defined(__CUDACC_RTC__) && !defined(__CUDA_ARCH__)
// Host emulation of the kernel's normaliser for tests: each chunk as 32 lanes of kChunkRegs
// registers, fold_registers per lane, then the lanes' pairs (l, l + w), w = 16 ... 1.
template <class Term>
inline float vocab_mass_host(const Term& term, i64 V, i64 group_len) {
  float total = 0.0f;
  for (i64 g0 = 0; g0 < V; g0 += group_len) {
    float group_total = 0.0f;
    for (i64 c0 = g0; c0 < g0 + group_len; c0 += kSamplerChunk) {
      float lanes[32];
      for (int l = 0; l < 32; ++l) {
        float s[kChunkRegs];
        for (int i = 0; i < kChunkRegs; ++i) {
          const i64 j = c0 + l + 32 * i;
          s[i] = j < g0 + group_len ? term(j) : 0.0f;
        }
        lanes[l] = fold_registers(s);
      }
      for (int w = 16; w >= 1; w >>= 1)
        for (int l = 0; l < w; ++l) lanes[l] = add_rn(lanes[l], lanes[l + w]);
      group_total = add_rn(group_total, lanes[0]);
    }
    total = add_rn(total, group_total);
  }
  return total;
}
#endif

// The group max kernel's step for one token: the invalid flag (NaN or +inf in z) and the max over
// the top-k-kept tokens (exact; NaN never compares greater).
BIK_HD void stats_consider(float z, i64 j, float vk, i64 ik, float& mx, bool& bad) {
  if (is_nan(z) || z == inf_f32()) bad = true;
  if (kept_k(z, j, vk, ik) && z > mx) mx = z;
}

// A row's inputs to the pick: temperature, the top-k threshold (vk, ik), the final lower bound
// v_lo (top-p and min-p), floor = fl(m + G_MIN) and the noise key.
struct PickRow {
  float temperature, vk, v_lo, floor;
  i64 ik;
  u64 seed, position;
  u32 stream;
};

// The pick kernel's loop body for token j with logit x: skip filtered tokens and (exactly) those
// whose best possible score fl(z + G_MAX) is below the max token's worst fl(m + G_MIN); else
// score z + g (z when greedy) and keep the better of it and (best_v, best_i) under (value desc,
// index asc). Only exactly rounded operations.
BIK_HD void pick_consider(const PickRow& p, float x, i64 j, float& best_v, i32& best_i) {
  const float z = tempered(x, p.temperature);
  if (!kept_k(z, j, p.vk, p.ik) || !(z >= p.v_lo) || z == -inf_f32()) return;
  const bool noisy = p.temperature > 0.0f;
  if (noisy && add_rn(z, kGumbelMax) < p.floor) return;
  const float s = noisy ? add_rn(z, gumbel(p.seed, p.position, u32(j), p.stream)) : z;
  if (better(s, j, best_v, best_i)) {
    best_v = s;
    best_i = i32(j);
  }
}

}  // namespace sampling
}  // namespace bik
