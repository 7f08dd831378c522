// Host build of csrc/cuda/matmul_sm90_plan.cuh (the sm_90a matmul's shared-memory layout,
// wgmma descriptors and accumulator map) for tests/cuda/test_cuda_sm90_host.py, plus a replay of
// the kernel's loops (csrc/cuda/matmul_sm90.cu: grid walk, split loop, BLOCK_K steps, k16
// instructions) that records the k sequence one output element meets.
#include "../../../csrc/cuda/matmul_sm90_plan.cuh"

using bik_mm::i64;
using bik_mm90::u64;

extern "C" {

u64 mm90_encode_desc(unsigned start, unsigned lbo, unsigned sbo, unsigned swizzle) {
  return bik_mm90::encode_desc(start, lbo, sbo, swizzle);
}

// out: start, lbo, sbo, base_offset, swizzle
void mm90_decode_desc(u64 d, unsigned* out) {
  const bik_mm90::Desc x = bik_mm90::decode_desc(d);
  out[0] = x.start, out[1] = x.lbo, out[2] = x.sbo, out[3] = x.base_offset, out[4] = x.swizzle;
}

u64 mm90_tile_desc(unsigned start, int rows, int kstep) {
  return bik_mm90::tile_desc(start, rows, kstep);
}

int mm90_tile_offset(int rows, int r, int k) { return bik_mm90::tile_offset(rows, r, k); }
int mm90_tile_bytes(int rows) { return bik_mm90::tile_bytes(rows); }

unsigned mm90_desc_element_address(u64 d, int r, int k) {
  return bik_mm90::desc_element_address(d, r, k);
}

void mm90_acc_coord(int thread, int i, int* row, int* col) {
  bik_mm90::acc_coord(thread, i, row, col);
}

// The kernel's programs replayed for C[m, n] with splits of split_len: for output (row, col),
// the (split, first k) of every k16 instruction that adds into its accumulator, in order.
// Returns the count (at most cap written).
int mm90_k_schedule(int m, int n, int k, int split_len, int spread, int row, int col,
                    int* splits, i64* k16s, int cap) {
  const i64 tiles_m = bik_mm::cdiv(m, bik_mm90::kBM), tiles_n = bik_mm::cdiv(n, bik_mm90::kBN);
  const int n_splits = bik_mm::num_splits(k, split_len);
  int count = 0;
  for (i64 pid = 0; pid < tiles_m * tiles_n; ++pid) {
    for (int y = 0; y < (spread ? n_splits : 1); ++y) {
      const bik_mm::Program p = bik_mm::program_of(pid, y, m, n, k, split_len, spread,
                                                   bik_mm90::kBM, bik_mm90::kBN);
      const bik_mm::Tile t = p.t;
      for (int thread = 0; thread < bik_mm90::kThreads; ++thread)
        for (int i = 0; i < bik_mm90::kAccRegs; ++i) {
          int r, c;
          bik_mm90::acc_coord(thread, i, &r, &c);
          if (t.m0 + r != row || t.n0 + c != col) continue;
          for (int s = p.s_first; s < p.s_end; ++s) {
            const i64 lo = bik_mm::split_lo(k, split_len, s), hi = bik_mm::split_hi(k, split_len, s);
            for (i64 k0 = lo; k0 < hi; k0 += bik_mm90::kBK)
              for (int kk = 0; kk < bik_mm90::kBK / bik_mm90::kK16; ++kk) {
                if (count < cap) splits[count] = s, k16s[count] = k0 + kk * bik_mm90::kK16;
                ++count;
              }
          }
        }
    }
  }
  return count;
}

i64 mm90_k16_steps(i64 lo, i64 hi) { return bik_mm90::k16_steps(lo, hi); }

}  // extern "C"
