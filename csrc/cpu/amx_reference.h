// The bf16 AMX sequence of contract.h written literally in scalar C++ (runs on any CPU): what
// the Amx kernel (matmul_bf16_amx.h) must equal bit for bit, and its start-up self-test's
// judge. tools/amx_probe.py checks the instruction itself against the same sequence.
#pragma once

#include "dot_reference.h"

namespace bik_cpu {
namespace amx_ref {

// c[m, n] for a[M, K], b[K, N] (bf16 bits, element strides), split length `split` (0 or >= K:
// one split), optional fp32 bias: per split, acc = +0; per block of 32 terms from the split's
// start, two chains from +0 (the block's even and odd offsets, each step dot_ref::step: the
// exact product added and rounded once, inputs' denormals read as zero, flushed below 2^-126),
// acc = acc + (even + odd) rounded the same way; splits folded t = t + acc; + bias.
inline void matmul(const std::uint16_t* a, idx_t sam, idx_t sak, const std::uint16_t* b,
                   idx_t sbk, idx_t sbn, const float* bias, float* c, idx_t ldc, idx_t M,
                   idx_t N, idx_t K, idx_t split) {
  matmul_splits(bias, c, ldc, M, N, K, split, [&](idx_t m, idx_t n, idx_t lo, idx_t hi) {
    float acc = 0.0f;
    for (idx_t k0 = lo; k0 < hi; k0 += 32) {
      float chain[2] = {0.0f, 0.0f};
      for (idx_t k = k0; k < hi && k < k0 + 32; ++k)
        chain[(k - k0) % 2] =
            dot_ref::step(chain[(k - k0) % 2], a[m * sam + k * sak], b[k * sbk + n * sbn]);
      acc = dot_ref::round_flush(
          double(acc) + double(dot_ref::round_flush(double(chain[0]) + double(chain[1]))));
    }
    return acc;
  });
}

}  // namespace amx_ref
}  // namespace bik_cpu
