// The C entry points of bik._cpu_kernels, for C++ callers in other shared objects (bik's
// dispatcher kernels, csrc/native): plain C types only, so the two sides need not agree on a
// C++ ABI. The caller gets each entry's address from the Python module (c_entry_points()),
// so the process holds one copy of each kernel.
#pragma once

#include <stdint.h>

#define BIK_C_ABI_VERSION 3  // 2: + split; 3: + a_bf16

#ifdef __cplusplus
extern "C" {
#endif

// c[e][M, N] (row pitch ldc) = a[e][M, K] @ b[e][K, N] (+ bias[N]) for e < batch, element
// strides; entry e starts at a + e*sab, b + e*sbb, c + e*scb. a, c, bias: fp32; b: fp32, or
// bf16 bit patterns when b_bf16 (widened exactly while packing). The fixed order of
// contract.h with K-split length `split` (0 or >= K: one split); bits do not depend on
// num_threads.
typedef struct {
  const void* a;
  int64_t sam, sak;
  const void* b;
  int64_t sbk, sbn;
  const float* bias;  // NULL: no bias
  float* c;
  int64_t ldc, M, N, K;
  int64_t batch, sab, sbb, scb;
  int64_t split;
  int32_t num_threads, b_bf16;
  // a_bf16 != 0: a and b hold bf16 bit patterns and the product runs contract.h's bf16 dot
  // sequence (vdpbf16ps); refused with code 3 where that path is unavailable.
  int32_t a_bf16;
} BikMatmulF32Args;

// The K-split rule of bik.configs.matmul_split, for C++ callers that pick a split themselves
// (the dispatcher kernels). Python hands over the live constants; tests check that this and
// matmul_split agree for every K up to tens of thousands. none != 0: one split (no split-K).
typedef struct {
  int64_t tp_max, group_align, split, one_split_max_k, none;
} BikMatmulSplitRule;

static inline int64_t bik_matmul_split_len(int64_t K, const BikMatmulSplitRule* r) {
  const int64_t one = K > 1 ? K : 1;
  if (r->none) return one;
  if (K > 0 && K % (r->tp_max * r->group_align) == 0) return K / r->tp_max;
  return K <= r->one_split_max_k ? one : r->split;
}

// 0 on success; 1: sizes refused (negative); 2: the kernel failed (a thread could not start);
// 3: the bf16 dot path asked for where it is unavailable.
// Never throws, takes no GIL.
typedef int (*BikMatmulF32Fn)(const BikMatmulF32Args*);

#ifdef __cplusplus
}
#endif
