// Tile shapes of the Hopper forward kernel per head-dim tile: consumer warpgroups per block (64 query rows
// each), keys per tile, pipeline stages of the K/V ring, whether a block may loop over tiles (persistent grid),
// and the register split made with setmaxnreg (the
// producer warpgroup keeps kProducerRegs; consumers take the rest of the 64K-register file).
// Shared memory Q + kStages x (K + V) must fit in 227 KiB. Chosen by measurement (docs/PERFORMANCE.md).
#pragma once

namespace flashcore::sm90 {

template <int kHeadDim>
struct FwdSm90Config;

template <> struct FwdSm90Config<64> {
  static constexpr int kWarpgroups = 3, kBlockN = 128, kStages = 4, kProducerRegs = 24, kConsumerRegs = 160;
  static constexpr bool kPersistent = true;
};
template <> struct FwdSm90Config<128> {
  static constexpr int kWarpgroups = 2, kBlockN = 128, kStages = 2, kProducerRegs = 24, kConsumerRegs = 240;
  static constexpr bool kPersistent = true;
};
template <> struct FwdSm90Config<256> {
  static constexpr int kWarpgroups = 2, kBlockN = 64, kStages = 2, kProducerRegs = 24, kConsumerRegs = 240;
  static constexpr bool kPersistent = false;  // the tile loop spills here (fwd_sm90_traits.cuh)
};

}  // namespace flashcore::sm90
