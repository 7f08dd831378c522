// The bf16 matmul on the bf16 dot sequence of contract.h (a and b both bf16), two ways:
//   Fma: each term one fp32 fused multiply-add of the widened pair halves, with MXCSR's DAZ and
//        FTZ set around the K loop (a bf16 x bf16 product is exact, so the FMA's one rounding
//        is the step's); on any x86 CPU with FMA (AVX2 or AVX-512).
//   Vdp: one vdpbf16ps lane per pair (AVX512_BF16), which does the same two steps by itself.
// Measured on the CI machine (`bik bench linear`, its kernel columns): the FMA kernel runs
// 1.1-1.2x as fast as the vdpbf16ps one at M = 8 and 1.5-1.6x at M = 64, so it is the
// default (docs/design.md).
//
// Included by bindings.cpp inside an ISA's namespace (it reuses that ISA's VW, MR, NRV, NRW,
// MC, transposes, loads, accumulator load/store and split fold) and a target region with FMA;
// BIK_DOT_VDPBF16 = 1 adds the Vdp kernel (compiled for avx512bf16 on its own). The scalar
// transcription of the same sequence, which runs on any CPU, is dot_reference.h. No include
// guard on purpose.

namespace dot {

using u16 = std::uint16_t;
using u32 = std::uint32_t;
typedef u32 vtw __attribute__((vector_size(TW * 4)));

// One pair word holds (x[k], x[k+1]) with x[k] in the high half: vdpbf16ps multiplies and adds
// a lane's high halves first, so the lane's sequence is k-ascending.
static inline __attribute__((always_inline)) u32 pair_word(u16 first, u16 second) {
  return (u32(first) << 16) | u32(second);
}

// Pair words for kc elements (an odd kc ends with the pair (x[kc-1], +0)).
static inline idx_t pairs(idx_t kc) { return (kc + 1) / 2; }

// The pair index where element k starts, with pairs counted from each split's start: every
// split of length `split` takes pairs(split) words, so a split's pairs never straddle two.
static inline idx_t pair_index(idx_t k, idx_t split) {
  return (k / split) * pairs(split) + pairs(k % split);
}

// Packs b[pc:pc+kc, jc:jc+nc] (bf16 bits) into pair panels: panel p at dst + p * stride
// (stride >= pairs(kc) * NRW), word [j][col] = pair_word(b[pc+2j, n], b[pc+2j+1, n]), the odd
// tail's second half and the columns past nc zero. Copies only.
static void pack_b(const u16* b, idx_t sbk, idx_t sbn, idx_t pc, idx_t kc, idx_t jc, idx_t nc,
                   u32* dst, idx_t stride) {
  const idx_t np = pairs(kc);
  const idx_t whole = kc / 2;  // pairs with both halves inside the block
  const idx_t panels = (nc + NRW - 1) / NRW;
  for (idx_t p = 0; p < panels; ++p) {
    u32* d = dst + p * stride;
    const idx_t n0 = jc + p * NRW;
    const idx_t w = nc - p * NRW < NRW ? nc - p * NRW : NRW;
    idx_t j0 = 0;
    if (sbk == 1) {
      // A weight row (b = weight.t()) holds (b[k, n], b[k+1, n]) as one 32-bit word with b[k]
      // in the low half: TW x TW word tiles are transposed, then each word's halves swapped.
      for (int g = 0; g < NRW / TW; ++g) {
        const idx_t gn = n0 + idx_t(g) * TW;
        const idx_t gw = w - idx_t(g) * TW;
        for (idx_t j = 0; j + TW <= whole; j += TW) {
          for (int t = 0; t < TW; ++t)
            if (t < gw) __builtin_prefetch(b + (gn + t) * sbn + pc + 2 * j + 256);
          vt v[TW];
#pragma GCC unroll 16
          for (int t = 0; t < TW; ++t)
            v[t] = t < gw ? loadu<vt>(reinterpret_cast<const float*>(b + (gn + t) * sbn + pc +
                                                                     2 * j))
                          : vt{};
          transpose(v);
#pragma GCC unroll 16
          for (int t = 0; t < TW; ++t) {
            vtw u;
            std::memcpy(&u, &v[t], sizeof u);
            u = (u << 16) | (u >> 16);
            std::memcpy(d + (j + t) * NRW + g * TW, &u, sizeof u);
          }
        }
      }
      j0 = whole / TW * TW;
    }
    for (idx_t j = j0; j < np; ++j) {
      const idx_t k = pc + 2 * j;
      const bool second = 2 * j + 1 < kc;
      for (idx_t t = 0; t < NRW; ++t) {
        const idx_t n = n0 + t;
        d[j * NRW + t] = t < w ? pair_word(b[k * sbk + n * sbn],
                                           second ? b[(k + 1) * sbk + n * sbn] : u16(0))
                               : 0u;
      }
    }
  }
}

static inline __attribute__((always_inline)) vf fma_v(vf a, vf b, vf c) {
#if BIK_DOT_VW == 16
  return _mm512_fmadd_ps(a, b, c);
#else
  return _mm256_fmadd_ps(a, b, c);
#endif
}

// x in every lane, bits unchanged (vf{} + x would turn -0 into +0, and under DAZ a negative
// denormal too).
static inline __attribute__((always_inline)) vf bcast(const float* x) {
#if BIK_DOT_VW == 16
  return _mm512_set1_ps(*x);
#else
  return _mm256_set1_ps(*x);
#endif
}

typedef u32 vu __attribute__((vector_size(VW * 4)));

// Pairs ahead that the FMA kernel prefetches B (speed only).
constexpr idx_t kPrefetchPairs = 48;

// Rows per register block: 8 on AVX-512 (16 accumulators, 4 widened B vectors and 2 broadcasts
// of its 32 registers; a decode batch of 8 is then one block), the ISA's own elsewhere.
constexpr int DMR = VW == 16 ? 8 : MR;
static_assert(MC % DMR == 0, "blocking must tile");

// The Fma kernel. A is packed as widened floats [blk][pair][DMR][2] (a[k], a[k+1]); a B pair
// word's high half masked is b[k] as fp32, shifted left 16 it is b[k+1]. Each lane: fma with
// b[k], then with b[k+1]: the contract's two steps under DAZ / FTZ, which the tile sets.
struct Fma {
  using PackedA = float;
  static constexpr int kRows = DMR;  // rows per register block
  static constexpr idx_t kKAlign = 2;  // K blocks hold whole pairs
  static void begin() {}  // around a tile call's micro kernels (AMX configures its tiles)
  static void end() {}
  static constexpr idx_t a_words(idx_t np) { return 2 * np; }

  static void pack_a(const u16* a, idx_t sam, idx_t sak, idx_t ic, idx_t mc, idx_t pc,
                     idx_t kc, float* dst) {
    const idx_t np = pairs(kc);
    for (idx_t r0 = 0; r0 < mc; r0 += DMR) {
      float* d = dst + r0 * 2 * np;
      const idx_t rows = mc - r0 < DMR ? mc - r0 : DMR;
      for (idx_t r = 0; r < rows; ++r) {
        const u16* s = a + (ic + r0 + r) * sam + pc * sak;
        for (idx_t j = 0; j < np; ++j) {
          d[(j * DMR + r) * 2] = bf16_f32(s[2 * j * sak]);
          d[(j * DMR + r) * 2 + 1] = 2 * j + 1 < kc ? bf16_f32(s[(2 * j + 1) * sak]) : 0.0f;
        }
      }
    }
  }

  template <int R>
  static void micro(const float* __restrict pa, const u32* __restrict pb, idx_t np,
                    float* __restrict c, idx_t ldc, idx_t cols, bool first) {
    vf acc[R][NRV];
    load_acc<R>(acc, c, ldc, cols, first);
    const vu high = vu{} + 0xffff0000u;
    for (idx_t j = 0; j < np; ++j) {
      // A panel is read once, front to back, straight from memory when the weight is packed
      // (decode): ask for its lines well ahead of the loads.
      __builtin_prefetch(pb + (j + kPrefetchPairs) * NRW);
      __builtin_prefetch(pb + (j + kPrefetchPairs) * NRW + 16);
      // One vector of B at a time: its two widened halves and the R accumulators it feeds
      // (AVX2's 16 registers hold 12 accumulators, 2 halves and a broadcast).
#pragma GCC unroll 8
      for (int v = 0; v < NRV; ++v) {
        vu w;
        std::memcpy(&w, pb + j * NRW + v * VW, sizeof w);
        const vu w0 = w & high, w1 = w << 16;
        vf b0, b1;
        std::memcpy(&b0, &w0, sizeof w0);
        std::memcpy(&b1, &w1, sizeof w1);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const float* ar = pa + (j * DMR + r) * 2;
          acc[r][v] = fma_v(bcast(ar + 1), b1, fma_v(bcast(ar), b0, acc[r][v]));
        }
      }
    }
    store_acc<R>(acc, c, ldc, cols);
  }

 private:
  static inline float bf16_f32(u16 h) {
    const u32 u = u32(h) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
};

#if BIK_DOT_VDPBF16
// The Vdp kernel: A packed as pair words [blk][pair][DMR]; one vdpbf16ps per pair and vector.
struct Vdp {
  using PackedA = u32;
  static constexpr int kRows = DMR;
  static constexpr idx_t kKAlign = 2;
  static void begin() {}
  static void end() {}
  static constexpr idx_t a_words(idx_t np) { return np; }

  static void pack_a(const u16* a, idx_t sam, idx_t sak, idx_t ic, idx_t mc, idx_t pc,
                     idx_t kc, u32* dst) {
    const idx_t np = pairs(kc);
    for (idx_t r0 = 0; r0 < mc; r0 += DMR) {
      u32* d = dst + r0 * np;
      const idx_t rows = mc - r0 < DMR ? mc - r0 : DMR;
      for (idx_t r = 0; r < rows; ++r) {
        const u16* s = a + (ic + r0 + r) * sam + pc * sak;
        for (idx_t j = 0; j < np; ++j)
          d[j * DMR + r] =
              pair_word(s[2 * j * sak], 2 * j + 1 < kc ? s[(2 * j + 1) * sak] : u16(0));
      }
    }
  }

  template <int R>
  __attribute__((target("avx512bf16"))) static void micro(const u32* __restrict pa,
                                                         const u32* __restrict pb, idx_t np,
                                                         float* __restrict c, idx_t ldc,
                                                         idx_t cols, bool first) {
    static_assert(VW == 16, "vdpbf16ps on 512-bit vectors");
    vf acc[R][NRV];
    load_acc<R>(acc, c, ldc, cols, first);
    for (idx_t j = 0; j < np; ++j) {
      __m512bh bv[NRV];
#pragma GCC unroll 8
      for (int v = 0; v < NRV; ++v) bv[v] = (__m512bh)_mm512_loadu_si512(pb + j * NRW + v * VW);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m512bh av = (__m512bh)_mm512_set1_epi32(int(pa[j * DMR + r]));
#pragma GCC unroll 8
        for (int v = 0; v < NRV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], av, bv[v]);
      }
    }
    store_acc<R>(acc, c, ldc, cols);
  }
};
#endif

template <class Kern, int... R>
static inline void micro_rows(int rows, std::integer_sequence<int, R...>,
                              const typename Kern::PackedA* pa, const u32* pb, idx_t np, float* c,
                              idx_t ldc, idx_t cols, bool first) {
  (void)((rows == R + 1 ? (Kern::template micro<R + 1>(pa, pb, np, c, ldc, cols, first), true)
                        : false) ||
         ...);
}

// MXCSR with DAZ and FTZ for the steps of one split's K blocks, the caller's value back for the
// folds and the bias (contract.h: plain fp32 adds). The "memory" clobbers keep the steps, which
// read A and B and write c from memory, between the two.
class FlushGuard {
 public:
  FlushGuard() {
    __asm__ volatile("stmxcsr %0" : "=m"(saved_) : : "memory");
    const unsigned flush = saved_ | 0x8040u;  // FTZ (bit 15) | DAZ (bit 6)
    __asm__ volatile("ldmxcsr %0" : : "m"(flush) : "memory");
  }
  ~FlushGuard() { __asm__ volatile("ldmxcsr %0" : : "m"(saved_) : "memory"); }
  FlushGuard(const FlushGuard&) = delete;
  FlushGuard& operator=(const FlushGuard&) = delete;

 private:
  unsigned saved_ = 0;
};

// One thread's share, as the ISA's fp32 matmul_tile (same splits, same fold, same scratch
// layout and size), with a and b bf16: rows [m0, m1), columns [n0, n1). K blocks are even, so
// a block's pairs are its split's. The bias is added by the fold after the last split, under
// the caller's MXCSR. `packed`, when not null, is all of B packed once by pack_b_all.
template <class Kern>
static void matmul_tile(const u16* a, idx_t sam, idx_t sak, const u16* b, idx_t sbk, idx_t sbn,
                        const float* bias, float* c, idx_t ldc, idx_t m0, idx_t m1, idx_t n0,
                        idx_t n1, idx_t K, idx_t split, idx_t KC, idx_t NC, float* scratch,
                        const u32* packed) {
  using PA = typename Kern::PackedA;
  // Pair words and widened A fit where the fp32 tile keeps floats (even KC).
  const size_t b_floats = (size_t(KC) * size_t(NC) + 15) & ~size_t(15);
  u32* bufb = reinterpret_cast<u32*>(scratch);
  PA* bufa = reinterpret_cast<PA*>(scratch + b_floats);
  float* part = scratch + b_floats + size_t(MC) * size_t(KC) + 16;
  if (split <= 0 || split >= K) split = K > 0 ? K : 1;
  // K blocks of whole pairs (and, for Amx, of whole instructions' blocks from the split start)
  KC = KC < Kern::kKAlign ? Kern::kKAlign : KC / Kern::kKAlign * Kern::kKAlign;
  const idx_t panel_pairs = pair_index(K, split);
  for (idx_t jc = n0; jc < n1; jc += NC) {
    const idx_t nc = n1 - jc < NC ? n1 - jc : NC;
    idx_t lo = 0;
    do {  // each split at least once, so K == 0 still writes 0.0f (+ bias)
      const idx_t hi = K - lo < split ? K : lo + split;
      const bool in_c = lo == 0;
      const idx_t ldd = in_c ? ldc : NC;
      {
        FlushGuard flush;
        Kern::begin();
        idx_t pc = lo;
        do {
          const idx_t kc = hi - pc < KC ? hi - pc : KC;
          const idx_t np = pairs(kc);
          const bool first = pc == lo;
          const u32* pb = bufb;
          idx_t panel_stride = np * NRW;
          if (packed) {
            pb = packed + (jc / NRW) * panel_pairs * NRW + pair_index(pc, split) * NRW;
            panel_stride = panel_pairs * NRW;
          } else if (kc > 0) {
            pack_b(b, sbk, sbn, pc, kc, jc, nc, bufb, panel_stride);
          }
          for (idx_t ic = m0; ic < m1; ic += MC) {
            const idx_t mc = m1 - ic < MC ? m1 - ic : MC;
            Kern::pack_a(a, sam, sak, ic, mc, pc, kc, bufa);
            // panel outside, row blocks inside (kernels_isa.h's matmul_tile says why)
            for (idx_t jr = 0; jr < nc; jr += NRW) {
              const idx_t cols = nc - jr < NRW ? nc - jr : NRW;
              for (idx_t ir = 0; ir < mc; ir += Kern::kRows) {
                const int rows = int(mc - ir < Kern::kRows ? mc - ir : Kern::kRows);
                float* cc = in_c ? c + (ic + ir) * ldc + jc + jr
                                 : part + (ic + ir - m0) * NC + jr;
                micro_rows<Kern>(rows, std::make_integer_sequence<int, Kern::kRows>{},
                                 bufa + ir * Kern::a_words(np), pb + (jr / NRW) * panel_stride,
                                 np, cc, ldd, cols, first);
              }
            }
          }
          pc += kc;
        } while (pc < hi);
        Kern::end();
      }
      const float* tail_bias = (hi >= K && bias) ? bias + jc : nullptr;
      if (!in_c || tail_bias)
        fold_part(c + m0 * ldc + jc, ldc, in_c ? nullptr : part, NC, m1 - m0, nc, tail_bias);
      lo = hi;
    } while (lo < K);
  }
}

// All of b[K, N] in pair panels for PackedWeight: panel p holds pair_index(K, split) pair rows,
// each split's pairs from its own start (what matmul_tile reads in place).
static void pack_b_all(const u16* b, idx_t sbk, idx_t sbn, idx_t K, idx_t N, idx_t split,
                       u32* dst) {
  if (split <= 0 || split >= K) split = K > 0 ? K : 1;
  const idx_t stride = pair_index(K, split) * NRW;
  for (idx_t lo = 0; lo < K; lo += split) {
    const idx_t kc = K - lo < split ? K - lo : split;
    pack_b(b, sbk, sbn, lo, kc, 0, N, dst + pair_index(lo, split) * NRW, stride);
  }
}

#if BIK_DOT_AMX
#include "matmul_bf16_amx.h"
#endif
}  // namespace dot
