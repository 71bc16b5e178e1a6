// Host-side steps shared by every backend: argument validation with messages that name the argument, output
// allocation, and filling FwdParams/BwdParams from tensors. Each backend (cpu/, cuda/) adds only its own
// dtype/head-dim rules and its kernels.
#pragma once

#include <ATen/core/Tensor.h>

#include <initializer_list>
#include <optional>
#include <tuple>

#include "paged_kv.h"
#include "params.h"

namespace flashcore {

// What a backend can run; validation reports anything outside it as an error naming the argument.
struct BackendLimits {
  const char* name;          // "CPU", "CUDA"
  bool allow_fp32_fp64;      // float32/float64 inputs
  int64_t max_head_dim;      // inclusive
  int64_t head_dim_multiple; // head_dim must be a multiple of this
};

// Options shared by the forward and backward schemas. sinks/alibi_slopes: undefined when absent.
struct AttentionOptions {
  double softmax_scale;
  bool is_causal;
  bool causal_bottom_right;  // aligns the causal diagonal and the window bottom-right (flash-attn), else top-left
  int64_t window_left;
  int64_t window_right;
  double softcap;
  at::Tensor sinks;         // (heads_q,) float32
  at::Tensor alibi_slopes;  // (heads_q,) or (batch, heads_q) float32
};

AttentionOptions make_options(double softmax_scale, bool is_causal, bool causal_bottom_right, int64_t window_left,
                              int64_t window_right, double softcap, const std::optional<at::Tensor>& sinks,
                              const std::optional<at::Tensor>& alibi_slopes);

// Whether the call's scores are transformed before the softmax (ScoreParams::transforms: softcap, ALiBi, a scale
// that is not positive): the CUDA dispatchers then pick the kernels' score-mod variants.
bool transforms_scores(const AttentionOptions& o);

// Validates query/key/value (logical (B, H, S, D), last dim contiguous) against the backend's limits and the
// options; throws c10::Error (Python: RuntimeError/ValueError/NotImplementedError) naming the argument.
void check_fwd_inputs(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                      const AttentionOptions& opts, const BackendLimits& limits);

// Also checks grad_out/out (shape and dtype of query) and lse ((B, Hq, Sq) float32; float64 for float64 inputs).
void check_bwd_inputs(const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
                      const at::Tensor& value, const at::Tensor& out, const at::Tensor& lse,
                      const AttentionOptions& opts, const BackendLimits& limits);

// Allocates out (same layout as query when query is dense, else contiguous) and lse (B, Hq, Sq) float32 (float64 for
// float64 inputs).
// Outputs and workspaces are poisoned (NaN) when FLASHCORE_POISON is set (switches.h), so that an element a kernel
// fails to write shows in the tests.
std::tuple<at::Tensor, at::Tensor> alloc_fwd_outputs(const at::Tensor& query);
// grad_query, grad_key, grad_value with the layouts of query, key, value (empty_like).
std::tuple<at::Tensor, at::Tensor, at::Tensor> alloc_bwd_outputs(const at::Tensor& query, const at::Tensor& key,
                                                                 const at::Tensor& value);
void poison_if_enabled(std::initializer_list<at::Tensor> tensors);

// Fills the sizes, strides, pointers and mask fields. `out`/`lse` may be undefined (params left null).
FwdParams make_fwd_params(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                          const at::Tensor& out, const at::Tensor& lse, const AttentionOptions& opts);

BwdParams make_bwd_params(const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
                          const at::Tensor& value, const at::Tensor& out, const at::Tensor& lse,
                          const at::Tensor& grad_query, const at::Tensor& grad_key, const at::Tensor& grad_value,
                          const AttentionOptions& opts, bool deterministic);

// ---- Variable-length batches (seqlen.h) ----
// query (total_q, heads_q, head_dim), key/value (total_k, heads_kv, head_dim), last dim contiguous.
struct VarlenArgs {
  at::Tensor cu_seqlens_q, cu_seqlens_k;  // int32 (batch + 1,)
  at::Tensor seqused_k;                   // int32 (batch,), or undefined
  int64_t max_seqlen_q = 0, max_seqlen_k = 0;
  int64_t batch() const { return cu_seqlens_q.size(0) - 1; }
};

VarlenArgs make_varlen_args(const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                            int64_t max_seqlen_k, const std::optional<at::Tensor>& seqused_k);

// Shapes, dtypes, devices and the options, as check_fwd_inputs; the offsets' values too when they are on the CPU
// or FLASHCORE_CHECK_VARLEN=1 (switches.h): otherwise reading them would need a device sync.
void check_varlen_fwd_inputs(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                             const VarlenArgs& args, const AttentionOptions& opts, const BackendLimits& limits);
// Also grad_out/out (query's shape and dtype) and lse ((heads_q, total_q) float32; float64 for float64 inputs).
void check_varlen_bwd_inputs(const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
                             const at::Tensor& value, const at::Tensor& out, const at::Tensor& lse,
                             const VarlenArgs& args, const AttentionOptions& opts, const BackendLimits& limits);

// out like query (poisoned as alloc_fwd_outputs), lse (heads_q, total_q) (flash-attn's varlen layout) filled with
// -inf: rows outside every sequence keep it.
std::tuple<at::Tensor, at::Tensor> alloc_varlen_fwd_outputs(const at::Tensor& query);
// The CPU varlen backward's gradients (CUDA's fused path zeroes only the rows its kernels skip: varlen_rows.cuh).
// grad_query uninitialized (poisoned as alloc_bwd_outputs): every backward writes all its rows, 0 outside every
// sequence. grad_key/grad_value zeroed: keys outside every sequence (and past seqused_k) keep 0, the kernels write
// the others.
std::tuple<at::Tensor, at::Tensor, at::Tensor> alloc_varlen_bwd_outputs(const at::Tensor& query,
                                                                        const at::Tensor& key,
                                                                        const at::Tensor& value);
// Nothing to launch: no sequence, head or query row (outputs as allocated), or no key at all (out = 0).
bool varlen_fwd_is_trivial(const FwdParams& p, at::Tensor& out);

// The params of a varlen call: the packed tensors as batch-stride-0 entries, seqlen_q/seqlen_k = the max lengths.
FwdParams make_varlen_fwd_params(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                 const at::Tensor& out, const at::Tensor& lse, const VarlenArgs& args,
                                 const AttentionOptions& opts);
BwdParams make_varlen_bwd_params(const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
                                 const at::Tensor& value, const at::Tensor& out, const at::Tensor& lse,
                                 const at::Tensor& grad_query, const at::Tensor& grad_key,
                                 const at::Tensor& grad_value, const VarlenArgs& args, const AttentionOptions& opts,
                                 bool deterministic);

// A packed (total, heads, dim) tensor as the 4-D (1, heads, total, dim) view the dense helpers take.
at::Tensor packed_as_bhsd(const at::Tensor& t);

// True when there is nothing for a kernel to do; the caller has already filled the outputs:
// an empty batch/head/query length leaves empty outputs; an empty key length gives out = 0 and lse = -inf
// (softmax over an empty set, as SDPA's math path) or the head's sink, and zero gradients.
bool fwd_is_trivial(const FwdParams& p, at::Tensor& out, at::Tensor& lse, const AttentionOptions& opts);
bool bwd_is_trivial(const at::Tensor& query, const at::Tensor& key, at::Tensor& grad_query, at::Tensor& grad_key,
                    at::Tensor& grad_value);

// ---- KV-cache calls (paged_kv.h), flash-attn's flash_attn_with_kvcache layout ----
// query (batch, seqlen_q, heads_q, head_dim); key_cache/value_cache (cache_batch, capacity, heads_kv, head_dim), or
// (num_pages, page_size, heads_kv, head_dim) with block_table; last dims contiguous.
struct KvCacheArgs {
  at::Tensor cache_seqlens;    // int32 (batch,)
  at::Tensor block_table;      // int32 (batch, max_pages), or undefined (dense cache)
  at::Tensor cache_batch_idx;  // int32 (batch,), or undefined
  at::Tensor cache_leftpad;    // int32 (batch,), or undefined
  int64_t num_splits = 0;      // 0: the heuristic's choice (CUDA)
  bool paged() const { return block_table.defined(); }
};

KvCacheArgs make_kvcache_args(const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& block_table,
                              const std::optional<at::Tensor>& cache_batch_idx,
                              const std::optional<at::Tensor>& cache_leftpad, int64_t num_splits);

// Shapes, dtypes, devices and options, naming the argument; the index tensors' values too when they are on the
// CPU (on CUDA that would need a sync: the kernel clamps them instead, paged_kv.h).
void check_kvcache_inputs(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                          const KvCacheArgs& args, const AttentionOptions& opts, const BackendLimits& limits);

// out like query, lse (batch, heads_q, seqlen_q) float32 (float64 for float64 inputs).
std::tuple<at::Tensor, at::Tensor> alloc_kvcache_outputs(const at::Tensor& query);

// Outputs of rows that see no key: out 0, lse the sink's logit (sinks given) or -inf, as the kernels' finalize.
// out/lse may be views (one batch entry's rows).
void fill_no_key_outputs(at::Tensor& out, at::Tensor& lse, const AttentionOptions& opts);

// The params of a KV-cache call (mask aligned bottom-right; f.seqlen_k = the capacity).
DecodeParams make_decode_params(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                const at::Tensor& out, const at::Tensor& lse, const KvCacheArgs& args,
                                const AttentionOptions& opts);

// The params of a varlen forward run by the KV-cache kernel: one query per sequence (query/out (batch, heads_q,
// dim)), the packed keys one cache row whose entries start at cu_seqlens_k (paged_kv.h), lse (heads_q, batch).
DecodeParams make_varlen_decode_params(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                       const at::Tensor& out, const at::Tensor& lse, const VarlenArgs& args,
                                       const AttentionOptions& opts);

}  // namespace flashcore
