// CUDA kernels for the tierkv ops, registered under the schemas declared in tierkv_ops.cpp.
// Launchers take raw pointers and a stream; the op wrappers validate (tierkv_checks.h), pick
// the widest vector width the alignment allows (16-byte loads/stores where possible), and
// launch on the current stream. Index math: tierkv_index.h, shared with the CPU kernels.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "tierkv_checks.h"
#include "tierkv_index.h"

namespace tierkv {
namespace {

// Layer base pointers (K of layer l at 2l, V at 2l+1). Up to kInlineLayers layers travel in
// the kernel parameters (no host-to-device copy, no sync); deeper models use a device array.
constexpr int kInlineLayers = 96;

struct LayerPointers {
  const int64_t* device_array;  // used when num_layers > kInlineLayers
  int64_t inline_ptrs[2 * kInlineLayers];
};

__device__ __forceinline__ uint8_t* layer_base(const LayerPointers& p, const PagedGeometry& g, int64_t lkv) {
  const int64_t address = g.num_layers <= kInlineLayers ? p.inline_ptrs[lkv] : p.device_array[lkv];
  return reinterpret_cast<uint8_t*>(address);
}

// Every layer in one launch: grid.y walks (layer, K/V); along x, each thread moves kItems
// vectors of the (token, segment, vector) items of that plane, loading all of them before
// storing any (several loads in flight per thread), and each block covers kItems * blockDim.x
// items (many tokens), so the grid is not hundreds of thousands of tiny blocks.
constexpr int kItems = 4;
constexpr int kThreads = 256;

template <typename VecT, typename index_t, bool kGather>
__global__ void __launch_bounds__(kThreads) paged_copy_kernel(const __grid_constant__ PagedGeometry g,
                                                              const __grid_constant__ LayerPointers p,
                                                              const index_t* __restrict__ slots,
                                                              uint8_t* __restrict__ chunk) {
  const int64_t lkv = blockIdx.y;
  uint8_t* cache = layer_base(p, g, lkv);
  const int64_t seg_vecs = segment_bytes(g) / static_cast<int64_t>(sizeof(VecT));
  const int64_t token_vecs = seg_vecs * segments_per_token(g);
  const int64_t total = token_vecs * g.num_tokens;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kItems * kThreads + threadIdx.x;
  VecT held[kItems];
  VecT* targets[kItems];
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    targets[k] = nullptr;
    const int64_t i = first + static_cast<int64_t>(k) * kThreads;
    if (i >= total) continue;
    const int64_t token = i / token_vecs;
    const int64_t within = i - token * token_vecs;
    const int64_t seg = within / seg_vecs;
    const int64_t v = within - seg * seg_vecs;
    const int64_t slot = static_cast<int64_t>(slots[token]);
    if (!slot_valid(g, slot)) continue;
    VecT* paged = reinterpret_cast<VecT*>(cache + cache_offset(g, slot, seg)) + v;
    VecT* flat = reinterpret_cast<VecT*>(chunk + chunk_offset(g, lkv / 2, lkv % 2, token, seg)) + v;
    held[k] = kGather ? *paged : *flat;
    targets[k] = kGather ? flat : paged;
  }
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    if (targets[k] != nullptr) *targets[k] = held[k];
  }
}

int vector_width(std::initializer_list<int64_t> values) {
  int64_t all = 0;
  for (int64_t v : values) all |= v;
  for (int width : {16, 8, 4, 2}) {
    if (all % width == 0) return width;
  }
  return 1;
}

int threads_for(int64_t work) {
  const int64_t warps = (std::min<int64_t>(std::max<int64_t>(work, 1), 512) + 31) / 32;
  return static_cast<int>(warps * 32);
}

template <typename index_t, bool kGather>
void launch_paged_copy(const PagedGeometry& g, const LayerPointers& p, const index_t* slots, uint8_t* chunk,
                       int width, cudaStream_t stream) {
  const int64_t items = segment_bytes(g) * segments_per_token(g) / width * g.num_tokens;
  const int64_t blocks = (items + kItems * kThreads - 1) / (kItems * kThreads);
  TORCH_CHECK(blocks <= 2147483647LL, "tierkv: ", g.num_tokens, " tokens are too many for one launch");
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(g.num_layers * 2));
  const int threads = kThreads;
  switch (width) {
    case 16:
      paged_copy_kernel<uint4, index_t, kGather><<<grid, threads, 0, stream>>>(g, p, slots, chunk);
      break;
    case 8:
      paged_copy_kernel<uint2, index_t, kGather><<<grid, threads, 0, stream>>>(g, p, slots, chunk);
      break;
    case 4:
      paged_copy_kernel<uint32_t, index_t, kGather><<<grid, threads, 0, stream>>>(g, p, slots, chunk);
      break;
    case 2:
      paged_copy_kernel<uint16_t, index_t, kGather><<<grid, threads, 0, stream>>>(g, p, slots, chunk);
      break;
    default:
      paged_copy_kernel<uint8_t, index_t, kGather><<<grid, threads, 0, stream>>>(g, p, slots, chunk);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <bool kGather>
void paged_cuda(at::TensorList key_caches, at::TensorList value_caches, const at::Tensor& slot_mapping,
                const at::Tensor& chunk, bool hf_order) {
  const auto keys = key_caches.vec();
  const auto values = value_caches.vec();
  const PagedGeometry g = paged_geometry(keys, values, slot_mapping, chunk, hf_order, kGather ? "out" : "chunk");
  TORCH_CHECK(chunk.is_cuda(), "tierkv: the CUDA kernel got ", chunk.device(), " tensors");
  TORCH_CHECK(g.num_layers * 2 <= 65535, "tierkv: at most 32767 layers, got ", g.num_layers);
  if (g.num_tokens == 0) return;
  const c10::cuda::CUDAGuard guard(chunk.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto bases = layer_pointers(keys, values);
  LayerPointers p{};
  at::Tensor device_array;
  int64_t pointer_bits = 0;
  for (int64_t base : bases) pointer_bits |= base;
  if (g.num_layers <= kInlineLayers) {
    std::copy(bases.begin(), bases.end(), p.inline_ptrs);
  } else {
    // pinned staging so the copy is asynchronous; the caching host allocator keeps it alive
    at::Tensor host = at::empty({static_cast<int64_t>(bases.size())}, at::TensorOptions(at::kLong).pinned_memory(true));
    std::copy(bases.begin(), bases.end(), host.data_ptr<int64_t>());
    device_array = host.to(chunk.device(), /*non_blocking=*/true);
    p.device_array = device_array.data_ptr<int64_t>();
  }
  const int width = vector_width({segment_bytes(g), g.head_bytes, g.block_stride, g.slot_stride, pointer_bits,
                                  reinterpret_cast<int64_t>(chunk.data_ptr())});
  auto* bytes = static_cast<uint8_t*>(chunk.data_ptr());
  if (slot_mapping.scalar_type() == at::kLong) {
    launch_paged_copy<int64_t, kGather>(g, p, slot_mapping.data_ptr<int64_t>(), bytes, width, stream);
  } else {
    launch_paged_copy<int32_t, kGather>(g, p, slot_mapping.data_ptr<int32_t>(), bytes, width, stream);
  }
}

void paged_gather_cuda(at::TensorList key_caches, at::TensorList value_caches, const at::Tensor& slot_mapping,
                       const at::Tensor& out, bool huggingface_order) {
  paged_cuda<true>(key_caches, value_caches, slot_mapping, out, huggingface_order);
}

void paged_scatter_cuda(const at::Tensor& chunk, at::TensorList key_caches, at::TensorList value_caches,
                        const at::Tensor& slot_mapping, bool huggingface_order) {
  paged_cuda<false>(key_caches, value_caches, slot_mapping, chunk, huggingface_order);
}

// ---- kv_deviation: one block per token, float32 accumulation, warp-shuffle reduction ----

template <typename scalar_t>
__device__ __forceinline__ float to_float(scalar_t x) {
  return static_cast<float>(x);
}
template <>
__device__ __forceinline__ float to_float<c10::Half>(c10::Half x) {
  return __half2float(static_cast<__half>(x));
}
template <>
__device__ __forceinline__ float to_float<c10::BFloat16>(c10::BFloat16 x) {
  return static_cast<float>(x);
}

template <typename scalar_t>
__global__ void kv_deviation_kernel(const scalar_t* __restrict__ a, const scalar_t* __restrict__ b, int64_t row,
                                    float* __restrict__ out) {
  const int64_t token = blockIdx.x;
  const scalar_t* pa = a + token * row;
  const scalar_t* pb = b + token * row;
  float sum = 0.f;
  for (int64_t i = threadIdx.x; i < row; i += blockDim.x) {
    const float d = to_float(pa[i]) - to_float(pb[i]);
    sum += d * d;
  }
  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, offset);
  __shared__ float partial[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) partial[warp] = sum;
  __syncthreads();
  if (warp == 0) {
    const int warps = (blockDim.x + 31) / 32;
    sum = lane < warps ? partial[lane] : 0.f;
    for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, offset);
    if (lane == 0) out[token] = sum;
  }
}

at::Tensor kv_deviation_cuda(const at::Tensor& retrieved_k, const at::Tensor& fresh_k) {
  check_kv_deviation(retrieved_k, fresh_k);
  const c10::cuda::CUDAGuard guard(retrieved_k.device());
  const at::Tensor a = retrieved_k.contiguous();
  const at::Tensor b = fresh_k.contiguous();
  const int64_t tokens = a.size(0), row = a.size(1) * a.size(2);
  at::Tensor out = at::empty({tokens}, a.options().dtype(at::kFloat));
  if (tokens == 0) return out;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int threads = threads_for(row);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.scalar_type(), "tierkv_kv_deviation_cuda", [&] {
    kv_deviation_kernel<scalar_t><<<static_cast<unsigned>(tokens), threads, 0, stream>>>(
        a.data_ptr<scalar_t>(), b.data_ptr<scalar_t>(), row, out.data_ptr<float>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

// ---- blend_scatter: one block per selected row, vectorized row copy ----

template <typename VecT>
__global__ void blend_scatter_kernel(uint8_t* __restrict__ dst, const uint8_t* __restrict__ src,
                                     const int64_t* __restrict__ indices, int64_t limit, int64_t row_bytes) {
  const int64_t i = blockIdx.x;
  const int64_t target = indices[i];
  if (target < 0 || target >= limit) return;  // validated on the host by tierkv.ops
  const int64_t vecs = row_bytes / static_cast<int64_t>(sizeof(VecT));
  VecT* out = reinterpret_cast<VecT*>(dst + target * row_bytes);
  const VecT* in = reinterpret_cast<const VecT*>(src + i * row_bytes);
  for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) out[v] = in[v];
}

void blend_scatter_cuda(const at::Tensor& dst, const at::Tensor& src, const at::Tensor& indices) {
  check_blend_scatter(dst, src, indices);
  const int64_t rows = indices.size(0);
  if (rows == 0 || src.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(dst.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t row_bytes = src.numel() / rows * src.element_size();
  auto* out = static_cast<uint8_t*>(dst.data_ptr());
  const auto* in = static_cast<const uint8_t*>(src.data_ptr());
  const int width = vector_width({row_bytes, reinterpret_cast<int64_t>(out), reinterpret_cast<int64_t>(in)});
  const int threads = threads_for(row_bytes / width);
  const unsigned grid = static_cast<unsigned>(rows);
  const int64_t* index = indices.data_ptr<int64_t>();
  const int64_t limit = dst.size(0);
  switch (width) {
    case 16: blend_scatter_kernel<uint4><<<grid, threads, 0, stream>>>(out, in, index, limit, row_bytes); break;
    case 8: blend_scatter_kernel<uint2><<<grid, threads, 0, stream>>>(out, in, index, limit, row_bytes); break;
    case 4: blend_scatter_kernel<uint32_t><<<grid, threads, 0, stream>>>(out, in, index, limit, row_bytes); break;
    case 2: blend_scatter_kernel<uint16_t><<<grid, threads, 0, stream>>>(out, in, index, limit, row_bytes); break;
    default: blend_scatter_kernel<uint8_t><<<grid, threads, 0, stream>>>(out, in, index, limit, row_bytes);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// ---- rope_rerotate: one block per token, threads over (head, pair) ----

template <typename scalar_t>
__global__ void rope_rerotate_kernel(scalar_t* __restrict__ k, const int64_t* __restrict__ old_positions,
                                     const int64_t* __restrict__ new_positions, const float* __restrict__ table,
                                     int64_t max_position, int64_t rot_dim, int64_t heads, int64_t token_stride,
                                     int64_t head_stride, bool is_neox) {
  const int64_t token = blockIdx.x;
  const int64_t old_pos = old_positions[token], new_pos = new_positions[token];
  if (old_pos < 0 || old_pos >= max_position || new_pos < 0 || new_pos >= max_position) return;  // host-validated
  const int64_t half = rot_dim / 2;
  const float* old_row = table + old_pos * rot_dim;
  const float* new_row = table + new_pos * rot_dim;
  for (int64_t work = threadIdx.x; work < heads * half; work += blockDim.x) {
    const int64_t h = work / half, i = work - h * half;
    float c, s;
    rotation_delta(old_row, new_row, half, i, &c, &s);
    int64_t first, second;
    rope_pair(is_neox, half, i, &first, &second);
    scalar_t* head = k + token * token_stride + h * head_stride;
    const float x1 = static_cast<float>(head[first]);
    const float x2 = static_cast<float>(head[second]);
    head[first] = static_cast<scalar_t>(x1 * c - x2 * s);
    head[second] = static_cast<scalar_t>(x2 * c + x1 * s);
  }
}

void rope_rerotate_cuda(const at::Tensor& k, const at::Tensor& old_positions, const at::Tensor& new_positions,
                        const at::Tensor& cos_sin_cache, bool is_neox) {
  check_rope(k, old_positions, new_positions, cos_sin_cache);
  const int64_t tokens = k.size(0);
  if (tokens == 0) return;
  const c10::cuda::CUDAGuard guard(k.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t rot_dim = cos_sin_cache.size(1);
  const int threads = threads_for(k.size(1) * rot_dim / 2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, k.scalar_type(), "tierkv_rope_rerotate_cuda", [&] {
    rope_rerotate_kernel<scalar_t><<<static_cast<unsigned>(tokens), threads, 0, stream>>>(
        k.data_ptr<scalar_t>(), old_positions.data_ptr<int64_t>(), new_positions.data_ptr<int64_t>(),
        cos_sin_cache.data_ptr<float>(), cos_sin_cache.size(0), rot_dim, k.size(1), k.stride(0), k.stride(1),
        is_neox);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace tierkv

TORCH_LIBRARY_IMPL(tierkv, CUDA, m) {
  m.impl("paged_gather", &tierkv::paged_gather_cuda);
  m.impl("paged_scatter", &tierkv::paged_scatter_cuda);
  m.impl("kv_deviation", &tierkv::kv_deviation_cuda);
  m.impl("blend_scatter", &tierkv::blend_scatter_cuda);
  m.impl("rope_rerotate", &tierkv::rope_rerotate_cuda);
}
