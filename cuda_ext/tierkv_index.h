// Per-element index math shared by the CPU kernels (tierkv_ops.cpp) and the CUDA kernels
// (tierkv_ops_cuda.cu): the CPU tests exercise exactly the addressing the GPU runs.
//
// Paged cache, per layer, K and V each: [num_blocks, block_size, heads, head_size], rows of
// heads * head_size elements contiguous; a block and a slot inside it are addressed with one
// block stride and one slot stride (in elements), identical for every layer, K and V (so the
// fused [2, num_blocks, ...] layout and vLLM's flash layout [num_blocks, 2, block_size, ...] are
// both just strides). Slot s lives in block s / block_size at offset s % block_size; slot -1
// is not in the cache and is skipped.
//
// Chunk: contiguous [layers, 2, tokens, heads, head_size] (vllm order) or
// [layers, 2, heads, tokens, head_size] (huggingface order).
//
// All offsets are in bytes: gathers and scatters are dtype-agnostic byte copies.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define TIERKV_HD __host__ __device__ __forceinline__
#else
#define TIERKV_HD inline
#endif

namespace tierkv {

struct PagedGeometry {
  int64_t num_layers;
  int64_t num_tokens;
  int64_t num_slots;     // num_blocks * block_size: slots >= this are invalid
  int64_t block_size;
  int64_t heads;
  int64_t head_bytes;    // head_size * element size
  int64_t block_stride;  // bytes between blocks
  int64_t slot_stride;   // bytes between slots of one block
  bool hf_order;         // chunk is [layers, 2, heads, tokens, head_size]
};

// A contiguous run of bytes copied per (layer, kv, token, segment): the whole token row in
// vllm order, one head in huggingface order (where heads of a token are not adjacent).
TIERKV_HD int64_t segment_bytes(const PagedGeometry& g) {
  return g.hf_order ? g.head_bytes : g.heads * g.head_bytes;
}

TIERKV_HD int64_t segments_per_token(const PagedGeometry& g) { return g.hf_order ? g.heads : 1; }

// Byte offset of segment `seg` of slot `slot` from a layer's K or V base pointer.
TIERKV_HD int64_t cache_offset(const PagedGeometry& g, int64_t slot, int64_t seg) {
  const int64_t block = slot / g.block_size;
  const int64_t within = slot - block * g.block_size;
  return block * g.block_stride + within * g.slot_stride + seg * segment_bytes(g);
}

// Byte offset of segment `seg` of token `token` of (layer, kv) in the chunk.
TIERKV_HD int64_t chunk_offset(const PagedGeometry& g, int64_t layer, int64_t kv, int64_t token, int64_t seg) {
  const int64_t plane = (layer * 2 + kv) * g.num_tokens * g.heads * g.head_bytes;
  if (g.hf_order) {
    return plane + (seg * g.num_tokens + token) * g.head_bytes;
  }
  return plane + token * g.heads * g.head_bytes;
}

TIERKV_HD bool slot_valid(const PagedGeometry& g, int64_t slot) { return slot >= 0 && slot < g.num_slots; }

// RoPE: the rotation by (new - old) from the cos/sin rows of both positions, by the
// angle-difference identities; cos_sin rows are [cos(0..half), sin(0..half)].
TIERKV_HD void rotation_delta(const float* old_row, const float* new_row, int64_t half, int64_t i, float* cos_out,
                              float* sin_out) {
  const float co = old_row[i], so = old_row[half + i];
  const float cn = new_row[i], sn = new_row[half + i];
  *cos_out = cn * co + sn * so;
  *sin_out = sn * co - cn * so;
}

// Indices of the i-th rotated pair inside one head: neox rotates halves, GPT-J adjacent pairs.
TIERKV_HD void rope_pair(bool is_neox, int64_t half, int64_t i, int64_t* first, int64_t* second) {
  if (is_neox) {
    *first = i;
    *second = i + half;
  } else {
    *first = 2 * i;
    *second = 2 * i + 1;
  }
}

}  // namespace tierkv
