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
// softmax and every sum are fp32 whatever the cache holds (fp32, bf16, or int8 rows that carry their own
// fp32 scale: paged_decode_int8).
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

#include "paged_decode_vectors.h"

namespace {

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

// An int8 pool's row is D codes then the row's fp32 scale (engine/attention/kv_int8.py): 4 more bytes.
template <typename T>
constexpr int64_t kRowExtra = std::is_same<T, int8_t>::value ? 4 : 0;

inline float row_scale(const int8_t* codes, int64_t d) {
  float scale;
  std::memcpy(&scale, codes + d, sizeof scale);  // 4-byte aligned in practice; memcpy says so to no one
  return scale;
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

// Scores of keys [t, t + kKeys) for every head; their K rows stay in registers across the G heads.
template <int64_t kKeys, int64_t kChunks, typename T>
inline void score_keys(const float* queries, const T* k_pool, const std::vector<int64_t>& offsets, int64_t t,
                       int64_t stride, int64_t hkv, int64_t groups, float* scores) {
  constexpr int64_t d = kChunks * kLanes, row = d + kRowExtra<T>;
  for (int64_t j = 0; j < hkv; ++j) {
    Vec k[kKeys][kChunks];
    for (int64_t i = 0; i < kKeys; ++i) load_row<kChunks>(k_pool + offsets[static_cast<size_t>(t + i)] + j * row, k[i]);
    for (int64_t g = 0; g < groups; ++g) {
      const float* q = queries + (j * groups + g) * d;
      Vec dot[kKeys];
      for (int64_t i = 0; i < kKeys; ++i) dot[i] = zero();
      for (int64_t c = 0; c < kChunks; ++c) {
        const Vec qc = load(q + c * kLanes);
        for (int64_t i = 0; i < kKeys; ++i) dot[i] = fmadd(qc, k[i][c], dot[i]);
      }
      store_sums<kKeys>(dot, scores + (j * groups + g) * stride + t);
      if constexpr (std::is_same<T, int8_t>::value)  // the row's scale, applied to its score
        for (int64_t i = 0; i < kKeys; ++i)
          scores[(j * groups + g) * stride + t + i] *= row_scale(k_pool + offsets[static_cast<size_t>(t + i)] + j * row, d);
    }
  }
}

// The probabilities of keys [t, t + kKeys) times their V rows, added to every head's output: each
// output vector is loaded and stored once per kKeys keys, not once per key. Over int8 pools the
// probabilities already carry their V row's scale (attend_chunk).
template <int64_t kKeys, int64_t kChunks, typename T>
inline void add_values(const float* scores, const T* v_pool, const std::vector<int64_t>& offsets, int64_t t,
                       int64_t stride, int64_t hkv, int64_t groups, float* acc) {
  constexpr int64_t d = kChunks * kLanes, row_size = d + kRowExtra<T>;
  for (int64_t j = 0; j < hkv; ++j) {
    for (int64_t c = 0; c < kChunks; c += 2) {  // two vectors at a time: one bf16 load splits into two
      Vec v[kKeys][2];
      for (int64_t i = 0; i < kKeys; ++i) {
        Vec row[kChunks];
        load_row<2>(v_pool + offsets[static_cast<size_t>(t + i)] + j * row_size + c * kLanes, row);
        v[i][0] = row[0];
        v[i][1] = row[1];
      }
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t head = j * groups + g;
        float* out = acc + head * d + c * kLanes;
        Vec lo = load(out), hi = load(out + kLanes);
        for (int64_t i = 0; i < kKeys; ++i) {
          const Vec weight = broadcast(scores[static_cast<size_t>(head * stride + t + i)]);
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
                  float* max_out /* (H) */, float* sum_out /* (H) */, float* acc /* (H, D) */,
                  std::vector<float>& scores) {
  constexpr int64_t d = kChunks * kLanes;
  // Four keys' K rows in registers where they fit (AVX-512, D <= 64: 16 of 32); AVX2 has 16 in all.
  constexpr int64_t kKeys = (kLanes == 16 && kChunks <= 4) ? 4 : 1;
  const int64_t n = item.num_keys, h = hkv * groups;
  const int64_t stride = (n + kLanes - 1) / kLanes * kLanes;  // a head's row of scores, -inf past n
  scores.resize(static_cast<size_t>(h * stride));
  for (int64_t head = 0; head < h; ++head)
    std::fill(scores.begin() + head * stride + n, scores.begin() + (head + 1) * stride, -std::numeric_limits<float>::infinity());
  int64_t t = 0;
  const int64_t slot = hkv * (d + kRowExtra<T>);
  for (; t + kKeys <= n; t += kKeys) {
    for (int64_t i = t; i < t + kKeys; ++i) {
      if (i + kPrefetchKeys < n) prefetch_slot(k_pool + offsets[static_cast<size_t>(i + kPrefetchKeys)], slot);
      prefetch_slot(v_pool + offsets[static_cast<size_t>(i)], slot);
    }
    score_keys<kKeys, kChunks>(queries, k_pool, offsets, t, stride, hkv, groups, scores.data());
  }
  for (; t < n; ++t) score_keys<1, kChunks>(queries, k_pool, offsets, t, stride, hkv, groups, scores.data());
  for (int64_t head = 0; head < h; ++head) {
    float total = 0.0f;
    max_out[head] = softmax_numerators(scores.data() + head * stride, stride, total);
    sum_out[head] = total;
  }
  if constexpr (std::is_same<T, int8_t>::value) {
    // Each V row's scale folded into its keys' weights once here: add_values multiplied it in again for
    // every pair of vectors of the row and every head (micro, 30 int8 layers at 2.6k keys, interleaved
    // A/B, best of 60: AVX2 build, 1 thread 163-174 -> 153-156 us a layer, 2 threads 101 -> 95; AVX-512,
    // 1 thread 161 -> 146; the same bits out).
    for (int64_t j = 0; j < hkv; ++j)
      for (int64_t i = 0; i < n; ++i) {
        const float row = row_scale(v_pool + offsets[static_cast<size_t>(i)] + j * (d + kRowExtra<T>), d);
        for (int64_t g = 0; g < groups; ++g) scores[static_cast<size_t>((j * groups + g) * stride + i)] *= row;
      }
  }
  std::fill(acc, acc + h * d, 0.0f);
  constexpr int64_t kValueKeys = 4;
  for (t = 0; t + kValueKeys <= n; t += kValueKeys) {
    add_values<kValueKeys, kChunks>(scores.data(), v_pool, offsets, t, stride, hkv, groups, acc);
  }
  for (; t < n; ++t) add_values<1, kChunks>(scores.data(), v_pool, offsets, t, stride, hkv, groups, acc);
}

// T: the pools' element type; TQ: the query's and output's (T itself, or bf16 over int8 pools).
template <typename T, typename TQ = T>
void decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
            const at::Tensor& context_lens, double scale, int64_t chunk, at::Tensor& out) {
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
      slot_offsets(table_data + item.sequence * max_blocks, block_size, hkv * (d + kRowExtra<T>), item, offsets);
      float *m = maxes.data() + i * h, *l = sums.data() + i * h, *acc = accs.data() + i * h * d;
      switch (chunks) {
        case 2: attend_chunk<2>(queries.data(), k_pool, v_pool, offsets, item, hkv, groups, m, l, acc, scores); break;
        case 4: attend_chunk<4>(queries.data(), k_pool, v_pool, offsets, item, hkv, groups, m, l, acc, scores); break;
        case 8: attend_chunk<8>(queries.data(), k_pool, v_pool, offsets, item, hkv, groups, m, l, acc, scores); break;
        default: attend_chunk<16>(queries.data(), k_pool, v_pool, offsets, item, hkv, groups, m, l, acc, scores); break;
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
                     const at::Tensor& context_lens, int64_t chunk, const at::Tensor& out, int64_t row_extra) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "shapes: q (B, H, D), caches (NB, BS, Hkv, D)");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() && out.is_contiguous(), "contiguous tensors only");
  TORCH_CHECK(out.scalar_type() == q.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "out in q's dtype, both caches in one dtype");
  TORCH_CHECK(q.size(2) + row_extra == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0,
              "heads: H a multiple of Hkv, one D (an int8 pool's rows: D + 4)");
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
  check_arguments(q, k_cache, v_cache, tables, context_lens, chunk, out, 0);
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and the caches share one dtype");
  if (q.scalar_type() == at::kFloat) {
    decode<float>(q, k_cache, v_cache, tables, context_lens, scale, chunk, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    decode<c10::BFloat16>(q, k_cache, v_cache, tables, context_lens, scale, chunk, out);
  } else {
    TORCH_CHECK(false, "fp32 or bf16 caches only");
  }
}

// The same over int8 pools (NB, BS, Hkv, D + 4): a key's K (V) row is its D codes times the fp32 scale in
// its last 4 bytes. q and out fp32 or bf16. Half the bytes of a bf16 pool: at 2.6k keys a decode step's K/V
// read also evicts the rest of the step's data from cache (benchmarks/kv_traffic.py).
void paged_decode_int8(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& tables,
                       const at::Tensor& context_lens, double scale, int64_t chunk, at::Tensor& out) {
  check_arguments(q, k_pool, v_pool, tables, context_lens, chunk, out, kRowExtra<int8_t>);
  TORCH_CHECK(k_pool.scalar_type() == at::kChar, "int8 pools");
  if (q.scalar_type() == at::kFloat) {
    decode<int8_t, float>(q, k_pool, v_pool, tables, context_lens, scale, chunk, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    decode<int8_t, c10::BFloat16>(q, k_pool, v_pool, tables, context_lens, scale, chunk, out);
  } else {
    TORCH_CHECK(false, "fp32 or bf16 queries only");
  }
}

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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_int8", &paged_decode_int8, "the same over int8 pools whose rows carry their scale");
  m.def("write_int8_rows", &write_int8_rows, "quantize rows into an int8 pool, their dequantized values out");
  m.def("paged_decode", &paged_decode, "one-token decode attention over the paged pool (see the file header)");
}
