// tierkv ops: one schema each (TORCH_LIBRARY), C++ CPU kernels and shape-only Meta kernels.
// The CUDA kernels (tierkv_ops_cuda.cu) register under the same op names; both use the index
// math in tierkv_index.h. Python entry points and the pure-torch reference: tierkv/ops.py.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

#include <algorithm>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#include <cstring>
#include <type_traits>
#include <vector>

#include "tierkv_checks.h"
#include "tierkv_copy_threads.h"
#include "tierkv_index.h"

namespace tierkv {
namespace {

// Slots must be -1 (skip) or inside the cache; checked before any byte moves, so bad input
// leaves the destination untouched.
template <typename index_t>
void check_slots(const index_t* slots, int64_t n, int64_t num_slots) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t s = static_cast<int64_t>(slots[i]);
    TORCH_CHECK(s >= -1 && s < num_slots, "tierkv: slot_mapping[", i, "] = ", s,
                " must be -1 (skip) or in [0, num_blocks * block_size = ", num_slots, ")");
  }
}

template <typename index_t, bool kGather>
void paged_copy_cpu(const PagedGeometry& g, const std::vector<int64_t>& bases, const index_t* slots, uint8_t* chunk) {
  check_slots(slots, g.num_tokens, g.num_slots);
  const int64_t seg_bytes = segment_bytes(g);
  const int64_t segments = segments_per_token(g);
  const int64_t items = g.num_layers * 2 * g.num_tokens;
  // grain: enough tokens per task that a task moves tens of KiB
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(1, seg_bytes * segments));
  parallel_items(items, grain, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t token = item % g.num_tokens;
      const int64_t lkv = item / g.num_tokens;
      const int64_t slot = static_cast<int64_t>(slots[token]);
      if (!slot_valid(g, slot)) continue;
      uint8_t* cache = reinterpret_cast<uint8_t*>(bases[lkv]);
      for (int64_t seg = 0; seg < segments; ++seg) {
        uint8_t* paged = cache + cache_offset(g, slot, seg);
        uint8_t* flat = chunk + chunk_offset(g, lkv / 2, lkv % 2, token, seg);
        if (kGather) {
          std::memcpy(flat, paged, seg_bytes);
        } else {
          std::memcpy(paged, flat, seg_bytes);
        }
      }
    }
  });
}

template <bool kGather>
void paged_cpu(const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
               const at::Tensor& slot_mapping, const at::Tensor& chunk, bool hf_order) {
  const PagedGeometry g =
      paged_geometry(keys, values, slot_mapping, chunk, hf_order, kGather ? "out" : "chunk");
  TORCH_CHECK(chunk.device().is_cpu(), "tierkv: the CPU kernel got ", chunk.device(), " tensors");
  const auto bases = layer_pointers(keys, values);
  auto* bytes = static_cast<uint8_t*>(chunk.data_ptr());
  if (slot_mapping.scalar_type() == at::kLong) {
    paged_copy_cpu<int64_t, kGather>(g, bases, slot_mapping.data_ptr<int64_t>(), bytes);
  } else {
    paged_copy_cpu<int32_t, kGather>(g, bases, slot_mapping.data_ptr<int32_t>(), bytes);
  }
}

void paged_gather_cpu(at::TensorList key_caches, at::TensorList value_caches, const at::Tensor& slot_mapping,
                      const at::Tensor& out, bool huggingface_order) {
  paged_cpu<true>(key_caches.vec(), value_caches.vec(), slot_mapping, out, huggingface_order);
}

void paged_scatter_cpu(const at::Tensor& chunk, at::TensorList key_caches, at::TensorList value_caches,
                       const at::Tensor& slot_mapping, bool huggingface_order) {
  paged_cpu<false>(key_caches.vec(), value_caches.vec(), slot_mapping, chunk, huggingface_order);
}

at::Tensor kv_deviation_cpu(const at::Tensor& retrieved_k, const at::Tensor& fresh_k) {
  check_kv_deviation(retrieved_k, fresh_k);
  const at::Tensor a = retrieved_k.contiguous();
  const at::Tensor b = fresh_k.contiguous();
  const int64_t tokens = a.size(0);
  const int64_t row = a.size(1) * a.size(2);
  at::Tensor out = at::empty({tokens}, a.options().dtype(at::kFloat));
  float* result = out.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.scalar_type(), "tierkv_kv_deviation", [&] {
    const scalar_t* pa = a.data_ptr<scalar_t>();
    const scalar_t* pb = b.data_ptr<scalar_t>();
    parallel_items(tokens, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        float sum = 0.f;
        for (int64_t i = 0; i < row; ++i) {
          const float d = static_cast<float>(pa[t * row + i]) - static_cast<float>(pb[t * row + i]);
          sum += d * d;
        }
        result[t] = sum;
      }
    });
  });
  return out;
}

void blend_scatter_cpu(const at::Tensor& dst, const at::Tensor& src, const at::Tensor& indices) {
  check_blend_scatter(dst, src, indices);
  const int64_t rows = indices.size(0);
  const int64_t limit = dst.size(0);
  const int64_t* index = indices.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows; ++i) {
    TORCH_CHECK(index[i] >= 0 && index[i] < limit, "tierkv: indices[", i, "] = ", index[i], " must be in [0, ",
                limit, ")");
  }
  const int64_t row_bytes = rows == 0 ? 0 : src.numel() / rows * src.element_size();
  auto* out = static_cast<uint8_t*>(dst.data_ptr());
  const auto* in = static_cast<const uint8_t*>(src.data_ptr());
  parallel_items(rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      std::memcpy(out + index[i] * row_bytes, in + i * row_bytes, row_bytes);
    }
  });
}

void rope_rerotate_cpu(const at::Tensor& k, const at::Tensor& old_positions, const at::Tensor& new_positions,
                       const at::Tensor& cos_sin_cache, bool is_neox) {
  check_rope(k, old_positions, new_positions, cos_sin_cache);
  const int64_t tokens = k.size(0), heads = k.size(1);
  const int64_t half = cos_sin_cache.size(1) / 2;
  const int64_t max_position = cos_sin_cache.size(0);
  const int64_t* old_pos = old_positions.data_ptr<int64_t>();
  const int64_t* new_pos = new_positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(old_pos[t] >= 0 && old_pos[t] < max_position && new_pos[t] >= 0 && new_pos[t] < max_position,
                "tierkv: positions of token ", t, " (old ", old_pos[t], ", new ", new_pos[t], ") must be in [0, ",
                max_position, ")");
  }
  const float* table = cos_sin_cache.data_ptr<float>();
  const int64_t row = cos_sin_cache.size(1);
  const int64_t token_stride = k.stride(0), head_stride = k.stride(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, k.scalar_type(), "tierkv_rope_rerotate", [&] {
    scalar_t* base = k.data_ptr<scalar_t>();
    parallel_items(tokens, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* old_row = table + old_pos[t] * row;
        const float* new_row = table + new_pos[t] * row;
        for (int64_t i = 0; i < half; ++i) {
          float c, s;
          rotation_delta(old_row, new_row, half, i, &c, &s);
          int64_t first, second;
          rope_pair(is_neox, half, i, &first, &second);
          for (int64_t h = 0; h < heads; ++h) {
            scalar_t* head = base + t * token_stride + h * head_stride;
            const float x1 = static_cast<float>(head[first]);
            const float x2 = static_cast<float>(head[second]);
            head[first] = static_cast<scalar_t>(x1 * c - x2 * s);
            head[second] = static_cast<scalar_t>(x2 * c + x1 * s);
          }
        }
      }
    });
  });
}


#if defined(__SSE2__)
// dst[j][i] = src[i][j] for an 8x8 block of 2-byte elements (rows `src_stride` / `dst_stride`
// elements apart): three rounds of unpacks, in registers.
inline void transpose8x8_u16(const uint16_t* src, int64_t src_stride, uint16_t* dst, int64_t dst_stride) {
  __m128i a[8], b[8], c[8];
  for (int i = 0; i < 8; ++i) a[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i * src_stride));
  for (int i = 0; i < 4; ++i) {
    b[2 * i] = _mm_unpacklo_epi16(a[2 * i], a[2 * i + 1]);
    b[2 * i + 1] = _mm_unpackhi_epi16(a[2 * i], a[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    c[4 * i] = _mm_unpacklo_epi32(b[4 * i], b[4 * i + 2]);
    c[4 * i + 1] = _mm_unpackhi_epi32(b[4 * i], b[4 * i + 2]);
    c[4 * i + 2] = _mm_unpacklo_epi32(b[4 * i + 1], b[4 * i + 3]);
    c[4 * i + 3] = _mm_unpackhi_epi32(b[4 * i + 1], b[4 * i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (2 * i) * dst_stride), _mm_unpacklo_epi64(c[i], c[i + 4]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (2 * i + 1) * dst_stride), _mm_unpackhi_epi64(c[i], c[i + 4]));
  }
}
#endif

#if defined(__SSE2__)
// dst[j][i] = src[i][j] for a 16x16 block of 1-byte elements: four rounds of unpacks (bytes,
// then pairs, quads and eights of rows), in registers.
inline void transpose16x16_u8(const uint8_t* src, int64_t src_stride, uint8_t* dst, int64_t dst_stride) {
  __m128i a[16], b[16];
  for (int i = 0; i < 16; ++i) a[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i * src_stride));
  for (int i = 0; i < 8; ++i) {  // b[2i]: columns 0-7 of rows 2i, 2i+1 as byte pairs; b[2i+1]: columns 8-15
    b[2 * i] = _mm_unpacklo_epi8(a[2 * i], a[2 * i + 1]);
    b[2 * i + 1] = _mm_unpackhi_epi8(a[2 * i], a[2 * i + 1]);
  }
  for (int p = 0; p < 4; ++p) {  // a[4p + q]: columns 4q..4q+3 of rows 4p..4p+3
    a[4 * p] = _mm_unpacklo_epi16(b[4 * p], b[4 * p + 2]);
    a[4 * p + 1] = _mm_unpackhi_epi16(b[4 * p], b[4 * p + 2]);
    a[4 * p + 2] = _mm_unpacklo_epi16(b[4 * p + 1], b[4 * p + 3]);
    a[4 * p + 3] = _mm_unpackhi_epi16(b[4 * p + 1], b[4 * p + 3]);
  }
  for (int h = 0; h < 2; ++h) {  // b[8h + 2q + k]: columns 4q+2k, 4q+2k+1 of rows 8h..8h+7
    for (int q = 0; q < 4; ++q) {
      b[8 * h + 2 * q] = _mm_unpacklo_epi32(a[8 * h + q], a[8 * h + 4 + q]);
      b[8 * h + 2 * q + 1] = _mm_unpackhi_epi32(a[8 * h + q], a[8 * h + 4 + q]);
    }
  }
  for (int c = 0; c < 8; ++c) {  // columns 2c, 2c+1 of all 16 rows
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (2 * c) * dst_stride), _mm_unpacklo_epi64(b[c], b[8 + c]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (2 * c + 1) * dst_stride), _mm_unpackhi_epi64(b[c], b[8 + c]));
  }
}
#endif

#if defined(__SSE2__)
// dst[j][i] = src[i][j] for a 4x4 block of 4-byte elements: two rounds of unpacks, in registers.
inline void transpose4x4_u32(const uint32_t* src, int64_t src_stride, uint32_t* dst, int64_t dst_stride) {
  const __m128i r0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  const __m128i r1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + src_stride));
  const __m128i r2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * src_stride));
  const __m128i r3 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 3 * src_stride));
  const __m128i lo01 = _mm_unpacklo_epi32(r0, r1), lo23 = _mm_unpacklo_epi32(r2, r3);
  const __m128i hi01 = _mm_unpackhi_epi32(r0, r1), hi23 = _mm_unpackhi_epi32(r2, r3);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm_unpacklo_epi64(lo01, lo23));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + dst_stride), _mm_unpackhi_epi64(lo01, lo23));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * dst_stride), _mm_unpacklo_epi64(hi01, hi23));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 3 * dst_stride), _mm_unpackhi_epi64(hi01, hi23));
}
#endif

// A tile of kTile tokens x kTile dims goes through a local buffer: both sides are then read and
// written kTile elements at a time (rows of the transposed page, rows of the chunk), and no two
// of the rows in flight alias in the L1 cache as a token-by-token walk would. Any slots.
template <typename T, bool kGather>
void tiled_rows(T* flat, T* cache, const int64_t* base, int64_t tokens, int64_t row_stride, int64_t head_size,
                int64_t dim_stride) {
  constexpr int64_t kTile = 16;
  T buffer[kTile][kTile];
  for (int64_t t0 = 0; t0 < tokens; t0 += kTile) {
    const int64_t tn = std::min(kTile, tokens - t0);
    const int64_t* tile_base = base + t0;
    for (int64_t d0 = 0; d0 < head_size; d0 += kTile) {
      const int64_t dn = std::min(kTile, head_size - d0);
      if (kGather) {
        for (int64_t dd = 0; dd < dn; ++dd) {
          const T* row = cache + (d0 + dd) * dim_stride;
          for (int64_t i = 0; i < tn; ++i) {
            if (tile_base[i] >= 0) buffer[dd][i] = row[tile_base[i]];
          }
        }
        for (int64_t i = 0; i < tn; ++i) {
          if (tile_base[i] < 0) continue;
          T* out = flat + (t0 + i) * row_stride + d0;
          for (int64_t dd = 0; dd < dn; ++dd) out[dd] = buffer[dd][i];
        }
      } else {
        for (int64_t i = 0; i < tn; ++i) {
          if (tile_base[i] < 0) continue;
          const T* in = flat + (t0 + i) * row_stride + d0;
          for (int64_t dd = 0; dd < dn; ++dd) buffer[dd][i] = in[dd];
        }
        for (int64_t dd = 0; dd < dn; ++dd) {
          T* row = cache + (d0 + dd) * dim_stride;
          for (int64_t i = 0; i < tn; ++i) {
            if (tile_base[i] >= 0) row[tile_base[i]] = buffer[dd][i];
          }
        }
      }
    }
  }
}

#if defined(__SSE2__)
// One register transpose of a kGroup x kGroup block (kGroup tokens x kGroup dims).
template <typename T, bool kGather>
inline void transpose_group(T* flat, T* cache, int64_t row_stride, int64_t dim_stride) {
  if constexpr (sizeof(T) == 1) {
    auto* f = reinterpret_cast<uint8_t*>(flat);
    auto* c = reinterpret_cast<uint8_t*>(cache);
    if (kGather) transpose16x16_u8(c, dim_stride, f, row_stride); else transpose16x16_u8(f, row_stride, c, dim_stride);
  } else if constexpr (sizeof(T) == 2) {
    auto* f = reinterpret_cast<uint16_t*>(flat);
    auto* c = reinterpret_cast<uint16_t*>(cache);
    if (kGather) transpose8x8_u16(c, dim_stride, f, row_stride); else transpose8x8_u16(f, row_stride, c, dim_stride);
  } else {
    auto* f = reinterpret_cast<uint32_t*>(flat);
    auto* c = reinterpret_cast<uint32_t*>(cache);
    if (kGather) transpose4x4_u32(c, dim_stride, f, row_stride); else transpose4x4_u32(f, row_stride, c, dim_stride);
  }
}
#endif

// Copies `bytes` (a multiple of 16) to a 16-byte aligned `dst` with non-temporal stores: a write
// that bypasses the cache skips the read-for-ownership of each destination line, a third of the
// traffic of a plain copy into memory not in cache. The caller fences (_mm_sfence) when done.
inline void stream_copy(void* dst, const void* src, int64_t bytes) {
#if defined(__SSE2__)
  auto* out = static_cast<__m128i*>(dst);
  const auto* in = static_cast<const __m128i*>(src);
  for (int64_t i = 0; i < bytes / 16; ++i) _mm_stream_si128(out + i, _mm_loadu_si128(in + i));
#else
  std::memcpy(dst, src, bytes);
#endif
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// One run of tokens in consecutive slots of one block: the unit of work of the CPU page copies.
struct TokenRun {
  int64_t first;  // index into the slot mapping
  int64_t count;
};

// Splits the mapped tokens into runs of consecutive slots inside one block, each at most `max_run`
// long and cut where the in-block position reaches a multiple of `max_run` (so a run of a
// transposed page fills whole cache lines of its rows). Skipped slots (-1) start no run.
std::vector<TokenRun> token_runs(const int64_t* slots, int64_t tokens, int64_t block_size, int64_t max_run) {
  std::vector<TokenRun> runs;
  int64_t t = 0;
  while (t < tokens) {
    if (slots[t] < 0) {
      ++t;
      continue;
    }
    int64_t n = 1;
    while (t + n < tokens && slots[t + n] == slots[t] + n && ((slots[t] + n) % block_size) % max_run != 0) ++n;
    runs.push_back({t, n});
    t += n;
  }
  return runs;
}

#if defined(__SSE2__)
// A run of one cache line of tokens of every head into a transposed view (token stride 1, the
// run's first token at a line start): each group of kGroup dimensions is transposed into a
// line-wide buffer in L1 and its kGroup page lines are streamed out whole.
template <typename T>
void transposed_line_scatter(T* rows, T* page, int64_t heads, int64_t head_stride, int64_t row_stride,
                             int64_t head_size, int64_t dim_stride) {
  constexpr int64_t kGroup = 16 / sizeof(T), kLine = 64 / sizeof(T);
  alignas(64) T buffer[kGroup][kLine];
  for (int64_t head = 0; head < heads; ++head) {
    T* flat = rows + head * head_size;
    T* cell = page + head * head_stride;
    for (int64_t d = 0; d < head_size; d += kGroup) {
      for (int64_t s = 0; s < kLine; s += kGroup) {
        transpose_group<T, false>(flat + s * row_stride + d, &buffer[0][s], row_stride, kLine);
      }
      for (int64_t r = 0; r < kGroup; ++r) stream_copy(cell + (d + r) * dim_stride, buffer[r], 64);
    }
  }
}

// One run of every head through a transposed view (token stride 1): kGroup x kGroup register
// transposes, groups of kGroup tokens outermost so the chunk is read (written) in address order
// while the run's page lines collect their tokens in cache; a remainder shorter than kGroup goes
// through the tiled path.
template <typename T, bool kGather>
void transposed_run(T* rows, T* page, int64_t count, int64_t heads, int64_t head_stride, int64_t row_stride,
                    int64_t head_size, int64_t dim_stride) {
  constexpr int64_t kGroup = 16 / sizeof(T);
  const int64_t whole = count - count % kGroup;
  for (int64_t s = 0; s < whole; s += kGroup) {
    for (int64_t head = 0; head < heads; ++head) {
      T* flat = rows + s * row_stride + head * head_size;
      T* cell = page + head * head_stride + s;
      for (int64_t d = 0; d < head_size; d += kGroup) {
        transpose_group<T, kGather>(flat + d, cell + d * dim_stride, row_stride, dim_stride);
      }
    }
  }
  if (whole < count) {
    int64_t base[kGroup];
    for (int64_t i = whole; i < count; ++i) base[i - whole] = i;
    for (int64_t head = 0; head < heads; ++head) {
      tiled_rows<T, kGather>(rows + whole * row_stride + head * head_size, page + head * head_stride, base,
                             count - whole, row_stride, head_size, dim_stride);
    }
  }
}
#endif

// Strided paged copy: per layer a K and a V view [num_blocks, block_size, heads, head_size] of any
// strides (vLLM's CPU cache holds K transposed per (block, head) page: the head_size stride is
// block_size, the token stride 1) <-> a contiguous chunk [layers, 2, tokens, heads, head_size].
// Work is split by (part, run of tokens) with every head inside, so the chunk is walked in address
// order (a head-by-head walk reads rows heads * head_size apart, a stride the prefetchers drop at
// each 4 KiB page). Rows whose head_size stride is 1 are memcpy'd; transposed rows of 1-, 2- and
// 4-byte elements go through register transposes; anything else through tiles.
template <typename T, bool kGather>
void strided_paged_copy(const std::vector<at::Tensor>& caches, const int64_t* slots, int64_t tokens,
                        int64_t block_size, T* chunk) {
  const int64_t heads = caches[0].size(2), head_size = caches[0].size(3);
  const int64_t parts = static_cast<int64_t>(caches.size());
  const int64_t row_stride = heads * head_size;
  const std::vector<TokenRun> runs = token_runs(slots, tokens, block_size, std::max<int64_t>(64 / sizeof(T), 16));
  const int64_t count = static_cast<int64_t>(runs.size());
  parallel_items(parts * count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t part = item / count;
      const TokenRun& run = runs[item % count];
      const at::Tensor& cache = caches[part];
      const int64_t token_stride = cache.stride(1), dim_stride = cache.stride(3);
      const int64_t slot = slots[run.first];
      T* page = static_cast<T*>(cache.data_ptr()) + (slot / block_size) * cache.stride(0) +
                (slot % block_size) * token_stride;
      T* rows = chunk + (part * tokens + run.first) * row_stride;
      if (dim_stride == 1) {  // tokens outermost: the chunk is read (written) in address order
        const bool streamed = (head_size * sizeof(T)) % 16 == 0 && aligned16(page) &&
                              (token_stride * sizeof(T)) % 16 == 0 && (cache.stride(2) * sizeof(T)) % 16 == 0;
        for (int64_t i = 0; i < run.count; ++i) {
          for (int64_t head = 0; head < heads; ++head) {
            T* flat = rows + i * row_stride + head * head_size;
            T* cell = page + i * token_stride + head * cache.stride(2);
            if (kGather) {
              std::memcpy(flat, cell, head_size * sizeof(T));
            } else if (streamed) {
              stream_copy(cell, flat, head_size * sizeof(T));
            } else {
              std::memcpy(cell, flat, head_size * sizeof(T));
            }
          }
        }
        continue;
      }
#if defined(__SSE2__)
      if (token_stride == 1 && head_size % (16 / sizeof(T)) == 0 && sizeof(T) <= 4) {
        if (!kGather && run.count == 64 / static_cast<int64_t>(sizeof(T)) && aligned16(page) &&
            (cache.stride(2) * sizeof(T)) % 16 == 0 && (dim_stride * sizeof(T)) % 16 == 0) {
          transposed_line_scatter<T>(rows, page, heads, cache.stride(2), row_stride, head_size, dim_stride);
          continue;
        }
        transposed_run<T, kGather>(rows, page, run.count, heads, cache.stride(2), row_stride, head_size, dim_stride);
        continue;
      }
#endif
      for (int64_t head = 0; head < heads; ++head) {
        T* flat = rows + head * head_size;
        T* cell = page + head * cache.stride(2);
        int64_t base[64];
        for (int64_t i = 0; i < run.count; ++i) base[i] = i * token_stride;
        tiled_rows<T, kGather>(flat, cell, base, run.count, row_stride, head_size, dim_stride);
      }
    }
#if defined(__SSE2__)
    _mm_sfence();  // streamed stores are visible before this thread's share counts as done
#endif
  });
}

// The slot mapping and chunk of a CPU page copy: slots a contiguous int64 vector (each -1 or below
// num_slots), the chunk a contiguous [layers, 2, tokens, heads, head_size] tensor of the cache's dtype.
void check_slots_and_chunk(const at::Tensor& slot_mapping, const at::Tensor& chunk, at::ScalarType dtype,
                           int64_t layers, int64_t heads, int64_t head_size, int64_t num_slots) {
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.scalar_type() == at::kLong && slot_mapping.device().is_cpu() &&
                  slot_mapping.is_contiguous(),
              "tierkv: slot_mapping must be a contiguous 1-D int64 CPU tensor, got ", slot_mapping.scalar_type(), " ",
              shape_of(slot_mapping));
  const int64_t tokens = slot_mapping.size(0);
  TORCH_CHECK(chunk.is_contiguous() && chunk.device().is_cpu() && chunk.scalar_type() == dtype &&
                  chunk.sizes() == at::IntArrayRef({layers, 2, tokens, heads, head_size}),
              "tierkv: chunk must be a contiguous CPU ", dtype, " tensor [", layers, ", 2, ", tokens, ", ", heads, ", ",
              head_size, "], got ", chunk.scalar_type(), " ", shape_of(chunk));
  check_slots(slot_mapping.data_ptr<int64_t>(), tokens, num_slots);
}

// Paged caches whose pages have their own element order (mapped, amx): per layer [num_blocks, heads, ...],
// every layer a CPU tensor like the first, each (block, head) page contiguous and no two pages overlapping.
// Returns the elements of one page.
int64_t check_page_layers(const std::vector<at::Tensor>& layers) {
  TORCH_CHECK(!layers.empty(), "tierkv: layers must hold one paged cache tensor per layer, got none");
  const at::Tensor& first = layers[0];
  TORCH_CHECK(first.dim() >= 3, "tierkv: layers[0] must be [num_blocks, heads, ...], got ", shape_of(first));
  const int64_t page = first[0][0].numel();
  for (size_t i = 0; i < layers.size(); ++i) {
    TORCH_CHECK(layers[i].sizes() == first.sizes() && layers[i].strides() == first.strides() &&
                    layers[i].scalar_type() == first.scalar_type() && layers[i].device().is_cpu() &&
                    layers[i][0][0].is_contiguous(),
                "tierkv: layers[", i, "] must be a CPU ", first.scalar_type(), " tensor of shape ", shape_of(first),
                " with the first's strides and contiguous pages, got ", layers[i].scalar_type(), " ",
                shape_of(layers[i]));
  }
  TORCH_CHECK(first.size(0) == 1 || first.stride(0) >= page, "tierkv: blocks overlap");
  TORCH_CHECK(first.size(1) == 1 || first.stride(1) >= page, "tierkv: pages of one block overlap");
  return page;
}

void paged_copy_strided_cpu(at::TensorList caches_list, const at::Tensor& slot_mapping, const at::Tensor& chunk,
                            bool gather) {
  const std::vector<at::Tensor> caches = caches_list.vec();
  TORCH_CHECK(!caches.empty() && caches.size() % 2 == 0,
              "tierkv: caches must hold a K and a V view per layer, got ", caches.size(), " tensors");
  const at::Tensor& first = caches[0];
  TORCH_CHECK(first.dim() == 4, "tierkv: caches[0] must be [num_blocks, block_size, heads, head_size], got ",
              shape_of(first));
  for (size_t i = 0; i < caches.size(); ++i) {
    TORCH_CHECK(caches[i].sizes() == first.sizes() && caches[i].scalar_type() == first.scalar_type() &&
                    caches[i].device().is_cpu(),
                "tierkv: caches[", i, "] must be a CPU ", first.scalar_type(), " tensor of shape ", shape_of(first),
                " like caches[0], got ", caches[i].scalar_type(), " ", shape_of(caches[i]), " on ",
                caches[i].device());
  }
  const int64_t layers = static_cast<int64_t>(caches.size()) / 2;
  const int64_t tokens = slot_mapping.size(0);
  const int64_t block_size = first.size(1);
  check_slots_and_chunk(slot_mapping, chunk, first.scalar_type(), layers, first.size(2), first.size(3),
                        first.size(0) * block_size);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  void* data = chunk.data_ptr();
  auto run = [&](auto tag) {
    using T = decltype(tag);
    if (gather) {
      strided_paged_copy<T, true>(caches, slots, tokens, block_size, static_cast<T*>(data));
    } else {
      strided_paged_copy<T, false>(caches, slots, tokens, block_size, static_cast<T*>(data));
    }
  };
  switch (first.element_size()) {
    case 1: run(uint8_t{}); break;
    case 2: run(uint16_t{}); break;
    case 4: run(uint32_t{}); break;
    case 8: run(uint64_t{}); break;
    default: TORCH_CHECK(false, "tierkv: paged_copy_strided moves 1-, 2-, 4- or 8-byte elements, got ",
                         first.element_size(), " bytes (", first.scalar_type(), ")");
  }
}

struct AnyWidth {};  // a run wider than 8 bytes: moved with a sized memcpy

// One part (K or V) of every layer: token i's run j of `unit_bytes` bytes moves between the chunk row and
// page offset map[t * runs + j] (elements). A run of 1, 2, 4 or 8 bytes is one load and one store; a
// wider one (vLLM's vec V: a whole row) one memcpy.
template <typename U, bool kGather>
void mapped_part(const std::vector<at::Tensor>& layers, int64_t part, const int32_t* map, int64_t runs,
                 int64_t unit_bytes, const int64_t* slots, int64_t tokens, int64_t block_size, int64_t heads,
                 int64_t row_bytes, char* chunk) {
  const int64_t count = static_cast<int64_t>(layers.size());
  const int64_t element = layers[0].element_size();
  parallel_items(count * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t layer = item / heads, head = item % heads;
      const at::Tensor& cache = layers[layer];
      char* base = static_cast<char*>(cache.data_ptr()) + head * cache.stride(1) * element;
      const int64_t block_bytes = cache.stride(0) * element;
      char* rows = chunk + ((layer * 2 + part) * tokens * heads + head) * row_bytes;
      for (int64_t i = 0; i < tokens; ++i) {
        const int64_t slot = slots[i];
        if (slot < 0) continue;
        char* page = base + (slot / block_size) * block_bytes;
        const int32_t* offsets = map + (slot % block_size) * runs;
        char* row = rows + i * heads * row_bytes;
        for (int64_t j = 0; j < runs; ++j) {
          char* cell = page + static_cast<int64_t>(offsets[j]) * element;
          char* mine = row + j * unit_bytes;
          if constexpr (std::is_same_v<U, AnyWidth>) {
            if (kGather) std::memcpy(mine, cell, unit_bytes); else std::memcpy(cell, mine, unit_bytes);
          } else if (kGather) {
            std::memcpy(mine, cell, sizeof(U));
          } else {
            std::memcpy(cell, mine, sizeof(U));
          }
        }
      }
    }
  });
}

template <bool kGather>
void mapped_part_any(const std::vector<at::Tensor>& layers, int64_t part, const at::Tensor& map, int64_t unit,
                     const int64_t* slots, int64_t tokens, int64_t block_size, int64_t heads, int64_t row_bytes,
                     char* chunk) {
  const int64_t unit_bytes = unit * layers[0].element_size();
  const int32_t* offsets = map.data_ptr<int32_t>();
  const int64_t runs = map.size(1);
  switch (unit_bytes) {
    case 1: mapped_part<uint8_t, kGather>(layers, part, offsets, runs, 1, slots, tokens, block_size, heads, row_bytes, chunk); break;
    case 2: mapped_part<uint16_t, kGather>(layers, part, offsets, runs, 2, slots, tokens, block_size, heads, row_bytes, chunk); break;
    case 4: mapped_part<uint32_t, kGather>(layers, part, offsets, runs, 4, slots, tokens, block_size, heads, row_bytes, chunk); break;
    case 8: mapped_part<uint64_t, kGather>(layers, part, offsets, runs, 8, slots, tokens, block_size, heads, row_bytes, chunk); break;
    default: mapped_part<AnyWidth, kGather>(layers, part, offsets, runs, unit_bytes, slots, tokens, block_size, heads, row_bytes, chunk);
  }
}

void paged_copy_mapped_cpu(at::TensorList layers_list, const at::Tensor& key_map, const at::Tensor& value_map,
                           int64_t key_unit, int64_t value_unit, int64_t block_size, const at::Tensor& slot_mapping,
                           const at::Tensor& chunk, bool gather) {
  const std::vector<at::Tensor> layers = layers_list.vec();
  const int64_t page = check_page_layers(layers);
  const at::Tensor& first = layers[0];
  for (const at::Tensor* map : {&key_map, &value_map}) {
    TORCH_CHECK(map->dim() == 2 && map->scalar_type() == at::kInt && map->is_contiguous() && map->size(0) == block_size,
                "tierkv: key_map / value_map must be contiguous int32 [", block_size, ", runs], got ",
                map->scalar_type(), " ", shape_of(*map));
  }
  const int64_t head_size = key_map.size(1) * key_unit;
  TORCH_CHECK(key_unit > 0 && value_unit > 0 && value_map.size(1) * value_unit == head_size,
              "tierkv: key and value maps must cover the same head size");
  const int64_t heads = first.size(1);
  const int32_t* maps[2] = {key_map.data_ptr<int32_t>(), value_map.data_ptr<int32_t>()};
  const int64_t units[2] = {key_unit, value_unit};
  for (int part = 0; part < 2; ++part) {
    const at::Tensor& map = part == 0 ? key_map : value_map;
    for (int64_t k = 0; k < map.numel(); ++k) {
      TORCH_CHECK(maps[part][k] >= 0 && maps[part][k] + units[part] <= page,
                  "tierkv: a page offset of the ", part == 0 ? "key" : "value", " map falls outside the ", page,
                  "-element page: ", maps[part][k]);
    }
  }
  const int64_t tokens = slot_mapping.size(0);
  check_slots_and_chunk(slot_mapping, chunk, first.scalar_type(), static_cast<int64_t>(layers.size()), heads,
                        head_size, first.size(0) * block_size);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  char* data = static_cast<char*>(chunk.data_ptr());
  const int64_t row_bytes = head_size * first.element_size();
  for (int64_t part = 0; part < 2; ++part) {
    const at::Tensor& map = part == 0 ? key_map : value_map;
    if (gather) {
      mapped_part_any<true>(layers, part, map, units[part], slots, tokens, block_size, heads, row_bytes, data);
    } else {
      mapped_part_any<false>(layers, part, map, units[part], slots, tokens, block_size, heads, row_bytes, data);
    }
  }
}

constexpr int64_t kMaxAmxPairs = 256;  // head sizes up to 512 (vLLM's CPU attention supports up to 256)

// vLLM's amx CPU page order (tierkv/integrations/vllm_v1/cpu_pages.py): K as [t/16][d/2][t%16][d%2]
// (16-token tiles of dimension pairs), V as [d/16][t/2][d%16][t%2] (16-dimension tiles of token
// pairs), for 1- and 2-byte elements (fp8, bf16/fp16). One token at a time: a K pair moves as one
// element twice as wide; a run of 16 tokens aligned to a tile goes through register transposes
// (4-byte pairs) and its V pairs are interleaved / split 16 dimensions at a time. A null row
// leaves that part alone.
template <typename E, bool kGather>
inline void amx_token(E* page, E* krow, E* vrow, int64_t t, int64_t block_size, int64_t head_size) {
  using P = std::conditional_t<sizeof(E) == 2, uint32_t, uint16_t>;
  const int64_t pairs = head_size / 2;
  P* kp = reinterpret_cast<P*>(page) + (t / 16) * 16 * pairs + (t % 16);
  P* rp = reinterpret_cast<P*>(krow);
  for (int64_t j = 0; krow != nullptr && j < pairs; ++j) {
    if (kGather) std::memcpy(rp + j, kp + j * 16, sizeof(P)); else std::memcpy(kp + j * 16, rp + j, sizeof(P));
  }
  E* vp = page + block_size * head_size + (t / 2) * 32 + (t % 2);
  for (int64_t g = 0; vrow != nullptr && g < head_size / 16; ++g) {
    E* cell = vp + g * block_size * 16;
    E* mine = vrow + g * 16;
    for (int64_t k = 0; k < 16; ++k) {
      if (kGather) mine[k] = cell[2 * k]; else cell[2 * k] = mine[k];
    }
  }
}

#if defined(__SSE2__)
// A 16-byte store: streamed (non-temporal, `dst` 16-byte aligned) or plain.
template <bool kStream>
inline void store16(void* dst, __m128i value) {
  if constexpr (kStream) _mm_stream_si128(static_cast<__m128i*>(dst), value);
  else _mm_storeu_si128(static_cast<__m128i*>(dst), value);
}

// 16 dimensions of two tokens a, b <-> the 32 elements [a0 b0 a1 b1 ...] of an amx V tile row
// (64 bytes for 2-byte elements, 32 for 1-byte), written with plain or streamed stores.
template <bool kStream = false>
inline void interleave16(const uint16_t* a, const uint16_t* b, uint16_t* cell) {
  for (int h = 0; h < 2; ++h) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + h * 8));
    const __m128i y = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + h * 8));
    store16<kStream>(cell + h * 16, _mm_unpacklo_epi16(x, y));
    store16<kStream>(cell + h * 16 + 8, _mm_unpackhi_epi16(x, y));
  }
}

inline __m128i evens_then_odds_u16(__m128i x) {  // [a0 b0 a1 b1 a2 b2 a3 b3] -> [a0 a1 a2 a3 b0 b1 b2 b3]
  x = _mm_shufflelo_epi16(x, _MM_SHUFFLE(3, 1, 2, 0));
  x = _mm_shufflehi_epi16(x, _MM_SHUFFLE(3, 1, 2, 0));
  return _mm_shuffle_epi32(x, _MM_SHUFFLE(3, 1, 2, 0));
}

inline void deinterleave16(const uint16_t* cell, uint16_t* a, uint16_t* b) {
  for (int h = 0; h < 2; ++h) {
    const __m128i x = evens_then_odds_u16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(cell + h * 16)));
    const __m128i y = evens_then_odds_u16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(cell + h * 16 + 8)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(a + h * 8), _mm_unpacklo_epi64(x, y));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(b + h * 8), _mm_unpackhi_epi64(x, y));
  }
}

template <bool kStream = false>
inline void interleave16(const uint8_t* a, const uint8_t* b, uint8_t* cell) {
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a));
  const __m128i y = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
  store16<kStream>(cell, _mm_unpacklo_epi8(x, y));
  store16<kStream>(cell + 16, _mm_unpackhi_epi8(x, y));
}

inline void deinterleave16(const uint8_t* cell, uint8_t* a, uint8_t* b) {
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(cell));
  const __m128i y = _mm_loadu_si128(reinterpret_cast<const __m128i*>(cell + 16));
  const __m128i low = _mm_set1_epi16(0x00FF);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(a), _mm_packus_epi16(_mm_and_si128(x, low), _mm_and_si128(y, low)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(b), _mm_packus_epi16(_mm_srli_epi16(x, 8), _mm_srli_epi16(y, 8)));
}
#endif

#if defined(__SSE2__)
// The V part of a whole 16-token tile of every head into 16-byte aligned pages: token pairs
// outermost, so the chunk is read in address order (two rows of every head at a time), and each
// page line (one token pair of 16 dimensions for 2-byte elements, two pairs for 1-byte) is
// written whole, back to back, with streamed stores.
template <typename E>
void amx_values_streamed(E* block, int64_t head_stride, int64_t heads, E* first, int64_t row, int64_t t0,
                         int64_t block_size, int64_t head_size) {
  using U = std::conditional_t<sizeof(E) == 2, uint16_t, uint8_t>;
  constexpr int64_t kPairsPerLine = 2 / sizeof(E);
  for (int64_t p0 = 0; p0 < 8; p0 += kPairsPerLine) {
    for (int64_t head = 0; head < heads; ++head) {
      E* v = block + head * head_stride + block_size * head_size + (t0 / 2 + p0) * 32;
      for (int64_t g = 0; g < head_size / 16; ++g) {
        for (int64_t q = 0; q < kPairsPerLine; ++q) {
          const U* a = reinterpret_cast<const U*>(first + 2 * (p0 + q) * row + head * head_size) + g * 16;
          interleave16<true>(a, a + row, reinterpret_cast<U*>(v + g * block_size * 16 + q * 32));
        }
      }
    }
  }
}
#endif

// One whole 16-token tile of one head, K or V part (kPart 0 / 1): chunk rows `row` elements
// apart from `first` (the tile's first token row of that head and part).
template <typename E, bool kGather, int kPart>
inline void amx_tile(E* page, E* first, int64_t row, int64_t t0, int64_t block_size, int64_t head_size) {
#if defined(__SSE2__)
  using P = std::conditional_t<sizeof(E) == 2, uint32_t, uint16_t>;
  using U = std::conditional_t<sizeof(E) == 2, uint16_t, uint8_t>;
  constexpr int64_t kSide = sizeof(P) == 4 ? 4 : 8;  // register transposes of kSide x kSide pairs
  // K: the tile is [pairs][16 tokens] of pairs, contiguous; each chunk row is [pairs] of them.
  // V: per 16 dimensions g, the tile's 8 token pairs are 8 x 32 interleaved elements, contiguous.
  if constexpr (kPart == 0) {
    const bool aligned = aligned16(page);  // tiles sit 16 * head_size elements apart: all aligned alike
    const int64_t pairs = head_size / 2, pair_row = row / 2;
    P* rows = reinterpret_cast<P*>(first);
    P* tile = reinterpret_cast<P*>(page) + (t0 / 16) * 16 * pairs;
    auto transpose = [](const P* src, int64_t src_stride, P* dst, int64_t dst_stride) {
      if constexpr (kSide == 4) transpose4x4_u32(src, src_stride, dst, dst_stride);
      else transpose8x8_u16(src, src_stride, dst, dst_stride);
    };
    if constexpr (!kGather) {  // built in L1 and streamed out whole (no read-for-ownership)
      alignas(64) P kbuf[kMaxAmxPairs * 16];
      for (int64_t j = 0; j < pairs; j += kSide) {
        for (int64_t i = 0; i < 16; i += kSide) transpose(rows + i * pair_row + j, pair_row, kbuf + j * 16 + i, 16);
      }
      if (aligned) stream_copy(tile, kbuf, 16 * pairs * sizeof(P)); else std::memcpy(tile, kbuf, 16 * pairs * sizeof(P));
    } else {
      for (int64_t j = 0; j < pairs; j += kSide) {
        for (int64_t i = 0; i < 16; i += kSide) transpose(tile + j * 16 + i, 16, rows + i * pair_row + j, pair_row);
      }
    }
  } else {
    E* v = page + block_size * head_size + (t0 / 2) * 32;
    if constexpr (!kGather) {  // pages off the 16-byte alignment (amx_values_streamed takes the rest)
      for (int64_t p = 0; p < 8; ++p) {
        const U* a = reinterpret_cast<const U*>(first + (2 * p) * row);
        for (int64_t g = 0; g < head_size / 16; ++g) {
          interleave16(a + g * 16, a + row + g * 16, reinterpret_cast<U*>(v + g * block_size * 16 + p * 32));
        }
      }
    } else {
      for (int64_t p = 0; p < 8; ++p) {
        U* a = reinterpret_cast<U*>(first + (2 * p) * row);
        for (int64_t g = 0; g < head_size / 16; ++g) {
          deinterleave16(reinterpret_cast<U*>(v + g * block_size * 16 + p * 32), a + g * 16, a + row + g * 16);
        }
      }
    }
  }
#else
  for (int64_t i = 0; i < 16; ++i) {
    if constexpr (kPart == 0) amx_token<E, kGather>(page, first + i * row, nullptr, t0 + i, block_size, head_size);
    else amx_token<E, kGather>(page, nullptr, first + i * row, t0 + i, block_size, head_size);
  }
#endif
}

// Work is split by (layer, run of up to 16 tokens in consecutive slots of one block), every head
// inside: the chunk is walked in address order. A run that is a whole 16-token tile goes through
// amx_tile, any other token one by one.
template <typename E, bool kGather>
void amx_copy(const std::vector<at::Tensor>& layers, const int64_t* slots, int64_t tokens, int64_t block_size,
              int64_t head_size, char* chunk) {
  const int64_t count = static_cast<int64_t>(layers.size());
  const int64_t heads = layers[0].size(1);
  const int64_t row = heads * head_size;
  const std::vector<TokenRun> runs = token_runs(slots, tokens, block_size, 16);
  const int64_t run_count = static_cast<int64_t>(runs.size());
  parallel_items(count * run_count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t layer = item / run_count;
      const TokenRun& run = runs[item % run_count];
      const at::Tensor& cache = layers[layer];
      const int64_t slot = slots[run.first];
      const int64_t t = slot % block_size;
      E* block = static_cast<E*>(cache.data_ptr()) + (slot / block_size) * cache.stride(0);
      E* kplane = reinterpret_cast<E*>(chunk) + (layer * 2) * tokens * row + run.first * row;
      E* vplane = kplane + tokens * row;
      if (run.count == 16) {  // runs are cut at in-block multiples of 16: a whole tile, K then V of every head
        for (int64_t head = 0; head < heads; ++head) {
          amx_tile<E, kGather, 0>(block + head * cache.stride(1), kplane + head * head_size, row, t, block_size,
                                  head_size);
        }
#if defined(__SSE2__)
        if (!kGather && aligned16(block) && (cache.stride(1) * sizeof(E)) % 16 == 0) {
          amx_values_streamed<E>(block, cache.stride(1), heads, vplane, row, t, block_size, head_size);
          continue;
        }
#endif
        for (int64_t head = 0; head < heads; ++head) {
          amx_tile<E, kGather, 1>(block + head * cache.stride(1), vplane + head * head_size, row, t, block_size,
                                  head_size);
        }
        continue;
      }
      for (int64_t head = 0; head < heads; ++head) {
        for (int64_t k = 0; k < run.count; ++k) {
          amx_token<E, kGather>(block + head * cache.stride(1), kplane + k * row + head * head_size,
                                vplane + k * row + head * head_size, t + k, block_size, head_size);
        }
      }
    }
#if defined(__SSE2__)
    _mm_sfence();  // streamed stores are visible before this thread's share counts as done
#endif
  });
}

void paged_copy_amx_cpu(at::TensorList layers_list, int64_t block_size, const at::Tensor& slot_mapping,
                        const at::Tensor& chunk, bool gather) {
  const std::vector<at::Tensor> layers = layers_list.vec();
  check_page_layers(layers);
  const at::Tensor& first = layers[0];
  TORCH_CHECK(first.dim() == 4 && first.size(2) == block_size && first.size(3) % 32 == 0 && block_size % 16 == 0,
              "tierkv: amx layers must be [num_blocks, heads, block_size, 2 * head_size] with block_size a multiple "
              "of 16 and head_size of 16, got ", shape_of(first), " and block size ", block_size);
  TORCH_CHECK(first.element_size() == 1 || first.element_size() == 2,
              "tierkv: the amx order holds 1- or 2-byte elements, got ", first.scalar_type());
  TORCH_CHECK(first.size(3) / 2 <= 2 * kMaxAmxPairs, "tierkv: the amx kernel moves head sizes up to ",
              2 * kMaxAmxPairs, ", got ", first.size(3) / 2);
  const int64_t tokens = slot_mapping.size(0), heads = first.size(1), head_size = first.size(3) / 2;
  check_slots_and_chunk(slot_mapping, chunk, first.scalar_type(), static_cast<int64_t>(layers.size()), heads,
                        head_size, first.size(0) * block_size);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  char* data = static_cast<char*>(chunk.data_ptr());
  if (first.element_size() == 2) {
    if (gather) amx_copy<uint16_t, true>(layers, slots, tokens, block_size, head_size, data);
    else amx_copy<uint16_t, false>(layers, slots, tokens, block_size, head_size, data);
  } else {
    if (gather) amx_copy<uint8_t, true>(layers, slots, tokens, block_size, head_size, data);
    else amx_copy<uint8_t, false>(layers, slots, tokens, block_size, head_size, data);
  }
}

// Meta (shape-only) kernels, so torch.compile / FakeTensor tracing and opcheck work.
void paged_gather_meta(at::TensorList, at::TensorList, const at::Tensor&, const at::Tensor&, bool) {}
void paged_scatter_meta(const at::Tensor&, at::TensorList, at::TensorList, const at::Tensor&, bool) {}
at::Tensor kv_deviation_meta(const at::Tensor& retrieved_k, const at::Tensor& fresh_k) {
  check_kv_deviation(retrieved_k, fresh_k);
  return at::empty({retrieved_k.size(0)}, retrieved_k.options().dtype(at::kFloat));
}
void blend_scatter_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&) {}
void rope_rerotate_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, bool) {}
void paged_copy_strided_meta(at::TensorList, const at::Tensor&, const at::Tensor&, bool) {}
void paged_copy_amx_meta(at::TensorList, int64_t, const at::Tensor&, const at::Tensor&, bool) {}
void paged_copy_mapped_meta(at::TensorList, const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t,
                            const at::Tensor&, const at::Tensor&, bool) {}

}  // namespace
}  // namespace tierkv

TORCH_LIBRARY(tierkv, m) {
  m.def(
      "paged_gather(Tensor[] key_caches, Tensor[] value_caches, Tensor slot_mapping, Tensor(a!) out, "
      "bool huggingface_order) -> ()");
  m.def(
      "paged_scatter(Tensor chunk, Tensor(a!)[] key_caches, Tensor(a!)[] value_caches, Tensor slot_mapping, "
      "bool huggingface_order) -> ()");
  m.def("kv_deviation(Tensor retrieved_k, Tensor fresh_k) -> Tensor");
  m.def("blend_scatter(Tensor(a!) dst, Tensor src, Tensor indices) -> ()");
  m.def(
      "rope_rerotate(Tensor(a!) k, Tensor old_positions, Tensor new_positions, Tensor cos_sin_cache, "
      "bool is_neox) -> ()");
  m.def("paged_copy_strided(Tensor(a!)[] caches, Tensor slot_mapping, Tensor(b!) chunk, bool gather) -> ()");
  m.def(
      "paged_copy_mapped(Tensor(a!)[] layers, Tensor key_map, Tensor value_map, int key_unit, int value_unit, "
      "int block_size, Tensor slot_mapping, Tensor(b!) chunk, bool gather) -> ()");
  m.def("paged_copy_amx(Tensor(a!)[] layers, int block_size, Tensor slot_mapping, Tensor(b!) chunk, bool gather) -> ()");
  m.def("set_copy_threads(int threads) -> ()", &tierkv::set_copy_threads);
  m.def("copy_threads() -> int", &tierkv::copy_threads_now);
}

TORCH_LIBRARY_IMPL(tierkv, CPU, m) {
  m.impl("paged_gather", &tierkv::paged_gather_cpu);
  m.impl("paged_scatter", &tierkv::paged_scatter_cpu);
  m.impl("kv_deviation", &tierkv::kv_deviation_cpu);
  m.impl("blend_scatter", &tierkv::blend_scatter_cpu);
  m.impl("rope_rerotate", &tierkv::rope_rerotate_cpu);
  m.impl("paged_copy_strided", &tierkv::paged_copy_strided_cpu);
  m.impl("paged_copy_mapped", &tierkv::paged_copy_mapped_cpu);
  m.impl("paged_copy_amx", &tierkv::paged_copy_amx_cpu);
}

TORCH_LIBRARY_IMPL(tierkv, Meta, m) {
  m.impl("paged_gather", &tierkv::paged_gather_meta);
  m.impl("paged_scatter", &tierkv::paged_scatter_meta);
  m.impl("kv_deviation", &tierkv::kv_deviation_meta);
  m.impl("blend_scatter", &tierkv::blend_scatter_meta);
  m.impl("rope_rerotate", &tierkv::rope_rerotate_meta);
  m.impl("paged_copy_strided", &tierkv::paged_copy_strided_meta);
  m.impl("paged_copy_mapped", &tierkv::paged_copy_mapped_meta);
  m.impl("paged_copy_amx", &tierkv::paged_copy_amx_meta);
}
