// bik CUDA matmul: C[b] = A[b] @ B[b] (+ bias) with an M-independent reduction order.
// The contract and the index math are in matmul_plan.cuh; this file holds the two tile
// programs (tensor-core mma.sync for bf16/fp16, a SIMT IEEE fp32 path) and the split reduce.
//
// Portable sm_80 code (mma.sync.m16n8k16 runs on Ampere and Hopper). Every tile is fixed at
// compile time: BLOCK_M never follows M, so every row of every M meets the same instruction
// sequence. Rows past M, columns past N and k past the split end are zero-filled on load and
// never stored. Loads decide speed, never bits: a two-stage cp.async pipeline when both 16-bit
// operands are k-contiguous and aligned (x @ weight.t()), else 16-byte register loads where the
// host found them aligned, else guarded element loads (any strides). Torch-free: raw pointers,
// element strides, an output-kind code.
#include "bik_convert.cuh"
#include "matmul_tile.cuh"
#include "matmul_plan.cuh"

using bik_mm::i64;

namespace {

using bik_mm::cp_async_commit;
using bik_mm::cp_async_wait;
using bik_mm::issue_rows_async;
using bik_mm::kVecA;
using bik_mm::kVecBk;
using bik_mm::kVecBn;
using bik_mm::ldg8;
using bik_mm::load_rows_elem;
using bik_mm::load_rows_vec8;
using bik_mm::Vec8;

// The tiles come from bik/configs.py (CUDA_DEFINES["matmul"]) as -D macros, so the launcher's
// grid and the compiled kernel cannot disagree.
#if !defined(BIK_MM_TC_BM) || !defined(BIK_MM_TC_BN) || !defined(BIK_MM_TC_BK) || \
    !defined(BIK_MM_TC_THREADS) || !defined(BIK_MM_F32_BM) || !defined(BIK_MM_F32_BN) || \
    !defined(BIK_MM_F32_BK) || !defined(BIK_MM_F32_THREADS)
#error "matmul.cu: compile with the -D tile macros of bik.configs.cuda_options('matmul')"
#endif

// ---- bf16 / fp16: BM x BN x BK tiles, 4 warps (2 x 2), each warp (BM/2) x (BN/2) mma tiles.
constexpr int kTcBM = BIK_MM_TC_BM;
constexpr int kTcBN = BIK_MM_TC_BN;
constexpr int kTcBK = BIK_MM_TC_BK;
constexpr int kTcThreads = BIK_MM_TC_THREADS;
constexpr int kTcLds = kTcBK + 8;  // +16 bytes a smem row: fragment reads hit distinct banks
constexpr int kWarpM = kTcBM / 2;
constexpr int kWarpN = kTcBN / 2;
constexpr int kFragM = kWarpM / 16;
constexpr int kFragN = kWarpN / 8;
static_assert(kTcThreads == 128, "the tensor-core tile is 2 x 2 warps");
static_assert(kWarpM % 16 == 0 && kWarpN % 8 == 0 && kTcBK % 16 == 0,
              "a warp tile is whole m16n8k16 instructions");

// d += a(16x16, row) * b(16x8, col) with fp32 accumulation: one m16n8k16 instruction.
template <int KIND>
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4],
                                          const unsigned (&b)[2]) {
#if defined(__CUDA_ARCH__)
  if (KIND == bik_cvt::kBF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
#else  // host builds for CPU tests: tests/cuda/cuda_host/cuda_on_cpu.h emulates the warp instruction
  host_cuda_mma_m16n8k16(d, a, b, KIND == bik_cvt::kBF16);
#endif
}

__device__ __forceinline__ unsigned lds32(const unsigned short* p) {
  return *reinterpret_cast<const unsigned*>(p);
}

// Slot of element (row, k) of a padded [rows][kTcLds] tile (matmul_tile.cuh's `at`).
struct PaddedTile {
  unsigned short (*t)[kTcLds];
  __device__ __forceinline__ unsigned short* operator()(int r, int k) const { return &t[r][k]; }
};

// A tile [BM rows][BK k] into As (k contiguous), zeros outside [M) x [k0, khi).
__device__ __forceinline__ void tc_load_a(unsigned short (*as)[kTcLds], const unsigned short* a,
                                          i64 base, i64 sam, i64 sak, i64 m0, i64 m, i64 k0,
                                          i64 khi, int vec) {
  if (vec & kVecA) {
    load_rows_vec8<kTcBM, kTcBK, kTcThreads>(PaddedTile{as}, a, base, sam, m0, m, k0, khi);
  } else {  // walk the unit-stride dim across threads
    load_rows_elem<kTcBM, kTcBK, kTcThreads>(PaddedTile{as}, a, base, sam, sak, m0, m, k0, khi,
                                             sak != 1 && sam == 1);
  }
}

// B tile [BK k][BN cols] into Bs transposed (n-major, k contiguous) for the col-major operand.
__device__ __forceinline__ void tc_load_b(unsigned short (*bs)[kTcLds], const unsigned short* b,
                                          i64 base, i64 sbk, i64 sbn, i64 n0, i64 n, i64 k0,
                                          i64 khi, int vec) {
  if (vec & kVecBk) {
    load_rows_vec8<kTcBN, kTcBK, kTcThreads>(PaddedTile{bs}, b, base, sbn, n0, n, k0, khi);
    return;
  }
  if (vec & kVecBn) {  // 8 columns per load, scattered into the k-contiguous smem layout
#pragma unroll 1
    for (int i = threadIdx.x; i < kTcBN * kTcBK / 8; i += kTcThreads) {
      const int kk = i / (kTcBN / 8);
      const int c = (i % (kTcBN / 8)) * 8;
      const i64 gn = n0 + c;
      const i64 gk = k0 + kk;
      Vec8 v = {{0u, 0u, 0u, 0u}};
      if (gn < n && gk < khi) v = ldg8(b + base + gk * sbk + gn);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        bs[c + 2 * j][kk] = static_cast<unsigned short>(v.w[j] & 0xffffu);
        bs[c + 2 * j + 1][kk] = static_cast<unsigned short>(v.w[j] >> 16);
      }
    }
    return;
  }
  // B = weight.t() (k unit-stride): threads walk k; else they walk the columns.
  load_rows_elem<kTcBN, kTcBK, kTcThreads>(PaddedTile{bs}, b, base, sbn, sbk, n0, n, k0, khi,
                                           sbk != 1);
}

// Both operands k-contiguous and aligned (x @ weight.t()): one stage of A and B by cp.async.
__device__ __forceinline__ void tc_issue_async(unsigned short (*as)[kTcLds],
                                               unsigned short (*bs)[kTcLds],
                                               const unsigned short* a, i64 a_base, i64 sam,
                                               i64 m0, i64 m, const unsigned short* b,
                                               i64 b_base, i64 sbn, i64 n0, i64 n, i64 k0,
                                               i64 khi) {
  issue_rows_async<kTcBM, kTcBK, kTcThreads>(PaddedTile{as}, a, a_base, sam, m0, m, k0, khi);
  issue_rows_async<kTcBN, kTcBK, kTcThreads>(PaddedTile{bs}, b, b_base, sbn, n0, n, k0, khi);
  cp_async_commit();
}

// One BLOCK_K step of the warp's 2 x 8 mma tiles: k16 halves in order 0, 16.
template <int KIND>
__device__ __forceinline__ void tc_step(const unsigned short (*as)[kTcLds],
                                        const unsigned short (*bs)[kTcLds],
                                        float (&acc)[kFragM][kFragN][4], int wm, int wn,
                                        int lane) {
#pragma unroll
  for (int kk = 0; kk < kTcBK; kk += 16) {
    unsigned af[kFragM][4];
    unsigned bf[kFragN][2];
#pragma unroll
    for (int i = 0; i < kFragM; ++i)
#pragma unroll
      for (int reg = 0; reg < 4; ++reg) {
        int r, kc;
        bik_mm::mma_a_coord(lane, reg, &r, &kc);
        af[i][reg] = lds32(&as[wm + i * 16 + r][kk + kc]);
      }
#pragma unroll
    for (int j = 0; j < kFragN; ++j)
#pragma unroll
      for (int reg = 0; reg < 2; ++reg) {
        int kc, cn;
        bik_mm::mma_b_coord(lane, reg, &kc, &cn);
        bf[j][reg] = lds32(&bs[wn + j * 8 + cn][kk + kc]);
      }
#pragma unroll
    for (int i = 0; i < kFragM; ++i)
#pragma unroll
      for (int j = 0; j < kFragN; ++j) mma_16816<KIND>(acc[i][j], af[i], bf[j]);
  }
}

template <int KIND>
__device__ __forceinline__ void matmul_tc(const unsigned short* a, const unsigned short* b,
                                          const float* bias, void* c, float* ws, int m, int n,
                                          int k, i64 sab, i64 sam, i64 sak, i64 sbb, i64 sbk,
                                          i64 sbn, i64 scb, i64 scm, i64 scn, int split_len,
                                          int spread, int out_kind, int vec) {
  // Two stages: the cp.async path overlaps the next step's copy with this step's mma; the
  // element-load path uses stage 0 only. The order of the mma steps is the same in both.
  __shared__ __align__(16) unsigned short as[2][kTcBM][kTcLds];
  __shared__ __align__(16) unsigned short bs[2][kTcBN][kTcLds];
  const bik_mm::Program p = bik_mm::program_of(blockIdx.x, static_cast<int>(blockIdx.y), m, n, k,
                                               split_len, spread, kTcBM, kTcBN);
  const bik_mm::Tile t = p.t;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int wm = (warp / 2) * kWarpM;
  const int wn = (warp % 2) * kWarpN;
  const bool async = (vec & (kVecA | kVecBk)) == (kVecA | kVecBk);
  const i64 a_base = t.batch * sab;
  const i64 b_base = t.batch * sbb;

  float total[kFragM][kFragN][4] = {};  // fold_split ignores it at s == 0
  for (int s = p.s_first; s < p.s_end; ++s) {
    float acc[kFragM][kFragN][4];
#pragma unroll
    for (int i = 0; i < kFragM; ++i)
#pragma unroll
      for (int j = 0; j < kFragN; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;
    const i64 lo = bik_mm::split_lo(k, split_len, s);
    const i64 hi = bik_mm::split_hi(k, split_len, s);
    if (async) {
      __syncthreads();  // the previous split's last reads of both stages are done
      if (lo < hi) tc_issue_async(as[0], bs[0], a, a_base, sam, t.m0, m, b, b_base, sbn, t.n0, n,
                                  lo, hi);
      int stage = 0;
      for (i64 k0 = lo; k0 < hi; k0 += kTcBK) {
        if (k0 + kTcBK < hi) {  // prefetch the next step into the other stage
          tc_issue_async(as[stage ^ 1], bs[stage ^ 1], a, a_base, sam, t.m0, m, b, b_base, sbn,
                         t.n0, n, k0 + kTcBK, hi);
          cp_async_wait<1>();
        } else {
          cp_async_wait<0>();
        }
        __syncthreads();  // this step's stage is visible to every warp
        tc_step<KIND>(as[stage], bs[stage], acc, wm, wn, lane);
        __syncthreads();  // reads done before the next prefetch overwrites this stage
        stage ^= 1;
      }
    } else {
      for (i64 k0 = lo; k0 < hi; k0 += kTcBK) {
        __syncthreads();  // the previous step's fragment reads are done
        tc_load_a(as[0], a, a_base, sam, sak, t.m0, m, k0, hi, vec);
        tc_load_b(bs[0], b, b_base, sbk, sbn, t.n0, n, k0, hi, vec);
        __syncthreads();
        tc_step<KIND>(as[0], bs[0], acc, wm, wn, lane);
      }
    }
    // SPREAD runs one split per program: s - s_first == 0 keeps p_s itself (no 0 + p_s).
#pragma unroll
    for (int i = 0; i < kFragM; ++i)
#pragma unroll
      for (int j = 0; j < kFragN; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          total[i][j][e] = bik_mm::fold_split(total[i][j][e], acc[i][j][e], s - p.s_first);
  }
  const bik_mm::Epilogue out = {c, bias, ws, scb, scm, scn, m, n, out_kind, spread};
#pragma unroll
  for (int i = 0; i < kFragM; ++i)
#pragma unroll
    for (int j = 0; j < kFragN; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        int cr, cc;
        bik_mm::mma_c_coord(lane, e, &cr, &cc);
        out.put(p, t.m0 + wm + i * 16 + cr, t.n0 + wn + j * 8 + cc, total[i][j][e]);
      }
}

// ---- fp32 (IEEE, no TF32): BM x BN x BK tiles, 4 x 4 outputs per thread (16 x 16 threads).
// Element (m, n) of split s: acc = 0; for k ascending in the split: acc = acc + a*b (each op
// rounded). With one split this is exactly the CPU backend's sequence (csrc/cpu/contract.h).
constexpr int kFBM = BIK_MM_F32_BM;
constexpr int kFBN = BIK_MM_F32_BN;
constexpr int kFBK = BIK_MM_F32_BK;
constexpr int kFThreads = BIK_MM_F32_THREADS;
static_assert(kFBM == 64 && kFBN == 64 && kFThreads == 256,
              "the fp32 tile maps 16 x 16 threads onto 4 x 4 outputs each");

__device__ __forceinline__ void matmul_f32_body(const float* a, const float* b, const float* bias,
                                                void* c, float* ws, int m, int n, int k, i64 sab,
                                                i64 sam, i64 sak, i64 sbb, i64 sbk, i64 sbn,
                                                i64 scb, i64 scm, i64 scn, int split_len,
                                                int spread, int out_kind) {
  __shared__ float as[kFBK][kFBM + 4];
  __shared__ float bs[kFBK][kFBN + 4];
  const bik_mm::Program p = bik_mm::program_of(blockIdx.x, static_cast<int>(blockIdx.y), m, n, k,
                                               split_len, spread, kFBM, kFBN);
  const bik_mm::Tile t = p.t;
  const int tx = threadIdx.x % 16;  // columns tx + 16 j
  const int ty = threadIdx.x / 16;  // rows ty + 16 i
  const bool a_m_fast = sak != 1 && sam == 1;
  const bool b_n_fast = sbn == 1;
  const i64 a_base = t.batch * sab;
  const i64 b_base = t.batch * sbb;

  float total[4][4] = {};  // fold_split ignores it at s == 0
  for (int s = p.s_first; s < p.s_end; ++s) {
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
    const i64 lo = bik_mm::split_lo(k, split_len, s);
    const i64 hi = bik_mm::split_hi(k, split_len, s);
    for (i64 k0 = lo; k0 < hi; k0 += kFBK) {
      __syncthreads();
#pragma unroll 1
      for (int i = threadIdx.x; i < kFBM * kFBK; i += kFThreads) {
        const int r = a_m_fast ? i % kFBM : i / kFBK;
        const int kk = a_m_fast ? i / kFBM : i % kFBK;
        const i64 gm = t.m0 + r;
        const i64 gk = k0 + kk;
        as[kk][r] = (gm < m && gk < hi) ? a[a_base + gm * sam + gk * sak] : 0.0f;
      }
#pragma unroll 1
      for (int i = threadIdx.x; i < kFBN * kFBK; i += kFThreads) {
        const int cn = b_n_fast ? i % kFBN : i / kFBK;
        const int kk = b_n_fast ? i / kFBN : i % kFBK;
        const i64 gn = t.n0 + cn;
        const i64 gk = k0 + kk;
        bs[kk][cn] = (gn < n && gk < hi) ? b[b_base + gk * sbk + gn * sbn] : 0.0f;
      }
      __syncthreads();
      // Only the k that exist: no padding products, so the sequence is the contract's exactly.
      const int kmax = static_cast<int>(bik_mm::min64(kFBK, hi - k0));
      for (int kk = 0; kk < kmax; ++kk) {
        float ar[4];
        float br[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) ar[i] = as[kk][ty + 16 * i];
#pragma unroll
        for (int j = 0; j < 4; ++j) br[j] = bs[kk][tx + 16 * j];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) acc[i][j] = bik_mm::mac(acc[i][j], ar[i], br[j]);
      }
    }
    // SPREAD runs one split per program: s - s_first == 0 keeps p_s itself (no 0 + p_s).
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j)
        total[i][j] = bik_mm::fold_split(total[i][j], acc[i][j], s - p.s_first);
  }
  const bik_mm::Epilogue out = {c, bias, ws, scb, scm, scn, m, n, out_kind, spread};
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) out.put(p, t.m0 + ty + 16 * i, t.n0 + tx + 16 * j, total[i][j]);
}

}  // namespace

// Grid: x = batch * ceil(M / BM) * ceil(N / BN); y = n_splits when spread, else 1.
// Block: 128 threads (bf16/fp16) or 256 (fp32). ws: fp32 [batch, n_splits, M, N] when spread.
// out_kind: 0 fp32, 1 bf16, 2 fp16. bias: fp32 [N] or null. vec: kVec* flags (16-bit only).
extern "C" __global__ void __launch_bounds__(kTcThreads)
bik_matmul_bf16(const unsigned short* a, const unsigned short* b, const float* bias, void* c,
                float* ws, int m, int n, int k, i64 sab, i64 sam, i64 sak, i64 sbb, i64 sbk,
                i64 sbn, i64 scb, i64 scm, i64 scn, int split_len, int spread, int out_kind,
                int vec) {
  matmul_tc<bik_cvt::kBF16>(a, b, bias, c, ws, m, n, k, sab, sam, sak, sbb, sbk, sbn, scb, scm,
                            scn, split_len, spread, out_kind, vec);
}

extern "C" __global__ void __launch_bounds__(kTcThreads)
bik_matmul_f16(const unsigned short* a, const unsigned short* b, const float* bias, void* c,
               float* ws, int m, int n, int k, i64 sab, i64 sam, i64 sak, i64 sbb, i64 sbk,
               i64 sbn, i64 scb, i64 scm, i64 scn, int split_len, int spread, int out_kind,
               int vec) {
  matmul_tc<bik_cvt::kF16>(a, b, bias, c, ws, m, n, k, sab, sam, sak, sbb, sbk, sbn, scb, scm,
                           scn, split_len, spread, out_kind, vec);
}

extern "C" __global__ void __launch_bounds__(kFThreads, 1)
bik_matmul_f32(const float* a, const float* b, const float* bias, void* c, float* ws, int m,
               int n, int k, i64 sab, i64 sam, i64 sak, i64 sbb, i64 sbk, i64 sbn, i64 scb,
               i64 scm, i64 scn, int split_len, int spread, int out_kind, int vec) {
  (void)vec;  // element loads only (the fp32 path is the slow exact path anyway)
  matmul_f32_body(a, b, bias, c, ws, m, n, k, sab, sam, sak, sbb, sbk, sbn, scb, scm, scn,
                  split_len, spread, out_kind);
}

// SPREAD mode's second kernel: one thread per output element folds its n_splits partials in
// ascending order with the same fold_split / add_bias as the FOLD path, then rounds once.
extern "C" __global__ void __launch_bounds__(256)
bik_matmul_reduce(const float* ws, const float* bias, void* c, int batch, int m, int n,
                  int n_splits, i64 scb, i64 scm, i64 scn, int out_kind) {
  const bik_mm::Epilogue out = {c, bias, nullptr, scb, scm, scn, m, n, out_kind, 0};
  const i64 count = static_cast<i64>(batch) * m * n;
  for (i64 idx = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x; idx < count;
       idx += static_cast<i64>(gridDim.x) * blockDim.x) {
    const i64 col = idx % n;
    const i64 row = (idx / n) % m;
    const i64 bt = idx / (static_cast<i64>(m) * n);
    float total = 0.0f;
    for (int s = 0; s < n_splits; ++s)
      total = bik_mm::fold_split(total, ws[bik_mm::partial_index(bt, s, n_splits, m, row, n, col)],
                                 s);
    out.store(bt, row, col, total);
  }
}
