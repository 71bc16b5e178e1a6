// The fragment-ordered dQ accumulator of the Hopper backward's 80-row steps (sm90/bwd_sm90_dq.cuh, transposed dQ),
// shared by the kernel that adds into it and the post-pass that reads it (bwd_dq_convert.cu).
//
// A step computes dQ^T = K^T dS^T for kRows queries: warpgroup wg holds head-dim columns [64 wg, +64) as the M
// dimension of an m64 x n kRows accumulator. Thread (warp w of the warpgroup, lane = 4 g + t) holds, for each n8
// tile ni, the float4 {dQ(q, c), dQ(q + 1, c), dQ(q, c + 8), dQ(q + 1, c + 8)} with q = 8 ni + 2t, c = 64 wg + 16 w
// + g. Stored as is, a thread writes kRows / 8 16-byte vectors instead of kRows / 2 scalars into a layout with
// rows = queries, and one bulk reduction adds a warpgroup's whole share (contiguous) to the accumulator.
//
// A tile of kRows queries x 128 columns is 128 kRows floats in the accumulator, tiles in query order per
// (batch, head); inside it the float4 of (wg, w, ni, lane) sits at float offset
//   wg * 64 kRows + w * 16 kRows + ni * 128 + lane * 4,
// so a warp's 32 vectors of one ni are 512 contiguous bytes (conflict-free stores), and a warpgroup's share is the
// contiguous 64 kRows floats at wg * 64 kRows. The post-pass inverts the map to write grad_query in its layout.
#pragma once

#include "../../macros.h"

namespace flashcore::cuda {

constexpr int kDqFragmentCols = 128;  // a tile's columns: two warpgroups of 64 head-dim columns

template <int kRows>
struct DqFragmentTile {
  static_assert(kRows % 8 == 0, "n8 tiles");
  static constexpr int kCols = kDqFragmentCols;
  static constexpr int kWgFloats = 64 * kRows;  // a warpgroup's share
  static constexpr int kFloats = 2 * kWgFloats;
  static constexpr int kVectors = kFloats / 4;

  // Float offset of this thread's float4 of n8 tile ni within its warpgroup's share.
  FLASHCORE_HOST_DEVICE static constexpr int wg_offset(int warp, int ni, int lane) {
    return warp * 16 * kRows + ni * 128 + lane * 4;
  }
  // The inverse, for float4 `vec` of the tile (0 <= vec < kVectors): its element e is dQ(query(vec) + e % 2,
  // column(vec) + 8 (e / 2)).
  FLASHCORE_HOST_DEVICE static constexpr int query(int vec) {
    const int in_warp = vec % (4 * kRows);  // 4 kRows vectors a warp: kRows / 8 tiles x 32 lanes
    return 8 * (in_warp / 32) + 2 * (in_warp % 4);
  }
  FLASHCORE_HOST_DEVICE static constexpr int column(int vec) {
    const int wg = vec / (16 * kRows), warp = vec / (4 * kRows) % 4, lane = vec % 32;
    return 64 * wg + 16 * warp + lane / 4;
  }
};

}  // namespace flashcore::cuda
