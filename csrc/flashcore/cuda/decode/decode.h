// Host interface of the KV-cache kernel (decode_kernel.cuh): how a call is split and launched.
#pragma once

#include <cuda_runtime_api.h>

#include "../../paged_kv.h"

namespace flashcore::decode {

struct DecodePlan {
  int head_dim_tile = 0;  // 64, 128 or 256
  bool rows_mode = false;  // more than 16 packed query rows per (entry, kv head): warps own rows, not key quarters
  int m_blocks = 0;        // blocks of packed query rows
  int splits = 1;          // key splits per (entry, kv head, row block)
  int smem_bytes = 0;
};

// The kernel variant and the key splits of a call: `requested` > 0 forces the split count (flash-attn's
// num_splits); 0 picks the smallest count whose grid fills the device's waves (every multiprocessor, by the
// kernel's occupancy) within 10 % of the best, keeping at least 4 key tiles a split.
DecodePlan plan_decode(const DecodeParams& p, int requested, bool bf16, const cudaDeviceProp& prop);

// Launches the kernel, and the combine kernel when p.num_splits > 1 (p.o_partial/p.lse_partial allocated).
void launch_decode(const DecodeParams& p, const DecodePlan& plan, bool bf16, cudaStream_t stream);

}  // namespace flashcore::decode
