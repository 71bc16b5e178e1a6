// Registry of compiled kernels. Each instantiation file (instantiations/*.cu) registers its launcher at load
// time, so a build that compiles a subset of head dims/dtypes (FLASHCORE_HEADDIMS, FLASHCORE_DTYPES) still links,
// and the dispatcher can say precisely what is missing.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "../params.h"

namespace flashcore::cuda {

enum class DType { kFp16, kBf16 };

using FwdLaunchFn = void (*)(const FwdParams&, cudaStream_t);
// dsum: (batch * heads_q * seqlen_q) fp32 rowsum(dO * O) from the pre-pass; dq_accum: (batch * heads_q,
// seqlen_q rounded up to block_m, or wide_block_m for launch_wide, head_dim_tile or head_dim:
// BwdKernelEntry::dq_accum) fp32, zeroed, receives dQ (times the softmax scale unless
// BwdKernelEntry::dq_accum.unscaled); padded so that every query block's dQ tile is whole.
using BwdLaunchFn = void (*)(const BwdParams&, const float* dsum, float* dq_accum, cudaStream_t);

struct FwdKernelEntry {
  const char* family;  // "sm80" (mma.sync, sm_80..sm_90), "sm90" (wgmma, sm_90a)
  int head_dim_tile;   // head dims up to this are padded to it
  DType dtype;
  bool score_mod;      // the score-mod variant (softcap, ALiBi, non-positive scale; score_mod.h)
  FwdLaunchFn launch;
  // The variable-length launcher (seqlen.h), or nullptr: the sm80 score-mod entries and the sm90 entries carry it.
  FwdLaunchFn launch_varlen = nullptr;
};

// What a backward kernel leaves in dq_accum.
struct DqAccumLayout {
  bool cols_exact;  // head_dim columns (the kernel's TMA reductions drop columns past it), else head_dim_tile
  bool unscaled;    // dS K without the softmax scale: the post-pass that writes grad_query multiplies by it
  // > 0: tiles of fragment_rows query rows x 128 columns, each in the Hopper 80-row kernel's fragment order
  // (common/dq_fragment_order.cuh), which the post-pass un-permutes; 0: rows of columns.
  int fragment_rows = 0;
};

struct BwdKernelEntry {
  const char* family;
  int head_dim_tile;
  DType dtype;
  bool score_mod;
  int smem_bytes;  // dynamic shared memory a block needs: the dispatcher checks it against the device's limit
  int block_m;     // query rows per tile: dq_accum's row padding
  BwdLaunchFn launch;
  DqAccumLayout dq_accum = {false, false};
  // The variable-length launcher: dsum (heads_q, total_q), dq_accum (heads_q, total_q, dq columns as above), zeroed.
  BwdLaunchFn launch_varlen = nullptr;
  // Keys of a block, the same in the dense and varlen kernels, where fixed (sm90), or 0: the varlen grid can then be
  // packed (VarlenParams::tile_end), and the dense kernel counts its dQ tiles down (BwdParams::dq_tiles_pending).
  int block_n = 0;
  // Kernels with wide_block_m query rows a step, taken instead of launch / launch_varlen where present (dense:
  // dq_accum's rows are padded to wide_block_m then), or nullptr: sm90 head-dim tiles 96 and 128 have 80-row steps.
  BwdLaunchFn launch_wide = nullptr;
  BwdLaunchFn launch_varlen_wide = nullptr;
  int wide_block_m = 0;
  DqAccumLayout wide_dq_accum = {false, false};  // what launch_wide leaves in dq_accum (launch_varlen_wide: dq_accum)
};

// Return true so that they can initialize a namespace-scope constant in an instantiation file.
bool register_fwd_kernel(const FwdKernelEntry& entry);
bool register_bwd_kernel(const BwdKernelEntry& entry);

// The entry of `family` (and variant) with the smallest head-dim tile >= head_dim for dtype, or nullptr.
const FwdKernelEntry* find_fwd_kernel(const char* family, int head_dim, DType dtype, bool score_mod);
const BwdKernelEntry* find_bwd_kernel(const char* family, int head_dim, DType dtype, bool score_mod);

// "32, 64, 128" style list of the forward tiles compiled for family/dtype, for error messages.
std::string compiled_head_dim_tiles(const char* family, DType dtype);

}  // namespace flashcore::cuda
