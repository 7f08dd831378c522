// bik CPU kernels: the numerics contract (this comment is the spec) and the shared helpers.
//
// Every kernel here computes each output element with one fixed sequence of IEEE-754 binary32
// operations (round to nearest even, denormals honoured) that depends only on that element's own
// inputs. Nothing in the sequence depends on M, on a row's position in the batch, on the thread
// count or split, on the N/M tails, on K blocking or on the SIMD width the CPU dispatches to, so
// the bits are the same whatever the batch. That is batch invariance by construction.
//
// matmul (fp32 in, fp32 out), c[m,n] for a[M,K], b[K,N], optional bias[N], split length S
// (bik.configs.matmul_split: from K, never M; S >= K is one split):
//     for each split s = [s*S, min((s+1)*S, K)) in ascending order (at least one):
//         p = 0.0f;  for k in the split, ascending:  p = step(p, a[m,k], b[k,n])
//         t = p if s == 0, else t = t + p
//     c[m,n] = t + bias[n]    if bias is given (so K == 0 gives 0.0f + bias[n])
//     c[m,n] = t              otherwise
//   (bik's K-split contract cuts K into G groups, then splits; its table keeps each group one
//   split when G > 1, so the two-level fold is this flat one.)
//   Two sequences of step, one per process (versions["cpu_fp32"] in the fingerprint):
//     fma:      step(p, x, y) = the exact p + x*y rounded once (fmaf). The default wherever
//               the widest ISA's Fma32 kernel passes its start-up self-test (bindings.cpp,
//               bik.runtime.cpu_ext.fp32_fma): x86 CPUs with FMA; the generic build's lanes
//               call fmaf, exact by definition. Transcriptions: fma_reference.h (scalar C++,
//               no FMA instruction) and bik/ops/matmul/reference.py's fma_step.
//     mul-add:  step(p, x, y) = p + x*y with the multiply rounded, then the add (no FMA):
//               BIK_CPU_FP32=mul-add, a CPU without FMA, and attention's dots in every process.
//               The CUDA backend's SIMT fp32 kernel runs this one.
//   The folds and the bias add are plain rounded adds in both.
//
// matmul, bf16 dot sequence (a and b bf16, fp32 out), on x86 CPUs with FMA whose start-up
// self-test passed (bindings.cpp; bik.runtime.cpu_ext.bf16_dot, BIK_CPU_BF16=widen turns it
// off). The splits, folds and bias are the ones above; inside a split:
//         p = 0.0f;  for k in the split, ascending:  p = step(p, a[m,k], b[k,n])
//         if the split's length is odd:              p = step(p, +0, +0)
//     step(p, x, y): x and y with a zero exponent field read as zeros of their sign; the exact
//         p + x*y rounded once to nearest even at 24 bits with an unbounded exponent; a result
//         below 2^-126 in magnitude (judged after that rounding) becomes a zero of its sign.
//   That is an fp32 FMA of the widened halves under MXCSR's DAZ and FTZ (the kernel bik runs),
//   and one lane of vdpbf16ps per pair (x[k] in a pair word's high half, which the instruction
//   takes first; it ignores MXCSR). The odd split's extra step is
//   its last pair's zero half: it turns a -0 partial into +0. A bf16 x bf16 product is exact in
//   fp32, so wherever no product or partial falls below 2^-126 each step rounds exactly where
//   the fp32 sequence's add does: the two sequences differ only near the flush threshold (and
//   in that -0), which is why they are two contracts (versions["cpu_bf16"] in the
//   fingerprint). Transcriptions: dot_reference.h (scalar C++), bik/ops/matmul/reference.py.
//
// matmul, bf16 AMX sequence (a and b bf16, fp32 out), on x86 CPUs whose AMX bf16 tiles the
// kernel grants and whose start-up self-test passed (and the dot sequence's too): the default
// for 2-D products (bik.runtime.cpu_ext.bf16_kernel; BIK_CPU_BF16=dot turns it off). bmm keeps
// the dot sequence: the blocks are cut from the split's start, so a product whose K begins with
// exact zeros (a left-padded attention product p @ v) changes bits with the padding, which the
// dot sequence's one chain from +0 does not. The splits, folds and bias are the ones above;
// inside a split:
//         acc = +0;  for each block of 32 k from the split's start (the last one shorter):
//             e = +0;  o = +0;  for k in the block, ascending:
//                 e = step(e, a[m,k], b[k,n]) if k's offset in the block is even, else o = ...
//             acc = flush(acc + (e + o))      (each of the two adds rounded once)
//     step: the dot sequence's; flush(x + y): x + y rounded once to nearest even, a result below
//     2^-126 (after rounding) a zero of its sign, inf past the largest.
//   That is one tdpbf16ps per block as measured on the CI machine (tools/amx_probe.py: two
//   fp32 chains per instruction, then the accumulator), so the bits differ from the dot
//   sequence's almost everywhere. Transcription: amx_reference.h. How (matmul_bf16_amx.h):
//   the dot path's pair panels read in place as B tiles, A pair words as rows of A tiles, 16 x 16
//   fp32 accumulator tiles; a split's last block zero-padded (+0 terms leave e and o as they
//   are: they start at +0); K blocks whole 32-term blocks.
//   How (matmul_bf16_dot.h): B packed into pair words (panels [pairs][NRW columns], each
//   split's pairs from its own start, so a packed weight keeps 2 bytes per element), A widened;
//   the ISA's register blocks; K blocks even, inside a split; DAZ / FTZ set around a split's
//   steps and the caller's MXCSR back for the folds and the bias; threads as above.
//   How: SIMD lanes run across N (each lane is one column n, so each lane's ops are exactly the
//   sequence above); a register block of R <= MR rows x NRV vectors of N; B is packed into
//   zero-padded [kc x NRW] panels so N tails run the same vector code; M tails instantiate the
//   same template with fewer rows; K blocking stores acc to c (fp32, exact) and reloads it,
//   which keeps the order; K blocks never cross a split, and a split after the first is summed
//   in scratch and then added to c. Threads split N panels and/or M rows, never K.
//
// rms_norm (fp32 in, fp32 out), per row x[0..H-1], weight w[H], eps rounded to fp32 first:
//     s[l] = 0.0f for l = 0..15;  for j ascending: s[j % 16] = s[j % 16] + x[j] * x[j]
//         (each multiply and add rounded separately)
//     for w = 8, 4, 2, 1:  s[l] = s[l] + s[l + w]  for l < w
//     mean = s[0] / (float)H;  rstd = 1.0f / sqrtf(mean + eps)  (correctly rounded div/sqrt)
//     y[j] = (x[j] * rstd) * w[j]
//   Rows are independent; threads split rows only. The vector body adds +0.0f (= 0*0) in the
//   lanes past H; since every s[l] is >= +0, NaN or +inf, that add is exact and changes nothing.
//
// softmax / log_softmax (fp32 in, fp32 out; reductions.h), per row x[0..n-1]:
//     mx = max_j x[j]  (NaN if any x[j] is NaN; max is exact, so its order is irrelevant)
//     s[l] = 0.0f for l = 0..15;  for j ascending:  e[j] = expf(x[j] - mx);  s[j % 16] += e[j]
//     for w = 8, 4, 2, 1:  s[l] = s[l] + s[l + w]  for l < w;   S = s[0]
//     softmax:      y[j] = e[j] / S                   (correctly rounded division)
//     log_softmax:  y[j] = (x[j] - mx) - logf(S)
//   expf/logf are the C library's: pure functions of their argument (the libm, not the batch,
//   decides their bits). Hence a +inf in a row makes the row NaN (inf - inf), an all -inf row is
//   NaN (-inf - -inf), a NaN poisons only its row, and -inf entries among finite ones give 0.
//
// mean (fp32 in, fp32 out; reductions.h), per row x[0..n-1], n >= 1:
//     s[l] = 0.0f for l = 0..15;  for j ascending:  s[j % 16] = s[j % 16] + x[j]
//     for w = 8, 4, 2, 1:  s[l] = s[l] + s[l + w]  for l < w;   y = s[0] / (float)n
//   (no padding adds in the tail: only lane j % 16 of each element is touched).
//   Rows are independent; threads split rows only, as for rms_norm.
//
// attention (attention.h): the sequence written there, the bits of the Python reference
//   (bik.ops.attention.reference.attention_cpu_reference); its dots are matmul tiles on the
//   mul-add sequence above, whichever sequence the process's products run. Threads split (sequence, KV head, row block) work items.
//
// FP environment: each compute thread (the caller included, restored afterwards) runs with the
// default environment (round to nearest, no flush-to-zero / denormals-are-zero), so a caller's
// torch.set_flush_denormal(True) cannot make a threaded call differ from a single-thread one.
// The build must not contract (-ffp-contract=off, no -ffast-math): see setup.py.
#pragma once

#include <cfenv>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace bik_cpu {

using idx_t = std::int64_t;

// Sets the default FP environment for the current thread and restores the old one on exit.
class FenvGuard {
 public:
  FenvGuard() {
    std::fegetenv(&saved_);
    std::fesetenv(FE_DFL_ENV);
  }
  ~FenvGuard() { std::fesetenv(&saved_); }
  FenvGuard(const FenvGuard&) = delete;
  FenvGuard& operator=(const FenvGuard&) = delete;

 private:
  std::fenv_t saved_;
};

// Set in a process forked from this one (pthread_atfork, registered at module init). libgomp's
// pool does not survive fork: the child's first parallel region waits forever for the
// parent's threads (measured: stock torch.mm hangs there too).
inline bool& forked_child() {
  static bool flag = false;
  return flag;
}

// Runs fn(tid) for every tid in [0, n), fn(0) included on the calling thread when it can.
// With OpenMP (the normal build) the work runs on the calling thread's OpenMP team: the
// extension links libgomp.so.1, and torch has already loaded its own copy under that soname,
// so this is torch's intra-op pool. Sharing it matters on a small machine: torch's workers
// spin for a while after each parallel op, and threads of our own would compete with them
// (measured on 2 cores: a 128x576x1536 product right after any torch op took 4.0 ms instead
// of 1.8 ms) and cost a spawn per call. A team may be smaller than n (nesting, limits), so
// each thread takes ids in strides; which thread runs an id never affects the bits. In a
// forked child, fresh threads instead. fn must not throw. n == 1 runs inline.
template <class Fn>
void parallel_run(int n, const Fn& fn) {
  if (n <= 1) {
    FenvGuard g;
    fn(0);
    return;
  }
#if defined(_OPENMP)
  if (!forked_child()) {
#pragma omp parallel num_threads(n)
    {
      FenvGuard g;
      for (int t = omp_get_thread_num(); t < n; t += omp_get_num_threads()) fn(t);
    }
    return;
  }
#endif
  std::vector<std::thread> workers;
  workers.reserve(static_cast<size_t>(n - 1));
  for (int t = 1; t < n; ++t) {
    workers.emplace_back([&fn, t] {
      FenvGuard g;
      fn(t);
    });
  }
  {
    FenvGuard g;
    fn(0);
  }
  for (auto& w : workers) w.join();
}

// Per-calling-thread scratch memory, 64-byte aligned, grown on demand and kept between calls
// (so decode-sized calls do not hit malloc/mmap). Workers get slices of their caller's arena.
inline float* scratch_floats(size_t count) {
  thread_local std::vector<float> arena;
  const size_t need = count + 16;
  if (arena.size() < need) {
    arena.clear();
    arena.shrink_to_fit();
    arena.resize(need);
  }
  auto p = reinterpret_cast<std::uintptr_t>(arena.data());
  p = (p + 63) & ~static_cast<std::uintptr_t>(63);
  return reinterpret_cast<float*>(p);
}

// An fp32 result rounded to bf16 as torch's vectorized CPU conversion rounds it (ATen's
// cvtfp32_bf16: nearest even on the bits, every NaN 0xffff), so a product that writes bf16
// itself has the bits of writing fp32 and calling .to(torch.bfloat16).
inline std::uint16_t round_bf16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0xffffu;
  return std::uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Thread-count policy: below these sizes one thread does the work (no spawn), because starting
// a thread (~20-50 us) would cost more than it saves. Never affects bits.
constexpr idx_t kMatmulMinMacsPerThread = idx_t(1) << 18;
// Rows a matmul tile call takes at once when K has several splits (bounds the partial's scratch).
constexpr idx_t kSplitRows = 256;
constexpr idx_t kRmsMinElemsPerThread = idx_t(1) << 18;

// The matmul contract's loops around a step, for the scalar transcriptions (dot_reference.h,
// fma_reference.h): c[m, n] for a[M, K], b[K, N] (element strides) and split length `split`
// (0 or >= K: one split): each split p = 0.0f, p = step(p, a[m,k], b[k,n]) for k ascending,
// then p = split_end(p, its length); t = p_0, t = t + p_s; then + bias[n] when bias is given.
// The splits' fold around split_sum(m, n, lo, hi), a split's partial: t = p_0, t = t + p_s.
template <class SplitSum>
inline void matmul_splits(const float* bias, float* c, idx_t ldc, idx_t M, idx_t N, idx_t K,
                          idx_t split, SplitSum split_sum) {
  if (split <= 0 || split >= K) split = K > 0 ? K : 1;
  for (idx_t m = 0; m < M; ++m) {
    for (idx_t n = 0; n < N; ++n) {
      float t = 0.0f;
      idx_t lo = 0;
      do {
        const idx_t hi = K - lo < split ? K : lo + split;
        const float p = split_sum(m, n, lo, hi);
        t = lo == 0 ? p : t + p;
        lo = hi;
      } while (lo < K);
      c[m * ldc + n] = bias ? t + bias[n] : t;
    }
  }
}

template <class T, class Step, class SplitEnd>
inline void matmul_loops(const T* a, idx_t sam, idx_t sak, const T* b, idx_t sbk, idx_t sbn,
                         const float* bias, float* c, idx_t ldc, idx_t M, idx_t N, idx_t K,
                         idx_t split, Step step, SplitEnd split_end) {
  matmul_splits(bias, c, ldc, M, N, K, split, [&](idx_t m, idx_t n, idx_t lo, idx_t hi) {
    float p = 0.0f;
    for (idx_t k = lo; k < hi; ++k) p = step(p, a[m * sam + k * sak], b[k * sbk + n * sbn]);
    return split_end(p, hi - lo);
  });
}

}  // namespace bik_cpu
