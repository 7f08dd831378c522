// bik.moe's experts and softmax routers (bik/moe/) in one C++ call each, for the vLLM plugin's
// mixture-of-experts layers. bik.moe is torch code that bik.enable() makes batch-invariant by
// routing its ops; at decode sizes that is ~15 Python-routed calls a layer around a few µs of
// products (bik bench vllm --profile). These functions make the same aten and kernel calls, in
// the same order, on the same values: each step below names the torch line it stands for, and
// tests/mode/test_moe_native.py checks the results equal bik.moe's torch code under bik.enable()
// bit for bit.
//
// Included by native_cpu.cpp inside its namespace, after the products (product, packed_product),
// SiLU (silu) and row reductions (reduce_last) it calls. A call these do not serve returns
// nullopt, and bik.moe runs its torch code.
#pragma once

#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

// The pairs of ids [S] (the flattened [T, k]) sorted by expert, stably: torch.sort(stable=True)
// on integers, whose order is unique. Fills perm [S] and ends [E] (each expert's cumulative
// end, the histogram's cumsum); false when an id is outside [0, E).
inline bool moe_sort_pairs(const int64_t* ids, int64_t S, int64_t E, int64_t* perm,
                           std::vector<int64_t>& ends) {
  ends.assign(E, 0);
  for (int64_t i = 0; i < S; ++i) {
    if (ids[i] < 0 || ids[i] >= E) return false;
    ++ends[ids[i]];
  }
  std::vector<int64_t> next(E, 0);
  for (int64_t e = 1; e < E; ++e) next[e] = next[e - 1] + ends[e - 1];
  for (int64_t i = 0; i < S; ++i) perm[next[ids[i]]++] = i;
  for (int64_t e = 1; e < E; ++e) ends[e] += ends[e - 1];
  return true;
}

// bik.enable()'s sum of x [T, k, C] over its middle dim (mode/_grad_routes.ones_sum: the rows
// [T * C, k] times a ones column through bik's matmul), [T, C] in x's dtype.
inline Tensor moe_sum_slots(const Tensor& x) {
  const int64_t T = x.size(0), k = x.size(1), C = x.size(2);
  const Tensor rows = x.permute({0, 2, 1}).reshape({T * C, k});
  const Tensor ones = at::ones({k, 1}, rows.options());
  return product(rows, ones, nullptr).reshape({T, C});
}

// Every expert's product of its rows of `rows` [S, k] (sorted by expert, expert e's rows ending
// at ends[e]) with its panels (panels[e]: a bik.PackedWeight's, [n, k], split and dot as
// packed), [S, n] in rows' dtype. bik.moe._grouped's packed loop: packed[e](rows[start:end]).
inline Tensor moe_grouped(const Tensor& rows, const std::vector<int64_t>& ends,
                          const int64_t* panels, int64_t n, int64_t split, bool dot) {
  const bool bf16 = rows.scalar_type() == at::kBFloat16;
  Tensor out = at::detail::empty_cpu({rows.size(0), n}, rows.scalar_type());
  int64_t start = 0;
  for (size_t e = 0; e < ends.size(); ++e) {
    if (ends[e] > start)
      packed_product(rows.narrow(0, start, ends[e] - start), panels[e], n, rows.size(1), split,
                     dot, out.narrow(0, start, 1).mutable_data_ptr(), bf16, n, nullptr,
                     "bik.moe");
    start = ends[e];
  }
  return out;
}

// bik.moe.experts(x, ids, weights, w13, w2, packed): x [T, H] (fp32, or bf16 on the bf16 dot
// path: a PackedWeight's product's dtypes), ids [T, k] int64, weights [T, k] fp32 or x's dtype,
// the experts' panels as int64 addresses [E] (w13: [2I, H] each, w2: [H, I]).
std::optional<Tensor> moe_experts(const Tensor& x, const Tensor& ids, const Tensor& weights,
                                  const Tensor& panels13, const Tensor& panels2, int64_t inter,
                                  int64_t split13, int64_t split2, bool dot) {
  const auto dtype = x.scalar_type();
  const bool served =
      g_matmul != nullptr && unobserved() && x.is_cpu() && !x.is_neg() && x.dim() == 2 &&
      x.size(0) > 0 && x.size(1) > 0 && inter > 0 && dtype == (dot ? at::kBFloat16 : at::kFloat) &&
      ids.is_cpu() && ids.dim() == 2 && ids.size(0) == x.size(0) && ids.size(1) > 0 &&
      ids.scalar_type() == at::kLong && weights.is_cpu() && !weights.is_neg() &&
      weights.sizes() == ids.sizes() &&
      (weights.scalar_type() == at::kFloat || weights.scalar_type() == dtype) &&
      panels13.dim() == 1 && panels13.scalar_type() == at::kLong && panels13.is_contiguous() &&
      panels2.sizes() == panels13.sizes() && panels2.scalar_type() == at::kLong &&
      panels2.is_contiguous() && panels13.size(0) > 0;
  if (!served) return std::nullopt;
  const int64_t T = x.size(0), H = x.size(1), k = ids.size(1), S = T * k, E = panels13.size(0);
  const int64_t* p13 = panels13.const_data_ptr<int64_t>();
  const int64_t* p2 = panels2.const_data_ptr<int64_t>();
  for (int64_t e = 0; e < E; ++e)
    if (p13[e] == 0 || p2[e] == 0) return std::nullopt;
  // sort_pairs: torch.sort(ids.reshape(-1)) (stable), the histogram's cumsum
  const Tensor flat = ids.contiguous();
  Tensor perm = at::detail::empty_cpu({S}, at::kLong);
  std::vector<int64_t> ends;
  if (!moe_sort_pairs(flat.const_data_ptr<int64_t>(), S, E, perm.mutable_data_ptr<int64_t>(),
                      ends))
    return std::nullopt;
  Tensor token = at::detail::empty_cpu({S}, at::kLong);  // perm // k
  const int64_t* pp = perm.const_data_ptr<int64_t>();
  int64_t* tp = token.mutable_data_ptr<int64_t>();
  for (int64_t i = 0; i < S; ++i) tp[i] = pp[i] / k;
  const Tensor selected = at::index_select(x, 0, token);  // x[perm // k]
  // expert_rows: the gate-up products, SiLU of the gate times up, the down products
  const Tensor proj = moe_grouped(selected, ends, p13, 2 * inter, split13, dot);
  const Tensor act = silu(c10::DispatchKeySet(), proj.narrow(1, 0, inter));  // F.silu(gate)
  const Tensor hidden = at::mul(act, proj.narrow(1, inter, inter));          // ... * up
  const Tensor rows = moe_grouped(hidden, ends, p2, H, split2, dot);
  // combine: weighted in sorted order, put back in (token, slot) order, summed over the slots
  const Tensor sorted_weights = at::index_select(weights.reshape({S}), 0, perm);
  const Tensor weighted = at::mul(rows, sorted_weights.unsqueeze(-1));
  Tensor inverse = at::detail::empty_cpu({S}, at::kLong);  // inv_perm[perm] = arange(S)
  int64_t* ip = inverse.mutable_data_ptr<int64_t>();
  for (int64_t i = 0; i < S; ++i) ip[pp[i]] = i;
  const Tensor back = at::index_select(weighted, 0, inverse);
  const Tensor summed = moe_sum_slots(back.view({T, k, H}));
  return summed.scalar_type() == dtype ? summed : summed.to(dtype);
}

// The first k of row `p` [E] in a stable descending sort (NaN the largest, as in torch): bik's
// topk (mode/_moe_routes._topk).
inline void moe_top_k(const float* p, int64_t E, int64_t k, float* values, int64_t* ids,
                      std::vector<char>& taken) {
  taken.assign(E, 0);
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t i = 0; i < E; ++i) {
      if (taken[i]) continue;
      if (best < 0 || (!std::isnan(p[best]) && (std::isnan(p[i]) || p[i] > p[best]))) best = i;
    }
    taken[best] = 1;
    values[j] = p[best];
    ids[j] = best;
  }
}

// bik.moe's softmax routers on logits [T, E]: probs = softmax in fp32 (F.softmax(logits,
// dtype=float) and F.softmax(logits.float()) are one kernel call), top-k, and with `renormalize`
// top /= top.sum(-1, keepdim=True); the weights cast to the logits' dtype when `cast` (Qwen3-MoE)
// or kept fp32 (Mixtral). (weights [T, k], ids [T, k] int64).
std::optional<std::tuple<Tensor, Tensor>> moe_route_softmax(const Tensor& logits, int64_t k,
                                                            bool renormalize, bool cast) {
  if (g_reduce_rows == nullptr || g_matmul == nullptr || !unobserved() || !plain(logits) ||
      logits.dim() != 2 || logits.size(0) == 0 || k < 1 || k > logits.size(1))
    return std::nullopt;
  const int64_t T = logits.size(0), E = logits.size(1);
  const Tensor probs = reduce_last(logits, 0);  // fp32 [T, E], unit-stride rows
  Tensor top = at::detail::empty_cpu({T, k}, at::kFloat);
  Tensor ids = at::detail::empty_cpu({T, k}, at::kLong);
  std::vector<char> taken;
  for (int64_t t = 0; t < T; ++t)
    moe_top_k(probs.const_data_ptr<float>() + t * probs.stride(0), E, k,
              top.mutable_data_ptr<float>() + t * k, ids.mutable_data_ptr<int64_t>() + t * k,
              taken);
  if (renormalize) top.div_(moe_sum_slots(top.view({T, k, 1})));  // [T, 1]
  if (cast && logits.scalar_type() != at::kFloat) top = top.to(logits.scalar_type());
  return std::make_tuple(top, ids);
}
