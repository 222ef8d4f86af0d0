// The micro-kernels of skinny_matmul.h, written once over a small vector interface `Isa` and compiled once per
// instruction set (skinny_avx512.cc, skinny_avx2.cc). Include after defining `Isa`.
//
// Register blocking: an MR x (NV vectors) block of y lives in registers while k runs; each k loads NV vectors of
// one W row and broadcasts MR entries of x, so one pass over a strip of W serves MR rows. Rows beyond MR reuse the
// strip from cache (it is at most K x 64 floats).
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <immintrin.h>

#include "skinny_matmul.h"

namespace bpd {
namespace {

// Two register-block shapes (accumulators + W vectors + one broadcast fit the 32 zmm or 16 ymm registers): wide
// (few rows, more columns) when all M rows fit in one wide block, else tall, so that up to kTallMr rows share one
// pass over W (a second pass re-reads the strip from cache). With AVX2 every M takes wide blocks: the tall
// block's one W vector per k comes with twelve broadcasts, more loads than the cores issue beside its FMAs, and
// measured slower than 6 x 16 blocks re-reading the strip at every M from 7 to 64 (docs/results/benchmark.md).
constexpr int kWideMr = 6, kWideNv = Isa::kW == 16 ? 4 : 2;
constexpr int kTallMr = 12, kTallNv = Isa::kW == 16 ? 2 : 1;
constexpr bool kOnlyWide = Isa::kW == 8;
// One or two rows take wider blocks, up to a whole tile (one row: up to two tiles, see unit_tiles_for): a wide
// block's two accumulators per row would leave a one-row product waiting on the FMA latency (each accumulator's
// chain over k is serial), and one row is a greedy step's every product. Each output is still one accumulator
// summed over k in order, so no sum depends on M.
template <int MR>
constexpr int max_nv() {
  return MR == 1 ? std::min(8, 2 * static_cast<int>(kTile) / Isa::kW)
                 : MR == 2 ? std::max(kWideNv, static_cast<int>(kTile) / Isa::kW / 2) : kWideNv;
}
// With AVX2, 3 to 8 rows go two at a time over 32-column strips (a packed part, read front to back) rather than in
// 6 x 16 blocks, whose strips take half of each part's rows: streamed from L3 or DRAM, as a decoding step streams
// its weights, two-row passes were 1.1-1.3x faster; one matrix kept in L2 is read faster by 6 x 16 blocks, but a
// decoder's weights do not stay there (docs/results/scripts/skinny_pairs.py).
constexpr int kPairsUpTo = Isa::kW == 8 ? 8 : 0;
constexpr int kNtMr = Isa::kW == 16 ? 4 : 2;    // transposed W: rows per block
constexpr int kNtNr = 4;                         // transposed W: W rows (output columns) per block
constexpr int kPrefetchRows = 16;                // W rows ahead: a strip row is one to four cache lines

// A vector of weights: float32, or float16 (WT = uint16_t) or int8 widened to float32 as it is loaded. Narrow
// weights come only packed, whose tiles are zero-padded past N, so their last vector is read whole (no masked load).
template <typename WT>
inline typename Isa::V load_w(const WT* p) {
  if constexpr (std::is_same<WT, float>::value) return Isa::load(p);
  else if constexpr (std::is_same<WT, int8_t>::value) return Isa::load_int8(p);
  else return Isa::load_half(p);
}

// y[0:MR, 0:cols] = x[0:MR, :] . w[:, 0:cols] (x scale) (+ bias), cols = NV * kW, or fewer in the last vector
// (MASKED). scale: int8 weights' per-column factors, applied once to each finished sum.
template <int MR, int NV, bool MASKED, typename WT>
void nn_block(const float* x, int64_t ldx, const WT* const* w, int64_t ldw, const float* scale, const float* bias,
              float* y, int64_t ldy, int64_t K, int last_lanes) {
  const typename Isa::Mask mask = Isa::mask(last_lanes);
  typename Isa::V acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = Isa::zero();
  for (int64_t k = 0; k < K; ++k) {
    for (int j = 0; j < NV; j += 16 / Isa::kW)
      _mm_prefetch(reinterpret_cast<const char*>(w[j] + (k + kPrefetchRows) * ldw), _MM_HINT_T0);
    typename Isa::V wv[NV];
    for (int j = 0; j < NV; ++j) {
      if constexpr (std::is_same<WT, float>::value)
        wv[j] = (MASKED && j == NV - 1) ? Isa::load(w[j] + k * ldw, mask) : Isa::load(w[j] + k * ldw);
      else
        wv[j] = load_w(w[j] + k * ldw);
    }
    for (int i = 0; i < MR; ++i) {
      const typename Isa::V xb = Isa::set1(x[i * ldx + k]);
      for (int j = 0; j < NV; ++j) acc[i][j] = Isa::fma(xb, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NV; ++j) {
      const bool masked = MASKED && j == NV - 1;
      typename Isa::V r = acc[i][j];
      if (scale != nullptr)
        r = Isa::mul(r, masked ? Isa::load(scale + j * Isa::kW, mask) : Isa::load(scale + j * Isa::kW));
      if (bias != nullptr)
        r = Isa::add(r, masked ? Isa::load(bias + j * Isa::kW, mask) : Isa::load(bias + j * Isa::kW));
      if (masked) Isa::store(y + i * ldy + j * Isa::kW, r, mask);
      else Isa::store(y + i * ldy + j * Isa::kW, r);
    }
  }
}

// y[0:MR, 0:NR] = x[0:MR, :] . w[0:NR, :]^T (+ bias): per output, kW lane sums over k in order, then Isa::sum.
template <int MR, int NR>
void nt_block(const float* x, int64_t ldx, const float* w, int64_t ldw, const float* bias, float* y, int64_t ldy,
              int64_t K) {
  typename Isa::V acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = Isa::zero();
  const int64_t full = K - K % Isa::kW;
  for (int64_t k = 0; k < full; k += Isa::kW) {
    typename Isa::V wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = Isa::load(w + j * ldw + k);
    for (int i = 0; i < MR; ++i) {
      const typename Isa::V xv = Isa::load(x + i * ldx + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = Isa::fma(xv, wv[j], acc[i][j]);
    }
  }
  if (full < K) {  // the ragged end of k: masked lanes load zeros, and x * 0 adds nothing
    const typename Isa::Mask mask = Isa::mask(static_cast<int>(K - full));
    typename Isa::V wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = Isa::load(w + j * ldw + full, mask);
    for (int i = 0; i < MR; ++i) {
      const typename Isa::V xv = Isa::load(x + i * ldx + full, mask);
      for (int j = 0; j < NR; ++j) acc[i][j] = Isa::fma(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[i * ldy + j] = Isa::sum(acc[i][j]) + (bias != nullptr ? bias[j] : 0.0f);
}

template <typename WT>
using NnFn = void (*)(const float*, int64_t, const WT* const*, int64_t, const float*, const float*, float*, int64_t,
                      int64_t, int);
using NtFn = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t, int64_t);

template <int MR, int NV, typename WT>
constexpr NnFn<WT> nn_of(bool masked) {
  constexpr int nv = std::min(NV, max_nv<MR>());
  return masked ? nn_block<MR, nv, true, WT> : nn_block<MR, nv, false, WT>;
}

template <int MR, typename WT>
constexpr NnFn<WT> nn_pick(int nv, bool masked) {
  switch (std::min(nv, max_nv<MR>())) {
    case 1: return nn_of<MR, 1, WT>(masked);
    case 2: return nn_of<MR, 2, WT>(masked);
    case 3: return nn_of<MR, 3, WT>(masked);
    case 4: return nn_of<MR, 4, WT>(masked);
    case 5: return nn_of<MR, 5, WT>(masked);
    case 6: return nn_of<MR, 6, WT>(masked);
    case 7: return nn_of<MR, 7, WT>(masked);
    default: return nn_of<MR, 8, WT>(masked);
  }
}

// Only the shapes run_tile asks for: mr <= kWideMr with nv <= kWideNv, mr <= kTallMr with nv <= kTallNv.
template <int MR, typename WT>
constexpr NnFn<WT> nn_tall(int nv, bool masked) {
  if (nv == 1 || kTallNv == 1) return masked ? nn_block<MR, 1, true, WT> : nn_block<MR, 1, false, WT>;
  return masked ? nn_block<MR, kTallNv, true, WT> : nn_block<MR, kTallNv, false, WT>;
}

template <typename WT>
NnFn<WT> nn_fn(int mr, int nv, bool masked) {
  switch (mr) {
    case 1: return nn_pick<1, WT>(nv, masked);
    case 2: return nn_pick<2, WT>(nv, masked);
    case 3: return nn_pick<3, WT>(nv, masked);
    case 4: return nn_pick<4, WT>(nv, masked);
    case 5: return nn_pick<5, WT>(nv, masked);
    case 6: return nn_pick<6, WT>(nv, masked);
    case 7: return nn_tall<7, WT>(nv, masked);
    case 8: return nn_tall<8, WT>(nv, masked);
    case 9: return nn_tall<9, WT>(nv, masked);
    case 10: return nn_tall<10, WT>(nv, masked);
    case 11: return nn_tall<11, WT>(nv, masked);
    default: return nn_tall<12, WT>(nv, masked);
  }
}

template <int MR>
constexpr NtFn nt_pick(int nr) {
  switch (nr) {
    case 1: return nt_block<MR, 1>;
    case 2: return nt_block<MR, 2>;
    case 3: return nt_block<MR, 3>;
    default: return nt_block<MR, 4>;
  }
}

NtFn nt_fn(int mr, int nr) {
  switch (mr) {
    case 1: return nt_pick<1>(nr);
    case 2: return nt_pick<2>(nr);
    case 3: return nt_pick<std::min(3, kNtMr)>(nr);
    default: return nt_pick<kNtMr>(nr);
  }
}

// Columns [n0, n0 + nw) of one batch entry, every row. WT: the weights' type (float16 and int8 weights are
// packed; int8 with this entry's per-column scale).
template <typename WT>
void run_tile(const MatmulArgs& a, const float* x, const WT* w, const float* scale, const float* bias, float* y,
              int64_t n0, int64_t nw) {
  const int64_t M = a.m, K = a.k, N = a.n;
  if (!a.transpose_w || !std::is_same<WT, float>::value) {
    // This tile's W: columns n0.. of the [K, N] matrix (row stride N), or its own contiguous block, as
    // kTile / kPackCols contiguous [K, kPackCols] parts (a tall strip reads one part front to back).
    const WT* wt = a.packed ? w + (n0 / kTile) * K * kTile : w + n0;
    const int64_t ldw = a.packed ? kPackCols : N;
    // Where the vector of tile column c starts (row 0).
    auto column = [&](int64_t c) { return a.packed ? wt + (c / kPackCols) * K * kPackCols + c % kPackCols : wt + c; };
    const bool wide = kOnlyWide || M <= kWideMr;
    const bool pairs = M > 2 && M <= kPairsUpTo;
    const int64_t strip = (M == 1 ? max_nv<1>() : (M == 2 || pairs) ? max_nv<2>() : wide ? kWideNv : kTallNv) * Isa::kW;
    const int64_t row_block = pairs ? 2 : wide ? kWideMr : kTallMr;
    const int64_t blocks = (M + row_block - 1) / row_block;  // row blocks of balanced sizes
    for (int64_t s0 = 0; s0 < nw; s0 += strip) {
      const int64_t sw = std::min(strip, nw - s0);
      const int nv = static_cast<int>((sw + Isa::kW - 1) / Isa::kW);
      const int last = static_cast<int>(sw - (nv - 1) * Isa::kW);
      const bool masked = last != Isa::kW;
      for (int64_t blk = 0; blk < blocks; ++blk) {
        const int64_t m0 = M * blk / blocks, m1 = M * (blk + 1) / blocks;
        const WT* starts[2 * kTile / Isa::kW];
        for (int j = 0; j < nv; ++j) starts[j] = column(s0 + j * Isa::kW);
        nn_fn<WT>(static_cast<int>(m1 - m0), nv, masked)(x + m0 * K, K, starts, ldw,
                                                     scale == nullptr ? nullptr : scale + n0 + s0,
                                                     bias == nullptr ? nullptr : bias + n0 + s0, y + m0 * N + n0 + s0,
                                                     N, K, last);
      }
    }
  } else {
    for (int64_t c0 = n0; c0 < n0 + nw; c0 += kNtNr) {
      const int nr = static_cast<int>(std::min<int64_t>(kNtNr, n0 + nw - c0));
      for (int64_t m0 = 0; m0 < M; m0 += kNtMr) {
        const int mr = static_cast<int>(std::min<int64_t>(kNtMr, M - m0));
        nt_fn(mr, nr)(x + m0 * K, K, reinterpret_cast<const float*>(w) + c0 * K, K,
                      bias == nullptr ? nullptr : bias + c0, y + m0 * N + c0, N, K);
      }
    }
  }
}

}  // namespace

void BPD_RUN_UNITS(const MatmulArgs& a, int64_t begin, int64_t end) {
  const int64_t tiles = num_tiles(a.n), per_entry = units_per_entry(a), unit_cols = a.unit_tiles * kTile;
  const int64_t w_stride = a.packed ? tiles * a.k * kTile : a.k * a.n;  // floats per batch entry of W
  for (int64_t u = begin; u < end; ++u) {
    const int64_t b = u / per_entry, n0 = (u % per_entry) * unit_cols;
    const int64_t wb = a.w_shared ? 0 : b;
    const float* bias = a.bias == nullptr ? nullptr : a.bias + wb * a.n;
    const float* x = a.x + b * a.m * a.k;
    float* y = a.y + b * a.m * a.n;
    const int64_t nw = std::min(unit_cols, a.n - n0);
    if (a.w_int8)
      run_tile(a, x, static_cast<const int8_t*>(a.w) + wb * w_stride, a.w_scale + wb * a.n, bias, y, n0, nw);
    else if (a.w_half)
      run_tile(a, x, static_cast<const uint16_t*>(a.w) + wb * w_stride, nullptr, bias, y, n0, nw);
    else
      run_tile(a, x, static_cast<const float*>(a.w) + wb * w_stride, nullptr, bias, y, n0, nw);
  }
}

}  // namespace bpd
