// Run-time switches for tests, ablations and benchmarks, read from the environment in this one place. Each is read
// when asked (per call, a getenv each), so a test can set it between calls.
//   FLASHCORE_FORCE_KERNEL=sm80|sm90            forward kernel family (CUDA)
//   FLASHCORE_FORCE_BWD=composite|sm80|sm90     backward path (CUDA)
//   FLASHCORE_KEY_SPLITS=n                      at most n blocks per query tile in the sm90 key split (1: none)
//   FLASHCORE_FWD_WARPGROUPS=n                  consumer warpgroups a block in the sm90 forward's plain kernels (1 to
//                                               the head dim's widest; A/B of pick_consumer_warpgroups)
//   FLASHCORE_PDL=0                             no programmatic dependent launch
//   FLASHCORE_FWD_PERSISTENT=0|1                the sm90 forward's plain multi-warpgroup kernels on a persistent
//                                               grid (1) or one block a tile (0) (default: fwd_sm90_launch.cuh's
//                                               rule; A/B)
//   FLASHCORE_CPU_ISA=portable                  the CPU kernels' baseline code instead of AVX2 (read once a process)
//   FLASHCORE_POISON=1                          fill outputs and workspaces with NaN before the kernels run, so a
//                                               kernel that leaves an element unwritten fails the tests (on in the
//                                               test suite)
//   FLASHCORE_CHECK_VARLEN=1                    validate varlen offsets and lengths (cu_seqlens, seqused_k,
//                                               max_seqlen) on CUDA too, at the cost of a device sync per call (the
//                                               CPU always validates them)
//   FLASHCORE_VARLEN_SCHEDULE=0                 run a varlen backward's sequences in their given order on a grid of
//                                               max_seqlen_k's blocks each, not longest first on a packed grid (A/B)
//   FLASHCORE_PACK_GQA=0                        no pack-GQA: the sm90 varlen forward keeps one query head a block,
//                                               and dense or short varlen GQA calls the kernels they took without
//                                               it (A/B; sm90/fwd_sm90_pack_gqa.h); =always packs every GQA call
//                                               the Hopper varlen forward runs, and sends dense GQA calls in BSHD
//                                               memory to it whatever their length (A/B)
//   FLASHCORE_VARLEN_FWD_PACKED=0               the Hopper varlen forward's grid of max_seqlen_q's tiles for every
//                                               sequence, not the packed grid of their own tiles (A/B)
//   FLASHCORE_BWD_WIDE_STEPS=0                  the sm90 backward at head-dim tiles 96 and 128 takes 64-row steps,
//                                               not its 80-row kernel (A/B)
//   FLASHCORE_BWD_TMA_EPILOGUE=0                the sm90 backward stores dK/dV from registers, not through shared
//                                               memory and TMA (A/B)
//   FLASHCORE_DQ_CONVERT=aten                   the backward's dQ post-pass from ATen operations, not its kernel
//                                               (the fallback the tests cover)
//   FLASHCORE_BWD_DQ_OVERLAP=0                  the sm90 backward's dQ post-pass waits for the whole kernel, not
//                                               tile by tile on its countdowns (BwdParams::dq_tiles_pending; A/B)
//   FLASHCORE_DECODE_LONGEST_FIRST=0            the KV-cache kernel's blocks take their batch entries in index
//                                               order, not longest first (A/B)
//   FLASHCORE_DECODE_TMA=0|1                    the KV-cache kernel's loader on Hopper: 0 cp.async everywhere, 1 TMA
//                                               wherever TMA can address the cache (default: decode_launch.cu's
//                                               choice: cp.async)
//   FLASHCORE_DECODE_STAGES=2|3                 the cp.async loader's K/V stages (default: decode_launch.cu's
//                                               choice)
//   FLASHCORE_DECODE_CLUSTER=0|1                the KV-cache kernel's splits: 0 always merged by the combine kernel,
//                                               1 in a thread-block cluster wherever one can (sm_90 code, 2-8
//                                               splits) (default: decode_launch.cu's choice)
//   FLASHCORE_DECODE_BLOCKS_PER_SM=N            a decode step's blocks resident an SM (N >= 1, at most what fits),
//                                               also the slots its split count fills; turns off the one-wave plan;
//                                               not for TMA or chunked prefill (default: decode_launch.cu's choice)
#pragma once

#include <string>

namespace flashcore {

std::string forced_fwd_family();  // "" when not forced
std::string forced_bwd_path();    // "" when not forced
int key_split_cap();              // 0 when not capped; throws on a malformed value
int fwd_warpgroups_forced();      // 0 when not forced; throws on a malformed value
bool pdl_allowed();
bool poison_outputs();
bool cpu_isa_forced_portable();
bool check_varlen_offsets();
bool varlen_schedule_enabled();
int pack_gqa_mode();  // 0 off, 1 where it saves rows (default), 2 always (FLASHCORE_PACK_GQA=always)
bool varlen_fwd_packed_grid_enabled();
bool decode_longest_first_enabled();
bool bwd_wide_steps_enabled();
bool bwd_tma_epilogue_enabled();
bool dq_convert_kernel_enabled();
bool bwd_dq_overlap_enabled();
int decode_tma_forced();      // -1 when not forced, else 0 or 1; throws on a malformed value
int decode_stages_forced();   // 0 when not forced, else 2 or 3; throws on a malformed value
int decode_cluster_forced();  // -1 when not forced, else 0 or 1; throws on a malformed value
int fwd_persistent_forced();  // -1 when not forced, else 0 or 1; throws on a malformed value
int decode_blocks_per_sm_forced();  // 0 when not forced, else >= 1; throws on a malformed value

}  // namespace flashcore
