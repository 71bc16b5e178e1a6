// Host-side launch of the Hopper (wgmma + TMA) backward kernel, included by the sm90 instantiation files only.
// The dispatcher (attention_cuda.cpp) sends only TMA-compatible tensors here (tma_desc.h).
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <type_traits>

#include "../../params.h"
#include "../../switches.h"
#include "../kernel_registry.h"
#include "../launch_utils.cuh"
#include "bwd_sm90_kernel.cuh"
#include "tma_desc.h"

namespace flashcore::sm90 {

// dq_accum has exactly head_dim columns: the TMA reductions drop the tile's columns past it (a padded head dim,
// e.g. 96 in the 128 tile, so the accumulator is no larger than the mma.sync family's). dQ is summed without the
// softmax scale, which the post-pass applies once (a multiply a value and step fewer in the consumers).
constexpr cuda::DqAccumLayout kBwdDqAccum = {/*cols_exact=*/true, /*unscaled=*/true};

// The entry's shared memory (BwdKernelEntry::smem_bytes, checked against the device's limit): the most any of its
// kernels takes (dense and varlen, 64-row and wide-step).
// Whether an entry has wide-step kernels (BwdSm90Traits::kWideSteps): the plain and score-mod variants of a head
// dim with BwdSm90Config::kWideBlockM.
template <int kHeadDim>
constexpr bool has_wide_steps() {
  return BwdSm90Config<kHeadDim>::kWideBlockM > 0;
}

template <int kHeadDim, typename Element, bool kScoreMod>
constexpr int bwd_smem_bytes() {
  constexpr int kDense = BwdSm90Traits<kHeadDim, Element, kScoreMod>::kSmemBytes;
  constexpr int kVarlen = BwdSm90Traits<kHeadDim, Element, kScoreMod, true>::kSmemBytes;
  constexpr int kNarrow = kDense > kVarlen ? kDense : kVarlen;
  if constexpr (has_wide_steps<kHeadDim>()) {
    constexpr int kWide = BwdSm90Traits<kHeadDim, Element, kScoreMod, true, true>::kSmemBytes;  // varlen: the larger
    return kWide > kNarrow ? kWide : kNarrow;
  } else {
    return kNarrow;
  }
}

template <int kHeadDim, typename Element, bool kScoreMod>
constexpr int bwd_block_m() {
  return BwdSm90Traits<kHeadDim, Element, kScoreMod>::kBlockM;
}

// Keys of a block (BwdKernelEntry::block_n: the packed varlen grid's tile and the dense dQ countdowns' key blocks).
template <int kHeadDim, typename Element, bool kScoreMod>
constexpr int bwd_block_n() {
  constexpr int kBlockN = BwdSm90Traits<kHeadDim, Element, kScoreMod>::kBlockN;
  static_assert(kBlockN == BwdSm90Traits<kHeadDim, Element, kScoreMod, /*kVarlen=*/true>::kBlockN);
  if constexpr (has_wide_steps<kHeadDim>())
    static_assert(kBlockN == BwdSm90Traits<kHeadDim, Element, kScoreMod, false, true>::kBlockN);
  return kBlockN;
}

// The dK/dV tensor maps of the TMA epilogue (write_dk_dv_tma): 64-key boxes over (batch, heads_kv, rows, dim), rows
// = seqlen_k (dense) or total_k (varlen, batch 1). Used where TMA can describe grad_key and grad_value (they take the
// inputs' strides) and the switch allows; the split-head-dim consumers store directly. Otherwise tma is false and the
// maps are placeholders (tm_k, tm_v) the kernel never reads.
struct DkDvMaps {
  bool tma;
  CUtensorMap dk, dv;
};

template <typename Traits>
DkDvMaps dk_dv_maps(const BwdParams& p, int64_t batch, int64_t rows, const CUtensorMap& tm_k,
                    const CUtensorMap& tm_v, bool bf16) {
  const bool tma = !Traits::kSplitHeadDim && bwd_tma_epilogue_enabled() &&
                   tma_compatible(p.dk, p.dk_stride, batch, p.heads_kv, rows) &&
                   tma_compatible(p.dv, p.dv_stride, batch, p.heads_kv, rows);
  if (!tma) return {false, tm_k, tm_v};
  return {true, make_tensor_map_bhsd(p.dk, p.dk_stride, batch, p.heads_kv, rows, p.head_dim, 64, bf16),
          make_tensor_map_bhsd(p.dv, p.dv_stride, batch, p.heads_kv, rows, p.head_dim, 64, bf16)};
}

// kWideSteps: the 80-row kernel (BwdSm90Traits::kWideSteps).
template <int kHeadDim, typename Element, bool kScoreMod, bool kWideSteps = false>
void launch_bwd(const BwdParams& p, const float* dsum, float* dq_accum, cudaStream_t stream) {
  using Traits = BwdSm90Traits<kHeadDim, Element, kScoreMod, /*kVarlen=*/false, kWideSteps>;
  auto kernel = &bwd_sm90_kernel<Traits>;
  constexpr int kSmem = Traits::kSmemBytes;
  static std::atomic<uint64_t> configured_devices{0};
  cuda::set_max_dynamic_smem_once(kernel, kSmem, configured_devices);

  constexpr bool kBf16 = std::is_same_v<Element, __nv_bfloat16>;
  const CUtensorMap tm_q = make_tensor_map_bhsd(p.q, p.q_stride, p.batch, p.heads_q, p.seqlen_q, p.head_dim,
                                                Traits::kBlockM, kBf16);
  const CUtensorMap tm_do = make_tensor_map_bhsd(p.dout, p.dout_stride, p.batch, p.heads_q, p.seqlen_q,
                                                 p.head_dim, Traits::kBlockM, kBf16);
  const CUtensorMap tm_k = make_tensor_map_bhsd(p.k, p.k_stride, p.batch, p.heads_kv, p.seqlen_k, p.head_dim,
                                                Traits::kBlockN, kBf16);
  const CUtensorMap tm_v = make_tensor_map_bhsd(p.v, p.v_stride, p.batch, p.heads_kv, p.seqlen_k, p.head_dim,
                                                Traits::kBlockN, kBf16);

  const int64_t dq_rows = (p.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM * Traits::kBlockM;
  static_assert(!Traits::kDqRowsInterleaved || (Traits::kBlockM % 8 == 0 && Traits::kDqBoxRows % 8 == 0));
  // Fragment order: the dQ writer adds to dq_accum by address; the map is a placeholder it never reads.
  const CUtensorMap tm_dq =
      Traits::kDqFragmentOrder ? tm_q
      : Traits::kDqRowsInterleaved
          ? make_tensor_map_f32_rows_interleaved(dq_accum, p.batch * p.heads_q * dq_rows, p.head_dim,
                                                 Traits::kDqBoxCols, Traits::kDqBoxRows)
          : make_tensor_map_f32_2d(dq_accum, p.batch * p.heads_q * dq_rows, p.head_dim, Traits::kDqBoxCols,
                                   Traits::kDqBoxRows);
  const DkDvMaps dkdv = dk_dv_maps<Traits>(p, p.batch, p.seqlen_k, tm_k, tm_v, kBf16);
  const int num_n_blocks = (int)((p.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN);
  const int64_t grid = (int64_t)num_n_blocks * p.batch * p.heads_kv;  // the dispatcher checked grid <= INT32_MAX
  // A plain launch, never a programmatic dependent one: the kernel triggers the dQ post-pass at its start, which must
  // come after the pre-pass has set the countdowns (BwdParams::dq_tiles_pending) and zeroed dq_accum.
  kernel<<<dim3((unsigned)grid), dim3(Traits::kNThreads), kSmem, stream>>>(
      p, tm_q, tm_k, tm_v, tm_do, tm_dq, dkdv.dk, dkdv.dv, dsum, dq_accum, num_n_blocks, dkdv.tma);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The entry's query rows a step of its wide-step kernels (BwdKernelEntry::wide_block_m), or 0 where it has none.
template <int kHeadDim, typename Element, bool kScoreMod>
constexpr int bwd_wide_block_m() {
  if constexpr (has_wide_steps<kHeadDim>()) {
    // The host pads dq_accum to this; the launcher and the dQ writer walk it by the kernel's own kBlockM.
    static_assert(BwdSm90Traits<kHeadDim, Element, kScoreMod, false, true>::kBlockM ==
                  BwdSm90Config<kHeadDim>::kWideBlockM);
    return BwdSm90Config<kHeadDim>::kWideBlockM;
  } else {
    return 0;
  }
}

// A variable-length batch (seqlen.h): the plain or score-mod variant built for varlen, one block per (key block of
// max_seqlen_k = p.seqlen_k, sequence slot, kv head). The descriptors cover the packed tensors as one
// (1, heads, total, dim) entry each (the dispatcher checks that TMA can describe them); dq_accum is
// (heads_q, total_q, head_dim) fp32, zeroed, addressed as heads_q * total_q rows (< 2^31: the dispatcher checks).
template <int kHeadDim, typename Element, bool kScoreMod, bool kWideSteps = false>
void launch_bwd_varlen(const BwdParams& p, const float* dsum, float* dq_accum, cudaStream_t stream) {
  using Traits = BwdSm90Traits<kHeadDim, Element, kScoreMod, /*kVarlen=*/true, kWideSteps>;
  auto kernel = &bwd_sm90_kernel<Traits>;
  constexpr int kSmem = Traits::kSmemBytes;
  static std::atomic<uint64_t> configured_devices{0};
  cuda::set_max_dynamic_smem_once(kernel, kSmem, configured_devices);

  constexpr bool kBf16 = std::is_same_v<Element, __nv_bfloat16>;
  const int64_t total_q = p.varlen.total_q, total_k = p.varlen.total_k;
  const CUtensorMap tm_q =
      make_tensor_map_bhsd(p.q, p.q_stride, 1, p.heads_q, total_q, p.head_dim, Traits::kBlockM, kBf16);
  const CUtensorMap tm_do =
      make_tensor_map_bhsd(p.dout, p.dout_stride, 1, p.heads_q, total_q, p.head_dim, Traits::kBlockM, kBf16);
  const CUtensorMap tm_k =
      make_tensor_map_bhsd(p.k, p.k_stride, 1, p.heads_kv, total_k, p.head_dim, Traits::kBlockN, kBf16);
  const CUtensorMap tm_v =
      make_tensor_map_bhsd(p.v, p.v_stride, 1, p.heads_kv, total_k, p.head_dim, Traits::kBlockN, kBf16);
  const CUtensorMap tm_dq = make_tensor_map_f32_2d(dq_accum, p.heads_q * total_q, p.head_dim, Traits::kDqBoxCols,
                                                   Traits::kDqBoxRows);
  const int num_n_blocks = (int)((p.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN);
  // A packed grid (VarlenParams::tile_end, built for kBlockN) or max_seqlen_k's key blocks for every sequence; no
  // larger than the latter, which the dispatcher checked against INT32_MAX.
  const int64_t grid = p.varlen.tile_end != nullptr ? p.varlen.grid_tiles * p.heads_kv
                                                    : (int64_t)num_n_blocks * p.batch * p.heads_kv;
  // dK and dV through TMA for the warpgroups whose 64 keys are all their sequence's (write_dk_dv_tma).
  const DkDvMaps dkdv = dk_dv_maps<Traits>(p, 1, total_k, tm_k, tm_v, kBf16);
  kernel<<<dim3((unsigned)grid), dim3(Traits::kNThreads), kSmem, stream>>>(
      p, tm_q, tm_k, tm_v, tm_do, tm_dq, dkdv.dk, dkdv.dv, dsum, dq_accum, num_n_blocks, dkdv.tma);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// What the entry's dense wide-step kernel leaves in dq_accum (BwdKernelEntry::wide_dq_accum): kTileCols columns
// in tiles of its kBlockM rows, each in the kernel's fragment order (common/dq_fragment_order.cuh); head dim 96's
// (no fragment order, BwdSm90Traits::kDqFragmentOrder) rows of exactly head_dim columns, as the other kernels'.
template <int kHeadDim, typename Element, bool kScoreMod>
constexpr cuda::DqAccumLayout bwd_wide_dq_accum() {
  if constexpr (has_wide_steps<kHeadDim>()) {  // the traits exist only for head dims with wide steps
    using Traits = BwdSm90Traits<kHeadDim, Element, kScoreMod, false, true>;
    if constexpr (Traits::kDqFragmentOrder)
      return {/*cols_exact=*/false, /*unscaled=*/true, /*fragment_rows=*/Traits::kBlockM};
  }
  return kBwdDqAccum;
}

// The entry's wide-step launcher, dense (BwdKernelEntry::launch_wide) or varlen (launch_varlen_wide), or nullptr.
template <int kHeadDim, typename Element, bool kScoreMod, bool kVarlen>
constexpr cuda::BwdLaunchFn bwd_wide_launcher() {
  if constexpr (!has_wide_steps<kHeadDim>())
    return nullptr;
  else if constexpr (kVarlen)
    return &launch_bwd_varlen<kHeadDim, Element, kScoreMod, true>;
  else
    return &launch_bwd<kHeadDim, Element, kScoreMod, true>;
}

}  // namespace flashcore::sm90
