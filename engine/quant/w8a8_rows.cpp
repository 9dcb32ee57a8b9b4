// W8A8's two passes over the rows (engine/quant/w8a8.py), one pass each instead of torch's chain of ops:
// - quantize_rows: (M, K) fp32/bf16 -> int8 codes and a per-row fp32 scale, amax / 127 (at least 1e-10),
//   each value divided by it and rounded half to even (torch: float, abs, amax, div, clamp_min, div,
//   round, to int8: seven passes and five temporaries);
// - scale_sums: (M, N) int32 sums -> float(sum) * row_scale * col_scale in the rows' dtype (torch: float,
//   mul, mul, to: four passes).
// Bit for bit torch's results: the same IEEE divisions and products in the same order (no reciprocal, no
// fused multiply-add), the same rounding to bf16 (ATen's own conversion), checked against torch at load.
#pragma GCC optimize("fp-contract=off")
#if defined(__AVX512F__)
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__)
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#endif
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

using at::vec::Vectorized;
using VecF = Vectorized<float>;

// Rows per parallel task: a decode step's few rows stay on the calling thread.
int64_t grain(int64_t row_elements) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_elements)); }

// Rounded (integral) fp32 lanes in [-127, 127] -> int8, VecF::size() of them.
inline void store_codes(const VecF& rounded, int8_t* dst) {
#if defined(__AVX512F__)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(rounded)));
#else
  const __m256i words = _mm256_cvtps_epi32(rounded);
  const __m128i halves = _mm_packs_epi32(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), _mm_packs_epi16(halves, halves));
#endif
}

// VecF::size() values from `x` as fp32 (bf16 is the high half of an fp32: exact).
inline VecF load_float(const float* x) { return VecF::loadu(x); }
inline VecF load_float(const c10::BFloat16* x) {
#if defined(__AVX512F__)
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
#else
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
#endif
}

// VecF::size() int32 sums as fp32 (rounded to nearest even past 2^24, as a cast is).
inline VecF load_sums(const int32_t* x) {
#if defined(__AVX512F__)
  return _mm512_cvtepi32_ps(_mm512_loadu_si512(x));
#else
  return _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
#endif
}

template <typename T>
void quantize_rows_of(const at::Tensor& x, at::Tensor& codes, at::Tensor& scales) {
  const int64_t m = x.size(0), k = x.size(1);
  const T* src = x.data_ptr<T>();
  int8_t* dst = codes.data_ptr<int8_t>();
  float* row_scales = scales.data_ptr<float>();
  const int64_t lanes = VecF::size(), vector_end = k - k % lanes;
  at::parallel_for(0, m, grain(k), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = src + r * k;
      int8_t* out = dst + r * k;
      VecF peaks(0.0f);
      for (int64_t j = 0; j < vector_end; j += lanes) peaks = at::vec::maximum(peaks, load_float(row + j).abs());
      float peak = at::vec::vec_reduce_all<float>([](VecF& a, VecF& b) { return at::vec::maximum(a, b); }, peaks);
      for (int64_t j = vector_end; j < k; ++j) {
        const float a = std::abs(static_cast<float>(row[j]));
        peak = (std::isnan(a) || a > peak) ? a : peak;
      }
      float scale = peak / 127.0f;
      if (!std::isnan(scale)) scale = std::max(scale, static_cast<float>(1e-10));
      row_scales[r] = scale;
      const VecF divisor(scale);
      for (int64_t j = 0; j < vector_end; j += lanes) store_codes((load_float(row + j) / divisor).round(), out + j);
      for (int64_t j = vector_end; j < k; ++j)
        out[j] = static_cast<int8_t>(std::nearbyint(static_cast<float>(row[j]) / scale));
    }
  });
}

template <typename T>
void scale_sums_of(const at::Tensor& sums, const at::Tensor& row_scale, const at::Tensor& col_scale, at::Tensor& out) {
  const int64_t m = sums.size(0), n = sums.size(1);
  const int32_t* src = sums.data_ptr<int32_t>();
  const float* rows = row_scale.data_ptr<float>();
  const float* cols = col_scale.data_ptr<float>();
  T* dst = out.data_ptr<T>();
  const int64_t lanes = VecF::size(), step = std::is_same<T, float>::value ? lanes : 2 * lanes;
  const int64_t vector_end = n - n % step;
  at::parallel_for(0, m, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int32_t* sum = src + r * n;
      T* o = dst + r * n;
      const VecF rs(rows[r]);
      auto scaled = [&](int64_t j) {
        return (load_sums(sum + j) * rs) * VecF::loadu(cols + j);
      };
      for (int64_t j = 0; j < vector_end; j += step) {
        if constexpr (std::is_same<T, float>::value) {
          scaled(j).store(o + j);
        } else {
          at::vec::convert_from_float<T>(scaled(j), scaled(j + lanes)).store(o + j);
        }
      }
      for (int64_t j = vector_end; j < n; ++j)
        o[j] = static_cast<T>((static_cast<float>(sum[j]) * rows[r]) * cols[j]);
    }
  });
}

void quantize_rows(const at::Tensor& x, at::Tensor& codes, at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && codes.is_contiguous() && codes.sizes() == x.sizes() &&
                  codes.scalar_type() == at::kChar, "x (M, K) contiguous, codes (M, K) int8 contiguous");
  TORCH_CHECK(scales.is_contiguous() && scales.numel() == x.size(0) && scales.scalar_type() == at::kFloat,
              "scales (M, 1) fp32");
  if (x.scalar_type() == at::kFloat) {
    quantize_rows_of<float>(x, codes, scales);
  } else if (x.scalar_type() == at::kBFloat16) {
    quantize_rows_of<c10::BFloat16>(x, codes, scales);
  } else {
    TORCH_CHECK(false, "fp32 or bf16 only");
  }
}

void scale_sums(const at::Tensor& sums, const at::Tensor& row_scale, const at::Tensor& col_scale, at::Tensor& out) {
  TORCH_CHECK(sums.dim() == 2 && sums.is_contiguous() && sums.scalar_type() == at::kInt, "sums (M, N) int32 contiguous");
  TORCH_CHECK(row_scale.is_contiguous() && row_scale.numel() == sums.size(0) && row_scale.scalar_type() == at::kFloat,
              "row_scale (M, 1) fp32");
  TORCH_CHECK(col_scale.is_contiguous() && col_scale.numel() == sums.size(1) && col_scale.scalar_type() == at::kFloat,
              "col_scale (N,) fp32");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == sums.sizes(), "out (M, N) contiguous");
  if (out.scalar_type() == at::kFloat) {
    scale_sums_of<float>(sums, row_scale, col_scale, out);
  } else if (out.scalar_type() == at::kBFloat16) {
    scale_sums_of<c10::BFloat16>(sums, row_scale, col_scale, out);
  } else {
    TORCH_CHECK(false, "fp32 or bf16 only");
  }
}

}  // namespace

// Each call lets go of the GIL while it computes (it touches no Python object).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto no_gil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("quantize_rows", &quantize_rows, "(M, K) rows -> int8 codes and per-row scales, as w8a8.py's torch ops", no_gil);
  m.def("scale_sums", &scale_sums, "int32 sums times row and column scales, in the output's dtype", no_gil);
}
