// bik CUDA matmul, sm_90a path (opt-in): the shared-memory tile layout, the wgmma matrix
// descriptor and the accumulator fragment map, as __host__ __device__ helpers so that CPU tests
// compile this header with g++ and check them (tests/cuda/cuda_host/sm90_shim.cpp). The K-split
// plan, the fold and the epilogue are matmul_plan.cuh's, unchanged.
//
// One CTA = one warpgroup (128 threads) computes a 64 x 128 output tile with
// wgmma.mma_async.m64n128k16 (fp32 accumulate), A and B both read from shared memory through
// 64-bit matrix descriptors, both K-major (imm-trans-a = imm-trans-b = 0), no swizzle.
//
// Shared-memory layout (PTX ISA "Shared Memory Matrix Layout", no-swizzle mode): a tile of R rows
// (M rows of A, N columns of B) by BK = 32 k is cut into core matrices of 8 rows x 16 bytes (8
// sixteen-bit k). A core matrix is 128 contiguous bytes, its rows 16 bytes apart. Core matrices
// adjacent in the row (M/N) dimension are SBO = 128 bytes apart; adjacent in K, LBO = R * 16
// bytes apart. So the tile is [k / 8][r / 8][r % 8][k % 8]: BK / 8 "k-slabs" of R x 8 elements.
// One k16 instruction reads two slabs; the next k16 step starts 2 * LBO bytes later.
// A 16-byte chunk (one row, 8 consecutive k starting at a multiple of 8) is 16 contiguous bytes.
#pragma once

#include "matmul_plan.cuh"  // BIK_HD, bik_mm::i64

namespace bik_mm90 {

typedef unsigned long long u64;

constexpr int kBM = 64;    // wgmma's M
constexpr int kBN = 128;   // wgmma's N (one m64n128k16 instruction per k16)
constexpr int kBK = 32;    // k per pipeline step: two k16 instructions, in ascending k
constexpr int kK16 = 16;
constexpr int kThreads = 128;  // one warpgroup
constexpr int kCoreRows = 8;
constexpr int kCoreBytes = 16;  // one core-matrix row: 8 sixteen-bit elements

// Byte offsets of the no-swizzle K-major layout of a tile with `rows` rows.
BIK_HD int sbo_bytes() { return kCoreRows * kCoreBytes; }          // next 8 rows
BIK_HD int lbo_bytes(int rows) { return rows * kCoreBytes; }       // next 8 k

// Byte offset of element (r, k) of a rows x kBK tile (r < rows, k < kBK).
BIK_HD int tile_offset(int rows, int r, int k) {
  return (k / 8) * lbo_bytes(rows) + (r / kCoreRows) * sbo_bytes() + (r % kCoreRows) * kCoreBytes +
         (k % 8) * 2;
}

BIK_HD int tile_bytes(int rows) { return rows * kBK * 2; }

// ---- the 64-bit matrix descriptor (PTX ISA "Matrix Descriptor Format" for wgmma):
//   bits  0-13  start address >> 4 (shared window)
//   bits 16-29  leading-dimension byte offset >> 4
//   bits 32-45  stride-dimension byte offset >> 4
//   bits 49-51  matrix base offset (0: no swizzle / aligned pattern)
//   bits 62-63  swizzle mode: 0 none, 1 128B, 2 64B, 3 32B
// All three byte quantities must be multiples of 16 below 2^18.
constexpr int kSwizzleNone = 0;

struct Desc {
  unsigned start;  // bytes
  unsigned lbo;    // bytes
  unsigned sbo;    // bytes
  unsigned base_offset;
  unsigned swizzle;
};

BIK_HD u64 encode_desc(unsigned start, unsigned lbo, unsigned sbo, unsigned swizzle) {
  return static_cast<u64>((start & 0x3FFFFu) >> 4) |
         (static_cast<u64>((lbo & 0x3FFFFu) >> 4) << 16) |
         (static_cast<u64>((sbo & 0x3FFFFu) >> 4) << 32) |
         (static_cast<u64>(swizzle & 3u) << 62);
}

BIK_HD Desc decode_desc(u64 d) {
  Desc r;
  r.start = static_cast<unsigned>(d & 0x3FFFu) << 4;
  r.lbo = static_cast<unsigned>((d >> 16) & 0x3FFFu) << 4;
  r.sbo = static_cast<unsigned>((d >> 32) & 0x3FFFu) << 4;
  r.base_offset = static_cast<unsigned>((d >> 49) & 7u);
  r.swizzle = static_cast<unsigned>(d >> 62);
  return r;
}

// Descriptor of the k16 step `kstep` (0 or 1) of a rows x kBK tile starting at shared address
// `tile_start` (16-byte aligned).
BIK_HD u64 tile_desc(unsigned tile_start, int rows, int kstep) {
  return encode_desc(tile_start + static_cast<unsigned>(kstep * 2 * lbo_bytes(rows)),
                     static_cast<unsigned>(lbo_bytes(rows)), static_cast<unsigned>(sbo_bytes()),
                     kSwizzleNone);
}

// Where element (r, k) of a K-major no-swizzle operand lies, read from a descriptor (what the
// hardware does with it): k < 16 within one instruction.
BIK_HD unsigned desc_element_address(u64 d, int r, int k) {
  const Desc x = decode_desc(d);
  return x.start + static_cast<unsigned>(r / kCoreRows) * x.sbo +
         static_cast<unsigned>(k / 8) * x.lbo + static_cast<unsigned>(r % kCoreRows) * kCoreBytes +
         static_cast<unsigned>(k % 8) * 2;
}

// ---- accumulator fragment of wgmma .m64nNk16 with fp32 D (PTX ISA "Matrix Fragments for
// wgmma.mma_async.m64nNk16", D): thread t of the warpgroup (warp w = t / 32, lane l) holds
// N / 2 floats; float i is D(16 w + l / 4 + 8 ((i / 2) % 2), 8 (i / 4) + 2 (l % 4) + i % 2).
constexpr int kAccRegs = kBN / 2;  // 64

BIK_HD void acc_coord(int thread, int i, int* row, int* col) {
  const int warp = thread / 32, lane = thread % 32;
  *row = 16 * warp + lane / 4 + 8 * ((i / 2) % 2);
  *col = 8 * (i / 4) + 2 * (lane % 4) + i % 2;
}

// The k sequence an output element meets inside a split [lo, hi): BK steps from lo ascending,
// each two k16 instructions in ascending k; positions past hi hold zeros. Step j of the
// sequence covers k in [lo + 16 j, lo + 16 j + 16). A function of (lo, hi) only: never of the
// element's row, the tile's place, or M.
BIK_HD bik_mm::i64 k16_steps(bik_mm::i64 lo, bik_mm::i64 hi) {
  return hi > lo ? bik_mm::cdiv(hi - lo, kBK) * (kBK / kK16) : 0;
}

}  // namespace bik_mm90
