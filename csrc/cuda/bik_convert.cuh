// Element conversions for bik's CUDA kernels, in inline PTX so that NVRTC needs no CUDA or
// C++ headers. bf16/fp16 travel as raw 16-bit patterns (unsigned short).
//   bf16 -> fp32 and fp16 -> fp32 are exact; fp32 -> bf16/fp16 round to nearest even (.rn),
//   the rounding torch's .to() uses.
#pragma once

namespace bik_cvt {

enum Kind { kF32 = 0, kBF16 = 1, kF16 = 2 };

__device__ __forceinline__ float bf16_to_f32(unsigned short h) {
  return __uint_as_float(static_cast<unsigned>(h) << 16);
}

#if defined(__CUDA_ARCH__)
__device__ __forceinline__ float f16_to_f32(unsigned short h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

__device__ __forceinline__ unsigned short f32_to_bf16(float f) {
  unsigned short h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

__device__ __forceinline__ unsigned short f32_to_f16(float f) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
#else  // host builds of the kernels for CPU tests (tests/cuda/cuda_host): the same roundings
__device__ __forceinline__ float f16_to_f32(unsigned short h) {
  _Float16 x;
  __builtin_memcpy(&x, &h, 2);
  return static_cast<float>(x);
}

__device__ __forceinline__ unsigned short f32_to_bf16(float f) {
  unsigned u;
  __builtin_memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<unsigned short>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<unsigned short>(u >> 16);
}

__device__ __forceinline__ unsigned short f32_to_f16(float f) {
  const _Float16 x = static_cast<_Float16>(f);
  unsigned short h;
  __builtin_memcpy(&h, &x, 2);
  return h;
}
#endif

// Element i of a tensor of dtype KIND, widened to fp32 (exact).
template <int KIND>
__device__ __forceinline__ float load_f32(const void* p, long long i) {
  if (KIND == kF32) return static_cast<const float*>(p)[i];
  const unsigned short h = static_cast<const unsigned short*>(p)[i];
  return KIND == kBF16 ? bf16_to_f32(h) : f16_to_f32(h);
}

// Store v rounded once to the output dtype (a runtime kind: the op's out_dtype).
__device__ __forceinline__ void store_as(void* p, long long i, float v, int kind) {
  if (kind == kF32) {
    static_cast<float*>(p)[i] = v;
  } else {
    static_cast<unsigned short*>(p)[i] = kind == kBF16 ? f32_to_bf16(v) : f32_to_f16(v);
  }
}

}  // namespace bik_cvt
