// Host build of csrc/cuda/{matmul,attention}_plan.cuh for the CPU tests (ctypes). Compiled with
// g++ -ffp-contract=off, so each float op is rounded on its own, as the kernels' __f*_rn are.
//
// Besides the index helpers, this file replays the CUDA kernels' programs on the host: the
// same grid walk, the same split/block loops and skips, the same per-element operation order
// (and the warp butterfly trees), built from the header's functions. It is a replica used to
// argue invariance without a GPU, not the kernel itself; the GPU tests check the kernels.
#include <cmath>
#include <cstring>
#include <vector>

#include "../../../csrc/cuda/attention_plan.cuh"
#include "../../../csrc/cuda/matmul_plan.cuh"

typedef long long i64;

extern "C" {

// ---- matmul --------------------------------------------------------------------------------

int mm_num_splits(i64 k, i64 split_len) { return bik_mm::num_splits(k, split_len); }

void mm_split_range(i64 k, i64 split_len, int s, i64* lo, i64* hi) {
  *lo = bik_mm::split_lo(k, split_len, s);
  *hi = bik_mm::split_hi(k, split_len, s);
}

void mm_tile_of(i64 pid, i64 tiles_m, i64 tiles_n, int bm, int bn, i64* out) {
  const bik_mm::Tile t = bik_mm::tile_of(pid, tiles_m, tiles_n, bm, bn);
  out[0] = t.batch;
  out[1] = t.m0;
  out[2] = t.n0;
}

void mm_mma_coords(int lane, int* a_rk, int* b_kc, int* c_rc) {  // 4x2, 2x2, 4x2 ints
  for (int reg = 0; reg < 4; ++reg)
    bik_mm::mma_a_coord(lane, reg, &a_rk[2 * reg], &a_rk[2 * reg + 1]);
  for (int reg = 0; reg < 2; ++reg)
    bik_mm::mma_b_coord(lane, reg, &b_kc[2 * reg], &b_kc[2 * reg + 1]);
  for (int e = 0; e < 4; ++e) bik_mm::mma_c_coord(lane, e, &c_rc[2 * e], &c_rc[2 * e + 1]);
}

// The (split, k) sequence element (row, col) of an M x N output meets, in the order of the
// fp32 kernel's loops, in either launch mode: returns its length (<= cap entries written).
int mm_k_schedule(int m, int n, int k, int split_len, int spread, int bm, int bn, int bk,
                  int row, int col, int* split_out, i64* k_out, int cap) {
  const i64 tiles_m = bik_mm::cdiv(m, bm), tiles_n = bik_mm::cdiv(n, bn);
  const int n_splits = bik_mm::num_splits(k, split_len);
  int count = 0;
  for (i64 pid = 0; pid < tiles_m * tiles_n; ++pid) {
    for (int y = 0; y < (spread ? n_splits : 1); ++y) {
      const bik_mm::Program p = bik_mm::program_of(pid, y, m, n, k, split_len, spread, bm, bn);
      const bik_mm::Tile t = p.t;
      if (row < t.m0 || row >= t.m0 + bm || col < t.n0 || col >= t.n0 + bn) continue;
      for (int s = p.s_first; s < p.s_end; ++s) {
        const i64 lo = bik_mm::split_lo(k, split_len, s), hi = bik_mm::split_hi(k, split_len, s);
        for (i64 k0 = lo; k0 < hi; k0 += bk) {
          const i64 kmax = bik_mm::min64(bk, hi - k0);
          for (i64 kk = 0; kk < kmax; ++kk) {
            if (count < cap) {
              split_out[count] = s;
              k_out[count] = k0 + kk;
            }
            ++count;
          }
        }
      }
    }
  }
  return count;
}

// The fp32 kernel (bik_matmul_f32 + bik_matmul_reduce) replayed: a [M, K], b [K, N] row-major.
void mm_emulate_f32(const float* a, const float* b, const float* bias, float* c, int m, int n,
                    int k, int split_len, int spread, int bm, int bn, int bk) {
  const i64 tiles_m = bik_mm::cdiv(m, bm), tiles_n = bik_mm::cdiv(n, bn);
  const int n_splits = bik_mm::num_splits(k, split_len);
  std::vector<float> ws(spread ? static_cast<size_t>(n_splits) * m * n : 0);
  std::vector<float> total(static_cast<size_t>(bm) * bn), acc(static_cast<size_t>(bm) * bn);
  for (i64 pid = 0; pid < tiles_m * tiles_n; ++pid) {
    const bik_mm::Tile t = bik_mm::tile_of(pid, tiles_m, tiles_n, bm, bn);
    for (int y = 0; y < (spread ? n_splits : 1); ++y) {
      const bik_mm::Program p = bik_mm::program_of(pid, y, m, n, k, split_len, spread, bm, bn);
      for (int s = p.s_first; s < p.s_end; ++s) {
        std::fill(acc.begin(), acc.end(), 0.0f);
        const i64 lo = bik_mm::split_lo(k, split_len, s), hi = bik_mm::split_hi(k, split_len, s);
        for (i64 k0 = lo; k0 < hi; k0 += bk) {
          const i64 kmax = bik_mm::min64(bk, hi - k0);
          for (i64 kk = 0; kk < kmax; ++kk)
            for (int r = 0; r < bm; ++r)
              for (int cc = 0; cc < bn; ++cc) {
                const i64 gm = t.m0 + r, gn = t.n0 + cc, gk = k0 + kk;
                const float av = gm < m ? a[gm * k + gk] : 0.0f;  // zero-filled like smem
                const float bv = gn < n ? b[gk * n + gn] : 0.0f;
                float& e = acc[static_cast<size_t>(r) * bn + cc];
                e = bik_mm::mac(e, av, bv);
              }
        }
        for (int r = 0; r < bm; ++r)
          for (int cc = 0; cc < bn; ++cc) {
            const i64 gm = t.m0 + r, gn = t.n0 + cc;
            const float v = acc[static_cast<size_t>(r) * bn + cc];
            if (spread) {
              if (gm < m && gn < n) ws[bik_mm::partial_index(0, s, n_splits, m, gm, n, gn)] = v;
            } else {
              float& tot = total[static_cast<size_t>(r) * bn + cc];
              tot = bik_mm::fold_split(tot, v, s);
            }
          }
      }
    }
    if (!spread)
      for (int r = 0; r < bm; ++r)
        for (int cc = 0; cc < bn; ++cc) {
          const i64 gm = t.m0 + r, gn = t.n0 + cc;
          if (gm < m && gn < n)
            c[gm * n + gn] = bik_mm::add_bias(total[static_cast<size_t>(r) * bn + cc], bias, gn);
        }
  }
  if (spread)
    for (i64 gm = 0; gm < m; ++gm)
      for (i64 gn = 0; gn < n; ++gn) {
        float tot = 0.0f;
        for (int s = 0; s < n_splits; ++s)
          tot = bik_mm::fold_split(tot, ws[bik_mm::partial_index(0, s, n_splits, m, gm, n, gn)], s);
        c[gm * n + gn] = bik_mm::add_bias(tot, bias, gn);
      }
}

// ---- attention -----------------------------------------------------------------------------

i64 attn_row_limit(i64 seqlen, i64 q_len, i64 t, int causal) {
  return bik_attn::row_limit(seqlen, q_len, t, causal);
}
i64 attn_tile_kv_end(i64 seqlen, i64 q_len, i64 tile, int block_t, int causal) {
  return bik_attn::tile_kv_end(seqlen, q_len, tile, block_t, causal);
}
int attn_tile_splits(i64 kv_end, int split) { return bik_attn::tile_splits(kv_end, split); }
int attn_row_splits(i64 lim, int split) { return bik_attn::row_splits(lim, split); }
int attn_keys_in_block(i64 n0, i64 lim, int block_n) {
  return bik_attn::keys_in_block(n0, lim, block_n);
}
i64 attn_key_offset(i64 pos, i64 b, const int* table, i64 stride_table, const i64* base,
                    int block_size, i64 stride_page, i64 stride_tok) {
  return bik_attn::key_offset(pos, b, table, stride_table, base, block_size, stride_page,
                              stride_tok);
}

static float tree32(const float* x, bool is_max) {  // the warp butterfly, lane 0's result
  float v[32], w[32];
  std::memcpy(v, x, sizeof(v));
  for (int o = 16; o > 0; o >>= 1) {
    for (int i = 0; i < 32; ++i)
      w[i] = is_max ? bik_attn::f_max(v[i], v[i ^ o]) : bik_attn::add_rn(v[i], v[i ^ o]);
    std::memcpy(v, w, sizeof(v));
  }
  return v[0];
}

// The attention kernel replayed for one sequence (fp32): q [q_len, hq, d], k/v [seqlen, hkv, d]
// contiguous; writes out [q_len, hq, d] and lse [q_len, hq]. block_n = 32 as in the kernel.
void attn_emulate_f32(const float* q, const float* k, const float* v, float* out, float* lse,
                      int q_len, int seqlen, int hq, int hkv, int d, int gh, int block_t,
                      int split, int causal, int fold, float scale_log2e) {
  const int block_n = 32, g = hq / hkv, slices = (g + gh - 1) / gh, rows = gh * block_t;
  const int tiles = (q_len + block_t - 1) / block_t;
  std::vector<float> pacc, pml;
  const int max_splits = bik_attn::tile_splits(seqlen, split);
  if (!fold) {
    pacc.assign(static_cast<size_t>(max_splits) * q_len * hq * d, 0.0f);
    pml.assign(static_cast<size_t>(max_splits) * 2 * q_len * hq, 0.0f);
  }
  for (int hk = 0; hk < hkv; ++hk)
    for (int slice = 0; slice < slices; ++slice)
      for (int tile = 0; tile < tiles; ++tile) {
        const i64 kv_end = bik_attn::tile_kv_end(seqlen, q_len, tile, block_t, causal);
        const int n_splits = bik_attn::tile_splits(kv_end, split);
        std::vector<i64> lim(rows);
        std::vector<int> tok(rows), head(rows);
        for (int r = 0; r < rows; ++r) {
          const i64 t = static_cast<i64>(tile) * block_t + r / gh;
          const int hs = slice * gh + r % gh;
          lim[r] = (t < q_len && hs < g) ? bik_attn::row_limit(seqlen, q_len, t, causal) : -1;
          tok[r] = static_cast<int>(t);
          head[r] = hk * g + hs;
        }
        std::vector<float> m_run(rows, bik_attn::neg_inf()), l_run(rows, 0.0f);
        std::vector<float> acc_run(static_cast<size_t>(rows) * d, 0.0f);
        for (int z = 0; z < (fold ? 1 : n_splits); ++z) {
          const int j_first = fold ? 0 : z, j_end = fold ? n_splits : z + 1;
          for (int j = j_first; j < j_end; ++j) {
            const i64 lo = static_cast<i64>(j) * split;
            const i64 hi = bik_attn::min64(lo + split, kv_end);
            std::vector<float> m_cur(rows, bik_attn::neg_inf()), l_cur(rows, 0.0f);
            std::vector<float> acc(static_cast<size_t>(rows) * d, 0.0f);
            for (i64 n0 = lo; n0 < hi; n0 += block_n)
              for (int r = 0; r < rows; ++r) {
                if (lim[r] < n0) continue;
                float s[32], p[32];
                for (int lane = 0; lane < 32; ++lane) {
                  s[lane] = bik_attn::neg_inf();
                  if (n0 + lane <= lim[r]) {
                    float dot = 0.0f;
                    const float* qr = q + (static_cast<i64>(tok[r]) * hq + head[r]) * d;
                    const float* kr = k + ((n0 + lane) * hkv + hk) * d;
                    for (int x = 0; x < d; ++x)
                      dot = bik_attn::add_rn(dot, bik_attn::mul_rn(qr[x], kr[x]));
                    s[lane] = bik_attn::mul_rn(dot, scale_log2e);
                  }
                }
                const bik_attn::Scales sc = bik_attn::merge_scales(m_cur[r], tree32(s, true));
                const float m_safe = sc.m_new == bik_attn::neg_inf() ? 0.0f : sc.m_new;
                for (int lane = 0; lane < 32; ++lane)
                  p[lane] = n0 + lane <= lim[r] ? bik_attn::f_exp2(s[lane] - m_safe) : 0.0f;
                const float sum = tree32(p, false);
                const int nk = bik_attn::keys_in_block(n0, lim[r], block_n);
                for (int x = 0; x < d; ++x) {
                  float pv = 0.0f;
                  for (int nn = 0; nn < nk; ++nn)
                    pv = bik_attn::add_rn(
                        pv, bik_attn::mul_rn(p[nn], v[((n0 + nn) * hkv + hk) * d + x]));
                  float& e = acc[static_cast<size_t>(r) * d + x];
                  e = bik_attn::rescale_add(e, sc.a, pv);
                }
                l_cur[r] = bik_attn::rescale_add(l_cur[r], sc.a, sum);
                m_cur[r] = sc.m_new;
              }
            for (int r = 0; r < rows; ++r) {
              if (lim[r] < lo) continue;
              const bik_attn::Scales sc = bik_attn::merge_scales(m_run[r], m_cur[r]);
              for (int x = 0; x < d; ++x) {
                const size_t i = static_cast<size_t>(r) * d + x;
                if (fold)
                  acc_run[i] = bik_attn::fold2(acc_run[i], sc.a, acc[i], sc.b);
                else
                  pacc[bik_attn::pacc_index(j, q_len, hq, tok[r], head[r], x, d)] = acc[i];
              }
              if (fold) {
                l_run[r] = bik_attn::fold2(l_run[r], sc.a, l_cur[r], sc.b);
                m_run[r] = sc.m_new;
              } else {
                pml[bik_attn::pml_index(j, 0, q_len, hq, tok[r], head[r])] = m_cur[r];
                pml[bik_attn::pml_index(j, 1, q_len, hq, tok[r], head[r])] = l_cur[r];
              }
            }
          }
        }
        if (fold)
          for (int r = 0; r < rows; ++r) {
            if (lim[r] < 0) continue;
            for (int x = 0; x < d; ++x)
              out[(static_cast<i64>(tok[r]) * hq + head[r]) * d + x] =
                  bik_attn::finalize_out(acc_run[static_cast<size_t>(r) * d + x], l_run[r]);
            lse[static_cast<i64>(tok[r]) * hq + head[r]] =
                bik_attn::finalize_lse(m_run[r], l_run[r]);
          }
      }
  if (!fold)  // split mode: the fused fold of every partial, j ascending
    for (int t = 0; t < q_len; ++t)
      for (int h = 0; h < hq; ++h) {
        const int n = bik_attn::row_splits(bik_attn::row_limit(seqlen, q_len, t, causal), split);
        float m = bik_attn::neg_inf(), l = 0.0f;
        std::vector<float> acc(d, 0.0f);
        for (int j = 0; j < n; ++j) {
          const bik_attn::Scales sc =
              bik_attn::merge_scales(m, pml[bik_attn::pml_index(j, 0, q_len, hq, t, h)]);
          for (int x = 0; x < d; ++x)
            acc[x] = bik_attn::fold2(
                acc[x], sc.a, pacc[bik_attn::pacc_index(j, q_len, hq, t, h, x, d)], sc.b);
          l = bik_attn::fold2(l, sc.a, pml[bik_attn::pml_index(j, 1, q_len, hq, t, h)], sc.b);
          m = sc.m_new;
        }
        for (int x = 0; x < d; ++x)
          out[(static_cast<i64>(t) * hq + h) * d + x] = bik_attn::finalize_out(acc[x], l);
        lse[static_cast<i64>(t) * hq + h] = bik_attn::finalize_lse(m, l);
      }
}

}  // extern "C"
