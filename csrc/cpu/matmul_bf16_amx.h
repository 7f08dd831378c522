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
  __attribute__((target("amx-tile,amx-bf16"))) static void begin() {
    // A static: GCC 12 drops stores to a local that only ldtilecfg reads (seen in the object
    // code: the rows and widths never written).
    static const AmxConfig cfg = [] {
      AmxConfig c;
      for (int t = 0; t < 5; ++t) c.colsb[t] = 64, c.rows[t] = 16;
      return c;
    }();
    _tile_loadconfig(&cfg);
  }
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
