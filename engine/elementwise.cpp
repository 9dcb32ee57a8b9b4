// A layer's elementwise steps in one pass each (engine/elementwise.py): RMSNorm (with the residual add
// before it), SiLU(gate) * up, and the rotary embedding of q and k; and the greedy token of each row of
// logits. In torch ops they are two to eight passes over the rows, each with its own output tensor and
// dispatch (benchmarks/elementwise_passes.py measures what one pass saves).
//
// Bit for bit torch's own results: the same ATen vectors (at::vec, built for the ISA the flags choose), the
// same roundings after each op (to bf16 where the activations are bf16), and torch's split of a row into
// vectors of 2 x Vec::size() elements with the rest scalar (ATen's vectorized_loop), whose SiLU differs
// (std::exp, not Sleef's). The module is checked against torch at load (elementwise.py).
// No fused multiply-adds: torch rounds each product before the sum (GCC contracts intrinsics otherwise).
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

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using at::vec::Vectorized;

// Rows per parallel task: a decode step's few rows stay on the calling thread.
int64_t grain(int64_t row_elements) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_elements)); }

template <typename T>
inline float silu_scalar(T x) {  // torch's scalar path (the tail of a row)
  const float f = static_cast<float>(x);
  return f / (1.0f + std::exp(-f));
}

// out (N, I) = SiLU(gate_up[:, :I]) * gate_up[:, I:], rounded to T after each of the two ops as torch does.
template <typename T>
void silu_mul_rows(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t n = gate_up.size(0), inter = out.size(1), stride = gate_up.stride(0);
  const T* src = gate_up.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  using Vec = Vectorized<T>;
  const int64_t step = 2 * Vec::size(), vector_end = inter >= step ? inter - inter % step : 0;
  at::parallel_for(0, n, grain(inter), [&](int64_t begin, int64_t end) {
    const Vectorized<float> one(1.0f);
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = src + r * stride;
      const T* up = gate + inter;
      T* o = dst + r * inter;
      for (int64_t j = 0; j < vector_end; j += Vec::size()) {
        const Vec g = Vec::loadu(gate + j);
        Vec s;
        if constexpr (std::is_same<T, float>::value) {
          s = g / (one + g.neg().exp());
        } else {
          auto [g0, g1] = at::vec::convert_to_float<T>(g);
          s = at::vec::convert_from_float<T>(g0 / (one + g0.neg().exp()), g1 / (one + g1.neg().exp()));
        }
        (s * Vec::loadu(up + j)).store(o + j);
      }
      for (int64_t j = vector_end; j < inter; ++j) {
        const T s = static_cast<T>(silu_scalar(gate[j]));
        o[j] = static_cast<T>(static_cast<float>(s) * static_cast<float>(up[j]));
      }
    }
  });
}

// out = x * cos + rotate_half(x) * sin over (N, heads, D), cos and sin (N, 1, D) with sin's first half
// negated (engine/model.py: Rotary): three roundings, as the three torch ops. x's rows may be strided (the
// q and k part of the fused qkv projection's rows), its heads not.
template <typename T>
void rotate_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  const int64_t n = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2, row_stride = x.stride(0);
  const T* xs = x.data_ptr<T>();
  const T* cs = cos.data_ptr<T>();
  const T* ss = sin.data_ptr<T>();
  T* os = out.data_ptr<T>();
  using Vec = Vectorized<T>;
  at::parallel_for(0, n, grain(heads * d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* c = cs + r * d;
      const T* s = ss + r * d;
      for (int64_t h = 0; h < heads; ++h) {
        const T* a = xs + r * row_stride + h * d;
        T* o = os + (r * heads + h) * d;
        int64_t j = 0;
        // The swapped halves: element j pairs with a[(j + half) % d]; a vector never straddles the halves.
        for (; half % Vec::size() == 0 && j < d; j += Vec::size()) {
          const int64_t partner = j < half ? j + half : j - half;
          const Vec direct = Vec::loadu(a + j) * Vec::loadu(c + j);
          const Vec swapped = Vec::loadu(a + partner) * Vec::loadu(s + j);
          (direct + swapped).store(o + j);
        }
        for (; j < d; ++j) {
          const int64_t partner = j < half ? j + half : j - half;
          const T direct = static_cast<T>(static_cast<float>(a[j]) * static_cast<float>(c[j]));
          const T swapped = static_cast<T>(static_cast<float>(a[partner]) * static_cast<float>(s[j]));
          o[j] = static_cast<T>(static_cast<float>(direct) + static_cast<float>(swapped));
        }
      }
    }
  });
}

// The sum of a row of fp32 values as ATen's sum over a contiguous last dimension adds them (SumKernel.cpp:
// cascade_sum -> vectorized_inner_sum): vectors of 8 lanes (its sum runs on 8 lanes on AVX-512 CPUs too,
// measured: elementwise.py's check holds it to torch's result) in 4 interleaved accumulators, cascaded
// every 16 rows of 4; the leftover vectors into the first; the accumulators in order; then the scalar tail
// and the lanes one by one. Rows here are far shorter than where the cascade's level widens (2^16 rows).
inline float torch_row_sum(const float* v, int64_t size) {
  constexpr int64_t kLanes = 8, kIlp = 4, kLevels = 4, kLevelPower = 4, kLevelStep = 1 << kLevelPower;
  const int64_t vectors = size / kLanes, groups = vectors / kIlp;
  __m256 acc[kLevels][kIlp];
  for (auto& level : acc)
    for (auto& a : level) a = _mm256_setzero_ps();
  int64_t i = 0;
  while (i + kLevelStep <= groups) {
    for (int64_t j = 0; j < kLevelStep; ++j, ++i)
      for (int64_t k = 0; k < kIlp; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], _mm256_loadu_ps(v + (i * kIlp + k) * kLanes));
    for (int64_t j = 1; j < kLevels; ++j) {
      for (int64_t k = 0; k < kIlp; ++k) {
        acc[j][k] = _mm256_add_ps(acc[j][k], acc[j - 1][k]);
        acc[j - 1][k] = _mm256_setzero_ps();
      }
      if ((i & ((kLevelStep - 1) << (j * kLevelPower))) != 0) break;
    }
  }
  for (; i < groups; ++i)
    for (int64_t k = 0; k < kIlp; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], _mm256_loadu_ps(v + (i * kIlp + k) * kLanes));
  for (int64_t j = 1; j < kLevels; ++j)
    for (int64_t k = 0; k < kIlp; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], acc[j][k]);
  __m256 total = acc[0][0];
  for (int64_t g = groups * kIlp; g < vectors; ++g) total = _mm256_add_ps(total, _mm256_loadu_ps(v + g * kLanes));
  for (int64_t k = 1; k < kIlp; ++k) total = _mm256_add_ps(total, acc[0][k]);
  float sum = 0.0f;
  for (int64_t e = vectors * kLanes; e < size; ++e) sum += v[e];
  alignas(32) float lanes[kLanes];
  _mm256_store_ps(lanes, total);
  for (int64_t l = 0; l < kLanes; ++l) sum += lanes[l];
  return sum;
}

// One row of engine/model.py's RMSNorm: fp32 statistics (the squares, their sum as torch adds it, divided
// by the width, plus eps, 1 / sqrt), the row times it rounded to T, then the weight's product rounded to T.
template <typename T>
inline void norm_row(const T* x, const T* weight, float eps, int64_t c, float* squares, T* out) {
  for (int64_t e = 0; e < c; ++e) {
    const float f = static_cast<float>(x[e]);
    squares[e] = f * f;
  }
  const float mean = torch_row_sum(squares, c) / static_cast<float>(c);
  const float scale = 1.0f / std::sqrt(mean + eps);
  for (int64_t e = 0; e < c; ++e) {
    const T normed = static_cast<T>(static_cast<float>(x[e]) * scale);
    out[e] = static_cast<T>(static_cast<float>(weight[e]) * static_cast<float>(normed));
  }
}

// out = RMSNorm(x); with `residual`: sum = x + residual first (rounded to T, the stream's next value), then
// out = RMSNorm(sum): a layer's residual add and the next norm in one pass.
template <typename T>
void norm_rows(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight, double eps, at::Tensor* sum,
               at::Tensor& out) {
  const int64_t n = x.size(0), c = x.size(1);
  const T* xs = x.data_ptr<T>();
  const T* rs = residual != nullptr ? residual->data_ptr<T>() : nullptr;
  T* sums = sum != nullptr ? sum->data_ptr<T>() : nullptr;
  const T* w = weight.data_ptr<T>();
  T* os = out.data_ptr<T>();
  at::parallel_for(0, n, grain(c), [&](int64_t begin, int64_t end) {
    std::vector<float> squares(static_cast<size_t>(c));
    for (int64_t r = begin; r < end; ++r) {
      const T* row = xs + r * c;
      if (rs != nullptr) {
        T* added = sums + r * c;
        for (int64_t e = 0; e < c; ++e)
          added[e] = static_cast<T>(static_cast<float>(row[e]) + static_cast<float>(rs[r * c + e]));
        row = added;
      }
      norm_row<T>(row, w, static_cast<float>(eps), c, squares.data(), os + r * c);
    }
  });
}

void check_norm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.is_contiguous() && out.sizes() == x.sizes(),
              "x and out (N, C) contiguous");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(), "weight (C,)");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && out.scalar_type() == x.scalar_type(), "one dtype");
}

void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  check_norm(x, weight, out);
  if (x.scalar_type() == at::kFloat) {
    norm_rows<float>(x, nullptr, weight, eps, nullptr, out);
  } else if (x.scalar_type() == at::kBFloat16) {
    norm_rows<c10::BFloat16>(x, nullptr, weight, eps, nullptr, out);
  } else {
    TORCH_CHECK(false, "fp32 or bf16 only");
  }
}

void add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
                  at::Tensor& sum, at::Tensor& out) {
  check_norm(x, weight, out);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() && sum.sizes() == x.sizes() &&
                  sum.is_contiguous(), "residual and sum shaped as x, contiguous");
  TORCH_CHECK(residual.scalar_type() == x.scalar_type() && sum.scalar_type() == x.scalar_type(), "one dtype");
  if (x.scalar_type() == at::kFloat) {
    norm_rows<float>(x, &residual, weight, eps, &sum, out);
  } else if (x.scalar_type() == at::kBFloat16) {
    norm_rows<c10::BFloat16>(x, &residual, weight, eps, &sum, out);
  } else {
    TORCH_CHECK(false, "fp32 or bf16 only");
  }
}

void silu_mul(const at::Tensor& gate_up, at::Tensor& out) {
  TORCH_CHECK(gate_up.dim() == 2 && out.dim() == 2 && gate_up.size(0) == out.size(0) &&
                  gate_up.size(1) == 2 * out.size(1) && gate_up.stride(1) == 1 && out.is_contiguous(),
              "gate_up (N, 2I) with contiguous rows, out (N, I) contiguous");
  TORCH_CHECK(gate_up.scalar_type() == out.scalar_type(), "one dtype");
  if (gate_up.scalar_type() == at::kFloat) {
    silu_mul_rows<float>(gate_up, out);
  } else if (gate_up.scalar_type() == at::kBFloat16) {
    silu_mul_rows<c10::BFloat16>(gate_up, out);
  } else {
    TORCH_CHECK(false, "fp32 or bf16 only");
  }
}

void rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2) && out.is_contiguous() &&
                  out.sizes() == x.sizes(), "x (N, heads, D) with contiguous rows (a split's view), out contiguous");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == x.size(0) * x.size(2) &&
                  sin.numel() == cos.numel() && x.size(2) % 2 == 0, "cos and sin (N, 1, D) contiguous, D even");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type() &&
                  out.scalar_type() == x.scalar_type(), "one dtype");
  if (x.scalar_type() == at::kFloat) {
    rotate_rows<float>(x, cos, sin, out);
  } else if (x.scalar_type() == at::kBFloat16) {
    rotate_rows<c10::BFloat16>(x, cos, sin, out);
  } else {
    TORCH_CHECK(false, "fp32 or bf16 only");
  }
}

// Each row's first maximal index, a NaN counted as maximal (its first NaN): torch.max(dim=-1)'s indices.
// torch's index-returning reductions carry a (value, index) pair per element; here one vector pass finds
// the row's maximum (NaN-propagating) and a second the first element equal to it (or the first NaN).
void argmax_rows(const at::Tensor& logits, at::Tensor& out) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == at::kFloat && logits.size(1) > 0,
              "logits (S, V) fp32 contiguous, V > 0");
  TORCH_CHECK(out.dim() == 1 && out.size(0) == logits.size(0) && out.scalar_type() == at::kLong, "out (S,) int64");
  using Vec = Vectorized<float>;
  const int64_t n = logits.size(0), v = logits.size(1), vector_end = v - v % Vec::size();
  const float* src = logits.data_ptr<float>();
  int64_t* dst = out.data_ptr<int64_t>();
  at::parallel_for(0, n, grain(v), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = src + r * v;
      float best = row[0];
      if (vector_end > 0) {
        Vec top = Vec::loadu(row);
        for (int64_t j = Vec::size(); j < vector_end; j += Vec::size()) top = at::vec::maximum(top, Vec::loadu(row + j));
        float lanes[Vec::size()];
        top.store(lanes);
        best = lanes[0];
        for (int64_t i = 1; i < Vec::size(); ++i)
          if (std::isnan(lanes[i]) || lanes[i] > best) best = lanes[i];  // a NaN best stays one
      }
      for (int64_t j = vector_end; j < v; ++j)
        if (std::isnan(row[j]) || row[j] > best) best = row[j];
      const bool nan = std::isnan(best);
      const Vec target(best);
      const int all_lanes = (1 << Vec::size()) - 1;
      int64_t index = 0;  // the first vector holding a match, then the match within it (or in the tail)
      for (; index < vector_end; index += Vec::size()) {
        const Vec x = Vec::loadu(row + index);
        if (~(nan ? x.isnan() : (x == target)).zero_mask() & all_lanes) break;  // zero_mask: lanes not matching
      }
      while (index < v && !(nan ? std::isnan(row[index]) : row[index] == best)) ++index;
      dst[r] = index;
    }
  });
}

}  // namespace

// Each call lets go of the GIL while it computes (it touches no Python object).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto no_gil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up of a fused gate_up projection's rows", no_gil);
  m.def("rotate", &rotate, "the rotary embedding of (N, heads, D) rows", no_gil);
  m.def("rms_norm", &rms_norm, "engine/model.py's RMSNorm of (N, C) rows", no_gil);
  m.def("add_rms_norm", &add_rms_norm, "a residual add, then RMSNorm of the sum", no_gil);
  m.def("argmax_rows", &argmax_rows, "each row's first maximal index (NaN maximal), as torch.max(dim=-1)", no_gil);
}
