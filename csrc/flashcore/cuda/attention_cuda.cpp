// CUDA dispatch-key implementations of the flashcore ops: shared validation (attention_host.h), the CUDA rules
// (fp16/bf16, head dims multiple of 8 up to 256, compute capability 8.0+), kernel selection, launch on the
// current stream. No allocation beyond the outputs, the backward's fp32 workspaces (dQ accumulator, row sums) and a
// copy of an input only when its alignment forbids 16-byte loads, all from the caching allocator, so the ops can be
// captured in CUDA graphs.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstring>
#include <limits>
#include <string>

#include "../attention_host.h"
#include "../kernel_trace.h"
#include "../switches.h"
#include "bwd_composite_cuda.h"
#include "bwd_dq_convert.cuh"
#include "bwd_preprocess.cuh"
#include "decode/decode.h"
#include "kernel_registry.h"
#include "sm90/fwd_sm90_pack_gqa.h"
#include "sm90/tma_desc.h"
#include "varlen_rows.cuh"

namespace flashcore {
namespace {

constexpr BackendLimits kCudaLimits{"CUDA", /*allow_fp32_fp64=*/false, /*max_head_dim=*/256,
                                    /*head_dim_multiple=*/8};
// Smallest query block of any forward kernel (sm80 hdim 256): bounds the grid (one block per query block and head).
constexpr int64_t kMinBlockM = 64;

cuda::DType to_dtype(at::ScalarType t) { return t == at::kHalf ? cuda::DType::kFp16 : cuda::DType::kBf16; }

// The kernels read rows with 16-byte loads: the base pointer and every row/head/batch stride must be 16-byte
// aligned. Any tensor the validation accepts (last dim contiguous, head_dim a multiple of 8) becomes aligned
// once copied into fresh (allocator-aligned) storage; most callers' tensors already are, and are used in place.
// Not .contiguous(): a contiguous view at an odd storage offset would come back unchanged, still misaligned.
bool is_16b_aligned(const at::Tensor& t) {
  const int64_t elems = 16 / t.element_size();
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && t.stride(0) % elems == 0 &&
         t.stride(1) % elems == 0 && t.stride(2) % elems == 0;
}

at::Tensor aligned_for_16b_loads(const at::Tensor& t) {
  return is_16b_aligned(t) ? t : t.clone(at::MemoryFormat::Contiguous);
}

// TMA (the sm90 family's loads) needs positive 16-byte-multiple strides; a tensor that aligned_for_16b_loads
// would copy is a fresh contiguous tensor afterwards, hence compatible.
bool tma_ready(const at::Tensor& t) {
  if (!is_16b_aligned(t)) return true;
  const Strides s{t.stride(0), t.stride(1), t.stride(2)};
  return sm90::tma_compatible(t.data_ptr(), s, t.size(0), t.size(1), t.size(2));
}

bool is_hopper(const cudaDeviceProp& prop) { return prop.major == 9 && prop.minor == 0; }

const cudaDeviceProp& device_properties(const at::Tensor& t) {
  const cudaDeviceProp& prop = *at::cuda::getDeviceProperties(t.device().index());
  TORCH_CHECK(prop.major >= 8, "flashcore: the CUDA kernels need compute capability 8.0 or newer; ", prop.name,
              " is ", prop.major, ".", prop.minor);
  return prop;
}

void check_sizes(const at::Tensor& query, const at::Tensor& key) {
  constexpr int64_t kIntMax = std::numeric_limits<int32_t>::max();
  TORCH_CHECK(query.size(2) <= kIntMax, "flashcore: query sequence length ", query.size(2), " exceeds 2^31 - 1");
  TORCH_CHECK(key.size(2) <= kIntMax, "flashcore: key sequence length ", key.size(2), " exceeds 2^31 - 1");
  const int64_t m_blocks = (query.size(2) + kMinBlockM - 1) / kMinBlockM;
  TORCH_CHECK(m_blocks * query.size(0) * query.size(1) <= kIntMax, "flashcore: batch x heads x query blocks (",
              query.size(0), " x ", query.size(1), " x ", m_blocks, ") exceeds the CUDA grid limit");
}

// The forward kernel for these inputs: the wgmma family (sm90) on compute capability 9.0 for the head dims it
// was compiled for and tensors TMA can describe; the mma.sync family (sm80) everywhere else (also when sm90 is
// forced but the layout rules it out, e.g. a zero-stride expanded key). FLASHCORE_FORCE_KERNEL=sm80|sm90 forces a
// family (switches.h).
// score_mod: the call transforms its scores (transforms_scores), so it needs a score-mod variant.
const cuda::FwdKernelEntry& select_fwd_kernel(const at::Tensor& query, const at::Tensor& key,
                                              const at::Tensor& value, const cudaDeviceProp& prop, bool score_mod) {
  const auto dtype = to_dtype(query.scalar_type());
  const int head_dim = (int)query.size(3);
  const std::string forced = forced_fwd_family();
  TORCH_CHECK(forced.empty() || forced == "sm80" || forced == "sm90", "flashcore: FLASHCORE_FORCE_KERNEL=", forced,
              " is not a forward kernel family (sm80, sm90)");
  const cuda::FwdKernelEntry* sm90 =
      forced == "sm80" ? nullptr : cuda::find_fwd_kernel("sm90", head_dim, dtype, score_mod);
  if (forced == "sm90") {
    TORCH_CHECK(is_hopper(prop), "flashcore: FLASHCORE_FORCE_KERNEL=sm90 needs a compute capability 9.0 GPU; ",
                prop.name, " is ", prop.major, ".", prop.minor);
    TORCH_CHECK(sm90 != nullptr, "flashcore: FLASHCORE_FORCE_KERNEL=sm90 but this build has no sm90 kernel for "
                "head_dim ", head_dim, " and dtype ", c10::toString(query.scalar_type()), " (build with "
                "FLASHCORE_CUDA_ARCHS including 90a)");
  }
  if (sm90 != nullptr && is_hopper(prop) && tma_ready(query) && tma_ready(key) && tma_ready(value)) return *sm90;
  const cuda::FwdKernelEntry* sm80 = cuda::find_fwd_kernel("sm80", head_dim, dtype, score_mod);
  TORCH_CHECK(sm80 != nullptr, "flashcore: this build has no forward kernel for head_dim ", head_dim, " and dtype ",
              c10::toString(query.scalar_type()), " (compiled head-dim tiles: ",
              cuda::compiled_head_dim_tiles("sm80", dtype), "); rebuild with FLASHCORE_HEADDIMS/FLASHCORE_DTYPES "
              "including it");
  return *sm80;
}

bool dense_on_packed_varlen(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            const cudaDeviceProp& prop, double softmax_scale, bool is_causal, bool causal_bottom_right,
                            int64_t window_left, int64_t window_right, double softcap,
                            const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& alibi_slopes,
                            bool score_mod, at::Tensor& out, at::Tensor& lse);

bool dense_decode_step(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                       const AttentionOptions& opts, const cudaDeviceProp& prop, bool after_packed_route,
                       at::Tensor& out, at::Tensor& lse);

std::tuple<at::Tensor, at::Tensor> fwd_cuda(const at::Tensor& query_in, const at::Tensor& key_in,
                                            const at::Tensor& value_in, double softmax_scale, bool is_causal,
                                            bool causal_bottom_right, int64_t window_left, int64_t window_right,
                                            double softcap, bool /*deterministic: only the backward's*/,
                                            const std::optional<at::Tensor>& sinks,
                                            const std::optional<at::Tensor>& alibi_slopes) {
  const AttentionOptions opts = make_options(softmax_scale, is_causal, causal_bottom_right, window_left,
                                             window_right, softcap, sinks, alibi_slopes);
  check_fwd_inputs(query_in, key_in, value_in, opts, kCudaLimits);
  const c10::cuda::CUDAGuard guard(query_in.device());
  const cudaDeviceProp& prop = device_properties(query_in);
  check_sizes(query_in, key_in);

  auto [out, lse] = alloc_fwd_outputs(query_in);
  const at::Tensor query = aligned_for_16b_loads(query_in);
  const at::Tensor key = aligned_for_16b_loads(key_in);
  const at::Tensor value = aligned_for_16b_loads(value_in);
  const FwdParams p = make_fwd_params(query, key, value, out, lse, opts);
  if (fwd_is_trivial(p, out, lse, opts)) return {out, lse};
  // One query a head, or a few under GQA: the KV-cache kernel where it beats the packed varlen kernel outright,
  // else the packed varlen kernel, else the KV-cache kernel for what the packed route declined (a grid too small for
  // it, or layouts it cannot read).
  if (dense_decode_step(query, key, value, opts, prop, /*after_packed_route=*/false, out, lse)) return {out, lse};
  if (dense_on_packed_varlen(query, key, value, prop, softmax_scale, is_causal, causal_bottom_right, window_left,
                             window_right, softcap, sinks, alibi_slopes, transforms_scores(opts), out, lse))
    return {out, lse};
  if (dense_decode_step(query, key, value, opts, prop, /*after_packed_route=*/true, out, lse)) return {out, lse};

  const cuda::FwdKernelEntry& kernel = select_fwd_kernel(query, key, value, prop, transforms_scores(opts));
  record_kernel(Pass::kFwd, KernelTrace{kernel.family, kernel.head_dim_tile, 0, 1, false, kernel.score_mod});
  kernel.launch(p, at::cuda::getCurrentCUDAStream());  // the sm90 launcher refines the record
  return {out, lse};
}

std::string fwd_kernel_name_cuda(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                 bool is_causal) {
  const AttentionOptions opts = make_options(1.0, is_causal, false, -1, -1, 0.0, std::nullopt, std::nullopt);
  check_fwd_inputs(query, key, value, opts, kCudaLimits);
  const c10::cuda::CUDAGuard guard(query.device());
  return select_fwd_kernel(query, key, value, device_properties(query), false).family;
}

// The fused backward runs when its head-dim tile was compiled, the device grants its shared memory (sm_86/sm_89
// do not, above head dim 96) and its grids fit: the wgmma family (sm90) on compute capability 9.0 for tensors TMA
// can describe, the mma.sync family (sm80) otherwise. Deterministic gradients run on the same kernels, their dQ
// additions ordered by key block (BwdParams::dq_turns). FLASHCORE_FORCE_BWD=composite|sm80|sm90 forces a path
// (switches.h); a forced sm90 still yields to sm80 where TMA rules the layout out, as the forward does.
// nullptr: the composite backward.
const cuda::BwdKernelEntry* select_bwd_kernel(const at::Tensor& grad_out, const at::Tensor& query,
                                              const at::Tensor& key, const at::Tensor& value, bool deterministic,
                                              const cudaDeviceProp& prop, bool score_mod) {
  const std::string forced = forced_bwd_path();
  TORCH_CHECK(forced.empty() || forced == "composite" || forced == "sm80" || forced == "sm90",
              "flashcore: FLASHCORE_FORCE_BWD=", forced, " is not a backward path (composite, sm80, sm90)");
  if (forced == "composite") return nullptr;
  const auto dtype = to_dtype(query.scalar_type());
  const int head_dim = (int)query.size(3);
  const cuda::BwdKernelEntry* sm90 = cuda::find_bwd_kernel("sm90", head_dim, dtype, score_mod);
  if (forced == "sm90") {
    TORCH_CHECK(is_hopper(prop), "flashcore: FLASHCORE_FORCE_BWD=sm90 needs a compute capability 9.0 GPU; ",
                prop.name, " is ", prop.major, ".", prop.minor);
    TORCH_CHECK(sm90 != nullptr, "flashcore: FLASHCORE_FORCE_BWD=sm90 but this build has no sm90 backward kernel "
                "for head_dim ", head_dim, " and dtype ", c10::toString(query.scalar_type()));
  }
  const bool tma = tma_ready(query) && tma_ready(key) && tma_ready(value) && tma_ready(grad_out);
  const cuda::BwdKernelEntry* entry = forced != "sm80" && is_hopper(prop) && sm90 != nullptr && tma
                                          ? sm90
                                          : cuda::find_bwd_kernel("sm80", head_dim, dtype, score_mod);
  if (entry == nullptr) return nullptr;
  if ((int64_t)prop.sharedMemPerBlockOptin < entry->smem_bytes) return nullptr;
  constexpr int64_t kIntMax = std::numeric_limits<int32_t>::max();
  const int64_t rows = query.size(0) * query.size(1) * query.size(2);
  const int64_t key_blocks = (key.size(2) + 63) / 64;  // 64: the smallest kBlockN, so an upper bound
  if (rows / 8 + 1 > kIntMax || key_blocks * key.size(0) * key.size(1) > kIntMax) return nullptr;
  return entry;
}

// dq_accum (B, H, rows, 128) in tiles of fragment_rows rows in fragment order (common/dq_fragment_order.cuh) as a
// (B, H, rows, 128) tensor of rows: the tile's float offset wg 64F + warp 16F + ni 128 + (4 g + t) 4 + 2 h + e
// holds query 8 ni + 2 t + e, column 64 wg + 16 warp + 8 h + g (F = fragment_rows).
at::Tensor dq_accum_as_rows(const at::Tensor& dq_accum, int fragment_rows) {
  const int64_t B = dq_accum.size(0), H = dq_accum.size(1), rows = dq_accum.size(2);
  TORCH_INTERNAL_ASSERT(dq_accum.size(3) == cuda::kDqFragmentCols && rows % fragment_rows == 0);
  return dq_accum.view({B, H, rows / fragment_rows, 2, 4, fragment_rows / 8, 8, 4, 2, 2})
      .permute({0, 1, 2, 5, 7, 9, 3, 4, 8, 6})
      .reshape({B, H, rows, cuda::kDqFragmentCols});
}

// grad_query = scale * the fp32 dQ accumulator, rounded once. dq_accum: (B, H, rows_per_head, cols) fp32,
// contiguous, rows of columns or (fragment_rows > 0) tiles in fragment order; grad_query4: grad_query viewed as
// (B, H, S, D) (a view, so both paths write grad_query's storage). The post-pass kernel (bwd_dq_convert.cuh) takes
// every grad_query empty_like makes here (the ops require a unit-stride head dim, a multiple of 8 on the fused
// paths); ATen covers what its grid does not. tiles_pending (BwdParams::dq_tiles_pending, tiles of tile_rows rows):
// the post-pass kernel converts each tile as soon as the fused kernel, launched just before, counts it down.
void write_grad_query(const at::Tensor& dq_accum, const at::Tensor& grad_query4, double scale,
                      int fragment_rows = 0, const int* tiles_pending = nullptr, int tile_rows = 0) {
  cuda::DqConvertArgs a{};
  a.accum = dq_accum.data_ptr<float>();
  a.batch = grad_query4.size(0);
  a.heads = grad_query4.size(1);
  a.seqlen = grad_query4.size(2);
  a.rows_per_head = dq_accum.size(2);
  a.cols = dq_accum.size(3);
  a.out = grad_query4.data_ptr();
  a.out_batch = grad_query4.stride(0);
  a.out_head = grad_query4.stride(1);
  a.out_seq = grad_query4.stride(2);
  a.head_dim = (int)grad_query4.size(3);
  a.scale = (float)scale;
  a.bf16 = grad_query4.scalar_type() == at::kBFloat16;
  a.fragment_rows = fragment_rows;
  a.tiles_pending = tiles_pending;
  a.tile_rows = tile_rows;
  if (grad_query4.stride(3) == 1 && cuda::dq_convert_supported(a) && dq_convert_kernel_enabled()) {
    cuda::launch_bwd_dq_convert(a, at::cuda::getCurrentCUDAStream());
  } else {
    const at::Tensor rows = fragment_rows > 0 ? dq_accum_as_rows(dq_accum, fragment_rows) : dq_accum;
    at::Tensor out = grad_query4;
    at::mul_out(out, rows.narrow(2, 0, a.seqlen).narrow(3, 0, a.head_dim), c10::scalar_to_tensor(scale));
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_cuda(const at::Tensor& grad_out_in, const at::Tensor& query_in,
                                                        const at::Tensor& key_in, const at::Tensor& value_in,
                                                        const at::Tensor& out_in, const at::Tensor& lse,
                                                        double softmax_scale, bool is_causal,
                                                        bool causal_bottom_right, int64_t window_left,
                                                        int64_t window_right, double softcap, bool deterministic,
                                                        const std::optional<at::Tensor>& alibi_slopes) {
  const AttentionOptions opts = make_options(softmax_scale, is_causal, causal_bottom_right, window_left,
                                             window_right, softcap, std::nullopt, alibi_slopes);
  check_bwd_inputs(grad_out_in, query_in, key_in, value_in, out_in, lse, opts, kCudaLimits);
  const c10::cuda::CUDAGuard guard(query_in.device());
  const cudaDeviceProp& prop = device_properties(query_in);
  auto [grad_query, grad_key, grad_value] = alloc_bwd_outputs(query_in, key_in, value_in);
  if (bwd_is_trivial(query_in, key_in, grad_query, grad_key, grad_value)) return {grad_query, grad_key, grad_value};

  const cuda::BwdKernelEntry* kernel =
      select_bwd_kernel(grad_out_in, query_in, key_in, value_in, deterministic, prop, transforms_scores(opts));
  if (kernel == nullptr) {
    const BwdParams p = make_bwd_params(grad_out_in, query_in, key_in, value_in, out_in, lse, grad_query, grad_key,
                                        grad_value, opts, deterministic);
    record_kernel(Pass::kBwd, KernelTrace{"composite"});
    cuda::bwd_composite(grad_out_in, query_in, key_in, value_in, out_in, lse, p, grad_query, grad_key, grad_value);
    return {grad_query, grad_key, grad_value};
  }
  // grad_key/grad_value are fresh (empty_like), hence 16-byte aligned; the inputs may need a copy.
  const at::Tensor q = aligned_for_16b_loads(query_in), k = aligned_for_16b_loads(key_in);
  const at::Tensor v = aligned_for_16b_loads(value_in), o = aligned_for_16b_loads(out_in);
  const at::Tensor dout = aligned_for_16b_loads(grad_out_in);
  // The fused kernel sums dQ in dq_accum (fp32) and never touches grad_query: release it until the end, so that
  // grad_query is not allocated together with dsum (peak memory at or below SDPA's; docs/PERFORMANCE.md).
  grad_query = at::Tensor();
  BwdParams p = make_bwd_params(dout, q, k, v, o, lse, grad_query, grad_key, grad_value, opts, deterministic);
  const auto f32 = q.options().dtype(at::kFloat);
  at::Tensor dsum = at::empty({q.size(0), q.size(1), q.size(2)}, f32);
  // The entry's wide-step kernel where it has one (its own row padding).
  const bool wide = kernel->launch_wide != nullptr && bwd_wide_steps_enabled();
  const int block_m = wide ? kernel->wide_block_m : kernel->block_m;
  const cuda::DqAccumLayout& layout = wide ? kernel->wide_dq_accum : kernel->dq_accum;
  const int64_t rows = (q.size(2) + block_m - 1) / block_m * block_m;
  const int64_t dq_cols = layout.fragment_rows > 0 ? cuda::kDqFragmentCols
                          : layout.cols_exact     ? q.size(3)
                                                  : kernel->head_dim_tile;
  at::Tensor dq_accum = at::empty({q.size(0), q.size(1), rows, dq_cols}, f32);
  poison_if_enabled({dsum, dq_accum});  // the pre-pass must write both whole
  at::Tensor dq_turns;  // deterministic: a flag a (batch, head, query tile), zeroed (BwdParams::dq_turns)
  if (deterministic) {
    dq_turns = at::zeros({q.size(0), q.size(1), rows / block_m}, q.options().dtype(at::kInt));
    p.dq_turns = dq_turns.data_ptr<int>();
  }
  // The sm90 kernel counts its dQ tiles down (the pre-pass sets them), so that the post-pass kernel, launched
  // behind it with programmatic dependent launch, can convert them during its last wave. grad_query is then written
  // while the kernel runs: it is allocated before, and nothing is allocated between the two launches (peak memory:
  // grad_query beside dsum, one fp32 value a query row).
  const bool overlap = std::strcmp(kernel->family, "sm90") == 0 && kernel->block_n > 0 && bwd_dq_overlap_enabled() &&
                       pdl_allowed() && dq_convert_kernel_enabled();
  at::Tensor tiles_pending;
  if (overlap) {
    tiles_pending = at::empty({q.size(0), q.size(1), rows / block_m}, q.options().dtype(at::kInt));
    if (poison_outputs()) tiles_pending.fill_(1 << 30);  // a count the pre-pass leaves unset never reaches zero
    p.dq_tiles_pending = tiles_pending.data_ptr<int>();
    grad_query = at::empty_like(query_in);
    poison_if_enabled({grad_query});
  }
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  // One pass computes dsum and zeroes dq_accum, instead of a separate fill kernel (~80 us of a 12 ms backward at
  // 4x16x8192x128; measured within noise of the two-kernel version, one launch fewer).
  cuda::launch_bwd_prepass(p, q.scalar_type() == at::kBFloat16, dsum.data_ptr<float>(), dq_accum.data_ptr<float>(),
                           rows, (int)dq_cols, cuda::DqTileShape{block_m, kernel->block_n}, stream);
  KernelTrace trace{kernel->family, kernel->head_dim_tile, 0, 1, false, kernel->score_mod};
  trace.wide_block_m = wide ? block_m : 0;
  trace.deterministic = deterministic;
  trace.dq_overlap = overlap;
  record_kernel(Pass::kBwd, trace);
  (wide ? kernel->launch_wide : kernel->launch)(p, dsum.data_ptr<float>(), dq_accum.data_ptr<float>(), stream);
  dsum = at::Tensor();
  if (!overlap) {
    grad_query = at::empty_like(query_in);
    poison_if_enabled({grad_query});
  }
  write_grad_query(dq_accum, grad_query, layout.unscaled ? p.scale : 1.0, layout.fragment_rows, p.dq_tiles_pending,
                   block_m);
  return {grad_query, grad_key, grad_value};
}

std::string bwd_kernel_name_cuda(const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
                                 const at::Tensor& value, bool deterministic) {
  const AttentionOptions opts = make_options(1.0, false, false, -1, -1, 0.0, std::nullopt, std::nullopt);
  check_fwd_inputs(query, key, value, opts, kCudaLimits);
  const c10::cuda::CUDAGuard guard(query.device());
  const cuda::BwdKernelEntry* kernel =
      select_bwd_kernel(grad_out, query, key, value, deterministic, device_properties(query), false);
  return kernel == nullptr ? "composite" : kernel->family;
}

// ---- Variable-length batches (seqlen.h) ----

// A packed (total, heads, dim) tensor is ready for 16-byte loads when its base and its row and head strides are.
at::Tensor packed_aligned_for_16b_loads(const at::Tensor& t) {
  const int64_t elems = 16 / t.element_size();
  const bool aligned = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && t.stride(0) % elems == 0 &&
                       t.stride(1) % elems == 0;
  return aligned ? t : t.clone(at::MemoryFormat::Contiguous);
}

// TMA can read a packed (total, heads, dim) tensor as one (1, heads, total, dim) entry.
bool packed_tma_ready(const at::Tensor& t) {
  return sm90::tma_compatible(t.data_ptr(), Strides{0, t.stride(1), t.stride(0)}, 1, t.size(1), t.size(0));
}

// The varlen forward: the wgmma family on compute capability 9.0 for tensors TMA can describe, the mma.sync
// family elsewhere and for batches of short sequences (max_seqlen_q <= kVarlenSm90MinRows): there the Hopper
// kernel's 192/128-row, 384-thread blocks hold at most 64 rows of work each (H100, 10 000 causal sequences of 1-64
// tokens, 16 heads, hd128 bf16: 6.5 ms against the mma.sync kernel's 4.0), unless GQA packing makes its blocks more
// than half queries (sm90/fwd_sm90_pack_gqa.h; 8 sequences of 64 queries on 8192 keys, 32 / 8 heads: 137 us packed
// against 431 on mma.sync) or the keys are long (kPackedLongKeys). The mma.sync family's varlen kernels
// are its score-mod variants; the wgmma family has plain ones too. FLASHCORE_FORCE_KERNEL forces a family as for fwd.
constexpr int64_t kVarlenSm90MinRows = 64;
// Short rows over long keys under GQA take the packed Hopper kernel however few queries fill its blocks: it reads
// a KV head's keys once a group where the mma.sync kernel (and the dense kernels, one query head a block) read them
// once a query head, and its small grids split their keys (more than one query a sequence: a decode step keeps
// the routes made for it). H200, Hq 32 / Hkv 8, hd128 bf16, causal, graph us,
// flash_attn_varlen_func mma.sync / Hopper: 8 sequences of 16 queries on 8192 keys 425.1 / 74.8, of 8 420.4 / 74.3,
// 4 of 16 on 4096 150.7 / 36.7; flash_attn_func (BSHD) dense / packed: 8 x 16 on 8192 186.1 / 78.6. No minimum
// grid: a single sequence's few blocks split their keys, 1 x 16 on 8192 295.5 / 54.3, 1 x 16 on 32768 1164 / 192.
constexpr int64_t kPackedLongKeys = 1024;

// The sm90 entry built for varlen: the plain kernel unless the scores are transformed (score_mod.h), else the
// score-mod one (it applies any transform); nullptr when neither carries a varlen launcher.
template <typename Entry, typename Find>
const Entry* sm90_varlen_entry(Find find, bool score_mod) {
  const Entry* e = find(score_mod);
  if (e != nullptr && e->launch_varlen != nullptr) return e;
  e = score_mod ? nullptr : find(true);
  return e != nullptr && e->launch_varlen != nullptr ? e : nullptr;
}

// The forward entry sm90_varlen_entry finds for a head dim and dtype, nullptr where the build has none.
const cuda::FwdKernelEntry* sm90_varlen_fwd_entry(int64_t head_dim, at::ScalarType dtype, bool score_mod) {
  const auto dt = to_dtype(dtype);
  return sm90_varlen_entry<cuda::FwdKernelEntry>(
      [&](bool mod) { return cuda::find_fwd_kernel("sm90", (int)head_dim, dt, mod); }, score_mod);
}

const cuda::FwdKernelEntry& select_varlen_fwd_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     const cudaDeviceProp& prop, int64_t max_seqlen_q,
                                                     int64_t max_seqlen_k, bool score_mod,
                                                     bool short_rows_on_sm90 = false) {
  const auto dtype = to_dtype(q.scalar_type());
  const int head_dim = (int)q.size(2);
  const std::string forced = forced_fwd_family();
  TORCH_CHECK(forced.empty() || forced == "sm80" || forced == "sm90", "flashcore: FLASHCORE_FORCE_KERNEL=", forced,
              " is not a forward kernel family (sm80, sm90)");
  const cuda::FwdKernelEntry* sm90 = forced == "sm80" ? nullptr : sm90_varlen_fwd_entry(head_dim, q.scalar_type(), score_mod);
  if (forced == "sm90") {
    TORCH_CHECK(is_hopper(prop) && sm90 != nullptr, "flashcore: FLASHCORE_FORCE_KERNEL=sm90 needs a compute "
                "capability 9.0 GPU and a build with sm90 kernels for head_dim ", head_dim);
  }
  bool short_rows = max_seqlen_q <= kVarlenSm90MinRows && forced != "sm90" && !short_rows_on_sm90;
  if (short_rows && sm90 != nullptr && k.size(1) > 0) {
    const sm90::VarlenFwdPack grid =
        sm90::varlen_fwd_pack(q.size(1), k.size(1), max_seqlen_q, sm90->head_dim_tile, pack_gqa_mode());
    short_rows = !(grid.heads > 1 && (grid.mostly_full(max_seqlen_q) ||
                                      (max_seqlen_q > 1 && max_seqlen_k >= kPackedLongKeys)));
  }
  if (sm90 != nullptr && is_hopper(prop) && !short_rows && packed_tma_ready(q) && packed_tma_ready(k) &&
      packed_tma_ready(v))
    return *sm90;
  const cuda::FwdKernelEntry* sm80 = cuda::find_fwd_kernel("sm80", head_dim, dtype, /*score_mod=*/true);
  TORCH_CHECK(sm80 != nullptr && sm80->launch_varlen != nullptr, "flashcore: this build has no variable-length "
              "forward kernel for head_dim ", head_dim, " and dtype ", c10::toString(q.scalar_type()));
  return *sm80;
}

// How the varlen backward's grid walks the batch (seqlen.h: VarlenParams::launch_order, tile_end): the sequences
// sorted longest first by sort_by's lengths (a backward block's work grows with its sequence's queries), and for
// kernels with a fixed tile (the entry's block_n) a packed grid of `tiled`'s lengths (at most max_seqlen, total
// in all) cut into tiles, so no block is launched past a short sequence's end. All on the device, a sort and a
// cumsum of batch values: no sync, capturable. Nothing for one sequence or with FLASHCORE_VARLEN_SCHEDULE=0. The
// returned tensors must live until the kernel is launched. (The forward keeps the given order: its short blocks
// measured 3 % slower with the schedule, docs/PERFORMANCE.md; the Hopper one packs its grid without a pre-pass,
// cuda/common/varlen_tile_scan.cuh.)
struct VarlenSchedule {
  at::Tensor order, tile_end;
};

VarlenSchedule plan_varlen_schedule(const at::Tensor& sort_by, const at::Tensor& tiled, int64_t max_seqlen,
                                    int64_t total, int tile, VarlenParams& v) {
  VarlenSchedule s;
  const int64_t batch = sort_by.size(0) - 1;
  if (batch < 2 || !varlen_schedule_enabled()) return s;
  auto lengths = [&](const at::Tensor& cu) { return cu.narrow(0, 1, batch) - cu.narrow(0, 0, batch); };
  const at::Tensor order = std::get<1>(lengths(sort_by).sort(/*stable=*/true, /*dim=*/0, /*descending=*/true));
  s.order = order.to(at::kInt);
  v.launch_order = s.order.data_ptr<int32_t>();
  if (tile > 0) {
    const at::Tensor len = lengths(tiled).index_select(0, order).clamp(0, max_seqlen);
    s.tile_end = at::div(len + (tile - 1), tile, "floor").cumsum(0).to(at::kInt);
    v.tile_end = s.tile_end.data_ptr<int32_t>();
    v.grid_tiles = packed_grid_tiles(batch, max_seqlen, total, tile);  // >= tile_end[batch - 1]
  }
  return s;
}

void check_varlen_grid(const VarlenArgs& a, int64_t heads, int64_t max_seqlen, const char* what) {
  constexpr int64_t kIntMax = std::numeric_limits<int32_t>::max();
  const int64_t blocks = (max_seqlen + kMinBlockM - 1) / kMinBlockM;
  TORCH_CHECK(blocks * a.batch() * heads <= kIntMax, "flashcore: batch x heads x ", what, " blocks (", a.batch(),
              " x ", heads, " x ", blocks, ") exceeds the CUDA grid limit");
}

// A KV cache's pages for the Hopper varlen forward (seqlen.h: VarlenParams::block_table): key and value are the
// paged caches viewed as packed (num_pages x page_size, heads_kv, dim) rows, seqused_k the entries' lengths.
struct PagedKeys {
  at::Tensor block_table;  // int32 (batch, max_pages), rows contiguous
  int64_t page_size;
};

// The KV-cache kernel for prepared params (decode/): plans stages and splits (num_splits > 0: forced), allocates the
// split workspace and launches, plus the combine kernel when split. query: the call's, for the workspace's device.
void run_decode_kernel(DecodeParams& p, int64_t num_splits, const at::Tensor& query, const cudaDeviceProp& prop) {
  const bool bf16 = query.scalar_type() == at::kBFloat16;
  const decode::DecodePlan plan = decode::plan_decode(p, (int)num_splits, bf16, prop);
  p.num_splits = plan.splits;
  p.longest_first = plan.longest_first;
  p.cluster_merge = plan.cluster_merge;
  at::Tensor o_partial, lse_partial;
  if (plan.splits > 1 && !plan.cluster_merge) {
    const int64_t rows = p.f.batch * p.f.heads_q * p.f.seqlen_q;
    o_partial = at::empty({plan.splits * rows * p.f.head_dim}, query.options().dtype(at::kFloat));
    lse_partial = at::empty({plan.splits * rows}, query.options().dtype(at::kFloat));
    p.o_partial = o_partial.data_ptr<float>();
    p.lse_partial = lse_partial.data_ptr<float>();
  }
  KernelTrace trace{plan.tma ? "decode tma" : plan.stages == 3 ? "decode stages3" : "decode", plan.head_dim_tile, 0,
                    plan.splits};
  trace.longest_first = plan.longest_first;
  trace.cluster_merge = plan.cluster_merge;
  record_kernel(Pass::kFwd, trace);
  decode::launch_decode(p, plan, bf16, at::cuda::getCurrentCUDAStream());
}

// The KV-cache kernel's head-dim-256 blocks for more than 16 query rows a KV head need the shared memory of sm_80
// and sm_90 (decode.h); the routes below keep such calls on their own kernels elsewhere (plan_decode would refuse
// them).
bool decode_kernel_fits(int64_t rows_per_kv_head, int64_t head_dim, const cudaDeviceProp& prop) {
  return rows_per_kv_head <= 16 || head_dim <= 128 || prop.sharedMemPerBlockOptin >= 160 * 1024;
}

// A decode step through the varlen op: one query a sequence (max_seqlen_q 1 and total_q = batch, so sequence b owns
// query row b), as serving engines and transformers' padded decoding call flash_attn_varlen_func. It runs on the
// KV-cache kernel, which packs a KV head's query heads into one block's rows, reads the head's keys once for all of
// them and splits the keys over the GPU, where the varlen kernels give every query head a block of 64 or more rows
// holding one query (docs/PERFORMANCE.md). Its entries read the packed keys as seqlen.h's sequences (one cache row
// whose entries start at cu_seqlens_k, make_varlen_decode_params), with the same alignment and outputs. Not where a
// kernel family is forced (FLASHCORE_FORCE_KERNEL) or for empty tensors (the varlen path's trivial cases).
bool varlen_decode_step(const VarlenArgs& args, const at::Tensor& query, const at::Tensor& key,
                        const cudaDeviceProp& prop) {
  constexpr int64_t kIntMax = std::numeric_limits<int32_t>::max();
  return args.max_seqlen_q == 1 && query.size(0) == args.batch() && query.numel() > 0 && key.numel() > 0 &&
         key.size(0) <= kIntMax && query.size(0) * key.size(1) <= kIntMax && forced_fwd_family().empty() &&
         decode_kernel_fits(query.size(1) / key.size(1), query.size(2), prop);
}

std::tuple<at::Tensor, at::Tensor> run_varlen_decode_step(const at::Tensor& query_in, const at::Tensor& key_in,
                                                          const at::Tensor& value_in, const VarlenArgs& args,
                                                          const AttentionOptions& opts, const cudaDeviceProp& prop) {
  at::Tensor out = at::empty_like(query_in);  // every row written: row b by entry b
  at::Tensor lse = at::empty({query_in.size(1), query_in.size(0)}, query_in.options().dtype(at::kFloat));
  poison_if_enabled({out, lse});
  const at::Tensor query = packed_aligned_for_16b_loads(query_in);
  const at::Tensor key = packed_aligned_for_16b_loads(key_in);
  const at::Tensor value = packed_aligned_for_16b_loads(value_in);
  DecodeParams p = make_varlen_decode_params(query, key, value, out, lse, args, opts);
  run_decode_kernel(p, /*num_splits=*/0, query, prop);
  return {out, lse};
}

// dense_on_packed_varlen's rule for a call's sizes (the tensors' layouts aside): on Hopper, under GQA, where the
// group's query heads pack, the queries fill at most half of a block of one head and more than half of a packed
// block (or the keys are long: kPackedLongKeys), and the packed grid has at least a third as many blocks as SMs.
bool packed_route_applies(const at::Tensor& query, const at::Tensor& key, bool score_mod, const cudaDeviceProp& prop) {
  const int64_t B = query.size(0), Hq = query.size(1), Sq = query.size(2), D = query.size(3);
  const int64_t Hkv = key.size(1), Sk = key.size(2);
  if (!is_hopper(prop) || Hkv >= Hq || forced_fwd_family() == "sm80" ||
      (B + 1) * std::max(Sq, Sk) > std::numeric_limits<int32_t>::max())
    return false;
  const cuda::FwdKernelEntry* sm90 = sm90_varlen_fwd_entry(D, query.scalar_type(), score_mod);
  if (sm90 == nullptr) return false;
  const int pack_mode = pack_gqa_mode();
  const sm90::VarlenFwdPack grid = sm90::varlen_fwd_pack(Hq, Hkv, Sq, sm90->head_dim_tile, pack_mode);
  const bool always = pack_mode == 2;
  const bool long_keys = Sq > 1 && Sk >= kPackedLongKeys;  // one query: the decode routes' (dense_decode_step)
  return grid.heads >= 2 && (always || (2 * Sq <= grid.block_m && (grid.mostly_full(Sq) || long_keys))) &&
         3 * grid.blocks(B, Hq, Sq) >= prop.multiProcessorCount;
}

// A dense decode step, one query a head (flash_attn_func or attention() in a generation loop over a contiguous
// cache): the KV-cache kernel too, where the dense kernels hold one query in a block of 64 or more rows per query
// head, read a KV head's keys once per query head and split the keys only where the grid is small (H200, 32 / 8
// heads, hd128: 8 x 8k 182 against 69 us, 8 x 1024 30.8 against 15.7; 32 / 32 heads 263 against 250). From
// kDenseDecodeMinKeys keys, and from kDenseDecodeOneWaveMinKeys where the dense grid (a block a query head) fits one
// wave: there the dense kernels' compact one-warpgroup block is quicker (4 x 576: 8.5 against 11.4 us, 4 x 1024
// 11.0 against 12.1; 4 x 2048 19.6 against 15.3; measured before the cluster merge of the splits, which took the
// KV-cache op itself at 4 x 576 from 11.1 to 9.3-9.6, still above the compact block). The batch rows are the
// cache's entries, every one full (no cache_seqlens: kv_seq takes every entry's keys, so no lengths are filled a
// call); the mask is the op's own, either causal alignment. Writes out and lse as the dense kernels would (the same
// layouts); false, nothing done, where a kernel family is forced or the grid would not fit.
constexpr int64_t kDenseDecodeMinKeys = 1024, kDenseDecodeOneWaveMinKeys = 2048;
// A few queries a head under GQA (a speculative-decoding check, a short chunk against a cache) take the same
// kernel, its block a KV head's query heads x Sq rows (at most kDecodeRowsMax), reading the head's keys once and
// splitting them over the GPU, where the dense kernels read them once a query head in a grid they split at most 3
// ways. H200, hd128 bf16, Hq 32, graph us dense / KV-cache kernel: 4 query heads a KV head, 1 x 16 queries x 32k
// keys 94.6 / 66.9, 1 x 4 x 16k 50.9 / 28.6, 4 x 8 x 8k 68.6 / 53.5; 8 a KV head, 8 x 2 x 32k 700.9 / 130.7 (the
// packed varlen grid too small to take it). The kernel's time grows with its rows, the dense kernels' with the
// keys, so it takes calls with at least kDecodeRowsKeysPerRow keys (all entries together) a row of its block: the
// dense kernels keep 1 x 16 x 8k (28.9 / 40.7) and 2 x 16 x 4k (23.0 / 39.2). Ahead of the packed varlen route
// (grids of a third of the SMs) it takes at most kDecodeRowsOverPacked rows (8 x 4 x 8k 81.0 packed / 71.4, 8 x 8
// x 8k 80.8 / 83.2, 8 x 16 x 8k 81.9 / 94.6), after it (calls that route declined) up to kDecodeRowsMax. Measured
// from 2048 keys (kDecodeRowsMinKeys), on the H200: other GPUs keep the dense kernels for more than one query.
// Head dims above 128 take twice the keys a row where the dense grid (a block a query head) fills half the SMs:
// there the dense kernels' one-warpgroup blocks keep up at 512 (hd256, Hq 32 / Hkv 8, us dense / KV-cache kernel:
// 4 x 4 x 2048 32.7 / 33.9, 4 x 8 x 4096 60.6 / 70.6, 4 x 16 x 8192 111.0 / 121.7), and fall behind from 1024 (4 x 8
// x 8192 111.8 / 107.6, 4 x 16 x 16384 214.8 / 195.0, 8 x 4 x 2048 60.3 / 50.6), while smaller grids gain from 512
// (1 x 8 x 16384 84.3 / 73.6, 1 x 4 x 8192 46.5 / 36.0). Head dim 64 lost nowhere in the same sweep.
constexpr int64_t kDecodeRowsMax = 64, kDecodeRowsKeysPerRow = 512, kDecodeRowsOverPacked = 16,
                  kDecodeRowsMinKeys = 2048;

// after_packed_route: the call the packed varlen route (dense_on_packed_varlen) declined, which may take more rows.
bool dense_decode_step(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                       const AttentionOptions& opts, const cudaDeviceProp& prop, bool after_packed_route,
                       at::Tensor& out, at::Tensor& lse) {
  constexpr int64_t kIntMax = std::numeric_limits<int32_t>::max();
  const int64_t B = query.size(0), Hq = query.size(1), Sq = query.size(2), Hkv = key.size(1), Sk = key.size(2);
  const int64_t rows = Sq * (Hq / Hkv);  // a KV head's query rows
  if ((after_packed_route && Sq == 1) || Sk < kDenseDecodeMinKeys || Sk > kIntMax || B * Hkv > kIntMax ||
      !forced_fwd_family().empty() || !decode_kernel_fits(rows, query.size(3), prop))
    return false;
  if (Sq > 1) {  // measured on Hopper only
    const bool wide_full_grid = query.size(3) > 128 && 2 * B * Hq >= prop.multiProcessorCount;
    const int64_t keys_per_row = wide_full_grid ? 2 * kDecodeRowsKeysPerRow : kDecodeRowsKeysPerRow;
    if (!is_hopper(prop) || Hq == Hkv || rows > (after_packed_route ? kDecodeRowsMax : kDecodeRowsOverPacked) ||
        Sk < kDecodeRowsMinKeys || B * Sk < keys_per_row * rows)
      return false;
  } else if (Sk < kDenseDecodeOneWaveMinKeys && B * Hq <= prop.multiProcessorCount) {
    return false;  // one wave of the dense kernels' blocks over short caches: their compact block is quicker
  }
  const KvCacheArgs args;  // every entry full (no cache_seqlens)
  // (batch, seq, heads, dim) views, as the KV-cache op takes its query and caches
  DecodeParams p = make_decode_params(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                      out.transpose(1, 2), lse, args, opts);
  run_decode_kernel(p, /*num_splits=*/0, query, prop);
  return true;
}

// short_rows_on_sm90: the Hopper kernel even for max_seqlen_q <= kVarlenSm90MinRows (a KV cache's chunked prefill,
// whose few sequences each walk a long cache). paged: keys through a block table, on the Hopper kernel only (the
// caller has checked that select_varlen_fwd_kernel picks it) and with the KV-cache op's input checks, not these
// (cu_seqlens_k is not read).
std::tuple<at::Tensor, at::Tensor> run_varlen_fwd(const at::Tensor& query_in, const at::Tensor& key_in,
                                                  const at::Tensor& value_in, const at::Tensor& cu_seqlens_q,
                                                  const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                                                  int64_t max_seqlen_k, double softmax_scale, bool is_causal,
                                                  int64_t window_left, int64_t window_right, double softcap,
                                                  const std::optional<at::Tensor>& sinks,
                                                  const std::optional<at::Tensor>& alibi_slopes,
                                                  const std::optional<at::Tensor>& seqused_k, bool short_rows_on_sm90,
                                                  const PagedKeys* paged = nullptr, bool causal_bottom_right = true) {
  const AttentionOptions opts = make_options(softmax_scale, is_causal, causal_bottom_right, window_left,
                                             window_right, softcap, sinks, alibi_slopes);
  const VarlenArgs args = make_varlen_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k);
  if (paged == nullptr) check_varlen_fwd_inputs(query_in, key_in, value_in, args, opts, kCudaLimits);
  const c10::cuda::CUDAGuard guard(query_in.device());
  const cudaDeviceProp& prop = device_properties(query_in);
  check_varlen_grid(args, query_in.size(1), max_seqlen_q, "query");
  if (paged == nullptr && varlen_decode_step(args, query_in, key_in, prop))
    return run_varlen_decode_step(query_in, key_in, value_in, args, opts, prop);

  auto [out, lse] = alloc_varlen_fwd_outputs(query_in);
  const at::Tensor query = packed_aligned_for_16b_loads(query_in);
  const at::Tensor key = packed_aligned_for_16b_loads(key_in);
  const at::Tensor value = packed_aligned_for_16b_loads(value_in);
  FwdParams p = make_varlen_fwd_params(query, key, value, out, lse, args, opts);
  if (paged != nullptr) {
    p.varlen.block_table = paged->block_table.data_ptr<int32_t>();
    p.varlen.block_table_stride = paged->block_table.stride(0);
    p.varlen.page_size = (int)paged->page_size;
  }
  cuda::zero_rows_outside_sequences(out, cu_seqlens_q);  // rows no kernel visits: 0, as rows that see no key
  if (varlen_fwd_is_trivial(p, out)) return {out, lse};
  const cuda::FwdKernelEntry& kernel = select_varlen_fwd_kernel(query, key, value, prop, max_seqlen_q, max_seqlen_k,
                                                                transforms_scores(opts), short_rows_on_sm90);
  TORCH_CHECK(paged == nullptr || std::string(kernel.family) == "sm90", "flashcore: internal error: paged keys "
              "on the ", kernel.family, " varlen kernel");
  record_kernel(Pass::kFwd, KernelTrace{kernel.family, kernel.head_dim_tile, 0, 1, false, kernel.score_mod, true});
  kernel.launch_varlen(p, at::cuda::getCurrentCUDAStream());  // the sm90 launcher refines the record
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> varlen_fwd_cuda(const at::Tensor& query_in, const at::Tensor& key_in,
                                                   const at::Tensor& value_in, const at::Tensor& cu_seqlens_q,
                                                   const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                                                   int64_t max_seqlen_k, double softmax_scale, bool is_causal,
                                                   int64_t window_left, int64_t window_right, double softcap,
                                                   bool /*deterministic*/, const std::optional<at::Tensor>& sinks,
                                                   const std::optional<at::Tensor>& alibi_slopes,
                                                   const std::optional<at::Tensor>& seqused_k) {
  return run_varlen_fwd(query_in, key_in, value_in, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        softmax_scale, is_causal, window_left, window_right, softcap, sinks, alibi_slopes, seqused_k,
                        /*short_rows_on_sm90=*/false);
}

// The varlen backward's fused kernel: the wgmma family on compute capability 9.0 for packed tensors TMA can
// describe (whose heads_q x total_q dQ rows a 2-D descriptor can address), the mma.sync family elsewhere and, as
// for the forward, for batches of short sequences (max_seqlen_q <= kVarlenSm90MinRows). FLASHCORE_FORCE_BWD=sm80|sm90 forces a family as for bwd.
const cuda::BwdKernelEntry& select_varlen_bwd_kernel(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                                                     const at::Tensor& v, const cudaDeviceProp& prop,
                                                     int64_t max_seqlen_q, bool score_mod) {
  const auto dtype = to_dtype(q.scalar_type());
  const int head_dim = (int)q.size(2);
  const std::string forced = forced_bwd_path();
  TORCH_CHECK(forced.empty() || forced == "sm80" || forced == "sm90", "flashcore: FLASHCORE_FORCE_BWD=", forced,
              " is not a variable-length backward path (composite, sm80, sm90)");
  const cuda::BwdKernelEntry* sm90 =
      forced == "sm80" ? nullptr
                       : sm90_varlen_entry<cuda::BwdKernelEntry>(
                             [&](bool mod) { return cuda::find_bwd_kernel("sm90", head_dim, dtype, mod); }, score_mod);
  if (forced == "sm90") {
    TORCH_CHECK(is_hopper(prop) && sm90 != nullptr, "flashcore: FLASHCORE_FORCE_BWD=sm90 needs a compute "
                "capability 9.0 GPU and a build with sm90 kernels for head_dim ", head_dim);
  }
  const bool short_rows = max_seqlen_q <= kVarlenSm90MinRows && forced != "sm90";
  const bool dq_rows_fit = q.size(0) * q.size(1) <= std::numeric_limits<int32_t>::max();
  if (sm90 != nullptr && is_hopper(prop) && !short_rows && dq_rows_fit && packed_tma_ready(q) &&
      packed_tma_ready(k) && packed_tma_ready(v) && packed_tma_ready(dout) &&
      (int64_t)prop.sharedMemPerBlockOptin >= sm90->smem_bytes)
    return *sm90;
  const cuda::BwdKernelEntry* sm80 = cuda::find_bwd_kernel("sm80", head_dim, dtype, /*score_mod=*/true);
  TORCH_CHECK(sm80 != nullptr && sm80->launch_varlen != nullptr, "flashcore: this build has no variable-length "
              "backward kernel for head_dim ", head_dim, " and dtype ", c10::toString(q.scalar_type()));
  TORCH_CHECK_NOT_IMPLEMENTED((int64_t)prop.sharedMemPerBlockOptin >= sm80->smem_bytes, "flashcore: the "
              "variable-length backward for head_dim ", head_dim, " needs ", sm80->smem_bytes, " bytes of shared "
              "memory a block; ", prop.name, " grants ", prop.sharedMemPerBlockOptin);
  return *sm80;
}

// The bitwise-reproducible varlen backward: the composite (ATen) backward on each sequence alone, written into the
// packed gradients through views. It reads the offsets on the host (a device sync), which only deterministic mode
// pays; SeqInfo's clamps apply as in the kernels.
void varlen_bwd_deterministic(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& out, const at::Tensor& lse, const VarlenArgs& args,
                              const AttentionOptions& opts, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv) {
  const at::Tensor cu_q = args.cu_seqlens_q.cpu(), cu_k = args.cu_seqlens_k.cpu();
  const at::Tensor used = args.seqused_k.defined() ? args.seqused_k.cpu() : at::Tensor();
  VarlenParams host;
  host.cu_seqlens_q = cu_q.data_ptr<int32_t>();
  host.cu_seqlens_k = cu_k.data_ptr<int32_t>();
  host.seqused_k = used.defined() ? used.data_ptr<int32_t>() : nullptr;
  host.total_q = q.size(0);
  host.total_k = k.size(0);
  auto bhsd = [](const at::Tensor& t, int64_t begin, int64_t len) { return packed_as_bhsd(t.narrow(0, begin, len)); };
  for (int64_t b = 0; b < args.batch(); ++b) {
    const SeqInfo s = varlen_seq_info(host, b, args.max_seqlen_q, args.max_seqlen_k);
    if (s.seqlen_q == 0 || s.seqlen_k == 0) continue;  // its gradients are the allocation's zeros
    AttentionOptions seq_opts = opts;
    if (opts.alibi_slopes.defined() && opts.alibi_slopes.dim() == 2) seq_opts.alibi_slopes = opts.alibi_slopes[b];
    const at::Tensor qb = bhsd(q, s.q_begin, s.seqlen_q), ob = bhsd(out, s.q_begin, s.seqlen_q);
    const at::Tensor dob = bhsd(dout, s.q_begin, s.seqlen_q);
    const at::Tensor kb = bhsd(k, s.k_begin, s.seqlen_k), vb = bhsd(v, s.k_begin, s.seqlen_k);
    const at::Tensor lse_b = lse.narrow(1, s.q_begin, s.seqlen_q).unsqueeze(0);
    at::Tensor dqb = bhsd(dq, s.q_begin, s.seqlen_q), dkb = bhsd(dk, s.k_begin, s.seqlen_k);
    at::Tensor dvb = bhsd(dv, s.k_begin, s.seqlen_k);
    const BwdParams p = make_bwd_params(dob, qb, kb, vb, ob, lse_b, dqb, dkb, dvb, seq_opts, /*deterministic=*/true);
    cuda::bwd_composite(dob, qb, kb, vb, ob, lse_b, p, dqb, dkb, dvb);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_bwd_cuda(
    const at::Tensor& grad_out_in, const at::Tensor& query_in, const at::Tensor& key_in, const at::Tensor& value_in,
    const at::Tensor& out_in, const at::Tensor& lse, const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
    int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale, bool is_causal, int64_t window_left,
    int64_t window_right, double softcap, bool deterministic, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& seqused_k) {
  const AttentionOptions opts = make_options(softmax_scale, is_causal, /*causal_bottom_right=*/true, window_left,
                                             window_right, softcap, std::nullopt, alibi_slopes);
  const VarlenArgs args = make_varlen_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k);
  check_varlen_bwd_inputs(grad_out_in, query_in, key_in, value_in, out_in, lse, args, opts, kCudaLimits);
  const c10::cuda::CUDAGuard guard(query_in.device());
  const cudaDeviceProp& prop = device_properties(query_in);
  check_varlen_grid(args, key_in.size(1), max_seqlen_k, "key");
  // Uninitialized (poisoned in the tests): each path below writes or zeroes every row.
  auto [grad_query, grad_key, grad_value] = alloc_bwd_outputs(query_in, key_in, value_in);
  if (query_in.numel() == 0 || key_in.numel() == 0 || args.batch() == 0) {
    grad_query.zero_(), grad_key.zero_(), grad_value.zero_();
    return {grad_query, grad_key, grad_value};
  }
  if (deterministic || forced_bwd_path() == "composite") {  // the fused kernel sums dQ with atomics
    record_kernel(Pass::kBwd, KernelTrace{"composite"});
    // The per-sequence path writes only rows inside sequences (and skips sequences without queries or keys).
    grad_query.zero_(), grad_key.zero_(), grad_value.zero_();
    varlen_bwd_deterministic(grad_out_in, query_in, key_in, value_in, out_in, lse, args, opts, grad_query, grad_key,
                             grad_value);
    return {grad_query, grad_key, grad_value};
  }

  const int64_t D = query_in.size(2);
  const at::Tensor q = packed_aligned_for_16b_loads(query_in), k = packed_aligned_for_16b_loads(key_in);
  const at::Tensor v = packed_aligned_for_16b_loads(value_in), o = packed_aligned_for_16b_loads(out_in);
  const at::Tensor dout = packed_aligned_for_16b_loads(grad_out_in);
  const cuda::BwdKernelEntry* kernel =
      &select_varlen_bwd_kernel(dout, q, k, v, prop, max_seqlen_q, transforms_scores(opts));
  BwdParams p = make_varlen_bwd_params(dout, q, k, v, o, lse, at::Tensor(), grad_key, grad_value, args, opts,
                                       deterministic);
  // The fused kernels write every used key row of every sequence (zeros where no query sees it); the others are
  // zeroed apart, not the whole gradients (2 x 68 us on the benchmark's batch, H200).
  cuda::zero_key_rows_outside_sequences(grad_key, grad_value, p.varlen, args.batch(), max_seqlen_q, max_seqlen_k);
  const VarlenSchedule schedule = plan_varlen_schedule(args.cu_seqlens_q, args.cu_seqlens_k, max_seqlen_k, k.size(0),
                                                       kernel->block_n, p.varlen);
  const int64_t total_q = q.size(0), Hq = q.size(1);
  const auto f32 = q.options().dtype(at::kFloat);
  at::Tensor dsum = at::empty({Hq, total_q}, f32);
  const int64_t dq_cols = kernel->dq_accum.cols_exact ? D : kernel->head_dim_tile;
  at::Tensor dq_accum = at::empty({Hq, total_q, dq_cols}, f32);
  poison_if_enabled({dsum, dq_accum});
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  // The pre-pass sees the packed rows as one sequence of total_q rows per head (lse's layout): it reads every row
  // of out and grad_out (all inside the tensors) and zeroes all of dq_accum.
  BwdParams rows = p;
  rows.batch = 1;
  rows.seqlen_q = total_q;
  rows.varlen = VarlenParams{};
  cuda::launch_bwd_prepass(rows, q.scalar_type() == at::kBFloat16, dsum.data_ptr<float>(), dq_accum.data_ptr<float>(),
                           total_q, (int)dq_cols, cuda::DqTileShape{}, stream);
  const bool wide = kernel->launch_varlen_wide != nullptr && bwd_wide_steps_enabled();
  KernelTrace trace{kernel->family, kernel->head_dim_tile, 0, 1, false, kernel->score_mod, true};
  trace.wide_block_m = wide ? kernel->wide_block_m : 0;
  record_kernel(Pass::kBwd, trace);
  (wide ? kernel->launch_varlen_wide : kernel->launch_varlen)(p, dsum.data_ptr<float>(), dq_accum.data_ptr<float>(),
                                                              stream);
  // dq_accum holds (Hq, total_q) rows: one batch entry of Hq heads, as grad_query (total_q, Hq, D) viewed.
  write_grad_query(dq_accum.unsqueeze(0), grad_query.transpose(0, 1).unsqueeze(0),
                   kernel->dq_accum.unscaled ? p.scale : 1.0);
  return {grad_query, grad_key, grad_value};
}

// Offsets of `batch` sequences of `len` rows each (cu_seqlens of an equal-length batch), int32 on `options`' device.
at::Tensor equal_offsets(int64_t batch, int64_t len, const at::TensorOptions& options) {
  return at::arange(0, (batch + 1) * len, len, options.dtype(at::kInt));
}

// A dense (B, H, S, D) tensor as packed (B * S, H, D) rows, read in place: where the batch is BSHD in memory (batch
// stride = S x sequence stride, or one entry) and TMA can describe the rows; nullopt otherwise.
std::optional<at::Tensor> bshd_rows(const at::Tensor& t) {
  if (t.size(0) > 1 && t.stride(0) != t.size(2) * t.stride(2)) return std::nullopt;
  at::Tensor r = t.as_strided({t.size(0) * t.size(2), t.size(1), t.size(3)}, {t.stride(2), t.stride(1), t.stride(3)});
  return packed_tma_ready(r) ? std::optional<at::Tensor>(r) : std::nullopt;
}

// Dense (B, Hkv, Sk, D) keys and values as one varlen batch the kernel reads in place, whatever their batch stride.
// Entry b's keys are rows [b x R, b x R + Sk) of a (rows, heads, dim) view whose row stride is the sequence stride,
// R = batch stride / sequence stride: BSHD R = Sk (no gaps); BHSD R = heads x Sk, a static cache's slice R = heads x
// capacity, the rows between two entries (other heads' keys, unwritten slots) skipped by seqused_k = Sk. The view's
// last row is entry B-1's last key, so it spans exactly the tensor's memory. Needs K and V of the same R (one
// cu_seqlens_k serves both), R whole and >= Sk (entries disjoint), int32 offsets and rows TMA can describe. A caller
// with its own used lengths (the KV cache's cache_seqlens) passes with_seqused = false: no seqused is built.
struct PackedBatch {
  at::Tensor key, value, cu_seqlens;
  std::optional<at::Tensor> seqused;  // none where the rows are back to back, or the caller brings its own
};

std::optional<PackedBatch> packed_batch_rows(const at::Tensor& key, const at::Tensor& value,
                                             bool with_seqused = true) {
  const int64_t B = key.size(0), Sk = key.size(2);
  const std::optional<at::Tensor> k_bshd = bshd_rows(key), v_bshd = bshd_rows(value);
  if (k_bshd && v_bshd) return PackedBatch{*k_bshd, *v_bshd, equal_offsets(B, Sk, key.options()), std::nullopt};
  const int64_t seq_stride = key.stride(2);
  if (seq_stride <= 0 || value.stride(2) != seq_stride || key.stride(0) % seq_stride != 0 ||
      value.stride(0) != key.stride(0))
    return std::nullopt;
  const int64_t R = key.stride(0) / seq_stride, rows = (B - 1) * R + Sk;
  if (R < Sk || B * R > std::numeric_limits<int32_t>::max()) return std::nullopt;
  auto view = [&](const at::Tensor& t) {
    return t.as_strided({rows, t.size(1), t.size(3)}, {seq_stride, t.stride(1), t.stride(3)});
  };
  PackedBatch p{view(key), view(value), {}, {}};
  if (!packed_tma_ready(p.key) || !packed_tma_ready(p.value)) return std::nullopt;
  const auto ints = key.options().dtype(at::kInt);
  p.cu_seqlens = at::arange(0, B * R + 1, R, ints).clamp_max_(rows);  // the last entry ends at the view's end
  if (with_seqused) p.seqused = at::full({B}, Sk, ints);
  return p;
}

// A dense op's outputs from the varlen forward of an equal-length batch (o (B * Sq, Hq, D), l (Hq, B * Sq)): out
// (B, Sq, Hq, D), or with heads_first (B, Hq, Sq, D), taken as a view of o where out's strides (the op's promise:
// like the query's) are o's already, else copied; lse (B, Hq, Sq) copied from the varlen layout.
void adopt_varlen_outputs(const at::Tensor& o, const at::Tensor& l, int64_t B, int64_t Sq, bool heads_first,
                          at::Tensor& out, at::Tensor& lse) {
  const int64_t Hq = o.size(1);
  at::Tensor o_view = o.view({B, Sq, Hq, o.size(2)});
  if (heads_first) o_view = o_view.transpose(1, 2);
  if (o_view.strides() == out.strides())
    out = o_view;
  else
    out.copy_(o_view);
  lse.copy_(l.view({Hq, B, Sq}).transpose(0, 1));
}

// Chunked prefill on Hopper: the Hopper varlen forward's wgmma kernel instead of the decode kernel's mma.sync rows,
// which re-read a KV head's cache for every 64 packed query rows (128 new tokens at 8 x 8k: 219 against 708 us,
// docs/PERFORMANCE.md). Entry b is sequence b of a varlen batch whose keys are cache row b (read in place at any batch
// stride: packed_batch_rows) or, paged, its pages through the block table (VarlenParams::block_table), of which
// seqused_k = cache_seqlens[b] are used: the same clamping, causal alignment, window, ALiBi offset and empty-entry
// outputs as the decode kernel's, and the slots past an entry's length are never read into the output (the varlen
// kernel zeroes V past a sequence's used keys; TMA zero-fills pages past it). Taken from kPrefillOnVarlenMinTokens new
// tokens a sequence, or fewer where the Hopper kernel's blocks (the group's query heads packed into them,
// sm90/fwd_sm90_pack_gqa.h) are more than half queries (from kSplitPrefillMinTokens where it splits keys), and where
// its grid, a key split's blocks counted, has at least a third as many blocks as the GPU has SMs; without
// cache_batch_idx, left pad or forced split count, on a build with the Hopper varlen kernel for the head dim and caches
// whose rows (or pages) TMA can read as packed (rows, heads, dim) tensors (else the decode kernel, never the mma.sync
// varlen one), paged ones in pages of a multiple of 16 keys. Returns false (nothing done) otherwise. The decode
// kernel's cost grows with each 64 packed rows of a KV head, the Hopper kernel's with its waves of blocks (128 or 192
// rows); a small grid splits its keys at head dim 128 only. H100, 8 x 8k, Hq 32 / Hkv 8, us decode / Hopper one head a
// block: 16 tokens 119.6 / 204.3, 32 198.3 / 210.7, 48 344.5 / 213.0, 64 353.0 / 214.1; 1 x 128k (32 blocks) with 64
// tokens 683.0 / 1378.5. Packed (4 heads a block from 17 tokens), the Hopper kernel takes ~115-120 us at 8 x 8k from 24
// to 64 tokens (64 or 128 blocks); docs/PERFORMANCE.md.
constexpr int64_t kPrefillOnVarlenMinTokens = 33;
// Where the Hopper kernel splits its keys (two blocks a query tile, merged in a cluster), from 16 new tokens, its
// blocks four query heads of 16 tokens (half padding). H200, Hq 32 / Hkv 8, hd128 bf16, us Hopper split / decode /
// FA4: 16 tokens 8 x 8k 80.1 / 92.5 / 91.0, 4 x 4096 (64 split blocks) 42.3 / 46.8 / 47.8, but 2 x 8k (32) 62.5 /
// 49.5 / 89.7, which the grid rule leaves to the decode kernel; 8 tokens 8 x 8k 79.7 / 81.7, 4 x 4096 41.4 / 37.0;
// 64 tokens 2 x 8k (64 split blocks) 63.9 / 87.4 / 91.7.
constexpr int64_t kSplitPrefillMinTokens = 16;
// Paged caches with pages under 64 keys: the Hopper kernel's producer issues up to 32 boxes and 8 block-table reads
// a 128-key tile, so the decode kernel keeps the shortest prefills (H100, pages of 16, us Hopper / decode: 8 x 8k
// 64 tokens 394.6 / 376.1, 128 tokens 397.0 / 746.2; 64 entries of mixed lengths, 64 tokens 618.5 / 737.4).
constexpr int64_t kPagedSmallPagesMinTokens = 64;

bool kvcache_prefill_on_varlen(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                               const KvCacheArgs& args, const AttentionOptions& opts, const cudaDeviceProp& prop,
                               double softmax_scale, int64_t window_left, int64_t window_right,
                               const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& alibi_slopes,
                               at::Tensor& out, at::Tensor& lse) {
  const int64_t B = query.size(0), Sq = query.size(1), Hq = query.size(2), D = query.size(3);
  const bool paged = args.paged();
  const int64_t rows_per_cache_row = key_cache.size(1);  // a page's keys, or a dense cache row's
  const int64_t capacity = paged ? args.block_table.size(1) * rows_per_cache_row : rows_per_cache_row;
  // Paged: pages of a multiple of 16 keys, so that the producer's TMA boxes (16 keys or more) never cross a page;
  // pages under 64 keys (up to 8 boxes a span, all from the producer's one thread) from kPagedSmallPagesMinTokens.
  const bool pages_fit = rows_per_cache_row % 16 == 0 &&
                         (rows_per_cache_row % 64 == 0 || Sq >= kPagedSmallPagesMinTokens);
  if (!is_hopper(prop) || args.cache_batch_idx.defined() || args.cache_leftpad.defined() || args.num_splits > 0 ||
      capacity == 0 || (paged ? !pages_fit : key_cache.size(0) < B) ||
      (B + 1) * std::max(Sq, capacity) > std::numeric_limits<int32_t>::max() || forced_fwd_family() == "sm80")
    return false;
  // The caches as packed (rows, heads_kv, dim) tensors: every page of a paged one; a dense cache's first B rows in
  // place, whatever its batch stride (packed_batch_rows; seqused_k = cache_seqlens, clamped to the capacity).
  std::optional<at::Tensor> k, v, cu_k;
  if (paged) {
    auto pages = [&](const at::Tensor& cache) -> std::optional<at::Tensor> {
      if (cache.size(0) > 1 && cache.stride(0) != rows_per_cache_row * cache.stride(1)) return std::nullopt;
      return cache.as_strided({cache.size(0) * rows_per_cache_row, cache.size(2), D},
                              {cache.stride(1), cache.stride(2), cache.stride(3)});
    };
    k = pages(key_cache), v = pages(value_cache);
  } else if (const std::optional<PackedBatch> rows = packed_batch_rows(key_cache.narrow(0, 0, B).transpose(1, 2),
                                                                       value_cache.narrow(0, 0, B).transpose(1, 2),
                                                                       /*with_seqused=*/false)) {
    k = rows->key, v = rows->value, cu_k = rows->cu_seqlens;  // TMA-ready: packed_batch_rows checked them
  }
  if (!k || !v || (paged && (!packed_tma_ready(*k) || !packed_tma_ready(*v)))) return false;
  const at::Tensor q = query.reshape({B * Sq, Hq, D});
  // The entry select_varlen_fwd_kernel picks (short_rows_on_sm90, not forced to sm80) where TMA can read the tensors.
  const cuda::FwdKernelEntry* sm90 = sm90_varlen_fwd_entry(D, query.scalar_type(), transforms_scores(opts));
  if (sm90 == nullptr || !packed_tma_ready(q)) return false;
  const sm90::VarlenFwdPack grid = sm90::varlen_fwd_pack(Hq, k->size(1), Sq, sm90->head_dim_tile, pack_gqa_mode());
  // The grid as the launcher runs it: key splits multiply a grid of at most one cluster an SM pair over long caches
  // (sm90::varlen_fwd_max_key_splits), and then from kSplitPrefillMinTokens even blocks half padding beat the
  // decode kernel.
  const int sms = prop.multiProcessorCount;
  const int64_t blocks = grid.blocks(B, Hq, Sq);
  // A query tile's walk at most, from the mask layer's band as the launcher's longest_walk_tiles takes it: the keys
  // the queries see, or a band bounded on both sides plus a tile's rows.
  const Band band = MaskParams{opts.is_causal, /*bottom_right=*/true, opts.window_left, opts.window_right}.band(
      Sq, capacity);
  int64_t walk_keys = band.keys_of_queries(0, Sq).size();
  if (band.lo > -kUnboundedDiagonal && band.hi < kUnboundedDiagonal)
    walk_keys = std::min(walk_keys, band.hi - band.lo + grid.block_m);
  const int splits = walk_keys >= sm90::kVarlenSplitMinKeys && 2 * blocks <= sms && key_split_cap() != 1
                         ? sm90::varlen_fwd_max_key_splits(sm90->head_dim_tile)
                         : 1;
  const bool enough_queries = Sq >= kPrefillOnVarlenMinTokens || grid.mostly_full(Sq) ||
                              (splits > 1 && Sq >= kSplitPrefillMinTokens);
  // FLASHCORE_FORCE_KERNEL=sm90 takes it for every prefill (Sq > 1) it can run, as the benchmarks' comparison.
  const bool forced = forced_fwd_family() == "sm90" && Sq > 1;
  if (!forced && (!enough_queries || 3 * blocks * splits < sms)) return false;
  const at::Tensor cu_q = equal_offsets(B, Sq, query.options());
  const PagedKeys pages{args.block_table, rows_per_cache_row};
  auto [o, l] = run_varlen_fwd(q, *k, *v, cu_q, paged ? cu_q : *cu_k /* paged: not read */, Sq, capacity,
                               softmax_scale, opts.is_causal, window_left, window_right, opts.softcap, sinks,
                               alibi_slopes, args.cache_seqlens,
                               /*short_rows_on_sm90=*/true, paged ? &pages : nullptr);
  adopt_varlen_outputs(o, l, B, Sq, /*heads_first=*/false, out, lse);
  return true;
}

// Dense calls with a few queries a head against many keys under GQA (a chunked prefill or a speculative-decoding
// check written against flash_attn_func, SDPA or transformers): the dense kernels' blocks hold one query head's few
// queries, and every query head's block reads its K/V head again, while the Hopper varlen kernel packs the group's
// query heads into one block's rows (sm90/fwd_sm90_pack_gqa.h). Taken on Hopper where it packs, the queries fill at
// most half of a block of one head and more than half of a packed block (or the keys are long: kPackedLongKeys), and
// the packed grid has at least a third as many blocks as SMs. The varlen kernel reads (rows, heads, dim) tensors:
// see packed_batch_rows for how any batch stride is read in place. Writes out and lse as the dense kernels would
// (the backward reads them as it reads theirs); returns false (nothing done) otherwise.
bool dense_on_packed_varlen(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            const cudaDeviceProp& prop, double softmax_scale, bool is_causal, bool causal_bottom_right,
                            int64_t window_left, int64_t window_right, double softcap,
                            const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& alibi_slopes,
                            bool score_mod, at::Tensor& out, at::Tensor& lse) {
  const int64_t B = query.size(0), Hq = query.size(1), Sq = query.size(2), D = query.size(3), Sk = key.size(2);
  if (!packed_route_applies(query, key, score_mod, prop)) return false;
  const std::optional<PackedBatch> keys = packed_batch_rows(key, value);
  if (!keys) return false;
  // The queries are few (at most half a block a head): rows in place where the batch is BSHD, else a BSHD copy.
  std::optional<at::Tensor> q = bshd_rows(query);
  if (!q) q = query.transpose(1, 2).contiguous().view({B * Sq, Hq, D});
  if (!packed_tma_ready(*q)) return false;
  auto [o, l] = run_varlen_fwd(*q, keys->key, keys->value, equal_offsets(B, Sq, query.options()), keys->cu_seqlens,
                               Sq, Sk, softmax_scale, is_causal, window_left, window_right, softcap, sinks,
                               alibi_slopes, keys->seqused, /*short_rows_on_sm90=*/true, nullptr, causal_bottom_right);
  adopt_varlen_outputs(o, l, B, Sq, /*heads_first=*/true, out, lse);
  return true;
}

// The KV-cache forward (decode/): one launch of the split-KV kernel (plus the combine kernel when split), no sync:
// lengths, indices and page numbers stay on the device and the kernel clamps them (paged_kv.h), so a call can be
// captured in a CUDA graph with cache_seqlens changing between replays.
std::tuple<at::Tensor, at::Tensor> kvcache_fwd_cuda(
    const at::Tensor& query_in, const at::Tensor& key_cache_in, const at::Tensor& value_cache_in,
    const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& block_table,
    const std::optional<at::Tensor>& cache_batch_idx, const std::optional<at::Tensor>& cache_leftpad,
    double softmax_scale, bool is_causal, int64_t window_left, int64_t window_right, double softcap,
    const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& alibi_slopes, int64_t num_splits) {
  const AttentionOptions opts = make_options(softmax_scale, is_causal, /*causal_bottom_right=*/true, window_left,
                                             window_right, softcap, sinks, alibi_slopes);
  const KvCacheArgs args = make_kvcache_args(cache_seqlens, block_table, cache_batch_idx, cache_leftpad, num_splits);
  check_kvcache_inputs(query_in, key_cache_in, value_cache_in, args, opts, kCudaLimits);
  const c10::cuda::CUDAGuard guard(query_in.device());
  const cudaDeviceProp& prop = device_properties(query_in);
  auto [out, lse] = alloc_kvcache_outputs(query_in);
  if (query_in.numel() == 0) return {out, lse};
  TORCH_CHECK(query_in.size(0) * key_cache_in.size(2) <= std::numeric_limits<int32_t>::max(), "flashcore: batch x "
              "heads_kv (", query_in.size(0), " x ", key_cache_in.size(2), ") exceeds the CUDA grid limit");
  // 16-byte loads: misaligned inputs are read from aligned copies (the caller's caches are never written here).
  const at::Tensor query = aligned_for_16b_loads(query_in);
  const at::Tensor key_cache = aligned_for_16b_loads(key_cache_in);
  const at::Tensor value_cache = aligned_for_16b_loads(value_cache_in);
  if (kvcache_prefill_on_varlen(query, key_cache, value_cache, args, opts, prop, softmax_scale, window_left,
                                window_right, sinks, alibi_slopes, out, lse))
    return {out, lse};
  DecodeParams p = make_decode_params(query, key_cache, value_cache, out, lse, args, opts);
  if (key_cache.numel() == 0 || p.kv.capacity == 0) {  // no key anywhere
    fill_no_key_outputs(out, lse, opts);
    return {out, lse};
  }
  run_decode_kernel(p, args.num_splits, query, prop);
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(flashcore, CUDA, m) {
  m.impl("varlen_fwd", &varlen_fwd_cuda);
  m.impl("varlen_bwd", &varlen_bwd_cuda);
  m.impl("kvcache_fwd", &kvcache_fwd_cuda);
  m.impl("fwd", &fwd_cuda);
  m.impl("bwd", &bwd_cuda);
  m.impl("fwd_kernel_name", &fwd_kernel_name_cuda);
  m.impl("bwd_kernel_name", &bwd_kernel_name_cuda);
}

}  // namespace flashcore
