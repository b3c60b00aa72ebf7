// tierkv ops: one schema each (TORCH_LIBRARY), C++ CPU kernels and shape-only Meta kernels.
// The CUDA kernels (tierkv_ops_cuda.cu) register under the same op names; both use the index
// math in tierkv_index.h. Python entry points and the pure-torch reference: tierkv/ops.py.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

#include <cstring>
#include <vector>

#include "tierkv_checks.h"
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
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
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
    at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
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
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
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
    at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
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

// Meta (shape-only) kernels, so torch.compile / FakeTensor tracing and opcheck work.
void paged_gather_meta(at::TensorList, at::TensorList, const at::Tensor&, const at::Tensor&, bool) {}
void paged_scatter_meta(const at::Tensor&, at::TensorList, at::TensorList, const at::Tensor&, bool) {}
at::Tensor kv_deviation_meta(const at::Tensor& retrieved_k, const at::Tensor& fresh_k) {
  check_kv_deviation(retrieved_k, fresh_k);
  return at::empty({retrieved_k.size(0)}, retrieved_k.options().dtype(at::kFloat));
}
void blend_scatter_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&) {}
void rope_rerotate_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, bool) {}

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
}

TORCH_LIBRARY_IMPL(tierkv, CPU, m) {
  m.impl("paged_gather", &tierkv::paged_gather_cpu);
  m.impl("paged_scatter", &tierkv::paged_scatter_cpu);
  m.impl("kv_deviation", &tierkv::kv_deviation_cpu);
  m.impl("blend_scatter", &tierkv::blend_scatter_cpu);
  m.impl("rope_rerotate", &tierkv::rope_rerotate_cpu);
}

TORCH_LIBRARY_IMPL(tierkv, Meta, m) {
  m.impl("paged_gather", &tierkv::paged_gather_meta);
  m.impl("paged_scatter", &tierkv::paged_scatter_meta);
  m.impl("kv_deviation", &tierkv::kv_deviation_meta);
  m.impl("blend_scatter", &tierkv::blend_scatter_meta);
  m.impl("rope_rerotate", &tierkv::rope_rerotate_meta);
}
