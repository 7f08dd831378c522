// bik._cpu_kernels: pybind11 glue for the fixed-order CPU kernels (contract: contract.h).
// No torch headers: the Python side passes data pointers and strides in elements.
#include <pthread.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "attention.h"
#include "c_abi.h"
#include "contract.h"
#include "dot_reference.h"
#include "fma_reference.h"
#include "amx_reference.h"
#include "reductions.h"
#include "sampling.h"

#if defined(__GNUC__) && !defined(__clang__)
// The internal per-ISA helpers pass vectors by value; they are inlined, so the ABI note is moot.
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

#if !defined(__GNUC__)
#error "bik CPU kernels need GCC or Clang (vector extensions)"
#endif

#if defined(__x86_64__) || defined(__i386__)
#define BIK_X86 1
#else
#define BIK_X86 0
#endif

// ---- per-ISA instantiations (same source, different vector width and blocking) ----------------

#if BIK_X86
#include <immintrin.h>
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f")
#endif
#define BIK_NS avx512
#define BIK_VW 16
#define BIK_MR 6
#define BIK_NRV 2
#define BIK_MC 96
#include "kernels_isa.h"
#undef BIK_NS
#undef BIK_VW
#undef BIK_MR
#undef BIK_NRV
#undef BIK_MC
// The bf16 dot path on AVX-512 (FMA, and vdpbf16ps for CPUs with AVX512_BF16).
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,fma"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,fma")
#endif
#define BIK_DOT_VW 16
#define BIK_DOT_VDPBF16 1
#define BIK_DOT_AMX 1
namespace bik_cpu {
namespace avx512 {
#include "matmul_bf16_dot.h"
}  // namespace avx512
}  // namespace bik_cpu
#undef BIK_DOT_VW
#undef BIK_DOT_VDPBF16
#undef BIK_DOT_AMX
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#if defined(__clang__)
#pragma clang attribute pop
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma")  // FMA instructions only in the Fma32 kernels (a test checks)
#endif
#define BIK_NS avx2
#define BIK_VW 8
#define BIK_MR 4
#define BIK_NRV 3
#define BIK_MC 96
#include "kernels_isa.h"
#undef BIK_NS
#undef BIK_VW
#undef BIK_MR
#undef BIK_NRV
#undef BIK_MC
#if defined(__clang__)
#pragma clang attribute pop
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif
#define BIK_DOT_VW 8
#define BIK_DOT_VDPBF16 0
namespace bik_cpu {
namespace avx2 {
#include "matmul_bf16_dot.h"
}  // namespace avx2
}  // namespace bik_cpu
#undef BIK_DOT_VW
#undef BIK_DOT_VDPBF16
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif  // BIK_X86

#define BIK_NS generic
#define BIK_VW 4
#define BIK_MR 4
#define BIK_NRV 2
#define BIK_MC 64
#include "kernels_isa.h"
#undef BIK_NS
#undef BIK_VW
#undef BIK_MR
#undef BIK_NRV
#undef BIK_MC

namespace bik_cpu {
namespace {

// The bf16 kernels matmul_run can take (a_bf16): the dot sequence's FMA and vdpbf16ps ones, and
// the AMX sequence's.
enum DotKernel { kDotFma = 0, kDotVdp = 1, kDotAmx = 2 };

struct Isa {
  const char* name;
  idx_t nrw, mr;
  size_t (*scratch_per_thread)(idx_t, idx_t, idx_t);
  // The fp32 sequence's tiles (contract.h), fp32 B and a bf16 B (bit patterns, widened
  // exactly while packing): mul-add (tile, tile_bf16; attention's dots too) and fma
  // (tile_fma, tile_bf16_fma; null where the CPU has no FMA for this ISA's vectors).
  using Tile = void (*)(const float*, idx_t, idx_t, const float*, idx_t, idx_t, const float*,
                        float*, idx_t, idx_t, idx_t, idx_t, idx_t, idx_t, idx_t, idx_t, idx_t,
                        float*, const float*);
  using TileBf16 = void (*)(const float*, idx_t, idx_t, const std::uint16_t*, idx_t, idx_t,
                            const float*, float*, idx_t, idx_t, idx_t, idx_t, idx_t, idx_t,
                            idx_t, idx_t, idx_t, float*, const float*);
  Tile tile, tile_fma;
  TileBf16 tile_bf16, tile_bf16_fma;
  // pack_b for an fp32 / bf16 B: b[pc:pc+kc, jc:jc+nc] -> panels dst[p][k][nrw].
  void (*pack)(const float*, idx_t, idx_t, idx_t, idx_t, idx_t, idx_t, float*);
  void (*pack_bf16)(const std::uint16_t*, idx_t, idx_t, idx_t, idx_t, idx_t, idx_t, float*);
  void (*rms)(const float*, idx_t, const float*, float*, idx_t, idx_t, idx_t, idx_t, float);
  void (*log_softmax)(const float*, idx_t, float*, idx_t, idx_t, idx_t, idx_t, idx_t, idx_t);
  float (*exp_sum)(const float*, idx_t, float, idx_t, idx_t, float*);
  float (*row_max)(const float*, idx_t, bool*);
  // The bf16 dot path (a and b bf16; matmul_bf16_dot.h): its FMA kernel and, on CPUs with
  // AVX512_BF16, its vdpbf16ps one; null where the ISA or the CPU has none. Same arguments as
  // tile, a packed B in pair words; pack_dot (pack_b_all) takes the split.
  using TileDot = void (*)(const std::uint16_t*, idx_t, idx_t, const std::uint16_t*, idx_t,
                           idx_t, const float*, float*, idx_t, idx_t, idx_t, idx_t, idx_t, idx_t,
                           idx_t, idx_t, idx_t, float*, const std::uint32_t*);
  TileDot tile_dot = nullptr, tile_vdp = nullptr;
  // contract.h's bf16 AMX sequence (matmul_bf16_amx.h): another sequence, same arguments.
  TileDot tile_amx = nullptr;
  // The AMX sequence for b = W.t() unpacked and few rows (amx_rows_product: c^T = W x^T with W
  // read in place; the same bits as tile_amx).
  void (*amx_rows)(const std::uint16_t*, idx_t, idx_t, const std::uint16_t*, idx_t,
                   const float*, float*, std::uint16_t*, idx_t, idx_t, idx_t, idx_t,
                   int) = nullptr;
  idx_t amx_rows_max = 0;
  void (*pack_dot)(const std::uint16_t*, idx_t, idx_t, idx_t, idx_t, idx_t,
                   std::uint32_t*) = nullptr;
  // The bf16 tile of a DotKernel (null where this ISA or CPU has none).
  TileDot dot_tile(int kernel) const {
    return kernel == kDotAmx ? tile_amx : kernel == kDotVdp ? tile_vdp : tile_dot;
  }
};

#define BIK_ISA_ENTRY(ns)                                                                    \
  Isa {                                                                                      \
#ns, ns::NRW, ns::MR, &ns::matmul_scratch_per_thread,                                     \
        &ns::matmul_tile<float, ns::MulAdd32>, &ns::matmul_tile<float, ns::Fma32>,           \
        &ns::matmul_tile<std::uint16_t, ns::MulAdd32>,                                       \
        &ns::matmul_tile<std::uint16_t, ns::Fma32>, &ns::pack_b<float>,                      \
        &ns::pack_b<std::uint16_t>,                                                          \
        &ns::rms_norm_rows, &ns::log_softmax_rows, &ns::exp_sum_row, &ns::row_max            \
  }

bool isa_supported(const std::string& name) {
  if (name == "generic") return true;
#if BIK_X86
  __builtin_cpu_init();
  if (name == "avx2") return __builtin_cpu_supports("avx2");
  if (name == "avx512") return __builtin_cpu_supports("avx512f");
#endif
  return false;
}

// The CPU has the bf16 dot-product instruction (AVX512_BF16) with the AVX-512 it needs.
bool vdpbf16_cpu() {
#if BIK_X86
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

// The CPU has AMX's bf16 tiles (with the AVX-512 the kernel's packing uses).
bool amx_cpu() {
#if BIK_X86 && defined(__linux__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("amx-tile") &&
         __builtin_cpu_supports("amx-bf16");
#else
  return false;
#endif
}

// Linux granted this process the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA),
// asked once, when the AMX kernel is first wanted (its self-test), so a process that never
// asks for AMX never holds the larger signal frames; a forked child keeps the grant.
bool amx_granted() {
#if BIK_X86 && defined(__linux__)
  static const bool ok = amx_cpu() && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                              18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
#else
  return false;
#endif
}

// "auto" picks the widest supported ISA; bits do not depend on the choice (tests check this).
Isa select_isa(const std::string& want) {
  std::string name = want;
  if (name == "auto") name = isa_supported("avx512") ? "avx512" : isa_supported("avx2") ? "avx2"
                                                                                         : "generic";
  if (name != "generic" && name != "avx2" && name != "avx512")
    throw std::invalid_argument("bik: unknown isa '" + want + "' (auto, avx512, avx2, generic)");
  if (!isa_supported(name))
    throw std::invalid_argument("bik: isa '" + name + "' is not supported by this CPU/build");
#if BIK_X86
  if (name == "avx512") {
    Isa isa = BIK_ISA_ENTRY(avx512);
    isa.tile_dot = &avx512::dot::matmul_tile<avx512::dot::Fma>;  // AVX-512F CPUs have FMA
    isa.pack_dot = &avx512::dot::pack_b_all;
    if (vdpbf16_cpu()) isa.tile_vdp = &avx512::dot::matmul_tile<avx512::dot::Vdp>;
    if (amx_cpu()) {
      isa.tile_amx = &avx512::dot::matmul_tile<avx512::dot::Amx>;
      isa.amx_rows = &avx512::dot::amx_rows_product;
      isa.amx_rows_max = avx512::dot::kAmxRowsMax;
    }
    return isa;
  }
  if (name == "avx2") {
    Isa isa = BIK_ISA_ENTRY(avx2);
    if (__builtin_cpu_supports("fma")) {
      isa.tile_dot = &avx2::dot::matmul_tile<avx2::dot::Fma>;
      isa.pack_dot = &avx2::dot::pack_b_all;
    } else {  // the fp32 fma sequence's tiles need the instruction too
      isa.tile_fma = nullptr;
      isa.tile_bf16_fma = nullptr;
    }
    return isa;
  }
#endif
  return BIK_ISA_ENTRY(generic);
}

const float* fptr(std::uintptr_t p) { return reinterpret_cast<const float*>(p); }

// Runs `product` into a [batch, M, N] fp32 buffer of its own (a thread's, kept between calls up
// to 4 MiB; a fresh one costs its page faults on every call), then rounds it into the bf16 c
// (row pitch ldc, entries scb apart) with round_bf16, rows shared among threads.
template <class Product>
void rounded_to_bf16(std::uintptr_t c, idx_t ldc, idx_t scb, idx_t M, idx_t N, idx_t batch,
                     int num_threads, const Product& product) {
  const size_t count = size_t(batch) * size_t(M) * size_t(N);
  thread_local std::vector<float> kept;
  std::vector<float> once;
  std::vector<float>& buf = count <= (size_t(1) << 20) ? kept : once;
  if (buf.size() < count) buf.resize(count);
  product(buf.data());
  const idx_t rows = batch * M;
  const int nt = int(std::max<idx_t>(1, std::min<idx_t>(num_threads, rows * N >> 15)));
  auto* out = reinterpret_cast<std::uint16_t*>(c);
  parallel_run(nt, [&](int id) {
    for (idx_t r = rows * id / nt; r < rows * (id + 1) / nt; ++r) {
      const float* src = buf.data() + r * N;
      std::uint16_t* dst = out + (r / M) * scb + (r % M) * ldc;
      for (idx_t j = 0; j < N; ++j) dst[j] = round_bf16(src[j]);
    }
  });
}

// The product, for sizes checked by the caller; takes no GIL (the pybind entry releases it, the
// C entry is called from torch's dispatcher, which holds none).
void matmul_run(const Isa& isa, std::uintptr_t a, idx_t sam, idx_t sak, std::uintptr_t b,
                idx_t sbk, idx_t sbn, std::uintptr_t bias, std::uintptr_t c, idx_t ldc, idx_t M,
                idx_t N, idx_t K, idx_t split, int num_threads, idx_t block_k, idx_t block_n,
                bool b_bf16, idx_t batch, idx_t sab, idx_t sbb, idx_t scb,
                std::uintptr_t packed = 0, bool a_bf16 = false, int dot = 0,
                bool fp32_fma = false, bool c_bf16 = false) {
  if (M == 0 || N == 0 || batch == 0) return;
  if (split <= 0 || split >= K) split = K;  // one split
  // AMX, b an unpacked weight's transpose, few rows: the weight read in place (same bits).
  if (a_bf16 && dot == kDotAmx && isa.amx_rows && !packed && batch == 1 && sbk == 1 &&
      sak == 1 && K > 0 && M <= isa.amx_rows_max) {
    float* c32 = c_bf16 ? nullptr : reinterpret_cast<float*>(c);
    std::uint16_t* c16 = c_bf16 ? reinterpret_cast<std::uint16_t*>(c) : nullptr;
    isa.amx_rows(reinterpret_cast<const std::uint16_t*>(a), sam, M,
                 reinterpret_cast<const std::uint16_t*>(b), sbn, bias ? fptr(bias) : nullptr,
                 c32, c16, ldc, N, K, split, num_threads);
    return;
  }
  if (c_bf16) {  // every other path writes fp32: into a buffer of its own, then rounded
    rounded_to_bf16(c, ldc, scb, M, N, batch, num_threads, [&](float* tmp) {
      matmul_run(isa, a, sam, sak, b, sbk, sbn, bias, reinterpret_cast<std::uintptr_t>(tmp), N,
                 M, N, K, split, num_threads, block_k, block_n, b_bf16, batch, sab, sbb, M * N,
                 packed, a_bf16, dot, fp32_fma, false);
    });
    return;
  }
  // Blocking (speed only; K blocks store/reload the fp32 acc in order, so bits never change).
  // Few rows: memory bound on B, so read B in long runs: whole weight rows when b = w.t(),
  // wide row segments when b is row-major. Many rows: cache-sized blocks for reuse.
  // A packed B (one entry) is read in place: long K runs, and N blocks only bound the loop.
  const bool few_rows = M < 4 * isa.mr;
  const bool by_column = sbk == 1 && sbn != 1 && !packed;
  idx_t kcb = few_rows ? (packed ? 2048 : by_column ? 2048 : 128) : 256;
  idx_t ncb = few_rows ? (by_column ? isa.nrw : 4096) : 512;
  if (block_k > 0) kcb = block_k;
  if (block_n > 0) ncb = block_n;
  kcb = std::max<idx_t>(1, std::min(kcb, K));
  // AMX: K blocks of whole 32-term instruction blocks (the tile rounds down, never below 32)
  if (a_bf16 && dot == kDotAmx) kcb = (kcb + 31) / 32 * 32;
  ncb = (std::max<idx_t>(1, std::min(ncb, N)) + isa.nrw - 1) / isa.nrw * isa.nrw;
  // Thread policy (never affects bits): one thread for small work; whole batch entries per
  // thread when there are enough of them (attention's many small products: one call, not a
  // call per entry); else, per entry, split N panels first (each thread packs only its own
  // B), then M row blocks when N has too few panels.
  const idx_t macs = batch * M * N * std::max<idx_t>(K, 1);
  const idx_t t = std::max<idx_t>(1, std::min<idx_t>(num_threads, macs / kMatmulMinMacsPerThread));
  const idx_t panels = (N + isa.nrw - 1) / isa.nrw;
  const idx_t mblocks = (M + isa.mr - 1) / isa.mr;
  const bool by_entry = batch >= t;
  const idx_t tn = by_entry ? 1 : std::min(t, panels);
  const idx_t tm = by_entry ? 1 : std::max<idx_t>(1, std::min(t / tn, mblocks));
  const int nt = by_entry ? int(t) : int(tn * tm);
  // Several K splits: each later split's partial needs rows x ncb of scratch, so a thread's
  // rows go to the tile in chunks of at most kSplitRows (the chunks only repeat B's packing).
  const idx_t part_rows = split < K ? std::min<idx_t>(M, kSplitRows) : 0;
  const size_t per_thread = isa.scratch_per_thread(kcb, ncb, part_rows);
  float* scratch = scratch_floats(per_thread * size_t(nt));
  const float* bias_p = bias ? fptr(bias) : nullptr;
  const size_t b_size = b_bf16 ? 2 : 4;
  // Entry e's tile [m0, m1) x [n0, n1) on thread scratch `mine`.
  auto tile = [&](idx_t e, idx_t m0, idx_t m1, idx_t n0, idx_t n1, float* mine) {
    const float* A = fptr(a) + e * sab;
    const std::uintptr_t B = b + std::uintptr_t(e * sbb) * b_size;
    float* C = reinterpret_cast<float*>(c) + e * scb;
    const float* P = packed ? fptr(packed) : nullptr;
    const idx_t step = part_rows > 0 ? part_rows : m1 - m0;
    for (idx_t r0 = m0; r0 < m1; r0 += step) {
      const idx_t r1 = std::min(m1, r0 + step);
      if (a_bf16)
        isa.dot_tile(dot)(reinterpret_cast<const std::uint16_t*>(a) + e * sab, sam, sak,
                          reinterpret_cast<const std::uint16_t*>(B), sbk, sbn, bias_p, C, ldc,
                          r0, r1, n0, n1, K, split, kcb, ncb, mine,
                          reinterpret_cast<const std::uint32_t*>(packed));
      else if (b_bf16)
        (fp32_fma ? isa.tile_bf16_fma : isa.tile_bf16)(
            A, sam, sak, reinterpret_cast<const std::uint16_t*>(B), sbk, sbn, bias_p, C, ldc, r0,
            r1, n0, n1, K, split, kcb, ncb, mine, P);
      else
        (fp32_fma ? isa.tile_fma : isa.tile)(A, sam, sak, fptr(B), sbk, sbn, bias_p, C, ldc, r0,
                                             r1, n0, n1, K, split, kcb, ncb, mine, P);
    }
  };
  if (by_entry) {
    parallel_run(nt, [&](int id) {
      for (idx_t e = batch * id / nt; e < batch * (id + 1) / nt; ++e)
        tile(e, 0, M, 0, N, scratch + per_thread * size_t(id));
    });
    return;
  }
  for (idx_t e = 0; e < batch; ++e) {
    parallel_run(nt, [&](int id) {
      const idx_t i = id / tn, j = id % tn;
      const idx_t p0 = panels * j / tn, p1 = panels * (j + 1) / tn;
      const idx_t b0 = mblocks * i / tm, b1 = mblocks * (i + 1) / tm;
      const idx_t n0 = p0 * isa.nrw, n1 = std::min(N, p1 * isa.nrw);
      const idx_t m0 = b0 * isa.mr, m1 = std::min(M, b1 * isa.mr);
      if (n0 < n1 && m0 < m1) tile(e, m0, m1, n0, n1, scratch + per_thread * size_t(id));
    });
  }
}

// Why a bf16 kernel cannot run here ("" when it can): the CPU lacks it, or the start-up
// self-test found its bits differing from its sequence's transcription (dot_reference.h,
// amx_reference.h) on a fixed probe. Decided once per process per kernel (DotKernel: the FMA
// one of the widest ISA, vdpbf16ps, AMX).
const std::string& bf16_dot_refusal(int kernel = kDotFma);
// Why the fp32 fma sequence's kernel of the widest ISA cannot run here ("" when it can): the
// CPU has no FMA for its vectors, or the start-up self-test found its bits differing from the
// transcription (fma_reference.h) on a fixed probe. Decided once per process.
const std::string& fp32_fma_refusal();

void matmul_f32(std::uintptr_t a, idx_t sam, idx_t sak, std::uintptr_t b, idx_t sbk, idx_t sbn,
                std::uintptr_t bias, std::uintptr_t c, idx_t ldc, idx_t M, idx_t N, idx_t K,
                idx_t split, int num_threads, const std::string& isa_name, idx_t block_k,
                idx_t block_n, bool b_bf16, idx_t batch, idx_t sab, idx_t sbb, idx_t scb,
                std::uintptr_t packed, bool a_bf16, const std::string& dot_kernel,
                bool fp32_fma, bool c_bf16) {
  if (M < 0 || N < 0 || K < 0 || batch < 0)
    throw std::invalid_argument("bik: negative matmul size");
  if (split < 0) throw std::invalid_argument("bik: negative matmul split");
  if (packed && batch != 1) throw std::invalid_argument("bik: a packed B serves one entry");
  const Isa isa = select_isa(isa_name);
  if (dot_kernel != "fma" && dot_kernel != "vdpbf16ps" && dot_kernel != "amx")
    throw std::invalid_argument("bik: dot_kernel '" + dot_kernel + "' (fma, vdpbf16ps, amx)");
  const int dot = dot_kernel == "amx" ? kDotAmx : dot_kernel == "vdpbf16ps" ? kDotVdp : kDotFma;
  if (a_bf16) {
    if (!b_bf16) throw std::invalid_argument("bik: the bf16 dot path takes a and b both bf16");
    if (!bf16_dot_refusal(dot).empty())
      throw std::invalid_argument("bik: the bf16 dot kernel " + dot_kernel +
                                  " is unavailable: " + bf16_dot_refusal(dot));
    if (isa.dot_tile(dot) == nullptr)
      throw std::invalid_argument("bik: isa '" + std::string(isa.name) + "' has no " +
                                  dot_kernel + " bf16 dot kernel on this CPU");
  }
  if (fp32_fma && !a_bf16) {
    if (!fp32_fma_refusal().empty())
      throw std::invalid_argument("bik: the fp32 fma sequence is unavailable: " +
                                  fp32_fma_refusal());
    if (isa.tile_fma == nullptr)
      throw std::invalid_argument("bik: isa '" + std::string(isa.name) +
                                  "' has no fp32 fma kernel on this CPU");
  }
  pybind11::gil_scoped_release nogil;
  matmul_run(isa, a, sam, sak, b, sbk, sbn, bias, c, ldc, M, N, K, split, num_threads, block_k,
             block_n, b_bf16, batch, sab, sbb, scb, packed, a_bf16, dot, fp32_fma, c_bf16);
}

// The self-test's probes: bf16 words whose exponents reach the denormals, products near the
// flush threshold 2^-126 and cancellations, from a fixed generator; K odd (45) and even (44),
// row and column tails, one split and splits of 16. Row 0 x column 0 is the add where tininess
// is judged after rounding: 2^-126 - 2^-152 rounds up to 2^-126 at fp32's precision and is
// kept. Row 1 x column 1 is a -0 that survives an even K (a flushed negative product, then a
// negative denormal read as -0, then -0 * +0 terms).
struct DotProbe {
  static constexpr idx_t M = 7, N = 35, kKs[2] = {45, 44};
  idx_t K;
  std::vector<std::uint16_t> a, b;  // a [M, K], b [K, N] row-major
  explicit DotProbe(idx_t k) : K(k), a(size_t(M * k)), b(size_t(k * N)) {
    std::uint32_t state = 12345u;
    auto word = [&state]() {
      state = state * 1664525u + 1013904223u;
      static const std::uint16_t exps[] = {0,  1,  3,   60,  62,  63,  64,
                                           65, 66, 120, 125, 127, 128, 131};
      const std::uint16_t e = exps[(state >> 8) % (sizeof exps / sizeof exps[0])];
      return std::uint16_t(((state >> 31) << 15) | (e << 7) | ((state >> 20) & 0x7f));
    };
    for (auto& x : a) x = word();
    for (auto& x : b) x = word();
    for (idx_t k = 0; k < K; ++k) {
      a[k] = b[k * N] = 0;
      a[K + k] = 0x8000;     // -0
      b[k * N + 1] = 0;      // +0
    }
    a[0] = 0x3f80;          // 1.0
    b[0] = 0x0080;          // 2^-126
    a[1] = 0x1980;          // 2^-76
    b[1 * N] = 0x9980;      // -2^-76: the product is -2^-152
    a[K] = 0x1c80;          // 2^-70
    b[1] = 0x9c80;          // -2^-70: the product -2^-140 flushes to -0
    a[K + 1] = 0x8001;      // a negative denormal: -0
    b[1 * N + 1] = 0x3f80;  // 1.0
  }
  std::vector<idx_t> splits() const { return {K, 16}; }
};

// A self-test's verdict on one run: "" when got equals want bit for bit (any NaN equal to any
// NaN), else which element of the [*, N] result differs and under which probe settings.
std::string first_difference(const std::vector<float>& got, const std::vector<float>& want,
                             idx_t N, const char* name, idx_t K, idx_t split, int layout) {
  for (size_t i = 0; i < got.size(); ++i) {
    const bool both_nan = std::isnan(got[i]) && std::isnan(want[i]);
    if (!both_nan && std::memcmp(&got[i], &want[i], sizeof(float)) != 0)
      return std::string("self-test (") + name + "): c[" + std::to_string(idx_t(i) / N) + ", " +
             std::to_string(idx_t(i) % N) + "] differs from the transcription (K " +
             std::to_string(K) + ", split " + std::to_string(split) + ", B layout " +
             std::to_string(layout) + ")";
  }
  return "";
}

// Runs probe K through `tile` (B row-major, B as a weight's transpose, B packed once; for AMX
// also the weight's rows as A tiles) and returns "" when its bits equal the transcription's
// everywhere (NaN where it is NaN).
std::string bf16_dot_probe_check(const Isa& isa, Isa::TileDot tile, const char* name, idx_t K) {
  const DotProbe probe(K);
  constexpr idx_t M = DotProbe::M, N = DotProbe::N;
  const bool amx = tile == isa.tile_amx;
  const idx_t kc = amx ? 32 : 16;  // K blocks: AMX's are whole instruction blocks
  std::vector<float> got(M * N), want(M * N);
  std::vector<std::uint32_t> panels(size_t((N + isa.nrw - 1) / isa.nrw) * K * isa.nrw);
  std::vector<std::uint16_t> bt(K * N);  // [N, K]: b = bt.t() reads K with unit stride
  for (idx_t k = 0; k < K; ++k)
    for (idx_t n = 0; n < N; ++n) bt[n * K + k] = probe.b[k * N + n];
  FenvGuard g;
  for (const idx_t split : probe.splits()) {
    (amx ? amx_ref::matmul : dot_ref::matmul)(probe.a.data(), K, 1, probe.b.data(), N, 1,
                                              nullptr, want.data(), N, M, N, K, split);
    for (int layout = 0; layout < 3; ++layout) {
      const std::uint16_t* bp = layout == 1 ? bt.data() : probe.b.data();
      const idx_t sbk = layout == 1 ? 1 : N, sbn = layout == 1 ? K : 1;
      if (layout == 2) isa.pack_dot(probe.b.data(), N, 1, K, N, split, panels.data());
      std::fill(got.begin(), got.end(), 12345.0f);  // an element left unwritten differs
      // asked for on each call: amx_rows takes this thread's arena too, and may move it
      float* scratch = scratch_floats(isa.scratch_per_thread(kc, 64, M));
      tile(probe.a.data(), K, 1, bp, sbk, sbn, nullptr, got.data(), N, 0, M, 0, N, K, split, kc,
           64, scratch, layout == 2 ? panels.data() : nullptr);
      std::string why = first_difference(got, want, N, name, K, split, layout);
      if (!why.empty()) return why;
    }
    if (amx && isa.amx_rows) {  // layout 3: the weight's rows as A tiles (amx_rows_product)
      std::fill(got.begin(), got.end(), 12345.0f);
      isa.amx_rows(probe.a.data(), K, M, bt.data(), K, nullptr, got.data(), nullptr, N, N, K,
                   split, 1);
      std::string why = first_difference(got, want, N, name, K, split, 3);
      if (!why.empty()) return why;
    }
  }
  return "";
}

// The self-test of a bf16 kernel of the widest ISA (DotKernel).
std::string bf16_dot_self_test(int kernel) {
  const Isa isa = select_isa("auto");
  const Isa::TileDot tile = isa.dot_tile(kernel);
  if (tile == nullptr || (kernel == kDotAmx && !amx_granted()))
    return kernel == kDotAmx   ? "this CPU or its kernel grants no AMX bf16 tiles"
           : kernel == kDotVdp ? "this CPU has no AVX512_BF16 (vdpbf16ps)"
                               : "this CPU has no FMA";
  const char* name = kernel == kDotAmx ? "amx" : kernel == kDotVdp ? "vdpbf16ps" : isa.name;
  for (const idx_t K : DotProbe::kKs) {
    std::string why = bf16_dot_probe_check(isa, tile, name, K);
    if (!why.empty()) return why;
  }
  return "";
}

const std::string& bf16_dot_refusal(int kernel) {
  // each kernel's self-test runs when it is first asked about
  if (kernel == kDotAmx) {
    static const std::string why = bf16_dot_self_test(kDotAmx);
    return why;
  }
  if (kernel == kDotVdp) {
    static const std::string why = bf16_dot_self_test(kDotVdp);
    return why;
  }
  static const std::string why = bf16_dot_self_test(kDotFma);
  return why;
}

// The fp32 fma self-test's probes: floats whose exponents reach the denormals, the overflow
// range and cancellations, from a fixed generator; K odd (45) and even (44), row and column
// tails, one split and splits of 16. Row 0 x column 0 is a step the two fp32 sequences round
// apart: p = -1, then (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24, whose product alone rounds (a tie, to
// even) to 1 + 2^-11 while the fused step keeps the 2^-24.
struct FmaProbe {
  static constexpr idx_t M = 7, N = 35, kKs[2] = {45, 44};
  idx_t K;
  std::vector<float> a, b;  // a [M, K], b [K, N] row-major
  explicit FmaProbe(idx_t k) : K(k), a(size_t(M * k)), b(size_t(k * N)) {
    std::uint32_t state = 54321u;
    auto value = [&state]() {
      state = state * 1664525u + 1013904223u;
      static const std::uint32_t exps[] = {0,   1,   2,   40,  63,  100, 120, 125, 126,
                                           127, 128, 129, 131, 150, 190, 230, 250, 254};
      const std::uint32_t e = exps[(state >> 8) % (sizeof exps / sizeof exps[0])];
      const std::uint32_t u = ((state >> 31) << 31) | (e << 23) | ((state * 2654435761u) >> 9);
      float f;
      std::memcpy(&f, &u, sizeof f);
      return f;
    };
    for (auto& x : a) x = value();
    for (auto& x : b) x = value();
    for (idx_t k = 0; k < K; ++k) a[k] = b[k * N] = 0.0f;
    a[0] = 1.0f;
    b[0] = -1.0f;
    a[1] = b[1 * N] = 1.0f + 0x1p-12f;
  }
  std::vector<idx_t> splits() const { return {K, 16}; }
};

// Runs probe K through the fp32 tile `tile` (B row-major, B as a weight's transpose, B packed
// once) and returns "" when its bits equal the transcription's everywhere (NaN where it is NaN).
std::string fp32_fma_probe_check(const Isa& isa, Isa::Tile tile, idx_t K) {
  const FmaProbe probe(K);
  constexpr idx_t M = FmaProbe::M, N = FmaProbe::N;
  std::vector<float> got(M * N), want(M * N);
  float* scratch = scratch_floats(isa.scratch_per_thread(16, 64, M));
  const idx_t panels_n = (N + isa.nrw - 1) / isa.nrw * isa.nrw;
  std::vector<float> panels(size_t(panels_n) * K);
  std::vector<float> bt(K * N);  // [N, K]: b = bt.t() reads K with unit stride
  for (idx_t k = 0; k < K; ++k)
    for (idx_t n = 0; n < N; ++n) bt[n * K + k] = probe.b[k * N + n];
  isa.pack(probe.b.data(), N, 1, 0, K, 0, N, panels.data());
  const std::string name = std::string(isa.name) + " fp32 fma";
  FenvGuard g;
  for (const idx_t split : probe.splits()) {
    fma_ref::matmul(probe.a.data(), K, 1, probe.b.data(), N, 1, nullptr, want.data(), N, M, N, K,
                    split);
    for (int layout = 0; layout < 3; ++layout) {
      const float* bp = layout == 1 ? bt.data() : probe.b.data();
      const idx_t sbk = layout == 1 ? 1 : N, sbn = layout == 1 ? K : 1;
      tile(probe.a.data(), K, 1, bp, sbk, sbn, nullptr, got.data(), N, 0, M, 0, N, K, split, 16,
           64, scratch, layout == 2 ? panels.data() : nullptr);
      std::string why = first_difference(got, want, N, name.c_str(), K, split, layout);
      if (!why.empty()) return why;
    }
  }
  return "";
}

std::string fp32_fma_self_test() {
  const Isa isa = select_isa("auto");
  if (isa.tile_fma == nullptr) return "this CPU has no FMA";
  for (const idx_t K : FmaProbe::kKs) {
    std::string why = fp32_fma_probe_check(isa, isa.tile_fma, K);
    if (!why.empty()) return why;
  }
  return "";
}

const std::string& fp32_fma_refusal() {
  static const std::string why = fp32_fma_self_test();
  return why;
}

// A scalar transcription of contract.h (Ref: fma_ref::matmul, dot_ref::matmul on words T) over
// raw pointers, for the tests.
template <class T, void (*Ref)(const T*, idx_t, idx_t, const T*, idx_t, idx_t, const float*,
                               float*, idx_t, idx_t, idx_t, idx_t, idx_t)>
void matmul_reference(std::uintptr_t a, idx_t sam, idx_t sak, std::uintptr_t b, idx_t sbk,
                      idx_t sbn, std::uintptr_t bias, std::uintptr_t c, idx_t ldc, idx_t M,
                      idx_t N, idx_t K, idx_t split) {
  if (M < 0 || N < 0 || K < 0 || split < 0)
    throw std::invalid_argument("bik: negative matmul size or split");
  pybind11::gil_scoped_release nogil;
  FenvGuard g;
  Ref(reinterpret_cast<const T*>(a), sam, sak, reinterpret_cast<const T*>(b), sbk, sbn,
      bias ? fptr(bias) : nullptr, reinterpret_cast<float*>(c), ldc, M, N, K, split);
}

// All of b[K, N] (bf16) in the dot path's pair panels for `isa_name`: panels * pair_rows * nrw
// words (sizes from matmul_dot_pair_rows and matmul_panel_width); copies only.
void matmul_pack_b_pairs(std::uintptr_t b, idx_t sbk, idx_t sbn, idx_t K, idx_t N, idx_t split,
                         const std::string& isa_name, std::uintptr_t dst) {
  if (K < 0 || N < 0 || split < 0) throw std::invalid_argument("bik: negative matmul size");
  const Isa isa = select_isa(isa_name);
  if (isa.pack_dot == nullptr)
    throw std::invalid_argument("bik: isa '" + std::string(isa.name) + "' has no bf16 dot path");
  if (K == 0 || N == 0) return;
  pybind11::gil_scoped_release nogil;
  isa.pack_dot(reinterpret_cast<const std::uint16_t*>(b), sbk, sbn, K, N, split,
               reinterpret_cast<std::uint32_t*>(dst));
}

// All of b[K, N] packed once into the matmul's panels for `isa_name` (dst: panels * K * nrw
// floats, sized by the caller from matmul_panel_width); pure copies, exact.
void matmul_pack_b(std::uintptr_t b, idx_t sbk, idx_t sbn, idx_t K, idx_t N, bool b_bf16,
                   const std::string& isa_name, std::uintptr_t dst) {
  if (K < 0 || N < 0) throw std::invalid_argument("bik: negative matmul size");
  const Isa isa = select_isa(isa_name);
  if (K == 0 || N == 0) return;
  pybind11::gil_scoped_release nogil;
  float* d = reinterpret_cast<float*>(dst);
  if (b_bf16)
    isa.pack_bf16(reinterpret_cast<const std::uint16_t*>(b), sbk, sbn, 0, K, 0, N, d);
  else
    isa.pack(fptr(b), sbk, sbn, 0, K, 0, N, d);
}

// The KV cache write: row t of src (tokens x hkv x d elements of `elem` bytes; element
// strides s_tok, s_head, unit along d) goes to slot slots[t] of the cache (page s / block,
// offset s % block; element strides c_page, c_off, c_head, unit along d), for every t with
// 0 <= slots[t] < n_slots (negative: padding; past the cache: skipped, as the GPU kernel does).
// slots: int64, or int32 unless slots_i64. Copies only; tokens in ascending order. The caller
// checks the sizes (block > 0, elem 2 or 4).
void copy_kv_rows(char* dst, idx_t c_page, idx_t c_off, idx_t c_head, idx_t block,
                  idx_t n_slots, const char* from, idx_t s_tok, idx_t s_head, idx_t tokens,
                  idx_t hkv, idx_t d, idx_t elem, const void* slots, bool slots_i64) {
  const size_t row = size_t(d) * size_t(elem);
  for (idx_t t = 0; t < tokens; ++t) {
    const std::int64_t s = slots_i64 ? static_cast<const std::int64_t*>(slots)[t]
                                     : static_cast<const std::int32_t*>(slots)[t];
    if (s < 0 || s >= n_slots) continue;
    const idx_t page = s / block, off = s % block;
    for (idx_t h = 0; h < hkv; ++h)
      std::memcpy(dst + size_t(page * c_page + off * c_off + h * c_head) * size_t(elem),
                  from + size_t(t * s_tok + h * s_head) * size_t(elem), row);
  }
}

void write_kv_rows(std::uintptr_t cache, idx_t c_page, idx_t c_off, idx_t c_head, idx_t block,
                   idx_t n_slots, std::uintptr_t src, idx_t s_tok, idx_t s_head, idx_t tokens,
                   idx_t hkv, idx_t d, idx_t elem, std::uintptr_t slots) {
  if (block <= 0 || tokens < 0 || hkv < 0 || d < 0 || (elem != 2 && elem != 4))
    throw std::invalid_argument("bik: bad write_kv_rows sizes");
  copy_kv_rows(reinterpret_cast<char*>(cache), c_page, c_off, c_head, block, n_slots,
               reinterpret_cast<const char*>(src), s_tok, s_head, tokens, hkv, d, elem,
               reinterpret_cast<const void*>(slots), true);
}

// A bf16's bits from an fp32 value, rounded to nearest even (torch's conversion; a NaN stays a
// NaN, its payload unspecified).
inline std::uint16_t bf16_round(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return std::uint16_t((u >> 16) | 0x40u);  // quiet NaN
  return std::uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline float bf16_value(std::uint16_t h) {
  const std::uint32_t u = std::uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The fixed-order RMSNorm over rows (the ISA's rms_norm_rows: the contract's 16-lane sum), with
// rows and outputs fp32 or bf16 bit patterns (bf16), w fp32. With a residual (not null; h then
// too), each row first becomes h = x + residual, added in fp32 and rounded to the rows' dtype
// (the new residual, written to h); the row (widened, when bf16) is normalised and rounded once
// to y. Without fp32 copies of bf16 rows, which at decode sizes cost more than the norm. Rows
// are independent: the bits depend on neither M nor the threads. Takes no GIL.
template <class T>
void rms_norm_rows_of(const Isa& isa, const T* xs, idx_t sxm, const T* rs, idx_t srm,
                      const float* w, T* ys, idx_t sym, T* hs, idx_t shm, idx_t M, idx_t H,
                      float eps, idx_t threads) {
  constexpr bool kF32 = std::is_same_v<T, float>;
  if (kF32 && rs == nullptr) {  // the kernel reads the rows and writes y in place
    parallel_run(int(threads), [&](int id) {
      isa.rms(reinterpret_cast<const float*>(xs), sxm, w, reinterpret_cast<float*>(ys), sym,
              M * id / threads, M * (id + 1) / threads, H, eps);
    });
    return;
  }
  float* rows = scratch_floats(size_t(2 * H) * size_t(threads));  // a row and its result
  parallel_run(int(threads), [&](int id) {
    float* in = rows + size_t(2 * H) * size_t(id);
    float* out = in + H;
    for (idx_t m = M * id / threads; m < M * (id + 1) / threads; ++m) {
      const T* xr = xs + m * sxm;
      if (rs != nullptr) {
        const T* rr = rs + m * srm;
        T* hr = hs + m * shm;
        for (idx_t j = 0; j < H; ++j) {
          if constexpr (kF32) {
            hr[j] = in[j] = xr[j] + rr[j];
          } else {
            hr[j] = bf16_round(bf16_value(xr[j]) + bf16_value(rr[j]));
            in[j] = bf16_value(hr[j]);
          }
        }
      } else if constexpr (!kF32) {
        for (idx_t j = 0; j < H; ++j) in[j] = bf16_value(xr[j]);
      }
      T* yr = ys + m * sym;
      if constexpr (kF32) {
        isa.rms(in, H, w, yr, H, 0, 1, H, eps);
      } else {
        isa.rms(in, H, w, out, H, 0, 1, H, eps);
        for (idx_t j = 0; j < H; ++j) yr[j] = bf16_round(out[j]);
      }
    }
  });
}

idx_t rms_threads(int num_threads, idx_t M, idx_t H) {
  return std::max<idx_t>(
      1, std::min<idx_t>({idx_t(num_threads), M, (M * H) / kRmsMinElemsPerThread}));
}

void rms_norm_f32(std::uintptr_t x, idx_t sxm, std::uintptr_t w, std::uintptr_t y, idx_t sym,
                  idx_t M, idx_t H, double eps, int num_threads, const std::string& isa_name) {
  if (M < 0 || H < 0) throw std::invalid_argument("bik: negative rms_norm size");
  const Isa isa = select_isa(isa_name);
  if (M == 0 || H == 0) return;
  pybind11::gil_scoped_release nogil;
  rms_norm_rows_of<float>(isa, fptr(x), sxm, nullptr, 0, fptr(w), reinterpret_cast<float*>(y),
                          sym, nullptr, 0, M, H, static_cast<float>(eps),  // eps rounded first
                          rms_threads(num_threads, M, H));
}

// rms_norm_f32 for bf16 rows (and residual, when not 0): bf16 y (and h = x + residual).
void rms_norm_bf16(std::uintptr_t x, idx_t sxm, std::uintptr_t residual, idx_t srm,
                   std::uintptr_t w, std::uintptr_t y, idx_t sym, std::uintptr_t h, idx_t shm,
                   idx_t M, idx_t H, double eps, int num_threads, const std::string& isa_name) {
  if (M < 0 || H < 0) throw std::invalid_argument("bik: negative rms_norm size");
  if (residual != 0 && h == 0) throw std::invalid_argument("bik: a residual needs h");
  const Isa isa = select_isa(isa_name);
  if (M == 0 || H == 0) return;
  using u16 = std::uint16_t;
  pybind11::gil_scoped_release nogil;
  rms_norm_rows_of<u16>(isa, reinterpret_cast<const u16*>(x), sxm,
                        reinterpret_cast<const u16*>(residual), srm, fptr(w),
                        reinterpret_cast<u16*>(y), sym, reinterpret_cast<u16*>(h), shm, M, H,
                        static_cast<float>(eps), rms_threads(num_threads, M, H));
}

// The fixed-order softmax (softmax = true) or mean of rows 0..M-1 of fp32 x [M, N] (unit
// stride along N, row stride sxm) into y (softmax: [M, N] with row stride sym; mean: [M]), on
// num_threads threads splitting rows. Takes no GIL; M, N > 0.
void reduce_rows(bool softmax, const float* x, idx_t sxm, float* y, idx_t sym, idx_t M, idx_t N,
                 int num_threads) {
  const idx_t t = std::max<idx_t>(
      1, std::min<idx_t>({idx_t(num_threads), M, (M * N) / red::kMinElemsPerThread}));
  parallel_run(int(t), [&](int id) {
    const idx_t m0 = M * id / t, m1 = M * (id + 1) / t;
    if (softmax)
      red::softmax_rows(x, sxm, y, sym, m0, m1, N);
    else
      red::mean_rows(x, sxm, y, m0, m1, N);
  });
}

void softmax_f32(std::uintptr_t x, idx_t sxm, std::uintptr_t y, idx_t sym, idx_t M, idx_t N,
                 int num_threads) {
  if (M < 0 || N < 0) throw std::invalid_argument("bik: negative softmax size");
  if (M == 0 || N == 0) return;
  pybind11::gil_scoped_release nogil;
  reduce_rows(true, fptr(x), sxm, reinterpret_cast<float*>(y), sym, M, N, num_threads);
}

void check_vocab_chunks(const char* op, idx_t V, idx_t groups, idx_t chunk) {
  if (groups < 1 || chunk < 1 || (chunk & (chunk - 1)) != 0 || V % groups != 0)
    throw std::invalid_argument(std::string("bik: ") + op +
                                " needs groups >= 1 dividing V and a power-of-two chunk, got V=" +
                                std::to_string(V) + " groups=" + std::to_string(groups) +
                                " chunk=" + std::to_string(chunk));
}

// log_softmax in the sampler's normaliser order (normaliser.h), groups/chunk from
// bik.configs.sampler_chunks(N); the isa changes speed only, never bits (tests).
void log_softmax_f32(std::uintptr_t x, idx_t sxm, std::uintptr_t y, idx_t sym, idx_t M, idx_t N,
                     idx_t groups, idx_t chunk, int num_threads, const std::string& isa_name) {
  if (M < 0 || N < 0) throw std::invalid_argument("bik: negative log_softmax size");
  if (M == 0 || N == 0) return;
  check_vocab_chunks("log_softmax", N, groups, chunk);
  const Isa isa = select_isa(isa_name);
  const idx_t t = std::max<idx_t>(
      1, std::min<idx_t>({idx_t(num_threads), M, (M * N) / red::kMinElemsPerThread}));
  pybind11::gil_scoped_release nogil;
  parallel_run(int(t), [&](int id) {
    const idx_t m0 = M * id / t, m1 = M * (id + 1) / t;
    isa.log_softmax(fptr(x), sxm, reinterpret_cast<float*>(y), sym, m0, m1, N, groups, chunk);
  });
}

void mean_f32(std::uintptr_t x, idx_t sxm, std::uintptr_t y, idx_t M, idx_t N, int num_threads) {
  if (M < 0 || N <= 0) throw std::invalid_argument("bik: mean needs M >= 0 and N > 0");
  if (M == 0) return;
  pybind11::gil_scoped_release nogil;
  reduce_rows(false, fptr(x), sxm, reinterpret_cast<float*>(y), 0, M, N, num_threads);
}

// y[i] = exp2f(x[i]) or log2f(x[i]): a pure function of each input value (no SIMD body vs scalar tail that could
// round differently), so an element's bits never depend on its position or the tensor's size.
// Used by the CPU attention path, whose other steps are exact or fixed-order kernels above.
void unary_f32(std::uintptr_t x, std::uintptr_t y, idx_t n, const std::string& fn) {
  if (n < 0) throw std::invalid_argument("bik: negative unary size");
  const bool is_exp2 = fn == "exp2";
  if (!is_exp2 && fn != "log2") throw std::invalid_argument("bik: unary_f32 takes exp2 or log2");
  const float* xp = fptr(x);
  float* yp = reinterpret_cast<float*>(y);
  pybind11::gil_scoped_release nogil;
  FenvGuard g;
  if (is_exp2) {
    for (idx_t i = 0; i < n; ++i) yp[i] = std::exp2(xp[i]);
  } else {
    for (idx_t i = 0; i < n; ++i) yp[i] = std::log2(xp[i]);
  }
}

// Runs one attention problem (attention.h) after the kernel's own check of its lengths and key
// offsets: "" when done, else the check's message (nothing computed). Takes no GIL.
std::string run_attention(const attn::Problem& p, idx_t total_q, idx_t k_extent,
                          int num_threads, const Isa& isa) {
  std::string bad = attn::check_metadata(p, total_q, k_extent);
  if (!bad.empty()) return bad;
  double macs = 0;
  const std::vector<attn::Item> items = attn::make_items(p, &macs);
  if (items.empty()) return "";
  // One K block and one N block per tile call (speed only): K is D or a split's keys.
  const idx_t d = p.d, split = p.split;
  const idx_t kc = std::max(d, split);
  const idx_t nc = (std::max(d, split) + isa.nrw - 1) / isa.nrw * isa.nrw;
  const size_t per_worker =
      (attn::own_floats(p) + isa.scratch_per_thread(kc, nc, 0) + 15) / 16 * 16;
  const idx_t nt = std::max<idx_t>(1, std::min<idx_t>(
      {idx_t(num_threads), idx_t(items.size()), idx_t(macs / double(kMatmulMinMacsPerThread))}));
  float* ws = scratch_floats(per_worker * size_t(nt));
  attn::run_items(p, attn::Tiles{isa.tile, isa.tile_bf16}, kc, nc, items, int(nt), ws,
                  per_worker);
  return "";
}

// Fixed-split attention (attention.h) over fp32 q and fp32 or bf16 k/v: q by strides, keys by
// per-key offsets.
void attention_f32(std::uintptr_t q, idx_t sq_tok, idx_t sq_head, std::uintptr_t k,
                   std::uintptr_t v, idx_t k_extent, std::uintptr_t koff, idx_t koff_row,
                   idx_t s_head, std::uintptr_t cu_q, std::uintptr_t lens_k, idx_t B,
                   idx_t total_q, idx_t hq, idx_t hkv, idx_t d, idx_t split, double scale_log2e,
                   bool causal, std::uintptr_t out, std::uintptr_t lse, int num_threads,
                   const std::string& isa_name, bool kv_bf16) {
  if (B < 0 || d < 0 || hkv <= 0 || hq % hkv != 0 || split <= 0 || koff_row < 0)
    throw std::invalid_argument("bik: attention needs B >= 0, D >= 0, Hq % Hkv == 0, split > 0");
  const Isa isa = select_isa(isa_name);
  using I64 = const std::int64_t*;
  const attn::Problem p{fptr(q), sq_tok, sq_head, reinterpret_cast<const void*>(k),
                        reinterpret_cast<const void*>(v), reinterpret_cast<I64>(koff),
                        koff_row, s_head, reinterpret_cast<I64>(cu_q),
                        reinterpret_cast<I64>(lens_k), B, hq, hkv, d, split,
                        static_cast<float>(scale_log2e), causal,
                        reinterpret_cast<float*>(out), reinterpret_cast<float*>(lse), kv_bf16};
  std::string bad;
  {
    pybind11::gil_scoped_release nogil;
    bad = run_attention(p, total_q, k_extent, num_threads, isa);
  }
  if (!bad.empty()) throw std::invalid_argument(bad);
}

// The normaliser's sum (sampling.h vocab_sum) of given fp32 terms [B, V] (contiguous), per row:
// the contract's order, for tests and cross-backend checks.
void vocab_sum_f32(std::uintptr_t terms, idx_t B, idx_t V, idx_t groups, idx_t chunk,
                   std::uintptr_t out) {
  if (B < 0 || V <= 0) throw std::invalid_argument("bik: vocab_sum needs B >= 0 and V > 0");
  check_vocab_chunks("vocab_sum", V, groups, chunk);
  const float* t = fptr(terms);
  float* o = reinterpret_cast<float*>(out);
  pybind11::gil_scoped_release nogil;
  FenvGuard g;
  for (idx_t r = 0; r < B; ++r)
    o[r] = sampling::vocab_sum(V, {groups, chunk}, [t, r, V](idx_t j) { return t[r * V + j]; });
}

// Gumbel-max sampler (sampling.h): rows of fp32 logits, per-row parameters, threads split rows.
void sample_f32(std::uintptr_t x, idx_t sx, idx_t B, idx_t V, idx_t groups, idx_t chunk,
                std::uintptr_t seed, std::uintptr_t position, std::uintptr_t temperature,
                std::uintptr_t top_k,
                std::uintptr_t top_p, std::uintptr_t log_min_p, std::uint32_t stream,
                std::uintptr_t tokens, std::uintptr_t logprobs, int num_threads,
                const std::string& isa_name, bool min_p_raw) {
  if (B < 0 || V <= 0) throw std::invalid_argument("bik: sample needs B >= 0 and V > 0");
  check_vocab_chunks("sample", V, groups, chunk);
  if (B == 0) return;
  // min_p_raw: log_min_p holds min_p itself; its bik_log is taken here, as noise.log_min_p
  // takes it in torch (the same sequence: the same bits), without reading it back first.
  std::vector<float> lmp;
  if (min_p_raw) {
    const float* mp = fptr(log_min_p);
    lmp.resize(size_t(B));
    for (idx_t r = 0; r < B; ++r)
      lmp[size_t(r)] = mp[r] > 0.0f
                           ? norm::bik_log(std::max(mp[r], std::numeric_limits<float>::min()))
                           : -std::numeric_limits<float>::infinity();
    log_min_p = reinterpret_cast<std::uintptr_t>(lmp.data());
  }
  using I64 = const std::int64_t*;
  using F32 = const float*;
  const idx_t t = std::max<idx_t>(
      1, std::min<idx_t>({idx_t(num_threads), B, (B * V) / red::kMinElemsPerThread}));
  // "scalar": every row on sample_row's scalar sequence (tests compare the greedy path with it)
  sampling::RowVectors vectors{};
  if (isa_name != "scalar") {
    const Isa isa = select_isa(isa_name);
    vectors = {isa.row_max, isa.exp_sum};
  }
  pybind11::gil_scoped_release nogil;
  parallel_run(int(t), [&](int id) {
    const idx_t r0 = B * id / t, r1 = B * (id + 1) / t;
    sampling::sample_rows(fptr(x), sx, V, {groups, chunk}, reinterpret_cast<I64>(seed),
                          reinterpret_cast<I64>(position), reinterpret_cast<F32>(temperature),
                          reinterpret_cast<I64>(top_k), reinterpret_cast<F32>(top_p),
                          reinterpret_cast<F32>(log_min_p), stream,
                          reinterpret_cast<std::int64_t*>(tokens),
                          reinterpret_cast<float*>(logprobs), r0, r1, vectors);
  });
}

// The sampler's building blocks, elementwise over n entries (tests and cross-backend checks):
// "philox": in = uint32 [n, 6] (counter c0..c3, key k0, k1) -> out = uint32 [n, 4];
// "log": fp32 -> bik_log; "gumbel": fp32 u -> -bik_log(-bik_log(u)); "exp": fp32 x <= 0 -> bik_exp.
void sampling_elementwise(const std::string& fn, std::uintptr_t in, std::uintptr_t out, idx_t n) {
  if (n < 0) throw std::invalid_argument("bik: negative size");
  pybind11::gil_scoped_release nogil;
  FenvGuard g;
  if (fn == "philox") {
    const auto* c = reinterpret_cast<const std::uint32_t*>(in);
    auto* o = reinterpret_cast<std::uint32_t*>(out);
    for (idx_t i = 0; i < n; ++i) {
      const auto w = sampling::philox4x32_10(c[6 * i], c[6 * i + 1], c[6 * i + 2], c[6 * i + 3],
                                             c[6 * i + 4], c[6 * i + 5]);
      for (int k = 0; k < 4; ++k) o[4 * i + k] = w.v[k];
    }
    return;
  }
  const float* xp = fptr(in);
  float* yp = reinterpret_cast<float*>(out);
  if (fn == "log") {
    for (idx_t i = 0; i < n; ++i) yp[i] = sampling::bik_log(xp[i]);
  } else if (fn == "gumbel") {
    for (idx_t i = 0; i < n; ++i) yp[i] = sampling::gumbel_from_unit(xp[i]);
  } else if (fn == "exp") {
    for (idx_t i = 0; i < n; ++i) yp[i] = sampling::bik_exp(xp[i]);
  } else {
    throw std::invalid_argument("bik: sampling_elementwise takes philox, log, gumbel or exp");
  }
}

}  // namespace
}  // namespace bik_cpu

// c_abi.h's matmul entry: the widest ISA (resolved once), auto blocking, no exceptions.
extern "C" int bik_cpu_matmul_f32(const BikMatmulF32Args* p) {
  if (p->M < 0 || p->N < 0 || p->K < 0 || p->batch < 0 || p->split < 0 ||
      (p->packed != nullptr && p->batch != 1))
    return 1;
  static const bik_cpu::Isa isa = bik_cpu::select_isa("auto");
  const int dot = p->bf16_amx ? bik_cpu::kDotAmx : bik_cpu::kDotFma;
  if (p->a_bf16 && (!p->b_bf16 || !bik_cpu::bf16_dot_refusal(dot).empty())) return 3;
  if (p->fp32_fma && !p->a_bf16 && !bik_cpu::fp32_fma_refusal().empty()) return 3;
  try {  // a thread that cannot start (std::system_error) must not cross the C boundary
    bik_cpu::matmul_run(isa, reinterpret_cast<std::uintptr_t>(p->a), p->sam, p->sak,
                        reinterpret_cast<std::uintptr_t>(p->b), p->sbk, p->sbn,
                        reinterpret_cast<std::uintptr_t>(p->bias),
                        reinterpret_cast<std::uintptr_t>(p->c), p->ldc, p->M, p->N, p->K,
                        p->split, p->num_threads, 0, 0, p->b_bf16 != 0, p->batch, p->sab,
                        p->sbb, p->scb, reinterpret_cast<std::uintptr_t>(p->packed),
                        p->a_bf16 != 0, dot, p->fp32_fma != 0, p->c_bf16 != 0);
  } catch (...) {
    return 2;
  }
  return 0;
}

// c_abi.h's KV cache write entry (write_kv_rows for one cache).
extern "C" int bik_cpu_write_kv_rows(const BikKvRowsArgs* a) {
  if (a->block <= 0 || a->tokens < 0 || a->hkv < 0 || a->d < 0 || (a->elem != 2 && a->elem != 4))
    return 1;
  bik_cpu::copy_kv_rows(static_cast<char*>(a->cache), a->c_page, a->c_off, a->c_head, a->block,
                        a->n_slots, static_cast<const char*>(a->src), a->s_tok, a->s_head,
                        a->tokens, a->hkv, a->d, a->elem, a->slots, a->slots_i64 != 0);
  return 0;
}

// c_abi.h's softmax / mean rows entry.
extern "C" int bik_cpu_reduce_rows(const BikReduceRowsArgs* a) {
  if (a->M < 0 || a->N <= 0 || (a->op != 0 && a->op != 1)) return 1;
  if (a->M == 0) return 0;
  try {
    bik_cpu::reduce_rows(a->op == 0, a->x, a->sxm, a->y, a->sym, a->M, a->N, a->num_threads);
  } catch (...) {
    return 2;
  }
  return 0;
}

// c_abi.h's RMSNorm entry: the widest ISA (resolved once), no exceptions.
extern "C" int bik_cpu_rms_norm(const BikRmsNormArgs* p) {
  if (p->M < 0 || p->H < 0 || (p->residual != nullptr && p->h == nullptr)) return 1;
  if (p->M == 0 || p->H == 0) return 0;
  static const bik_cpu::Isa isa = bik_cpu::select_isa("auto");
  const auto threads = bik_cpu::rms_threads(p->num_threads, p->M, p->H);
  const auto eps = static_cast<float>(p->eps);
  try {
    if (p->bf16) {
      using u16 = std::uint16_t;
      bik_cpu::rms_norm_rows_of<u16>(
          isa, static_cast<const u16*>(p->x), p->sxm, static_cast<const u16*>(p->residual),
          p->srm, p->w, static_cast<u16*>(p->y), p->sym, static_cast<u16*>(p->h), p->shm, p->M,
          p->H, eps, threads);
    } else {
      bik_cpu::rms_norm_rows_of<float>(
          isa, static_cast<const float*>(p->x), p->sxm, static_cast<const float*>(p->residual),
          p->srm, p->w, static_cast<float*>(p->y), p->sym, static_cast<float*>(p->h), p->shm,
          p->M, p->H, eps, threads);
    }
  } catch (...) {
    return 2;
  }
  return 0;
}

namespace {

std::int64_t read_index(const void* base, bool i64, std::int64_t at) {
  return i64 ? static_cast<const std::int64_t*>(base)[at]
             : std::int64_t(static_cast<const std::int32_t*>(base)[at]);
}

int refuse(const BikAttentionPagedArgs* a, const std::string& why) {
  if (a->error != nullptr && a->error_size > 0) {
    const size_t n = std::min(why.size(), size_t(a->error_size - 1));
    std::memcpy(a->error, why.data(), n);
    a->error[n] = '\0';
  }
  return 1;
}

}  // namespace

// c_abi.h's paged attention entry. The key offsets are the ones bik.ops.attention.cpu.cpu_keys
// builds in torch: a page of the block table clamped to [-1, num_blocks], then page * s_page +
// (t % block_size) * s_tok, for the first min(max_seqlen_k, pages * block_size) keys of each
// sequence; then attention.h's check and kernel.
extern "C" int bik_cpu_attention_paged(const BikAttentionPagedArgs* a) {
  using bik_cpu::idx_t;
  if (a->B < 0 || a->d < 0 || a->hkv <= 0 || a->hq % a->hkv != 0 || a->split <= 0 ||
      a->block_size <= 0 || a->table_cols < 0 || a->max_seqlen_k < 0 || a->total_q < 0)
    return refuse(a, "attention needs B >= 0, D >= 0, Hq % Hkv == 0, split > 0, block_size > 0");
  try {
    const idx_t B = a->B, block = a->block_size;
    const idx_t pages = std::min((a->max_seqlen_k + block - 1) / block, a->table_cols);
    const idx_t width = std::min(a->max_seqlen_k, pages * block);
    thread_local std::vector<std::int64_t> koff, cu, lens;  // read by the workers below
    koff.assign(size_t(B * width), 0);
    cu.resize(size_t(B + 1));
    lens.resize(size_t(B));
    for (idx_t b = 0; b < B; ++b) {
      std::int64_t* row = koff.data() + b * width;
      for (idx_t p = 0; p < pages; ++p) {
        const std::int64_t page = std::clamp<std::int64_t>(
            read_index(a->block_table, a->table_i64, b * a->s_table + p), -1, a->num_blocks);
        for (idx_t t = p * block; t < std::min(width, (p + 1) * block); ++t)
          row[t] = page * a->s_page + (t - p * block) * a->s_tok;
      }
      lens[size_t(b)] = read_index(a->seqlens_k, a->seqlens_i64, b);
    }
    for (idx_t b = 0; b <= B; ++b) cu[size_t(b)] = read_index(a->cu_q, a->cu_q_i64, b);
    const bik_cpu::attn::Problem p{
        a->q, a->sq_tok, a->sq_head, a->k, a->v, koff.data(), width, a->s_head, cu.data(),
        lens.data(), B, a->hq, a->hkv, a->d, a->split, static_cast<float>(a->scale_log2e),
        a->causal != 0, a->out, a->lse, a->kv_bf16 != 0};
    static const bik_cpu::Isa isa = bik_cpu::select_isa("auto");
    const std::string bad =
        bik_cpu::run_attention(p, a->total_q, a->k_extent, a->num_threads, isa);
    if (!bad.empty()) return refuse(a, bad);
  } catch (...) {
    return 2;
  }
  return 0;
}

// A self-test's probes for the tests: M, N, K, splits and the words of a [M, K] and b [K, N].
template <class Probe>
pybind11::list probe_list() {
  pybind11::list probes;
  for (const auto K : Probe::kKs) {
    const Probe p(K);
    pybind11::dict d;
    d["M"] = p.M;
    d["N"] = p.N;
    d["K"] = p.K;
    d["splits"] = p.splits();
    d["a"] = p.a;
    d["b"] = p.b;
    probes.append(d);
  }
  return probes;
}

PYBIND11_MODULE(_cpu_kernels, m) {
  pthread_atfork(nullptr, nullptr, [] { bik_cpu::forked_child() = true; });
  namespace py = pybind11;
  m.doc() = "bik fixed-order fp32 CPU kernels (batch-invariant by construction; see contract.h)";
#ifndef BIK_CPU_SOURCE_HASH
#define BIK_CPU_SOURCE_HASH "unknown"
#endif
  m.attr("SOURCE_HASH") = BIK_CPU_SOURCE_HASH;  // of csrc/cpu, computed by setup.py
  // The numerics contract's revision (in bik.fingerprint): raised whenever a kernel's bits
  // change or a kernel is added, so fingerprints of different contracts never match.
  m.attr("CONTRACT_VERSION") = 10;
  m.def("matmul_f32", &bik_cpu::matmul_f32, py::arg("a"), py::arg("sam"), py::arg("sak"),
        py::arg("b"), py::arg("sbk"), py::arg("sbn"), py::arg("bias"), py::arg("c"),
        py::arg("ldc"), py::arg("M"), py::arg("N"), py::arg("K"), py::arg("split"),
        py::arg("num_threads"), py::arg("isa") = "auto", py::arg("block_k") = 0,
        py::arg("block_n") = 0, py::arg("b_bf16") = false, py::arg("batch") = 1, py::arg("sab") = 0, py::arg("sbb") = 0,
        py::arg("scb") = 0, py::arg("packed") = 0, py::arg("a_bf16") = false,
        py::arg("dot_kernel") = "fma", py::arg("fp32_fma") = false, py::arg("c_bf16") = false,
        "c[M,N] (row pitch ldc) = a[M,K] @ b[K,N] (+ bias[N]); raw pointers, element strides.\n"
        "split: the K-split length S of contract.h (0 or >= K: one split).\n"
        "isa/block_k/block_n (0 = auto) change speed only, never bits (tests check this).\n"
        "b_bf16: b holds bf16 bit patterns, widened exactly to fp32 while packing.\n"
        "batch entries e < batch: a + e*sab, b + e*sbb, c + e*scb (elements; b's in its dtype).\n"
        "packed: b as matmul_pack_b wrote it for the same isa (b unread; batch 1), same bits.\n"
        "a_bf16: a and b hold bf16 bit patterns: the bf16 dot sequence of contract.h (packed:\n"
        "as matmul_pack_b_pairs wrote it), on dot_kernel 'fma' or 'vdpbf16ps' (same bits).\n"
        "fp32_fma (off the bf16 dot path): contract.h's fp32 fma sequence, else the mul-add one.\n"
        "c_bf16: c holds bf16, each result rounded as torch's .to(torch.bfloat16) rounds it.");
  m.def(
      "fp32_fma_probe",
      &probe_list<bik_cpu::FmaProbe>,
      "The fp32 fma self-test's probes: M, N, K, splits and the floats of a [M, K], b [K, N].");
  m.def("fp32_fma_refusal", &bik_cpu::fp32_fma_refusal,
        "Why the fp32 fma sequence's kernel cannot run in this process ('' when it can): the\n"
        "CPU has no FMA, or the start-up self-test disagreed with the transcription.");
  m.def("matmul_fp32_fma_reference",
        &bik_cpu::matmul_reference<float, &bik_cpu::fma_ref::matmul>, py::arg("a"),
        py::arg("sam"), py::arg("sak"), py::arg("b"), py::arg("sbk"), py::arg("sbn"),
        py::arg("bias"), py::arg("c"), py::arg("ldc"), py::arg("M"), py::arg("N"), py::arg("K"),
        py::arg("split"), "contract.h's fp32 fma sequence in scalar C++ (any CPU; tests).");
  m.def(
      "bf16_dot_probe",
      &probe_list<bik_cpu::DotProbe>,
      "The self-test's probes: M, N, K, splits and the bf16 words of a [M, K] and b [K, N].");
  m.def(
      "bf16_dot_refusal",
      [](const std::string& kernel) {
        if (kernel != "fma" && kernel != "vdpbf16ps" && kernel != "amx")
          throw std::invalid_argument("bik: bf16 kernel '" + kernel + "' (fma, vdpbf16ps, amx)");
        return bik_cpu::bf16_dot_refusal(kernel == "amx"         ? bik_cpu::kDotAmx
                                         : kernel == "vdpbf16ps" ? bik_cpu::kDotVdp
                                                                 : bik_cpu::kDotFma);
      },
      py::arg("kernel") = "fma",
      "Why a bf16 kernel (the dot sequence's 'fma' or 'vdpbf16ps', the AMX sequence's 'amx')\n"
      "cannot run in this process ('' when it can): the CPU lacks it, or the start-up\n"
      "self-test disagreed with its sequence's transcription.");
  m.def("matmul_bf16_amx_reference",
        &bik_cpu::matmul_reference<std::uint16_t, &bik_cpu::amx_ref::matmul>, py::arg("a"),
        py::arg("sam"), py::arg("sak"), py::arg("b"), py::arg("sbk"), py::arg("sbn"),
        py::arg("bias"), py::arg("c"), py::arg("ldc"), py::arg("M"), py::arg("N"), py::arg("K"),
        py::arg("split"), "contract.h's bf16 AMX sequence in scalar C++ (any CPU; tests).");
  m.def("matmul_bf16_dot_reference",
        &bik_cpu::matmul_reference<std::uint16_t, &bik_cpu::dot_ref::matmul>, py::arg("a"),
        py::arg("sam"), py::arg("sak"), py::arg("b"), py::arg("sbk"), py::arg("sbn"),
        py::arg("bias"), py::arg("c"), py::arg("ldc"), py::arg("M"), py::arg("N"), py::arg("K"),
        py::arg("split"), "contract.h's bf16 dot sequence in scalar C++ (any CPU; tests).");
  m.def("matmul_pack_b_pairs", &bik_cpu::matmul_pack_b_pairs, py::arg("b"), py::arg("sbk"),
        py::arg("sbn"), py::arg("K"), py::arg("N"), py::arg("split"), py::arg("isa"),
        py::arg("dst"),
        "All of b[K, N] (bf16) in the bf16 dot path's pair panels, each split's pairs apart.");
  m.def(
      "matmul_dot_pair_rows",
      [](bik_cpu::idx_t K, bik_cpu::idx_t split) {
        if (split <= 0 || split >= K) split = K > 0 ? K : 1;
        return (K / split) * ((split + 1) / 2) + (K % split + 1) / 2;
      },
      py::arg("K"), py::arg("split"), "Pair rows of a packed panel for K and the split.");
  m.def(
      "matmul_split_len",
      [](std::int64_t K, std::array<std::int64_t, 5> r) {
        const BikMatmulSplitRule rule{r[0], r[1], r[2], r[3], r[4]};
        return bik_matmul_split_len(K, &rule);
      },
      py::arg("K"), py::arg("rule"),
      "c_abi.h's split rule (what the dispatcher kernels use) for the constants `rule`.");
  m.def("matmul_pack_b", &bik_cpu::matmul_pack_b, py::arg("b"), py::arg("sbk"), py::arg("sbn"),
        py::arg("K"), py::arg("N"), py::arg("b_bf16"), py::arg("isa"), py::arg("dst"),
        "dst[p][k][nrw] = b[k, p*nrw + j] (0 past N): all of b[K, N] in the matmul's panels.");
  m.def(
      "matmul_panel_width",
      [](const std::string& want) { return bik_cpu::select_isa(want).nrw; },
      py::arg("isa") = "auto", "Columns per packed B panel (nrw) of the ISA path `want`.");
  m.def("write_kv_rows", &bik_cpu::write_kv_rows, py::arg("cache"), py::arg("c_page"),
        py::arg("c_off"), py::arg("c_head"), py::arg("block"), py::arg("n_slots"),
        py::arg("src"), py::arg("s_tok"), py::arg("s_head"), py::arg("tokens"), py::arg("hkv"),
        py::arg("d"), py::arg("elem"), py::arg("slots"),
        "cache[slots[t] / block, slots[t] % block] = src[t] for 0 <= slots[t] < n_slots.");
  m.def("rms_norm_bf16", &bik_cpu::rms_norm_bf16, py::arg("x"), py::arg("sxm"),
        py::arg("residual"), py::arg("srm"), py::arg("w"), py::arg("y"), py::arg("sym"),
        py::arg("h"), py::arg("shm"), py::arg("M"), py::arg("H"), py::arg("eps"),
        py::arg("num_threads"), py::arg("isa") = "auto",
        "rms_norm_f32 on bf16 rows (and residual; 0: none), bf16 y (and h = x + residual),\n"
        "fp32 w: the fp32 path's bits without fp32 copies of the rows.");
  m.def("rms_norm_f32", &bik_cpu::rms_norm_f32, py::arg("x"), py::arg("sxm"), py::arg("w"),
        py::arg("y"), py::arg("sym"), py::arg("M"), py::arg("H"), py::arg("eps"),
        py::arg("num_threads"), py::arg("isa") = "auto",
        "y[M,H] = rms_norm(x[M,H]) * w[H]; unit stride along H, row strides sxm/sym.");
  m.def("softmax_f32", &bik_cpu::softmax_f32, py::arg("x"), py::arg("sxm"), py::arg("y"),
        py::arg("sym"), py::arg("M"), py::arg("N"), py::arg("num_threads"),
        "y[M,N] = softmax of each row of x[M,N] (16-lane sum); unit stride along N.");
  m.def("log_softmax_f32", &bik_cpu::log_softmax_f32, py::arg("x"), py::arg("sxm"),
        py::arg("y"), py::arg("sym"), py::arg("M"), py::arg("N"), py::arg("groups"),
        py::arg("chunk"), py::arg("num_threads"), py::arg("isa") = "auto",
        "y[M,N] = log_softmax of each row of x[M,N] in the sampler's normaliser order.");
  m.def("mean_f32", &bik_cpu::mean_f32, py::arg("x"), py::arg("sxm"), py::arg("y"), py::arg("M"),
        py::arg("N"), py::arg("num_threads"),
        "y[M] = mean of each row of x[M,N] (N > 0); unit stride along N.");
  m.def("unary_f32", &bik_cpu::unary_f32, py::arg("x"), py::arg("y"), py::arg("n"),
        py::arg("fn"), "y[i] = exp2f(x[i]) or log2f(x[i]) (fn) for contiguous fp32 buffers.");
  m.def("attention_f32", &bik_cpu::attention_f32, py::arg("q"), py::arg("sq_tok"),
        py::arg("sq_head"), py::arg("k"), py::arg("v"), py::arg("k_extent"), py::arg("koff"),
        py::arg("koff_row"), py::arg("s_head"), py::arg("cu_q"), py::arg("lens_k"), py::arg("B"),
        py::arg("total_q"), py::arg("hq"), py::arg("hkv"), py::arg("d"), py::arg("split"),
        py::arg("scale_log2e"), py::arg("causal"), py::arg("out"), py::arg("lse"),
        py::arg("num_threads"), py::arg("isa") = "auto", py::arg("kv_bf16") = false,
        "Fixed-split attention (attention.h): fp32 q, fp32 k/v (bf16 bit patterns when\n"
        "kv_bf16, read in place), int64 koff [B, koff_row] in k's elements, cu_q and lens_k,\n"
        "checked first (ValueError); writes fp32 out [total_q, hq, d] and lse [total_q, hq]\n"
        "(natural log).");
  m.def("sample_f32", &bik_cpu::sample_f32, py::arg("x"), py::arg("sx"), py::arg("B"),
        py::arg("V"), py::arg("groups"), py::arg("chunk"), py::arg("seed"), py::arg("position"), py::arg("temperature"),
        py::arg("top_k"), py::arg("top_p"), py::arg("log_min_p"), py::arg("stream"),
        py::arg("tokens"), py::arg("logprobs"), py::arg("num_threads"),
        py::arg("isa") = "auto", py::arg("min_p_raw") = false,
        "Gumbel-max sampler over rows of x[B,V] (unit stride along V); see sampling.h.\n"
        "min_p_raw: log_min_p holds min_p, whose bik_log (or -inf where 0) is taken here.\n"
        "isa: the vectors of the unfiltered greedy rows' normaliser (speed only; 'scalar':\n"
        "every row on sample_row's scalar sequence).");
  m.def("sampling_elementwise", &bik_cpu::sampling_elementwise, py::arg("fn"), py::arg("in"),
        py::arg("out"), py::arg("n"), "philox / log / gumbel / exp building blocks of the sampler.");
  m.def("vocab_sum_f32", &bik_cpu::vocab_sum_f32, py::arg("terms"), py::arg("B"), py::arg("V"),
        py::arg("groups"), py::arg("chunk"), py::arg("out"),
        "The sampler normaliser's sum of fp32 terms [B, V] per row (sampling.h vocab_sum).");
  m.def(
      "isa", [](const std::string& want) { return std::string(bik_cpu::select_isa(want).name); },
      py::arg("want") = "auto", "Name of the ISA path `want` resolves to.");
  m.def("isa_supported", &bik_cpu::isa_supported, py::arg("name"));
  m.def(
      "c_entry_points",
      [] {
        py::dict d;
        d["abi_version"] = BIK_C_ABI_VERSION;
        d["matmul_f32"] = reinterpret_cast<std::uintptr_t>(&bik_cpu_matmul_f32);
        d["rms_norm"] = reinterpret_cast<std::uintptr_t>(&bik_cpu_rms_norm);
        d["attention_paged"] = reinterpret_cast<std::uintptr_t>(&bik_cpu_attention_paged);
        d["write_kv_rows"] = reinterpret_cast<std::uintptr_t>(&bik_cpu_write_kv_rows);
        d["reduce_rows"] = reinterpret_cast<std::uintptr_t>(&bik_cpu_reduce_rows);
        return d;
      },
      "Addresses of the c_abi.h entry points (for bik's dispatcher kernels), and its version.");
}
