// Tile shapes of the Hopper forward kernel per head-dim tile: consumer warpgroups per block (64 query rows
// each), keys per tile (kBlockN under a causal mask, kBlockNNonCausal without one, or for the plain kernels under
// every mask with kWideUnderMasks; the score-mod and varlen kernels keep kBlockN), pipeline stages of the K/V
// ring, whether a block may loop over tiles (persistent grid), and the register split made with setmaxnreg (the
// producer warpgroup keeps kProducerRegs; consumers take the rest of the 64K-register file).
// Shared memory Q + kStages x (K + V) must fit in 227 KiB. Chosen by measurement (docs/PERFORMANCE.md).
#pragma once

namespace flashcore::sm90 {

template <int kHeadDim>
struct FwdSm90Config;

template <> struct FwdSm90Config<64> {
  static constexpr int kWarpgroups = 3, kBlockN = 128, kStages = 4, kProducerRegs = 24, kConsumerRegs = 160;
  static constexpr int kBlockNNonCausal = 128;  // wider tiles spill in 160-register consumers
  static constexpr int kWideMinKeys = 0;
  static constexpr bool kWideUnderMasks = false;
  static constexpr bool kPersistent = true;
};
template <> struct FwdSm90Config<128> {
  static constexpr int kWarpgroups = 2, kBlockN = 128, kStages = 2, kProducerRegs = 24, kConsumerRegs = 240;
  // Without a mask, 176-key tiles (FlashAttention-3's choice) spread a tile's fixed costs (row max and sum
  // reductions, the O rescale, barriers) over 38 % more keys; S (88), P (44) and O (64 registers) still fit in
  // 240 without spills (192 keys spill). Under a causal mask the diagonal tiles would waste more. Below
  // kWideMinKeys keys the partial last tile and the longer pipeline fill cost more than that buys (H100:
  // 2x16x2048 6 % slower, 1x16x4096 2 % and 4x16x8192 2-4 % faster; docs/PERFORMANCE.md).
  static constexpr int kBlockNNonCausal = 176;
  static constexpr int kWideMinKeys = 4096;
  static constexpr bool kWideUnderMasks = false;
  static constexpr bool kPersistent = true;
};
// Head dim 96 runs the 128-wide shared-memory tiles with n96 / 6-k-step GEMMs (fwd_sm90_traits.cuh), in blocks of
// three consumer warpgroups on 96-key tiles: S (48), P (24) and O (48 registers) fit in 160 (128-key tiles spill
// 144 B there; FlashAttention-3/4 take 192 x 144 tiles with P through shared memory).
template <> struct FwdSm90Config<96> {
  static constexpr int kWarpgroups = 3, kBlockN = 96, kStages = 2, kProducerRegs = 24, kConsumerRegs = 160;
  static constexpr int kBlockNNonCausal = 96;
  static constexpr int kWideMinKeys = 0;
  static constexpr bool kWideUnderMasks = false;
  static constexpr bool kPersistent = true;
};
// Head dim 256: the plain kernels take 80-key tiles, causal or not (FlashAttention-4's 128 x 80): Q 64 KiB and two
// stages of K and V 160 KiB fit beside the barriers (O is staged in Q's buffer), and S (40), P (20) and O (128
// registers) fit in 240 without spills. Against 64-key tiles, same process (H200): 4x16x8192x256 fp16 0.95 -> 0.98x
// FA4, causal 0.94 -> 0.98x, 16x16x2048x256 bf16 causal 0.94 -> 0.97x (docs/PERFORMANCE.md). The score-mod kernels
// keep 64 (their softcap path spills 580 B at 80).
template <> struct FwdSm90Config<256> {
  static constexpr int kWarpgroups = 2, kBlockN = 64, kStages = 2, kProducerRegs = 24, kConsumerRegs = 240;
  static constexpr int kBlockNNonCausal = 80;
  static constexpr int kWideMinKeys = 0;
  static constexpr bool kWideUnderMasks = true;
  static constexpr bool kPersistent = false;  // the tile loop spills here (fwd_sm90_traits.cuh)
};

}  // namespace flashcore::sm90
