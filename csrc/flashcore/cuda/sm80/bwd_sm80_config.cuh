// Tile shapes and shared-memory layout of the mma.sync backward kernel, per head-dim tile.
//
// One block owns kBlockN keys of one (batch, kv head) and walks query blocks of kBlockM = 64 rows; the warp
// layout of each product is below (BwdKernelTraits). A warp's dK + dV accumulators are 2 x 16 x kKVDims / 32
// registers a thread, which is what bounds the tile: larger head dims take more warps, and fewer keys.
//
// Q and dO are double-buffered (the next query block loads while this one computes) up to head dim 128; above it
// one stage. Shared memory: head dim <= 64: <= 97 KiB; 96: 89 KiB; 128: 161 KiB; 192: 113 KiB; 256: 145 KiB.
// sm_86/sm_89 (99 KiB a block) therefore run head dims <= 96 here; the dispatcher sends larger ones to the
// composite backward.
#pragma once

#include "../common/smem_tile.cuh"

namespace flashcore::sm80 {

// Per head-dim tile: keys a block owns, warps, Q/dO stages, blocks an SM should hold (register cap).
// FLASHCORE_BWD_TUNE_{BLOCK_N,WARPS,STAGES,MIN_BLOCKS} override every tile (tuning builds only).
template <int kHeadDim>
struct BwdConfig {
#ifdef FLASHCORE_BWD_TUNE_BLOCK_N
  static constexpr int kBlockN = FLASHCORE_BWD_TUNE_BLOCK_N;
  static constexpr int kNWarps = FLASHCORE_BWD_TUNE_WARPS;
  static constexpr int kStages = FLASHCORE_BWD_TUNE_STAGES;
  static constexpr int kMinBlocksPerSm = FLASHCORE_BWD_TUNE_MIN_BLOCKS;
#else
  // Measured on H100, head dim 128 (4 x 16 x 8192, fp16): 64 keys / 8 warps 126 TFLOP/s, 64 / 4 133,
  // 128 / 8 181, 128 / 16 (registers capped at 128) 164. 128 keys halve the dQ atomics and the Q/dO traffic per
  // key. Head dim 96 keeps 64 keys so that it fits sm_86/sm_89's 99 KiB; 192 and 256 keep 64 keys and 16 warps
  // (registers).
  static constexpr int kBlockN = (kHeadDim <= 64 || kHeadDim == 128) ? 128 : 64;
  static constexpr int kNWarps = kHeadDim > 128 ? 16 : 8;
  static constexpr int kStages = kHeadDim > 128 ? 1 : 2;
  static constexpr int kMinBlocksPerSm = 1;
#endif
};

template <int kHeadDim_, typename Element_>
struct BwdKernelTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = 64;
  static constexpr int kBlockN = BwdConfig<kHeadDim>::kBlockN;
  static constexpr int kNWarps = BwdConfig<kHeadDim>::kNWarps;
  static constexpr int kNThreads = 32 * kNWarps;
  static constexpr int kStages = BwdConfig<kHeadDim>::kStages;
  static constexpr int kMinBlocksPerSm = BwdConfig<kHeadDim>::kMinBlocksPerSm;

  // Warp layouts (warp w): S and dP (kBlockM x kBlockN) and dQ (kBlockM x kHeadDim) put w % 4 along the query
  // rows and w / 4 along the columns; dK and dV (kBlockN x kHeadDim) put w % kKVWarpsN along the keys and
  // w / kKVWarpsN along the head dim.
  static constexpr int kRowWarps = kBlockM / 16;  // 4
  static constexpr int kColWarps = kNWarps / kRowWarps;
  static constexpr int kKVWarpsN = kBlockN / 16;
  static constexpr int kKVWarpsD = kNWarps / kKVWarpsN;
  static_assert(kNWarps % kRowWarps == 0 && kNWarps % kKVWarpsN == 0, "warp layout");
  static constexpr int kSCols = kBlockN / kColWarps;      // S / dP columns (keys) of one warp
  static constexpr int kQDims = kHeadDim / kColWarps;     // dQ columns of one warp
  static constexpr int kKVDims = kHeadDim / kKVWarpsD;    // dK / dV columns of one warp
  static constexpr int kSNTiles = kSCols / 8;
  static constexpr int kQDTiles = kQDims / 8;
  static constexpr int kKVDTiles = kKVDims / 8;
  static_assert(kSCols % 16 == 0 && kQDims % 16 == 0 && kKVDims % 16 == 0, "ldmatrix.x4 fetches pairs of n8 tiles");

  using QTile = cuda::SmemTile<kBlockM, kHeadDim>;   // Q and dO: rows = queries
  using KVTile = cuda::SmemTile<kBlockN, kHeadDim>;  // K and V: rows = keys
  using PTile = cuda::SmemTile<kBlockM, kBlockN>;    // P and dS: rows = queries, cols = keys

  // Shared memory, in elements of Element from the base: kStages x [Q][dO], then [K][V][P][dS], then fp32
  // [lse x kStages][dsum x kStages] (per query row of the block: log2-domain LSE and rowsum(dO * O)).
  static constexpr int kStageElems = 2 * QTile::kElems;
  static constexpr int kKOffset = kStages * kStageElems;
  static constexpr int kVOffset = kKOffset + KVTile::kElems;
  static constexpr int kPOffset = kVOffset + KVTile::kElems;
  static constexpr int kDsOffset = kPOffset + PTile::kElems;
  static constexpr int kElementsEnd = kDsOffset + PTile::kElems;
  static constexpr int kSmemBytes = kElementsEnd * 2 + 2 * kStages * kBlockM * 4;
};

}  // namespace flashcore::sm80
