// Rows of a packed varlen output that no sequence covers (before cu_seqlens_q[0], from cu_seqlens_q[batch] on): the
// attention kernels never visit them, and they become 0 here, as a row that sees no key does (lse is -inf there
// already). cu_seqlens_q is read on the device: no sync; offsets past total_q are clamped.
#pragma once

#include <ATen/ATen.h>

#include "../seqlen.h"

namespace flashcore::cuda {

// out: (total_q, heads, head_dim) 16-bit, unit-stride last dim; cu_seqlens_q: int32 (batch + 1,) on out's device.
void zero_rows_outside_sequences(at::Tensor& out, const at::Tensor& cu_seqlens_q);

// Rows of the packed key gradients (total_k, heads_kv, head_dim) that no backward block writes: before the first
// sequence, from each sequence's last used key (varlen_seq_info's seqlen_k: cu_seqlens_k, seqused_k and
// max_seqlen_k) to the next sequence's first, and after the last sequence. Without seqused_k these are the rows
// before and after the batch (a padded buffer's tail), zeroed by one small launch instead of a fill of both tensors
// (2 x 68 us at 55 680 rows, 16 heads, head dim 128); with it every sequence may end in a gap, and both tensors are
// filled whole. The backward kernels write every other row of a sequence (a key block with no visible query writes
// zeros). Launch it before the kernels: where offsets overlap (bad input, not checked without a sync) the kernels'
// writes land last. Offsets are clamped as the kernels clamp them, so no write leaves the tensors; offsets whose
// lengths sum past total_k (bad input) can leave rows the packed grid never reaches unwritten.
void zero_key_rows_outside_sequences(at::Tensor& grad_key, at::Tensor& grad_value, const VarlenParams& varlen,
                                     int64_t batch, int64_t max_seqlen_q, int64_t max_seqlen_k);

}  // namespace flashcore::cuda
