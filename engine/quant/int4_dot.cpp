// GEMMs on 4-bit weights with int8 dot products (engine/quant/native.py): decode rows and prompt chunks.
//
// torch's CPU int4 kernel computes in fp32 and dequantizes its weights again for every block of 4 rows,
// so its cost grows with rows: what a speculative verify and a batch of streams pay. Here, as llama.cpp
// does, each row's activations are quantized to int8 per group of 32 (one scale per group), and the
// products with the 4-bit codes run on integer multiply-adds: AVX-512 VNNI's u8 x s8 dot of 4 (64
// products an instruction), or AVX2's u8 x s8 pair sums. Codes 0..15 times int8 never saturate.
//
// The weights are laid out for it (tile_codes in native.py): per block of 16 output columns and group
// of 32 inputs, 4 chunks of 64 bytes; byte 4c + i of chunk j holds column c's input 8j + i in its low
// nibble and 8j + 4 + i in its high one. One 512-bit load is then 16 columns x 4 inputs twice over, and
// each row's 4 activations broadcast against it; a tile of rows x columns keeps its sums in registers,
// and its codes are unpacked once for every row of the tile. A row's result does not depend on the
// other rows of the call (each row is computed alone, in the same order, at every row count).
//
// Prompt chunks: besides the dot products, each (row, group) pays its rescale (a convert, a multiply and
// two FMAs per 8 dot instructions, on the same pipes) whatever the register tile's shape (wider or
// taller tiles measured no faster); the cost that was left was the scalar quantization and bf16 stores,
// and the serial quantization ahead of the parallel region: both vectorized, and calls of many rows
// split between threads by rows.
//
// Scales: per block and group, 16 bf16 scales then 16 bf16 zeros, w = (code - 8) * scale + zero.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kBlock = 16;                // output columns per tile block
constexpr int64_t kGroupBytes = kBlock * kGroup / 2;  // 256: one block's codes for one group
constexpr int kRows = 4;                      // rows per register tile
// From this many rows a call is split between threads by rows, each quantizing its own: one parallel
// region, no serial quantization before it. Fewer rows (decode, verify) split the columns: their cost is
// the weights' bytes, which each thread then reads once.
constexpr int64_t kRowSplit = 64;
constexpr int64_t kRowChunk = 32;  // rows quantized and run together: their int8 values stay in L1

// The call's rows quantized per group: values (M, K) int8, and per (row, group) the int8 step and the
// sum of the unquantized values (the zero's term needs it, not the codes).
struct Activations {
  std::vector<int8_t> values;
  std::vector<float> steps, sums;
  int64_t k = 0, groups = 0;

  int32_t quad(int64_t row, int64_t offset) const {  // 4 consecutive int8 values as one int32 lane
    int32_t word;
    std::memcpy(&word, values.data() + row * k + offset, sizeof(word));
    return word;
  }
};

// One group of 32 values: its int8 codes, step and sum. Vectorized, the codes and steps are the scalar
// loop's (the same fp32 product, rounded to nearest even), the sum is added up in another (fixed) order.
#if defined(__AVX512F__) && defined(__AVX512BW__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

template <typename T>
inline void quantize_group(const T* group, int8_t* out, float* step, float* sum) {
  const __m512 v0 = load16(group), v1 = load16(group + 16);
  const float peak = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  *sum = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
  *step = peak / 127.0f;
  const __m512 inverse = _mm512_set1_ps(*step > 0.0f ? 1.0f / *step : 0.0f);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v0, inverse))));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16),
                   _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v1, inverse))));
}
#else
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline float horizontal(__m256 v, bool max) {
  __m128 x = max ? _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1))
                 : _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 y = _mm_movehl_ps(x, x);
  x = max ? _mm_max_ps(x, y) : _mm_add_ps(x, y);
  const __m128 z = _mm_shuffle_ps(x, x, 1);
  return _mm_cvtss_f32(max ? _mm_max_ss(x, z) : _mm_add_ss(x, z));
}

template <typename T>
inline void quantize_group(const T* group, int8_t* out, float* step, float* sum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4], peak = _mm256_setzero_ps(), total = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = load8(group + 8 * i);
    peak = _mm256_max_ps(peak, _mm256_andnot_ps(sign, v[i]));
    total = _mm256_add_ps(total, v[i]);
  }
  *sum = horizontal(total, false);
  *step = horizontal(peak, true) / 127.0f;
  const __m256 inverse = _mm256_set1_ps(*step > 0.0f ? 1.0f / *step : 0.0f);
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));
  // packs interleave the 128-bit lanes: 4-byte chunks come out as q0a q1a q2a q3a q0b q1b q2b q3b.
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}
#endif

template <typename T>
Activations quantize_rows(const T* x, int64_t m_rows, int64_t k) {
  Activations a;
  a.k = k;
  a.groups = k / kGroup;
  a.values.resize(static_cast<size_t>(m_rows * k));
  a.steps.resize(static_cast<size_t>(m_rows * a.groups));
  a.sums.resize(static_cast<size_t>(m_rows * a.groups));
  for (int64_t m = 0; m < m_rows; ++m)
    for (int64_t g = 0; g < a.groups; ++g) {
      const auto at = static_cast<size_t>(m * a.groups + g);
      quantize_group(x + m * k + g * kGroup, a.values.data() + m * k + g * kGroup, &a.steps[at], &a.sums[at]);
    }
  return a;
}

// fp32 -> bf16 rounded to nearest even, NaN to 0x7FC0: c10::BFloat16's conversion, 16 or 8 at a time.
inline void store_row(const float* values, int64_t count, float* out) { std::memcpy(out, values, count * sizeof(float)); }

inline void store_row(const float* values, int64_t count, at::BFloat16* out) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (count == 16) {
    const __m512 v = _mm512_loadu_ps(values);
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1)),
                                          _mm512_set1_epi32(0x7FFF));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
    rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(rounded));
    return;
  }
#else
  if (count == 8) {
    const __m256 v = _mm256_loadu_ps(values);
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1)),
                                          _mm256_set1_epi32(0x7FFF));
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
    rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(packed));
    return;
  }
#endif
  for (int64_t i = 0; i < count; ++i) out[i] = static_cast<at::BFloat16>(values[i]);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int64_t kTaskCols = 2 * kBlock;  // a task: two blocks of 16 columns

inline __m512 load_bf16x16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline __m512i dot4(__m512i acc, __m512i codes, __m512i x) {
#ifdef __AVX512VNNI__
  return _mm512_dpbusd_epi32(acc, codes, x);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(codes, x), _mm512_set1_epi16(1)));
#endif
}

// Rows [row0, row0 + R) x blocks [block, block + C) of 16 columns.
template <int R, int C, typename Out>
void tile(const Activations& a, int64_t row0, const uint8_t* tiles, const at::BFloat16* scales, int64_t block,
          int64_t n_out, Out* out) {
  const int64_t groups = a.groups;
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  const __m512 eight = _mm512_set1_ps(8.0f);
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i dot[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) dot[r][c] = _mm512_setzero_si512();
    for (int64_t j = 0; j < 4; ++j) {
      __m512i low[C], high[C];
      for (int c = 0; c < C; ++c) {
        const uint8_t* chunk = tiles + ((block + c) * groups + g) * kGroupBytes + j * 64;
        const __m512i bytes = _mm512_loadu_si512(chunk);
        low[c] = _mm512_and_si512(bytes, low_nibbles);
        high[c] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low_nibbles);
      }
      for (int r = 0; r < R; ++r) {
        const __m512i x_low = _mm512_set1_epi32(a.quad(row0 + r, g * kGroup + 8 * j));
        const __m512i x_high = _mm512_set1_epi32(a.quad(row0 + r, g * kGroup + 8 * j + 4));
        for (int c = 0; c < C; ++c) dot[r][c] = dot4(dot4(dot[r][c], low[c], x_low), high[c], x_high);
      }
    }
    __m512 scale[C], offset[C];
    for (int c = 0; c < C; ++c) {
      const at::BFloat16* sz = scales + ((block + c) * groups + g) * 2 * kBlock;
      scale[c] = load_bf16x16(sz);
      offset[c] = _mm512_fnmadd_ps(eight, scale[c], load_bf16x16(sz + kBlock));  // zero - 8 * scale
    }
    for (int r = 0; r < R; ++r) {
      const int64_t at = (row0 + r) * groups + g;
      const __m512 step = _mm512_set1_ps(a.steps[static_cast<size_t>(at)]);
      const __m512 sum = _mm512_set1_ps(a.sums[static_cast<size_t>(at)]);
      for (int c = 0; c < C; ++c) {
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][c]), _mm512_mul_ps(scale[c], step), acc[r][c]);
        acc[r][c] = _mm512_fmadd_ps(offset[c], sum, acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      alignas(64) float values[kBlock];
      _mm512_store_ps(values, acc[r][c]);
      store_row(values, kBlock, out + (row0 + r) * n_out + (block + c) * kBlock);
    }
}

template <int R, typename Out>
void run_task(const Activations& a, int64_t row0, const uint8_t* tiles, const at::BFloat16* scales, int64_t task,
              int64_t n_out, Out* out) {
  const int64_t block = task * 2;
  if ((block + 2) * kBlock <= n_out)
    tile<R, 2>(a, row0, tiles, scales, block, n_out, out);
  else
    tile<R, 1>(a, row0, tiles, scales, block, n_out, out);
}
#else
constexpr int64_t kTaskCols = kBlock / 2;  // a task: half a block, 8 columns in one 256-bit register

inline __m256 load_bf16x8(const at::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// Rows [row0, row0 + R) x 8 columns: half `task % 2` of block `task / 2`. A group's 16 products per
// 16-bit lane sum to at most 16 * 15 * 127 = 30480, so they add up in 16 bits before one widening.
template <int R, typename Out>
void run_task(const Activations& a, int64_t row0, const uint8_t* tiles, const at::BFloat16* scales, int64_t task,
              int64_t n_out, Out* out) {
  const int64_t groups = a.groups, block = task / 2, half = task % 2;
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256 eight = _mm256_set1_ps(8.0f);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm256_setzero_si256();
    // Not unrolled: unrolled, the compiler hoisted every product of the group ahead of its sums and
    // spilled them to the stack (16 ymm registers).
#pragma GCC unroll 1
    for (int64_t j = 0; j < 4; ++j) {
      const uint8_t* chunk = tiles + (block * groups + g) * kGroupBytes + j * 64 + half * 32;
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk));
      const __m256i low = _mm256_and_si256(bytes, low_nibbles);
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low_nibbles);
      for (int r = 0; r < R; ++r) {
        const __m256i x_low = _mm256_set1_epi32(a.quad(row0 + r, g * kGroup + 8 * j));
        const __m256i x_high = _mm256_set1_epi32(a.quad(row0 + r, g * kGroup + 8 * j + 4));
        dot[r] = _mm256_add_epi16(dot[r], _mm256_maddubs_epi16(low, x_low));
        dot[r] = _mm256_add_epi16(dot[r], _mm256_maddubs_epi16(high, x_high));
      }
    }
    const at::BFloat16* sz = scales + (block * groups + g) * 2 * kBlock + half * 8;
    const __m256 scale = load_bf16x8(sz);
    const __m256 offset = _mm256_fnmadd_ps(eight, scale, load_bf16x8(sz + kBlock));  // zero - 8 * scale
    for (int r = 0; r < R; ++r) {
      const int64_t at = (row0 + r) * groups + g;
      const __m256 step = _mm256_set1_ps(a.steps[static_cast<size_t>(at)]);
      const __m256 sum = _mm256_set1_ps(a.sums[static_cast<size_t>(at)]);
      const __m256 products = _mm256_cvtepi32_ps(_mm256_madd_epi16(dot[r], ones));
      acc[r] = _mm256_fmadd_ps(products, _mm256_mul_ps(scale, step), acc[r]);
      acc[r] = _mm256_fmadd_ps(offset, sum, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float values[8];
    _mm256_store_ps(values, acc[r]);
    store_row(values, 8, out + (row0 + r) * n_out + task * 8);
  }
}
#endif

// Rows [0, m_rows) of `a` x tasks [task_begin, task_end); `out` points at row 0's output.
template <typename Out>
void run_rows(const Activations& a, int64_t m_rows, const uint8_t* tiles, const at::BFloat16* scales,
              int64_t task_begin, int64_t task_end, int64_t n_out, Out* out) {
  for (int64_t task = task_begin; task < task_end; ++task) {
    for (int64_t m = 0; m < m_rows; m += kRows) {
      switch (std::min<int64_t>(kRows, m_rows - m)) {
        case 1: run_task<1>(a, m, tiles, scales, task, n_out, out); break;
        case 2: run_task<2>(a, m, tiles, scales, task, n_out, out); break;
        case 3: run_task<3>(a, m, tiles, scales, task, n_out, out); break;
        default: run_task<4>(a, m, tiles, scales, task, n_out, out); break;
      }
    }
  }
}

template <typename T, typename Out>
void matmul(const T* x, int64_t m_rows, int64_t k, const uint8_t* tiles, const at::BFloat16* scales, int64_t n_out,
            Out* out) {
  const int64_t tasks = (n_out + kTaskCols - 1) / kTaskCols;
  if (m_rows >= kRowSplit) {
    at::parallel_for(0, m_rows, kRowChunk, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; m += kRowChunk) {
        const int64_t rows = std::min(kRowChunk, end - m);
        const Activations a = quantize_rows(x + m * k, rows, k);
        run_rows(a, rows, tiles, scales, 0, tasks, n_out, out + m * n_out);
      }
    });
    return;
  }
  const Activations a = quantize_rows(x, m_rows, k);
  // A task is 8-32 columns x K: a few thousand multiply-adds a row, enough to amortize a thread's wake-up
  // only in bunches.
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, kTaskCols * k));
  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    run_rows(a, m_rows, tiles, scales, begin, end, n_out, out);
  });
}

}  // namespace

// x (M, K) float32 or bfloat16 -> out (M, N), same dtype; tiles (N/16, K/32, 4, 64) uint8, scales
// (N/16, K/32, 2, 16) bfloat16 (native.py's tile_codes).
void int4_matmul(const torch::Tensor& x, const torch::Tensor& tiles, const torch::Tensor& scales, torch::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: (M, K) contiguous");
  const int64_t m_rows = x.size(0), k = x.size(1), n_out = out.size(1);
  TORCH_CHECK(k % kGroup == 0, "K: groups of 32");
  TORCH_CHECK(tiles.dtype() == torch::kUInt8 && tiles.is_contiguous() && tiles.dim() == 4 &&
                  tiles.size(0) * kBlock == n_out && tiles.size(1) == k / kGroup && tiles.size(2) == 4 &&
                  tiles.size(3) == 64,
              "tiles: (N/16, K/32, 4, 64) uint8");
  TORCH_CHECK(scales.dtype() == torch::kBFloat16 && scales.is_contiguous() && scales.dim() == 4 &&
                  scales.size(0) == tiles.size(0) && scales.size(1) == k / kGroup && scales.size(2) == 2 &&
                  scales.size(3) == kBlock,
              "scales: (N/16, K/32, 2, 16) bfloat16");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == m_rows && out.is_contiguous() && out.scalar_type() == x.scalar_type(),
              "out: (M, N), x's dtype");
  const auto* tile_ptr = tiles.data_ptr<uint8_t>();
  const auto* scale_ptr = scales.data_ptr<at::BFloat16>();
  if (x.scalar_type() == torch::kFloat32) {
    matmul(x.data_ptr<float>(), m_rows, k, tile_ptr, scale_ptr, n_out, out.data_ptr<float>());
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "x: float32 or bfloat16");
    matmul(x.data_ptr<at::BFloat16>(), m_rows, k, tile_ptr, scale_ptr, n_out, out.data_ptr<at::BFloat16>());
  }
}

bool uses_vnni() {
#ifdef __AVX512VNNI__
  return true;
#else
  return false;
#endif
}

// How many of ATen's threads a parallel_for of this build reaches: 1 where the build lost OpenMP (the
// header-only omp loop compiled without -fopenmp runs serially).
int64_t parallel_threads() {
  std::vector<int> seen(static_cast<size_t>(at::get_num_threads()), 0);
  at::parallel_for(0, 64 * at::get_num_threads(), 1, [&](int64_t, int64_t) {
    seen[static_cast<size_t>(at::get_thread_num())] = 1;
    volatile double sink = 0;  // enough work per chunk that one thread cannot take every chunk first
    for (int i = 0; i < 200000; ++i) sink = sink + i;
  });
  int64_t count = 0;
  for (int flag : seen) count += flag;
  return count;
}

// int4_matmul lets go of the GIL while it computes (it touches no Python object): the server's event loop
// then streams tokens during the kernel instead of between kernels, where it would hold up the step.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_matmul", &int4_matmul, "few rows x 4-bit weights in tiles, int8 dot products (AVX2 / AVX-512)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("uses_vnni", &uses_vnni, "built with AVX-512 VNNI");
  m.def("parallel_threads", &parallel_threads, "threads an at::parallel_for reaches in this build");
}
