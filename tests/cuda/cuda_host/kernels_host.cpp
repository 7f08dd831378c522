// bik's real CUDA kernel sources compiled for the CPU (cuda_on_cpu.h's fiber execution model),
// behind one entry point shaped like cuLaunchKernel: run_kernel(name, grid, block, args) where
// args[i] points at the i-th parameter's value. tests/cuda/test_cuda_kernels_host.py routes
// bik.runtime.cuda_jit.launch here, so the real launchers and ops run these kernels on CPU
// tensors. Every matmul, attention, RMSNorm and sampler kernel runs; the 16-bit matmul's
// mma.sync is emulated by cuda_on_cpu.h (fp64 sum, not the tensor core's bits) and its cp.async
// is a synchronous copy; likewise the sm_90a kernels' wgmma (matmul_sm90.cu).
// Built with g++ -std=c++20 -ffp-contract=off and -DBIK_HOST_KERNELS(X)=X(name) ... listing the
// kernels the launchers declare (KERNELS in python/bik/ops/*/cuda.py): a declared name the
// sources lack does not compile. kernel_kinds(name) gives the compiled parameter kinds, which
// tests/cuda/test_cuda_kernel_decls.py compares with each declaration.
#include <cstring>
#include <type_traits>
#include <utility>

#include "cuda_on_cpu.h"

#include "../../../csrc/cuda/attention.cu"
#include "../../../csrc/cuda/matmul.cu"
#include "../../../csrc/cuda/matmul_sm90.cu"
#include "../../../csrc/cuda/rms_norm.cu"
#include "../../../csrc/cuda/sampling.cu"

#ifndef BIK_HOST_KERNELS
#error "build with -DBIK_HOST_KERNELS(X)=X(name) ... (tests/cuda/cuda_host_build.py, from KERNELS)"
#endif

namespace {

// The kind of a kernel parameter as the declarations spell it: p(ointer), i(nt32), l (int64),
// f(loat32); '?' for anything else (which no declaration matches).
template <class T>
constexpr char kind_of() {
  if constexpr (std::is_pointer_v<T>) return 'p';
  else if constexpr (std::is_same_v<T, float>) return 'f';
  else if constexpr (std::is_integral_v<T> && std::is_signed_v<T> && sizeof(T) == 4) return 'i';
  else if constexpr (std::is_integral_v<T> && std::is_signed_v<T> && sizeof(T) == 8) return 'l';
  else return '?';
}

template <class... P>
const char* kinds(void (*)(P...)) {
  static const char text[] = {kind_of<P>()..., '\0'};
  return text;
}

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
  BIK_HOST_KERNELS(BIK_HOST_KERNEL)
#undef BIK_HOST_KERNEL
  return 1;  // unknown kernel
}

// The parameter kinds of a declared kernel's compiled signature ("pplf..."), or null.
extern "C" const char* kernel_kinds(const char* name) {
#define BIK_HOST_KINDS(K) \
  if (std::strcmp(name, #K) == 0) return kinds(K);
  BIK_HOST_KERNELS(BIK_HOST_KINDS)
#undef BIK_HOST_KINDS
  return nullptr;
}
