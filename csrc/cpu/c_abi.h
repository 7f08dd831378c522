// The C entry points of bik._cpu_kernels, for C++ callers in other shared objects (bik's
// dispatcher kernels, csrc/native): plain C types only, so the two sides need not agree on a
// C++ ABI. The caller gets each entry's address from the Python module (c_entry_points()),
// so the process holds one copy of each kernel.
#pragma once

#include <stdint.h>

// 2: + split; 3: + a_bf16; 4: + packed, rms_norm, attention_paged, write_kv_rows, reduce_rows;
// 5: + fp32_fma, bf16_amx; 6: + c_bf16
#define BIK_C_ABI_VERSION 6

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
  // Not NULL: B as bik.PackedWeight packed it for this process's CPU path (matmul_pack_b, or
  // matmul_pack_b_pairs with a_bf16), read in place of b (b unread; batch 1). Same bits.
  const void* packed;
  // Off the bf16 dot path: fp32_fma != 0 runs contract.h's fp32 fma sequence (refused with code
  // 3 where it is unavailable), else its mul-add one.
  int32_t fp32_fma;
  // With a_bf16: bf16_amx != 0 runs contract.h's bf16 AMX sequence (refused with code 3 where
  // it is unavailable), else its bf16 dot sequence.
  int32_t bf16_amx;
  // c_bf16 != 0: c holds bf16 bit patterns (uint16), each result rounded as torch's
  // .to(torch.bfloat16) rounds it (contract.h's round_bf16), without an fp32 pass.
  int32_t c_bf16;
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
// 3: the bf16 dot path or the fp32 fma sequence asked for where it is unavailable.
// Never throws, takes no GIL.
typedef int (*BikMatmulF32Fn)(const BikMatmulF32Args*);

// RMSNorm over M rows of H (unit stride along H; row strides in elements): x, residual, y and h
// fp32, or bf16 bit patterns when bf16 != 0; w fp32 [H]. With a residual (not NULL; h then too)
// each row is first h = x + residual rounded to the rows' dtype, written to h. The bits of
// bik.rms_norm's CPU launcher (the same kernel). 0 on success; 1: sizes refused; 2: a thread
// could not start. Never throws, takes no GIL.
typedef struct {
  const void* x;
  int64_t sxm;
  const void* residual;  // NULL: none
  int64_t srm;
  const float* w;
  void* y;
  int64_t sym;
  void* h;
  int64_t shm;
  int64_t M, H;
  double eps;  // rounded to fp32 by the kernel, as the contract says
  int32_t bf16, num_threads;
} BikRmsNormArgs;
typedef int (*BikRmsNormFn)(const BikRmsNormArgs*);

// Fixed-split attention (attention.h) over a paged KV cache, the bits of bik.attention's CPU
// launcher: q fp32 [total_q, hq, d] by strides (unit along d); k and v one layout, fp32 or bf16
// bit patterns (kv_bf16), key t of sequence b and KV head h at element
// page * s_page + (t % block_size) * s_tok + h * s_head, page = block_table[b, t / block_size]
// (clamped to [-1, num_blocks]: the kernel's check refuses it). block_table [B, table_cols]
// with row stride s_table; cu_q [B + 1] and seqlens_k [B]; each int32, or int64 when its
// *_i64 is set. max_seqlen_k: the host bound on any sequence's keys. out [total_q, hq, d] and
// lse [total_q, hq]: fp32, contiguous. 0 on success; 1: refused, with the reason in error
// (NUL-terminated, at most error_size bytes); 2: the kernel failed (a thread could not start).
// Never throws, takes no GIL.
typedef struct {
  const float* q;
  int64_t sq_tok, sq_head;
  const void* k;
  const void* v;
  int64_t k_extent;  // elements k's view reaches from its first (1 + sum (n - 1) * stride)
  int64_t num_blocks, block_size, s_page, s_tok, s_head;
  const void* block_table;
  int64_t table_cols, s_table;
  const void* cu_q;
  const void* seqlens_k;
  int32_t table_i64, cu_q_i64, seqlens_i64, kv_bf16;
  int64_t B, total_q, hq, hkv, d, split, max_seqlen_k;
  double scale_log2e;  // rounded to fp32
  int32_t causal, num_threads;
  float* out;
  float* lse;
  char* error;
  int64_t error_size;
} BikAttentionPagedArgs;
typedef int (*BikAttentionPagedFn)(const BikAttentionPagedArgs*);

// New K/V rows into one paged cache, in place (bik.write_kv_cache's CPU copy loop): row t of src
// [tokens, hkv, d] (element strides s_tok, s_head, unit along d; elements of `elem` bytes, 2 or
// 4) goes to slot slots[t] (page s / block, offset s % block; element strides c_page, c_off,
// c_head), tokens ascending; a slot < 0 or >= n_slots is skipped. slots: int32, or int64 when
// slots_i64. 0 on success; 1: sizes refused. Never throws, takes no GIL.
typedef struct {
  void* cache;
  int64_t c_page, c_off, c_head, block, n_slots;
  const void* src;
  int64_t s_tok, s_head, tokens, hkv, d, elem;
  const void* slots;
  int32_t slots_i64;
} BikKvRowsArgs;
typedef int (*BikKvRowsFn)(const BikKvRowsArgs*);

// The fixed-order softmax (op 0: y [M, N], row stride sym) or mean (op 1: y [M]) of the rows of
// fp32 x [M, N] (unit stride along N, row stride sxm; N >= 1): the kernels of bik.softmax's and
// bik.mean's CPU launchers (contract.h), threads splitting rows. 0 on success; 1: sizes
// refused; 2: a thread could not start. Never throws, takes no GIL.
typedef struct {
  const float* x;
  int64_t sxm;
  float* y;
  int64_t sym, M, N;
  int32_t op, num_threads;
} BikReduceRowsArgs;
typedef int (*BikReduceRowsFn)(const BikReduceRowsArgs*);

#ifdef __cplusplus
}
#endif
