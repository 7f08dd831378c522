// bik CUDA matmul: the index math and the per-element arithmetic that decide the bits, as
// __host__ __device__ helpers so CPU tests compile this header with g++ and check them
// (tests/cuda/cuda_host/plan_shim.cpp). No CUDA or C++ standard headers on the device: NVRTC has
// none. The rounded float ops are common.cuh's (its numerics policy: no FMA on either side).
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

#include "common.cuh"  // BIK_HD, i64, cdiv, min64, add_rn / mul_rn

namespace bik_mm {

using bik::add_rn;
using bik::cdiv;
using bik::i64;
using bik::min64;
using bik::mul_rn;

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

// What program (pid, pid_split) of a launch computes: its output tile, and the splits
// [s_first, s_end) it sums in ascending order -- SPREAD: the one split of grid axis 1; FOLD:
// all of them. Pure indexing, like tile_of.
struct Program {
  Tile t;
  int n_splits;
  int s_first;
  int s_end;
};

BIK_HD Program program_of(i64 pid, int pid_split, i64 m, i64 n, i64 k, i64 split_len, int spread,
                          int block_m, int block_n) {
  Program p;
  p.t = tile_of(pid, cdiv(m, block_m), cdiv(n, block_n), block_m, block_n);
  p.n_splits = num_splits(k, split_len);
  p.s_first = spread ? pid_split : 0;
  p.s_end = spread ? p.s_first + 1 : p.n_splits;
  return p;
}

// Workspace of SPREAD mode: fp32 [batch, n_splits, M, N], contiguous.
BIK_HD i64 partial_index(i64 batch, int s, int n_splits, i64 m, i64 row, i64 n, i64 col) {
  return ((batch * n_splits + s) * m + row) * n + col;
}

// One step of the fp32 inner product: the multiply and the add each rounded (no FMA).
BIK_HD float mac(float acc, float a, float b) { return add_rn(acc, mul_rn(a, b)); }

// The fold over splits: s == 0 starts the total with p_0 itself (no 0 + p_0, which would turn
// a -0.0 into +0.0); later splits are added in ascending s. Both launch modes call this.
BIK_HD float fold_split(float total, float partial, int s) {
  return s == 0 ? partial : add_rn(total, partial);
}

// The epilogue before the single rounding to the output dtype.
BIK_HD float add_bias(float total, const float* bias, i64 col) {
  return bias ? add_rn(total, bias[col]) : total;
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
