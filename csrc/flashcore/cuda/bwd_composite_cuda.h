// Interim CUDA backward: FlashAttention-2's gradient equations evaluated with ATen GEMMs over chunks of query
// rows (float32 math; the seq_q x seq_k matrix is only ever held for one chunk, at most ~512 MiB). Correct for
// every input the forward accepts (GQA, causal both alignments, strides), deterministic, but not fused: the
// fused CUDA backward kernels are issue 5's work and replace this behind the same op.
#pragma once

#include <ATen/core/Tensor.h>

#include "../params.h"

namespace flashcore::cuda {

void bwd_composite(const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
                   const at::Tensor& value, const at::Tensor& out, const at::Tensor& lse, const BwdParams& p,
                   at::Tensor& grad_query, at::Tensor& grad_key, at::Tensor& grad_value);

}  // namespace flashcore::cuda
