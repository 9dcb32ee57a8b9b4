// One-token decode attention read straight from the paged KV pool (engine/attention/native_decode.py).
//
// Why: a decode has G query rows per K/V head, too few for the CPU flash kernel to reach memory speed
// (measured ~6 GB/s of K/V in the engine's step, where a core streams 11-13), and a batch of short
// decodes paid a gather of every block (index_select) before its GEMMs. Here every sequence's keys are
// read in place through its block table, each K/V row once for all of its G query heads, in one call
// per layer for the whole step, parallel over (sequence, chunk of keys).
//
// Per work item (a tile of rows and a piece of at most `chunk` keys): the scores of every query head over
// the piece (fp32, pre-scaled query), the piece's max and exp, then the value rows weighted; a row
// split into several pieces is merged by its pieces' log-sum-exp (flash-decoding). A tile is the
// consecutive rows of one sequence (a prompt chunk's or a verify's tokens), each K/V row read once for
// all of them, each row's result bit for bit the one it gets alone (a prefix hit, a chunk boundary, a
// decode of the same position and deterministic mode all compute one function). The
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
#include <memory>
#include <type_traits>
#include <vector>

#include "paged_decode_vectors.h"
#include "paged_decode_items.h"

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

// Scores of keys [t, t + kKeys) for every head of every row; their K rows stay in registers across them.
template <int64_t kKeys, int64_t kChunks, typename T>
inline void score_keys(const float* queries, const T* k_pool, const std::vector<int64_t>& offsets, int64_t t,
                       int64_t stride, int64_t hkv, int64_t groups, int64_t rows, float* scores) {
  constexpr int64_t d = kChunks * kLanes, row = d + kRowExtra<T>;
  const int64_t h = hkv * groups;
  for (int64_t j = 0; j < hkv; ++j) {
    Vec k[kKeys][kChunks];
    for (int64_t i = 0; i < kKeys; ++i) load_row<kChunks>(k_pool + offsets[static_cast<size_t>(t + i)] + j * row, k[i]);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t head = r * h + j * groups + g;
        const float* q = queries + head * d;
        Vec dot[kKeys];
        for (int64_t i = 0; i < kKeys; ++i) dot[i] = zero();
        for (int64_t c = 0; c < kChunks; ++c) {
          const Vec qc = load(q + c * kLanes);
          for (int64_t i = 0; i < kKeys; ++i) dot[i] = fmadd(qc, k[i][c], dot[i]);
        }
        store_sums<kKeys>(dot, scores + head * stride + t);
        if constexpr (std::is_same<T, int8_t>::value)  // the row's scale, applied to its score
          for (int64_t i = 0; i < kKeys; ++i)
            scores[head * stride + t + i] *= row_scale(k_pool + offsets[static_cast<size_t>(t + i)] + j * row, d);
      }
  }
}

// The probabilities of keys [t, t + kKeys) times their V rows, added to every row's and head's output: each
// output vector is loaded and stored once per kKeys keys. Over int8 pools the probabilities already carry
// their V row's scale (attend_tile). Per output element a chain of fmadds in key order, whatever kKeys.
template <int64_t kKeys, int64_t kChunks, typename T>
inline void add_values(const float* scores, const T* v_pool, const std::vector<int64_t>& offsets, int64_t t,
                       int64_t stride, int64_t hkv, int64_t groups, int64_t rows, float* acc) {
  constexpr int64_t d = kChunks * kLanes, row_size = d + kRowExtra<T>;
  // Vectors of a V row per broadcast weight: four where the registers hold them (AVX-512), else two (one
  // bf16 load splits into two). Each output element's chain of fmadds is the same either way.
  constexpr int64_t kVecs = (kLanes == 16 && kChunks >= 4) ? 4 : 2;
  const int64_t h = hkv * groups;
  for (int64_t j = 0; j < hkv; ++j) {
    for (int64_t c = 0; c < kChunks; c += kVecs) {
      Vec v[kKeys][kVecs];
      for (int64_t i = 0; i < kKeys; ++i)
        load_row<kVecs>(v_pool + offsets[static_cast<size_t>(t + i)] + j * row_size + c * kLanes, v[i]);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t head = r * h + j * groups + g;
          float* out = acc + head * d + c * kLanes;
          Vec o[kVecs];
          for (int64_t u = 0; u < kVecs; ++u) o[u] = load(out + u * kLanes);
          for (int64_t i = 0; i < kKeys; ++i) {
            const Vec weight = broadcast(scores[head * stride + t + i]);
            for (int64_t u = 0; u < kVecs; ++u) o[u] = fmadd(weight, v[i][u], o[u]);
          }
          for (int64_t u = 0; u < kVecs; ++u) store(out + u * kLanes, o[u]);
        }
    }
  }
}

// One item: `rows` rows, row r seeing the first row_keys[r] of the item's n keys (0 to n). Per row and head
// the max score, the sum of exp and the unnormalized output (stored order). kChunks = D / kLanes.
// A row's scores past its keys are -inf before its softmax (as alone) and 0 after it: a weight of 0 adds
// 0 * v = 0 to a sum that is never -0 (it starts at +0), which leaves it bit for bit as it was.
template <int64_t kChunks, typename T>
void attend_tile(const float* queries /* (R, H, D), scaled, stored order */, const T* k_pool, const T* v_pool,
                 const std::vector<int64_t>& offsets, int64_t n, int64_t rows, const int64_t* row_keys, int64_t hkv,
                 int64_t groups, float* max_out /* (R, H) */, float* sum_out /* (R, H) */, float* acc /* (R, H, D) */,
                 std::vector<float>& scores) {
  constexpr int64_t d = kChunks * kLanes;
  // Four keys' K rows in registers where they fit (AVX-512, D <= 64: 16 of 32); AVX2 has 16 in all. The
  // keys go in fours up to the padded end (store_sums<4>'s adds for every key, whatever the key count).
  constexpr int64_t kKeys = (kLanes == 16 && kChunks <= 4) ? 4 : 1;
  const int64_t h = hkv * groups;
  const int64_t stride = (n + kLanes - 1) / kLanes * kLanes;  // a head's row of scores
  scores.resize(static_cast<size_t>(rows * h * stride));
  const int64_t slot = hkv * (d + kRowExtra<T>);
  for (int64_t i = 0; i < std::min(n, kPrefetchKeys); ++i) prefetch_slot(k_pool + offsets[static_cast<size_t>(i)], slot);
  for (int64_t t = 0; t < n; t += kKeys) {
    for (int64_t i = t; i < t + kKeys; ++i) {
      if (i + kPrefetchKeys < n) prefetch_slot(k_pool + offsets[static_cast<size_t>(i + kPrefetchKeys)], slot);
      prefetch_slot(v_pool + offsets[static_cast<size_t>(i)], slot);
    }
    score_keys<kKeys, kChunks>(queries, k_pool, offsets, t, stride, hkv, groups, rows, scores.data());
  }
  constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t keys = row_keys[r], own = (keys + kLanes - 1) / kLanes * kLanes;
    for (int64_t head = r * h; head < (r + 1) * h; ++head) {
      float* s = scores.data() + head * stride;
      if (keys == 0) {
        std::fill(s, s + stride, 0.0f);
        max_out[head] = kMinusInf;
        sum_out[head] = 0.0f;
        continue;
      }
      std::fill(s + keys, s + stride, kMinusInf);
      float total = 0.0f;
      max_out[head] = softmax_numerators(s, own, total);
      sum_out[head] = total;
      std::fill(s + own, s + stride, 0.0f);
    }
  }
  if constexpr (std::is_same<T, int8_t>::value) {
    // Each V row's scale folded into its keys' weights once here: add_values multiplied it in again for
    // every pair of vectors of the row and every head (micro, 30 int8 layers at 2.6k keys, interleaved
    // A/B, best of 60: AVX2 build, 1 thread 163-174 -> 153-156 us a layer, 2 threads 101 -> 95; AVX-512,
    // 1 thread 161 -> 146; the same bits out).
    for (int64_t j = 0; j < hkv; ++j)
      for (int64_t i = 0; i < n; ++i) {
        const float scale = row_scale(v_pool + offsets[static_cast<size_t>(i)] + j * (d + kRowExtra<T>), d);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t g = 0; g < groups; ++g) scores[static_cast<size_t>((r * h + j * groups + g) * stride + i)] *= scale;
      }
  }
  std::fill(acc, acc + rows * h * d, 0.0f);
  constexpr int64_t kValueKeys = 4;
  int64_t t = 0;
  for (; t + kValueKeys <= n; t += kValueKeys)
    add_values<kValueKeys, kChunks>(scores.data(), v_pool, offsets, t, stride, hkv, groups, rows, acc);
  for (; t < n; ++t) add_values<1, kChunks>(scores.data(), v_pool, offsets, t, stride, hkv, groups, rows, acc);
}

// T: the pools' element type; TQ: the query's and output's (T itself, or bf16 over int8 pools).
// Pieces split at the multiples of `chunk` keys, the same for every row whatever its length or the thread
// count (a row's result must not depend on them). The items are dealt to the threads in runs of equal
// work (rows x keys): a long single decode is split where its pieces' keys halve, not where their count does.
template <typename T, typename TQ = T>
void decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
            const at::Tensor& context_lens, double scale, int64_t chunk, int64_t tile_rows, at::Tensor& out) {
  const int64_t b = q.size(0), h = q.size(1), d = q.size(2);
  const int64_t block_size = k_cache.size(1), hkv = k_cache.size(2), groups = h / hkv;
  const int64_t max_blocks = tables.size(1);
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int32_t* table_data = tables.data_ptr<int32_t>();
  for (int64_t s = 0; s < b; ++s) {
    TORCH_CHECK(lens[s] > 0 && lens[s] <= max_blocks * block_size, "context length outside its block table");
    const int32_t* row = table_data + s * max_blocks;
    for (int64_t blk = 0; blk < (lens[s] + block_size - 1) / block_size; ++blk)
      TORCH_CHECK(row[blk] >= 0 && row[blk] < k_cache.size(0), "block id outside the pool");
  }
  const std::vector<Tile> tiles = find_tiles(lens, table_data, b, max_blocks, block_size, tile_rows);
  std::vector<Item> items;
  std::vector<int64_t> first_item, row_tile(static_cast<size_t>(b));
  int64_t results = 0;
  for (int64_t t = 0; t < static_cast<int64_t>(tiles.size()); ++t) {
    const Tile& tile = tiles[static_cast<size_t>(t)];
    first_item.push_back(static_cast<int64_t>(items.size()));
    for (int64_t r = 0; r < tile.rows; ++r) row_tile[static_cast<size_t>(tile.first_row + r)] = t;
    const int64_t longest = lens[tile.first_row + tile.rows - 1];
    for (int64_t first = 0; first < longest; first += chunk, results += tile.rows)
      items.push_back({t, first, std::min<int64_t>(chunk, longest - first), results});
  }
  first_item.push_back(static_cast<int64_t>(items.size()));
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t num_items = static_cast<int64_t>(items.size());
  std::vector<int64_t> until(static_cast<size_t>(num_items + 1), 0);  // work before each item
  for (int64_t i = 0; i < num_items; ++i) {
    const Item& item = items[static_cast<size_t>(i)];
    until[static_cast<size_t>(i + 1)] = until[static_cast<size_t>(i)] + tiles[static_cast<size_t>(item.tile)].rows * item.num_keys;
  }
  std::vector<int64_t> deal(static_cast<size_t>(threads + 1), num_items);  // thread p: items [deal[p], deal[p + 1])
  deal[0] = 0;
  for (int64_t p = 1, i = 0; p < threads; ++p) {
    const double target = static_cast<double>(until.back()) * static_cast<double>(p) / static_cast<double>(threads);
    while (i < num_items && static_cast<double>(until[static_cast<size_t>(i + 1)]) <= target) ++i;
    if (i < num_items && target - static_cast<double>(until[static_cast<size_t>(i)]) >
                             static_cast<double>(until[static_cast<size_t>(i + 1)]) - target) ++i;  // the nearer end
    deal[static_cast<size_t>(p)] = i;
  }
  // Every piece's max, sum and output, written by its item before the merge reads them: left uninitialized
  // (a value-initialized vector zeroed ~2 MB a layer for a prompt chunk, all overwritten).
  std::unique_ptr<float[]> maxes(new float[static_cast<size_t>(results * h)]);
  std::unique_ptr<float[]> sums(new float[static_cast<size_t>(results * h)]);
  std::unique_ptr<float[]> accs(new float[static_cast<size_t>(results * h * d)]);
  const T* k_pool = k_cache.data_ptr<T>();
  const T* v_pool = v_cache.data_ptr<T>();
  const TQ* q_data = q.data_ptr<TQ>();
  const int64_t chunks = d / kLanes;
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, queries;  // the tile's queries: scaled, stored order (one parallel region less)
    std::vector<int64_t> offsets, row_keys;
    int64_t converted = -1;  // the tile whose queries are in `queries`
    for (int64_t i = deal[static_cast<size_t>(begin)]; i < deal[static_cast<size_t>(end)]; ++i) {
      const Item& item = items[static_cast<size_t>(i)];
      const Tile& tile = tiles[static_cast<size_t>(item.tile)];
      row_keys.resize(static_cast<size_t>(tile.rows));
      for (int64_t r = 0; r < tile.rows; ++r)
        row_keys[static_cast<size_t>(r)] = std::clamp<int64_t>(lens[tile.first_row + r] - item.first_key, 0, item.num_keys);
      slot_offsets(table_data + tile.first_row * max_blocks, block_size, hkv * (d + kRowExtra<T>), item.first_key,
                   item.num_keys, 4, offsets);
      // The next item's first keys (K rows), requested into L2 while this one computes: an item's own
      // prefetch starts at its first key, so each began with a wait on memory (a step of 16 decodes deals
      // ~48 items a layer). Written out here: as a called helper the same requests measured no gain.
      if (i + 1 < deal[static_cast<size_t>(end)]) {
        const Item& next = items[static_cast<size_t>(i + 1)];
        const int32_t* table = table_data + tiles[static_cast<size_t>(next.tile)].first_row * max_blocks;
        const int64_t slot = hkv * (d + kRowExtra<T>), last = next.first_key + std::min(next.num_keys, kPrefetchKeys);
        for (int64_t key = next.first_key; key < last;) {
          const int64_t run = std::min(block_size - key % block_size, last - key);
          const char* bytes = reinterpret_cast<const char*>(
              k_pool + (static_cast<int64_t>(table[key / block_size]) * block_size + key % block_size) * slot);
          for (int64_t byte = 0; byte < run * slot * static_cast<int64_t>(sizeof(T)); byte += 64)
            _mm_prefetch(bytes + byte, _MM_HINT_T1);
          key += run;
        }
      }
      if (converted != item.tile) {
        queries.resize(static_cast<size_t>(tile.rows * h * d));
        const TQ* q_rows = q_data + tile.first_row * h * d;
        for (int64_t row = 0; row < tile.rows * h; ++row)
          load_query<T>(q_rows + row * d, d, static_cast<float>(scale), queries.data() + row * d);
        converted = item.tile;
      }
      const float* qs = queries.data();
      float *m = maxes.get() + item.result * h, *l = sums.get() + item.result * h, *acc = accs.get() + item.result * h * d;
#define DECODESERVICE_ATTEND(K) \
  attend_tile<K>(qs, k_pool, v_pool, offsets, item.num_keys, tile.rows, row_keys.data(), hkv, groups, m, l, acc, scores)
      switch (chunks) {
        case 2: DECODESERVICE_ATTEND(2); break;
        case 4: DECODESERVICE_ATTEND(4); break;
        case 8: DECODESERVICE_ATTEND(8); break;
        default: DECODESERVICE_ATTEND(16); break;
      }
#undef DECODESERVICE_ATTEND
    }
  });
  TQ* out_data = out.data_ptr<TQ>();
  at::parallel_for(0, b, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(static_cast<size_t>(d));
    for (int64_t s = begin; s < end; ++s) {
      const int64_t t = row_tile[static_cast<size_t>(s)], r = s - tiles[static_cast<size_t>(t)].first_row;
      const int64_t lo = first_item[static_cast<size_t>(t)];
      const int64_t hi = lo + (lens[s] + chunk - 1) / chunk;  // the pieces that hold this row's keys
      for (int64_t head = 0; head < h; ++head) {
        float peak = -std::numeric_limits<float>::infinity();
        for (int64_t i = lo; i < hi; ++i)
          peak = std::max(peak, maxes[static_cast<size_t>((items[static_cast<size_t>(i)].result + r) * h + head)]);
        std::fill(merged.begin(), merged.end(), 0.0f);
        float total = 0.0f;
        for (int64_t i = lo; i < hi; ++i) {
          const int64_t at = (items[static_cast<size_t>(i)].result + r) * h + head;
          const float weight = std::exp(maxes[static_cast<size_t>(at)] - peak);
          total += weight * sums[static_cast<size_t>(at)];
          const float* acc = accs.get() + at * d;
          const Vec w = broadcast(weight);
          for (int64_t e = 0; e < d; e += kLanes) store(merged.data() + e, fmadd(w, load(acc + e), load(merged.data() + e)));
        }
        store_result<T>(merged.data(), total, d, out_data + (s * h + head) * d);
      }
    }
  });
}

// The checks both entries share: shapes, contiguity, the tables' types and the head size.
void check_arguments(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
                     const at::Tensor& context_lens, int64_t chunk, int64_t tile_rows, const at::Tensor& out,
                     int64_t row_extra) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "shapes: q (B, H, D), caches (NB, BS, Hkv, D)");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() && out.is_contiguous(), "contiguous tensors only");
  TORCH_CHECK(out.scalar_type() == q.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "out in q's dtype, both caches in one dtype");
  TORCH_CHECK(q.size(2) + row_extra == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0,
              "heads: H a multiple of Hkv, one D (an int8 pool's rows: D + 4)");
  TORCH_CHECK(tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt && tables.is_contiguous() &&
              tables.size(0) == q.size(0) && context_lens.size(0) == q.size(0), "int32 tables (B, M) and lengths (B,)");
  TORCH_CHECK(chunk > 0 && tile_rows > 0 && out.sizes() == q.sizes(), "chunk > 0, tile_rows > 0 and out shaped as q");
  const int64_t chunks = q.size(2) / kLanes;
  TORCH_CHECK(q.size(2) % kLanes == 0 && (chunks == 2 || chunks == 4 || chunks == 8 || chunks == 16),
              "head_dim must be 2, 4, 8 or 16 vectors of ", kLanes, " floats");
}

// q (B, H, D); caches (num_blocks, block_size, Hkv, D), the same dtype (fp32 or bf16), contiguous;
// tables (B, M) int32 block ids; context_lens (B,) int32, each >= 1 and covered by its table row.
// Writes out (B, H, D) in q's dtype.
void paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
                  const at::Tensor& context_lens, double scale, int64_t chunk, int64_t tile_rows, at::Tensor& out) {
  check_arguments(q, k_cache, v_cache, tables, context_lens, chunk, tile_rows, out, 0);
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and the caches share one dtype");
  if (q.scalar_type() == at::kFloat) {
    decode<float>(q, k_cache, v_cache, tables, context_lens, scale, chunk, tile_rows, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    decode<c10::BFloat16>(q, k_cache, v_cache, tables, context_lens, scale, chunk, tile_rows, out);
  } else {
    TORCH_CHECK(false, "fp32 or bf16 caches only");
  }
}

// The same over int8 pools (NB, BS, Hkv, D + 4): a key's K (V) row is its D codes times the fp32 scale in
// its last 4 bytes. q and out fp32 or bf16. Half the bytes of a bf16 pool: at 2.6k keys a decode step's K/V
// read also evicts the rest of the step's data from cache (benchmarks/kv_traffic.py).
void paged_decode_int8(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& tables,
                       const at::Tensor& context_lens, double scale, int64_t chunk, int64_t tile_rows, at::Tensor& out) {
  check_arguments(q, k_pool, v_pool, tables, context_lens, chunk, tile_rows, out, kRowExtra<int8_t>);
  TORCH_CHECK(k_pool.scalar_type() == at::kChar, "int8 pools");
  if (q.scalar_type() == at::kFloat) {
    decode<int8_t, float>(q, k_pool, v_pool, tables, context_lens, scale, chunk, tile_rows, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    decode<int8_t, c10::BFloat16>(q, k_pool, v_pool, tables, context_lens, scale, chunk, tile_rows, out);
  } else {
    TORCH_CHECK(false, "fp32 or bf16 queries only");
  }
}

#include "paged_decode_int8_rows.h"  // NOLINT: needs kRowExtra above

}  // namespace

// Each call lets go of the GIL while it computes (it touches no Python object): the server's event loop
// then streams tokens during the kernel instead of between kernels, where it would hold up the step.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto no_gil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("paged_decode_int8", &paged_decode_int8, "the same over int8 pools whose rows carry their scale", no_gil);
  m.def("write_int8_rows", &write_int8_rows, "quantize rows into an int8 pool, their dequantized values out", no_gil);
  m.def("paged_decode", &paged_decode, "one-token decode attention over the paged pool (see the file header)", no_gil);
}
