// CPU kernels: the blocked online-softmax algorithm (no seq_q x seq_k buffer), parallel over
// batch x heads x query blocks with at::parallel_for. fp32 accumulation for float16/bfloat16/float32 inputs,
// fp64 for float64. Preconditions (checked by the caller, attention_cpu.cpp): params describe validated,
// non-empty tensors (batch, heads_q, seqlen_q, seqlen_k, head_dim all > 0).
#pragma once

#include <c10/core/ScalarType.h>

#include "../params.h"

namespace flashcore::cpu {

// Writes p.out and p.lse.
void fwd_kernel(const FwdParams& p, c10::ScalarType dtype);

// Writes p.dq, p.dk, p.dv from p.dout, p.q, p.k, p.v, p.out and p.lse. Deterministic whatever p.deterministic
// says (no atomics: dk/dv are reduced over the query heads of a group by the thread that owns the key block).
void bwd_kernel(const BwdParams& p, c10::ScalarType dtype);

}  // namespace flashcore::cpu
