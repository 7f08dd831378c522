// bik's RMSNorm (plain and fused with the residual add) and paged attention on the CPU at torch's
// dispatcher, in C++ (included once, by native_cpu.cpp). A decode step calls each about twice
// per layer on one to a few rows, where the kernel takes microseconds and bik's Python front took
// 30 (RMSNorm) to 90 (attention) µs around it. Each kernel serves the calls whose arguments it
// can check here as bik's Python check would pass them, runs bik._cpu_kernels' entry (the same
// kernel as the Python launcher: the same bits) and hands every other call to bik's op, whose
// check names the op and the offending value.
//
// The kernels are boxed: they read a call's arguments from the stack in its schema's order, as
// bik's Python reads an op's record. Python defines each bik_native op from its bik op's schema
// (the backend left out) and binds it to a kernel here (bind below; bik/ops/_native.py), so an
// op's signature is written once, in its define(...).
#pragma once

#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <array>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "c_abi.h"

namespace bik_layers {

using at::Tensor;

inline BikRmsNormFn g_rms_norm = nullptr;
inline BikAttentionPagedFn g_attention = nullptr;
inline BikKvRowsFn g_kv_rows = nullptr;
inline int64_t g_attention_split = 0;  // bik.configs.CPU_ATTENTION_SPLIT, handed over with it
inline bool g_debug_checks = false;   // BIK_DEBUG_CHECKS: bik's op reads the lengths itself

inline bool cpu_real(const Tensor& t) { return t.is_cpu() && !t.is_neg() && !t.is_conj(); }

inline bool unit_rows(const Tensor& t) { return t.size(1) <= 1 || t.stride(1) == 1; }

inline bool float_dtype(const Tensor& t) {
  const auto s = t.scalar_type();
  return s == at::kFloat || s == at::kBFloat16 || s == at::kHalf;
}

// ---- RMSNorm -----------------------------------------------------------------------------------

// x [M, H] fp32 or bf16 with unit-stride rows, H > 0, a weight w [H] of a float dtype, eps as
// bik's check takes it (finite in fp32, >= 0), a residual like x. fp16 rows and every other call
// take bik's op (which widens fp16 in torch).
inline bool norm_served(const Tensor& x, const Tensor& w, double eps, const Tensor* residual) {
  const auto s = x.scalar_type();
  if (!cpu_real(x) || x.dim() != 2 || (s != at::kFloat && s != at::kBFloat16) || !unit_rows(x))
    return false;
  if (!cpu_real(w) || w.dim() != 1 || w.size(0) != x.size(1) || x.size(1) == 0 ||
      !float_dtype(w))
    return false;
  if (!(std::isfinite(eps) && eps >= 0 && eps <= FLT_MAX)) return false;
  return residual == nullptr ||
         (cpu_real(*residual) && residual->scalar_type() == s &&
          residual->sizes() == x.sizes() && unit_rows(*residual));
}

// (y, h): the rows normalised, and with a residual h = x + residual (undefined without).
inline std::tuple<Tensor, Tensor> norm_rows(const Tensor& x, const Tensor& w, double eps,
                                            const Tensor* residual) {
  TORCH_CHECK(g_rms_norm != nullptr, "bik: its CPU RMSNorm kernel was not handed over "
              "(torch.ops.bik_native.set_cpu_kernels)");
  const int64_t M = x.size(0), H = x.size(1);
  const Tensor w32 =
      w.scalar_type() == at::kFloat && w.is_contiguous() ? w : w.to(at::kFloat).contiguous();
  Tensor y = at::detail::empty_cpu({M, H}, x.scalar_type());
  Tensor h = residual ? at::detail::empty_cpu({M, H}, x.scalar_type()) : Tensor();
  BikRmsNormArgs args{};
  args.x = x.const_data_ptr();
  args.sxm = x.stride(0);
  args.residual = residual ? residual->const_data_ptr() : nullptr;
  args.srm = residual ? residual->stride(0) : 0;
  args.w = w32.const_data_ptr<float>();
  args.y = y.mutable_data_ptr();
  args.sym = H;
  args.h = residual ? h.mutable_data_ptr() : nullptr;
  args.shm = H;
  args.M = M;
  args.H = H;
  args.eps = eps;
  args.bf16 = x.scalar_type() == at::kBFloat16;
  args.num_threads = at::get_num_threads();
  const int rc = g_rms_norm(&args);
  TORCH_CHECK(rc == 0, "bik.rms_norm: bik's CPU kernel failed (code ", rc, ")");
  return {y, h};
}

// ---- paged attention ---------------------------------------------------------------------------

inline bool index_vector(const Tensor& t, int64_t length) {
  const auto s = t.scalar_type();
  return t.is_cpu() && t.dim() == 1 && (s == at::kInt || s == at::kLong) &&
         t.size(0) == length && (length <= 1 || t.stride(0) == 1);
}

// The calls bik's check passes with host bounds and a block table, q and the cache fp32 or
// bf16 (the kernel reads bf16 pages in place; fp16 ones are gathered in torch by bik's op).
inline bool attention_served(const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& seqlens, const Tensor& cu_q,
                             const std::optional<Tensor>& table, double scale,
                             std::optional<int64_t> max_q, std::optional<int64_t> max_k) {
  if (g_debug_checks || !table || !max_q || !max_k || !std::isfinite(scale)) return false;
  const auto s = q.scalar_type();
  if (!cpu_real(q) || q.dim() != 3 || (s != at::kFloat && s != at::kBFloat16)) return false;
  if (!cpu_real(k) || !cpu_real(v) || k.dim() != 4 || k.scalar_type() != s ||
      v.scalar_type() != s || k.sizes() != v.sizes() || k.strides() != v.strides())
    return false;
  const int64_t hq = q.size(1), d = q.size(2), hkv = k.size(2);
  if (d < 1 || k.size(3) != d || hkv == 0 || hq % hkv != 0 || k.stride(3) != 1 ||
      q.stride(2) != 1 || k.size(1) == 0)
    return false;
  for (const int64_t st : k.strides())
    if (st < 0) return false;
  const int64_t B = seqlens.dim() == 1 ? seqlens.size(0) : -1;
  if (B < 1 || !index_vector(seqlens, B) || !index_vector(cu_q, B + 1)) return false;
  const Tensor& t = *table;
  const auto ts = t.scalar_type();
  if (!t.is_cpu() || t.dim() != 2 || (ts != at::kInt && ts != at::kLong) || t.size(0) != B ||
      (t.size(1) > 1 && t.stride(1) != 1))
    return false;
  const int64_t capacity = t.size(1) * k.size(1);
  return 0 <= *max_q && *max_q <= *max_k && *max_k <= capacity;
}

// The output of a served call (attention_served).
inline Tensor paged_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& seqlens, const Tensor& cu_q,
                              const std::optional<Tensor>& table, double scale, bool causal,
                              int64_t max_k) {
  TORCH_CHECK(g_attention != nullptr, "bik: its CPU attention kernel was not handed over "
              "(torch.ops.bik_native.set_cpu_kernels)");
  const bool f32 = q.scalar_type() == at::kFloat;
  const Tensor q32 = f32 ? q : q.to(at::kFloat);  // exact; keeps a unit stride along D
  const int64_t total_q = q.size(0), hq = q.size(1), d = q.size(2);
  Tensor out = at::detail::empty_cpu({total_q, hq, d}, at::kFloat);
  Tensor lse = at::detail::empty_cpu({total_q, hq}, at::kFloat);
  int64_t extent = 1;  // elements k's view reaches from its first
  for (int64_t i = 0; i < k.dim(); ++i) extent += (k.size(i) - 1) * k.stride(i);
  std::array<char, 512> error{};
  BikAttentionPagedArgs a{};
  a.q = q32.const_data_ptr<float>();
  a.sq_tok = q32.stride(0);
  a.sq_head = q32.stride(1);
  a.k = k.const_data_ptr();
  a.v = v.const_data_ptr();
  a.k_extent = k.numel() == 0 ? 0 : extent;
  a.num_blocks = k.size(0);
  a.block_size = k.size(1);
  a.s_page = k.stride(0);
  a.s_tok = k.stride(1);
  a.s_head = k.stride(2);
  a.block_table = table->const_data_ptr();
  a.table_cols = table->size(1);
  a.s_table = table->stride(0);
  a.cu_q = cu_q.const_data_ptr();
  a.seqlens_k = seqlens.const_data_ptr();
  a.table_i64 = table->scalar_type() == at::kLong;
  a.cu_q_i64 = cu_q.scalar_type() == at::kLong;
  a.seqlens_i64 = seqlens.scalar_type() == at::kLong;
  a.kv_bf16 = k.scalar_type() == at::kBFloat16;
  a.B = seqlens.size(0);
  a.total_q = total_q;
  a.hq = hq;
  a.hkv = k.size(2);
  a.d = d;
  a.split = g_attention_split;
  a.max_seqlen_k = max_k;
  a.scale_log2e = scale * 1.4426950408889634;  // bik.ops._pointwise.LOG2E, in fp64 as there
  a.causal = causal;
  a.num_threads = at::get_num_threads();
  a.out = out.mutable_data_ptr<float>();
  a.lse = lse.mutable_data_ptr<float>();
  a.error = error.data();
  a.error_size = int64_t(error.size());
  const int rc = g_attention(&a);
  TORCH_CHECK_VALUE(rc != 1, "bik.attention: ", error.data());
  TORCH_CHECK(rc == 0, "bik.attention: bik's CPU kernel failed (code ", rc, ")");
  return f32 ? out : out.to(q.scalar_type());
}

// ---- the KV cache write ------------------------------------------------------------------------

// A cache as pages [P, block, Hkv, D] (a [slots, Hkv, D] one has pages of one token): sizes
// and strides, or false when it is not a cache the copy loop serves.
inline bool cache_pages(const Tensor& c, std::array<int64_t, 4>& size,
                        std::array<int64_t, 4>& stride) {
  if (!c.is_cpu() || (c.dim() != 3 && c.dim() != 4) || c.numel() == 0 || c.stride(-1) != 1)
    return false;
  for (const int64_t st : c.strides())
    if (st < 0) return false;
  const bool flat = c.dim() == 3;
  size = {c.size(0), flat ? 1 : c.size(1), c.size(-2), c.size(-1)};
  stride = {c.stride(0), flat ? 0 : c.stride(1), c.stride(-2), 1};
  return true;
}

// Rows of k and v into their caches without validation (validate=False, no BIK_DEBUG_CHECKS):
// what bik's op does on the CPU, its copy loop; every other call goes to the op.
inline bool kv_write(const Tensor& k_cache, const Tensor& v_cache, const Tensor& k,
                     const Tensor& v, const Tensor& slots, bool validate) {
  if (validate || g_debug_checks || g_kv_rows == nullptr) return false;
  std::array<int64_t, 4> size{}, stride{}, v_size{}, v_stride{};
  if (!cache_pages(k_cache, size, stride) || !cache_pages(v_cache, v_size, v_stride) ||
      k_cache.sizes() != v_cache.sizes() || k_cache.data_ptr() == v_cache.data_ptr())
    return false;
  const auto dtype = k_cache.scalar_type();
  if (!k.is_cpu() || !v.is_cpu() || k.dim() != 3 || k.sizes() != v.sizes() ||
      k.size(1) != size[2] || k.size(2) != size[3] || k.scalar_type() != dtype ||
      v.scalar_type() != dtype || v_cache.scalar_type() != dtype ||
      (k.element_size() != 2 && k.element_size() != 4) || k.stride(2) != 1 ||
      v.stride(2) != 1)
    return false;
  if (!index_vector(slots, k.size(0))) return false;
  for (const auto& [cache, src, sz, st] :
       {std::tuple{&k_cache, &k, size, stride}, std::tuple{&v_cache, &v, v_size, v_stride}}) {
    BikKvRowsArgs a{};
    a.cache = cache->mutable_data_ptr();
    a.c_page = st[0];
    a.c_off = st[1];
    a.c_head = st[2];
    a.block = sz[1];
    a.n_slots = sz[0] * sz[1];
    a.src = src->const_data_ptr();
    a.s_tok = src->stride(0);
    a.s_head = src->stride(1);
    a.tokens = src->size(0);
    a.hkv = sz[2];
    a.d = sz[3];
    a.elem = src->element_size();
    a.slots = slots.const_data_ptr();
    a.slots_i64 = slots.scalar_type() == at::kLong;
    TORCH_CHECK(g_kv_rows(&a) == 0, "bik.write_kv_cache: bik's CPU copy loop refused its sizes");
  }
  return true;
}

// ---- boxed kernels, bound to the ops Python defines ---------------------------------------------

// A call a kernel does not serve: bik's op of the same name on the CPU backend, its "backend"
// argument inserted where its schema has it.
inline void to_bik_op(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& name = op.schema().name();  // "bik_native::<op>"
  const auto bik = c10::Dispatcher::singleton().findSchemaOrThrow(
      ("bik::" + name.substr(name.find("::") + 2)).c_str(), "");
  const auto& args = bik.schema().arguments();
  const size_t n = op.schema().arguments().size();
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i].name() == "backend") {
      stack->insert(stack->end() - static_cast<std::ptrdiff_t>(n - i), c10::IValue("cpu"));
      break;
    }
  }
  bik.callBoxed(stack);
}

// bik::rms_norm's arguments (x, weight, eps) -> y, or bik::fused_add_rms_norm's (+ residual)
// -> (y, h), without the backend.
inline void boxed_norm(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const size_t n = op.schema().arguments().size();
  TORCH_CHECK(n == 3 || n == 4, "bik: the RMSNorm kernel is bound to ", op.schema().name());
  const auto args = torch::jit::last(*stack, n);
  const Tensor x = args[0].toTensor(), w = args[1].toTensor();
  const double eps = args[2].toDouble();
  const Tensor residual = n == 4 ? args[3].toTensor() : Tensor();
  const Tensor* r = n == 4 ? &residual : nullptr;
  if (!norm_served(x, w, eps, r)) return to_bik_op(op, stack);
  auto [y, h] = norm_rows(x, w, eps, r);
  torch::jit::drop(*stack, n);
  torch::jit::push(*stack, std::move(y));
  if (r != nullptr) torch::jit::push(*stack, std::move(h));
}

// bik::attention's arguments without the backend -> out.
inline void boxed_attention(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const size_t n = op.schema().arguments().size();
  TORCH_CHECK(n == 10, "bik: the attention kernel is bound to ", op.schema().name());
  const auto a = torch::jit::last(*stack, n);
  const Tensor q = a[0].toTensor(), k = a[1].toTensor(), v = a[2].toTensor(),
               seqlens = a[3].toTensor(), cu_q = a[4].toTensor();
  const std::optional<Tensor> table = a[5].toOptional<Tensor>();
  const double scale = a[6].toDouble();
  const bool causal = a[7].toBool();
  const std::optional<int64_t> max_q = a[8].toOptional<int64_t>(),
                               max_k = a[9].toOptional<int64_t>();
  if (!attention_served(q, k, v, seqlens, cu_q, table, scale, max_q, max_k))
    return to_bik_op(op, stack);
  Tensor out = paged_attention(q, k, v, seqlens, cu_q, table, scale, causal, *max_k);
  torch::jit::drop(*stack, n);
  torch::jit::push(*stack, std::move(out));
}

// bik::write_kv_cache's arguments -> nothing (the caches are written in place).
inline void boxed_kv_write(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const size_t n = op.schema().arguments().size();
  TORCH_CHECK(n == 6, "bik: the KV cache write kernel is bound to ", op.schema().name());
  const auto a = torch::jit::last(*stack, n);
  if (!kv_write(a[0].toTensor(), a[1].toTensor(), a[2].toTensor(), a[3].toTensor(),
                a[4].toTensor(), a[5].toBool()))
    return to_bik_op(op, stack);
  torch::jit::drop(*stack, n);
}

// Binds bik_native::<op> (defined by Python from bik::<op>'s schema) at the CPU key to the
// kernel named `kernel` ("norm", "attention" or "kv_write"). Once per op and process; the registrations
// live as long as the process.
inline void bind(std::string op, std::string kernel) {
  static std::mutex lock;
  static std::vector<std::unique_ptr<torch::Library>> bound;
  static std::vector<std::string> names;
  std::lock_guard<std::mutex> guard(lock);
  for (const auto& name : names)
    if (name == op) return;
  auto library = std::make_unique<torch::Library>(torch::Library::IMPL, "bik_native",
                                                  c10::DispatchKey::CPU, __FILE__, __LINE__);
  if (kernel == "norm") {
    library->impl(op.c_str(), torch::CppFunction::makeFromBoxedFunction<&boxed_norm>());
  } else if (kernel == "attention") {
    library->impl(op.c_str(), torch::CppFunction::makeFromBoxedFunction<&boxed_attention>());
  } else if (kernel == "kv_write") {
    library->impl(op.c_str(), torch::CppFunction::makeFromBoxedFunction<&boxed_kv_write>());
  } else {
    TORCH_CHECK(false, "bik: no native kernel named ", kernel);
  }
  bound.push_back(std::move(library));
  names.push_back(op);
}

}  // namespace bik_layers
