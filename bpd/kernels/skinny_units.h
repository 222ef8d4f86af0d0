// The micro-kernels of skinny_matmul.h, written once over a small vector interface `Isa` and compiled once per
// instruction set (skinny_avx512.cc, skinny_avx2.cc). Include after defining `Isa`.
//
// Register blocking: an MR x (NV vectors) block of y lives in registers while k runs; each k loads NV vectors of
// one W row and broadcasts MR entries of x, so one pass over a strip of W serves MR rows. Rows beyond MR reuse the
// strip from cache (it is at most K x 64 floats).
#include <algorithm>
#include <immintrin.h>

#include "skinny_matmul.h"

namespace bpd {
namespace {

constexpr int kMaxMr = Isa::kW == 16 ? 6 : 4;   // rows per register block (x broadcasts)
constexpr int kMaxNv = Isa::kW == 16 ? 4 : 2;   // vectors per register block (columns = kMaxNv * kW)
constexpr int kNtMr = Isa::kW == 16 ? 4 : 2;    // transposed W: rows per block
constexpr int kNtNr = 4;                         // transposed W: W rows (output columns) per block
constexpr int kPrefetchRows = 16;                // W rows ahead: a strip row is one to four cache lines

// y[0:MR, 0:cols] = x[0:MR, :] . w[:, 0:cols] (+ bias), cols = NV * kW, or fewer in the last vector (MASKED).
template <int MR, int NV, bool MASKED>
void nn_block(const float* x, int64_t ldx, const float* w, int64_t ldw, const float* bias, float* y, int64_t ldy,
              int64_t K, int last_lanes) {
  const typename Isa::Mask mask = Isa::mask(last_lanes);
  typename Isa::V acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = Isa::zero();
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = w + k * ldw;
    for (int j = 0; j < NV * Isa::kW; j += 16) _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetchRows * ldw + j), _MM_HINT_T0);
    typename Isa::V wv[NV];
    for (int j = 0; j < NV; ++j)
      wv[j] = (MASKED && j == NV - 1) ? Isa::load(wk + j * Isa::kW, mask) : Isa::load(wk + j * Isa::kW);
    for (int i = 0; i < MR; ++i) {
      const typename Isa::V xb = Isa::set1(x[i * ldx + k]);
      for (int j = 0; j < NV; ++j) acc[i][j] = Isa::fma(xb, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NV; ++j) {
      const bool masked = MASKED && j == NV - 1;
      typename Isa::V r = acc[i][j];
      if (bias != nullptr) r = Isa::add(r, masked ? Isa::load(bias + j * Isa::kW, mask) : Isa::load(bias + j * Isa::kW));
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

using NnFn = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t, int64_t, int);
using NtFn = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t, int64_t);

template <int MR>
constexpr NnFn nn_pick(int nv, bool masked) {
  switch (nv) {
    case 1: return masked ? nn_block<MR, 1, true> : nn_block<MR, 1, false>;
    case 2: return masked ? nn_block<MR, 2, true> : nn_block<MR, 2, false>;
    case 3: return masked ? nn_block<MR, 3, true> : nn_block<MR, 3, false>;
    default: return masked ? nn_block<MR, 4, true> : nn_block<MR, 4, false>;
  }
}

NnFn nn_fn(int mr, int nv, bool masked) {
  switch (mr) {
    case 1: return nn_pick<1>(nv, masked);
    case 2: return nn_pick<2>(nv, masked);
    case 3: return nn_pick<3>(nv, masked);
    case 4: return nn_pick<4>(nv, masked);
    case 5: return nn_pick<std::min(5, kMaxMr)>(nv, masked);
    default: return nn_pick<kMaxMr>(nv, masked);
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

// Columns [n0, n0 + nw) of one batch entry, every row.
void run_tile(const MatmulArgs& a, const float* x, const float* w, const float* bias, float* y, int64_t n0,
              int64_t nw) {
  const int64_t M = a.m, K = a.k, N = a.n;
  if (!a.transpose_w) {
    // This tile's W: columns n0.. of the [K, N] matrix (row stride N), or its own contiguous [K, kTile] block.
    const float* wt = a.packed ? w + (n0 / kTile) * K * kTile : w + n0;
    const int64_t ldw = a.packed ? kTile : N;
    constexpr int64_t kStrip = kMaxNv * Isa::kW;
    for (int64_t s0 = 0; s0 < nw; s0 += kStrip) {
      const int64_t sw = std::min(kStrip, nw - s0);
      const int nv = static_cast<int>((sw + Isa::kW - 1) / Isa::kW);
      const int last = static_cast<int>(sw - (nv - 1) * Isa::kW);
      const bool masked = last != Isa::kW;
      for (int64_t m0 = 0; m0 < M; m0 += kMaxMr) {
        const int mr = static_cast<int>(std::min<int64_t>(kMaxMr, M - m0));
        nn_fn(mr, nv, masked)(x + m0 * K, K, wt + s0, ldw, bias == nullptr ? nullptr : bias + n0 + s0,
                              y + m0 * N + n0 + s0, N, K, last);
      }
    }
  } else {
    for (int64_t c0 = n0; c0 < n0 + nw; c0 += kNtNr) {
      const int nr = static_cast<int>(std::min<int64_t>(kNtNr, n0 + nw - c0));
      for (int64_t m0 = 0; m0 < M; m0 += kNtMr) {
        const int mr = static_cast<int>(std::min<int64_t>(kNtMr, M - m0));
        nt_fn(mr, nr)(x + m0 * K, K, w + c0 * K, K, bias == nullptr ? nullptr : bias + c0, y + m0 * N + c0, N, K);
      }
    }
  }
}

}  // namespace

void BPD_RUN_UNITS(const MatmulArgs& a, int64_t begin, int64_t end) {
  const int64_t tiles = num_tiles(a.n);
  const int64_t w_stride = a.packed ? tiles * a.k * kTile : a.k * a.n;  // floats per batch entry of W
  for (int64_t u = begin; u < end; ++u) {
    const int64_t b = u / tiles, n0 = (u % tiles) * kTile;
    const int64_t wb = a.w_shared ? 0 : b;
    run_tile(a, a.x + b * a.m * a.k, a.w + wb * w_stride, a.bias == nullptr ? nullptr : a.bias + wb * a.n,
             a.y + b * a.m * a.n, n0, std::min(kTile, a.n - n0));
  }
}

}  // namespace bpd
