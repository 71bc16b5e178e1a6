// CPU forward: FlashAttention's blocked online softmax. One task is one (batch, query head, block of kQueryBlock
// queries), or a GQA group's query heads where their queries fit one block (heads_per_task); it walks the key
// blocks left to right keeping the running row max m, the running sum l and the unnormalized output O in a
// per-thread fp32 (fp64 for float64) workspace, so nothing of size seqlen_q x seqlen_k exists. Per key block:
//   S = (scale Q) K^T                 gemm, K packed transposed (head_dim x keys); for a few float32/64 rows,
//                                     dot products with K's rows in place (scores_from_key_rows)
//   m', l', P = exp(S - m')           BlockOps::softmax_update (masked scores -> P = 0)
//   O = diag(exp(m - m')) O + P V     gemm with the rescale fused into its accumulator load
// and at the end out = O / l, lse = m + log(l) (out = 0, lse = -inf for a row that saw no key).
// Variable-length batches (seqlen.h) run the same tasks: each entry's sequence comes from p.seq(b), and query
// blocks past its end are skipped.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>
#include <type_traits>

#include "kernels_cpu.h"
#include "microkernel_cpu.h"

namespace flashcore::cpu {
namespace {

// 64 x 64 blocks keep the working set (Q, K^T, V, S, O: 5 x 64 x 128 floats = 160 KiB at head_dim 128) in L2.
constexpr int64_t kQueryBlock = 64;
constexpr int64_t kKeyBlock = 64;

// Query heads a task takes together. Where every query of a GQA group's heads fits one block (a decode step, a
// short chunk), the group shares a task: row r of the block is query r % n of head h0 + r / n (n queries a head),
// so each key block is packed (K transposed, V) once for the group instead of once per query head, and the GEMMs
// get group x n rows instead of n. Not with ALiBi (a slope per head, score_mod takes one per block), nor where the
// packed tasks would leave threads idle.
int64_t heads_per_task(const FwdParams& p) {
  const bool fits = p.group > 1 && p.seqlen_q * p.group <= kQueryBlock && p.score.alibi_slopes == nullptr;
  return fits && p.batch * p.heads_kv >= at::get_num_threads() ? p.group : 1;
}

template <typename Ops, typename S, typename T>
void fwd_impl(const FwdParams& p) {
  const int64_t D = p.head_dim;
  const int64_t Dp = round_up(D, kPad);
  const int64_t ldk = round_up(kKeyBlock, kPad);  // row length of K^T and S
  const int64_t g = heads_per_task(p);
  const int64_t head_rows = kQueryBlock / g;      // queries of one head in a block
  const int64_t q_blocks = (p.seqlen_q + head_rows - 1) / head_rows;
  const int64_t head_groups = p.heads_q / g;
  const int64_t tasks = p.batch * head_groups * q_blocks;
  const T scale = std::is_same_v<T, double> ? static_cast<T>(p.scale_fp64) : static_cast<T>(p.scale);
  const T cap = std::is_same_v<T, double> ? static_cast<T>(p.score.softcap_fp64) : static_cast<T>(p.score.softcap);
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();
  const ScoreParams& sp = p.score;

  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    Scratch<T> scratch(Scratch<T>::total(
        {kQueryBlock * Dp, D * ldk, kKeyBlock * Dp, kQueryBlock * ldk, kQueryBlock * Dp, 4 * kQueryBlock}));
    T* q_tile = scratch.take(kQueryBlock * Dp);   // scale * Q, rows x Dp
    T* kt_tile = scratch.take(D * ldk);           // K^T, D x ldk
    T* v_tile = scratch.take(kKeyBlock * Dp);     // V, keys x Dp
    T* s_tile = scratch.take(kQueryBlock * ldk);  // scores, then probabilities
    T* o_acc = scratch.take(kQueryBlock * Dp);    // unnormalized output
    T* row_max = scratch.take(kQueryBlock);
    T* row_sum = scratch.take(kQueryBlock);
    T* alpha = scratch.take(kQueryBlock);
    T* inv_sum = scratch.take(kQueryBlock);

    for (int64_t task = begin; task < end; ++task) {
      const int64_t qb = task % q_blocks;
      const int64_t h0 = (task / q_blocks) % head_groups * g;  // the task's first query head
      const int64_t b = task / (q_blocks * head_groups);
      const int64_t hk = h0 / p.group;
      const int64_t i0 = qb * head_rows;
      const SeqInfo seq = p.seq(b);
      if (i0 >= seq.seqlen_q) continue;  // past a varlen sequence's end
      const int64_t n = std::min(head_rows, seq.seqlen_q - i0);  // queries of each head
      const int64_t rows = g * n;
      const Band band = p.band_of(seq);
      const int64_t alibi_offset = seq.seqlen_k - seq.seqlen_q;

      auto q_of = [&](int64_t h) {
        return static_cast<const S*>(p.q) + b * p.q_stride.batch + h * p.q_stride.head +
               (seq.q_begin + i0) * p.q_stride.seq;
      };
      const S* k = static_cast<const S*>(p.k) + b * p.k_stride.batch + hk * p.k_stride.head +
                   seq.k_begin * p.k_stride.seq;
      const S* v = static_cast<const S*>(p.v) + b * p.v_stride.batch + hk * p.v_stride.head +
                   seq.k_begin * p.v_stride.seq;

      for (int64_t gi = 0; gi < g; ++gi)
        Ops::pack_rows(q_of(h0 + gi), p.q_stride.seq, n, D, scale, q_tile + gi * n * Dp, Dp, n);
      std::fill(o_acc, o_acc + rows * Dp, T(0));
      const T slope = sp.alibi_slopes ? static_cast<T>(sp.alibi_slopes[b * sp.alibi_stride_batch +
                                                                        h0 * sp.alibi_stride_head])
                                      : T(0);  // g == 1 with ALiBi (heads_per_task)
      const bool mod = sp.softcap > 0.f || slope != T(0);
      std::fill(row_max, row_max + rows, kNegInf);
      std::fill(row_sum, row_sum + rows, T(0));

      // Key blocks that no query of this block sees (the mask's band) are skipped entirely.
      const IndexRange key_tiles = Band::tiles(band.keys_of_queries(i0, i0 + n), kKeyBlock);

      for (int64_t j0 = key_tiles.begin * kKeyBlock; j0 < key_tiles.end * kKeyBlock; j0 += kKeyBlock) {
        const int64_t keys = std::min(kKeyBlock, seq.seqlen_k - j0);
        const int64_t cols = round_up(keys, kPad);
        Ops::pack_rows(v + j0 * p.v_stride.seq, p.v_stride.seq, keys, D, T(1), v_tile, Dp, keys);
        // S from K's rows in place for a few float32/float64 rows (kt_tile's first row holds the key row); half
        // inputs keep the transposed copy, whose conversion measured faster than a key row's.
        if (std::is_same_v<S, T> && rows <= Ops::kDotRows) {
          Ops::scores_from_key_rows(q_tile, Dp, rows, k + j0 * p.k_stride.seq, p.k_stride.seq, keys, D, Dp, kt_tile,
                                    s_tile, ldk, cols);
        } else {
          Ops::pack_transposed(k + j0 * p.k_stride.seq, p.k_stride.seq, keys, D, kt_tile, ldk);
          Ops::template gemm<GemmMode::kStore>(rows, cols, D, q_tile, Dp, 1, kt_tile, ldk, s_tile, ldk);
        }
        if (mod) Ops::score_mod(s_tile, ldk, rows, cols, cap, slope, i0, j0, alibi_offset,
                                static_cast<T*>(nullptr));
        const BlockMask mask(band, i0, j0, keys, n);
        Ops::softmax_update(s_tile, ldk, rows, cols, mask, row_max, row_sum, alpha);
        Ops::template gemm<GemmMode::kScaleAccumulate>(rows, Dp, keys, s_tile, ldk, 1, v_tile, Dp, o_acc, Dp,
                                                      alpha);
      }

      // A sink joins each row's sum (and max): o's rescale is exp(m - m'), and a row that saw no key gets
      // lse = sink, out = 0.
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t h = h0 + r / n;
        const T sink = sp.sinks ? static_cast<T>(sp.sinks[h]) : kNegInf;
        T m = row_max[r], sum = row_sum[r], o_scale = T(1);
        if (sink != kNegInf) {
          const T m2 = std::max(m, sink);
          o_scale = std::exp(m - m2);
          sum = sum * o_scale + std::exp(sink - m2);
          m = m2;
        }
        const bool empty = !(sum > T(0));
        inv_sum[r] = empty ? T(0) : o_scale / sum;
        const T l = empty ? kNegInf : m + std::log(sum);
        const int64_t lse_row = p.row_index(seq, b, h) + i0 + r % n;
        if constexpr (std::is_same_v<T, double>)
          p.lse64[lse_row] = l;
        else
          p.lse[lse_row] = static_cast<float>(l);
      }
      for (int64_t gi = 0; gi < g; ++gi) {
        S* out = static_cast<S*>(p.out) + b * p.out_stride.batch + (h0 + gi) * p.out_stride.head +
                 (seq.q_begin + i0) * p.out_stride.seq;
        Ops::store_rows(o_acc + gi * n * Dp, Dp, n, D, inv_sum + gi * n, T(1), out, p.out_stride.seq);
      }
    }
  });
}

template <typename Ops>
void fwd_dispatch(const FwdParams& p, c10::ScalarType dtype) {
  switch (dtype) {
    case c10::ScalarType::Float: return fwd_impl<Ops, float, float>(p);
    case c10::ScalarType::Double: return fwd_impl<Ops, double, double>(p);
    case c10::ScalarType::Half: return fwd_impl<Ops, c10::Half, float>(p);
    case c10::ScalarType::BFloat16: return fwd_impl<Ops, c10::BFloat16, float>(p);
    default: TORCH_CHECK(false, "flashcore: CPU forward has no kernel for dtype ", dtype);
  }
}

}  // namespace

void fwd_kernel(const FwdParams& p, c10::ScalarType dtype) {
#if FLASHCORE_CPU_HAVE_AVX2
  if (use_avx2_fma()) return fwd_dispatch<avx2::BlockOps>(p, dtype);
#endif
  fwd_dispatch<portable::BlockOps>(p, dtype);
}

}  // namespace flashcore::cpu
