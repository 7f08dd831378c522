// Device code the matmul kernels share (matmul.cu, matmul_sm90.cu): the epilogue, and the
// global -> shared loads of the 16-bit kernels (the mma.sync and the wgmma tile). Loads decide
// speed, never bits: every path moves the same values
// (zeros outside the operand and past the split end) into the same shared-memory slots. The
// tile's layout is the caller's: `at(r, k)` is the slot of element (row r, k) of the tile, where
// a "row" is an M row of A or an N column of B (both tiles are k-contiguous rows).
#pragma once

#include "bik_convert.cuh"
#include "matmul_plan.cuh"

namespace bik_mm {

// 16-byte global loads (8 halves) where the host found the operand aligned for them
// (cuda_matmul.load_flags).
struct alignas(16) Vec8 {
  unsigned w[4];
};
constexpr int kVecA = 1;   // A: k unit-stride, rows and base 16-byte aligned, K % 8 == 0
constexpr int kVecBk = 2;  // B: k unit-stride (weight.t()), columns aligned, K % 8 == 0
constexpr int kVecBn = 4;  // B: n unit-stride (row-major [K, N]), rows aligned, N % 8 == 0

__device__ __forceinline__ Vec8 ldg8(const unsigned short* p) {
  return *reinterpret_cast<const Vec8*>(p);
}

// ---- cp.async (sm_80+): 16-byte global -> shared copies; src-size 0 writes zeros.
#if defined(__CUDA_ARCH__)
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool pred) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem),
               "r"(pred ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
#else  // host builds for CPU tests: a synchronous copy (or zero fill), as the async one ends
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool pred) {
  if (pred) __builtin_memcpy(smem, gmem, 16); else __builtin_memset(smem, 0, 16);
}
__device__ __forceinline__ void cp_async_commit() {}
template <int N>
__device__ __forceinline__ void cp_async_wait() {}
#endif

// Rows [r0, r0 + ROWS) x k [k0, k0 + BK) of an operand with k unit-stride, row stride s_row,
// 16-byte aligned and K % 8 == 0, by 16-byte chunks; zeros outside [0, r_lim) x [k0, khi).
// khi is K or a multiple of BK, so a chunk is all in or all out.
template <int ROWS, int BK, int THREADS, class At>
__device__ __forceinline__ void load_rows_vec8(At at, const unsigned short* src, i64 base,
                                               i64 s_row, i64 r0, i64 r_lim, i64 k0, i64 khi) {
#pragma unroll 1
  for (int i = threadIdx.x; i < ROWS * BK / 8; i += THREADS) {
    const int r = i / (BK / 8);
    const int c = (i % (BK / 8)) * 8;
    Vec8 v = {{0u, 0u, 0u, 0u}};
    if (r0 + r < r_lim && k0 + c < khi) v = ldg8(src + base + (r0 + r) * s_row + k0 + c);
    *reinterpret_cast<Vec8*>(at(r, c)) = v;
  }
}

// The same tile by guarded element loads (any strides). r_fast: consecutive threads walk the
// rows (the unit-stride dim when k is not).
template <int ROWS, int BK, int THREADS, class At>
__device__ __forceinline__ void load_rows_elem(At at, const unsigned short* src, i64 base,
                                               i64 s_row, i64 s_k, i64 r0, i64 r_lim, i64 k0,
                                               i64 khi, bool r_fast) {
#pragma unroll 1
  for (int i = threadIdx.x; i < ROWS * BK; i += THREADS) {
    const int r = r_fast ? i % ROWS : i / BK;
    const int c = r_fast ? i / ROWS : i % BK;
    const bool ok = r0 + r < r_lim && k0 + c < khi;
    *at(r, c) = ok ? src[base + (r0 + r) * s_row + (k0 + c) * s_k] : static_cast<unsigned short>(0);
  }
}

// The vec8 tile by cp.async (no commit: the caller commits both operands as one group).
template <int ROWS, int BK, int THREADS, class At>
__device__ __forceinline__ void issue_rows_async(At at, const unsigned short* src, i64 base,
                                                 i64 s_row, i64 r0, i64 r_lim, i64 k0,
                                                 i64 khi) {
#pragma unroll
  for (int i = threadIdx.x; i < ROWS * BK / 8; i += THREADS) {
    const int r = i / (BK / 8);
    const int c = (i % (BK / 8)) * 8;
    const bool ok = r0 + r < r_lim && k0 + c < khi;
    cp_async16(at(r, c), ok ? src + base + (r0 + r) * s_row + k0 + c : src, ok);
  }
}

// ---- the epilogue (every matmul kernel): where a program's result for output (row, col) goes.
struct Epilogue {
  void* c;
  const float* bias;
  float* ws;
  i64 scb, scm, scn;  // C's element strides
  int m, n, out_kind, spread;

  // C[batch, row, col] = total + bias[col] in fp32, rounded once to the output dtype.
  __device__ __forceinline__ void store(i64 batch, i64 row, i64 col, float total) const {
    bik_cvt::store_as(c, batch * scb + row * scm + col * scn, add_bias(total, bias, col),
                      out_kind);
  }

  // Program p's sum for (row, col) of its tile: SPREAD writes its split's fp32 partial to the
  // workspace (bik_matmul_reduce folds them), FOLD stores the output. Rows past M and columns
  // past N are never stored.
  __device__ __forceinline__ void put(const Program& p, i64 row, i64 col, float total) const {
    if (row >= m || col >= n) return;
    if (spread)
      ws[partial_index(p.t.batch, p.s_first, p.n_splits, m, row, n, col)] = total;
    else
      store(p.t.batch, row, col, total);
  }
};

}  // namespace bik_mm
