// Which kernel the last call ran (process-wide), per pass: tests assert the path they meant to test (a forced
// family that fell back, a key split that did not happen), benchmarks label their rows. Recorded at launch by the
// dispatchers and launchers (a few stores); read through flashcore.last_kernel("fwd" | "bwd").
#pragma once

#include <string>

namespace flashcore {

enum class Pass { kFwd, kBwd };

struct KernelTrace {
  const char* family = "none";  // "cpu", "sm80", "sm90", "composite", or "none" (nothing ran: empty inputs)
  int head_dim_tile = 0;        // CUDA kernels: the compiled head-dim tile
  int warpgroups = 0;           // sm90 forward: consumer warpgroups a block
  int key_splits = 1;           // sm90 forward: blocks a query tile (1: no split)
  bool compact = false;         // sm90 forward: the compact one-warpgroup variant
  bool score_mod = false;       // CUDA kernels: the score-mod variant (softcap, ALiBi, non-positive scale)
  bool varlen = false;          // CUDA kernels: the variable-length variant (seqlen.h)
  bool longest_first = false;   // KV-cache kernel: blocks took their batch entries longest first
  bool cluster_merge = false;   // KV-cache kernel: the splits merged in thread-block clusters (no combine kernel)
  bool dq_overlap = false;      // sm90 backward: the dQ post-pass converts tiles as they count down (dq_tiles_pending)
  bool deterministic = false;   // sm90 backward: dQ reductions in key-block order (BwdParams::dq_turns)
  int wide_block_m = 0;         // backward: the wide-step kernel's query rows a step, where it ran
  int pack_gqa = 1;             // sm90 varlen forward: query heads a block (params.h: PackGqa)
  bool packed_grid = false;     // sm90 varlen forward: the sequences' own tiles (cuda/common/varlen_tile_scan.cuh)
};

void record_kernel(Pass pass, const KernelTrace& trace);
// "sm90 hdim128 wg2", "sm90 hdim64 wg1 splits3", "sm80 hdim64 mod", "sm80 hdim128 mod varlen", "decode hdim128
// longest-first", "decode stages3 hdim128 splits4 cluster", "sm90 hdim128 dq-overlap m80", "sm90 hdim128 wg2 pack4 packed-grid varlen", "cpu", "composite", "none", ...
std::string last_kernel(Pass pass);

}  // namespace flashcore
