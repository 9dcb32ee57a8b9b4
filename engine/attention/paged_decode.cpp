// One-token decode attention read straight from the paged KV pool (engine/attention/native_decode.py).
//
// Why: a decode has G query rows per K/V head, too few for the CPU flash kernel to reach memory speed
// (measured ~6 GB/s of K/V in the engine's step, where a core streams 11-13), and a batch of short
// decodes paid a gather of every block (index_select) before its GEMMs. Here every sequence's keys are
// read in place through its block table, each K/V row once for all of its G query heads, in one call
// per layer for the whole step, parallel over (sequence, chunk of keys).
//
// Per work item (a sequence and a chunk of at most `chunk` keys): the scores of every query head over
// the chunk (fp32, pre-scaled query), the chunk's max and exp, then the value rows weighted; a
// sequence split into several chunks is merged by its chunks' log-sum-exp (flash-decoding). The
// softmax and every sum are fp32 whatever the cache holds (fp32, bf16, or int8 codes with per-(slot, head)
// scales: paged_decode_int8).
// One source for AVX2 and AVX-512: the vector type follows the ISA flags of engine/cpp_extensions.py.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

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

inline float exp_nonpositive(float x) {
  const bool negligible = x < kNegligible;
  x = std::max(x, kNegligible);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return negligible ? 0.0f : y * scale;
}

// The same for a vector of scores. Written out: the compiler left the scalar loop above scalar (the
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

// Each score replaced by exp(score - max); returns the max, adds the exps' sum to `total`.
inline float softmax_numerators(float* s, int64_t n, float& total) {
  Vec peaks = broadcast(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) peaks = max(peaks, load(s + i));
  float peak = reduce_max(peaks);
  for (; i < n; ++i) peak = std::max(peak, s[i]);
  const Vec minus_peak = broadcast(-peak);
  Vec sums = zero();
  for (i = 0; i + kLanes <= n; i += kLanes) {
    const Vec e = exp_nonpositive(add(load(s + i), minus_peak));
    store(s + i, e);
    sums = add(sums, e);
  }
  total = sum(sums);
  for (; i < n; ++i) {
    s[i] = exp_nonpositive(s[i] - peak);
    total += s[i];
  }
  return peak;
}

// The cache lines of one slot (every K/V head's row of one key) requested ahead of their use. Blocks
// are scattered over the pool, so the hardware prefetcher restarts at every block (16 keys) and the
// loads and the arithmetic did not overlap (~4 GB/s from a pool out of cache against ~9 for a plain
// read). Requested here: the K rows kPrefetchKeys ahead, and the V rows of the keys being scored, so
// the value pass after the softmax finds them in cache. Measured over 30 layers' scattered bf16 pools
// at 2.6k keys, 1 thread: 560 -> 430 us a layer; 2 threads 348 -> 268 (out-of-cache, weights streamed
// between layers); the hot case unchanged within noise.
constexpr int64_t kPrefetchKeys = 64;

template <typename T>
inline void prefetch_slot(const T* p, int64_t elements) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < elements * static_cast<int64_t>(sizeof(T)); b += 64) _mm_prefetch(bytes + b, _MM_HINT_T0);
}

// A sequence shorter than this many keys a thread is not split for balance: a piece's merge would cost more.
constexpr int64_t kMinKeysPerPiece = 64;

struct Item {
  int64_t sequence, first_key, num_keys;
};

// The element offset of each of the chunk's keys in the pool, computed once per chunk: a division
// per key and head in the loops below cost more than their arithmetic.
void slot_offsets(const int32_t* table, int64_t block_size, int64_t slot_stride, const Item& item,
                  std::vector<int64_t>& offsets) {
  offsets.resize(static_cast<size_t>(item.num_keys));
  int64_t key = item.first_key, t = 0;
  while (t < item.num_keys) {
    const int64_t block = key / block_size, within = key % block_size;
    const int64_t run = std::min(block_size - within, item.num_keys - t);
    const int64_t base = (static_cast<int64_t>(table[block]) * block_size + within) * slot_stride;
    for (int64_t i = 0; i < run; ++i) offsets[static_cast<size_t>(t + i)] = base + i * slot_stride;
    t += run;
    key += run;
  }
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

// Where element e of a row sits in stored order (the identity for fp32).
template <typename T>
int64_t stored_index(int64_t e) {
  if (!std::is_same<T, c10::BFloat16>::value) return e;
  const int64_t pair = e / (2 * kLanes), within = e % (2 * kLanes);
  return (2 * pair + (within & 1)) * kLanes + within / 2;
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

// Scores of keys [t, t + kKeys) for every head; their K rows stay in registers across the G heads.
template <int64_t kKeys, int64_t kChunks, typename T>
inline void score_keys(const float* queries, const T* k_pool, const std::vector<int64_t>& offsets, int64_t t,
                       int64_t n, int64_t hkv, int64_t groups, float* scores, const float* k_scales) {
  constexpr int64_t d = kChunks * kLanes;
  for (int64_t j = 0; j < hkv; ++j) {
    Vec k[kKeys][kChunks];
    for (int64_t i = 0; i < kKeys; ++i) load_row<kChunks>(k_pool + offsets[static_cast<size_t>(t + i)] + j * d, k[i]);
    for (int64_t g = 0; g < groups; ++g) {
      const float* q = queries + (j * groups + g) * d;
      Vec dot[kKeys];
      for (int64_t i = 0; i < kKeys; ++i) dot[i] = zero();
      for (int64_t c = 0; c < kChunks; ++c) {
        const Vec qc = load(q + c * kLanes);
        for (int64_t i = 0; i < kKeys; ++i) dot[i] = fmadd(qc, k[i][c], dot[i]);
      }
      store_sums<kKeys>(dot, scores + (j * groups + g) * n + t);
      if constexpr (std::is_same<T, int8_t>::value)  // a slot's scales: (slot, Hkv), at its offset / D
        for (int64_t i = 0; i < kKeys; ++i) scores[(j * groups + g) * n + t + i] *= k_scales[offsets[static_cast<size_t>(t + i)] / d + j];
    }
  }
}

// The probabilities of keys [t, t + kKeys) times their V rows, added to every head's output: each
// output vector is loaded and stored once per kKeys keys, not once per key.
template <int64_t kKeys, int64_t kChunks, typename T>
inline void add_values(const float* scores, const T* v_pool, const std::vector<int64_t>& offsets, int64_t t,
                       int64_t n, int64_t hkv, int64_t groups, float* acc, const float* v_scales) {
  constexpr int64_t d = kChunks * kLanes;
  for (int64_t j = 0; j < hkv; ++j) {
    for (int64_t c = 0; c < kChunks; c += 2) {  // two vectors at a time: one bf16 load splits into two
      Vec v[kKeys][2];
      for (int64_t i = 0; i < kKeys; ++i) {
        Vec row[kChunks];
        load_row<2>(v_pool + offsets[static_cast<size_t>(t + i)] + j * d + c * kLanes, row);
        v[i][0] = row[0];
        v[i][1] = row[1];
      }
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t head = j * groups + g;
        float* out = acc + head * d + c * kLanes;
        Vec lo = load(out), hi = load(out + kLanes);
        for (int64_t i = 0; i < kKeys; ++i) {
          float weight_of_key = scores[static_cast<size_t>(head * n + t + i)];
          if constexpr (std::is_same<T, int8_t>::value) weight_of_key *= v_scales[offsets[static_cast<size_t>(t + i)] / d + j];
          const Vec weight = broadcast(weight_of_key);
          lo = fmadd(weight, v[i][0], lo);
          hi = fmadd(weight, v[i][1], hi);
        }
        store(out, lo);
        store(out + kLanes, hi);
      }
    }
  }
}

// One chunk of one sequence, all heads, each slot's K (then V) rows read in pool order: per query head
// the max score, the sum of exp and the unnormalized output (stored order). kChunks = D / kLanes.
template <int64_t kChunks, typename T>
void attend_chunk(const float* queries /* (H, D), scaled, stored order */, const T* k_pool, const T* v_pool,
                  const std::vector<int64_t>& offsets, const Item& item, int64_t hkv, int64_t groups,
                  const float* k_scales, const float* v_scales /* int8 pools: (slot, Hkv) */,
                  float* max_out /* (H) */, float* sum_out /* (H) */, float* acc /* (H, D) */,
                  std::vector<float>& scores) {
  constexpr int64_t d = kChunks * kLanes;
  // Four keys' K rows in registers where they fit (AVX-512, D <= 64: 16 of 32); AVX2 has 16 in all.
  constexpr int64_t kKeys = (kLanes == 16 && kChunks <= 4) ? 4 : 1;
  const int64_t n = item.num_keys, h = hkv * groups;
  scores.resize(static_cast<size_t>(h * n));
  int64_t t = 0;
  const int64_t slot = hkv * d;
  for (; t + kKeys <= n; t += kKeys) {
    for (int64_t i = t; i < t + kKeys; ++i) {
      if (i + kPrefetchKeys < n) prefetch_slot(k_pool + offsets[static_cast<size_t>(i + kPrefetchKeys)], slot);
      prefetch_slot(v_pool + offsets[static_cast<size_t>(i)], slot);
    }
    score_keys<kKeys, kChunks>(queries, k_pool, offsets, t, n, hkv, groups, scores.data(), k_scales);
  }
  for (; t < n; ++t) score_keys<1, kChunks>(queries, k_pool, offsets, t, n, hkv, groups, scores.data(), k_scales);
  for (int64_t head = 0; head < h; ++head) {
    float total = 0.0f;
    max_out[head] = softmax_numerators(scores.data() + head * n, n, total);
    sum_out[head] = total;
  }
  std::fill(acc, acc + h * d, 0.0f);
  constexpr int64_t kValueKeys = 4;
  for (t = 0; t + kValueKeys <= n; t += kValueKeys) {
    add_values<kValueKeys, kChunks>(scores.data(), v_pool, offsets, t, n, hkv, groups, acc, v_scales);
  }
  for (; t < n; ++t) add_values<1, kChunks>(scores.data(), v_pool, offsets, t, n, hkv, groups, acc, v_scales);
}

// T: the pools' element type; TQ: the query's and output's (T itself, or bf16 over int8 pools).
template <typename T, typename TQ = T>
void decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
            const at::Tensor& context_lens, double scale, int64_t chunk, at::Tensor& out,
            const float* k_scales = nullptr, const float* v_scales = nullptr) {
  const int64_t b = q.size(0), h = q.size(1), d = q.size(2);
  const int64_t block_size = k_cache.size(1), hkv = k_cache.size(2), groups = h / hkv;
  const int64_t max_blocks = tables.size(1);
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  std::vector<Item> items;
  std::vector<int64_t> first_item(static_cast<size_t>(b + 1));
  for (int64_t s = 0; s < b; ++s) {
    first_item[static_cast<size_t>(s)] = static_cast<int64_t>(items.size());
    TORCH_CHECK(lens[s] > 0 && lens[s] <= max_blocks * block_size, "context length outside its block table");
    const int32_t* row = tables.data_ptr<int32_t>() + s * max_blocks;
    for (int64_t blk = 0; blk < (lens[s] + block_size - 1) / block_size; ++blk)
      TORCH_CHECK(row[blk] >= 0 && row[blk] < k_cache.size(0), "block id outside the pool");
    // Pieces of equal size, as many as a multiple of the threads: fixed `chunk`-key pieces split a 2600-key
    // sequence 6/5 over 2 threads, the last of them 40 keys, so one thread scanned 1536 keys, the other 1064.
    int64_t pieces = (lens[s] + chunk - 1) / chunk;
    if (lens[s] >= threads * kMinKeysPerPiece) pieces = (pieces + threads - 1) / threads * threads;
    const int64_t piece = (lens[s] + pieces - 1) / pieces;
    for (int64_t first = 0; first < lens[s]; first += piece) items.push_back({s, first, std::min<int64_t>(piece, lens[s] - first)});
  }
  first_item[static_cast<size_t>(b)] = static_cast<int64_t>(items.size());
  const int64_t num_items = static_cast<int64_t>(items.size());
  std::vector<float> maxes(static_cast<size_t>(num_items * h)), sums(static_cast<size_t>(num_items * h));
  std::vector<float> accs(static_cast<size_t>(num_items * h * d));
  const T* k_pool = k_cache.data_ptr<T>();
  const T* v_pool = v_cache.data_ptr<T>();
  const TQ* q_data = q.data_ptr<TQ>();
  const int32_t* table_data = tables.data_ptr<int32_t>();
  const int64_t chunks = d / kLanes;
  std::vector<int64_t> order(static_cast<size_t>(d));  // element e's place in stored order
  for (int64_t e = 0; e < d; ++e) order[static_cast<size_t>(e)] = stored_index<T>(e);
  at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> queries(static_cast<size_t>(h * d)), scores;
    std::vector<int64_t> offsets;
    for (int64_t i = begin; i < end; ++i) {
      const Item& item = items[static_cast<size_t>(i)];
      const TQ* q_row = q_data + item.sequence * h * d;
      for (int64_t head = 0; head < h; ++head)
        for (int64_t e = 0; e < d; ++e)
          queries[static_cast<size_t>(head * d + order[static_cast<size_t>(e)])] =
              static_cast<float>(q_row[head * d + e]) * static_cast<float>(scale);
      slot_offsets(table_data + item.sequence * max_blocks, block_size, hkv * d, item, offsets);
      float *m = maxes.data() + i * h, *l = sums.data() + i * h, *acc = accs.data() + i * h * d;
      switch (chunks) {
        case 2: attend_chunk<2>(queries.data(), k_pool, v_pool, offsets, item, hkv, groups, k_scales, v_scales, m, l, acc, scores); break;
        case 4: attend_chunk<4>(queries.data(), k_pool, v_pool, offsets, item, hkv, groups, k_scales, v_scales, m, l, acc, scores); break;
        case 8: attend_chunk<8>(queries.data(), k_pool, v_pool, offsets, item, hkv, groups, k_scales, v_scales, m, l, acc, scores); break;
        default: attend_chunk<16>(queries.data(), k_pool, v_pool, offsets, item, hkv, groups, k_scales, v_scales, m, l, acc, scores); break;
      }
    }
  });
  TQ* out_data = out.data_ptr<TQ>();
  at::parallel_for(0, b, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(static_cast<size_t>(d));
    for (int64_t s = begin; s < end; ++s) {
      const int64_t lo = first_item[static_cast<size_t>(s)], hi = first_item[static_cast<size_t>(s + 1)];
      for (int64_t head = 0; head < h; ++head) {
        float peak = -std::numeric_limits<float>::infinity();
        for (int64_t i = lo; i < hi; ++i) peak = std::max(peak, maxes[static_cast<size_t>(i * h + head)]);
        std::fill(merged.begin(), merged.end(), 0.0f);
        float total = 0.0f;
        for (int64_t i = lo; i < hi; ++i) {
          const float weight = std::exp(maxes[static_cast<size_t>(i * h + head)] - peak);
          total += weight * sums[static_cast<size_t>(i * h + head)];
          const float* acc = accs.data() + (i * h + head) * d;
          for (int64_t e = 0; e < d; ++e) merged[static_cast<size_t>(e)] += weight * acc[e];
        }
        TQ* dst = out_data + (s * h + head) * d;
        for (int64_t e = 0; e < d; ++e) dst[e] = static_cast<TQ>(merged[static_cast<size_t>(order[static_cast<size_t>(e)])] / total);
      }
    }
  });
}

// The checks both entries share: shapes, contiguity, the tables' types and the head size.
void check_arguments(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
                     const at::Tensor& context_lens, int64_t chunk, const at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "shapes: q (B, H, D), caches (NB, BS, Hkv, D)");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() && out.is_contiguous(), "contiguous tensors only");
  TORCH_CHECK(out.scalar_type() == q.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "out in q's dtype, both caches in one dtype");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0, "heads: H a multiple of Hkv, one D");
  TORCH_CHECK(tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt && tables.is_contiguous() &&
              tables.size(0) == q.size(0) && context_lens.size(0) == q.size(0), "int32 tables (B, M) and lengths (B,)");
  TORCH_CHECK(chunk > 0 && out.sizes() == q.sizes(), "chunk > 0 and out shaped as q");
  const int64_t chunks = q.size(2) / kLanes;
  TORCH_CHECK(q.size(2) % kLanes == 0 && (chunks == 2 || chunks == 4 || chunks == 8 || chunks == 16),
              "head_dim must be 2, 4, 8 or 16 vectors of ", kLanes, " floats");
}

// q (B, H, D); caches (num_blocks, block_size, Hkv, D), the same dtype (fp32 or bf16), contiguous;
// tables (B, M) int32 block ids; context_lens (B,) int32, each >= 1 and covered by its table row.
// Writes out (B, H, D) in q's dtype.
void paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
                  const at::Tensor& context_lens, double scale, int64_t chunk, at::Tensor& out) {
  check_arguments(q, k_cache, v_cache, tables, context_lens, chunk, out);
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and the caches share one dtype");
  if (q.scalar_type() == at::kFloat) {
    decode<float>(q, k_cache, v_cache, tables, context_lens, scale, chunk, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    decode<c10::BFloat16>(q, k_cache, v_cache, tables, context_lens, scale, chunk, out);
  } else {
    TORCH_CHECK(false, "fp32 or bf16 caches only");
  }
}

// The same over int8 pools: a key's K (V) row is k_codes[slot, head] * k_scales[slot, head]. Scales
// (num_blocks, block_size, Hkv) fp32; q and out fp32 or bf16. Half the bytes of a bf16 pool: at 2.6k
// keys a decode step's K/V read also evicts the rest of the step's data from cache (benchmarks/kv_traffic.py).
void paged_decode_int8(const at::Tensor& q, const at::Tensor& k_codes, const at::Tensor& k_scales,
                       const at::Tensor& v_codes, const at::Tensor& v_scales, const at::Tensor& tables,
                       const at::Tensor& context_lens, double scale, int64_t chunk, at::Tensor& out) {
  check_arguments(q, k_codes, v_codes, tables, context_lens, chunk, out);
  TORCH_CHECK(k_codes.scalar_type() == at::kChar, "int8 codes");
  for (const at::Tensor* scales : {&k_scales, &v_scales})
    TORCH_CHECK(scales->scalar_type() == at::kFloat && scales->is_contiguous() && scales->dim() == 3 &&
                scales->sizes() == k_codes.sizes().slice(0, 3), "fp32 scales (NB, BS, Hkv), contiguous");
  const float *ks = k_scales.data_ptr<float>(), *vs = v_scales.data_ptr<float>();
  if (q.scalar_type() == at::kFloat) {
    decode<int8_t, float>(q, k_codes, v_codes, tables, context_lens, scale, chunk, out, ks, vs);
  } else if (q.scalar_type() == at::kBFloat16) {
    decode<int8_t, c10::BFloat16>(q, k_codes, v_codes, tables, context_lens, scale, chunk, out, ks, vs);
  } else {
    TORCH_CHECK(false, "fp32 or bf16 queries only");
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_int8", &paged_decode_int8, "the same over int8 pools with per-(slot, head) scales");
  m.def("paged_decode", &paged_decode, "one-token decode attention over the paged pool (see the file header)");
}
