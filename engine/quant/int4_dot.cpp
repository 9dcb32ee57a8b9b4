// Decode-size GEMMs on 4-bit weights with int8 dot products (engine/quant/native.py), for few rows.
//
// torch's CPU int4 kernel computes in fp32 and dequantizes its weights again for every block of 4 rows:
// on AVX2 it took 13 of a 20 ms decode step of SmolLM2-135M at 1 thread, and its cost grows with rows,
// which is what a speculative verify and a batch pay. Here, as llama.cpp does, each row's activations
// are quantized to int8 per group of 32 (one scale per group), and each group's dot product with the
// 4-bit codes runs on AVX2's u8 x s8 multiply-adds (32 products an instruction); the group's weight
// scale and offset apply in fp32. The codes are unpacked once per group for every row of the call,
// and each row is computed on its own, the same way at every row count: a stream's tokens do not
// depend on its batch. Codes 0..15 times int8 never saturate the 16-bit pair sums.
//
// Layout (engine/quant/int4.py): codes (N, K/2) uint8, weight 2i in the low nibble of byte i and 2i+1
// in the high one; scale_zeros (K/32, N', 2) bf16 with w = (code - 8) * scale + zero.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;

inline float bf16_to_float(at::BFloat16 value) { return static_cast<float>(value); }

// One row of activations, quantized per group of 32 and laid out per pair of groups as the kernel
// reads them: 32 bytes of even-indexed values (group 2p's 16, then group 2p+1's), then 32 of odd ones;
// per pair, 8 floats of scales and 8 of sums (4 lanes per group, the lanes a 256-bit int32 result of a
// 128-bit group occupies).
struct QuantizedRow {
  std::vector<int8_t> values;  // pairs * 64
  std::vector<float> scales;   // pairs * 8: the group's int8 step
  std::vector<float> sums;     // pairs * 8: the group's sum of the unquantized values / 4
};

template <typename T>
void quantize_row(const T* x, int64_t k, QuantizedRow& row) {
  const int64_t pairs = k / (2 * kGroup);
  row.values.assign(static_cast<size_t>(pairs * 64), 0);
  row.scales.assign(static_cast<size_t>(pairs * 8), 0.0f);
  row.sums.assign(static_cast<size_t>(pairs * 8), 0.0f);
  for (int64_t g = 0; g < k / kGroup; ++g) {
    float values[kGroup];
    float peak = 0.0f, sum = 0.0f;
    for (int64_t i = 0; i < kGroup; ++i) {
      values[i] = static_cast<float>(x[g * kGroup + i]);
      peak = std::max(peak, std::fabs(values[i]));
      sum += values[i];
    }
    const float step = peak / 127.0f;
    const float inverse = step > 0.0f ? 1.0f / step : 0.0f;
    const int64_t pair = g / 2, half = g % 2;
    int8_t* even = row.values.data() + pair * 64 + half * 16;
    int8_t* odd = even + 32;
    for (int64_t i = 0; i < kGroup / 2; ++i) {
      even[i] = static_cast<int8_t>(std::nearbyint(values[2 * i] * inverse));
      odd[i] = static_cast<int8_t>(std::nearbyint(values[2 * i + 1] * inverse));
    }
    for (int64_t lane = 0; lane < 4; ++lane) {
      row.scales[pair * 8 + half * 4 + lane] = step;
      row.sums[pair * 8 + half * 4 + lane] = sum / 4.0f;
    }
  }
}

inline float horizontal_sum(__m256 v) {
  __m128 low = _mm256_castps256_ps128(v), high = _mm256_extractf128_ps(v, 1);
  low = _mm_add_ps(low, high);
  low = _mm_add_ps(low, _mm_movehl_ps(low, low));
  low = _mm_add_ss(low, _mm_shuffle_ps(low, low, 1));
  return _mm_cvtss_f32(low);
}

// Rows in tiles of up to kTile, their accumulators in registers; two output columns at a time, so each
// row's activation vectors are loaded once for both.
constexpr int64_t kTile = 4;

template <int64_t Tile, typename Out>
inline void tile_columns(const QuantizedRow* rows, const uint8_t* codes, const at::BFloat16* scale_zeros,
                         int64_t n, int64_t n_out, int64_t k, int64_t padded, Out* out) {
  const int64_t pairs = k / (2 * kGroup);
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[Tile][2];
  for (int64_t t = 0; t < Tile; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  const uint8_t* codes0 = codes + n * (k / 2);
  const uint8_t* codes1 = codes0 + k / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    __m256i even[2], odd[2];
    __m256 weight_scale[2], weight_offset[2];
    const uint8_t* column_codes[2] = {codes0, codes1};
    for (int64_t c = 0; c < 2; ++c) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(column_codes[c] + p * 32));
      even[c] = _mm256_and_si256(bytes, low_nibbles);
      odd[c] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low_nibbles);
      // (code - 8) * s + z = code * s + (z - 8 s): lanes 0-3 group 2p, lanes 4-7 group 2p+1
      const at::BFloat16* sz0 = scale_zeros + ((2 * p) * padded + n + c) * 2;
      const at::BFloat16* sz1 = scale_zeros + ((2 * p + 1) * padded + n + c) * 2;
      const float s0 = bf16_to_float(sz0[0]), s1 = bf16_to_float(sz1[0]);
      weight_scale[c] = _mm256_set_m128(_mm_set1_ps(s1), _mm_set1_ps(s0));
      weight_offset[c] = _mm256_set_m128(_mm_set1_ps(bf16_to_float(sz1[1]) - 8.0f * s1),
                                         _mm_set1_ps(bf16_to_float(sz0[1]) - 8.0f * s0));
    }
    for (int64_t t = 0; t < Tile; ++t) {
      const int8_t* xq = rows[t].values.data() + p * 64;
      const __m256i x_even = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
      const __m256i x_odd = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32));
      const __m256 x_scale = _mm256_loadu_ps(rows[t].scales.data() + p * 8);
      const __m256 x_sum = _mm256_loadu_ps(rows[t].sums.data() + p * 8);
      for (int64_t c = 0; c < 2; ++c) {
        const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(even[c], x_even), ones),
                                             _mm256_madd_epi16(_mm256_maddubs_epi16(odd[c], x_odd), ones));
        acc[t][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(weight_scale[c], x_scale), acc[t][c]);
        acc[t][c] = _mm256_fmadd_ps(weight_offset[c], x_sum, acc[t][c]);
      }
    }
  }
  for (int64_t t = 0; t < Tile; ++t)
    for (int64_t c = 0; c < 2; ++c) out[t * n_out + n + c] = static_cast<Out>(horizontal_sum(acc[t][c]));
}

template <typename Out>
void matmul(const std::vector<QuantizedRow>& rows, const uint8_t* codes, const at::BFloat16* scale_zeros,
            int64_t n_out, int64_t k, int64_t padded, Out* out) {
  const int64_t m_rows = static_cast<int64_t>(rows.size());
  // Columns in pairs (an even count, checked below).
  at::parallel_for(0, n_out / 2, 8, [&](int64_t begin, int64_t end) {
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t n = 2 * pair;
      for (int64_t m = 0; m < m_rows; m += kTile) {
        const QuantizedRow* tile = rows.data() + m;
        Out* tile_out = out + m * n_out;
        switch (std::min(kTile, m_rows - m)) {
          case 1: tile_columns<1>(tile, codes, scale_zeros, n, n_out, k, padded, tile_out); break;
          case 2: tile_columns<2>(tile, codes, scale_zeros, n, n_out, k, padded, tile_out); break;
          case 3: tile_columns<3>(tile, codes, scale_zeros, n, n_out, k, padded, tile_out); break;
          default: tile_columns<4>(tile, codes, scale_zeros, n, n_out, k, padded, tile_out); break;
        }
      }
    }
  });
}

}  // namespace

// x (M, K) float32 or bfloat16 -> out (M, N), same dtype.
void int4_matmul(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale_zeros,
                 torch::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: (M, K) contiguous");
  TORCH_CHECK(codes.dtype() == torch::kUInt8 && codes.dim() == 2 && codes.is_contiguous(), "codes: (N, K/2) uint8");
  TORCH_CHECK(scale_zeros.dtype() == torch::kBFloat16 && scale_zeros.dim() == 3 && scale_zeros.is_contiguous() &&
                  scale_zeros.size(2) == 2,
              "scale_zeros: (K/32, N', 2) bfloat16");
  const int64_t m_rows = x.size(0), k = x.size(1), n_out = codes.size(0);
  TORCH_CHECK(codes.size(1) * 2 == k && k % (2 * kGroup) == 0 && scale_zeros.size(0) == k / kGroup &&
                  scale_zeros.size(1) >= n_out && n_out % 2 == 0,
              "groups of 32, an even number of them, an even number of outputs, and shapes that agree");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == m_rows && out.size(1) == n_out && out.is_contiguous() &&
                  out.scalar_type() == x.scalar_type(),
              "out: (M, N), x's dtype");
  std::vector<QuantizedRow> rows(static_cast<size_t>(m_rows));
  for (int64_t m = 0; m < m_rows; ++m) {
    if (x.scalar_type() == torch::kFloat32)
      quantize_row(x.data_ptr<float>() + m * k, k, rows[static_cast<size_t>(m)]);
    else
      quantize_row(x.data_ptr<at::BFloat16>() + m * k, k, rows[static_cast<size_t>(m)]);
  }
  const auto* code_ptr = codes.data_ptr<uint8_t>();
  const auto* sz_ptr = scale_zeros.data_ptr<at::BFloat16>();
  if (x.scalar_type() == torch::kFloat32) {
    matmul(rows, code_ptr, sz_ptr, n_out, k, scale_zeros.size(1), out.data_ptr<float>());
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "x: float32 or bfloat16");
    matmul(rows, code_ptr, sz_ptr, n_out, k, scale_zeros.size(1), out.data_ptr<at::BFloat16>());
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_matmul", &int4_matmul, "few rows x 4-bit weights, int8 dot products (AVX2)");
}
