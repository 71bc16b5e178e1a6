// Pack-GQA for the Hopper varlen forward (params.h: PackGqa): how many query heads of one key/value head share a
// block. Host code only; the launcher (fwd_sm90_launch.cuh) and the KV-cache prefill's router
// (attention_cuda.cpp) both ask here, so the router's grid estimate is the grid that is launched.
//
// Why: the varlen forward's block holds kBlockM query rows (192 at head-dim tiles 64/96, 128 at 128/256) of one
// head. A chunked prefill of a KV cache (tens of new tokens a sequence, GQA) fills a fraction of them, and every
// query head's block reads its K/V head's whole cache again. Packed, the group's heads fill the rows (block row r is
// query r % rows of head h0 + r / rows) and read each K/V tile once for all of them.
#pragma once

#include <cstdint>

#include "fwd_sm90_config.cuh"

namespace flashcore::sm90 {

// Rows of the varlen forward's block at a head-dim tile (launch_fwd_varlen: the configured width).
constexpr int varlen_fwd_block_m(int head_dim_tile) {
  return 64 * (head_dim_tile <= 64    ? FwdSm90Config<64>::kWarpgroups
               : head_dim_tile <= 96  ? FwdSm90Config<96>::kWarpgroups
               : head_dim_tile <= 128 ? FwdSm90Config<128>::kWarpgroups
                                      : FwdSm90Config<256>::kWarpgroups);
}

// Query rows a block computes (padding included) for `heads` query heads with max_seqlen_q rows each, packing
// `pack` heads a block of block_m rows.
inline int64_t packed_rows(int64_t heads, int64_t max_seqlen_q, int block_m, int pack) {
  const int64_t rows = block_m / pack;
  return (max_seqlen_q + rows - 1) / rows * block_m * (heads / pack);
}

// The heads a block packs: among the divisors g of the group whose rows a head (block_m / g) are a multiple of 16
// (one head a warp's m16 rows), the one that computes the fewest padded rows, ties to the smaller g; and 1 (no
// packing) unless that saves at least an eighth of the unpacked rows. So short sequences pack (64 queries, 4 heads a
// KV head, 128-row blocks: half the rows), while long ones, whose blocks are full either way and whose packed
// shapes were not measured, keep one head a block (4097 queries: 2 % fewer rows, not packed). mode 0: 1
// (A/B switch); mode 2: the most heads that fit, whatever the rows saved (A/B switch).
inline int pick_pack_gqa(int64_t group, int64_t max_seqlen_q, int block_m, int mode = 1) {
  int best = 1;
  if (mode == 0 || group < 2) return best;
  if (mode == 2) {
    for (int g = 2; g <= group && 16 * g <= block_m; ++g)
      if (group % g == 0 && block_m % (16 * g) == 0) best = g;
    return best;
  }
  const int64_t unpacked = packed_rows(group, max_seqlen_q, block_m, 1);
  int64_t best_rows = unpacked;
  for (int g = 2; g <= group && 16 * g <= block_m; ++g) {
    if (group % g != 0 || block_m % (16 * g) != 0) continue;
    const int64_t rows = packed_rows(group, max_seqlen_q, block_m, g);
    if (rows < best_rows) best = g, best_rows = rows;
  }
  return 8 * best_rows <= 7 * unpacked ? best : 1;
}

// Key splits the Hopper varlen forward can take: its two-warpgroup kernels split where rank 0's K/V ring holds the
// other ranks' partial results (fwd_sm90_traits.cuh: head dim 128, two ranks), so that routers can count the blocks
// a split grid fills. The launcher (fwd_sm90_launch.cuh: pick_key_splits) takes them for grids whose clusters are
// all resident at once and walks long enough to pay for the merge: from about 8 key tiles where the split grid
// fills more than half the SMs (kVarlenSplitMinKeys).
constexpr int varlen_fwd_max_key_splits(int head_dim_tile) {
  return head_dim_tile > 96 && head_dim_tile <= 128 ? 2 : 1;
}
constexpr int64_t kVarlenSplitMinKeys = 1024;

// The varlen forward's blocks for a call: block_m rows, `heads` query heads of `rows` queries each.
struct VarlenFwdPack {
  int block_m;
  int heads;
  int64_t rows;

  // Blocks of the grid for `batch` sequences of at most max_seqlen_q queries and heads_q query heads.
  int64_t blocks(int64_t batch, int64_t heads_q, int64_t max_seqlen_q) const {
    return batch * (heads_q / heads) * ((max_seqlen_q + rows - 1) / rows);
  }
  // Whether a block is more than half queries (each head's rows hold up to max_seqlen_q of them): the KV-cache
  // prefill's router takes the Hopper kernel for few new tokens only then.
  bool mostly_full(int64_t max_seqlen_q) const {
    return 2 * heads * (max_seqlen_q < rows ? max_seqlen_q : rows) > block_m;
  }
};

inline VarlenFwdPack varlen_fwd_pack(int64_t heads_q, int64_t heads_kv, int64_t max_seqlen_q, int head_dim_tile,
                                     int pack_mode) {
  const int block_m = varlen_fwd_block_m(head_dim_tile);
  const int g = pick_pack_gqa(heads_kv > 0 ? heads_q / heads_kv : 1, max_seqlen_q, block_m, pack_mode);
  return VarlenFwdPack{block_m, g, block_m / g};
}

}  // namespace flashcore::sm90
