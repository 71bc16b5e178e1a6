// CPU dispatch-key implementations of the flashcore ops: shared validation (attention_host.h), then the CPU
// kernels (kernels_cpu.h).
#include <ATen/ATen.h>
#include <torch/library.h>


#include "../attention_host.h"
#include "../kernel_trace.h"
#include "kernels_cpu.h"

namespace flashcore {
namespace {

constexpr BackendLimits kCpuLimits{"CPU", /*allow_fp32_fp64=*/true, /*max_head_dim=*/256, /*head_dim_multiple=*/1};

std::tuple<at::Tensor, at::Tensor> fwd_cpu(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                           double softmax_scale, bool is_causal, bool causal_bottom_right,
                                           int64_t window_left, int64_t window_right, double softcap,
                                           bool /*deterministic: only the backward's*/,
                                           const std::optional<at::Tensor>& sinks,
                                           const std::optional<at::Tensor>& alibi_slopes) {
  const AttentionOptions opts = make_options(softmax_scale, is_causal, causal_bottom_right, window_left,
                                             window_right, softcap, sinks, alibi_slopes);
  check_fwd_inputs(query, key, value, opts, kCpuLimits);
  auto [out, lse] = alloc_fwd_outputs(query);
  const FwdParams p = make_fwd_params(query, key, value, out, lse, opts);
  if (!fwd_is_trivial(p, out, lse, opts)) {
    record_kernel(Pass::kFwd, KernelTrace{"cpu"});
    cpu::fwd_kernel(p, query.scalar_type());
  }
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_cpu(const at::Tensor& grad_out, const at::Tensor& query,
                                                       const at::Tensor& key, const at::Tensor& value,
                                                       const at::Tensor& out, const at::Tensor& lse,
                                                       double softmax_scale, bool is_causal,
                                                       bool causal_bottom_right, int64_t window_left,
                                                       int64_t window_right, double softcap, bool deterministic,
                                                       const std::optional<at::Tensor>& alibi_slopes) {
  const AttentionOptions opts = make_options(softmax_scale, is_causal, causal_bottom_right, window_left,
                                             window_right, softcap, std::nullopt, alibi_slopes);
  check_bwd_inputs(grad_out, query, key, value, out, lse, opts, kCpuLimits);
  auto [grad_query, grad_key, grad_value] = alloc_bwd_outputs(query, key, value);
  if (bwd_is_trivial(query, key, grad_query, grad_key, grad_value)) return {grad_query, grad_key, grad_value};
  const BwdParams p = make_bwd_params(grad_out, query, key, value, out, lse, grad_query, grad_key, grad_value,
                                      opts, deterministic);
  record_kernel(Pass::kBwd, KernelTrace{"cpu"});
  cpu::bwd_kernel(p, query.scalar_type());
  return {grad_query, grad_key, grad_value};
}

std::tuple<at::Tensor, at::Tensor> varlen_fwd_cpu(const at::Tensor& query, const at::Tensor& key,
                                                  const at::Tensor& value, const at::Tensor& cu_seqlens_q,
                                                  const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                                                  int64_t max_seqlen_k, double softmax_scale, bool is_causal,
                                                  int64_t window_left, int64_t window_right, double softcap,
                                                  bool /*deterministic*/, const std::optional<at::Tensor>& sinks,
                                                  const std::optional<at::Tensor>& alibi_slopes,
                                                  const std::optional<at::Tensor>& seqused_k) {
  const AttentionOptions opts = make_options(softmax_scale, is_causal, /*causal_bottom_right=*/true, window_left,
                                             window_right, softcap, sinks, alibi_slopes);
  const VarlenArgs args = make_varlen_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k);
  check_varlen_fwd_inputs(query, key, value, args, opts, kCpuLimits);
  auto [out, lse] = alloc_varlen_fwd_outputs(query);
  // Rows before the first sequence or after the last (validated offsets): no kernel visits them; 0, as a row that
  // sees no key (lse is -inf there already).
  const at::Tensor cu = cu_seqlens_q.contiguous();
  const int64_t first = cu.data_ptr<int32_t>()[0], last = cu.data_ptr<int32_t>()[cu.numel() - 1];
  out.narrow(0, 0, first).zero_();
  out.narrow(0, last, out.size(0) - last).zero_();
  const FwdParams p = make_varlen_fwd_params(query, key, value, out, lse, args, opts);
  if (!varlen_fwd_is_trivial(p, out)) {
    record_kernel(Pass::kFwd, KernelTrace{"cpu"});
    cpu::fwd_kernel(p, query.scalar_type());
  }
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_bwd_cpu(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
    int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale, bool is_causal, int64_t window_left,
    int64_t window_right, double softcap, bool deterministic, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& seqused_k) {
  const AttentionOptions opts = make_options(softmax_scale, is_causal, /*causal_bottom_right=*/true, window_left,
                                             window_right, softcap, std::nullopt, alibi_slopes);
  const VarlenArgs args = make_varlen_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k);
  check_varlen_bwd_inputs(grad_out, query, key, value, out, lse, args, opts, kCpuLimits);
  auto [grad_query, grad_key, grad_value] = alloc_varlen_bwd_outputs(query, key, value);
  if (query.numel() == 0 || key.numel() == 0 || args.batch() == 0) {
    grad_query.zero_();  // the kernel, which writes every row of grad_query, does not run
    return {grad_query, grad_key, grad_value};
  }
  const BwdParams p = make_varlen_bwd_params(grad_out, query, key, value, out, lse, grad_query, grad_key, grad_value,
                                             args, opts, deterministic);
  record_kernel(Pass::kBwd, KernelTrace{"cpu"});
  cpu::bwd_kernel(p, query.scalar_type());
  return {grad_query, grad_key, grad_value};
}

// One call of the CPU forward kernel per batch entry, on that entry's keys as a (1, heads_kv, keys, head_dim) view
// of the cache (a paged cache's pages are gathered first).
std::tuple<at::Tensor, at::Tensor> kvcache_fwd_cpu(
    const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
    const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& block_table,
    const std::optional<at::Tensor>& cache_batch_idx, const std::optional<at::Tensor>& cache_leftpad,
    double softmax_scale, bool is_causal, int64_t window_left, int64_t window_right, double softcap,
    const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& alibi_slopes, int64_t num_splits) {
  const AttentionOptions opts = make_options(softmax_scale, is_causal, /*causal_bottom_right=*/true, window_left,
                                             window_right, softcap, sinks, alibi_slopes);
  const KvCacheArgs args = make_kvcache_args(cache_seqlens, block_table, cache_batch_idx, cache_leftpad, num_splits);
  check_kvcache_inputs(query, key_cache, value_cache, args, opts, kCpuLimits);
  auto [out, lse] = alloc_kvcache_outputs(query);
  if (query.numel() == 0) return {out, lse};
  record_kernel(Pass::kFwd, KernelTrace{"cpu"});
  const DecodeParams dp = make_decode_params(query, key_cache, value_cache, out, lse, args, opts);
  for (int64_t b = 0; b < query.size(0); ++b) {
    const KvSeq s = kv_seq(dp.kv, b);
    auto keys_of = [&](const at::Tensor& cache) {  // (seqlen_k, heads_kv, head_dim)
      if (!args.paged()) return cache[s.cache_row].narrow(0, s.first_key, s.seqlen_k);
      const int64_t pages = (s.first_key + s.seqlen_k + dp.kv.page_size - 1) / dp.kv.page_size;
      const at::Tensor table = args.block_table[b].narrow(0, 0, pages).to(at::kLong);
      return cache.index_select(0, table).flatten(0, 1).narrow(0, s.first_key, s.seqlen_k);
    };
    const at::Tensor k = keys_of(key_cache).unsqueeze(0).transpose(1, 2);
    const at::Tensor v = keys_of(value_cache).unsqueeze(0).transpose(1, 2);
    at::Tensor q_b = query.narrow(0, b, 1).transpose(1, 2);
    at::Tensor out_b = out.narrow(0, b, 1).transpose(1, 2);
    at::Tensor lse_b = lse.narrow(0, b, 1);
    AttentionOptions entry = opts;
    if (entry.alibi_slopes.defined() && entry.alibi_slopes.dim() == 2)
      entry.alibi_slopes = entry.alibi_slopes.narrow(0, b, 1);
    if (s.seqlen_k == 0) {
      fill_no_key_outputs(out_b, lse_b, opts);
      continue;
    }
    const FwdParams p = make_fwd_params(q_b, k, v, out_b, lse_b, entry);
    cpu::fwd_kernel(p, query.scalar_type());
  }
  return {out, lse};
}

std::string fwd_kernel_name_cpu(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool) { return "cpu"; }
std::string bwd_kernel_name_cpu(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, bool) {
  return "cpu";
}

}  // namespace

TORCH_LIBRARY_IMPL(flashcore, CPU, m) {
  m.impl("fwd", &fwd_cpu);
  m.impl("bwd", &bwd_cpu);
  m.impl("varlen_fwd", &varlen_fwd_cpu);
  m.impl("varlen_bwd", &varlen_bwd_cpu);
  m.impl("kvcache_fwd", &kvcache_fwd_cpu);
  m.impl("fwd_kernel_name", &fwd_kernel_name_cpu);
  m.impl("bwd_kernel_name", &bwd_kernel_name_cpu);
}

}  // namespace flashcore
