// bik's CPU products at torch's dispatcher, in C++ (torch.ops.bik_native). A one-row product's
// kernel takes about a microsecond; a Python kernel at the dispatcher costs ~15 us around it
// (bik bench boundary), and a model's decode step is mostly such calls. Three users:
//
// * bik.enable() (mode/_enable.py) installs kernels for aten::mm, addmm, bmm, silu, mean.dim and
//   _softmax at the CPU key. Each serves the calls it can be sure bik's handler would serve (served dtypes,
//   the shapes torch accepts, nonempty, no dispatch mode to observe the call) and hands every
//   other call to the Python kernel bik.enable() registered on bik_native_py::<op> (aten's
//   schema), which serves it or gives it to the original kernel, with torch's own errors.
// * batch_invariant_mode() under torch.compile with grad off (ops/_call.py) puts
//   bik_native::matmul / bik_native::bmm in the graph: bik::matmul / bik::bmm on the CPU backend
//   without their Python impl and autograd wrapper; any call they do not serve is bik's op.
// * the public functions' direct route (ops/_call.py) once the kernels are loaded: matmul / bmm
//   as a Python module's functions (PYBIND11_MODULE below), without the dispatcher.
//
// layers.h adds RMSNorm, paged attention and the KV cache write for the compiled mode's graphs
// and the direct route; rope.h the vLLM plugin's RoPE; moe.h bik.moe's experts and softmax
// routers in one call each.
//
// Both run bik's fixed-order CPU matmul through the entry point bik._cpu_kernels runs (handed
// over by address: one copy of the kernel in the process, c_abi.h), so the bits are the Python
// route's. Built against the installed torch at first use (bik/runtime/native_ext.py).
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/util/Exception.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <memory>
#include <mutex>

#include "c_abi.h"
#include "layers.h"
#include "rope.h"

namespace {

using at::Tensor;

enum Op { kMm, kAddmm, kBmm, kSilu, kMean, kSoftmax, kOps };

BikMatmulF32Fn g_matmul = nullptr;
BikReduceRowsFn g_reduce_rows = nullptr;  // set with g_matmul
BikMatmulSplitRule g_split_rule{};  // set with g_matmul
bool g_bf16_dot = false;  // bf16 products on contract.h's bf16 dot sequence (set with g_matmul)
// mm / addmm on its bf16 AMX sequence instead, bmm never (set with g_matmul)
bool g_bf16_amx = false;
bool g_fp32_fma = false;  // the other products on its fp32 fma sequence (set with g_matmul)
std::mutex g_switch;
std::unique_ptr<torch::Library> g_library;  // while installed: the aten overrides
std::array<std::atomic<int64_t>, kOps> g_served{};
// Set while this thread is inside the Python kernel these kernels handed a call to: an aten
// mm / addmm / bmm made there goes to Python too, whose guard sends it to the original kernel.
// (Calls made inside bik's other Python handlers are served here; none makes one today.)
thread_local bool t_in_python = false;

struct InPython {
  bool previous = t_in_python;
  InPython() { t_in_python = true; }
  ~InPython() { t_in_python = previous; }
};

const c10::DispatchKeySet kCpu(c10::DispatchKey::CPU);

// A thread with no dispatch mode on: a mode (a tracer, a user's) must see bik's own ops, which
// the Python route gives it.
bool unobserved() { return !t_in_python && c10::impl::TorchDispatchModeTLS::stack_len() == 0; }

bool served_dtype(c10::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

bool plain(const Tensor& t) { return t.is_cpu() && !t.is_neg() && served_dtype(t.scalar_type()); }

// a [.., M, K] @ b [.., K, N] that torch accepts and bik serves, every size > 0 (empty products
// are rare; the Python route handles them).
bool product_served(const Tensor& a, const Tensor& b, int64_t rank) {
  if (a.dim() != rank || b.dim() != rank || !plain(a) || !plain(b)) return false;
  if (a.scalar_type() != b.scalar_type() || a.size(-1) != b.size(-2)) return false;
  if (rank == 3 && a.size(0) != b.size(0)) return false;
  return a.numel() > 0 && b.numel() > 0;
}

bool is_one(const c10::Scalar& s) {
  if (s.isFloatingPoint()) return s.toDouble() == 1.0;
  if (s.isIntegral(/*includeBool=*/false)) return s.toLong() == 1;
  return false;  // bool or complex: the Python route decides
}

// What bik's CPU launcher does (ops/matmul/cpu.py): bf16 a and b on the bf16 dot path when the
// process takes it (both read as bf16); else rows and bias widened to fp32 (exact), a bf16 b read
// as bf16 by the kernel, fp16 b widened first; one fp32 product; rounded once to a's dtype.
Tensor product(const Tensor& a, const Tensor& b, const Tensor* bias) {
  const bool batched = a.dim() == 3;
  const int64_t B = batched ? a.size(0) : 1, M = a.size(-2), K = a.size(-1), N = b.size(-1);
  const auto dtype = a.scalar_type();
  const bool f32 = dtype == at::kFloat;
  // Each skipped call (a no-op .to(), a dispatched empty) is ~0.3 us on a ~1 us product.
  const bool b_bf16 = dtype == at::kBFloat16;
  const bool dot = b_bf16 && g_bf16_dot;
  const Tensor a32 = f32 || dot ? a : a.to(at::kFloat);
  const Tensor bk = dtype == at::kHalf ? b.to(at::kFloat) : b;
  Tensor bias32;
  if (bias != nullptr) {
    bias32 = bias->dim() == 1 ? *bias : bias->reshape({N});
    if (!f32) bias32 = bias32.to(at::kFloat);
    if (!bias32.is_contiguous()) bias32 = bias32.contiguous();
  }
  // bf16 results are rounded by the kernel as .to() rounds them (c_bf16), fp16 ones after
  const auto out_dtype = b_bf16 ? at::kBFloat16 : at::kFloat;
  Tensor out(batched ? at::detail::empty_cpu({B, M, N}, out_dtype)
                     : at::detail::empty_cpu({M, N}, out_dtype));
  BikMatmulF32Args args{};
  args.a = a32.const_data_ptr();
  args.sam = a32.stride(-2);
  args.sak = a32.stride(-1);
  args.b = bk.const_data_ptr();
  args.sbk = bk.stride(-2);
  args.sbn = bk.stride(-1);
  args.bias = bias != nullptr ? bias32.const_data_ptr<float>() : nullptr;
  args.c = static_cast<float*>(out.mutable_data_ptr());
  args.c_bf16 = b_bf16;
  args.ldc = N;
  args.M = M;
  args.N = N;
  args.K = K;
  args.batch = B;
  args.sab = batched ? a32.stride(0) : 0;
  args.sbb = batched ? bk.stride(0) : 0;
  args.scb = M * N;
  args.num_threads = at::get_num_threads();
  args.b_bf16 = b_bf16;
  args.a_bf16 = dot;
  // bmm stays on the dot sequence (cpu_ext.bf16_bmm_kernel says why), 2-D products take AMX
  args.bf16_amx = dot && g_bf16_amx && !batched;
  args.fp32_fma = g_fp32_fma;
  TORCH_CHECK(g_matmul != nullptr, "bik: its CPU matmul kernel was not handed over "
              "(torch.ops.bik_native.set_cpu_kernels; bik.mode._native does it)");
  args.split = bik_matmul_split_len(K, &g_split_rule);  // set with g_matmul (nonzero)
  const int rc = g_matmul(&args);
  TORCH_CHECK(rc == 0, "bik.enable(): bik's CPU matmul kernel failed (code ", rc, ")");
  return out.scalar_type() == dtype ? out : out.to(dtype);
}

template <class Signature>
c10::TypedOperatorHandle<Signature> python_kernel(const char* name, const char* overload = "") {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, overload).typed<Signature>();
}

using MmSig = Tensor(const Tensor&, const Tensor&);
using AddmmSig = Tensor(const Tensor&, const Tensor&, const Tensor&, const c10::Scalar&,
                        const c10::Scalar&);

Tensor mm(c10::DispatchKeySet, const Tensor& a, const Tensor& b) {
  if (unobserved() && product_served(a, b, 2)) {
    g_served[kMm].fetch_add(1, std::memory_order_relaxed);
    return product(a, b, nullptr);
  }
  static const auto python = python_kernel<MmSig>("bik_native_py::mm");
  InPython guard;
  return python.redispatch(kCpu, a, b);
}

Tensor bmm(c10::DispatchKeySet, const Tensor& a, const Tensor& b) {
  if (unobserved() && product_served(a, b, 3)) {
    g_served[kBmm].fetch_add(1, std::memory_order_relaxed);
    return product(a, b, nullptr);
  }
  static const auto python = python_kernel<MmSig>("bik_native_py::bmm");
  InPython guard;
  return python.redispatch(kCpu, a, b);
}

// addmm with beta = alpha = 1 and a bias row [N] or [1, N]: F.linear's decomposition.
Tensor addmm(c10::DispatchKeySet, const Tensor& bias, const Tensor& a, const Tensor& b,
             const c10::Scalar& beta, const c10::Scalar& alpha) {
  const auto bias_row = [&] {
    const int64_t n = b.size(-1);
    return plain(bias) && bias.scalar_type() == a.scalar_type() &&
           ((bias.dim() == 1 && bias.size(0) == n) ||
            (bias.dim() == 2 && bias.size(0) == 1 && bias.size(1) == n));
  };
  if (unobserved() && is_one(beta) && is_one(alpha) && product_served(a, b, 2) && bias_row()) {
    g_served[kAddmm].fetch_add(1, std::memory_order_relaxed);
    return product(a, b, &bias);
  }
  static const auto python = python_kernel<AddmmSig>("bik_native_py::addmm");
  InPython guard;
  return python.redispatch(kCpu, bias, a, b, beta, alpha);
}

// silu(x) = x / (1 + exp(-x)) in fp32, rounded to x's dtype: bik's silu (the Python handler's
// bik.ops._pointwise.silu_f32) without ~15 µs of Python around it. Its rounded steps are the
// handler's: exp is torch's own kernel, run in place on -x (torch.exp's CPU kernel rounds an
// element the same wherever it sits: tests/test_pointwise.py; stock silu's SIMD body and scalar
// tail do not), and the widening, negation, + 1 and division are exact or correctly rounded, so
// the loops around it give the handler's bits with two passes instead of five; the result is
// rounded to x's dtype by torch's conversion, as the handler's.
// Widening, negation, + 1 and division are exact or correctly rounded in every lane width, so
// the loops may run on whatever vectors the CPU has: an AVX-512 build of them where it has it.
#define BIK_SILU_ROWS                                                                        \
  for (int64_t r = 0; r < rows; ++r) {                                                      \
    const T* xr = x + r * sx;                                                               \
    float* yr = y + r * cols;                                                               \
    if (negate) {                                                                           \
      for (int64_t c = 0; c < cols; ++c) yr[c] = -static_cast<float>(xr[c]);               \
    } else { /* y holds exp(-x): y = x / (exp(-x) + 1) */                                   \
      for (int64_t c = 0; c < cols; ++c) yr[c] = static_cast<float>(xr[c]) / (yr[c] + 1.0f); \
    }                                                                                       \
  }

#if defined(__x86_64__)
template <class T>
__attribute__((target("avx512f,avx512bw"), optimize("tree-vectorize"))) void silu_rows_avx512(
    const T* x, int64_t rows, int64_t cols, int64_t sx, float* y, bool negate) {
  BIK_SILU_ROWS
}
#endif

template <class T>
__attribute__((optimize("tree-vectorize"))) void silu_rows_base(const T* x, int64_t rows,
                                                                int64_t cols, int64_t sx,
                                                                float* y, bool negate) {
  BIK_SILU_ROWS
}
#undef BIK_SILU_ROWS

template <class T>
void silu_rows(const T* x, int64_t rows, int64_t cols, int64_t sx, float* y, bool negate) {
#if defined(__x86_64__)
  static const bool avx512 =
      __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  if (avx512) return silu_rows_avx512(x, rows, cols, sx, y, negate);
#endif
  silu_rows_base(x, rows, cols, sx, y, negate);
}

Tensor silu(c10::DispatchKeySet, const Tensor& x) {
  // Rows of unit stride (a contiguous x, or vLLM's x[..., :d] of its gate-and-up output): the
  // loops; any other layout: the handler's ops in C++.
  const bool flat = x.is_contiguous();
  const bool rows2d = x.dim() == 2 && x.size(1) > 1 && x.stride(1) == 1 &&
                      x.stride(0) >= x.size(1);
  if (unobserved() && plain(x) && (flat || rows2d)) {
    g_served[kSilu].fetch_add(1, std::memory_order_relaxed);
    const int64_t rows = flat ? 1 : x.size(0), cols = flat ? x.numel() : x.size(1);
    const int64_t sx = flat ? cols : x.stride(0);
    Tensor y = at::detail::empty_cpu(x.sizes(), at::kFloat);
    float* yp = y.mutable_data_ptr<float>();
    for (const bool negate : {true, false}) {
      if (!negate) y.exp_();  // torch's exp of -x, in place
      switch (x.scalar_type()) {
        case at::kFloat: silu_rows(x.const_data_ptr<float>(), rows, cols, sx, yp, negate); break;
        case at::kBFloat16:
          silu_rows(x.const_data_ptr<c10::BFloat16>(), rows, cols, sx, yp, negate);
          break;
        default: silu_rows(x.const_data_ptr<c10::Half>(), rows, cols, sx, yp, negate); break;
      }
    }
    return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
  }
  if (unobserved() && plain(x)) {
    g_served[kSilu].fetch_add(1, std::memory_order_relaxed);
    const bool f32 = x.scalar_type() == at::kFloat;
    const Tensor x32 = f32 ? x : x.to(at::kFloat);
    Tensor d = at::neg(x32);  // a fresh tensor: the next two steps run in place on it
    d.exp_();
    d.add_(1);
    const Tensor y = at::div(x32, d);
    return f32 ? y : y.to(x.scalar_type());
  }
  static const auto python = python_kernel<Tensor(const Tensor&)>("bik_native_py::silu");
  InPython guard;
  return python.redispatch(kCpu, x);
}

// The rows of x along its last dim as fp32 [rows, n] with unit stride along n (exact copies where
// needed), as bik's mean / softmax launchers read them.
Tensor fp32_rows(const Tensor& x) {
  const int64_t n = x.size(-1);
  Tensor rows = (x.scalar_type() == at::kFloat ? x : x.to(at::kFloat)).reshape({-1, n});
  return n <= 1 || rows.stride(1) == 1 ? rows : rows.contiguous();
}

// bik's softmax (op 0) or mean (op 1) of x's rows along its last dim, fp32 [rows, n] / [rows].
Tensor reduce_last(const Tensor& x, int32_t op) {
  TORCH_CHECK(g_reduce_rows != nullptr, "bik.enable(): bik's CPU reductions were not handed over");
  const Tensor rows = fp32_rows(x);
  const int64_t M = rows.size(0), N = rows.size(1);
  Tensor out = op == 0 ? at::detail::empty_cpu({M, N}, at::kFloat)
                       : at::detail::empty_cpu({M}, at::kFloat);
  BikReduceRowsArgs a{rows.const_data_ptr<float>(), rows.stride(0), out.mutable_data_ptr<float>(),
                      N, M, N, op, static_cast<int32_t>(at::get_num_threads())};
  const int rc = g_reduce_rows(&a);
  TORCH_CHECK(rc == 0, "bik.enable(): bik's CPU reduction failed (code ", rc, ")");
  return out;
}

// x's last dim, given as d (wrapped), and a call on a nonempty x of a served dtype.
bool last_dim_served(const Tensor& x, int64_t d) {
  return unobserved() && plain(x) && x.dim() >= 1 && x.numel() > 0 &&
         (d == x.dim() - 1 || d == -1);
}

// mean over the last dim (RMSNorm as transformers writes it): bik.mean's bits (its launcher's
// kernel on the same fp32 rows, rounded once to x's dtype), without the Python handler.
Tensor mean_dim(c10::DispatchKeySet, const Tensor& x, at::OptionalIntArrayRef dim, bool keepdim,
                std::optional<c10::ScalarType> dtype) {
  if (!dtype && dim && dim->size() == 1 && last_dim_served(x, (*dim)[0])) {
    g_served[kMean].fetch_add(1, std::memory_order_relaxed);
    Tensor out = reduce_last(x, 1);
    if (x.scalar_type() != at::kFloat) out = out.to(x.scalar_type());
    auto shape = x.sizes().vec();
    if (keepdim)
      shape.back() = 1;
    else
      shape.pop_back();
    return out.reshape(shape);
  }
  static const auto python = python_kernel<Tensor(const Tensor&, at::OptionalIntArrayRef, bool,
                                                  std::optional<c10::ScalarType>)>(
      "bik_native_py::mean", "dim");
  InPython guard;
  return python.redispatch(kCpu, x, dim, keepdim, dtype);
}

// softmax over the last dim (eager attention's): bik.softmax's bits, in x's dtype.
Tensor softmax(c10::DispatchKeySet, const Tensor& x, int64_t dim, bool half_to_float) {
  if (!half_to_float && last_dim_served(x, dim)) {
    g_served[kSoftmax].fetch_add(1, std::memory_order_relaxed);
    Tensor out = reduce_last(x, 0);
    if (x.scalar_type() != at::kFloat) out = out.to(x.scalar_type());
    return out.reshape(x.sizes());
  }
  static const auto python =
      python_kernel<Tensor(const Tensor&, int64_t, bool)>("bik_native_py::_softmax");
  InPython guard;
  return python.redispatch(kCpu, x, dim, half_to_float);
}

// ---- the compiled mode's ops -------------------------------------------------------------------

bool same_dtype_row(const std::optional<Tensor>& bias, const Tensor& a, int64_t n) {
  return !bias || (plain(*bias) && bias->scalar_type() == a.scalar_type() && bias->dim() == 1 &&
                   bias->size(0) == n);
}

bool keeps_dtype(std::optional<c10::ScalarType> out_dtype, const Tensor& a) {
  return !out_dtype || *out_dtype == a.scalar_type();
}

Tensor compiled_matmul(const Tensor& a, const Tensor& b, const std::optional<Tensor>& bias,
                       std::optional<c10::ScalarType> out_dtype) {
  if (product_served(a, b, 2) && keeps_dtype(out_dtype, a) && same_dtype_row(bias, a, b.size(1)))
    return product(a, b, bias ? &*bias : nullptr);
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("bik::matmul", "").typed<Tensor(
          const Tensor&, const Tensor&, const std::optional<Tensor>&,
          std::optional<c10::ScalarType>, c10::string_view)>();
  return op.call(a, b, bias, out_dtype, "cpu");
}

Tensor compiled_bmm(const Tensor& a, const Tensor& b, std::optional<c10::ScalarType> out_dtype) {
  if (product_served(a, b, 3) && keeps_dtype(out_dtype, a)) return product(a, b, nullptr);
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("bik::bmm", "").typed<Tensor(
          const Tensor&, const Tensor&, std::optional<c10::ScalarType>, c10::string_view)>();
  return op.call(a, b, out_dtype, "cpu");
}

// One product of rows a [M, k] (unit-stride or strided rows, bf16 on the dot path, else fp32)
// with the panels at `panels` (bik.PackedWeight's: `split` and `dot` as packed) into c, rows of
// ldc elements of c's dtype (bf16 rounded by the kernel as .to() rounds), + bias32 (fp32 [n]).
void packed_product(const Tensor& a, int64_t panels, int64_t n, int64_t k, int64_t split,
                    bool dot, void* c, bool c_bf16, int64_t ldc, const float* bias32,
                    const char* who) {
  BikMatmulF32Args args{};
  args.a = a.const_data_ptr();
  args.sam = a.stride(0);
  args.sak = a.stride(1);
  args.bias = bias32;
  args.c = static_cast<float*>(c);
  args.c_bf16 = c_bf16;
  args.ldc = ldc;
  args.M = a.size(0);
  args.N = n;
  args.K = k;
  args.batch = 1;
  args.split = split;
  args.num_threads = at::get_num_threads();
  args.b_bf16 = dot;
  args.a_bf16 = dot;
  args.bf16_amx = dot && g_bf16_amx;
  args.fp32_fma = g_fp32_fma;
  args.packed = reinterpret_cast<const void*>(panels);
  const int rc = g_matmul(&args);
  TORCH_CHECK(rc == 0, who, ": bik's CPU matmul kernel failed (code ", rc, ")");
}

// bik.PackedWeight's product (ops/matmul/packed.py) without its Python: rows of x [..., K] times
// the panels at `panels` (packed for this process's CPU path, `split` and `dot` as packed: the
// bf16 dot path's pair words for bf16 x, fp32 panels for fp32 x), + bias, rounded once to x's
// dtype: the same kernel call as the Python route, so the same bits. nullopt for anything else
// (another dtype, an empty product, a bias of another shape): the Python route then serves or
// refuses it with its own message.
std::optional<Tensor> packed_linear(const Tensor& x, const std::optional<Tensor>& bias,
                                    int64_t panels, int64_t n, int64_t k, int64_t split,
                                    bool dot) {
  const auto dtype = x.scalar_type();
  if (g_matmul == nullptr || panels == 0 || !x.is_cpu() || x.is_neg() || x.dim() < 1 ||
      x.size(-1) != k || n <= 0 || k <= 0 || x.numel() == 0 ||
      dtype != (dot ? at::kBFloat16 : at::kFloat))
    return std::nullopt;
  if (bias && !(bias->is_cpu() && !bias->is_neg() && bias->dim() == 1 && bias->size(0) == n &&
                served_dtype(bias->scalar_type())))
    return std::nullopt;
  const int64_t rows = x.numel() / k;
  const Tensor a = x.dim() == 2 ? x : x.reshape({rows, k});
  Tensor bias32;
  if (bias) bias32 = bias->to(at::kFloat).contiguous();
  Tensor out = at::detail::empty_cpu({rows, n}, dtype);  // bf16: rounded by the kernel
  packed_product(a, panels, n, k, split, dot, out.mutable_data_ptr(), dtype == at::kBFloat16, n,
                 bias ? bias32.const_data_ptr<float>() : nullptr, "bik.PackedWeight");
  if (x.dim() == 2) return out;
  auto shape = x.sizes().vec();
  shape.back() = n;
  return out.view(shape);
}

#include "moe.h"  // bik.moe's layers, on the products, SiLU and reductions above

// ---- control -----------------------------------------------------------------------------------

// entries: bik._cpu_kernels' c_abi.h entry points [matmul_f32, rms_norm, attention_paged,
// write_kv_rows, reduce_rows];
// split_rule: bik.configs.matmul_split's constants (tp_max, group_align, split,
// one_split_max_k, none), so these kernels pick the splits bik's Python launcher picks;
// attention_split: bik.configs.CPU_ATTENTION_SPLIT; bf16_dot: bik.runtime.cpu_ext.bf16_dot(), so
// they take the bf16 path it takes, and bf16_amx: its 2-D products' kernel is AMX's
// (cpu_ext.bf16_kernel(); bmm keeps the dot sequence, cpu_ext.bf16_bmm_kernel());
// fp32_fma: bik.runtime.cpu_ext.fp32_fma(), the fp32
// sequence the other products take; debug_checks: BIK_DEBUG_CHECKS as bik read it (attention
// then leaves every call to bik's op, which reads the lengths).
void set_cpu_kernels(c10::ArrayRef<int64_t> entries, int64_t abi_version,
                     c10::ArrayRef<int64_t> split_rule, int64_t attention_split, bool bf16_dot,
                     bool bf16_amx, bool fp32_fma, bool debug_checks) {
  TORCH_CHECK(abi_version == BIK_C_ABI_VERSION, "bik: bik._cpu_kernels has C ABI ", abi_version,
              ", its dispatcher kernels expect ", BIK_C_ABI_VERSION, " (rebuild bik)");
  TORCH_CHECK(entries.size() == 5 &&
                  std::all_of(entries.begin(), entries.end(), [](int64_t e) { return e != 0; }),
              "bik: set_cpu_kernels needs 5 entry points, got ", entries);
  TORCH_CHECK(split_rule.size() == 5 && split_rule[0] > 0 && split_rule[1] > 0 &&
                  split_rule[2] > 0,
              "bik: set_cpu_kernels needs the 5 matmul split constants, got ", split_rule);
  TORCH_CHECK(attention_split > 0, "bik: set_cpu_kernels needs attention_split > 0");
  g_split_rule = {split_rule[0], split_rule[1], split_rule[2], split_rule[3], split_rule[4]};
  g_bf16_dot = bf16_dot;
  g_bf16_amx = bf16_amx;
  g_fp32_fma = fp32_fma;
  bik_layers::g_attention_split = attention_split;
  bik_layers::g_debug_checks = debug_checks;
  bik_layers::g_rms_norm = reinterpret_cast<BikRmsNormFn>(entries[1]);
  bik_layers::g_attention = reinterpret_cast<BikAttentionPagedFn>(entries[2]);
  bik_layers::g_kv_rows = reinterpret_cast<BikKvRowsFn>(entries[3]);
  g_reduce_rows = reinterpret_cast<BikReduceRowsFn>(entries[4]);
  g_matmul = reinterpret_cast<BikMatmulF32Fn>(entries[0]);
}

// torch warns (to stderr, from C++) when a kernel replaces another; replacing is the point here.
struct Quiet : c10::WarningHandler {
  void process(const c10::Warning&) override {}
};

void install() {
  TORCH_CHECK(g_matmul != nullptr, "bik.enable(): set_cpu_kernels() was not called");
  std::lock_guard<std::mutex> lock(g_switch);
  if (g_library) return;
  for (const char* name : {"bik_native_py::mm", "bik_native_py::addmm", "bik_native_py::bmm",
                           "bik_native_py::silu", "bik_native_py::_softmax"})
    c10::Dispatcher::singleton().findSchemaOrThrow(name, "");  // Python defined them first
  c10::Dispatcher::singleton().findSchemaOrThrow("bik_native_py::mean", "dim");
  Quiet quiet;
  c10::WarningUtils::WarningHandlerGuard guard(&quiet);
  auto library = std::make_unique<torch::Library>(torch::Library::IMPL, "aten",
                                                  c10::DispatchKey::CPU, __FILE__, __LINE__);
  library->impl("mm", TORCH_FN(mm));
  library->impl("addmm", TORCH_FN(addmm));
  library->impl("bmm", TORCH_FN(bmm));
  library->impl("silu", TORCH_FN(silu));
  library->impl("mean.dim", TORCH_FN(mean_dim));
  library->impl("_softmax", TORCH_FN(softmax));
  g_library = std::move(library);
}

void uninstall() {
  std::lock_guard<std::mutex> lock(g_switch);
  g_library.reset();  // the kernels registered before install() are back
}

std::vector<int64_t> served() {
  std::vector<int64_t> counts;
  for (const auto& n : g_served) counts.push_back(n.load(std::memory_order_relaxed));
  return counts;
}

void reset_served() {
  for (auto& n : g_served) n.store(0, std::memory_order_relaxed);
}

}  // namespace

// Control ops, and the compiled mode's products. Nothing is overridden until install().
TORCH_LIBRARY(bik_native, m) {
  m.def("set_cpu_kernels(int[] entries, int abi_version, int[] split_rule, int attention_split, "
        "bool bf16_dot, bool bf16_amx, bool fp32_fma, bool debug_checks) -> ()",
        &set_cpu_kernels);
  m.def("install() -> ()", &install);
  m.def("uninstall() -> ()", &uninstall);
  // calls served in C++: mm, addmm, bmm, silu, mean.dim, _softmax
  m.def("served() -> int[]", &served);
  m.def("reset_served() -> ()", &reset_served);
  m.def("matmul(Tensor a, Tensor b, Tensor? bias, ScalarType? out_dtype) -> Tensor");
  m.def("bmm(Tensor a, Tensor b, ScalarType? out_dtype) -> Tensor");
  // layers.h's kernels, bound to the ops Python defines from bik's (bik/ops/_native.py).
  m.def("bind(str op, str kernel) -> ()", &bik_layers::bind);
}

TORCH_LIBRARY_IMPL(bik_native, CPU, m) {
  m.impl("matmul", TORCH_FN(compiled_matmul));
  m.impl("bmm", TORCH_FN(compiled_bmm));
}

// The direct route's entry (bik/ops/_native.py): a call through torch.ops matches its
// arguments against the schema in Python, ~5 us around a ~1 us one-row product; a pybind11
// function with tensor arguments costs ~0.3 us. Same kernels: the bits and the fallback to
// bik::matmul / bik::bmm are the dispatcher op's. The GIL is released around the product (a
// fallback to the Python op takes it back).
PYBIND11_MODULE(bik_native, m) {
  m.def("matmul", &compiled_matmul, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("bmm", &compiled_bmm, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("packed_linear", &packed_linear, pybind11::call_guard<pybind11::gil_scoped_release>());
  // bik.moe's experts and softmax routers in one call each (moe.h): None when not served.
  m.def("moe_experts", &moe_experts, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("moe_route_softmax", &moe_route_softmax,
        pybind11::call_guard<pybind11::gil_scoped_release>());
  // vLLM's RoPE formula in one call (rope.h; the vLLM plugin's rope.py): None when not served.
  m.def(
      "rope",
      [](const Tensor& positions, const Tensor& x, const Tensor& cos_sin, int64_t head_size,
         int64_t rotary_dim, bool neox) -> std::optional<Tensor> {
        Tensor out = bik_layers::rope(positions, x, cos_sin, head_size, rotary_dim, neox);
        return out.defined() ? std::optional<Tensor>(out) : std::nullopt;
      },
      pybind11::call_guard<pybind11::gil_scoped_release>());
}
