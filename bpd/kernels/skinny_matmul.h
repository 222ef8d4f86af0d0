// Skinny matmul: y[b, M, N] = x[b, M, K] . W[b, K, N] (+ bias[b, N]), float32 (a packed W may be float16, or int8
// with a float32 scale per column: y = (x . W) * scale + bias), for few rows M.
//
// Why: at batch 1 a decoder call multiplies a handful of rows (1 for greedy, k for a verification) by every weight
// matrix. The time is that of reading the weights, so a kernel that streams each weight once for all M rows
// makes k rows cost about what one row costs (DESIGN §8). XLA's CPU backend splits such products differently for
// each M and reads the weights at a fraction of the one-row rate.
//
// Bitwise independence of M: every output element is summed in one order whatever M is (k ascending, one FMA per
// term, then the bias; with a transposed W, 16-lane partial sums in k order, then one fixed lane reduction), and
// the row blocking only decides which rows share a weight load. So a verification of k tokens computes exactly
// the logits that k greedy steps would.
#pragma once

#include <cstdint>

namespace bpd {

struct MatmulArgs {
  const float* x;     // [batch, m, k]
  const void* w;      // float32 [w_batch, k, n]; [w_batch, n, k] with transpose_w; packed: see kPackCols (float32,
                      // or float16 with w_half)
  const float* bias;  // [w_batch, n], or nullptr
  float* y;           // [batch, m, n]
  int64_t batch, m, k, n;
  bool w_shared;      // w_batch == 1: every batch entry multiplies the same W (and bias)
  bool transpose_w;   // W stored [n, k]: y = x . W^T (the tied vocabulary projection)
  bool w_half;        // packed W in float16 (IEEE half), widened to float32 as it is read: half the bytes
  bool w_int8;        // packed W in int8, widened to float32 as it is read (a quarter of the bytes), each column's
                      // finished sum times w_scale[w_batch, n]
  const float* w_scale;
  bool packed;        // W stored column tile by column tile, each [k, kTile] contiguous, zeros past n (pack_nn):
                      // the kernel then reads W front to back, which DRAM and the prefetchers stream at full rate
  int64_t unit_tiles = 1;  // column tiles per unit of work: 2 for one row (unit_tiles_for), else 1
};

// Output columns are cut into tiles of kTile; a unit of work is one (batch entry, unit_tiles column tiles).
constexpr int64_t kTile = 64;
// A packed tile is kTile / kPackCols parts, each [k, kPackCols] contiguous: [w_batch, tiles, parts, k, kPackCols].
constexpr int64_t kPackCols = 32;
inline int64_t num_tiles(int64_t n) { return (n + kTile - 1) / kTile; }

// One row takes two tiles per unit: a row's block then holds 128 columns, 8 AVX-512 accumulators whose chains over k
// keep both FMA pipes busy (4 accumulators left each pipe waiting on the FMA latency, and every greedy step and
// proposal head is one-row products). Each output is still one accumulator over k in order.
inline int64_t unit_tiles_for(const MatmulArgs& a) { return a.m == 1 && !a.transpose_w ? 2 : 1; }
inline int64_t units_per_entry(const MatmulArgs& a) { return (num_tiles(a.n) + a.unit_tiles - 1) / a.unit_tiles; }
inline int64_t num_units(const MatmulArgs& a) { return a.batch * units_per_entry(a); }

// Compute units [begin, end): every row of those column tiles.
void run_units_avx512(const MatmulArgs& a, int64_t begin, int64_t end);
void run_units_avx2(const MatmulArgs& a, int64_t begin, int64_t end);

}  // namespace bpd
