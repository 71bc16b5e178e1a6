// Tile shapes of the Hopper backward kernel per head-dim tile: consumer warpgroups per block, query rows per step
// (kBlockM), stages of the Q and dO rings, and the setmaxnreg split (producer warpgroup / consumers).
// Up to head dim 128 each consumer warpgroup owns 64 keys and holds their whole dK and dV (2 x kHeadDim / 2 fp32
// registers a thread), S^T and dP^T of one step (2 x kBlockM / 2), then dQ (kBlockM / 2). Head dim 64 takes
// 128-row steps: its GEMMs are half as deep, and a step's fixed costs (barriers, fences, the dQ hand-off) would
// otherwise weigh twice as much.
// kDqSplit, how the two warpgroups share a step's dQ = dS K (query rows x head-dim columns, summed over the
// block's keys):
//   kColumns: each takes a 64-column span over all keys of the block (head dims 96-256);
//   kRows: each takes 64 of a 128-row step's queries over all keys and every column (head dim 64);
//   kKeys: each takes its own 64 keys, every row and column; the two partial sums meet in the fp32 accumulator,
//     so a warpgroup never reads the other's dS^T and they need not meet each step, but the TMA reductions carry
//     twice the bytes (no kernel takes it now; BwdSm90Traits falls back to it for kRows at 64-row steps).
// kColumns and kRows read both warpgroups' dS^T: one consumer barrier a step.
// Head dim 256 does not fit that way (dK + dV alone would be 256 registers a thread): its two warpgroups share
// the block's 64 keys and split the head dim (BwdSm90Traits::kSplitHeadDim). Its shared memory (K, V, two Q
// stages, P^T and dS^T double-buffered, dQ staging) leaves room for one dO stage only.
#pragma once

namespace flashcore::sm90 {

enum class DqSplit { kColumns, kRows, kKeys };

template <int kHeadDim>
struct BwdSm90Config;

template <> struct BwdSm90Config<64> {
  static constexpr int kWarpgroups = 2, kBlockM = 128, kStages = 2, kDoStages = 2;
  // By rows: half the reduction bytes of by keys, and 32 dQ registers a thread instead of 64; measured 13-17 %
  // faster (docs/PERFORMANCE.md, ablation).
  static constexpr DqSplit kDqSplit = DqSplit::kRows;
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
  static constexpr int kWideBlockM = 0;  // no wide-step kernel (BwdSm90Traits::kWideSteps)
};
template <> struct BwdSm90Config<128> {
  static constexpr int kWarpgroups = 2, kBlockM = 64, kStages = 2, kDoStages = 2;
  // By keys (each warpgroup adds a 64 x 128 partial dQ) measured 12-15 % slower; the consumer supports by keys
  // and by rows only where dQ is one 64-column GEMM (head dim 64).
  static constexpr DqSplit kDqSplit = DqSplit::kColumns;
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
  // The plain and score-mod kernels take 80-row steps (BwdSm90Traits::kWideSteps): shared memory K, V 64 KiB +
  // 2 x (Q, dO) 80 KiB + 2 dS 40 KiB + dQ staging 40 KiB, 226 KiB with the rest.
  static constexpr int kWideBlockM = 80;
};
// Head dim 96 runs the 128-wide tiles with narrower GEMMs (bwd_sm90_traits.cuh): same shapes as 128.
template <> struct BwdSm90Config<96> : BwdSm90Config<128> {};
template <> struct BwdSm90Config<256> {
  static constexpr int kWarpgroups = 2, kBlockM = 64, kStages = 2, kDoStages = 1;
  static constexpr DqSplit kDqSplit = DqSplit::kColumns;
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
  static constexpr int kWideBlockM = 0;
};

}  // namespace flashcore::sm90
