// The bf16 matmul on contract.h's bf16 AMX sequence: one tdpbf16ps per 16 pairs (32 terms) of a
// split, from the split's start, on 16 x 16 fp32 accumulator tiles. What the instruction computes
// was measured (tools/amx_probe.py; docs/design.md): per output element and instruction, two
// fp32 chains from +0, one over the block's pair-high terms and one over its pair-low terms,
// then acc + (chain + chain), each add rounded once with flush-to-zero. That order differs from
// the dot sequence's one chain, so this is its own contract; amx_reference.h transcribes it.
//
// Included by bindings.cpp inside the AVX-512 instantiation of matmul_bf16_dot.h's namespace
// (pair words, pair panels and its matmul_tile); the Amx kernel's pack_a keeps each row's pair
// words contiguous (an A tile row), B is the dot path's pair panels read in place (a B tile is
// 16 pair rows of 16 columns, stride NRW words). A block past the split's end is zero-padded:
// +0 terms leave a chain that starts at +0 unchanged. No include guard on purpose.

// The tile configuration ldtilecfg takes (palette 1).
struct alignas(64) AmxConfig {
  std::uint8_t palette = 1, start_row = 0, reserved[14] = {};
  std::uint16_t colsb[16] = {};
  std::uint8_t rows[16] = {};
};

// Pairs per tdpbf16ps (a tile row of 64 bytes).
constexpr idx_t kAmxPairs = 16;

// Loads the one tile configuration every AMX kernel here uses: tiles 0-6, each 16 rows of 64
// bytes (Amx uses 0-4, amx_rows_tile 0-6). From a static: GCC 12 drops stores to a local that
// only ldtilecfg reads (seen in the object code: the rows and widths never written).
__attribute__((target("amx-tile,amx-bf16"))) static void amx_load_config() {
  static const AmxConfig cfg = [] {
    AmxConfig c;
    for (int t = 0; t < 7; ++t) c.colsb[t] = 64, c.rows[t] = 16;
    return c;
  }();
  _tile_loadconfig(&cfg);
}

struct Amx {
  using PackedA = u32;
  static constexpr int kRows = 16;  // an accumulator tile's rows
  static_assert(MC % kRows == 0, "blocking must tile");
  static constexpr idx_t kKAlign = 2 * kAmxPairs;  // K blocks start on an instruction's block
  static constexpr idx_t a_words(idx_t np) { return np; }

  // A as pair words, row-major: dst[r][np] (a block of kRows rows is a run of them).
  static void pack_a(const u16* a, idx_t sam, idx_t sak, idx_t ic, idx_t mc, idx_t pc,
                     idx_t kc, u32* dst) {
    const idx_t np = pairs(kc);
    for (idx_t r = 0; r < mc; ++r) {
      const u16* s = a + (ic + r) * sam + pc * sak;
      u32* d = dst + r * np;
      for (idx_t j = 0; j < np; ++j)
        d[j] = pair_word(s[2 * j * sak], 2 * j + 1 < kc ? s[(2 * j + 1) * sak] : u16(0));
    }
  }

  // Once per tile call (matmul_tile's begin / end): tiles 0 and 1 the two 16-column halves of
  // a panel's accumulators, 2 the A rows, 3 and 4 the B halves, all 16 rows; the call's micro
  // kernels run no other AMX code in between.
  static void begin() { amx_load_config(); }
  __attribute__((target("amx-tile,amx-bf16"))) static void end() { _tile_release(); }

  // c[0:R, 0:cols] += the block's product (first: from +0). A block of fewer than 16 rows
  // computes rows past R from whatever A holds there (rows are independent) and keeps only R.
  template <int R>
  __attribute__((target("amx-tile,amx-bf16"))) static void micro(
      const u32* __restrict pa, const u32* __restrict pb, idx_t np, float* __restrict c,
      idx_t ldc, idx_t cols, bool first) {
    static_assert(NRW == 2 * 16 && R <= kRows, "two 16-column tiles per panel");
    // A whole block's accumulators live in c (row pitch ldc); a tail block's in acc.
    alignas(64) float acc[kRows][NRW];
    const bool whole = cols == NRW && R == kRows;
    if (first) {
      _tile_zero(0);
      _tile_zero(1);
    } else if (whole) {
      _tile_loadd(0, c, ldc * 4);
      _tile_loadd(1, c + 16, ldc * 4);
    } else {
      for (int r = 0; r < kRows; ++r)
        for (idx_t j = 0; j < NRW; ++j) acc[r][j] = r < R && j < cols ? c[r * ldc + j] : 0.0f;
      _tile_loadd(0, acc, NRW * 4);
      _tile_loadd(1, &acc[0][16], NRW * 4);
    }
    alignas(64) u32 ta[kRows][kAmxPairs];
    alignas(64) u32 tb[kAmxPairs][NRW];
    for (idx_t j0 = 0; j0 < np; j0 += kAmxPairs) {
      const idx_t n = np - j0 < kAmxPairs ? np - j0 : kAmxPairs;
      if (n == kAmxPairs) {
        _tile_loadd(2, pa + j0, np * 4);
        _tile_loadd(3, pb + j0 * NRW, NRW * 4);
        _tile_loadd(4, pb + j0 * NRW + 16, NRW * 4);
      } else {  // the split's last block: zero pairs after its end
        for (int r = 0; r < kRows; ++r)
          for (idx_t j = 0; j < kAmxPairs; ++j) ta[r][j] = j < n ? pa[r * np + j0 + j] : 0u;
        for (idx_t j = 0; j < kAmxPairs; ++j)
          for (idx_t t = 0; t < NRW; ++t) tb[j][t] = j < n ? pb[(j0 + j) * NRW + t] : 0u;
        _tile_loadd(2, ta, kAmxPairs * 4);
        _tile_loadd(3, tb, NRW * 4);
        _tile_loadd(4, &tb[0][16], NRW * 4);
      }
      _tile_dpbf16ps(0, 2, 3);
      _tile_dpbf16ps(1, 2, 4);
    }
    if (whole) {
      _tile_stored(0, c, ldc * 4);
      _tile_stored(1, c + 16, ldc * 4);
      return;
    }
    _tile_stored(0, acc, NRW * 4);
    _tile_stored(1, &acc[0][16], NRW * 4);
    for (int r = 0; r < R; ++r)
      for (idx_t j = 0; j < cols; ++j) c[r * ldc + j] = acc[r][j];
  }
};

// ---- An unpacked weight: the product transposed, the weight's rows the A tiles in place --------
// For b = W.t() (W [N, K] with unit K stride) and a few rows of x, packing W into pair panels on
// every call costs as much as the product. tdpbf16ps is symmetric in its operands: an output
// element's two chains hold the same exact products in the same order whichever operand holds
// which factor, and the instruction adds the chains (E + O, commutative). So c^T = W x^T with W's
// rows loaded straight from memory as A tiles and x packed per call as B tiles has the Amx
// kernel's bits (the AMX self-test runs this way too). Pair words here are memory's own (x[k] in
// the low half) in both operands, which only swaps which chain is E; no pair panel of
// PackedWeight is read. A block that ends inside the split, and a last row block of fewer
// than 16 weight rows, are staged with zeros (never read past the split, the row or the weight).

// Rows of x per call up to which matmul_run takes this way: x's pair panels (rows * K * 2
// bytes) stay in L2 while every 16 weight rows read them again (speed only).
constexpr idx_t kAmxRowsMax = 128;

// 32-term blocks from each split's start, over all of K (the B panels' block index).
static inline idx_t amx_blocks(idx_t K, idx_t split) {
  const idx_t per = (split + 31) / 32;
  return (K / split) * per + (K % split + 31) / 32;
}

// x [M, K] (row stride sxm, unit K stride) as B tiles: per block of every split, per group of
// 16 rows, 16 pair rows x 16 row columns of raw pair words (x[k] | x[k+1] << 16, zero past the
// split's end and past M): dst[((block * groups + g) * 16 + j) * 16 + r]. Whole blocks of 8
// rows are moved as 8 x 8 word tiles (kernels_isa.h's transpose), the rest word by word.
static void amx_pack_rows(const u16* x, idx_t sxm, idx_t M, idx_t K, idx_t split, u32* dst) {
  const idx_t groups = (M + 15) / 16;
  idx_t block = 0;
  for (idx_t lo = 0; lo < K; lo += split) {
    const idx_t hi = K - lo < split ? K : lo + split;
    for (idx_t k0 = lo; k0 < hi; k0 += 32, ++block) {
      const idx_t n = hi - k0 < 32 ? hi - k0 : 32;  // terms in this block
      for (idx_t g = 0; g < groups; ++g) {
        u32* d = dst + (block * groups + g) * 256;
        for (idx_t r0 = 0; r0 < 16; r0 += TW) {
          const idx_t m0 = g * 16 + r0;
          if (n == 32 && m0 + TW <= M) {
            for (idx_t j0 = 0; j0 < 16; j0 += TW) {
              vt v[TW];
#pragma GCC unroll 8
              for (int t = 0; t < TW; ++t)
                v[t] = loadu<vt>(reinterpret_cast<const float*>(x + (m0 + t) * sxm + k0 + 2 * j0));
              transpose(v);
#pragma GCC unroll 8
              for (int t = 0; t < TW; ++t) std::memcpy(d + (j0 + t) * 16 + r0, &v[t], sizeof v[t]);
            }
            continue;
          }
          for (idx_t r = r0; r < r0 + TW; ++r) {
            const idx_t m = g * 16 + r;
            const u16* s = x + m * sxm + k0;
            for (idx_t j = 0; j < 16; ++j) {
              u32 w = 0;
              if (m < M && 2 * j < n) {
                w = s[2 * j];
                if (2 * j + 1 < n) w |= u32(s[2 * j + 1]) << 16;
              }
              d[j * 16 + r] = w;
            }
          }
        }
      }
    }
  }
}

// One block's T accumulator tiles += A (tile 4) x the block's B groups (B tiles alternate so a
// load overlaps the previous product).
template <int T>
__attribute__((target("amx-tile,amx-bf16"))) static inline void amx_rows_dp(const u32* pb) {
  _tile_loadd(5, pb, 64);
  _tile_dpbf16ps(0, 4, 5);
  if constexpr (T > 1) {
    _tile_loadd(6, pb + 256, 64);
    _tile_dpbf16ps(1, 4, 6);
  }
  if constexpr (T > 2) {
    _tile_loadd(5, pb + 512, 64);
    _tile_dpbf16ps(2, 4, 5);
  }
  if constexpr (T > 3) {
    _tile_loadd(6, pb + 768, 64);
    _tile_dpbf16ps(3, 4, 6);
  }
}

template <int T>
__attribute__((target("amx-tile,amx-bf16"))) static inline void amx_rows_zero() {
  _tile_zero(0);
  if constexpr (T > 1) _tile_zero(1);
  if constexpr (T > 2) _tile_zero(2);
  if constexpr (T > 3) _tile_zero(3);
}

// part[16][64]: weight row r, x row 16 t + i at part[r * 64 + 16 t + i].
template <int T>
__attribute__((target("amx-tile,amx-bf16"))) static inline void amx_rows_store(float* part) {
  _tile_stored(0, part, 256);
  if constexpr (T > 1) _tile_stored(1, part + 16, 256);
  if constexpr (T > 2) _tile_stored(2, part + 32, 256);
  if constexpr (T > 3) _tile_stored(3, part + 48, 256);
}

// One split of weight rows [n, n + R) against x-row groups [g0, g0 + T): the split's blocks
// (first block index `block`), accumulators from +0, stored to part[16][64] (weight row r, x
// row 16 t + i at part[r * 64 + 16 t + i]).
template <int T>
__attribute__((target("amx-tile,amx-bf16"))) static void amx_rows_split(
    const u16* w, idx_t swn, idx_t n, idx_t R, idx_t lo, idx_t hi, const u32* xp, idx_t block,
    idx_t groups, idx_t g0, float* part) {
  alignas(64) u16 ta[16][32];
  amx_rows_zero<T>();
  for (idx_t k0 = lo; k0 < hi; k0 += 32, ++block) {
    const idx_t terms = hi - k0 < 32 ? hi - k0 : 32;
    if (terms == 32 && R == 16) {
      _tile_loadd(4, w + n * swn + k0, swn * 2);
    } else {
      for (idx_t r = 0; r < 16; ++r)
        for (idx_t j = 0; j < 32; ++j)
          ta[r][j] = r < R && j < terms ? w[(n + r) * swn + k0 + j] : u16(0);
      _tile_loadd(4, ta, 64);
    }
    amx_rows_dp<T>(xp + (block * groups + g0) * 256);
  }
  amx_rows_store<T>(part);
}

// TW floats rounded to bf16 as contract.h's round_bf16 rounds one.
static inline __attribute__((always_inline)) vth round_bf16_v(vt v) {
  vtu u;
  std::memcpy(&u, &v, sizeof u);
  const vtu nan = (u & 0x7fffffffu) > 0x7f800000u;  // all ones where NaN
  const vtu r = ((u + 0x7fffu + ((u >> 16) & 1u)) >> 16) | nan;
  return __builtin_convertvector(r, vth);
}

// c[m0:m1, n:n+R] = total's transpose (+ bias), fp32 into c or, c16 not null, rounded to bf16
// into c16 (same pitch ldc): 8 x 8 tiles where whole, else word by word.
static void amx_rows_write(const float* total, idx_t m0, idx_t m1, idx_t n, idx_t R,
                           const float* bias, float* c, u16* c16, idx_t ldc) {
  for (idx_t r0 = 0; r0 < R; r0 += TW) {
    for (idx_t i0 = m0; i0 < m1; i0 += TW) {
      if (r0 + TW <= R && i0 + TW <= m1) {
        vt v[TW];
#pragma GCC unroll 8
        for (int t = 0; t < TW; ++t) v[t] = loadu<vt>(total + (r0 + t) * 64 + (i0 - m0));
        transpose(v);
        const vt b = bias ? loadu<vt>(bias + n + r0) : vt{};
#pragma GCC unroll 8
        for (int t = 0; t < TW; ++t) {
          const vt o = bias ? v[t] + b : v[t];
          if (c16) {
            const vth h = round_bf16_v(o);
            std::memcpy(c16 + (i0 + t) * ldc + n + r0, &h, sizeof h);
          } else {
            std::memcpy(c + (i0 + t) * ldc + n + r0, &o, sizeof o);
          }
        }
        continue;
      }
      for (idx_t m = i0; m < (i0 + TW < m1 ? i0 + TW : m1); ++m)
        for (idx_t r = r0; r < (r0 + TW < R ? r0 + TW : R); ++r) {
          const float t = total[r * 64 + (m - m0)];
          const float o = bias ? t + bias[n + r] : t;
          if (c16)
            c16[m * ldc + n + r] = round_bf16(o);
          else
            c[m * ldc + n + r] = o;
        }
    }
  }
}

// c[m, n] (or c16's, bf16) for m in [0, M), weight rows n in [n0, n1) (n0 a multiple of 16): x
// as packed by amx_pack_rows (xp), W [N, K] row stride swn. The splits are folded (t = t + p,
// in order) in the tiles' own layout and the bias added while writing c: plain fp32 adds as
// every matmul_tile does (tdpbf16ps ignores MXCSR).
__attribute__((target("amx-tile,amx-bf16"))) static void amx_rows_tile(
    const u32* xp, idx_t M, const u16* w, idx_t swn, const float* bias, float* c, u16* c16,
    idx_t ldc, idx_t n0, idx_t n1, idx_t K, idx_t split) {
  const idx_t groups = (M + 15) / 16;
  alignas(64) float total[16 * 64], part[16 * 64];
  amx_load_config();  // tiles 0-3 accumulators, 4 a block of W, 5 and 6 blocks of x
  for (idx_t n = n0; n < n1; n += 16) {
    const idx_t R = n1 - n < 16 ? n1 - n : 16;
    for (idx_t g0 = 0; g0 < groups; g0 += 4) {
      const int T = int(groups - g0 < 4 ? groups - g0 : 4);
      const idx_t m0 = g0 * 16, m1 = M < m0 + 64 ? M : m0 + 64;
      idx_t block = 0;
      for (idx_t lo = 0; lo < K; lo += split) {
        const idx_t hi = K - lo < split ? K : lo + split;
        float* dst = lo == 0 ? total : part;
        switch (T) {
          case 1: amx_rows_split<1>(w, swn, n, R, lo, hi, xp, block, groups, g0, dst); break;
          case 2: amx_rows_split<2>(w, swn, n, R, lo, hi, xp, block, groups, g0, dst); break;
          case 3: amx_rows_split<3>(w, swn, n, R, lo, hi, xp, block, groups, g0, dst); break;
          default: amx_rows_split<4>(w, swn, n, R, lo, hi, xp, block, groups, g0, dst);
        }
        block += (hi - lo + 31) / 32;
        if (lo > 0) {
          const idx_t width = idx_t(T) * 16;
          for (idx_t r = 0; r < R; ++r)
            for (idx_t i = 0; i < width; ++i)
              total[r * 64 + i] = total[r * 64 + i] + part[r * 64 + i];
        }
      }
      amx_rows_write(total, m0, m1, n, R, bias, c, c16, ldc);
    }
  }
  _tile_release();
}

// The whole product this way (matmul_run's entry for b = W.t() and at most kAmxRowsMax rows;
// c16 not null: the result rounded to bf16 there instead of c):
// x packed once on the calling thread, then 16-row blocks of W shared among threads (which
// thread takes a block never affects the bits).
static void amx_rows_product(const u16* x, idx_t sxm, idx_t M, const u16* w, idx_t swn,
                             const float* bias, float* c, u16* c16, idx_t ldc, idx_t N, idx_t K,
                             idx_t split, int num_threads) {
  if (split <= 0 || split >= K) split = K;
  const idx_t groups = (M + 15) / 16;
  u32* xp = reinterpret_cast<u32*>(scratch_floats(size_t(amx_blocks(K, split) * groups * 256)));
  amx_pack_rows(x, sxm, M, K, split, xp);
  const idx_t row_blocks = (N + 15) / 16;
  const idx_t want = std::min<idx_t>(num_threads, M * N * K / kMatmulMinMacsPerThread);
  const int nt = int(std::max<idx_t>(1, std::min(want, row_blocks)));
  parallel_run(nt, [&](int id) {
    const idx_t b0 = row_blocks * id / nt, b1 = row_blocks * (id + 1) / nt;
    if (b0 < b1)
      amx_rows_tile(xp, M, w, swn, bias, c, c16, ldc, b0 * 16, std::min(N, b1 * 16), K, split);
  });
}
