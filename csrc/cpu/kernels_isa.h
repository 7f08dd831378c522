// One ISA's instantiation of the bik CPU kernels (numerics contract: contract.h).
//
// Included once per ISA by bindings.cpp, inside a `#pragma GCC target` region, with these set:
//   BIK_NS   namespace name           BIK_VW   floats per SIMD vector (16, 8, 4)
//   BIK_MR   rows per register block  BIK_NRV  vectors of N per register block
//   BIK_MC   M block (multiple of BIK_MR)
// The K and N blocks are chosen per call (bindings.cpp).
// The blocking only changes speed: every path runs the per-element sequence of the contract.
// No include guard on purpose.

namespace bik_cpu {
namespace BIK_NS {

constexpr int VW = BIK_VW;
constexpr int MR = BIK_MR;
constexpr int NRV = BIK_NRV;
constexpr int NRW = VW * NRV;  // columns per packed B panel
constexpr idx_t MC = BIK_MC;
static_assert(MC % MR == 0, "blocking must tile");

typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vf16 __attribute__((vector_size(64)));  // rms_norm's 16 lanes

template <class V>
static inline __attribute__((always_inline)) V loadu(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <class V>
static inline __attribute__((always_inline)) void storeu(float* p, V v) {
  std::memcpy(p, &v, sizeof v);
}

// ---- packing (copies only: exact) -------------------------------------------------------------

// Transposes of TW x TW tiles for packing b = weight.t(). TW = 8 even on AVX-512: 256-bit
// shuffles are cheaper there per element than 512-bit ones (Zen 4 splits those in two).
constexpr int TW = VW < 8 ? VW : 8;
typedef float vt __attribute__((vector_size(TW * 4)));

// One Eklundh stage on rows a (index i) and b (index i + H) of a TW x TW tile.
template <int H, int... C>
static inline __attribute__((always_inline)) void tstage(vt& a, vt& b,
                                                         std::integer_sequence<int, C...>) {
  vt na = __builtin_shufflevector(a, b, ((C & H) ? TW + C - H : C)...);
  vt nb = __builtin_shufflevector(a, b, ((C & H) ? TW + C : C + H)...);
  a = na;
  b = nb;
}
template <int H>
static inline __attribute__((always_inline)) void tlevel(vt* v) {
#pragma GCC unroll 16
  for (int i = 0; i < TW; ++i)
    if ((i & H) == 0) tstage<H>(v[i], v[i + H], std::make_integer_sequence<int, TW>{});
}
static inline __attribute__((always_inline)) void transpose(vt* v) {
  if constexpr (TW >= 8) tlevel<4>(v);
  tlevel<2>(v);
  tlevel<1>(v);
}

// B may be fp32 or bf16 (its bit pattern as uint16_t): packing widens bf16 to fp32, which is
// exact (the 16 bits become the high half of the fp32 pattern), so a bf16 B gives the bits of
// the same B upcast to fp32 first, and a weight is never copied to fp32 outside the panels.
static inline __attribute__((always_inline)) float to_f32(float x) { return x; }
static inline __attribute__((always_inline)) float to_f32(std::uint16_t h) {
  const std::uint32_t u = std::uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
typedef std::uint16_t vth __attribute__((vector_size(TW * 2)));
typedef std::uint32_t vtu __attribute__((vector_size(TW * 4)));
static inline __attribute__((always_inline)) vt load_vt(const float* p) { return loadu<vt>(p); }
static inline __attribute__((always_inline)) vt load_vt(const std::uint16_t* p) {
  vth h;
  std::memcpy(&h, p, sizeof h);
  const vtu u = __builtin_convertvector(h, vtu) << 16;
  vt v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}
static inline __attribute__((always_inline)) void copy_row(float* d, const float* s, idx_t n) {
  std::memcpy(d, s, 4 * size_t(n));
}
static inline __attribute__((always_inline)) void copy_row(float* d, const std::uint16_t* s,
                                                           idx_t n) {
  for (idx_t j = 0; j < n; ++j) d[j] = to_f32(s[j]);
}

// Packs b[pc:pc+kc, jc:jc+nc] into panels of NRW columns: dst[p][k][NRW], zero-padded past nc.
template <class TB>
static void pack_b(const TB* b, idx_t sbk, idx_t sbn, idx_t pc, idx_t kc, idx_t jc, idx_t nc,
                   float* dst) {
  const idx_t panels = (nc + NRW - 1) / NRW;
  if (sbn == 1) {  // rows of b contiguous: row copies, k outer so each row is read in order
    const idx_t full = nc / NRW;
    for (idx_t k = 0; k < kc; ++k) {
      const TB* s = b + (pc + k) * sbk + jc;
      for (idx_t p = 0; p < full; ++p) copy_row(dst + (p * kc + k) * NRW, s + p * NRW, NRW);
      if (full < panels) {
        float* dk = dst + (full * kc + k) * NRW;
        for (idx_t j = 0; j < NRW; ++j)
          dk[j] = full * NRW + j < nc ? to_f32(s[full * NRW + j]) : 0.0f;
      }
    }
    return;
  }
  for (idx_t p = 0; p < panels; ++p) {
    float* d = dst + p * kc * NRW;
    const idx_t n0 = jc + p * NRW;
    const idx_t w = nc - p * NRW < NRW ? nc - p * NRW : NRW;
    if (sbk == 1) {  // columns of b contiguous (b = weight.t()): tile transposes
      for (int g = 0; g < NRW / TW; ++g) {
        const idx_t gn = n0 + idx_t(g) * TW;
        const idx_t gw = w - idx_t(g) * TW;  // valid columns in this group (may be <= 0)
        idx_t k = 0;
        for (; k + TW <= kc; k += TW) {
          // TW weight rows are read side by side: prefetch ahead so memory keeps up.
          for (int t = 0; t < TW; ++t)
            if (t < gw) __builtin_prefetch(b + (gn + t) * sbn + pc + k + 128);
          vt v[TW];
#pragma GCC unroll 16
          for (int t = 0; t < TW; ++t)
            v[t] = t < gw ? load_vt(b + (gn + t) * sbn + pc + k) : vt{};
          transpose(v);
#pragma GCC unroll 16
          for (int t = 0; t < TW; ++t) storeu(d + (k + t) * NRW + g * TW, v[t]);
        }
        for (; k < kc; ++k)
          for (int t = 0; t < TW; ++t)
            d[k * NRW + g * TW + t] = t < gw ? to_f32(b[(gn + t) * sbn + pc + k]) : 0.0f;
      }
    } else {  // any strides (including 0)
      for (idx_t k = 0; k < kc; ++k)
        for (idx_t j = 0; j < NRW; ++j)
          d[k * NRW + j] = j < w ? to_f32(b[(pc + k) * sbk + (n0 + j) * sbn]) : 0.0f;
    }
  }
}

// Packs a[ic:ic+mc, pc:pc+kc] into blocks of MR rows: dst[blk][k][MR] (rows past mc unused).
static void pack_a(const float* a, idx_t sam, idx_t sak, idx_t ic, idx_t mc, idx_t pc, idx_t kc,
                   float* dst) {
  for (idx_t r0 = 0; r0 < mc; r0 += MR) {
    float* d = dst + r0 * kc;
    const idx_t rows = mc - r0 < MR ? mc - r0 : MR;
    for (idx_t r = 0; r < rows; ++r) {
      const float* s = a + (ic + r0 + r) * sam + pc * sak;
      for (idx_t k = 0; k < kc; ++k) d[k * MR + r] = s[k * sak];
    }
  }
}

// ---- matmul micro-kernel ----------------------------------------------------------------------

// The accumulators of an R x NRW block: 0.0f for a split's first K block, else what the
// previous K block stored in c (fp32, exact). Shared by the fp32 and the bf16 dot kernels.
template <int R>
static inline __attribute__((always_inline)) void load_acc(vf (&acc)[R][NRV], const float* c,
                                                           idx_t ldc, idx_t cols, bool first) {
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int v = 0; v < NRV; ++v) {
      if (first) {
        acc[r][v] = vf{};
      } else if (cols == NRW) {
        acc[r][v] = loadu<vf>(c + r * ldc + v * VW);
      } else {
        alignas(64) float t[VW] = {};
        for (idx_t j = v * VW; j < cols && j < (v + 1) * VW; ++j) t[j - v * VW] = c[r * ldc + j];
        acc[r][v] = loadu<vf>(t);
      }
    }
  }
}

template <int R>
static inline __attribute__((always_inline)) void store_acc(const vf (&acc)[R][NRV], float* c,
                                                            idx_t ldc, idx_t cols) {
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    if (cols == NRW) {
#pragma GCC unroll 8
      for (int v = 0; v < NRV; ++v) storeu(c + r * ldc + v * VW, acc[r][v]);
    } else {
      alignas(64) float t[NRW];
#pragma GCC unroll 8
      for (int v = 0; v < NRV; ++v) storeu(t + v * VW, acc[r][v]);
      for (idx_t j = 0; j < cols; ++j) c[r * ldc + j] = t[j];
    }
  }
}

// The two fp32 sequences of contract.h, as tags (their names mark the FMA code in the object
// file for the test that keeps FMAs out of everything else): MulAdd32 rounds the multiply and
// then the add; Fma32 rounds p + a*b once.
struct MulAdd32 {
  static inline __attribute__((always_inline)) vf step(vf p, float a, vf b) { return p + a * b; }
};
struct Fma32 {
  static inline __attribute__((always_inline)) vf step(vf p, float a, vf b) {
#if BIK_VW == 16
    return _mm512_fmadd_ps(_mm512_set1_ps(a), b, p);
#elif BIK_VW == 8
    return _mm256_fmadd_ps(_mm256_set1_ps(a), b, p);
#else
    vf r;  // no vector FMA in this build: the C library's fmaf is exact by definition
    for (int l = 0; l < VW; ++l) r[l] = std::fmaf(a, b[l], p[l]);
    return r;
#endif
  }
};

// c[0:R, 0:cols] (row pitch ldc) for one packed A block (kc x MR) and one B panel (kc x NRW).
// first: acc starts at 0.0f, else at the fp32 value stored in c by the previous K block.
// bias (already offset to this panel, or null) is added once, after the last K block.
template <int R, class Seq>
static void micro(const float* __restrict pa, const float* __restrict pb, idx_t kc,
                  float* __restrict c, idx_t ldc, idx_t cols, bool first, const float* bias) {
  vf acc[R][NRV];
  load_acc<R>(acc, c, ldc, cols, first);
  for (idx_t k = 0; k < kc; ++k) {
    vf bv[NRV];
#pragma GCC unroll 8
    for (int v = 0; v < NRV; ++v) bv[v] = loadu<vf>(pb + k * NRW + v * VW);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const float av = pa[k * MR + r];
#pragma GCC unroll 8
      for (int v = 0; v < NRV; ++v) acc[r][v] = Seq::step(acc[r][v], av, bv[v]);
    }
  }
  if (bias) {
    alignas(64) float t[NRW] = {};
    for (idx_t j = 0; j < cols; ++j) t[j] = bias[j];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int v = 0; v < NRV; ++v) acc[r][v] = acc[r][v] + loadu<vf>(t + v * VW);
  }
  store_acc<R>(acc, c, ldc, cols);
}

template <class Seq, int... R>
static inline void micro_rows(int rows, std::integer_sequence<int, R...>, const float* pa,
                              const float* pb, idx_t kc, float* c, idx_t ldc, idx_t cols,
                              bool first, const float* bias) {
  // rows in [1, MR]: call micro<rows>.
  (void)((rows == R + 1 ? (micro<R + 1, Seq>(pa, pb, kc, c, ldc, cols, first, bias), true)
                        : false) ||
         ...);
}

// Scratch floats one thread needs for K block kcb and N block ncb (a multiple of NRW), plus
// part_rows x ncb for the partial of a split after the first (0 when K is one split).
static size_t matmul_scratch_per_thread(idx_t kcb, idx_t ncb, idx_t part_rows) {
  return ((size_t(kcb) * size_t(ncb) + 15) & ~size_t(15)) + size_t(MC) * size_t(kcb) + 16 +
         size_t(part_rows) * size_t(ncb);
}

// part[rows x cols] (pitch ldp) folded into c (pitch ldc): c = c + part, each add rounded (the
// split fold of contract.h); then + bias[col] when bias is given (the epilogue of a split K).
static void fold_part(float* c, idx_t ldc, const float* part, idx_t ldp, idx_t rows, idx_t cols,
                      const float* bias) {
  for (idx_t r = 0; r < rows; ++r) {
    float* cr = c + r * ldc;
    if (part) {
      const float* pr = part + r * ldp;
      for (idx_t j = 0; j < cols; ++j) cr[j] = cr[j] + pr[j];
    }
    if (bias)
      for (idx_t j = 0; j < cols; ++j) cr[j] = cr[j] + bias[j];
  }
}

// One thread's share: rows [m0, m1), columns [n0, n1). Threads never split K; the K splits of
// contract.h ([s*split, (s+1)*split) clamped to K; split <= 0 or >= K: one split) run one after
// another: the first into c, each later one from zero into scratch `part`, then folded into c.
// K blocks never cross a split, and store/reload the fp32 acc in order. `part` holds
// (m1 - m0) x NC floats when there are several splits (matmul_run bounds m1 - m0).
// `packed`, when not null, is all of B packed once by pack_b (dst[p][k][NRW] for k in [0, K),
// every panel p of N): its panel rows are the ones pack_b would write for each block, read in
// place, so the micro kernel sees the same values in the same order (same bits) without
// packing on every call.
template <class TB, class Seq>
static void matmul_tile(const float* a, idx_t sam, idx_t sak, const TB* b, idx_t sbk,
                        idx_t sbn, const float* bias, float* c, idx_t ldc, idx_t m0, idx_t m1,
                        idx_t n0, idx_t n1, idx_t K, idx_t split, idx_t KC, idx_t NC,
                        float* scratch, const float* packed) {
  float* bufb = scratch;
  float* bufa = scratch + ((size_t(KC) * size_t(NC) + 15) & ~size_t(15));
  float* part = bufa + size_t(MC) * size_t(KC) + 16;
  if (split <= 0 || split >= K) split = K;
  const bool one_split = split == K;
  for (idx_t jc = n0; jc < n1; jc += NC) {
    const idx_t nc = n1 - jc < NC ? n1 - jc : NC;
    idx_t lo = 0;
    do {  // each split at least once, so K == 0 still writes 0.0f (+ bias)
      const idx_t hi = K - lo < split ? K : lo + split;
      // The first split accumulates in c itself, later ones in part (rows from m0, pitch NC).
      const bool in_c = lo == 0;
      const idx_t ldd = in_c ? ldc : NC;
      idx_t pc = lo;
      do {
        const idx_t kc = hi - pc < KC ? hi - pc : KC;
        const bool first = pc == lo;
        const bool last = pc + kc >= hi;
        // Panel jr / NRW of this block starts at pb + (jr / NRW) * panel_stride.
        const float* pb = bufb;
        idx_t panel_stride = kc * NRW;
        if (packed) {
          pb = packed + (jc / NRW) * K * NRW + pc * NRW;  // jc is a multiple of NRW
          panel_stride = K * NRW;
        } else {
          pack_b(b, sbk, sbn, pc, kc, jc, nc, bufb);
        }
        for (idx_t ic = m0; ic < m1; ic += MC) {
          const idx_t mc = m1 - ic < MC ? m1 - ic : MC;
          pack_a(a, sam, sak, ic, mc, pc, kc, bufa);
          // Panel outside, row blocks inside: a B panel is read from memory once and reused
          // from cache by every row block (a packed weight's panels stream past once per call).
          for (idx_t jr = 0; jr < nc; jr += NRW) {
            const idx_t cols = nc - jr < NRW ? nc - jr : NRW;
            for (idx_t ir = 0; ir < mc; ir += MR) {
              const int rows = int(mc - ir < MR ? mc - ir : MR);
              // One split: the bias rides in the last K block's registers (same rounding).
              const float* bb = (one_split && last && bias) ? bias + jc + jr : nullptr;
              float* cc = in_c ? c + (ic + ir) * ldc + jc + jr
                               : part + (ic + ir - m0) * NC + jr;
              micro_rows<Seq>(rows, std::make_integer_sequence<int, MR>{}, bufa + ir * kc,
                         pb + (jr / NRW) * panel_stride, kc, cc, ldd, cols, first, bb);
            }
          }
        }
        pc += kc;
      } while (pc < hi);
      const float* tail_bias = (!one_split && hi >= K && bias) ? bias + jc : nullptr;
      if (!in_c || tail_bias)
        fold_part(c + m0 * ldc + jc, ldc, in_c ? nullptr : part, NC, m1 - m0, nc, tail_bias);
      lo = hi;
    } while (lo < K);
  }
}

// ---- rms_norm ---------------------------------------------------------------------------------

static void rms_norm_rows(const float* x, idx_t sxm, const float* w, float* y, idx_t sym,
                          idx_t m0, idx_t m1, idx_t H, float eps) {
  for (idx_t m = m0; m < m1; ++m) {
    const float* xr = x + m * sxm;
    float* yr = y + m * sym;
    vf16 s = vf16{};
    idx_t j = 0;
    for (; j + 16 <= H; j += 16) {
      const vf16 xv = loadu<vf16>(xr + j);
      s = s + xv * xv;
    }
    if (j < H) {
      alignas(64) float t[16] = {};
      for (idx_t i = j; i < H; ++i) t[i - j] = xr[i];
      const vf16 xv = loadu<vf16>(t);
      s = s + xv * xv;
    }
    alignas(64) float l[16];
    storeu(l, s);
    for (int wd = 8; wd >= 1; wd >>= 1)
      for (int i = 0; i < wd; ++i) l[i] = l[i] + l[i + wd];
    const float mean = l[0] / static_cast<float>(H);
    const float rstd = 1.0f / __builtin_sqrtf(mean + eps);
    j = 0;
    for (; j + VW <= H; j += VW) {
      const vf xv = loadu<vf>(xr + j);
      storeu(yr + j, (xv * rstd) * loadu<vf>(w + j));
    }
    for (; j < H; ++j) yr[j] = (xr[j] * rstd) * w[j];
  }
}

// ---- log_softmax (normaliser.h: the sampler's normaliser) ------------------------------------

typedef std::int32_t vi __attribute__((vector_size(VW * 4)));

// norm::bik_exp on VW lanes, each lane the scalar's sequence. GCC will not vectorise the scalar
// loop (floor and the early return need -fno-trapping-math), so it is written on vectors; floor
// becomes truncate-then-step-down, exact for t in [-124.1, 0.5] (t is never -0).
static inline __attribute__((always_inline)) vf bik_exp_v(vf x) {
  const vi live = x >= -86.0f;
  const vf xs = live ? x : vf{};
  const vf t = xs * 0x1.715476p+0f + 0.5f;
  const vf kt = __builtin_convertvector(__builtin_convertvector(t, vi), vf);
  const vf k = kt > t ? kt - 1.0f : kt;
  const vf r = (xs - k * 0x1.630000p-1f) - k * -0x1.bd0106p-13f;
  vf q = r * 0x1.a0d2cep-13f + 0x1.6e879cp-10f;
  q = q * r + 0x1.111210p-7f;
  q = q * r + 0x1.555382p-5f;
  q = q * r + 0x1.555554p-3f;
  q = q * r + 0x1.000000p-1f;
  const vf p = (q * (r * r) + r) + 1.0f;
  const vi scale_bits = (__builtin_convertvector(k, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &scale_bits, sizeof scale);
  const vf e = p * scale;
  return live ? e : vf{};
}

// The largest entry of a row x[0..n) (-inf for an empty or all -inf row; the max is exact, so
// the vectors' order is free, save the sign of a zero maximum) and whether it holds a NaN.
static float row_max(const float* xr, idx_t n, bool* nan_out) {
  alignas(64) float lanes[VW];
  vf vmax = vf{} - INFINITY;
  vi vnan = vi{};
  idx_t j = 0;
  for (; j + VW <= n; j += VW) {
    const vf v = loadu<vf>(xr + j);
    vnan |= v != v;
    vmax = v > vmax ? v : vmax;
  }
  storeu(lanes, vmax);
  float m = -INFINITY;
  bool nan = false;
  for (int l = 0; l < VW; ++l) {
    m = lanes[l] > m ? lanes[l] : m;
    nan |= vnan[l] != 0;
  }
  for (; j < n; ++j) {
    m = xr[j] > m ? xr[j] : m;
    nan |= xr[j] != xr[j];
  }
  *nan_out = nan;
  return m;
}

// vocab_sum(bik_exp(x[j] - m)) over a row x[0..n) in the normaliser's order, with the chunks'
// terms on vectors (each lane the scalar's sequence): the normaliser of log_softmax_rows and of
// the sampler's unfiltered greedy rows. s: scratch of `chunk` floats.
static float exp_sum_row(const float* xr, idx_t n, float m, idx_t groups, idx_t chunk,
                         float* s) {
  // Each chunk's terms go straight into the scratch the fold reads: one call per chunk.
  const auto terms = [xr, m](idx_t c0, idx_t len, float* d) {
    idx_t t = 0;
    for (; t + VW <= len; t += VW) storeu(d + t, bik_exp_v(loadu<vf>(xr + c0 + t) - m));
    for (; t < len; ++t) d[t] = norm::bik_exp(xr[c0 + t] - m);
  };
  return norm::vocab_sum_chunks(n, {groups, chunk}, terms, s);
}

// log_softmax of rows m0..m1-1 of x [M, n] (unit stride along n) into y, in the sampler's
// normaliser order (docs/design.md#softmax-log_softmax-and-mean): m = max x (exact, so the
// vectors' order is free); a row whose m is not finite (a NaN, a +inf, all -inf) is NaN; else
// y[j] = (x[j] - m) - bik_log(vocab_sum(bik_exp(x[j] - m))). A token's entry is the logprob the sampler reports for it at T = 1 with no filter.
static void log_softmax_rows(const float* x, idx_t sxm, float* y, idx_t sym, idx_t m0,
                             idx_t m1, idx_t n, idx_t groups, idx_t chunk) {
  std::vector<float> s(static_cast<size_t>(chunk));
  for (idx_t row = m0; row < m1; ++row) {
    const float* xr = x + row * sxm;
    float* yr = y + row * sym;
    bool nan = false;
    const float m = row_max(xr, n, &nan);
    idx_t j = 0;
    if (nan || !(m > -INFINITY && m < INFINITY)) {
      for (j = 0; j < n; ++j) yr[j] = NAN;
      continue;
    }
    const float lse = norm::bik_log(exp_sum_row(xr, n, m, groups, chunk, s.data()));
    for (j = 0; j < n; ++j) yr[j] = (xr[j] - m) - lse;
  }
}

}  // namespace BIK_NS
}  // namespace bik_cpu
