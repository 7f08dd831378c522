// bik CUDA matmul: the index math and the per-element arithmetic that decide the bits, as
// __host__ __device__ helpers so CPU tests compile this header with g++ and check them
// (tests/cuda_host/plan_shim.cpp). No CUDA or C++ standard headers: NVRTC has none.
//
// Contract for output element (m, n) of C[M, N] = A[M, K] @ B[K, N] (+ bias[N]):
//   S = split_len(dtype, N, K, arch) from the config table, a multiple of BLOCK_K, never M.
//   [0, K) is cut into n_splits = max(1, ceil(K / S)) splits [s*S, min((s+1)*S, K)).
//   Split s is summed from zero in its own fp32 accumulator, in BLOCK_K steps ascending
//   (inside a step: the tensor-core instruction for 16-bit inputs; acc = acc + a*b, k ascending,
//   each op rounded, for fp32 inputs).
//   total = p_0;  total = total + p_s for s = 1, 2, ... (ascending);  then total + bias[n]
//   (fp32); then one rounding to the output dtype.
// Two launch modes compute exactly that: SPREAD (grid axis 1 = split; fp32 partials to a
// workspace; a reduce kernel folds them) and FOLD (one program computes the splits one after
// another, each into a fresh accumulator, folding as it goes). The mode follows the amount of
// work (M), the bits do not.
#pragma once

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define BIK_HD __host__ __device__ __forceinline__
#else
#define BIK_HD inline
#endif

namespace bik_mm {

typedef long long i64;

BIK_HD i64 cdiv(i64 a, i64 b) { return (a + b - 1) / b; }
BIK_HD i64 min64(i64 a, i64 b) { return a < b ? a : b; }

// Number of K splits: a function of K and the split length (itself a function of K) only.
BIK_HD int num_splits(i64 k, i64 split_len) {
  return k <= 0 ? 1 : static_cast<int>(cdiv(k, split_len));
}

// Split s covers [split_lo, split_hi). Both are clamped to K, so K == 0 has one empty split.
BIK_HD i64 split_lo(i64 k, i64 split_len, int s) { return min64(s * split_len, k); }
BIK_HD i64 split_hi(i64 k, i64 split_len, int s) { return min64((s + 1) * split_len, k); }

// Program -> output tile of the flat grid axis 0: batch-major, then M tiles, N tiles fastest
// (consecutive programs share an A row block). Pure indexing: it cannot change a sum.
struct Tile {
  i64 batch;
  i64 m0;
  i64 n0;
};

BIK_HD Tile tile_of(i64 pid, i64 tiles_m, i64 tiles_n, int block_m, int block_n) {
  const i64 per_batch = tiles_m * tiles_n;
  Tile t;
  t.batch = pid / per_batch;
  const i64 r = pid % per_batch;
  t.m0 = (r / tiles_n) * block_m;
  t.n0 = (r % tiles_n) * block_n;
  return t;
}

// Workspace of SPREAD mode: fp32 [batch, n_splits, M, N], contiguous.
BIK_HD i64 partial_index(i64 batch, int s, int n_splits, i64 m, i64 row, i64 n, i64 col) {
  return ((batch * n_splits + s) * m + row) * n + col;
}

// One step of the fp32 inner product: the multiply and the add each rounded (no FMA).
BIK_HD float mac(float acc, float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(acc, __fmul_rn(a, b));
#else
  return acc + a * b;  // the host build uses -ffp-contract=off
#endif
}

// The fold over splits: s == 0 starts the total with p_0 itself (no 0 + p_0, which would turn
// a -0.0 into +0.0); later splits are added in ascending s. Both launch modes call this.
BIK_HD float fold_split(float total, float partial, int s) {
#if defined(__CUDA_ARCH__)
  return s == 0 ? partial : __fadd_rn(total, partial);
#else
  return s == 0 ? partial : total + partial;
#endif
}

// The epilogue before the single rounding to the output dtype.
BIK_HD float add_bias(float total, const float* bias, i64 col) {
#if defined(__CUDA_ARCH__)
  return bias ? __fadd_rn(total, bias[col]) : total;
#else
  return bias ? total + bias[col] : total;
#endif
}

// ---- mma.sync.m16n8k16 fragments (PTX ISA "Matrix Fragments for mma.m16n8k16"): which
// element of the 16x16 A tile, 16x8 B tile and 16x8 C tile a lane's register holds. A and B
// registers hold two 16-bit elements, the lower-addressed one (returned here) in the low half
// and the next k in the high half. The kernel reads shared memory and writes C through these.
BIK_HD void mma_a_coord(int lane, int reg, int* row, int* k) {  // reg 0..3
  *row = (lane >> 2) + 8 * (reg & 1);
  *k = 2 * (lane & 3) + 8 * (reg >> 1);
}
BIK_HD void mma_b_coord(int lane, int reg, int* k, int* col) {  // reg 0..1
  *k = 2 * (lane & 3) + 8 * reg;
  *col = lane >> 2;
}
BIK_HD void mma_c_coord(int lane, int e, int* row, int* col) {  // e 0..3
  *row = (lane >> 2) + 8 * (e >> 1);
  *col = 2 * (lane & 3) + (e & 1);
}

}  // namespace bik_mm
