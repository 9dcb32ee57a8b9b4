// The dense path's dequantization of 4-bit weights, fused into one pass (engine/quant/native.py).
//
// torch runs it as six elementwise passes (unpack, cast, sub, mul, add, plus a stack), ~1.4 ns a
// weight on one core, which made a prompt chunk's dequantization cost as much as its GEMM. Here each
// weight is read once as half a byte and written once. The layout is the project's own
// (engine/quant/int4.py, Int4Linear): codes (N, K/2) uint8, column 2i in the low nibble and 2i+1 in
// the high one; scale_zeros (K/G, N', 2) with w = (code - 8) * scale + zero, N' >= N (padded rows).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

inline uint32_t float_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

// Round to nearest even, as Tensor.to(torch.bfloat16) does for finite values (weights are finite);
// branch-free, so the loops below vectorize (at::BFloat16's constructor checks for NaN).
inline uint32_t bf16_bits(float value) {
  const uint32_t bits = float_bits(value);
  return (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
}

// A byte holds two neighbouring weights, so each byte becomes one word holding both outputs (low
// nibble first, little-endian): one contiguous store per byte, which vectorizes, where two
// interleaved stores did not.
inline void dequantize_group(const uint8_t* __restrict__ pairs, int64_t count, float scale, float offset,
                             uint32_t* __restrict__ out) {
  for (int64_t i = 0; i < count; ++i) {
    const int32_t byte = pairs[i];
    out[i] = bf16_bits(static_cast<float>(byte & 15) * scale + offset) |
             (bf16_bits(static_cast<float>(byte >> 4) * scale + offset) << 16);
  }
}

inline void dequantize_group(const uint8_t* __restrict__ pairs, int64_t count, float scale, float offset,
                             uint64_t* __restrict__ out) {
  for (int64_t i = 0; i < count; ++i) {
    const int32_t byte = pairs[i];
    out[i] = static_cast<uint64_t>(float_bits(static_cast<float>(byte & 15) * scale + offset)) |
             (static_cast<uint64_t>(float_bits(static_cast<float>(byte >> 4) * scale + offset)) << 32);
  }
}

// Word: uint32_t for bf16 outputs, uint64_t for float32 (two outputs a word). Blocks of rows, each
// group across the block's rows in turn: scale_zeros holds a group's rows side by side, so its reads
// stay sequential (row by row they stride N' x 4 bytes, which measured 3x slower).
template <typename Word>
void dequantize_rows(const uint8_t* codes, const at::BFloat16* scale_zeros, Word* out, int64_t rows, int64_t k,
                     int64_t group, int64_t padded_rows) {
  constexpr int64_t kBlock = 16;
  const int64_t groups = k / group, half = group / 2;
  at::parallel_for(0, (rows + kBlock - 1) / kBlock, 1, [&](int64_t first_block, int64_t end_block) {
    for (int64_t block = first_block; block < end_block; ++block) {
      const int64_t n0 = block * kBlock, n1 = std::min(rows, n0 + kBlock);
      for (int64_t g = 0; g < groups; ++g) {
        const at::BFloat16* sz = scale_zeros + g * padded_rows * 2;
        for (int64_t n = n0; n < n1; ++n) {
          const float scale = static_cast<float>(sz[n * 2]);
          const float zero = static_cast<float>(sz[n * 2 + 1]);
          // (code - 8) * scale + zero, as code * scale + offset
          dequantize_group(codes + n * (k / 2) + g * half, half, scale, zero - 8.0f * scale,
                           out + n * (k / 2) + g * half);
        }
      }
    }
  });
}

}  // namespace

// out (N, K), float32 or bfloat16, is written in full.
void dequantize_int4(const torch::Tensor& codes, const torch::Tensor& scale_zeros, int64_t group,
                     torch::Tensor& out) {
  TORCH_CHECK(codes.dtype() == torch::kUInt8 && codes.dim() == 2 && codes.is_contiguous(), "codes: (N, K/2) uint8");
  TORCH_CHECK(scale_zeros.dtype() == torch::kBFloat16 && scale_zeros.dim() == 3 && scale_zeros.is_contiguous() &&
                  scale_zeros.size(2) == 2,
              "scale_zeros: (K/G, N', 2) bfloat16");
  const int64_t rows = codes.size(0), k = codes.size(1) * 2;
  TORCH_CHECK(group > 0 && group % 2 == 0 && k % group == 0 && scale_zeros.size(0) == k / group &&
                  scale_zeros.size(1) >= rows,
              "group size and shapes disagree");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == rows && out.size(1) == k && out.is_contiguous(), "out: (N, K)");
  const auto* code_ptr = codes.data_ptr<uint8_t>();
  const auto* sz_ptr = scale_zeros.data_ptr<at::BFloat16>();
  if (out.scalar_type() == torch::kFloat32) {
    dequantize_rows(code_ptr, sz_ptr, reinterpret_cast<uint64_t*>(out.data_ptr<float>()), rows, k, group,
                    scale_zeros.size(1));
  } else {
    TORCH_CHECK(out.scalar_type() == torch::kBFloat16, "out: float32 or bfloat16");
    dequantize_rows(code_ptr, sz_ptr, reinterpret_cast<uint32_t*>(out.data_ptr<at::BFloat16>()), rows, k, group,
                    scale_zeros.size(1));
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("dequantize_int4", &dequantize_int4, "4-bit codes -> dense weights, one pass");
}
