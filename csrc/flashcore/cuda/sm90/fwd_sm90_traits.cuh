// Compile-time shape of the Hopper forward kernel and the layout of its shared memory.
#pragma once

#include <cstdint>

#include "../ptx/warpgroup.cuh"
#include "../common/smem_tile.cuh"
#include "fwd_sm90_config.cuh"

namespace flashcore::sm90 {

// kWarpgroups_ (consumer warpgroups, 64 query rows each) defaults to the configured width; the launcher also
// instantiates a one-warpgroup variant for grids too small to fill the GPU (fwd_sm90_launch.cuh). kBlockN_
// (keys per tile) defaults to the causal width; the launcher takes kBlockNNonCausal for unmasked calls.
// kCompact_ (one-warpgroup blocks only) leaves out the two-buffer key loop and the key-split code, for unsplit grids
// whose walks are shorter than kDeepMinTiles: such a block runs its code once, cold, and every jump over code it
// does not use costs instruction-cache misses (ncu, 1x8x512x64: ~15 % of the stall samples were instruction fetch
// in the epilogue, which sat behind both; docs/PERFORMANCE.md).
// kScoreMod_: the score-mod variant (softcap, ALiBi, or a scale that is not positive; score_mod.h): each tile's
// scores become logits before the mask, and the softmax runs with scale 1.
// kVarlen_: a variable-length batch (seqlen.h): TMA reads the packed tensors at each sequence's rows (rows past its
// end, read from the next sequence, are masked like any key past seqlen_k, or never stored); O is stored with
// bounded 16-byte stores instead of TMA, which would write past the sequence's end; one tile per block (a cluster's
// blocks where the launcher splits its keys).
template <int kHeadDim_, typename Element_, int kWarpgroups_ = FwdSm90Config<kHeadDim_>::kWarpgroups,
          int kBlockN_ = FwdSm90Config<kHeadDim_>::kBlockN, bool kCompact_ = false, bool kScoreMod_ = false,
          bool kVarlen_ = false>
struct FwdSm90Traits {
  using Element = Element_;
  using Config = FwdSm90Config<kHeadDim_>;
  // kHeadDim is the width the GEMMs compute (head dims up to it run here); the shared-memory tiles are whole
  // 64-element swizzle spans (kTileCols), so head dim 96 keeps the 128-wide tiles' layout, TMA boxes and
  // descriptors, and only its wgmma are narrower: Q K^T takes 6 k-steps, P V is n96. The columns past 96 are never
  // read by a wgmma (TMA fills them with zeros, and the store of O clips them).
  static constexpr int kHeadDim = kHeadDim_;
  static_assert(kHeadDim % 32 == 0 && kHeadDim <= 256, "k16 steps within 64-element swizzle spans");
  static constexpr int kTileCols = (kHeadDim + 63) / 64 * 64;
  static constexpr int kWarpgroups = kWarpgroups_;  // consumers
  static_assert(kWarpgroups >= 1 && kWarpgroups <= Config::kWarpgroups, "more consumers than configured");
  static constexpr int kBlockM = 64 * kWarpgroups;
  static constexpr int kBlockN = kBlockN_;
  static constexpr bool kCompact = kCompact_;
  static constexpr bool kScoreMod = kScoreMod_;
  static constexpr bool kVarlen = kVarlen_;
  static_assert(!kCompact || kWarpgroups == 1, "compact variants are one-warpgroup blocks");
  static_assert(kBlockN % 16 == 0, "P V takes k16 steps over a tile's keys");
  static constexpr int kStages = Config::kStages;
  static constexpr int kConsumerThreads = 128 * kWarpgroups;
  static constexpr int kConsumerWarps = kConsumerThreads / 32;
  static constexpr int kNThreads = kConsumerThreads + 128;  // + the producer warpgroup
  // Varlen kernels of two consumer warpgroups: 40 producer registers (the consumers keep 232, unspilled), for the two
  // producer threads of paged keys (fwd_sm90_producer.cuh: produce_paged_v), whose code spilled 80-200 B inside its
  // loops at 24 and 32 registers (8 B outside them at 40). Non-paged varlen calls measured the same with either split.
  static constexpr bool kTwoPagedProducers = kVarlen_ && Config::kWarpgroups == 2;
  static constexpr int kProducerRegs = kTwoPagedProducers ? 40 : Config::kProducerRegs;
  // setmaxnreg only moves registers within what the block was given at launch: ptxas's per-thread count times
  // the threads, that count being the __launch_bounds__ cap for these kernels (-Xptxas=-v: 168 at 384 threads).
  // Asking for more makes setmaxnreg.inc wait forever: a 32-register producer with two 240-register consumer
  // warpgroups hangs (found on the H100).
  static constexpr int kLaunchRegs = ptx::launch_regs_per_thread(kNThreads);
  // The configured split is for the configured width; a narrower variant gives its consumers what the launch
  // allocation leaves, up to kNarrowCap (240; a one-warpgroup block, launched with 248 a thread, gives them 248,
  // which its two score buffers need to stay unspilled), so it does not spill where the wide one fits.
  static constexpr int kNarrowRegs = (kLaunchRegs * kNThreads - kProducerRegs * 128) / kConsumerThreads / 8 * 8;
  static constexpr int kNarrowCap = kLaunchRegs > 240 ? kLaunchRegs : 240;
  static constexpr int kConsumerRegs = kWarpgroups == Config::kWarpgroups && kProducerRegs == Config::kProducerRegs
                                           ? Config::kConsumerRegs
                                       : kNarrowRegs < kNarrowCap          ? kNarrowRegs
                                                                           : kNarrowCap;
  static_assert(kProducerRegs * 128 + kConsumerRegs * kConsumerThreads <= kLaunchRegs * kNThreads,
                "setmaxnreg split exceeds the registers the block gets at launch");
  // The persistent tile loop costs the consumers registers (loop-carried tile and ring counters); where the
  // accumulators leave none to spare (head dim 256: ~150 B of spills with the loop, 0 without) the kernel is
  // built for one tile per block and the launcher never makes its grid persistent.
  // One-warpgroup variants are launched only for grids of at most one wave (fwd_sm90_launch.cuh), so they are
  // built without the loop too (with two score buffers, its counters spilled 8 B).
  static constexpr bool kPersistent = Config::kPersistent && kWarpgroups > 1 && !kVarlen;
  // Score (S) register buffers of a consumer: two where a warpgroup is alone in its block (no ping-pong partner
  // fills the tensor cores during its softmax), so the next tile's S is computed during this tile's softmax; the
  // second buffer must fit beside O and P (head dim 64: 2 x 64 + 32 + 32 of 248 registers).
  static constexpr int kScoreBuffers =
      (kWarpgroups == 1 && !kCompact && 2 * (kBlockN / 2) + kBlockN / 4 + kHeadDim / 2 <= 192) ? 2 : 1;
  static constexpr int kDeepMinTiles = 16;  // key tiles from which a block takes the two-buffer loop (consumer)
  // Key splits, for grids that leave SMs idle (one-warpgroup blocks, and varlen batches of few long-keyed query
  // tiles: a chunked prefill): a cluster of up to kMaxKeySplits blocks shares one query tile, each walking a slice
  // of its key tiles; every block but rank 0 sends its normalized O and LSE (kSplitVecs float4 a consumer thread)
  // into rank 0's K/V ring, free once rank 0's key walk is done, and rank 0 merges them (fwd_sm90_split.cuh). The
  // ring bounds the splits (two-warpgroup varlen blocks: 2 at head dim 128, none at 256). The three-warpgroup varlen
  // kernels (head dims 64 and 96) are built without: their 160-register consumers spilled 72-140 B with the split.
  static constexpr int kSplitVecs = (kHeadDim / 2 + 2 + 3) / 4;  // O fragment + 2 row LSEs, in float4s
  static constexpr uint32_t kPartialBytes = kSplitVecs * kConsumerThreads * 16;
  static constexpr int kMaxKeySplitsRing = 1 + (int)(2 * kStages * (kBlockN * kTileCols * 2) / kPartialBytes);
  static constexpr bool kSplitKeys =
      !kCompact && (kWarpgroups == 1 || (kVarlen && kWarpgroups == 2 && kMaxKeySplitsRing >= 2));
  // The split protocol has one phase per barrier and no ring use after the merge: one tile per block.
  static_assert(!(kSplitKeys && kPersistent), "key splits need one tile per block");
  static constexpr int kMaxKeySplits = !kSplitKeys ? 1 : kMaxKeySplitsRing < 8 ? kMaxKeySplitsRing : 8;
  static constexpr int kSpans = kTileCols / 64;  // TMA boxes per tile
  static_assert(kBlockM <= 256 && kBlockN <= 256, "a TMA box has at most 256 rows");

  using QTile = cuda::SmemTile<kBlockM, kTileCols>;
  using KVTile = cuda::SmemTile<kBlockN, kTileCols>;
  static constexpr uint32_t kQBytes = QTile::kElems * 2;
  static constexpr uint32_t kKVBytes = KVTile::kElems * 2;
  static_assert((kMaxKeySplits - 1) * kPartialBytes <= 2 * kStages * kKVBytes, "partial results overflow the ring");
  static constexpr int kBarriers = 2 + 4 * kStages + (kSplitKeys ? 2 : 0);
  // After the mbarriers, one 8-byte slot per consumer warp that its lane 0 stores to only to order the warp's
  // instructions (order_slots; one each, so no two threads write the same word).
  // Varlen: then the producer threads' block-table entries of the tile they load (fwd_sm90_producer.cuh:
  // read_tile_pages), one a TMA box of at least 16 keys, for each of the two threads that load paged keys.
  static constexpr int kMaxPageBoxes = kBlockN / 16;
  static constexpr int kWords = kBarriers + kConsumerWarps + (kVarlen ? kMaxPageBoxes : 0);
  // The epilogue stages O in a buffer of its own where shared memory allows (all but the two-warpgroup variants
  // of head dim 256 and of the 176-key tiles; every variant a persistent grid runs has it): the consumers then
  // release Q as soon as their last Q K^T retires, and the next tile's Q loads while this tile finishes its last
  // P V and its epilogue. Otherwise O is staged in the Q buffer, which goes back to the producer only once TMA
  // has read O.
  static constexpr int kBaseSmemBytes = 1024 + kQBytes + 2 * kStages * kKVBytes + 8 * kWords;
  static constexpr bool kSeparateO = kBaseSmemBytes + (int)kQBytes <= 227 * 1024;
  static constexpr uint32_t kOBytes = kSeparateO ? kQBytes : 0;
  // Tiles are 1024-byte aligned (the swizzle atom); the slack covers aligning the dynamic shared memory base.
  static constexpr int kSmemBytes = kBaseSmemBytes + (int)kOBytes;
  // The persistent launch (one block per SM, grid <= SM count) relies on two blocks never fitting on one SM.
  static_assert(2 * kSmemBytes > 227 * 1024, "a second block per SM would leave SMs idle in the persistent grid");
};

template <typename Traits>
struct SharedStorage {
  using Element = typename Traits::Element;
  Element* q;
  Element* k;  // kStages K tiles
  Element* v;  // kStages V tiles
  Element* o;  // the epilogue's staging tile: its own buffer with kSeparateO, else q
  uint64_t* q_full;
  uint64_t* q_empty;  // the consumers are done with the Q tile (without kSeparateO: also with staged O)
  uint64_t* k_full;
  uint64_t* v_full;
  uint64_t* k_empty;
  uint64_t* v_empty;
  uint64_t* split_full;  // kSplitKeys, rank 0: the other ranks' partial results have landed (st.async bytes)
  uint64_t* split_go;    // kSplitKeys, ranks > 0: rank 0's ring is free for them
  uint64_t* order_slots;  // one per consumer warp, written, never read: scheduling anchors (ptx::store_before_wait)
  int* tile_pages;        // kVarlen: 2 x kMaxPageBoxes block-table entries, each half written and read by one thread

  __device__ __forceinline__ explicit SharedStorage(unsigned char* raw) {
    // The compact variant derives its pointers from raw by pointer arithmetic, so they stay provably in shared
    // memory and its epilogue stages O with STS; the integer round trip below makes them generic pointers (ST.E
    // through the shared window, 64-bit address arithmetic per store). The other variants keep the round trip:
    // with it their consumers fit in the registers they have (the full one-warpgroup kernel spilled 16 B without).
    unsigned char* base =
        Traits::kCompact
            ? raw + ((1024u - (static_cast<uint32_t>(__cvta_generic_to_shared(raw)) & 1023u)) & 1023u)
            : reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t{1023});
    q = reinterpret_cast<Element*>(base);
    k = reinterpret_cast<Element*>(base + Traits::kQBytes);
    v = reinterpret_cast<Element*>(base + Traits::kQBytes + Traits::kStages * Traits::kKVBytes);
    unsigned char* after_kv = base + Traits::kQBytes + 2 * Traits::kStages * Traits::kKVBytes;
    o = Traits::kSeparateO ? reinterpret_cast<Element*>(after_kv) : q;
    uint64_t* bars = reinterpret_cast<uint64_t*>(after_kv + Traits::kOBytes);
    q_full = bars;
    q_empty = bars + 1;
    k_full = bars + 2;
    v_full = k_full + Traits::kStages;
    k_empty = v_full + Traits::kStages;
    v_empty = k_empty + Traits::kStages;
    split_full = v_empty + Traits::kStages;
    split_go = split_full + 1;
    order_slots = bars + Traits::kBarriers;
    tile_pages = reinterpret_cast<int*>(order_slots + Traits::kConsumerWarps);
  }
  __device__ __forceinline__ Element* k_stage(int s) const { return k + s * Traits::KVTile::kElems; }
  __device__ __forceinline__ Element* v_stage(int s) const { return v + s * Traits::KVTile::kElems; }
};

}  // namespace flashcore::sm90
