// Rows of a packed varlen output that no sequence covers (before cu_seqlens_q[0], from cu_seqlens_q[batch] on): the
// attention kernels never visit them, and they become 0 here, as a row that sees no key does (lse is -inf there
// already). cu_seqlens_q is read on the device: no sync; offsets past total_q are clamped.
#pragma once

#include <ATen/ATen.h>

namespace flashcore::cuda {

// out: (total_q, heads, head_dim) 16-bit, unit-stride last dim; cu_seqlens_q: int32 (batch + 1,) on out's device.
void zero_rows_outside_sequences(at::Tensor& out, const at::Tensor& cu_seqlens_q);

}  // namespace flashcore::cuda
