// Plain-old-data descriptions of one attention call, shared by the host code, the CPU kernels and the CUDA
// kernels (this header is included by nvcc too, so it holds no torch types).
//
// Layout contract: every tensor is addressed as logical (batch, head, seq, dim) through element strides; the
// last dim is contiguous (stride 1). BHSD and BSHD inputs are the same thing to a kernel: only strides differ.
// Grouped-query attention: query head h reads key/value head h / group, where group = heads_q / heads_kv, so
// K and V are never copied per query head.
#pragma once

#include <cstdint>

#include "macros.h"
#include "mask.h"
#include "score_mod.h"
#include "seqlen.h"

namespace flashcore {

// Division by a divisor fixed for a call, as a multiply-high, an add and a shift (the round-up method of
// Granlund and Montgomery, "Division by invariant integers using multiplication", PLDI 1994): the kernels split
// tile indices into (batch, head, query block) at their start, on the critical path of a small call, where each
// 64-bit division by a runtime value cost ~140 cycles (H100 timeline, docs/PERFORMANCE.md).
// Exact for dividends in [0, 2^31) and divisors in [1, 2^31) (the host keeps every index below 2^31).
struct FastDiv {
  uint32_t divisor = 1;
  uint32_t multiplier = 1;  // with shift: floor(2^(32 + shift) / divisor) - 2^32 + 1
  uint32_t shift = 0;

  FastDiv() = default;
  // Divisors outside [1, 2^31) (zero heads, or 2^31 or more heads of empty tensors, which no kernel is launched
  // for) become 1, so building the params never divides by zero or shifts by 32.
  explicit FastDiv(int64_t d) {
    divisor = (d < 1 || d >= (int64_t(1) << 31)) ? 1u : (uint32_t)d;
    while ((uint64_t(1) << shift) < divisor) ++shift;  // ceil(log2(divisor))
    multiplier = (uint32_t)(((uint64_t(1) << 32) * ((uint64_t(1) << shift) - divisor)) / divisor + 1);
  }
  FLASHCORE_HOST_DEVICE uint32_t div(uint32_t x) const {
#if defined(__CUDA_ARCH__)
    const uint32_t hi = __umulhi(x, multiplier);
#else
    const uint32_t hi = (uint32_t)(((uint64_t)x * multiplier) >> 32);
#endif
    return (hi + x) >> shift;  // hi < x < 2^31: no overflow
  }
  // x = quotient * divisor + remainder.
  FLASHCORE_HOST_DEVICE uint32_t divmod(uint32_t x, uint32_t& remainder) const {
    const uint32_t q = div(x);
    remainder = x - q * divisor;
    return q;
  }
};

// Element strides of one (batch, head, seq, dim) tensor whose dim stride is 1.
struct Strides {
  int64_t batch = 0;
  int64_t head = 0;
  int64_t seq = 0;
};

// Pack-GQA (the Hopper varlen forward; sm90/fwd_sm90_launch.cuh picks it): `heads` query heads of one key/value
// head share a block, whose kBlockM rows are `rows` = kBlockM / heads queries of each (block row r is query
// m0 + r % rows of head h0 + r / rows), so the block reads its K/V tiles once for all of them and a short sequence
// fills the block's rows. rows is a multiple of 16, so each warp's m16 rows are one head's. heads 1: one query head
// a block. No other kernel reads it.
struct PackGqa {
  int heads = 1;
  int rows = 0;
  FastDiv groups_div;  // heads_q / heads: the grid's head groups
};

struct FwdParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  float* lse = nullptr;     // (batch, heads_q, seqlen_q), contiguous, natural-log units
  double* lse64 = nullptr;  // instead of lse for float64 inputs (CPU): the float64 path keeps float64 exactness

  Strides q_stride, k_stride, v_stride, out_stride;

  int64_t batch = 0;
  int64_t heads_q = 0;
  int64_t heads_kv = 0;
  int64_t group = 1;  // heads_q / heads_kv
  int64_t seqlen_q = 0;
  int64_t seqlen_k = 0;
  int64_t head_dim = 0;
  // heads_q, heads_kv and group as FastDiv divisors, set with them (make_fwd_params).
  FastDiv heads_q_div, heads_kv_div, group_div;

  float scale = 1.f;       // softmax scale applied to q.k
  float scale_log2 = 1.f;  // scale * log2(e): kernels exponentiate with exp2
  double scale_fp64 = 1.0;  // the same scale unrounded, for float64 inputs (the gradcheck path)

  // Which keys each query sees (mask.h): the rule from the op's arguments, and its band for this call's lengths
  // (mask.band(seqlen_q, seqlen_k), set with them by make_fwd_params). Kernels read the band from their
  // parameters (constant memory: no registers held across their loops). A query row that sees no key gets
  // out = 0 and lse = -inf.
  MaskParams mask;
  Band band;

  // Softcap, ALiBi and sinks (score_mod.h).
  ScoreParams score;

  PackGqa pack;

  // Variable-length batches (seqlen.h): set, the tensors are packed along the sequence (batch strides 0),
  // seqlen_q/seqlen_k are the max lengths, lse is (heads_q, total_q), and each entry's lengths and band come from
  // seq(b) and band_of(). Dense calls never read it.
  VarlenParams varlen;

  FLASHCORE_HOST_DEVICE SeqInfo seq(int64_t b) const {
    if (varlen.enabled()) return varlen_seq_info(varlen, b, seqlen_q, seqlen_k);
    SeqInfo s;
    s.seqlen_q = seqlen_q;
    s.seqlen_k = seqlen_k;
    return s;
  }
  FLASHCORE_HOST_DEVICE Band band_of(const SeqInfo& s) const {
    return varlen.enabled() ? mask.band(s.seqlen_q, s.seqlen_k) : band;
  }
  // Index in lse (and in any per-row workspace laid out like it) of row 0 of (b, h)'s sequence s.
  FLASHCORE_HOST_DEVICE int64_t row_index(const SeqInfo& s, int64_t b, int64_t h) const {
    return varlen.enabled() ? h * varlen.total_q + s.q_begin : (b * heads_q + h) * seqlen_q;
  }
  // Rows of lse: batch * heads_q * seqlen_q, or heads_q * total_q.
  FLASHCORE_HOST_DEVICE int64_t rows_total() const {
    return varlen.enabled() ? heads_q * varlen.total_q : batch * heads_q * seqlen_q;
  }
};

struct BwdParams : FwdParams {
  const void* dout = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  Strides dout_stride, dq_stride, dk_stride, dv_stride;
  // Bitwise-reproducible gradients run to run (no floating-point atomics whose order varies).
  bool deterministic = false;
  // The deterministic Hopper backward (dense): a zeroed int32 flag a (batch, query head, query tile) that orders the
  // key blocks' dQ reductions of the tile by key block (sm90/bwd_sm90_producer.cuh); nullptr otherwise.
  int* dq_turns = nullptr;
  // The Hopper backward (dense): an int32 countdown a (batch, query head, query tile of the kernel's kBlockM rows),
  // set by the pre-pass to the number of key blocks that add to the tile; each block's dQ writer counts its tiles
  // down once all its reductions are complete, and the dQ post-pass, launched to overlap the kernel's last wave,
  // converts a tile once it reads zero (bwd_dq_convert.cu). nullptr otherwise.
  int* dq_tiles_pending = nullptr;
};

}  // namespace flashcore
