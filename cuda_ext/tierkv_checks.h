// Input validation shared by the CPU and CUDA op implementations: every message names the
// tensor and the expected shape / dtype / device. Host code only.
#pragma once

#include <torch/library.h>
#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "tierkv_index.h"

namespace tierkv {

inline std::string shape_of(const at::Tensor& t) { return c10::str(t.sizes()); }

inline void check_device(const at::Tensor& t, const char* name, const c10::Device& device) {
  TORCH_CHECK(t.device() == device, "tierkv: ", name, " must be on ", device, " (where the other inputs are), got ",
              t.device());
}

// Validates a paged gather/scatter and returns its geometry. The chunk is `out` for a gather
// and `chunk` for a scatter.
inline PagedGeometry paged_geometry(const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                                    const at::Tensor& slot_mapping, const at::Tensor& chunk, bool hf_order,
                                    const char* chunk_name) {
  TORCH_CHECK(!keys.empty(), "tierkv: key_caches must hold one tensor per layer, got none");
  TORCH_CHECK(keys.size() == values.size(), "tierkv: key_caches has ", keys.size(), " layers but value_caches has ",
              values.size());
  const at::Tensor& first = keys[0];
  TORCH_CHECK(first.dim() == 4, "tierkv: key_caches[0] must be [num_blocks, block_size, heads, head_size], got ",
              shape_of(first));
  const auto device = first.device();
  for (size_t layer = 0; layer < keys.size(); ++layer) {
    for (int kv = 0; kv < 2; ++kv) {
      const at::Tensor& t = kv == 0 ? keys[layer] : values[layer];
      const char* part = kv == 0 ? "key_caches" : "value_caches";
      TORCH_CHECK(t.sizes() == first.sizes(), "tierkv: ", part, "[", layer, "] must be ", shape_of(first),
                  " like key_caches[0], got ", shape_of(t));
      TORCH_CHECK(t.scalar_type() == first.scalar_type(), "tierkv: ", part, "[", layer, "] must have dtype ",
                  first.scalar_type(), " like key_caches[0], got ", t.scalar_type());
      TORCH_CHECK(t.device() == device, "tierkv: ", part, "[", layer, "] must be on ", device, ", got ", t.device());
      TORCH_CHECK(t.strides() == first.strides(), "tierkv: ", part, "[", layer, "] must have the strides ",
                  c10::str(first.strides()), " of key_caches[0] (one launch addresses all layers), got ",
                  c10::str(t.strides()));
    }
  }
  const int64_t heads = first.size(2), head_size = first.size(3);
  TORCH_CHECK(first.stride(3) == 1 && first.stride(2) == head_size, "tierkv: key_caches[0] rows [heads, head_size] ",
              "must be contiguous, got strides ", c10::str(first.strides()));
  TORCH_CHECK(slot_mapping.dim() == 1 &&
                  (slot_mapping.scalar_type() == at::kLong || slot_mapping.scalar_type() == at::kInt),
              "tierkv: slot_mapping must be 1-D int32/int64, got ", slot_mapping.dim(), "-D ",
              slot_mapping.scalar_type());
  check_device(slot_mapping, "slot_mapping", device);
  TORCH_CHECK(slot_mapping.is_contiguous(), "tierkv: slot_mapping must be contiguous");
  const int64_t layers = static_cast<int64_t>(keys.size());
  const int64_t tokens = slot_mapping.size(0);
  std::vector<int64_t> expected = hf_order ? std::vector<int64_t>{layers, 2, heads, tokens, head_size}
                                           : std::vector<int64_t>{layers, 2, tokens, heads, head_size};
  TORCH_CHECK(chunk.sizes() == at::IntArrayRef(expected), "tierkv: ", chunk_name, " must be ",
              hf_order ? "huggingface" : "vllm", "-order ", c10::str(at::IntArrayRef(expected)), ", got ",
              shape_of(chunk));
  TORCH_CHECK(chunk.scalar_type() == first.scalar_type(), "tierkv: ", chunk_name, " must have the cache dtype ",
              first.scalar_type(), ", got ", chunk.scalar_type());
  check_device(chunk, chunk_name, device);
  TORCH_CHECK(chunk.is_contiguous(), "tierkv: ", chunk_name, " must be contiguous");
  const int64_t elem = first.element_size();
  PagedGeometry g;
  g.num_layers = layers;
  g.num_tokens = tokens;
  g.num_slots = first.size(0) * first.size(1);
  g.block_size = first.size(1);
  g.heads = heads;
  g.head_bytes = head_size * elem;
  g.block_stride = first.stride(0) * elem;
  g.slot_stride = first.stride(1) * elem;
  g.hf_order = hf_order;
  return g;
}

// Base addresses of every layer's K then V (index layer * 2 + kv), as integers.
inline std::vector<int64_t> layer_pointers(const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values) {
  std::vector<int64_t> pointers(keys.size() * 2);
  for (size_t layer = 0; layer < keys.size(); ++layer) {
    pointers[layer * 2] = reinterpret_cast<int64_t>(keys[layer].data_ptr());
    pointers[layer * 2 + 1] = reinterpret_cast<int64_t>(values[layer].data_ptr());
  }
  return pointers;
}

inline void check_kv_deviation(const at::Tensor& retrieved, const at::Tensor& fresh) {
  TORCH_CHECK(retrieved.dim() == 3, "tierkv: retrieved_k must be [num_tokens, num_heads, head_size], got ",
              shape_of(retrieved));
  TORCH_CHECK(fresh.sizes() == retrieved.sizes(), "tierkv: fresh_k must be ", shape_of(retrieved),
              " like retrieved_k, got ", shape_of(fresh));
  TORCH_CHECK(fresh.scalar_type() == retrieved.scalar_type(), "tierkv: fresh_k must have retrieved_k's dtype ",
              retrieved.scalar_type(), ", got ", fresh.scalar_type());
  TORCH_CHECK(at::isFloatingType(retrieved.scalar_type()), "tierkv: retrieved_k must be float16/bfloat16/float32, got ",
              retrieved.scalar_type());
  check_device(fresh, "fresh_k", retrieved.device());
}

inline void check_blend_scatter(const at::Tensor& dst, const at::Tensor& src, const at::Tensor& indices) {
  TORCH_CHECK(dst.dim() >= 1, "tierkv: dst must be [num_tokens, ...]");
  TORCH_CHECK(indices.dim() == 1 && indices.scalar_type() == at::kLong, "tierkv: indices must be 1-D int64, got ",
              indices.dim(), "-D ", indices.scalar_type());
  std::vector<int64_t> expected(dst.sizes().begin(), dst.sizes().end());
  expected[0] = indices.size(0);
  TORCH_CHECK(src.sizes() == at::IntArrayRef(expected), "tierkv: src must be [len(indices), *dst.shape[1:]] = ",
              c10::str(at::IntArrayRef(expected)), ", got ", shape_of(src));
  TORCH_CHECK(src.scalar_type() == dst.scalar_type(), "tierkv: src must have dst's dtype ", dst.scalar_type(),
              ", got ", src.scalar_type());
  check_device(src, "src", dst.device());
  check_device(indices, "indices", dst.device());
  TORCH_CHECK(dst.is_contiguous() && src.is_contiguous() && indices.is_contiguous(),
              "tierkv: dst, src and indices must be contiguous");
}

inline void check_rope(const at::Tensor& k, const at::Tensor& old_positions, const at::Tensor& new_positions,
                       const at::Tensor& cos_sin_cache) {
  TORCH_CHECK(k.dim() == 3, "tierkv: k must be [num_tokens, num_heads, head_size], got ", shape_of(k));
  TORCH_CHECK(k.stride(2) == 1, "tierkv: k's head_size dimension must be contiguous (stride 1), got strides ",
              c10::str(k.strides()));
  TORCH_CHECK(at::isFloatingType(k.scalar_type()), "tierkv: k must be float16/bfloat16/float32, got ",
              k.scalar_type());
  for (const auto* pair : {&old_positions, &new_positions}) {
    const char* name = pair == &old_positions ? "old_positions" : "new_positions";
    TORCH_CHECK(pair->dim() == 1 && pair->size(0) == k.size(0) && pair->scalar_type() == at::kLong,
                "tierkv: ", name, " must be int64 [", k.size(0), "], got ", pair->scalar_type(), " ",
                shape_of(*pair));
    TORCH_CHECK(pair->is_contiguous(), "tierkv: ", name, " must be contiguous");
    check_device(*pair, name, k.device());
  }
  TORCH_CHECK(cos_sin_cache.dim() == 2 && cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.is_contiguous(),
              "tierkv: cos_sin_cache must be contiguous float32 [max_position, rot_dim], got ",
              cos_sin_cache.scalar_type(), " ", shape_of(cos_sin_cache));
  const int64_t rot_dim = cos_sin_cache.size(1);
  TORCH_CHECK(rot_dim >= 2 && rot_dim % 2 == 0 && rot_dim <= k.size(2),
              "tierkv: cos_sin_cache rot_dim must be even and <= head_size=", k.size(2), ", got ", rot_dim);
  check_device(cos_sin_cache, "cos_sin_cache", k.device());
}

}  // namespace tierkv
