#include "tma_desc.h"

#include <c10/util/Exception.h>


namespace flashcore::sm90 {
namespace {

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiledFn encode_tiled() {
  static EncodeTiledFn fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult query{};
    const cudaError_t err =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &query);
    TORCH_CHECK(err == cudaSuccess && query == cudaDriverEntryPointSuccess && ptr != nullptr,
                "flashcore: cannot load the CUDA driver's cuTensorMapEncodeTiled (", cudaGetErrorString(err), ")");
    return reinterpret_cast<EncodeTiledFn>(ptr);
  }();
  return fn;
}

// Every map here: unit element strides, 128-byte swizzle (the layout the kernels' shared-memory tiles and wgmma
// descriptors assume), 256-byte L2 promotion, zero fill out of bounds. strides has rank - 1 entries (bytes).
CUresult encode_swizzled(CUtensorMap* map, CUtensorMapDataType dtype, cuuint32_t rank, const void* base,
                         const cuuint64_t* dims, const cuuint64_t* strides, const cuuint32_t* box) {
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  return encode_tiled()(map, dtype, rank, const_cast<void*>(base), dims, strides, box, elem_strides,
                        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

constexpr int64_t kMaxStrideBytes = int64_t(1) << 40;

bool stride_ok(int64_t stride_elems, int64_t extent) {
  if (extent <= 1) return true;  // never stepped over
  const int64_t bytes = stride_elems * 2;
  return stride_elems > 0 && bytes % 16 == 0 && bytes < kMaxStrideBytes;
}

// A size-1 dimension is never stepped over, but TMA still validates its stride: give it the packed value.
cuuint64_t stride_bytes(int64_t stride_elems, int64_t extent, cuuint64_t packed) {
  return extent <= 1 ? packed : static_cast<cuuint64_t>(stride_elems) * 2;
}

}  // namespace

bool tma_compatible(const void* base, const Strides& s, int64_t batch, int64_t heads, int64_t seqlen) {
  constexpr int64_t kMaxDim = int64_t(1) << 31;
  return reinterpret_cast<uintptr_t>(base) % 16 == 0 && stride_ok(s.seq, seqlen) && stride_ok(s.head, heads) &&
         stride_ok(s.batch, batch) && batch < kMaxDim && heads < kMaxDim && seqlen < kMaxDim;
}

CUtensorMap make_tensor_map_bhsd(const void* base, const Strides& s, int64_t batch, int64_t heads, int64_t seqlen,
                                 int64_t head_dim, int box_rows, bool bf16, int box_heads) {
  CUtensorMap map;
  const cuuint64_t dims[4] = {(cuuint64_t)head_dim, (cuuint64_t)seqlen, (cuuint64_t)heads, (cuuint64_t)batch};
  const cuuint64_t row = ((cuuint64_t)head_dim * 2 + 15) / 16 * 16;
  const cuuint64_t seq_b = stride_bytes(s.seq, seqlen, row);
  const cuuint64_t head_b = stride_bytes(s.head, heads, seq_b * dims[1]);
  const cuuint64_t batch_b = stride_bytes(s.batch, batch, head_b * dims[2]);
  const cuuint64_t strides[3] = {seq_b, head_b, batch_b};
  const cuuint32_t box[4] = {64, (cuuint32_t)box_rows, (cuuint32_t)box_heads, 1};
  const CUresult res = encode_swizzled(&map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                                       4, base, dims, strides, box);
  TORCH_CHECK(res == CUDA_SUCCESS, "flashcore: cuTensorMapEncodeTiled failed (CUresult ", (int)res,
              ") for a tensor of shape (", batch, ", ", heads, ", ", seqlen, ", ", head_dim, ") with strides (",
              s.batch, ", ", s.head, ", ", s.seq, ", 1)");
  return map;
}

CUtensorMap make_tensor_map_f32_2d(void* base, int64_t rows, int64_t cols, int box_cols, int box_rows) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)rows};
  const cuuint64_t strides[1] = {(cuuint64_t)cols * 4};
  const cuuint32_t box[2] = {(cuuint32_t)box_cols, (cuuint32_t)box_rows};
  const CUresult res = encode_swizzled(&map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, base, dims, strides, box);
  TORCH_CHECK(res == CUDA_SUCCESS, "flashcore: cuTensorMapEncodeTiled failed (CUresult ", (int)res,
              ") for an fp32 accumulator of shape (", rows, ", ", cols, ")");
  return map;
}

CUtensorMap make_tensor_map_f32_rows_interleaved(void* base, int64_t rows, int64_t cols, int box_cols, int box_rows) {
  TORCH_CHECK(rows % 8 == 0 && box_rows % 8 == 0, "flashcore: interleaved dQ rows need multiples of 8 (", rows, ", ",
              box_rows, ")");
  CUtensorMap map;
  const cuuint64_t row = (cuuint64_t)cols * 4;
  const cuuint64_t dims[4] = {(cuuint64_t)cols, 2, 4, (cuuint64_t)rows / 8};
  const cuuint64_t strides[3] = {4 * row, row, 8 * row};  // h, l, k
  const cuuint32_t box[4] = {(cuuint32_t)box_cols, 2, 4, (cuuint32_t)box_rows / 8};
  const CUresult res = encode_swizzled(&map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, base, dims, strides, box);
  TORCH_CHECK(res == CUDA_SUCCESS, "flashcore: cuTensorMapEncodeTiled failed (CUresult ", (int)res,
              ") for an interleaved fp32 accumulator of shape (", rows, ", ", cols, ")");
  return map;
}

}  // namespace flashcore::sm90
