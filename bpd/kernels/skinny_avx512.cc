// The skinny-matmul micro-kernels for AVX-512 (compiled with -mavx512f -mfma; chosen at run time).
#include <cstdint>
#include <immintrin.h>

namespace bpd {
namespace {
struct Isa {
  using V = __m512;
  using Mask = __mmask16;
  static constexpr int kW = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float f) { return _mm512_set1_ps(f); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load_half(const uint16_t* p) {  // 16 float16 widened
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static V load_int8(const int8_t* p) {  // 16 int8 widened
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static V load(const float* p, Mask m) { return _mm512_maskz_loadu_ps(m, p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static void store(float* p, V v, Mask m) { _mm512_mask_storeu_ps(p, m, v); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static Mask mask(int lanes) { return lanes >= 16 ? Mask(0xFFFF) : Mask((1u << lanes) - 1u); }
  static float sum(V v) {  // one fixed tree: halves, then quarters, then pairs
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));
    return _mm_cvtss_f32(q);
  }
};
}  // namespace
}  // namespace bpd

#define BPD_RUN_UNITS run_units_avx512
#include "skinny_units.h"
