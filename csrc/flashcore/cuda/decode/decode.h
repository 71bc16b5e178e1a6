// Host interface of the KV-cache kernel (decode_kernel.cuh): how a call is split and launched.
#pragma once

#include <cuda_runtime_api.h>

#include "../../paged_kv.h"

namespace flashcore::decode {

// Batches of up to this many entries are ranked by work for the longest-first order (decode_kernel.cuh).
constexpr int kMaxRankedEntries = 256;

struct DecodePlan {
  int head_dim_tile = 0;  // 64, 128 or 256
  bool rows_mode = false;  // more than 16 packed query rows per (entry, kv head): warps own rows, not key quarters
  int m_blocks = 0;        // blocks of packed query rows
  int splits = 1;          // key splits per (entry, kv head, row block)
  int smem_bytes = 0;      // the launch's dynamic shared memory: the variant's, or more to cap blocks an SM
  bool tma = false;        // Hopper: K/V tiles loaded by TMA (decode_kernel.cuh), else by cp.async
  int stages = 2;          // cp.async: K/V stages of the pipeline (2 or 3; the TMA loader sizes its own)
  int box_rows = 64;       // TMA: keys a box (a dense cache 64; a paged one a divisor of its page size)
  bool longest_first = false;  // blocks take batch entries longest first (decode steps of 2 .. kMaxRankedEntries
                               // entries whose grid has more than one wave)
  int resident = 0;            // blocks an SM the launch's shared memory allows (smem_bytes' residency cap)
  bool cluster_merge = false;  // the splits of an (entry, kv head) are a cluster that merges them (no partials in
                               // global memory, no combine kernel): decode steps of 2 .. kMaxClusterSplits splits
                               // where the kernel's code is sm_90
};

// Splits a cluster merges at most (the portable cluster size).
constexpr int kMaxClusterSplits = 8;

// The kernel variant and the key splits of a call. The cp.async loader is the default everywhere; the TMA loader
// (Hopper, the kernel's code built for sm_90) is taken only when FLASHCORE_DECODE_TMA=1 and TMA can address the
// caches: 16-byte strides and base, a dense cache of at least 64 rows, a paged one with pages a multiple of 16 keys
// and no left pad (a box then never crosses a page). `requested` > 0 forces the split count (flash-attn's
// num_splits); 0 picks the smallest count whose grid fills the device's block slots within 10 % of the best,
// keeping at least 3 key tiles a split (and at most kMaxClusterSplits splits for short caches that clusters can
// merge). The slots an SM counts are the blocks it takes to stream at the memory's
// full rate (decode_launch.cu: full_rate_blocks_per_sm), two for a decode step through pages under 64 keys
// (kGatherBlocksPerSm), or every block the occupancy allows (chunked prefill, TMA). A decode step's residency is
// capped at two blocks an SM or its slots, whichever is more, by padding its shared memory (DecodePlan::smem_bytes);
// a decode step whose unsplit grid fills one wave of two-stage blocks at full occupancy runs so, unsplit.
DecodePlan plan_decode(const DecodeParams& p, int requested, bool bf16, const cudaDeviceProp& prop);

// Launches the kernel, and the combine kernel when p.num_splits > 1 and the splits are not merged in clusters
// (p.o_partial/p.lse_partial allocated).
void launch_decode(const DecodeParams& p, const DecodePlan& plan, bool bf16, cudaStream_t stream);

}  // namespace flashcore::decode
