// bik CUDA kernels: shared types, the no-FMA float policy, dtype conversions and fixed-order
// reductions. Header-only; compiles with NVRTC, nvcc (device and host) and a plain C++17 host
// compiler (g++/clang++), so tests on machines without a GPU run the __host__ __device__ helpers
// (BIK_HD) on the CPU and compare their bits with bik's CPU kernels.
//
// Numerics policy (docs/design.md#cuda-c-backend):
//  * every multiply and add whose rounding matters goes through mul_rn / add_rn (__fmul_rn /
//    __fadd_rn on the device: never contracted into an FMA, whatever the flags); the build adds
//    --fmad=false as well. div_rn / sqrt_rn are correctly rounded (IEEE).
//  * reductions whose order decides bits are written out in a fixed order (a fixed shuffle tree,
//    then a fixed shared-memory tree); no atomics, no order that depends on scheduling.
//  * no NVRTC host headers: the types below are the compiler's own.
#pragma once

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define BIK_HD __host__ __device__ __forceinline__
#define BIK_DEVICE __device__ __forceinline__
#else
#include <cstring>
#define BIK_HD inline
#endif

namespace bik {

typedef unsigned short u16;
typedef int i32;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

BIK_HD i64 cdiv(i64 a, i64 b) { return (a + b - 1) / b; }
BIK_HD i64 min64(i64 a, i64 b) { return a < b ? a : b; }

// ---- bit casts and correctly rounded fp32 arithmetic ----------------------------------------

BIK_HD u32 bits_of(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  u32 b;
  std::memcpy(&b, &f, 4);
  return b;
#endif
}

BIK_HD float f32_from_bits(u32 b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  float f;
  std::memcpy(&f, &b, 4);
  return f;
#endif
}

// On the host these are plain IEEE ops: build host code without contraction (-ffp-contract=off,
// which is also GCC's default in ISO C++ mode).
BIK_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

BIK_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

BIK_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

BIK_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

BIK_HD float sqrt_rn(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return __builtin_sqrtf(a);
#endif
}

BIK_HD float inf_f32() { return f32_from_bits(0x7F800000u); }

BIK_HD bool is_nan(float f) { return (bits_of(f) & 0x7FFFFFFFu) > 0x7F800000u; }

// ---- storage dtypes <-> fp32 (torch's CPU rounding, bit for bit, NaN included) ---------------
// Storage types are raw bits (u16), so no cuda_fp16.h / cuda_bf16.h is needed.

BIK_HD float bf16_to_f32(u16 h) { return f32_from_bits(u32(h) << 16); }

// Round to nearest even; NaN -> 0x7FC0 (c10::BFloat16's round_to_nearest_even).
BIK_HD u16 f32_to_bf16(float f) {
  const u32 b = bits_of(f);
  if (is_nan(f)) return u16(0x7FC0);
  return u16((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

// Exact: every fp16 is an fp32.
BIK_HD float f16_to_f32(u16 h) {
  const u32 sign = u32(h & 0x8000u) << 16;
  const u32 exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  if (exp == 0x1Fu) return f32_from_bits(sign | 0x7F800000u | (man << 13));
  if (exp != 0) return f32_from_bits(sign | ((exp + 112u) << 23) | (man << 13));
  // zero or subnormal: man * 2^-24, exact in fp32
  return f32_from_bits(sign | bits_of(mul_rn(float(man), 5.9604644775390625e-08f)));
}

// Round to nearest even; overflow -> inf; NaN -> sign | 0x7E00 (c10's fp16_ieee_from_fp32_value).
BIK_HD u16 f32_to_f16(float f) {
  const u32 b = bits_of(f);
  const u32 sign = (b >> 16) & 0x8000u, a = b & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return u16(sign | 0x7E00u);
  if (a >= 0x477FF000u) return u16(sign | 0x7C00u);  // >= 65520 rounds to inf
  if (a >= 0x38800000u) {                             // normal fp16 (>= 2^-14)
    const u32 r = a - 0x38000000u;                     // rebias the exponent by 127 - 15
    return u16(sign | ((r + 0xFFFu + ((r >> 13) & 1u)) >> 13));
  }
  // subnormal fp16 (or zero): round |f| * 2^24 (exact) to an integer, ties to even, by the
  // 2^23 trick; 1024 is the smallest normal and encodes correctly as 0x0400.
  const float scaled = mul_rn(f32_from_bits(a), 16777216.0f);
  const float rounded = sub_rn(add_rn(scaled, 8388608.0f), 8388608.0f);
  return u16(sign | u32(rounded));
}

// Loads/stores of one element of a storage type as fp32.
struct F32 {
  typedef float storage;
  static BIK_HD float load(float v) { return v; }
  static BIK_HD float store(float v) { return v; }
};
struct BF16 {
  typedef u16 storage;
  static BIK_HD float load(u16 v) { return bf16_to_f32(v); }
  static BIK_HD u16 store(float v) { return f32_to_bf16(v); }
};
struct F16 {
  typedef u16 storage;
  static BIK_HD float load(u16 v) { return f16_to_f32(v); }
  static BIK_HD u16 store(float v) { return f32_to_f16(v); }
};

constexpr u32 kFullMask = 0xFFFFFFFFu;  // every lane of a warp (shuffles, votes)

// ---- fixed-order reductions (device) ---------------------------------------------------------
#if defined(__CUDACC__)

// Sum over `width` consecutive lanes (a power of two <= 32) by the fold w = width/2, ..., 2, 1:
// lane l < w takes s[l] + s[l + w]. Lane 0 of each group ends with the sum; every lane of the
// warp must call it (no divergence).
template <int width>
__device__ __forceinline__ float group_sum_fixed(float s) {
#pragma unroll
  for (int w = width / 2; w >= 1; w >>= 1) s = add_rn(s, __shfl_down_sync(kFullMask, s, w, width));
  return s;
}

// Block-wide sum of one value per thread in a fixed tree: the warp fold above, then warp 0
// folds the per-warp sums (warp 0, 1, ... as lanes) the same way. `scratch` holds 32 floats.
// Returns the total in every thread. blockDim.x must be a multiple of 32 and <= 1024.
__device__ __forceinline__ float block_sum_fixed(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = group_sum_fixed<32>(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float t = lane < warps ? scratch[lane] : 0.0f;
    t = group_sum_fixed<32>(t);
    if (lane == 0) scratch[0] = t;
  }
  __syncthreads();
  return scratch[0];
}

#endif  // __CUDACC__

}  // namespace bik
