// Tile shapes of the mma.sync forward kernel, per head-dim tile (the head dim rounded up to 32/64/96/128/192/256).
//
// Every configuration keeps shared memory (Q + double-buffered K and V) at or under 96 KiB, so one binary runs
// on sm_80/sm_90 (up to 227 KiB a block) and on sm_86/sm_89 (99 KiB a block).
// Each warp owns kBlockM / kNWarps query rows (16 per m16 tile). Two m-tiles per warp halve the shared-memory
// traffic of K and V per MMA (each B fragment feeds two MMAs), which an mma.sync kernel needs to keep the tensor
// cores busy; the price is accumulator registers, so large head dims use one m-tile and keep Q in shared memory.
#pragma once

namespace flashcore::sm80 {

template <int kHeadDim>
struct FwdConfig;

// kBlockMSmallGrid x kBlockNSmallGrid: the tile of the variant launched when the grid of kBlockM-row blocks has
// fewer blocks than the GPU has multiprocessors (one m-tile a warp: half the serial MMA chain per key block, twice
// the blocks). Up to head dim 64 its key blocks are 128 wide: a warp's 16 rows leave registers for 64 scores a
// thread, and each key block's fixed costs (two __syncthreads, cp.async waits, row max/sum shuffles, the O
// rescale) are paid half as often (H100, forced, graph us: 4x8x512x64 11.88 -> 9.59, 1x8x512x64 7.20 -> 6.26;
// docs/PERFORMANCE.md). Shared memory stays 72 KiB at head dim 64, two blocks an SM on sm_80/sm_90.
//                                                  kBlockM      kBlockN      kNWarps     kQInRegs          kBlockMSmallGrid        kBlockNSmallGrid
template <> struct FwdConfig<32>  { static constexpr int kBlockM = 128, kBlockN = 64,  kNWarps = 4; static constexpr bool kQInRegs = true;  static constexpr int kBlockMSmallGrid = 64,  kBlockNSmallGrid = 128; };
template <> struct FwdConfig<64>  { static constexpr int kBlockM = 128, kBlockN = 64,  kNWarps = 4; static constexpr bool kQInRegs = true;  static constexpr int kBlockMSmallGrid = 64,  kBlockNSmallGrid = 128; };
template <> struct FwdConfig<96>  { static constexpr int kBlockM = 128, kBlockN = 64,  kNWarps = 4; static constexpr bool kQInRegs = false; static constexpr int kBlockMSmallGrid = 64,  kBlockNSmallGrid = 64; };
template <> struct FwdConfig<128> { static constexpr int kBlockM = 128, kBlockN = 64,  kNWarps = 4; static constexpr bool kQInRegs = false; static constexpr int kBlockMSmallGrid = 64,  kBlockNSmallGrid = 64; };
template <> struct FwdConfig<192> { static constexpr int kBlockM = 128, kBlockN = 32,  kNWarps = 8; static constexpr bool kQInRegs = false; static constexpr int kBlockMSmallGrid = 128, kBlockNSmallGrid = 32; };
template <> struct FwdConfig<256> { static constexpr int kBlockM = 64,  kBlockN = 32,  kNWarps = 4; static constexpr bool kQInRegs = false; static constexpr int kBlockMSmallGrid = 64,  kBlockNSmallGrid = 32; };

}  // namespace flashcore::sm80
