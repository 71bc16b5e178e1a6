// Host side of the TMA loads: CUtensorMap descriptors of (batch, head, seq, dim) tensors, built from strides.
// The driver entry point is fetched through the runtime (cudaGetDriverEntryPointByVersion), so the extension does
// not link libcuda directly.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "../../params.h"

namespace flashcore::sm90 {

// TMA's rules for a 16-bit (batch, head, seq, dim) tensor read as boxes of 64 x box_rows elements with the
// 128-byte swizzle: 16-byte aligned base, every stride of a dimension longer than 1 positive, a multiple of
// 16 bytes and below 2^40 bytes, sizes below 2^32. The dispatcher sends anything else to the mma.sync family.
bool tma_compatible(const void* base, const Strides& s, int64_t batch, int64_t heads, int64_t seqlen);

// Encodes the descriptor; dims are (head_dim, seqlen, heads, batch), box (64, box_rows, box_heads, 1): box_heads > 1
// lands box_heads heads' rows one after another in shared memory (pack-GQA, params.h: PackGqa). Throws
// (TORCH_CHECK) if the driver refuses, which tma_compatible rules out.
CUtensorMap make_tensor_map_bhsd(const void* base, const Strides& s, int64_t batch, int64_t heads, int64_t seqlen,
                                 int64_t head_dim, int box_rows, bool bf16, int box_heads = 1);

// Descriptor of a row-major fp32 matrix (rows x cols, rows 16-byte aligned) read or reduced into as boxes of
// box_cols (32: one 128-byte swizzle span) x box_rows: the backward's dQ accumulator.
CUtensorMap make_tensor_map_f32_2d(void* base, int64_t rows, int64_t cols, int box_cols, int box_rows);

// The same matrix (rows a multiple of 8, box_rows too) with the rows of each group of 8 interleaved in shared
// memory: global row 8k + 4 h + l (h < 2, l < 4) is row 8k + 2 l + h of the box (4-D: columns, h, l, k).
// The backward's float2 dQ staging stores then meet no bank conflict in the 128-byte swizzle (bwd_sm90_dq.cuh).
CUtensorMap make_tensor_map_f32_rows_interleaved(void* base, int64_t rows, int64_t cols, int box_cols, int box_rows);

}  // namespace flashcore::sm90
