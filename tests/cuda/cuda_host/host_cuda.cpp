// Host build of the CUDA kernels' __host__ __device__ element math (csrc/cuda/*.cuh) for
// tests/cuda/test_cuda_host.py. A separate translation unit from host_check.cpp (which holds
// the CPU path's math), so the compiler cannot fold the two sides of a comparison into one.
#include <cstdint>

#include "rms_norm.cuh"
#include "sampling.cuh"

namespace {

template <class T, class W>
void rows(const typename T::storage* x, const typename T::storage* r, std::int64_t n_rows,
          std::int64_t hidden, const typename W::storage* w, float eps, typename T::storage* y,
          typename T::storage* h) {
  for (std::int64_t i = 0; i < n_rows; ++i) {
    const typename T::storage* src = x + i * hidden;
    if (r != nullptr) {
      for (std::int64_t j = 0; j < hidden; ++j)
        h[i * hidden + j] = bik::rms::residual_sum<T>(x[i * hidden + j], r[i * hidden + j]);
      src = h + i * hidden;
    }
    bik::rms::rms_norm_row_host<T, W>(src, w, hidden, eps, y + i * hidden);
  }
}

// row_cut's probe pass on the host: each probe's mass, then (when collect) the kept finite
// tokens with z in [lo_v, hi_v), the first kTopPCandidates in cand. kept_z(j): token j's z, or
// -inf when a filter drops it.
template <class Mass, class KeptZ>
std::int64_t probe_pass(const Mass& mass, const KeptZ& kept_z, std::int64_t V,
                        const float (&probes)[bik::sampling::kProbeLanes], float lo_v,
                        float hi_v, bool collect, float (&masses)[bik::sampling::kProbeLanes],
                        float* cand) {
  namespace s = bik::sampling;
  for (int k = 0; k < s::kProbeLanes; ++k) masses[k] = mass(probes[k]);
  std::int64_t n = 0;
  for (std::int64_t j = 0; collect && j < V; ++j) {
    const float z = kept_z(j);
    if (z > -bik::inf_f32() && z >= lo_v && z < hi_v) {
      if (n < s::kTopPCandidates) cand[n] = z;
      ++n;
    }
  }
  return n;
}

}  // namespace

extern "C" {

float bik_cuda_gumbel(std::uint64_t seed, std::uint64_t pos, std::uint32_t token,
                      std::uint32_t stream) {
  return bik::sampling::gumbel(seed, pos, token, stream);
}
float bik_cuda_bits_to_unit(std::uint32_t bits) { return bik::sampling::bits_to_unit(bits); }
float bik_cuda_gumbel_from_unit(float u) { return bik::sampling::gumbel_from_unit(u); }
float bik_cuda_log(float x) { return bik::sampling::bik_log(x); }
float bik_cuda_exp(float x) { return bik::sampling::bik_exp(x); }

// The normaliser's sum of fp32 terms [B, V] per row, in the stats kernel's layout.
void bik_cuda_vocab_sum(const float* terms, std::int64_t B, std::int64_t V,
                        std::int64_t group_len, float* out) {
  for (std::int64_t r = 0; r < B; ++r)
    out[r] = bik::sampling::vocab_mass_host([&](std::int64_t j) { return terms[r * V + j]; },
                                            V, group_len);
}

// The stats kernel's top-p search (row_cut) on fp32 logits [B, V] at T = 1, top-k and min-p
// off, with the normaliser in the kernel's layout: v_p and the kept mass per row; `passes` as
// row_cut's (a control cuts it short).
void bik_cuda_top_p_cut(const float* x, std::int64_t B, std::int64_t V, std::int64_t group_len,
                        float top_p, int passes, float* v_p, float* kept_mass) {
  namespace s = bik::sampling;
  for (std::int64_t r = 0; r < B; ++r) {
    const float* xr = x + r * V;
    float m = -bik::inf_f32();
    for (std::int64_t j = 0; j < V; ++j) m = xr[j] > m ? xr[j] : m;
    auto mass = [&](float threshold) {
      return s::vocab_mass_host(
          [&](std::int64_t j) {
            return s::normaliser_term(xr[j], j, -bik::inf_f32(), V, threshold, m);
          },
          V, group_len);
    };
    float cand[s::kTopPCandidates];
    auto probe = [&](const float (&probes)[s::kProbeLanes], float lo_v, float hi_v, bool collect,
                     float (&masses)[s::kProbeLanes]) {
      return probe_pass(mass, [&](std::int64_t j) { return xr[j]; }, V, probes, lo_v, hi_v,
                        collect, masses, cand);
    };
    s::row_cut(mass, probe, V, m, top_p, -bik::inf_f32(), cand, v_p[r], kept_mass[r], passes);
  }
}

std::uint32_t bik_host_philox_word0(std::uint32_t c0, std::uint32_t c1, std::uint32_t c2,
                                    std::uint32_t c3, std::uint32_t k0, std::uint32_t k1) {
  return bik::sampling::philox_word0(c0, c1, c2, c3, k0, k1);
}

void bik_host_f32_to_bf16(const float* x, std::int64_t n, std::uint16_t* y) {
  for (std::int64_t i = 0; i < n; ++i) y[i] = bik::f32_to_bf16(x[i]);
}
void bik_host_f32_to_f16(const float* x, std::int64_t n, std::uint16_t* y) {
  for (std::int64_t i = 0; i < n; ++i) y[i] = bik::f32_to_f16(x[i]);
}
void bik_host_f16_to_f32(const std::uint16_t* x, std::int64_t n, float* y) {
  for (std::int64_t i = 0; i < n; ++i) y[i] = bik::f16_to_f32(x[i]);
}

// RMSNorm rows [n_rows, hidden] (contiguous) in the CUDA kernel's order. dtype: 0 fp32,
// 1 bf16, 2 fp16 (x, r, y, h share it; w is fp32). r may be null (then h is unused).
void bik_host_rms_norm(int dtype, const void* x, const void* r, std::int64_t n_rows,
                       std::int64_t hidden, const float* w, float eps, void* y, void* h) {
  using bik::u16;
  if (dtype == 0)
    rows<bik::F32, bik::F32>(static_cast<const float*>(x), static_cast<const float*>(r),
                             n_rows, hidden, w, eps, static_cast<float*>(y),
                             static_cast<float*>(h));
  else if (dtype == 1)
    rows<bik::BF16, bik::F32>(static_cast<const u16*>(x), static_cast<const u16*>(r), n_rows,
                              hidden, w, eps, static_cast<u16*>(y), static_cast<u16*>(h));
  else
    rows<bik::F16, bik::F32>(static_cast<const u16*>(x), static_cast<const u16*>(r), n_rows,
                             hidden, w, eps, static_cast<u16*>(y), static_cast<u16*>(h));
}

// The CUDA sampler's token, max and log normaliser for rows of fp32 logits [B, V], computed on
// the host with the kernels' own helpers in the kernels' work split: the stats kernel's pass 1
// (stats_consider per thread, then an exact max), its row_cut over the normaliser in the
// kernel's layout (vocab_mass_host: top-p's probe search, min-p, the kept mass), and the pick kernel's loop
// body (pick_consider) per split of `split` tokens and per thread of `threads`, the winners
// combined under (value desc, index asc). vk/ik: the top-k threshold the ops layer computes.
// key: int64 [B, 5] as the ops layer builds it. group_len: V / G (bik.configs.sampler_chunks).
void bik_cuda_emulate_sample(const float* x, std::int64_t B, std::int64_t V,
                             std::int64_t group_len, const std::int64_t* key,
                             const float* temperature, const float* vk, const std::int32_t* ik,
                             const float* top_p, const float* log_min_p, std::int64_t split,
                             std::int64_t threads, std::int64_t* tokens, float* m_out,
                             float* log_s_out) {
  namespace s = bik::sampling;
  for (std::int64_t r = 0; r < B; ++r) {
    const float* xr = x + r * V;
    float m = -bik::inf_f32();
    bool bad = false;
    for (std::int64_t t = 0; t < threads; ++t) {
      float mx = -bik::inf_f32();
      for (std::int64_t j = t; j < V; j += threads)
        s::stats_consider(s::tempered(xr[j], temperature[r]), j, vk[r], ik[r], mx, bad);
      m = mx > m ? mx : m;
    }
    const bool is_bad = bad || m == -bik::inf_f32();
    const float m_safe = is_bad ? 0.0f : m;
    auto mass = [&](float threshold) {
      return s::vocab_mass_host(
          [&](std::int64_t j) {
            return s::normaliser_term(s::tempered(xr[j], temperature[r]), j, vk[r], ik[r],
                                      threshold, m_safe);
          },
          V, group_len);
    };
    float cand[s::kTopPCandidates];
    auto kept_z = [&](std::int64_t j) {
      const float z = s::tempered(xr[j], temperature[r]);
      return s::kept_k(z, j, vk[r], ik[r]) ? z : -bik::inf_f32();
    };
    auto probe = [&](const float (&probes)[s::kProbeLanes], float lo_v, float hi_v, bool collect,
                     float (&masses)[s::kProbeLanes]) {
      return probe_pass(mass, kept_z, V, probes, lo_v, hi_v, collect, masses, cand);
    };
    float v_lo, norm;
    s::row_cut(mass, probe, V, m_safe, top_p[r], log_min_p[r], cand, v_lo, norm);
    m_out[r] = m_safe;
    log_s_out[r] = s::bik_log(is_bad ? 1.0f : norm);
    s::PickRow p;
    p.temperature = temperature[r];
    p.vk = vk[r];
    p.ik = ik[r];
    p.v_lo = v_lo;
    p.floor = bik::add_rn(m_safe, s::kGumbelMin);
    const std::int64_t* k = key + r * 5;
    p.seed = std::uint64_t(k[0]) | (std::uint64_t(k[1]) << 32);
    p.position = std::uint64_t(k[2]) | (std::uint64_t(k[3]) << 32);
    p.stream = std::uint32_t(k[4]);
    float best_v = -bik::inf_f32();
    std::int32_t best_i = 0x7FFFFFFF;
    for (std::int64_t begin = 0; begin < V; begin += split) {
      const std::int64_t end = begin + split < V ? begin + split : V;
      for (std::int64_t t = 0; t < threads; ++t) {
        float tv = -bik::inf_f32();
        std::int32_t ti = 0x7FFFFFFF;
        for (std::int64_t j = begin + t; j < end; j += threads)
          s::pick_consider(p, xr[j], j, tv, ti);
        if (s::better(tv, ti, best_v, best_i)) {
          best_v = tv;
          best_i = ti;
        }
      }
    }
    tokens[r] = is_bad || best_v == -bik::inf_f32() ? -1 : best_i;
  }
}

}  // extern "C"
