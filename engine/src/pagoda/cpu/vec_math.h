// Small AVX-512 helpers shared by the native CPU ops (float32 math on 16-bit data).
#pragma once

#include <ATen/ATen.h>

#include <immintrin.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)
namespace pagoda_simd {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// e^x for x <= 0 (scores minus their running max): 2^n * 2^f with |f| <= 1/2 and a degree-7 Taylor
// polynomial for 2^f (relative error < 1e-8 before float32 rounding); x below -100 gives ~0.
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-100.0f)), _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5252733804059840e-5f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381609e-4f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

#ifdef __AVX512BF16__
// v rounded to bf16 (round to nearest even, as c10::BFloat16 does) and widened back to float32
inline __m512 round_bf16(__m512 v) {
  const __m256i r = (__m256i)_mm512_cvtneps_pbh(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(r), 16));
}
inline void store_bf16(at::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}

// silu(g) * u for 16 lanes, rounded like bf16(bf16(g / (1 + exp(-g))) * u); exp(-|g|) never overflows.
inline __m512 silu_mul_bf16(__m512 g, __m512 u) {
  const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
  const __m512 one = _mm512_set1_ps(1.0f);
  const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
  // g >= 0: exp(-g) = e; g < 0: exp(-g) = 1 / e
  const __m512 denom = _mm512_add_ps(one, _mm512_mask_div_ps(e, negative, one, e));
  return _mm512_mul_ps(round_bf16(_mm512_div_ps(g, denom)), u);
}
#endif

}  // namespace pagoda_simd
#endif
