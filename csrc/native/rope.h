// vLLM's RoPE formula (RotaryEmbedding.forward_static) in one C++ call, for the vLLM plugin's
// rope.py through bik_native's module (native_cpu.cpp); included once, by native_cpu.cpp.
//
// vLLM's RotaryEmbedding.forward_static, op for op, in x's dtype: with cos and sin the halves of
// cos_sin[positions[t]], o1 = x1 * cos - x2 * sin and o2 = x2 * cos + x1 * sin, each product and
// sum rounded to the dtype as torch's elementwise ops round it (computed in fp32, then rounded to
// nearest even: a bf16 product is exact in fp32), x1 / x2 the halves (neox) or the even / odd
// entries (GPT-J) of a head's first rotary_dim entries, the rest passed through. Hugging Face
// Llama's q * cos + rotate_half(q) * sin is the same arithmetic (negation is exact). Elementwise:
// a token's bits depend on nothing else. Replaces ~15 torch ops a layer (~70 µs at decode).
#pragma once

#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace bik_layers {

using at::Tensor;

// Element access in fp32 bits: a bf16 is the high half of its float (exact both ways once
// rounded). Inline bit arithmetic, so the loops below vectorise.
inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) {
  const uint32_t u = uint32_t(v.x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// v rounded to T's precision, as a float: round to nearest even to bf16 (c10's rule; a NaN
// becomes the quiet NaN 0x7fc0, whose payload bik does not promise); the identity for fp32.
template <class T>
inline float rounded(float v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    const bool nan = (u & 0x7fffffffu) > 0x7f800000u;  // integer ops only: they vectorise
    u = nan ? 0x7fc00000u : (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    float r;
    std::memcpy(&r, &u, 4);
    return r;
  }
}

// A float already rounded to T's precision, stored as T (exact).
template <class T>
inline void store(T* at, float v) {
  if constexpr (std::is_same_v<T, float>) {
    *at = v;
  } else {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    at->x = uint16_t(u >> 16);
  }
}

// One head's rotary pairs, every product and sum rounded to T. Exactly rounded ops only, so
// any vector width gives the same bits: the AVX-512 version below where the CPU has it.
#define BIK_ROPE_HEAD                                                                  \
  for (int64_t i = 0; i < half; ++i) {                                                 \
    const int64_t i1 = kNeox ? i : 2 * i, i2 = kNeox ? i + half : 2 * i + 1;           \
    const float x1 = widen(xr[i1]), x2 = widen(xr[i2]);                                \
    const float c = widen(cs[i]), s = widen(cs[half + i]);                             \
    store(yr + i1, rounded<T>(rounded<T>(x1 * c) - rounded<T>(x2 * s)));               \
    store(yr + i2, rounded<T>(rounded<T>(x2 * c) + rounded<T>(x1 * s)));               \
  }

#if defined(__x86_64__)
// The neox pairs on 16-lane vectors (GCC's vector extensions; each lane the scalar's ops):
// x1, x2 and cos, sin are contiguous halves, so a head is a few vector steps.
typedef float rope_vf __attribute__((vector_size(64)));
typedef uint32_t rope_vu __attribute__((vector_size(64)));
typedef uint16_t rope_vh __attribute__((vector_size(32)));

template <class T>
__attribute__((target("avx512f,avx512bw"), always_inline)) inline rope_vf rope_load(const T* p) {
  rope_vf v;
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(&v, p, sizeof v);
  } else {
    rope_vh h;
    std::memcpy(&h, p, sizeof h);
    const rope_vu u = __builtin_convertvector(h, rope_vu) << 16;
    std::memcpy(&v, &u, sizeof v);
  }
  return v;
}

template <class T>
__attribute__((target("avx512f,avx512bw"), always_inline)) inline rope_vf rope_round(rope_vf v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    rope_vu u;
    std::memcpy(&u, &v, sizeof u);
    const rope_vu nearest = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    u = (u & 0x7fffffffu) > 0x7f800000u ? rope_vu{} + 0x7fc00000u : nearest;
    std::memcpy(&v, &u, sizeof v);
    return v;
  }
}

template <class T>
__attribute__((target("avx512f,avx512bw"), always_inline)) inline void rope_store(T* p,
                                                                                   rope_vf v) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(p, &v, sizeof v);
  } else {
    rope_vu u;
    std::memcpy(&u, &v, sizeof u);
    const rope_vh h = __builtin_convertvector(u >> 16, rope_vh);
    std::memcpy(p, &h, sizeof h);
  }
}

template <class T, bool kNeox>
__attribute__((target("avx512f,avx512bw"))) void rope_head_avx512(const T* xr, T* yr,
                                                                  const T* cs, int64_t half) {
  int64_t i0 = 0;
  if constexpr (kNeox) {
    for (; i0 + 16 <= half; i0 += 16) {
      const rope_vf x1 = rope_load(xr + i0), x2 = rope_load(xr + half + i0);
      const rope_vf c = rope_load(cs + i0), s = rope_load(cs + half + i0);
      rope_store(yr + i0, rope_round<T>(rope_round<T>(x1 * c) - rope_round<T>(x2 * s)));
      rope_store(yr + half + i0,
                 rope_round<T>(rope_round<T>(x2 * c) + rope_round<T>(x1 * s)));
    }
  }
  for (int64_t i = i0; i < half; ++i) {  // the rest (and GPT-J's interleaved pairs)
    const int64_t i1 = kNeox ? i : 2 * i, i2 = kNeox ? i + half : 2 * i + 1;
    const float x1 = widen(xr[i1]), x2 = widen(xr[i2]);
    const float c = widen(cs[i]), s = widen(cs[half + i]);
    store(yr + i1, rounded<T>(rounded<T>(x1 * c) - rounded<T>(x2 * s)));
    store(yr + i2, rounded<T>(rounded<T>(x2 * c) + rounded<T>(x1 * s)));
  }
}
#endif

template <class T, bool kNeox>
__attribute__((optimize("tree-vectorize"))) void rope_head_base(const T* xr, T* yr, const T* cs,
                                                               int64_t half) {
  BIK_ROPE_HEAD
}
#undef BIK_ROPE_HEAD

template <class T, bool kNeox>
void (*rope_head())(const T*, T*, const T*, int64_t) {
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"))
    return &rope_head_avx512<T, kNeox>;
#endif
  return &rope_head_base<T, kNeox>;
}

template <class T>
void rope_rows(const int64_t* pos, const T* x, int64_t sx, T* out, const T* cos_sin,
               int64_t tokens, int64_t heads, int64_t head_size, int64_t rotary_dim, bool neox) {
  static const auto neox_head = rope_head<T, true>(), gptj_head = rope_head<T, false>();
  const auto head = neox ? neox_head : gptj_head;
  const int64_t half = rotary_dim / 2;
  at::parallel_for(0, tokens, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const T* cs = cos_sin + pos[t] * rotary_dim;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xr = x + t * sx + h * head_size;
        T* yr = out + (t * heads + h) * head_size;
        head(xr, yr, cs, half);
        for (int64_t i = rotary_dim; i < head_size; ++i) yr[i] = xr[i];
      }
    }
  });
}

inline bool rope_served(const Tensor& positions, const Tensor& x, const Tensor& cos_sin,
                        int64_t head_size, int64_t rotary_dim) {
  const auto s = x.scalar_type();
  return x.is_cpu() && positions.is_cpu() && cos_sin.is_cpu() &&
         (s == at::kFloat || s == at::kBFloat16) && cos_sin.scalar_type() == s &&
         positions.scalar_type() == at::kLong && positions.is_contiguous() &&
         positions.dim() == 1 && x.dim() == 2 && x.size(0) == positions.numel() &&
         (x.size(1) <= 1 || x.stride(1) == 1) && cos_sin.is_contiguous() &&
         cos_sin.dim() == 2 && cos_sin.size(1) == rotary_dim && rotary_dim % 2 == 0 &&
         0 < rotary_dim && rotary_dim <= head_size && positions.numel() > 0 &&
         x.size(1) % head_size == 0;
}

// The rotated copy of x [tokens, heads * head_size] (rows of unit stride along the heads, as
// vLLM's q and k slices of the fused qkv output are), contiguous as forward_native's, or an
// undefined tensor when the call is not served (the caller then runs vLLM's torch formula).
inline Tensor rope(const Tensor& positions, const Tensor& x, const Tensor& cos_sin,
                   int64_t head_size, int64_t rotary_dim, bool neox) {
  if (!rope_served(positions, x, cos_sin, head_size, rotary_dim)) return Tensor();
  const int64_t tokens = positions.numel(), n_pos = cos_sin.size(0);
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    if (pos[t] < 0 || pos[t] >= n_pos) return Tensor();  // index_select's error, from torch
  Tensor out = at::detail::empty_cpu({tokens, x.size(1)}, x.scalar_type());
  const int64_t heads = x.size(1) / head_size;
  if (x.scalar_type() == at::kFloat) {
    rope_rows<float>(pos, x.const_data_ptr<float>(), x.stride(0), out.mutable_data_ptr<float>(),
                     cos_sin.const_data_ptr<float>(), tokens, heads, head_size, rotary_dim,
                     neox);
  } else {
    rope_rows<c10::BFloat16>(pos, x.const_data_ptr<c10::BFloat16>(), x.stride(0),
                             out.mutable_data_ptr<c10::BFloat16>(),
                             cos_sin.const_data_ptr<c10::BFloat16>(), tokens, heads, head_size,
                             rotary_dim, neox);
  }
  return out;
}

}  // namespace bik_layers
