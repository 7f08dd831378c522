// bik CUDA matmul, sm_90a path (opt-in; docs/design.md "sm_90a matmul (opt-in)"): the same
// contract as matmul.cu's 16-bit kernel (matmul_plan.cuh: K splits from K alone, each from a
// zero accumulator, folded in ascending order, bias in fp32, one rounding), with Hopper's
// warpgroup MMA: one warpgroup per CTA, a 64 x 128 output tile, wgmma.mma_async.m64n128k16
// (fp32 accumulate) with A and B in shared memory (layout and descriptors in
// matmul_sm90_plan.cuh). Within a split every output element meets the k16 steps in ascending
// k, whatever M: the tile never follows M. Its bits need not equal the mma.sync kernel's (a
// different instruction may round its internal sums differently); the fingerprint records
// which kernel ran.
//
// Loads decide speed, never bits: a two-stage cp.async pipeline when both operands are
// k-contiguous and 16-byte aligned (x @ weight.t()), else 16-byte register loads where aligned,
// else guarded element loads. No TMA (it needs a driver-made tensor map; see the design notes).
//
// Only sm_90a has wgmma: other device builds (the sm_80 CI build of every .cu) compile these
// kernels to a trap. The SPREAD mode's partials are folded by matmul.cu's bik_matmul_reduce.
#include "bik_convert.cuh"
#include "matmul_tile.cuh"
#include "matmul_sm90_plan.cuh"

using bik_mm::i64;

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define BIK_SM90_WGMMA 1
#elif defined(__CUDA_ARCH__)
#define BIK_SM90_TRAP 1
#endif

#if !defined(BIK_SM90_TRAP)  // sm_80 builds hold only the trapping entry points
namespace bik_sm90 {  // named: the host tests compile this file next to matmul.cu

using bik_mm::i64;
using bik_mm90::kBK;
using bik_mm90::kBM;
using bik_mm90::kBN;
using bik_mm90::kThreads;
typedef unsigned long long u64;

struct Smem {  // two stages of the K-major no-swizzle tiles (matmul_sm90_plan.cuh)
  unsigned short a[2][kBM * kBK];
  unsigned short b[2][kBN * kBK];
};

// Shared-window address of p (what a descriptor holds). The host build has no shared window:
// there the address is p's byte offset in the CTA's Smem, and the emulated wgmma is given its
// base (tests/cuda/cuda_host/cuda_on_cpu.h).
__device__ __forceinline__ unsigned smem_addr(const void* p, const Smem* base) {
#if defined(__CUDA_ARCH__)
  (void)base;
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
#else
  return static_cast<unsigned>(static_cast<const char*>(p) -
                               reinterpret_cast<const char*>(base));
#endif
}

#define BIK_WG_D8(i)                                                                   \
  "+f"(d[i + 0]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]),     \
      "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define BIK_WG_REGS                                                                       \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23," \
  "%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,"   \
  "%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}"
// d (+)= A(64x16, K-major, desc a) * B(16x128, K-major, desc b): scale-d = 1 (accumulate; the
// split's accumulator starts at zero), no negation, no transpose.
#define BIK_WG_ASM(T)                                                             \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                    \
  "wgmma.mma_async.sync.aligned.m64n128k16.f32." T "." T " " BIK_WG_REGS        \
  ", %64, %65, p, 1, 1, 0, 0;\n}\n"

template <int KIND>
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], u64 da, u64 db,
                                                 const Smem* base) {
#if defined(BIK_SM90_WGMMA)
  (void)base;
  if (KIND == bik_cvt::kBF16) {
    asm volatile(BIK_WG_ASM("bf16")
                 : BIK_WG_D8(0), BIK_WG_D8(8), BIK_WG_D8(16), BIK_WG_D8(24), BIK_WG_D8(32),
                   BIK_WG_D8(40), BIK_WG_D8(48), BIK_WG_D8(56)
                 : "l"(da), "l"(db), "n"(1));
  } else {
    asm volatile(BIK_WG_ASM("f16")
                 : BIK_WG_D8(0), BIK_WG_D8(8), BIK_WG_D8(16), BIK_WG_D8(24), BIK_WG_D8(32),
                   BIK_WG_D8(40), BIK_WG_D8(48), BIK_WG_D8(56)
                 : "l"(da), "l"(db), "n"(1));
  }
#elif defined(BIK_SM90_TRAP)
  (void)d, (void)da, (void)db, (void)base;
  __trap();
#else  // host builds for CPU tests: emulated from the descriptors and the fragment layout
  host_cuda_wgmma_m64n128k16(d, da, db, base, KIND == bik_cvt::kBF16);
#endif
}
#undef BIK_WG_ASM
#undef BIK_WG_REGS
#undef BIK_WG_D8

// Ordering around the asynchronous MMA. fence.proxy.async: this thread's generic-proxy writes
// to shared memory (st.shared, cp.async) become visible to the async proxy wgmma reads through
// (a __syncthreads follows). wgmma.fence: prior register and shared-memory accesses are ordered
// before the next wgmma. Then commit + wait 0: the accumulators are final when it returns.
__device__ __forceinline__ void fence_proxy_async() {
#if defined(BIK_SM90_WGMMA)
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_fence() {
#if defined(BIK_SM90_WGMMA)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit_wait() {
#if defined(BIK_SM90_WGMMA)
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#endif
}
// Pin the accumulators in place across the asm above (no move of a read or write across it).
__device__ __forceinline__ void fence_operands(float (&d)[64]) {
#if defined(BIK_SM90_WGMMA)
#pragma unroll
  for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
#else
  (void)d;
#endif
}

// ---- loads (matmul_tile.cuh, matmul.cu's): global -> the K-major no-swizzle tile
using bik_mm::cp_async_commit;
using bik_mm::cp_async_wait;
using bik_mm::kVecA;
using bik_mm::kVecBk;

// Slot of element (r, k) of a ROWS x kBK no-swizzle tile (matmul_tile.cuh's `at`).
template <int ROWS>
struct CoreTile {
  unsigned short* t;
  __device__ __forceinline__ unsigned short* operator()(int r, int k) const {
    return t + bik_mm90::tile_offset(ROWS, r, k) / 2;
  }
};

// Rows [r0, r0 + ROWS) x k [k0, k0 + kBK) of an operand with element strides (s_row, s_k),
// zeros outside [0, r_lim) x [k0, khi). vec16: k unit-stride, 16-byte aligned, K % 8 == 0.
template <int ROWS>
__device__ __forceinline__ void load_tile(unsigned short* tile, const unsigned short* src,
                                          i64 base, i64 s_row, i64 s_k, i64 r0, i64 r_lim,
                                          i64 k0, i64 khi, bool vec16) {
  if (vec16) {
    bik_mm::load_rows_vec8<ROWS, kBK, kThreads>(CoreTile<ROWS>{tile}, src, base, s_row, r0,
                                                r_lim, k0, khi);
  } else {  // walk the unit-stride dim across threads
    bik_mm::load_rows_elem<ROWS, kBK, kThreads>(CoreTile<ROWS>{tile}, src, base, s_row, s_k, r0,
                                                r_lim, k0, khi, s_k != 1 && s_row == 1);
  }
}

// One stage of one operand by cp.async (both k-contiguous and aligned).
template <int ROWS>
__device__ __forceinline__ void issue_tile(unsigned short* tile, const unsigned short* src,
                                           i64 base, i64 s_row, i64 r0, i64 r_lim, i64 k0,
                                           i64 khi) {
  bik_mm::issue_rows_async<ROWS, kBK, kThreads>(CoreTile<ROWS>{tile}, src, base, s_row, r0,
                                                r_lim, k0, khi);
}

// One BLOCK_K step: two k16 instructions on the same accumulators, k ascending.
template <int KIND>
__device__ __forceinline__ void mma_step(const Smem* sm, int stage, float (&acc)[64]) {
  const unsigned a0 = smem_addr(sm->a[stage], sm);
  const unsigned b0 = smem_addr(sm->b[stage], sm);
  fence_operands(acc);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kBK / bik_mm90::kK16; ++kk)
    wgmma_m64n128k16<KIND>(acc, bik_mm90::tile_desc(a0, kBM, kk),
                           bik_mm90::tile_desc(b0, kBN, kk), sm);
  wgmma_commit_wait();
  fence_operands(acc);
}

template <int KIND>
__device__ __forceinline__ void matmul_wgmma(const unsigned short* a, const unsigned short* b,
                                             const float* bias, void* c, float* ws, int m,
                                             int n, int k, i64 sab, i64 sam, i64 sak, i64 sbb,
                                             i64 sbk, i64 sbn, i64 scb, i64 scm, i64 scn,
                                             int split_len, int spread, int out_kind, int vec) {
  __shared__ __align__(128) Smem sm;
  const bik_mm::Program p = bik_mm::program_of(blockIdx.x, static_cast<int>(blockIdx.y), m, n, k,
                                               split_len, spread, kBM, kBN);
  const bik_mm::Tile t = p.t;
  const bool async = (vec & (kVecA | kVecBk)) == (kVecA | kVecBk);
  const i64 a_base = t.batch * sab;
  const i64 b_base = t.batch * sbb;
  const int tid = static_cast<int>(threadIdx.x);

  float total[64] = {};  // fold_split ignores it at s == 0
  for (int s = p.s_first; s < p.s_end; ++s) {
    float acc[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
    const i64 lo = bik_mm::split_lo(k, split_len, s);
    const i64 hi = bik_mm::split_hi(k, split_len, s);
    if (async) {
      __syncthreads();  // the previous split's last reads of both stages are done
      if (lo < hi) {
        issue_tile<kBM>(sm.a[0], a, a_base, sam, t.m0, m, lo, hi);
        issue_tile<kBN>(sm.b[0], b, b_base, sbn, t.n0, n, lo, hi);
        cp_async_commit();
      }
      int stage = 0;
      for (i64 k0 = lo; k0 < hi; k0 += kBK) {
        if (k0 + kBK < hi) {  // prefetch the next step into the other stage
          issue_tile<kBM>(sm.a[stage ^ 1], a, a_base, sam, t.m0, m, k0 + kBK, hi);
          issue_tile<kBN>(sm.b[stage ^ 1], b, b_base, sbn, t.n0, n, k0 + kBK, hi);
          cp_async_commit();
          cp_async_wait<1>();
        } else {
          cp_async_wait<0>();
        }
        fence_proxy_async();
        __syncthreads();  // this step's stage is visible to the whole warpgroup
        mma_step<KIND>(&sm, stage, acc);
        __syncthreads();  // reads done before the next prefetch overwrites this stage
        stage ^= 1;
      }
    } else {
      for (i64 k0 = lo; k0 < hi; k0 += kBK) {
        __syncthreads();  // the previous step's wgmma reads are done (it waited)
        load_tile<kBM>(sm.a[0], a, a_base, sam, sak, t.m0, m, k0, hi, (vec & kVecA) != 0);
        load_tile<kBN>(sm.b[0], b, b_base, sbn, sbk, t.n0, n, k0, hi, (vec & kVecBk) != 0);
        fence_proxy_async();
        __syncthreads();
        mma_step<KIND>(&sm, 0, acc);
      }
    }
    // SPREAD runs one split per program: s - s_first == 0 keeps p_s itself (no 0 + p_s).
#pragma unroll
    for (int i = 0; i < 64; ++i) total[i] = bik_mm::fold_split(total[i], acc[i], s - p.s_first);
  }
  const bik_mm::Epilogue out = {c, bias, ws, scb, scm, scn, m, n, out_kind, spread};
#pragma unroll
  for (int i = 0; i < 64; ++i) {
    int cr, cc;
    bik_mm90::acc_coord(tid, i, &cr, &cc);
    out.put(p, t.m0 + cr, t.n0 + cc, total[i]);
  }
}

}  // namespace bik_sm90
#endif  // !BIK_SM90_TRAP

// Grid: x = batch * ceil(M / 64) * ceil(N / 128); y = n_splits when spread, else 1. Block: 128
// threads (one warpgroup). The arguments are matmul.cu's bik_matmul_bf16's, in the same order.
#if defined(BIK_SM90_TRAP)
#define BIK_SM90_BODY(KIND) __trap()
#else
#define BIK_SM90_BODY(KIND)                                                                 \
  bik_sm90::matmul_wgmma<KIND>(a, b, bias, c, ws, m, n, k, sab, sam, sak, sbb, sbk, sbn, scb, \
                               scm, scn, split_len, spread, out_kind, vec)
#endif

extern "C" __global__ void __launch_bounds__(bik_mm90::kThreads)
bik_matmul_sm90_bf16(const unsigned short* a, const unsigned short* b, const float* bias, void* c,
                     float* ws, int m, int n, int k, i64 sab, i64 sam, i64 sak, i64 sbb, i64 sbk,
                     i64 sbn, i64 scb, i64 scm, i64 scn, int split_len, int spread, int out_kind,
                     int vec) {
  BIK_SM90_BODY(bik_cvt::kBF16);
}

extern "C" __global__ void __launch_bounds__(bik_mm90::kThreads)
bik_matmul_sm90_f16(const unsigned short* a, const unsigned short* b, const float* bias, void* c,
                    float* ws, int m, int n, int k, i64 sab, i64 sam, i64 sak, i64 sbb, i64 sbk,
                    i64 sbn, i64 scb, i64 scm, i64 scn, int split_len, int spread, int out_kind,
                    int vec) {
  BIK_SM90_BODY(bik_cvt::kF16);
}
#undef BIK_SM90_BODY
