// Tile shapes of the wgmma forward kernel per head-dim tile: warpgroups per block (64 query rows each) and keys
// per tile. Chosen by measurement (docs/PERFORMANCE.md); shared memory Q + 2 x (K + V) must fit in 227 KiB.
#pragma once

namespace flashcore::sm90 {

template <int kHeadDim>
struct FwdSm90Config;

template <> struct FwdSm90Config<64>  { static constexpr int kWarpgroups = 3, kBlockN = 192; };
template <> struct FwdSm90Config<128> { static constexpr int kWarpgroups = 2, kBlockN = 128; };
template <> struct FwdSm90Config<256> { static constexpr int kWarpgroups = 2, kBlockN = 64; };

}  // namespace flashcore::sm90
