// The XLA FFI entry of the skinny matmul (skinny_matmul.h): argument checks, the instruction set chosen at run
// time, and a thread pool that stays alive between calls, so that a decoding step's dozens of small products pay
// no thread start: idle workers spin briefly (the next product of a step comes within microseconds), then sleep.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <functional>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <immintrin.h>
#include <sched.h>

#include "skinny_matmul.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace bpd {
namespace {

using RunUnits = void (*)(const MatmulArgs&, int64_t, int64_t);

bool has_avx512() { return __builtin_cpu_supports("avx512f"); }
bool has_avx2() {  // F16C widens float16 weights; every AVX2 CPU has it
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

RunUnits pick_isa() {
  const char* force = std::getenv("BPD_SKINNY_ISA");  // 'avx2' to test the narrower path on an AVX-512 machine
  if (has_avx512() && !(force != nullptr && std::string(force) == "avx2")) return run_units_avx512;
  if (has_avx2()) return run_units_avx2;
  return nullptr;
}

int default_threads() {
  if (const char* s = std::getenv("BPD_SKINNY_THREADS")) return std::max(1, std::atoi(s));
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

class Pool {
 public:
  explicit Pool(int threads) {
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { Work(); });
  }
  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs unit(u) for every u in [0, units): the caller and the workers claim units one at a time, so a worker
  // that the OS has not scheduled (XLA's own threads share the cores) delays nothing: the caller does its share.
  // If another call holds the pool (XLA may run two products at once), this one runs alone on its caller.
  //
  // A claim is a compare-and-swap on one word, `ticket_` = job id | units | next unit, published (release) after
  // the job; a worker that claims a unit has therefore seen that job, and the job's caller cannot return (it waits
  // for every unit to be done) before the worker is finished with it. A worker that wakes late finds the ticket
  // exhausted, or a later job's, and never touches a finished job.
  void Run(int64_t units, const std::function<void(int64_t)>& unit) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock() || workers_.empty() || units <= 1 || units > kMaxUnits) {
      for (int64_t u = 0; u < units; ++u) unit(u);
      return;
    }
    job_ = &unit;
    done_.store(0, std::memory_order_relaxed);
    job_id_ = (job_id_ + 1) & kIdMask;
    ticket_.store((job_id_ << 40) | (static_cast<uint64_t>(units) << 20), std::memory_order_release);
    {
      std::lock_guard<std::mutex> lock(mu_);
      epoch_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    Claim();
    while (done_.load(std::memory_order_acquire) != units) _mm_pause();
  }

 private:
  static constexpr int64_t kMaxUnits = (1 << 20) - 1;
  static constexpr uint64_t kIdMask = (1 << 24) - 1, kField = (1 << 20) - 1;

  void Claim() {
    for (;;) {
      uint64_t t = ticket_.load(std::memory_order_acquire);
      const uint64_t next = t & kField, units = (t >> 20) & kField;
      if (next >= units) return;
      if (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
      (*job_)(static_cast<int64_t>(next));  // this ticket's job: its caller waits for this unit
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  void Work() {
    uint64_t seen = 0;
    for (;;) {
      auto idle_since = std::chrono::steady_clock::now();
      int spins = 0;
      while (epoch_.load(std::memory_order_acquire) == seen) {
        _mm_pause();
        if (++spins % 256 == 0 && std::chrono::steady_clock::now() - idle_since > std::chrono::microseconds(300)) {
          std::unique_lock<std::mutex> lock(mu_);
          cv_.wait(lock, [&] { return epoch_.load(std::memory_order_acquire) != seen; });
        }
      }
      seen = epoch_.load(std::memory_order_acquire);
      Claim();
    }
  }

  std::vector<std::thread> workers_;
  std::mutex busy_, mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> epoch_{0};    // bumped per job: wakes the workers (a hint; the ticket decides)
  std::atomic<uint64_t> ticket_{0};   // job id (24 bits) | units (20 bits) | next unit (20 bits)
  std::atomic<int64_t> done_{0};
  const std::function<void(int64_t)>* job_ = nullptr;
  uint64_t job_id_ = 0;
};

Pool& pool() {
  static Pool* p = new Pool(default_threads());  // never destroyed: workers may outlive static destruction order
  return *p;
}

// Bytes per weight: int8, float16 or float32.
int64_t weight_bytes(bool int8, bool half) { return int8 ? 1 : half ? 2 : 4; }

// Below this many weight bytes a product runs on one thread: the hand-off would cost more than it saves.
constexpr int64_t kParallelBytes = 96 * 1024;

void run(MatmulArgs a, RunUnits units) {
  a.unit_tiles = unit_tiles_for(a);
  const int64_t total = num_units(a);
  const int64_t bytes = (a.w_shared ? 1 : a.batch) * a.k * a.n * weight_bytes(a.w_int8, a.w_half);
  if (bytes < kParallelBytes) {
    units(a, 0, total);
    return;
  }
  pool().Run(total, [&](int64_t u) { units(a, u, u + 1); });
}

// x [B, M, K]; w [Bw, K, N] (or [..., K, N], the leading axes' product Bw), [Bw, N, K] (transpose_w) or [Bw, tiles, parts, K, kPackCols] (packed), Bw = 1 or B; or
// with w_index >= 0 one more leading axis, of which only entry w_index is read (a head's weights, not copied);
// bias [Bw, N] or [0, N] (none); scale (int8 weights only, each column's factor) [Bw, N], with w_index [H, Bw, N]
// read at entry w_index as w is, or [0, N] (none); y [B, M, N].
ffi::Error SkinnyMatmul(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer bias, ffi::AnyBuffer scale,
                        ffi::Result<ffi::AnyBuffer> y, int64_t transpose_w, int64_t packed, int64_t w_index) {
  static const RunUnits units = pick_isa();
  if (units == nullptr)
    return ffi::Error::InvalidArgument("bpd skinny matmul: this CPU has neither AVX-512 nor AVX2+FMA");
  const bool w_half = w.element_type() == ffi::F16, w_int8 = w.element_type() == ffi::S8;
  if (x.element_type() != ffi::F32 || !(w.element_type() == ffi::F32 || ((w_half || w_int8) && packed)) ||
      bias.element_type() != ffi::F32 || scale.element_type() != ffi::F32 || y->element_type() != ffi::F32)
    return ffi::Error::InvalidArgument(
        "bpd skinny matmul: float32 operands only, but for packed float16 or int8 weights (float32 scale)");
  const auto xd = x.dimensions(), yd = y->dimensions(), bd = bias.dimensions();
  const auto w_dims = w.dimensions();
  const size_t w_rank = (packed ? 5 : 3) + (w_index >= 0 ? 1 : 0);
  // A plain w may have more leading axes, read as one (a decoding cache [B, H, K, S] as [B * H, K, S]): reshaped
  // in the program instead, a freshly written cache was copied by XLA's CPU backend on every call.
  const bool plain = !packed && w_index < 0;
  if (xd.size() != 3 || !(w_dims.size() == w_rank || (plain && w_dims.size() > w_rank)) || yd.size() != 3 ||
      bd.size() != 2)
    return ffi::Error::InvalidArgument("bpd skinny matmul: operand ranks do not match the layout");
  const char* w_data = static_cast<const char*>(w.untyped_data());
  std::vector<int64_t> wd(w_dims.begin(), w_dims.end());
  while (wd.size() > w_rank) {  // leading axes into one
    wd[1] *= wd[0];
    wd.erase(wd.begin());
  }
  if (w_index >= 0) {  // entry w_index of the leading axis
    if (w_index >= wd[0]) return ffi::Error::InvalidArgument("bpd skinny matmul: w_index out of range");
    int64_t entry = 1;
    for (size_t i = 1; i < wd.size(); ++i) entry *= wd[i];
    w_data += w_index * entry * weight_bytes(w_int8, w_half);
    wd.erase(wd.begin());
  }
  // int8 weights come with one scale per column of each weight matrix, the same leading axes as w: [(H,) Bw, N].
  const auto sd = scale.dimensions();
  const bool scaled = sd.size() > 0 && sd[0] != 0;
  const size_t s_rank = w_index >= 0 ? 3 : 2;
  if (scaled != w_int8 || (scaled && (sd.size() != s_rank || (w_index >= 0 && w_index >= sd[0]) ||
                                      sd[s_rank - 2] != wd[0] || sd[s_rank - 1] != yd[2])))
    return ffi::Error::InvalidArgument(
        "bpd skinny matmul: int8 weights need a float32 scale [(H,) Bw, N] (and only int8 weights take one)");
  const float* scale_data = !scaled ? nullptr
                                    : reinterpret_cast<const float*>(scale.untyped_data()) +
                                          (w_index >= 0 ? w_index * sd[1] * sd[2] : 0);
  MatmulArgs a;
  a.batch = xd[0];
  a.m = xd[1];
  a.k = xd[2];
  a.transpose_w = transpose_w != 0;
  a.packed = packed != 0;
  a.w_half = w_half;
  a.w_int8 = w_int8;
  a.w_scale = scale_data;
  a.n = yd[2];
  const int64_t wk = a.packed ? wd[3] : a.transpose_w ? wd[2] : wd[1];
  const bool w_n_ok = a.packed ? (wd[1] == num_tiles(a.n) && wd[2] == kTile / kPackCols && wd[4] == kPackCols)
                               : (a.transpose_w ? wd[1] : wd[2]) == a.n;
  a.w_shared = wd[0] == 1;
  if (wk != a.k || !w_n_ok || (a.packed && a.transpose_w) || !(wd[0] == 1 || wd[0] == a.batch) ||
      yd[0] != a.batch || yd[1] != a.m || !(bd[0] == 0 || (bd[0] == wd[0] && bd[1] == a.n)))
    return ffi::Error::InvalidArgument("bpd skinny matmul: shapes of x, w, bias and y do not agree");
  a.x = reinterpret_cast<const float*>(x.untyped_data());
  a.w = w_data;
  a.bias = bd[0] == 0 ? nullptr : reinterpret_cast<const float*>(bias.untyped_data());
  a.y = reinterpret_cast<float*>(y->untyped_data());
  if (a.batch * a.m * a.n == 0) return ffi::Error::Success();
  if (a.k == 0) {
    std::fill(a.y, a.y + a.batch * a.m * a.n, 0.0f);
    return ffi::Error::Success();
  }
  run(a, units);
  return ffi::Error::Success();
}

// The first index of the maximum of row[0, v), a NaN (its first index) counting as the maximum: jnp.argmax's rule.
// Two passes of four lanes (SSE, which every x86-64 has): the maximum and whether a NaN occurs, then the first
// index equal to it. A serial compare per element took several microseconds for a 4000-token vocabulary, a
// sizeable share of a small model's greedy step. -0 and +0 compare equal, so either one found first is the
// answer, as in a serial scan.
int64_t argmax_row(const float* row, int64_t v) {
  __m128 max0 = _mm_set1_ps(-std::numeric_limits<float>::infinity()), max1 = max0;
  __m128 nan = _mm_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= v; i += 8) {
    const __m128 a = _mm_loadu_ps(row + i), b = _mm_loadu_ps(row + i + 4);
    nan = _mm_or_ps(nan, _mm_cmpunord_ps(a, b));
    max0 = _mm_max_ps(max0, a);
    max1 = _mm_max_ps(max1, b);
  }
  float lanes[4];
  _mm_storeu_ps(lanes, _mm_max_ps(max0, max1));
  float best = std::max(std::max(lanes[0], lanes[1]), std::max(lanes[2], lanes[3]));
  bool any_nan = _mm_movemask_ps(nan) != 0;
  for (; i < v; ++i) {
    any_nan |= row[i] != row[i];
    best = std::max(best, row[i]);
  }
  if (any_nan) {
    for (int64_t j = 0; j < v; ++j)
      if (row[j] != row[j]) return j;
  }
  const __m128 target = _mm_set1_ps(best);
  int64_t j = 0;
  for (; j + 4 <= v; j += 4) {
    const int hits = _mm_movemask_ps(_mm_cmpeq_ps(_mm_loadu_ps(row + j), target));
    if (hits != 0) return j + __builtin_ctz(hits);
  }
  for (; j < v; ++j)
    if (row[j] == best) return j;
  return 0;  // unreachable: best is one of the row's values
}

// argmax over the last axis of x [R, V] into y [R] (int32), argmax_row's rule. XLA's CPU backend runs its own
// argmax of a few rows of a vocabulary-wide buffer as a slow variadic reduction, and top_k as a slow custom call.
ffi::Error Argmax(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  const auto xd = x.dimensions();
  if (x.element_type() != ffi::F32 || y->element_type() != ffi::S32 || xd.size() != 2 || xd[1] == 0)
    return ffi::Error::InvalidArgument("bpd argmax: expected float32 x [R, V >= 1] and int32 y [R]");
  const float* data = reinterpret_cast<const float*>(x.untyped_data());
  int32_t* out = reinterpret_cast<int32_t*>(y->untyped_data());
  for (int64_t r = 0; r < xd[0]; ++r) out[r] = static_cast<int32_t>(argmax_row(data + r * xd[1], xd[1]));
  return ffi::Error::Success();
}

// out[0, d) = table[id] of table [v, d], as jnp.take(table, id, axis=0): a negative id counts from the end, and an
// id still outside [0, v) gives a row of NaN.
void take_row(const float* table, int64_t v, int64_t d, int64_t id, float* out) {
  const int64_t i = id < 0 ? id + v : id;
  if (0 <= i && i < v) std::copy(table + i * d, table + (i + 1) * d, out);
  else std::fill(out, out + d, std::numeric_limits<float>::quiet_NaN());
}

// Rows of a table: y[i] = table[ids[i]] for table [V, D] float32, ids [R] int32, y [R, D]; as jnp.take(table, ids,
// axis=0): a negative id counts from the end, and an id still outside [0, V) gives a row of NaN. XLA's CPU backend
// fuses such a gather of a few decoding rows with what follows it and splits the fusion over threads (its cost
// model counts the whole table), which took tens of microseconds for a handful of rows.
ffi::Error TakeRows(ffi::AnyBuffer table, ffi::AnyBuffer ids, ffi::Result<ffi::AnyBuffer> y) {
  const auto td = table.dimensions(), id = ids.dimensions(), yd = y->dimensions();
  if (table.element_type() != ffi::F32 || ids.element_type() != ffi::S32 || y->element_type() != ffi::F32 ||
      td.size() != 2 || id.size() != 1 || yd.size() != 2 || yd[0] != id[0] || yd[1] != td[1])
    return ffi::Error::InvalidArgument("bpd take_rows: expected float32 table [V, D], int32 ids [R], float32 y [R, D]");
  const float* data = reinterpret_cast<const float*>(table.untyped_data());
  const int32_t* index = reinterpret_cast<const int32_t*>(ids.untyped_data());
  float* out = reinterpret_cast<float*>(y->untyped_data());
  const int64_t v = td[0], d = td[1];
  for (int64_t r = 0; r < id[0]; ++r) take_row(data, v, d, index[r], out + r * d);
  return ffi::Error::Success();
}

// One packed weight matrix of the fused heads: `pack`'s [tiles, parts, K, kPackCols] layout in float32, float16 or
// int8 (with its per-column scale), at entry `index` of a stack of them when index >= 0.
struct PackedOperand {
  const char* w = nullptr;
  const float* scale = nullptr;
  bool half = false, int8 = false;
};

// Checks a packed operand against [(H,) tiles, kTile / kPackCols, K, kPackCols] and its scale against [(H,) N] (or
// [0, N]: none, float32 and float16 only), and points at entry `index` (index < 0: no stack axis). Empty string: ok.
std::string packed_operand(const ffi::AnyBuffer& w, const ffi::AnyBuffer& scale, int64_t stack, int64_t k, int64_t n,
                           int64_t index, PackedOperand* out) {
  const auto wd = w.dimensions(), sd = scale.dimensions();
  const bool stacked = stack >= 0;
  const size_t rank = stacked ? 5 : 4, lead = stacked ? 1 : 0;
  out->half = w.element_type() == ffi::F16;
  out->int8 = w.element_type() == ffi::S8;
  if (!(out->half || out->int8 || w.element_type() == ffi::F32) || scale.element_type() != ffi::F32)
    return "packed weights float32, float16 or int8, scales float32";
  if (wd.size() != rank || (stacked && wd[0] != stack) || wd[lead] != num_tiles(n) ||
      wd[lead + 1] != kTile / kPackCols || wd[lead + 2] != k || wd[lead + 3] != kPackCols)
    return "a packed weight's shape does not match the layout for its [K, N]";
  const bool scaled = sd.size() > 0 && sd[0] != 0;
  if (scaled != out->int8 || (scaled && (sd.size() != lead + 1 || (stacked && sd[0] != stack) || sd[lead] != n)))
    return "int8 weights need a float32 scale [(H,) N], and only int8 weights take one";
  const int64_t entry = num_tiles(n) * kTile * k * weight_bytes(out->int8, out->half);
  out->w = static_cast<const char*>(w.untyped_data()) + (stacked ? index * entry : 0);
  out->scale = scaled ? reinterpret_cast<const float*>(scale.untyped_data()) + (stacked ? index * n : 0) : nullptr;
  return "";
}

// y[M, N] = x[M, K] . W (+ bias[N]), W a packed operand: the product every other call of the kernel computes.
void packed_product(const float* x, int64_t m, int64_t k, int64_t n, const PackedOperand& w, const float* bias,
                    float* y, RunUnits units) {
  MatmulArgs a;
  a.x = x;
  a.w = w.w;
  a.bias = bias;
  a.y = y;
  a.batch = 1;
  a.m = m;
  a.k = k;
  a.n = n;
  a.w_shared = true;
  a.transpose_w = false;
  a.w_half = w.half;
  a.w_int8 = w.int8;
  a.w_scale = w.scale;
  a.packed = true;
  run(a, units);
}

// Sequential proposal heads 2..k' in one call (bpd/model.py, Transformer._propose_sequential; layers.MultiOutput):
// for each head n in turn, on every row b,
//   x = hidden[b] + (embedding[token] * embed_scale) . token_w[n]      token: head 1's, then head n + 1's choice
//   v = layer_norm(relu(x . wi[n] + wi_bias[n]) . wo[n] + wo_bias[n] + x)
//   logits[b, n] = v . projection;   tokens[b, n] = draft_ids[argmax] (or the argmax, without a draft vocabulary)
// Why one call: each head is a chain of M = B products of a few hundred KB, each waiting on the one before, and
// XLA's CPU backend ran every head as a dozen kernels with a dozen small fusions between them, which cost more
// than the products. The products here are the kernel's own (the same sums, bit for bit); the layer norm is
// flax's (fast variance: mean of x and of x², rsqrt) summed in index order, so it may round a last bit
// differently from XLA's, which only heads 2..k ever read: proposals, never what verification accepts.
ffi::Error SequentialHeads(ffi::AnyBuffer hidden, ffi::AnyBuffer first, ffi::AnyBuffer embedding,
                           ffi::AnyBuffer draft_ids, ffi::AnyBuffer token_w, ffi::AnyBuffer token_scale,
                           ffi::AnyBuffer wi, ffi::AnyBuffer wi_scale, ffi::AnyBuffer wi_bias, ffi::AnyBuffer wo,
                           ffi::AnyBuffer wo_scale, ffi::AnyBuffer wo_bias, ffi::AnyBuffer ln_scale,
                           ffi::AnyBuffer ln_bias, ffi::AnyBuffer projection, ffi::AnyBuffer projection_scale,
                           ffi::Result<ffi::AnyBuffer> logits, ffi::Result<ffi::AnyBuffer> tokens, float embed_scale,
                           float epsilon) {
  static const RunUnits units = pick_isa();
  const auto fail = [](const std::string& what) {
    return ffi::Error::InvalidArgument("bpd sequential heads: " + what);
  };
  if (units == nullptr) return fail("this CPU has neither AVX-512 nor AVX2+FMA");
  const auto hd = hidden.dimensions(), ed = embedding.dimensions(), wib = wi_bias.dimensions();
  const auto ld = logits->dimensions(), td = tokens->dimensions(), dd = draft_ids.dimensions();
  if (hd.size() != 2 || ed.size() != 2 || wib.size() != 2 || ld.size() != 3 || td.size() != 2 || dd.size() != 1 ||
      first.dimensions().size() != 1)
    return fail("operand ranks do not match hidden [B, D], first [B], embedding [V, D], draft_ids [R], "
                "wi_bias [H, F], logits [B, heads, X], tokens [B, heads]");
  const int64_t b = hd[0], d = hd[1], v = ed[0], f = wib[1], stack = wib[0], heads = ld[1], x_cols = ld[2];
  const int64_t r = dd[0];
  if (hidden.element_type() != ffi::F32 || embedding.element_type() != ffi::F32 || first.element_type() != ffi::S32 ||
      draft_ids.element_type() != ffi::S32 || wi_bias.element_type() != ffi::F32 ||
      wo_bias.element_type() != ffi::F32 || ln_scale.element_type() != ffi::F32 ||
      ln_bias.element_type() != ffi::F32 || logits->element_type() != ffi::F32 || tokens->element_type() != ffi::S32)
    return fail("hidden, embedding, biases, layer norm and logits are float32; first, draft_ids and tokens int32");
  if (ed[1] != d || first.dimensions()[0] != b || ld[0] != b || td[0] != b || td[1] != heads || heads > stack ||
      (r != 0 && r != x_cols) || (r == 0 && x_cols != v) || wo_bias.dimensions().size() != 2 ||
      wo_bias.dimensions()[0] != stack || wo_bias.dimensions()[1] != d || ln_scale.dimensions().size() != 1 ||
      ln_scale.dimensions()[0] != d || ln_bias.dimensions().size() != 1 || ln_bias.dimensions()[0] != d)
    return fail("shapes do not agree (B rows, D features, H >= heads stacked heads, X = R draft ids or V)");
  if (b == 0 || heads == 0) return ffi::Error::Success();
  const float* hidden_data = reinterpret_cast<const float*>(hidden.untyped_data());
  const float* table = reinterpret_cast<const float*>(embedding.untyped_data());
  const int32_t* first_data = reinterpret_cast<const int32_t*>(first.untyped_data());
  const int32_t* ids = reinterpret_cast<const int32_t*>(draft_ids.untyped_data());
  const float* bi = reinterpret_cast<const float*>(wi_bias.untyped_data());
  const float* bo = reinterpret_cast<const float*>(wo_bias.untyped_data());
  const float* gamma = reinterpret_cast<const float*>(ln_scale.untyped_data());
  const float* beta = reinterpret_cast<const float*>(ln_bias.untyped_data());
  float* logits_out = reinterpret_cast<float*>(logits->untyped_data());
  int32_t* tokens_out = reinterpret_cast<int32_t*>(tokens->untyped_data());
  PackedOperand proj;
  std::string error = packed_operand(projection, projection_scale, -1, d, x_cols, -1, &proj);
  if (!error.empty()) return fail("projection: " + error);

  std::vector<int32_t> token(first_data, first_data + b);
  std::vector<float> e(b * d), x(b * d), h(b * f), o(b * d), y(b * x_cols);
  for (int64_t n = 0; n < heads; ++n) {
    PackedOperand tw, w1, w2;
    error = packed_operand(token_w, token_scale, stack, d, d, n, &tw);
    if (error.empty()) error = packed_operand(wi, wi_scale, stack, d, f, n, &w1);
    if (error.empty()) error = packed_operand(wo, wo_scale, stack, f, d, n, &w2);
    if (!error.empty()) return fail("token_w, wi or wo: " + error);
    for (int64_t row = 0; row < b; ++row) {  // the token's embedding (as take_rows reads it), at the input's scale
      take_row(table, v, d, token[row], e.data() + row * d);
      for (int64_t i = row * d; i < (row + 1) * d; ++i) e[i] *= embed_scale;
    }
    packed_product(e.data(), b, d, d, tw, nullptr, x.data(), units);
    for (int64_t i = 0; i < b * d; ++i) x[i] = hidden_data[i] + x[i];
    packed_product(x.data(), b, d, f, w1, bi + n * f, h.data(), units);
    for (float& value : h) value = value != value ? value : value > 0.0f ? value : 0.0f;  // relu, NaN kept
    packed_product(h.data(), b, f, d, w2, bo + n * d, o.data(), units);
    for (int64_t row = 0; row < b; ++row) {  // o + x, then flax's layer norm
      float* out = o.data() + row * d;
      const float* in = x.data() + row * d;
      float sum = 0.0f, sum_sq = 0.0f;
      for (int64_t i = 0; i < d; ++i) {
        out[i] += in[i];
        sum += out[i];
        sum_sq += out[i] * out[i];
      }
      const float mean = sum / static_cast<float>(d), mean_sq = sum_sq / static_cast<float>(d);
      const float inv = 1.0f / std::sqrt(std::max(0.0f, mean_sq - mean * mean) + epsilon);
      for (int64_t i = 0; i < d; ++i) out[i] = (out[i] - mean) * (inv * gamma[i]) + beta[i];
    }
    packed_product(o.data(), b, d, x_cols, proj, nullptr, y.data(), units);
    for (int64_t row = 0; row < b; ++row) {
      const float* row_logits = y.data() + row * x_cols;
      std::copy(row_logits, row_logits + x_cols, logits_out + (row * heads + n) * x_cols);
      const int64_t choice = argmax_row(row_logits, x_cols);
      token[row] = r != 0 ? ids[choice] : static_cast<int32_t>(choice);
      tokens_out[row * heads + n] = token[row];
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace bpd

XLA_FFI_DEFINE_HANDLER_SYMBOL(BpdTakeRows, bpd::TakeRows,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(BpdSequentialHeads, bpd::SequentialHeads,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // hidden
                                  .Arg<ffi::AnyBuffer>()  // first
                                  .Arg<ffi::AnyBuffer>()  // embedding
                                  .Arg<ffi::AnyBuffer>()  // draft_ids
                                  .Arg<ffi::AnyBuffer>()  // token_w
                                  .Arg<ffi::AnyBuffer>()  // token_scale
                                  .Arg<ffi::AnyBuffer>()  // wi
                                  .Arg<ffi::AnyBuffer>()  // wi_scale
                                  .Arg<ffi::AnyBuffer>()  // wi_bias
                                  .Arg<ffi::AnyBuffer>()  // wo
                                  .Arg<ffi::AnyBuffer>()  // wo_scale
                                  .Arg<ffi::AnyBuffer>()  // wo_bias
                                  .Arg<ffi::AnyBuffer>()  // ln_scale
                                  .Arg<ffi::AnyBuffer>()  // ln_bias
                                  .Arg<ffi::AnyBuffer>()  // projection
                                  .Arg<ffi::AnyBuffer>()  // projection_scale
                                  .Ret<ffi::AnyBuffer>()  // logits
                                  .Ret<ffi::AnyBuffer>()  // tokens
                                  .Attr<float>("embed_scale")
                                  .Attr<float>("epsilon"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(BpdArgmax, bpd::Argmax,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(BpdSkinnyMatmul, bpd::SkinnyMatmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("transpose_w")
                                  .Attr<int64_t>("packed")
                                  .Attr<int64_t>("w_index"));

extern "C" {
// For bpd/matmul.py: which instruction set the kernel runs ("avx512", "avx2" or "" where it cannot run).
__attribute__((visibility("default"))) const char* bpd_skinny_isa() {
  const auto units = bpd::pick_isa();
  return units == bpd::run_units_avx512 ? "avx512" : units == bpd::run_units_avx2 ? "avx2" : "";
}
__attribute__((visibility("default"))) int bpd_skinny_threads() { return bpd::pool().size(); }
}
