// The work of paged_decode.cpp's calls: tiles of a sequence's consecutive rows, the items (pieces of a tile's
// keys) dealt to the threads, and the pool offsets of an item's keys. Included by paged_decode.cpp only (an
// anonymous namespace: nothing is exported); part of the build's cache key (native_decode.py).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// A tile: consecutive kernel rows of one sequence (a prompt chunk or a verify: one table, lengths n, n + 1,
// ...). Its K/V rows are read once for all of its rows; each row's result stays bit for bit the one it gets
// alone (a tile of one): the same keys in the same order, the same pieces, the same sums.
struct Tile {
  int64_t first_row, rows;
};

// A work item: keys [first_key, first_key + num_keys) of a tile (num_keys: its longest row's share);
// its rows' partial results sit at `result` onward, a row each.
struct Item {
  int64_t tile, first_key, num_keys, result;
};

// The element offset of each of the item's keys in the pool, computed once per item: a division per key
// and head in the kernel's loops cost more than their arithmetic. Padded to a whole number of `multiple`
// keys with the last key's offset (its score is computed and discarded, see attend_tile).
void slot_offsets(const int32_t* table, int64_t block_size, int64_t slot_stride, int64_t first_key, int64_t num_keys,
                  int64_t multiple, std::vector<int64_t>& offsets) {
  offsets.resize(static_cast<size_t>((num_keys + multiple - 1) / multiple * multiple));
  int64_t key = first_key, t = 0;
  while (t < num_keys) {
    const int64_t block = key / block_size, within = key % block_size;
    const int64_t run = std::min(block_size - within, num_keys - t);
    const int64_t base = (static_cast<int64_t>(table[block]) * block_size + within) * slot_stride;
    for (int64_t i = 0; i < run; ++i) offsets[static_cast<size_t>(t + i)] = base + i * slot_stride;
    t += run;
    key += run;
  }
  std::fill(offsets.begin() + num_keys, offsets.end(), offsets[static_cast<size_t>(num_keys - 1)]);
}

// Tiles of up to `tile_rows` rows: a row joins the tile before it where it is the next position of the same
// sequence (its length one more, the same blocks under its keys).
std::vector<Tile> find_tiles(const int32_t* lens, const int32_t* tables, int64_t b, int64_t max_blocks,
                             int64_t block_size, int64_t tile_rows) {
  std::vector<Tile> tiles;
  for (int64_t s = 0; s < b; ++s) {
    const int64_t blocks = (lens[s] + block_size - 1) / block_size;
    if (!tiles.empty() && tiles.back().rows < tile_rows && lens[s] == lens[s - 1] + 1 &&
        std::memcmp(tables + s * max_blocks, tables + (s - 1) * max_blocks, static_cast<size_t>(blocks) * 4) == 0) {
      ++tiles.back().rows;
    } else {
      tiles.push_back({s, 1});
    }
  }
  return tiles;
}

}  // namespace
