// Tile shapes of the Hopper backward kernel per head-dim tile: consumer warpgroups per block (64 keys each),
// query rows per step (kBlockM), stages of the Q/dO ring, and the setmaxnreg split (producer warpgroup /
// consumers). A consumer thread holds dK and dV of its 64 keys (2 x kHeadDim / 2 fp32 registers), S^T and dP^T of
// one step (2 x kBlockM / 2), then dQ (kBlockM / 2): head dims above 128 do not fit and keep the mma.sync
// backward. Head dim 64 takes 128-row steps: its GEMMs are half as deep, and a step's fixed costs (barriers,
// fences, the dQ hand-off) would otherwise weigh twice as much.
#pragma once

namespace flashcore::sm90 {

template <int kHeadDim>
struct BwdSm90Config;

template <> struct BwdSm90Config<64> {
  static constexpr int kWarpgroups = 2, kBlockM = 128, kStages = 2, kProducerRegs = 24, kConsumerRegs = 240;
};
template <> struct BwdSm90Config<128> {
  static constexpr int kWarpgroups = 2, kBlockM = 64, kStages = 2, kProducerRegs = 24, kConsumerRegs = 240;
};

}  // namespace flashcore::sm90
