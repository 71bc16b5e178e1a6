// Tile shapes of the Hopper backward kernel per head-dim tile: consumer warpgroups per block (64 keys each),
// stages of the Q/dO ring, and the setmaxnreg split (producer warpgroup / consumers). One query block is 64 rows.
// A consumer thread holds dK and dV of its 64 keys (2 x kHeadDim / 2 fp32 registers), S^T and dP^T of one query
// block (2 x 32), then dQ (32): head dims above 128 do not fit and keep the mma.sync backward.
#pragma once

namespace flashcore::sm90 {

template <int kHeadDim>
struct BwdSm90Config;

template <> struct BwdSm90Config<64> {
  static constexpr int kWarpgroups = 2, kStages = 2, kProducerRegs = 24, kConsumerRegs = 240;
};
template <> struct BwdSm90Config<128> {
  static constexpr int kWarpgroups = 2, kStages = 2, kProducerRegs = 24, kConsumerRegs = 240;
};

}  // namespace flashcore::sm90
