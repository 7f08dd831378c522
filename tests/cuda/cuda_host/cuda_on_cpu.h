// A minimal CUDA execution model on the CPU, for running bik's real kernel sources
// (csrc/cuda/*.cu) in the CPU tests. One CTA at a time; each of its threads is a fiber
// (ucontext) on the calling OS thread, run round-robin until it reaches a barrier, so a CTA of
// 256 threads costs no OS threads and each barrier is a few context switches.
// __shared__ becomes a function-local static (one copy, shared by the CTA's threads);
// __syncthreads / __syncwarp wait for every thread of the CTA / warp; warp shuffles go through a
// per-warp buffer between two warp barriers. A barrier that can never complete (some threads
// returned while others wait, a divergent __syncthreads) aborts the launch with an error
// instead of hanging. Only 1-D blocks and full-warp shuffles (all bik kernels need).
// Inline PTX (mma, cp.async, cvt) is compiled out on the host by the kernels' own #ifs.
#pragma once

#include <ucontext.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};

inline dim3 threadIdx;  // the running fiber's (set by the scheduler at every switch)
inline dim3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;

namespace host_cuda {

struct Barrier {
  unsigned size = 0, arrived = 0, generation = 0;
};

struct Fiber {
  ucontext_t ctx;
  bool done = false;
  Barrier* waiting = nullptr;  // the barrier it waits at (nullptr: runnable)
  unsigned generation = 0;
};

inline ucontext_t scheduler_ctx;
inline std::vector<Fiber> fibers;
inline std::vector<std::unique_ptr<char[]>> stacks;  // reused across CTAs and launches
inline unsigned current = 0;
inline Barrier cta_barrier;
inline std::vector<Barrier> warp_barriers;
inline std::vector<float> shuffle_buffer;  // 32 floats per warp
inline std::function<void()> kernel_body;
constexpr std::size_t kStack = 64 * 1024;

inline void wait(Barrier& b) {
  Fiber& f = fibers[current];
  const unsigned gen = b.generation;
  if (++b.arrived == b.size) {  // the last one releases everybody
    b.arrived = 0;
    ++b.generation;
    return;
  }
  f.waiting = &b;
  f.generation = gen;
  swapcontext(&f.ctx, &scheduler_ctx);  // resumed once b.generation != gen
}

inline void fiber_main() {
  kernel_body();
  fibers[current].done = true;
  // returning ends the fiber: uc_link brings control back to the scheduler
}

// Run body() as the kernel over grid x block (block.y == block.z == 1), CTAs in order.
// Returns false if a CTA deadlocked on a barrier.
inline bool launch(dim3 grid, dim3 block, std::function<void()> body) {
  gridDim = grid;
  blockDim = block;
  kernel_body = std::move(body);
  const unsigned n = block.x;
  const unsigned warps = (n + 31) / 32;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        blockIdx = dim3{x, y, z};
        cta_barrier = Barrier{n, 0, 0};
        warp_barriers.assign(warps, Barrier{});
        for (unsigned w = 0; w < warps; ++w)
          warp_barriers[w].size = n - 32 * w < 32 ? n - 32 * w : 32;
        shuffle_buffer.assign(32 * warps, 0.0f);
        fibers.clear();
        fibers.resize(n);
        while (stacks.size() < n) stacks.emplace_back(new char[kStack]);
        for (unsigned t = 0; t < n; ++t) {
          Fiber& f = fibers[t];
          getcontext(&f.ctx);
          f.ctx.uc_stack.ss_sp = stacks[t].get();
          f.ctx.uc_stack.ss_size = kStack;
          f.ctx.uc_link = &scheduler_ctx;
          makecontext(&f.ctx, fiber_main, 0);
        }
        unsigned finished = 0;
        while (finished < n) {
          bool progressed = false;
          finished = 0;
          for (unsigned t = 0; t < n; ++t) {
            Fiber& f = fibers[t];
            if (f.done) {
              ++finished;
              continue;
            }
            if (f.waiting && f.waiting->generation == f.generation) continue;  // still blocked
            f.waiting = nullptr;
            current = t;
            threadIdx = dim3{t, 0, 0};
            swapcontext(&scheduler_ctx, &f.ctx);
            progressed = true;
          }
          if (!progressed && finished < n) {
            std::fprintf(stderr, "host_cuda: deadlock in CTA (%u, %u, %u)\n", x, y, z);
            return false;
          }
        }
      }
  return true;
}

}  // namespace host_cuda

inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}

inline void __syncthreads() { host_cuda::wait(host_cuda::cta_barrier); }
// CTAs run one at a time on one OS thread: a fence orders nothing more, an atomic is a plain
// read-modify-write, and an L2 load is a load.
inline void __threadfence() {}
inline int atomicAdd(int* address, int value) {
  const int old = *address;
  *address = old + value;
  return old;
}
inline float __ldcg(const float* address) { return *address; }
inline void __syncwarp(unsigned = 0xffffffffu) {
  host_cuda::wait(host_cuda::warp_barriers[threadIdx.x / 32]);
}

// Lane l reads lane l + delta of its width-lane segment (its own value past the segment's end).
inline float __shfl_down_sync(unsigned, float v, int delta, int width = 32) {
  const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* buf = &host_cuda::shuffle_buffer[warp * 32];
  buf[lane] = v;
  __syncwarp();
  const unsigned src = lane + static_cast<unsigned>(delta);
  const unsigned seg = lane / static_cast<unsigned>(width);
  const float r = src / static_cast<unsigned>(width) == seg ? buf[src] : v;
  __syncwarp();
  return r;
}

inline float __shfl_xor_sync(unsigned, float v, int lane_mask) {
  const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* buf = &host_cuda::shuffle_buffer[warp * 32];
  buf[lane] = v;
  __syncwarp();
  const float r = buf[lane ^ static_cast<unsigned>(lane_mask)];
  __syncwarp();
  return r;
}

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}: d += A(16x16) B(16x8) for the warp. Each lane
// posts its fragments; after a warp barrier each lane computes its four d elements. Element
// placement restated from the PTX ISA table (independently of csrc/cuda/matmul_plan.cuh):
// A a_i: row g (+8 for i in 2,3,6,7), col 2t + (i & 1) (+8 for i >= 4); B b_i: row 2t + (i & 1)
// (+8 for i >= 2), col g; C c_i: row g (+8 for i >= 2), col 2t + (i & 1); g = lane / 4,
// t = lane % 4; register r holds elements 2r (low half) and 2r + 1. The sum is taken in double
// and rounded once: not the tensor core's bits, but the same function for every row.
namespace host_cuda {
inline std::vector<unsigned> mma_a, mma_b;
inline float half_to_float(unsigned short h, bool bf16) {
  if (bf16) return __uint_as_float(static_cast<unsigned>(h) << 16);
  _Float16 x;
  std::memcpy(&x, &h, 2);
  return static_cast<float>(x);
}
inline float mma_elem(const std::vector<unsigned>& regs, int per_lane, int lane, int i,
                      unsigned base, bool bf16) {
  const unsigned w = regs[base + static_cast<unsigned>(lane * per_lane + i / 2)];
  return half_to_float(static_cast<unsigned short>(i & 1 ? w >> 16 : w & 0xffffu), bf16);
}
}  // namespace host_cuda

inline void host_cuda_mma_m16n8k16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                                   bool bf16) {
  using namespace host_cuda;
  const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const unsigned warps = (blockDim.x + 31) / 32;
  if (mma_a.size() < 128 * warps) mma_a.assign(128 * warps, 0);  // same size for every lane
  if (mma_b.size() < 64 * warps) mma_b.assign(64 * warps, 0);
  for (int r = 0; r < 4; ++r) mma_a[warp * 128 + lane * 4 + r] = a[r];
  for (int r = 0; r < 2; ++r) mma_b[warp * 64 + lane * 2 + r] = b[r];
  __syncwarp();
  // Who holds A(row, k) and B(k, col): the table above, inverted.
  auto a_at = [&](int row, int k) {
    const int l = (row % 8) * 4 + (k % 8) / 2;
    return mma_elem(mma_a, 4, l, (k & 1) + (row >= 8 ? 2 : 0) + (k >= 8 ? 4 : 0), warp * 128, bf16);
  };
  auto b_at = [&](int k, int col) {
    const int l = col * 4 + (k % 8) / 2;
    return mma_elem(mma_b, 2, l, (k & 1) + (k >= 8 ? 2 : 0), warp * 64, bf16);
  };
  const int g = static_cast<int>(lane) / 4, t = static_cast<int>(lane) % 4;
  for (int e = 0; e < 4; ++e) {
    const int row = g + (e >= 2 ? 8 : 0), col = 2 * t + (e & 1);
    double sum = d[e];
    for (int k = 0; k < 16; ++k)
      sum += static_cast<double>(a_at(row, k)) * static_cast<double>(b_at(k, col));
    d[e] = static_cast<float>(sum);
  }
  __syncwarp();  // everybody has read the fragments before they are posted again
}


// wgmma.mma_async.sync.aligned.m64n128k16.f32.{bf16,f16} with A and B in shared memory, both
// K-major, no swizzle: d += A(64x16) B(16x128) for the warpgroup (threads 128 w ... 128 w + 127).
// Restated from the PTX ISA independently of csrc/cuda/matmul_sm90_plan.cuh: a matrix
// descriptor holds the start address >> 4 in bits 0-13, the leading-dimension byte offset >> 4
// (between core matrices adjacent in K) in bits 16-29, the stride-dimension byte offset >> 4
// (between core matrices adjacent in M or N) in bits 32-45, the swizzle mode in bits 62-63; a
// core matrix is 8 rows of 16 contiguous bytes. Accumulator float i of thread t (warp w = t / 32
// of the group, lane l) is D(16 w + l / 4 + 8 ((i / 2) % 2), 8 (i / 4) + 2 (l % 4) + i % 2).
// Addresses are byte offsets from smem_base (the host has no shared window). Every operand is
// in shared memory, so each thread computes its own 64 floats with no exchange; the sum is
// taken in double and rounded once (not the tensor core's bits, the same function for every
// row).
namespace host_cuda {
inline float wgmma_operand(const void* smem_base, unsigned long long desc, int r, int k,
                           bool bf16) {
  if ((desc >> 62) != 0 || ((desc >> 49) & 7u) != 0) {
    std::fprintf(stderr, "host_cuda: only no-swizzle wgmma descriptors are emulated\n");
    std::abort();
  }
  const unsigned start = static_cast<unsigned>(desc & 0x3FFFu) << 4;
  const unsigned lbo = static_cast<unsigned>((desc >> 16) & 0x3FFFu) << 4;
  const unsigned sbo = static_cast<unsigned>((desc >> 32) & 0x3FFFu) << 4;
  const unsigned off = start + static_cast<unsigned>(r / 8) * sbo +
                       static_cast<unsigned>(r % 8) * 16 + static_cast<unsigned>(k / 8) * lbo +
                       static_cast<unsigned>(k % 8) * 2;
  unsigned short h;
  std::memcpy(&h, static_cast<const char*>(smem_base) + off, 2);
  return half_to_float(h, bf16);
}
}  // namespace host_cuda

inline void host_cuda_wgmma_m64n128k16(float (&d)[64], unsigned long long desc_a,
                                       unsigned long long desc_b, const void* smem_base,
                                       bool bf16) {
  using namespace host_cuda;
  const int t = static_cast<int>(threadIdx.x % 128), w = t / 32, l = t % 32;
  for (int i = 0; i < 64; ++i) {
    const int row = 16 * w + l / 4 + 8 * ((i / 2) % 2), col = 8 * (i / 4) + 2 * (l % 4) + i % 2;
    double sum = d[i];
    for (int k = 0; k < 16; ++k)
      sum += static_cast<double>(wgmma_operand(smem_base, desc_a, row, k, bf16)) *
             static_cast<double>(wgmma_operand(smem_base, desc_b, col, k, bf16));
    d[i] = static_cast<float>(sum);
  }
}
