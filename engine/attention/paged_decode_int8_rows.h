// The int8 pool's row writer of paged_decode.cpp (kv_int8.py's rows), included by it after kRowExtra;
// part of the build's cache key (native_decode.py).
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

// Writes rows (N, Hkv, D), fp32 or bf16, into the int8 pool (NB, BS, Hkv, D + 4) at slots (N,) int64, as
// kv_int8.pack_rows does (symmetric over each row's absmax, round half to even, the same fp32 ops), and
// their dequantized values into out (rows' shape and dtype). One call per layer for K and one for V: the
// dozen torch ops it replaces cost ~50 us a layer and K/V at one token a step, ~3 ms of a 10 ms step.
template <typename T>
void write_rows(const at::Tensor& rows, at::Tensor& pool, const at::Tensor& slots, at::Tensor& out) {
  const int64_t n = rows.size(0), hkv = rows.size(1), d = rows.size(2), row = d + kRowExtra<int8_t>;
  const T* src = rows.data_ptr<T>();
  T* dequantized = out.data_ptr<T>();
  int8_t* base = pool.data_ptr<int8_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  at::parallel_for(0, n * hkv, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* x = src + r * d;
      float absmax = 0.0f;
      for (int64_t j = 0; j < d; ++j) absmax = std::max(absmax, std::fabs(static_cast<float>(x[j])));
      const float scale = absmax / 127.0f;
      const float divisor = std::max(scale, std::numeric_limits<float>::min());
      int8_t* codes = base + (slot[r / hkv] * hkv + r % hkv) * row;
      for (int64_t j = 0; j < d; ++j) {
        const float code = std::min(127.0f, std::max(-127.0f, std::nearbyint(static_cast<float>(x[j]) / divisor)));
        codes[j] = static_cast<int8_t>(code);
        dequantized[r * d + j] = static_cast<T>(code * scale);
      }
      std::memcpy(codes + d, &scale, sizeof scale);
    }
  });
}

void write_int8_rows(const at::Tensor& rows, at::Tensor& pool, const at::Tensor& slots, at::Tensor& out) {
  TORCH_CHECK(rows.dim() == 3 && pool.dim() == 4 && pool.size(2) == rows.size(1) &&
              pool.size(3) == rows.size(2) + kRowExtra<int8_t>, "rows (N, Hkv, D), pool (NB, BS, Hkv, D + 4)");
  TORCH_CHECK(rows.is_contiguous() && pool.is_contiguous() && out.is_contiguous() && out.sizes() == rows.sizes() &&
              out.scalar_type() == rows.scalar_type(), "contiguous tensors, out shaped and typed as rows");
  TORCH_CHECK(pool.scalar_type() == at::kChar && slots.scalar_type() == at::kLong && slots.dim() == 1 &&
              slots.size(0) == rows.size(0) && slots.is_contiguous(), "an int8 pool and (N,) int64 slots");
  const int64_t num_slots = pool.size(0) * pool.size(1);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < slots.size(0); ++i) TORCH_CHECK(slot[i] >= 0 && slot[i] < num_slots, "slot out of the pool");
  if (rows.scalar_type() == at::kFloat) {
    write_rows<float>(rows, pool, slots, out);
  } else if (rows.scalar_type() == at::kBFloat16) {
    write_rows<c10::BFloat16>(rows, pool, slots, out);
  } else {
    TORCH_CHECK(false, "fp32 or bf16 rows only");
  }
}

}  // namespace
