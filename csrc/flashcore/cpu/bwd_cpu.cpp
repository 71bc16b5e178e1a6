// CPU backward: FlashAttention-2's structure, parallel over key blocks. With P = exp(scale Q K^T - lse) rebuilt
// from the saved log-sum-exp (no seqlen_q x seqlen_k buffer) and delta_i = dO_i . O_i:
//   dV = P^T dO,   dP = dO V^T,   dS = P o (dP - delta),   dK = scale dS^T Q,   dQ = scale dS K.
// One task owns (batch, key/value head, chunk of key blocks) and walks every query head of its GQA group and
// every query block, so dK and dV of its keys are summed in registers/scratch and written once, with no atomics.
// dQ is summed across key blocks: each key chunk adds into its own fp32/fp64 partial buffer, and a final pass adds
// the partials in chunk order. The chunking depends on the shape only, so the same inputs give the same bits
// whatever the thread count, and the `deterministic` flag costs nothing here. Chunks exist to find parallelism
// when batch x kv heads is small. Variable-length batches (seqlen.h) run the same tasks on each entry's sequence
// (p.seq(b)); per-row buffers follow lse's layout (p.row_index), and key blocks past a sequence's end are skipped
// (the caller zeroes dK/dV rows outside every sequence).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>
#include <type_traits>

#include "../attention_host.h"  // poison_if_enabled
#include "kernels_cpu.h"
#include "microkernel_cpu.h"

namespace flashcore::cpu {
namespace {

constexpr int64_t kQueryBlock = 64;
constexpr int64_t kKeyBlock = 64;
constexpr int64_t kMinTasks = 32;
constexpr int64_t kMaxPartialBytes = int64_t(256) << 20;

template <typename T>
T alibi_slope(const FwdParams& p, int64_t b, int64_t h) {
  const ScoreParams& sp = p.score;
  return sp.alibi_slopes ? static_cast<T>(sp.alibi_slopes[b * sp.alibi_stride_batch + h * sp.alibi_stride_head])
                         : T(0);
}

template <typename Ops, typename S, typename T>
void bwd_impl(const BwdParams& p, c10::ScalarType acc_dtype) {
  const int64_t D = p.head_dim;
  const int64_t Dp = round_up(D, kPad);
  const int64_t ld = round_up(kKeyBlock, kPad);  // row length of K^T, V^T, S/P and dP/dS
  const int64_t key_blocks = (p.seqlen_k + kKeyBlock - 1) / kKeyBlock;
  const int64_t heads = p.batch * p.heads_kv;
  // Split keys into chunks only when batch x kv heads gives fewer than kMinTasks tasks; the split depends on the
  // shape alone (never on the thread count), so the dQ summation order and hence the bits are fixed. The dQ
  // partials are capped at kMaxPartialBytes.
  const int64_t rows_total = p.rows_total();  // lse's rows; per-row buffers and dQ partials share its layout
  const int64_t dq_bytes = std::max<int64_t>(1, rows_total * Dp * int64_t(sizeof(T)));
  const int64_t chunk_cap = std::max<int64_t>(1, kMaxPartialBytes / dq_bytes);
  const int64_t chunks =
      std::clamp<int64_t>((kMinTasks + heads - 1) / heads, 1, std::min(key_blocks, chunk_cap));
  const int64_t blocks_per_chunk = (key_blocks + chunks - 1) / chunks;
  const T scale = std::is_same_v<T, double> ? static_cast<T>(p.scale_fp64) : static_cast<T>(p.scale);
  const T cap = std::is_same_v<T, double> ? static_cast<T>(p.score.softcap_fp64) : static_cast<T>(p.score.softcap);

  // delta_i = dO_i . O_i, and lse with "+inf" for rows that saw no key (P = exp(s - inf) = 0 there).
  at::Tensor row_stats = at::empty({2, rows_total}, at::TensorOptions().dtype(acc_dtype));
  poison_if_enabled({row_stats});  // every row of every sequence is written below, and only those are read
  T* delta = row_stats.data_ptr<T>();
  T* lse = delta + rows_total;
  at::parallel_for(0, p.batch * p.heads_q, 1, [&](int64_t begin, int64_t end) {
    Scratch<T> scratch(Dp);
    T* o_row = scratch.take(Dp);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / p.heads_q, h = bh % p.heads_q;
      const SeqInfo seq = p.seq(b);
      const int64_t r0 = p.row_index(seq, b, h);
      const S* o = static_cast<const S*>(p.out) + b * p.out_stride.batch + h * p.out_stride.head +
                   seq.q_begin * p.out_stride.seq;
      const S* dout = static_cast<const S*>(p.dout) + b * p.dout_stride.batch + h * p.dout_stride.head +
                      seq.q_begin * p.dout_stride.seq;
      for (int64_t i = 0; i < seq.seqlen_q; ++i) {
        Ops::pack_rows(o + i * p.out_stride.seq, 0, 1, D, T(1), o_row, Dp, 1);
        Ops::row_dots(o_row, Dp, dout + i * p.dout_stride.seq, 0, 1, D, delta + r0 + i);
        // float64 inputs come with a float64 lse (attention_host.cpp), so their gradients keep float64 exactness
        const T l = p.lse64 ? static_cast<T>(p.lse64[r0 + i]) : static_cast<T>(p.lse[r0 + i]);
        lse[r0 + i] = l == -std::numeric_limits<T>::infinity() ? std::numeric_limits<T>::infinity() : l;
      }
    }
  });


  // dQ partial sums: (chunks, rows of lse, Dp).
  const int64_t dq_rows = rows_total;
  at::Tensor dq_partial = at::zeros({chunks, dq_rows, Dp}, at::TensorOptions().dtype(acc_dtype));
  T* dq_acc_all = dq_partial.data_ptr<T>();

  at::parallel_for(0, heads * chunks, 1, [&](int64_t begin, int64_t end) {
    Scratch<T> scratch(Scratch<T>::total({D * ld, D * ld, kKeyBlock * Dp, kQueryBlock * Dp, kQueryBlock * Dp,
                                          kQueryBlock * ld, kQueryBlock * ld, kKeyBlock * Dp, kKeyBlock * Dp,
                                          kQueryBlock * ld}));
    T* kt_tile = scratch.take(D * ld);          // K^T, D x ld
    T* vt_tile = scratch.take(D * ld);          // V^T, D x ld
    T* k_tile = scratch.take(kKeyBlock * Dp);   // K, keys x Dp
    T* q_tile = scratch.take(kQueryBlock * Dp);   // scale * Q, rows x Dp
    T* do_tile = scratch.take(kQueryBlock * Dp);  // dO, rows x Dp
    T* s_tile = scratch.take(kQueryBlock * ld);   // S, then P
    T* dp_tile = scratch.take(kQueryBlock * ld);  // dP, then dS
    T* dk_acc = scratch.take(kKeyBlock * Dp);
    T* dv_acc = scratch.take(kKeyBlock * Dp);
    T* dtanh_tile = scratch.take(kQueryBlock * ld);  // softcap: d logit / d(scale q.k) = 1 - tanh^2

    for (int64_t task = begin; task < end; ++task) {
      const int64_t chunk = task % chunks;
      const int64_t hk = (task / chunks) % p.heads_kv;
      const int64_t b = task / (chunks * p.heads_kv);
      T* dq_acc = dq_acc_all + chunk * dq_rows * Dp;
      const SeqInfo seq = p.seq(b);
      const Band band = p.band_of(seq);
      const int64_t alibi_offset = seq.seqlen_k - seq.seqlen_q;
      const S* k = static_cast<const S*>(p.k) + b * p.k_stride.batch + hk * p.k_stride.head +
                   seq.k_begin * p.k_stride.seq;
      const S* v = static_cast<const S*>(p.v) + b * p.v_stride.batch + hk * p.v_stride.head +
                   seq.k_begin * p.v_stride.seq;
      S* dk = static_cast<S*>(p.dk) + b * p.dk_stride.batch + hk * p.dk_stride.head + seq.k_begin * p.dk_stride.seq;
      S* dv = static_cast<S*>(p.dv) + b * p.dv_stride.batch + hk * p.dv_stride.head + seq.k_begin * p.dv_stride.seq;

      const int64_t kb_end = std::min(key_blocks, (chunk + 1) * blocks_per_chunk);
      for (int64_t kb = chunk * blocks_per_chunk; kb < kb_end; ++kb) {
        const int64_t j0 = kb * kKeyBlock;
        if (j0 >= seq.seqlen_k) break;  // past a varlen sequence's end
        const int64_t keys = std::min(kKeyBlock, seq.seqlen_k - j0);
        const int64_t cols = round_up(keys, kPad);
        Ops::pack_transposed(k + j0 * p.k_stride.seq, p.k_stride.seq, keys, D, kt_tile, ld);
        Ops::pack_transposed(v + j0 * p.v_stride.seq, p.v_stride.seq, keys, D, vt_tile, ld);
        Ops::pack_rows(k + j0 * p.k_stride.seq, p.k_stride.seq, keys, D, T(1), k_tile, Dp, keys);
        std::fill(dk_acc, dk_acc + keys * Dp, T(0));
        std::fill(dv_acc, dv_acc + keys * Dp, T(0));

        // Query blocks that see no key of this block (the mask's band) are skipped.
        const IndexRange query_tiles = band.query_tiles_of_keys(j0, j0 + keys, seq.seqlen_q, kQueryBlock);
        for (int64_t h = hk * p.group; h < (hk + 1) * p.group; ++h) {
          const int64_t r0 = p.row_index(seq, b, h);
          const S* q = static_cast<const S*>(p.q) + b * p.q_stride.batch + h * p.q_stride.head +
                       seq.q_begin * p.q_stride.seq;
          const S* dout = static_cast<const S*>(p.dout) + b * p.dout_stride.batch + h * p.dout_stride.head +
                          seq.q_begin * p.dout_stride.seq;
          const T slope = alibi_slope<T>(p, b, h);
          const bool softcap = p.score.softcap > 0.f, mod = softcap || slope != T(0);
          for (int64_t i0 = query_tiles.begin * kQueryBlock; i0 < query_tiles.end * kQueryBlock;
               i0 += kQueryBlock) {
            const int64_t rows = std::min(kQueryBlock, seq.seqlen_q - i0);
            Ops::pack_rows(q + i0 * p.q_stride.seq, p.q_stride.seq, rows, D, scale, q_tile, Dp, rows);
            Ops::pack_rows(dout + i0 * p.dout_stride.seq, p.dout_stride.seq, rows, D, T(1), do_tile, Dp, rows);

            Ops::template gemm<GemmMode::kStore>(rows, cols, D, q_tile, Dp, 1, kt_tile, ld, s_tile, ld);
            Ops::template gemm<GemmMode::kStore>(rows, cols, D, do_tile, Dp, 1, vt_tile, ld, dp_tile, ld);
            if (mod) Ops::score_mod(s_tile, ld, rows, cols, cap, slope, i0, j0,
                                    alibi_offset, softcap ? dtanh_tile : static_cast<T*>(nullptr));
            const BlockMask mask(band, i0, j0, keys);
            Ops::softmax_grad(s_tile, dp_tile, ld, rows, cols, mask, lse + r0 + i0, delta + r0 + i0);
            if (softcap) Ops::multiply(dp_tile, dtanh_tile, rows * ld);  // dS on scale q.k

            // dV += P^T dO and dK += dS^T (scale Q): the A operand read transposed (a_row = 1, a_col = ld).
            Ops::template gemm<GemmMode::kAccumulate>(keys, Dp, rows, s_tile, 1, ld, do_tile, Dp, dv_acc, Dp);
            Ops::template gemm<GemmMode::kAccumulate>(keys, Dp, rows, dp_tile, 1, ld, q_tile, Dp, dk_acc, Dp);
            // dQ (unscaled) += dS K.
            Ops::template gemm<GemmMode::kAccumulate>(rows, Dp, keys, dp_tile, ld, 1, k_tile, Dp,
                                                      dq_acc + (r0 + i0) * Dp, Dp);
          }
        }
        Ops::store_rows(dk_acc, Dp, keys, D, static_cast<const T*>(nullptr), T(1), dk + j0 * p.dk_stride.seq,
                        p.dk_stride.seq);
        Ops::store_rows(dv_acc, Dp, keys, D, static_cast<const T*>(nullptr), T(1), dv + j0 * p.dv_stride.seq,
                        p.dv_stride.seq);
      }
      // A key block that no query sees still writes zeros above, so every dK/dV row is defined.
    }
  });

  // dQ = scale * sum over chunks, in chunk order; partials are added into chunk 0.
  at::parallel_for(0, dq_rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      T* acc = dq_acc_all + row * Dp;
      for (int64_t c = 1; c < chunks; ++c) {
        const T* part = dq_acc_all + (c * dq_rows + row) * Dp;
        for (int64_t d = 0; d < D; ++d) acc[d] += part[d];
      }
      // Row -> (b, h, i) of lse's layout: (batch, heads_q, seqlen_q), or (heads_q, total_q) packed.
      const int64_t len = p.varlen.enabled() ? p.varlen.total_q : p.seqlen_q;
      const int64_t i = row % len;
      const int64_t h = (row / len) % p.heads_q;
      const int64_t b = p.varlen.enabled() ? 0 : row / (len * p.heads_q);
      S* dq = static_cast<S*>(p.dq) + b * p.dq_stride.batch + h * p.dq_stride.head + i * p.dq_stride.seq;
      Ops::store_rows(acc, Dp, 1, D, static_cast<const T*>(nullptr), scale, dq, 0);
    }
  });
}

template <typename Ops>
void bwd_dispatch(const BwdParams& p, c10::ScalarType dtype) {
  switch (dtype) {
    case c10::ScalarType::Float: return bwd_impl<Ops, float, float>(p, at::kFloat);
    case c10::ScalarType::Double: return bwd_impl<Ops, double, double>(p, at::kDouble);
    case c10::ScalarType::Half: return bwd_impl<Ops, c10::Half, float>(p, at::kFloat);
    case c10::ScalarType::BFloat16: return bwd_impl<Ops, c10::BFloat16, float>(p, at::kFloat);
    default: TORCH_CHECK(false, "flashcore: CPU backward has no kernel for dtype ", dtype);
  }
}

}  // namespace

void bwd_kernel(const BwdParams& p, c10::ScalarType dtype) {
#if FLASHCORE_CPU_HAVE_AVX2
  if (use_avx2_fma()) return bwd_dispatch<avx2::BlockOps>(p, dtype);
#endif
  bwd_dispatch<portable::BlockOps>(p, dtype);
}

}  // namespace flashcore::cpu
