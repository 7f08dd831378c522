// The C entry points of bik._cpu_kernels, for C++ callers in other shared objects (bik's
// dispatcher kernels, csrc/aten): plain C types only, so the two sides need not agree on a
// C++ ABI. The caller gets each entry's address from the Python module (c_entry_points()),
// so the process holds one copy of each kernel.
#pragma once

#include <stdint.h>

#define BIK_C_ABI_VERSION 1

#ifdef __cplusplus
extern "C" {
#endif

// c[e][M, N] (row pitch ldc) = a[e][M, K] @ b[e][K, N] (+ bias[N]) for e < batch, element
// strides; entry e starts at a + e*sab, b + e*sbb, c + e*scb. a, c, bias: fp32; b: fp32, or
// bf16 bit patterns when b_bf16 (widened exactly while packing). The fixed order of
// contract.h; bits do not depend on num_threads.
typedef struct {
  const void* a;
  int64_t sam, sak;
  const void* b;
  int64_t sbk, sbn;
  const float* bias;  // NULL: no bias
  float* c;
  int64_t ldc, M, N, K;
  int64_t batch, sab, sbb, scb;
  int32_t num_threads, b_bf16;
} BikMatmulF32Args;

// 0 on success; 1: sizes refused (negative); 2: the kernel failed (a thread could not start).
// Never throws, takes no GIL.
typedef int (*BikMatmulF32Fn)(const BikMatmulF32Args*);

#ifdef __cplusplus
}
#endif
