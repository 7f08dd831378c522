// bik's real CUDA kernel sources compiled for the CPU (cuda_on_cpu.h's fiber execution model),
// behind one entry point shaped like cuLaunchKernel: run_kernel(name, grid, block, args) where
// args[i] points at the i-th parameter's value. tests/cuda/test_cuda_kernels_host.py routes
// bik.runtime.cuda_jit.launch here, so the real launchers and ops run these kernels on CPU
// tensors. Every matmul, attention, RMSNorm and sampler kernel runs; the 16-bit matmul's
// mma.sync is emulated by cuda_on_cpu.h (fp64 sum, not the tensor core's bits) and its cp.async
// is a synchronous copy; likewise the sm_90a kernels' wgmma (matmul_sm90.cu).
// Built with g++ -std=c++20 -ffp-contract=off.
#include <cstring>
#include <utility>

#include "cuda_on_cpu.h"

#include "../../../csrc/cuda/attention.cu"
#include "../../../csrc/cuda/matmul.cu"
#include "../../../csrc/cuda/matmul_sm90.cu"
#include "../../../csrc/cuda/rms_norm.cu"
#include "../../../csrc/cuda/sampling.cu"

namespace {

template <class... P, std::size_t... I>
void call(void (*f)(P...), void* const* args, std::index_sequence<I...>) {
  f(*static_cast<P*>(args[I])...);
}

template <class... P>
int run(void (*f)(P...), dim3 grid, dim3 block, void* const* args) {
  return host_cuda::launch(grid, block, [=] { call(f, args, std::index_sequence_for<P...>{}); })
             ? 0
             : 2;  // deadlock
}

}  // namespace

extern "C" int run_kernel(const char* name, unsigned gx, unsigned gy, unsigned gz,
                          unsigned bx, void* const* args) {
  const dim3 grid{gx, gy, gz}, block{bx, 1, 1};
#define BIK_HOST_KERNEL(K) \
  if (std::strcmp(name, #K) == 0) return run(K, grid, block, args);
  BIK_HOST_KERNEL(bik_matmul_f32)
  BIK_HOST_KERNEL(bik_matmul_bf16)
  BIK_HOST_KERNEL(bik_matmul_f16)
  BIK_HOST_KERNEL(bik_matmul_reduce)
  BIK_HOST_KERNEL(bik_matmul_sm90_bf16)
  BIK_HOST_KERNEL(bik_matmul_sm90_f16)
  BIK_HOST_KERNEL(bik_attention_f32_d64)
  BIK_HOST_KERNEL(bik_attention_f32_d128)
  BIK_HOST_KERNEL(bik_attention_bf16_d64)
  BIK_HOST_KERNEL(bik_attention_bf16_d128)
  BIK_HOST_KERNEL(bik_attention_f16_d64)
  BIK_HOST_KERNEL(bik_attention_f16_d128)
#define BIK_HOST_RMS_NORM(XN, WN)           \
  BIK_HOST_KERNEL(bik_rms_norm_##XN##_##WN) \
  BIK_HOST_KERNEL(bik_rms_norm_vec_##XN##_##WN)
#define BIK_HOST_RMS_NORM_FOR_X(XN) \
  BIK_HOST_RMS_NORM(XN, f32)        \
  BIK_HOST_RMS_NORM(XN, bf16)       \
  BIK_HOST_RMS_NORM(XN, f16)
  BIK_HOST_RMS_NORM_FOR_X(f32)
  BIK_HOST_RMS_NORM_FOR_X(bf16)
  BIK_HOST_RMS_NORM_FOR_X(f16)
#define BIK_HOST_SAMPLER(TN)           \
  BIK_HOST_KERNEL(bik_sample_group_max_##TN) \
  BIK_HOST_KERNEL(bik_sample_pass_##TN)      \
  BIK_HOST_KERNEL(bik_gumbel_pick_##TN)
  BIK_HOST_SAMPLER(f32)
  BIK_HOST_SAMPLER(bf16)
  BIK_HOST_SAMPLER(f16)
#undef BIK_HOST_SAMPLER
#undef BIK_HOST_RMS_NORM_FOR_X
#undef BIK_HOST_RMS_NORM
#undef BIK_HOST_KERNEL
  return 1;  // unknown kernel
}
