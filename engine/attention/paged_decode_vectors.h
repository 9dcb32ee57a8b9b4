// The vector layer of paged_decode.cpp: one vector of fp32 lanes (AVX-512 where the build has it, else
// AVX2), the softmax's exp, and K/V rows widened from their stored type. Included by paged_decode.cpp
// only (an anonymous namespace: nothing is exported); part of the build's cache key (native_decode.py).
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>
#include <limits>
#include <type_traits>

namespace {

// One vector of fp32 lanes: AVX-512 where the build has it, else AVX2 (the ISA flags choose).
#ifdef __AVX512F__
using Vec = __m512;
constexpr int64_t kLanes = 16;
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec broadcast(float x) { return _mm512_set1_ps(x); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec load(const c10::BFloat16* p) {  // bf16 is the high half of an fp32
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline float sum(Vec v) { return _mm512_reduce_add_ps(v); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec div(Vec a, Vec b) { return _mm512_div_ps(a, b); }
inline Vec max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline float reduce_max(Vec v) { return _mm512_reduce_max_ps(v); }
inline Vec round_down(Vec v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
inline Vec pow2(Vec n) {  // 2^n for integral n in the normal range
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
inline Vec zero_below(Vec x, Vec limit, Vec v) {  // v where x >= limit, else 0
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, limit, _CMP_GE_OQ), v);
}
#else
using Vec = __m256;
constexpr int64_t kLanes = 8;
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec broadcast(float x) { return _mm256_set1_ps(x); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec load(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline float sum(Vec v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pairs = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs)));
}
inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec div(Vec a, Vec b) { return _mm256_div_ps(a, b); }
inline Vec max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline float reduce_max(Vec v) {
  const __m128 half = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pairs = _mm_max_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_max_ss(pairs, _mm_movehdup_ps(pairs)));
}
inline Vec round_down(Vec v) { return _mm256_floor_ps(v); }
inline Vec pow2(Vec n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline Vec zero_below(Vec x, Vec limit, Vec v) { return _mm256_and_ps(_mm256_cmp_ps(x, limit, _CMP_GE_OQ), v); }
#endif

// exp(x) for x <= 0 (scores minus their max), Cephes' expf: 2^n * p(r), r = x - n ln 2 in [-ln2/2, ln2/2].
// Relative error ~2e-7; written so the vectorizer takes it (std::exp would be a scalar libm call).
// Below kNegligible it is 0: such a weight (< 1.6e-28 of the max's 1) cannot move an fp32 sum, and
// kept, weights and their products could go denormal, which x86 handles in microcode; real attention is
// peaked, most keys scoring far below the max. (No speed change measured on the engine's own caches.)
constexpr float kNegligible = -64.0f;

// Written out as vector code: the compiler had left a scalar loop of the same formula scalar (the
// softmax's exp and max were ~45% of the kernel's time at 2.6k keys, 1 thread, measured by removing them).
inline Vec exp_nonpositive(Vec x) {
  const Vec limit = broadcast(kNegligible);
  const Vec clamped = max(x, limit);
  const Vec n = round_down(fmadd(clamped, broadcast(1.44269504088896341f), broadcast(0.5f)));
  const Vec r = fmadd(n, broadcast(2.12194440e-4f), fmadd(n, broadcast(-0.693359375f), clamped));
  Vec p = broadcast(1.9875691500e-4f);
  p = fmadd(p, r, broadcast(1.3981999507e-3f));
  p = fmadd(p, r, broadcast(8.3334519073e-3f));
  p = fmadd(p, r, broadcast(4.1665795894e-2f));
  p = fmadd(p, r, broadcast(1.6666665459e-1f));
  p = fmadd(p, r, broadcast(5.0000001201e-1f));
  const Vec y = add(fmadd(mul(p, r), r, r), broadcast(1.0f));
  return zero_below(x, limit, mul(y, pow2(n)));
}

// Each score replaced by exp(score - max); returns the max and the exps' sum. n is a whole number of
// vectors, the row padded with -inf (whose exp is 0), at least one score finite.
inline float softmax_numerators(float* s, int64_t n, float& total) {
  Vec peaks = broadcast(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; i += kLanes) peaks = max(peaks, load(s + i));
  const float peak = reduce_max(peaks);
  const Vec minus_peak = broadcast(-peak);
  Vec sums = zero();
  for (int64_t i = 0; i < n; i += kLanes) {
    const Vec e = exp_nonpositive(add(load(s + i), minus_peak));
    store(s + i, e);
    sums = add(sums, e);
  }
  total = sum(sums);
  return peak;
}

// A K/V row of D elements as kChunks vectors of fp32. bf16 is the high half of an fp32, so a vector of
// 2 * kLanes bf16 splits into its even elements (shifted up) and its odd ones (masked) with no shuffle:
// the shuffle ports were the bottleneck of the widening loads. A row is then held in "stored order"
// (evens, odds per pair of vectors); the query is laid out the same way and the output laid back.
template <int64_t kChunks>
inline void load_row(const float* p, Vec* row) {
  for (int64_t c = 0; c < kChunks; ++c) row[c] = load(p + c * kLanes);
}

template <int64_t kChunks>
inline void load_row(const c10::BFloat16* p, Vec* row) {
  for (int64_t c = 0; c < kChunks; c += 2) {
#ifdef __AVX512F__
    const __m512i raw = _mm512_loadu_si512(p + c * kLanes);
    row[c] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
    row[c + 1] = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
#else
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + c * kLanes));
    row[c] = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
    row[c + 1] = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
#endif
  }
}

// An int8 row (its codes; the slot's scale is applied to the score or the weight, not per element).
template <int64_t kChunks>
inline void load_row(const int8_t* p, Vec* row) {
  for (int64_t c = 0; c < kChunks; ++c) {
#ifdef __AVX512F__
    row[c] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + c * kLanes))));
#else
    row[c] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + c * kLanes))));
#endif
  }
}

// The horizontal sums of kKeys dot vectors into `out` (kKeys consecutive scores). Four at once share
// their shuffles (13 operations instead of 4 x 8): the per-key sum was most of the score pass.
template <int64_t kKeys>
inline void store_sums(const Vec* dot, float* out) {
#ifdef __AVX512F__
  if constexpr (kKeys == 4) {
    const __m512 a = _mm512_add_ps(_mm512_unpacklo_ps(dot[0], dot[1]), _mm512_unpackhi_ps(dot[0], dot[1]));
    const __m512 b = _mm512_add_ps(_mm512_unpacklo_ps(dot[2], dot[3]), _mm512_unpackhi_ps(dot[2], dot[3]));
    const __m512 c = _mm512_add_ps(
        _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))),
        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))));  // lane: s0 s1 s2 s3
    const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(c),
                                      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(c), 1)));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1)));
    return;
  }
#endif
  for (int64_t i = 0; i < kKeys; ++i) out[i] = sum(dot[i]);
}

// A query row of D elements (TQ), times `scale`, into `out` in T's stored order: what load_row makes of a K
// row (bf16: evens, odds per pair of vectors), so that score_keys' lanes pair up. Each value is
// float(q) * scale, as a scalar loop computes it.
template <typename T, typename TQ>
inline void load_query(const TQ* q, int64_t d, float scale, float* out) {
  const Vec factor = broadcast(scale);
  if constexpr (std::is_same<T, c10::BFloat16>::value) {
    for (int64_t c = 0; c < d / kLanes; c += 2) {
      Vec pair[2];
      load_row<2>(q + c * kLanes, pair);
      store(out + c * kLanes, mul(pair[0], factor));
      store(out + (c + 1) * kLanes, mul(pair[1], factor));
    }
  } else {
    for (int64_t e = 0; e < d; e += kLanes) store(out + e, mul(load(q + e), factor));
  }
}

#ifdef __AVX512F__
using Bits = __m512i;
inline Bits as_bits(Vec v) { return _mm512_castps_si512(v); }
// fp32 -> bf16 rounded to nearest even, NaN to 0x7FC0 (c10::BFloat16's conversion), in each lane's low half.
inline Bits bf16_bits(Vec v) {
  const Bits bits = as_bits(v);
  const Bits bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1)),
                                     _mm512_set1_epi32(0x7FFF));
  const Bits rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}
inline void store_pairs(c10::BFloat16* out, Bits low, Bits high) {  // 2 * kLanes bf16: low[i], high[i], ...
  _mm512_storeu_si512(out, _mm512_or_si512(low, _mm512_slli_epi32(high, 16)));
}
inline void store_halves(c10::BFloat16* out, Bits v) {  // kLanes bf16: each lane's low half
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(v));
}
#else
using Bits = __m256i;
inline Bits as_bits(Vec v) { return _mm256_castps_si256(v); }
inline Bits bf16_bits(Vec v) {
  const Bits bits = as_bits(v);
  const Bits bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1)),
                                     _mm256_set1_epi32(0x7FFF));
  const Bits rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
inline void store_pairs(c10::BFloat16* out, Bits low, Bits high) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_or_si256(low, _mm256_slli_epi32(high, 16)));
}
inline void store_halves(c10::BFloat16* out, Bits v) {
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(v, v), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(packed));
}
#endif

// A row's merged sums (D, T's stored order) divided by `total` into `out` (TQ) in natural order: bf16 pools'
// evens and odds interleave again as the halves of 32-bit words. Each value is TQ(merged / total).
template <typename T, typename TQ>
inline void store_result(const float* merged, float total, int64_t d, TQ* out) {
  const Vec divisor = broadcast(total);
  if constexpr (std::is_same<TQ, float>::value) {
    for (int64_t e = 0; e < d; e += kLanes) store(out + e, div(load(merged + e), divisor));
  } else if constexpr (std::is_same<T, c10::BFloat16>::value) {
    for (int64_t e = 0; e < d; e += 2 * kLanes)
      store_pairs(out + e, bf16_bits(div(load(merged + e), divisor)), bf16_bits(div(load(merged + e + kLanes), divisor)));
  } else {
    for (int64_t e = 0; e < d; e += kLanes) store_halves(out + e, bf16_bits(div(load(merged + e), divisor)));
  }
}

}  // namespace
