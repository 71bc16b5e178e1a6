// Compile-time shape of the Hopper backward kernel, the key/query blocks it walks, and its shared memory.
#pragma once

#include <cstdint>
#include <type_traits>

#include "../../params.h"
#include "../ptx/warpgroup.cuh"
#include "../common/smem_tile.cuh"
#include "../common/varlen_tile_scan.cuh"
#include "bwd_sm90_config.cuh"

namespace flashcore::sm90 {

// kScoreMod_: the score-mod variant (softcap, ALiBi, or a scale that is not positive; score_mod.h).
// kVarlen_: a variable-length batch (seqlen.h). TMA reads the packed tensors as one (1, heads, total, dim) entry at
// each sequence's rows; rows past a sequence's end belong to the next sequence, and are hidden as in the dense
// kernel's tail: queries by lse = +inf (P = 0, so dS = 0), keys by the band's sequence end (P = 0, and their dK/dV
// rows are not stored). dQ's zero rows past the end are added to the next sequence's accumulator rows (exact: x + 0).
// kWideSteps_: steps of Config::kWideBlockM query rows (80 at head-dim tiles 96 and 128; FlashAttention-3 takes
// 80 rows at head dim 128 without a causal mask). n80 S^T and dP^T read each K and V operand for 80 rows instead
// of 64, so a row costs less shared-memory traffic; 80 rows are no whole m64 tile, so dQ is computed transposed,
// dQ^T = K^T dS^T (each warpgroup 64 head-dim columns, all rows), with dS stored query-major. Causal and windowed
// masks take them too: a band's edge tiles are masked as at 64 rows, and the steps' saving outweighs the larger
// edge tiles (docs/PERFORMANCE.md, ablation).
template <int kHeadDim_, typename Element_, bool kScoreMod_ = false, bool kVarlen_ = false, bool kWideSteps_ = false>
struct BwdSm90Traits {
  using Element = Element_;
  static constexpr bool kScoreMod = kScoreMod_;
  static constexpr bool kVarlen = kVarlen_;
  static constexpr bool kWideSteps = kWideSteps_;
  using Config = BwdSm90Config<kHeadDim_>;
  static_assert(!kWideSteps || Config::kWideBlockM > 0, "wide steps: a head dim that has them");
  // kHeadDim is the width the GEMMs compute; the shared-memory tiles are whole 64-element swizzle spans
  // (kTileCols). Head dim 96 keeps the 128-wide tiles: S^T and dP^T take 6 k-steps, dV and dK are n96, and the
  // second warpgroup's dQ chunk (columns 64..127) computes zeros past 96 that the dQ reduction drops.
  static constexpr int kHeadDim = kHeadDim_;
  static_assert(kHeadDim % 32 == 0 && kHeadDim <= 256, "k16 steps within 64-element swizzle spans");
  static constexpr int kTileCols = (kHeadDim + 63) / 64 * 64;
  static constexpr int kWarpgroups = Config::kWarpgroups;  // consumers
  // Up to head dim 128 each consumer warpgroup owns 64 keys of the block, all head-dim columns of their dK/dV.
  // Above, the warpgroups share 64 keys and split the columns (bwd_sm90_consumer_wide.cuh).
  static constexpr bool kSplitHeadDim = kHeadDim > 128;
  static constexpr int kBlockN = kSplitHeadDim ? 64 : 64 * kWarpgroups;       // keys of a block
  static constexpr int kWgCols = kSplitHeadDim ? kHeadDim / kWarpgroups : kHeadDim;  // dK/dV columns a warpgroup
  // Query rows of one step, the same for the plain and score-mod variants (the latter's wider steps read the lse
  // where it is used: bwd_sm90_consumer.cuh).
  static constexpr int kBlockM = kWideSteps ? Config::kWideBlockM : Config::kBlockM;
  static_assert(kBlockM == 64 || kBlockM == 128 || (kWideSteps && kBlockM == 80),
                "a step is one or two m64 query tiles, or 80 rows with dQ transposed");
  // dQ^T = K^T dS^T: the warpgroups split dQ by head-dim columns (M of the transposed GEMM), all rows as N.
  static constexpr bool kDqTransposed = kBlockM % 64 != 0;
  static_assert(!kSplitHeadDim || (kBlockM == 64 && kWarpgroups == 2 && kWgCols % 64 == 0),
                "split head dim: each warpgroup computes S^T for half of a 64-row step");
  static constexpr int kStages = Config::kStages;      // Q ring
  static constexpr int kDoStages = Config::kDoStages;  // dO ring
  static_assert(kDoStages == kStages || kDoStages == 1, "dO shares Q's barriers, or has its own single stage");
  static constexpr bool kSeparateDo = kDoStages != kStages;
  static constexpr int kConsumerThreads = 128 * kWarpgroups;
  static constexpr int kConsumerWarps = kConsumerThreads / 32;
  static constexpr int kNThreads = kConsumerThreads + 128;
  static constexpr int kProducerRegs = Config::kProducerRegs;
  static constexpr int kConsumerRegs = Config::kConsumerRegs;
  // setmaxnreg moves registers only within the launch allocation (ptx::launch_regs_per_thread).
  static constexpr int kLaunchRegs = ptx::launch_regs_per_thread(kNThreads);
  static_assert(kProducerRegs * 128 + kConsumerRegs * kConsumerThreads <= kLaunchRegs * kNThreads,
                "setmaxnreg split exceeds the registers the block gets at launch");
  static constexpr int kSpans = kTileCols / 64;  // TMA boxes per Q/dO/K/V tile

  // dQ = dS K of the step is split between the warpgroups by head-dim columns, query rows or keys
  // (Config::kDqSplit, bwd_sm90_config.cuh). Split head dim: by columns, kDqChunks 64-column chunks a warpgroup,
  // one after the other through its staging tile.
  // By rows needs one m64 query tile a warpgroup: a kernel whose steps are 64 rows splits by keys instead (none
  // now: the score-mod variant at head dim 64 took 64-row steps until its lse moved out of registers).
  static constexpr bool kDqSplitRows = Config::kDqSplit == DqSplit::kRows && kBlockM == 64 * kWarpgroups;
  static constexpr bool kDqSplitKeys = Config::kDqSplit == DqSplit::kKeys ||
                                       (Config::kDqSplit == DqSplit::kRows && !kDqSplitRows);
  static_assert(!((kDqSplitKeys || kDqSplitRows) && kSplitHeadDim), "split head dim splits dQ by columns");
  static_assert(!kDqTransposed || (Config::kDqSplit == DqSplit::kColumns && !kSplitHeadDim && kWarpgroups == 2),
                "transposed dQ: each warpgroup one 64-column chunk of a 128-column tile");
  static constexpr int kDqKeys = kDqSplitKeys ? 64 : kBlockN;  // K extent of one warpgroup's dQ GEMM
  static constexpr int kDqCols = kDqSplitKeys || kDqSplitRows ? kTileCols : 64;  // N of one dQ GEMM (one chunk)
  static constexpr int kDqRows = kDqSplitRows ? 64 : kBlockM;  // query rows of one warpgroup's dQ
  static constexpr int kDqChunks = kSplitHeadDim ? kWgCols / 64 : 1;
  static_assert(kDqSplitKeys || kDqSplitRows || kTileCols / kWarpgroups == 64 * kDqChunks, "dQ chunks are m64n64");

  using QTile = cuda::SmemTile<kBlockM, kTileCols>;   // Q and dO: rows = queries
  using KVTile = cuda::SmemTile<kBlockN, kTileCols>;  // K and V: rows = keys
  // dS^T: rows = keys, 64-query spans; transposed dQ reads dS K-major (rows = queries, 64-key spans).
  using DsTile = std::conditional_t<kDqTransposed, cuda::SmemTile<kBlockM, kBlockN>, cuda::SmemTile<kBlockN, kBlockM>>;
  static constexpr uint32_t kQBytes = QTile::kElems * 2;
  static constexpr uint32_t kKVBytes = KVTile::kElems * 2;
  static constexpr uint32_t kDsBytes = DsTile::kElems * 2;
  static constexpr uint32_t kRowStatBytes = 2 * kBlockM * 4;  // per query: lse (log2 units), rowsum(dO * O)
  // First column and first query row (from the step's) of dQ chunk `chunk` of warpgroup `wg`.
  static constexpr int dq_col0(int wg, int chunk) {
    return kDqSplitKeys || kDqSplitRows ? 0 : 64 * (wg * kDqChunks + chunk);
  }
  static constexpr int dq_row0(int wg) { return kDqSplitRows ? 64 * wg : 0; }
  // Each warpgroup's dQ (kDqRows queries x kDqCols columns, fp32) is staged as 32-column boxes in the 128-byte
  // swizzle and added to the global accumulator by TMA (cp.reduce.async.bulk.tensor).
  static constexpr int kDqBoxCols = 32, kDqBoxRows = kDqRows, kDqBoxes = kDqCols / kDqBoxCols;
  // Dense kernels that stage dQ as float2 pairs (all but the transposed one) interleave the staging rows of each
  // group of 8 (dq_staging_row), which the dQ writer's 4-D tensor map undoes: a warp's stores then meet no bank
  // conflict. Varlen keeps plain rows: its tiles start at any row of the accumulator, not at multiples of 8.
  static constexpr bool kDqRowsInterleaved = !kDqTransposed && !kVarlen;
  // Dense transposed dQ (80-row steps) is staged and accumulated in its fragment order (common/dq_fragment_order.cuh):
  // float4 stores instead of scalar ones, and one bulk reduction a warpgroup and step, no tensor map; the post-pass
  // un-permutes. Varlen keeps rows: its tiles start at any row of the packed accumulator. So does head dim 96: a
  // fragment-ordered tile holds all 128 columns of the shared-memory tile (an fp32 accumulator 11 % above cuDNN's
  // peak memory at 4x16x8192x96), where the row layout's TMA reductions drop the columns past head_dim; the two
  // measured alike in speed (docs/PERFORMANCE.md).
  static constexpr bool kDqFragmentOrder = kDqTransposed && !kVarlen && kHeadDim == kTileCols;
  static_assert(!kDqFragmentOrder || kTileCols == 128, "fragment-ordered tiles are 128 columns wide");
  static constexpr uint32_t kDqWgBytes = kDqRows * kDqCols * 4;
  // Split keys, the warpgroups never read each other's shared memory in a step: each stages its own copy of the
  // step's lse/dsum and synchronizes only its own threads, so neither waits for the other.
  static constexpr int kRowStatCopies = kDqSplitKeys ? kWarpgroups : 1;
  // dS^T is double-buffered by step parity where the warpgroups read each other's rows (dQ split by columns or
  // rows): a fast warpgroup may write step i + 1's while the other still reads step i's. Split by keys, each reads only
  // the rows it wrote, after its own previous dQ GEMM retired: one buffer.
  // Split head dim: P^T goes through shared memory too (each warpgroup computes half of it), double-buffered
  // like dS^T.
  static constexpr int kDsBuffers = kDqSplitKeys ? 1 : 2;
  static constexpr int kPtBuffers = kSplitHeadDim ? kDsBuffers : 0;
  static constexpr int kBarriers = 1 + 2 * kStages + (kSeparateDo ? 2 * kDoStages : 0) + 2 * kWarpgroups;
  // Tiles are 1024-byte aligned (the swizzle atom); the first 1024 bytes cover aligning the dynamic base.
  // Varlen: the sequence's band in shared memory after the barriers, a copy for each consumer warpgroup (they may
  // synchronize apart), as the consumers have no registers to hold it across their loop.
  static constexpr int kBandBytes = kVarlen ? 32 * kWarpgroups : 0;  // a copy a warpgroup
  // Deterministic dense kernels: the query tiles [begin, end) of key block n_block + 1, which the dQ writer
  // (24 registers) computes once and reads back each step (bwd_sm90_producer.cuh).
  static constexpr int kNextTilesBytes = kVarlen ? 0 : 8;
  static constexpr int kSmemBytes = 1024 + 2 * kKVBytes + (kStages + kDoStages) * kQBytes +
                                    (kDsBuffers + kPtBuffers) * kDsBytes + kWarpgroups * kDqWgBytes +
                                    2 * kRowStatCopies * kRowStatBytes + 8 * kBarriers + kBandBytes +
                                    kNextTilesBytes;
  static_assert(kSmemBytes <= 227 * 1024, "shared memory");
};

template <typename Traits>
struct BwdSharedStorage {
  using Element = typename Traits::Element;
  Element* k;
  Element* v;
  Element* q;     // kStages Q tiles
  Element* dout;  // kDoStages dO tiles
  Element* ds;    // kDsBuffers dS^T tiles
  Element* pt;    // kPtBuffers P^T tiles (split head dim only)
  float* dq;      // kWarpgroups dQ staging tiles
  float* row_stats;  // kRowStatCopies x 2 (step parity) x [lse_log2 (kBlockM) | dsum (kBlockM)]
  uint64_t* kv_full;
  uint64_t* qdo_full;   // kStages: Q, and dO unless kSeparateDo
  uint64_t* qdo_empty;  // kStages
  uint64_t* do_full;    // kDoStages, kSeparateDo only (else = qdo_full)
  uint64_t* do_empty;   // kDoStages, kSeparateDo only (else = qdo_empty)
  uint64_t* dq_full;    // kWarpgroups: a warpgroup's dQ is staged (its 4 warps arrive)
  uint64_t* dq_empty;   // kWarpgroups: the dQ writer's reduction has read the staging tile
  Band* seq_band;       // varlen: kWarpgroups copies of the block's sequence's band (kBandBytes)
  int* next_tiles;      // dense: the dQ writer's [begin, end) of key block n_block + 1 (kNextTilesBytes)

  __device__ __forceinline__ explicit BwdSharedStorage(unsigned char* raw) {
    // Pointer arithmetic on raw (not an integer round trip) keeps the pointers provably in shared memory, so
    // the compiler emits LDS/STS rather than generic loads and stores.
    unsigned char* base = raw + ((1024u - (static_cast<uint32_t>(__cvta_generic_to_shared(raw)) & 1023u)) & 1023u);
    k = reinterpret_cast<Element*>(base);
    v = reinterpret_cast<Element*>(base + Traits::kKVBytes);
    q = reinterpret_cast<Element*>(base + 2 * Traits::kKVBytes);
    dout = reinterpret_cast<Element*>(base + 2 * Traits::kKVBytes + Traits::kStages * Traits::kQBytes);
    unsigned char* ds_base = base + 2 * Traits::kKVBytes + (Traits::kStages + Traits::kDoStages) * Traits::kQBytes;
    ds = reinterpret_cast<Element*>(ds_base);
    pt = reinterpret_cast<Element*>(ds_base + Traits::kDsBuffers * Traits::kDsBytes);
    unsigned char* dq_base = ds_base + (Traits::kDsBuffers + Traits::kPtBuffers) * Traits::kDsBytes;
    dq = reinterpret_cast<float*>(dq_base);
    unsigned char* tail = dq_base + Traits::kWarpgroups * Traits::kDqWgBytes;
    row_stats = reinterpret_cast<float*>(tail);
    uint64_t* bars = reinterpret_cast<uint64_t*>(tail + 2 * Traits::kRowStatCopies * Traits::kRowStatBytes);
    kv_full = bars;
    qdo_full = bars + 1;
    qdo_empty = qdo_full + Traits::kStages;
    do_full = Traits::kSeparateDo ? qdo_empty + Traits::kStages : qdo_full;
    do_empty = Traits::kSeparateDo ? do_full + Traits::kDoStages : qdo_empty;
    dq_full = qdo_empty + Traits::kStages + (Traits::kSeparateDo ? 2 * Traits::kDoStages : 0);
    dq_empty = dq_full + Traits::kWarpgroups;
    seq_band = reinterpret_cast<Band*>(bars + Traits::kBarriers);
    next_tiles = reinterpret_cast<int*>(reinterpret_cast<unsigned char*>(seq_band) + Traits::kBandBytes);
  }
  __device__ __forceinline__ Element* q_stage(int s) const { return q + s * Traits::QTile::kElems; }
  __device__ __forceinline__ Element* dout_stage(int s) const { return dout + s * Traits::QTile::kElems; }
  __device__ __forceinline__ Element* ds_buffer(int step) const {
    return ds + (step % Traits::kDsBuffers) * Traits::DsTile::kElems;
  }
  __device__ __forceinline__ Element* pt_buffer(int step) const {
    return pt + (step % Traits::kDsBuffers) * Traits::DsTile::kElems;
  }
  __device__ __forceinline__ float* dq_staging(int wg) const { return dq + wg * (Traits::kDqWgBytes / 4); }
  __device__ __forceinline__ float* row_stats_buffer(int parity, int copy) const {
    return row_stats + (copy * 2 + parity) * 2 * Traits::kBlockM;
  }
};

// The work of one block: kBlockN keys of one (batch, kv head), and the steps (query head of the group, query
// block) that can see them, in order. Producer and consumers walk that sequence with BwdStepCursor; the dQ
// writer walks its accumulator rows in the same order (bwd_sm90_producer.cuh).
struct BwdBlock {
  int n_block, n0;
  int64_t b, h_kv, group;
  int m_begin, m_count;  // query blocks [m_begin, m_begin + m_count) of every head of the group
  int steps;             // group * m_count
  // Varlen only (the dense kernels read p.seqlen_q/p.seqlen_k/p.band): the sequence's first rows in the packed
  // tensors, its lengths and its band. Indices n0, m0 and the band's are relative to the sequence.
  int q_begin, k_begin, seqlen_q, seqlen_k;
  Band band;
};

// (query head, query block) of successive steps of a BwdBlock: the steps run over the query blocks of one head,
// then the next head of the group. Walked, not derived from the step index: a division by m_count per step sat
// on the consumers' path from one step's last GEMM to the next step's first (ncu: the I2F/MUFU.RCP sequence).
struct BwdStepCursor {
  int head, m_index, m_begin, m_end;

  __device__ __forceinline__ explicit BwdStepCursor(const BwdBlock& blk)
      : head((int)(blk.h_kv * blk.group)), m_index(blk.m_begin), m_begin(blk.m_begin),
        m_end(blk.m_begin + blk.m_count) {}
  __device__ __forceinline__ int m0(int block_m) const { return m_index * block_m; }
  __device__ __forceinline__ BwdStepCursor next() const {
    BwdStepCursor c = *this;
    if (++c.m_index == c.m_end) {
      c.m_index = c.m_begin;
      ++c.head;
    }
    return c;
  }
};

// locate_packed_tile (seqlen.h) as one warp's round of loads for batches of at most kVarlenScanMaxBatch: lane l
// reads tile_end[l], tile_end[l + 32], ... at once, and a ballot a chunk finds the first slot whose blocks end past
// `block` (tile_end ascends), where the binary search's chain of dependent loads (4-8 L2 round trips) sat on every
// block's start. Warp-collective: all 32 lanes call it with the same arguments; every ballot and shuffle runs on
// every lane (the chunk loop's bound is the batch, a kernel parameter), so the warp stays converged.
__device__ __forceinline__ bool locate_packed_tile_warp(const VarlenParams& v, int batch, int heads, int block,
                                                        PackedTile& out) {
  constexpr int kChunks = cuda::kVarlenScanMaxBatch / 32;
  const int lane = threadIdx.x & 31;
  int end_of[kChunks];  // tile_end of slot c * 32 + lane; 0 past the batch (never past the block)
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int s = c * 32 + lane;
    end_of[c] = s < batch ? v.tile_end[s] : 0;
  }
  int slot = -1, end = 0, first = 0, prev_last = 0;  // prev_last: the previous chunk's last tile_end
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    if (c * 32 >= batch) break;
    const unsigned past = __ballot_sync(0xffffffffu, (int64_t)heads * end_of[c] > block);
    const int owner = past != 0 ? __ffs(past) - 1 : 0;
    const int owner_end = __shfl_sync(0xffffffffu, end_of[c], owner);
    const int before_owner = __shfl_sync(0xffffffffu, end_of[c], (owner + 31) & 31);
    if (slot < 0 && past != 0) slot = c * 32 + owner, end = owner_end, first = owner > 0 ? before_owner : prev_last;
    prev_last = __shfl_sync(0xffffffffu, end_of[c], 31);
  }
  if (slot < 0) return false;
  const int tiles = end - first;
  const int rel = block - heads * first;  // < heads * tiles, so tiles > 0
  out.slot = slot;
  out.tiles = tiles;
  out.head = rel / tiles;
  out.tile = rel % tiles;
  return true;
}

// Varlen: the block of a packed grid (VarlenParams::tile_end: a slot's key blocks of one head side by side, the
// heavier first) or of a grid of max_seqlen_k's key blocks for every slot; a block past its sequence's keys (or
// past the packed grid's last slot: seqlen_k = 0) exits in the kernel.
template <int kBlockM, int kBlockN>
__device__ __forceinline__ BwdBlock varlen_bwd_block(const BwdParams& p, int num_n_blocks) {
  BwdBlock blk;
  bool in_grid = true;
  int64_t slot;
  if (p.varlen.tile_end != nullptr) {
    PackedTile t;
    in_grid = p.batch <= cuda::kVarlenScanMaxBatch
                  ? locate_packed_tile_warp(p.varlen, (int)p.batch, (int)p.heads_kv, (int)blockIdx.x, t)
                  : locate_packed_tile(p.varlen, p.batch, p.heads_kv, blockIdx.x, t);
    blk.n_block = t.tile;
    slot = t.slot;
    blk.h_kv = t.head;
  } else {
    blk.n_block = (int)(blockIdx.x % num_n_blocks);
    uint32_t h_kv;
    slot = p.heads_kv_div.divmod(blockIdx.x / num_n_blocks, h_kv);
    blk.h_kv = h_kv;
  }
  blk.b = p.varlen.sequence_of_slot(slot);
  blk.group = p.group;
  blk.n0 = blk.n_block * kBlockN;
  const SeqInfo seq = p.seq(blk.b);
  blk.q_begin = (int)seq.q_begin;  // < 2^31: the host checks the packed lengths
  blk.k_begin = (int)seq.k_begin;
  blk.seqlen_q = (int)seq.seqlen_q;
  blk.seqlen_k = in_grid ? (int)seq.seqlen_k : 0;
  blk.band = p.band_of(seq);
  const IndexRange m_tiles =
      blk.band.query_tiles_of_keys(blk.n0, (int64_t)blk.n0 + kBlockN, seq.seqlen_q, kBlockM);
  blk.m_begin = (int)m_tiles.begin;
  blk.m_count = (int)m_tiles.size();
  blk.steps = (int)(p.group * blk.m_count);
  return blk;
}

// Heavier key blocks (the first ones, under a causal mask) have the smaller n_block and start first. Deterministic
// (p.dq_turns) the other way round: a key block adds its dQ to a query tile after block n_block + 1 did
// (bwd_sm90_producer.cuh), which must therefore have the lower block index (started no later: no deadlock).
template <int kBlockM, int kBlockN, bool kVarlen>
__device__ __forceinline__ BwdBlock bwd_block(const BwdParams& p, int num_n_blocks) {
  if constexpr (kVarlen) return varlen_bwd_block<kBlockM, kBlockN>(p, num_n_blocks);
  BwdBlock blk;
  blk.n_block = (int)(blockIdx.x % num_n_blocks);
  if (p.dq_turns != nullptr) blk.n_block = num_n_blocks - 1 - blk.n_block;
  const uint32_t bhkv = blockIdx.x / num_n_blocks;
  uint32_t h_kv;
  blk.b = p.heads_kv_div.divmod(bhkv, h_kv);  // bhkv < gridDim.x < 2^31
  blk.h_kv = h_kv;
  blk.group = p.group;
  blk.n0 = blk.n_block * kBlockN;
  // The query blocks that see some key of the block (the mask's band).
  const IndexRange m_tiles =
      p.band.query_tiles_of_keys(blk.n0, (int64_t)blk.n0 + kBlockN, p.seqlen_q, kBlockM);
  blk.m_begin = (int)m_tiles.begin;
  blk.m_count = (int)m_tiles.size();
  blk.steps = (int)(p.group * blk.m_count);
  return blk;
}

}  // namespace flashcore::sm90
