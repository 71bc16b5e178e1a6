// Block-level building blocks of the CPU attention kernels (fwd_cpu.cpp, bwd_cpu.cpp): packing inputs into
// fp32/fp64 scratch, a register-blocked GEMM, and the softmax steps of one score block.
//
// Instruction sets. The extension is built with plain -O3 (no -march), so this header compiles its vector code
// twice: once under `#pragma GCC target("avx2,fma")` into namespace flashcore::cpu::avx2, once for the baseline
// target into flashcore::cpu::portable (any GCC/Clang architecture). Each namespace ends in a `BlockOps` struct
// with the same static functions; the kernels are templates over it and pick one at run time (use_avx2_fma()).
// The header includes itself to do so: the outer inclusion holds the target-independent part and instantiates
// the inner part (#else branch) once per target. The pragma has to cover every helper, not only the GEMM:
// a helper compiled for the baseline target and inlined into AVX2 code keeps its SSE lowering of 32-byte
// vectors.
//
// Vectors are GCC vector extensions of 32 bytes (8 floats / 4 doubles). C++ builds contract a * b + c into FMA
// by default (-ffp-contract=fast), which is what makes the AVX2 GEMM loop a chain of vfmadd231ps.
//
// Layouts (all scratch is acc_t, row-major, rows padded to a multiple of kPad elements with zeros):
//   A operand of gemm: element (r, k) at a[r * a_row + k * a_col], read one scalar at a time (broadcast), so a
//                      row-major block (a_row = ld, a_col = 1) and its transpose (a_row = 1, a_col = ld) both work;
//   B operand:         k rows of n contiguous elements (n a multiple of kPad), e.g. K packed transposed as
//                      (head_dim x keys) so that S = Q K^T is a sum of broadcast-FMA rows;
//   C:                 rows of n contiguous elements.
#ifndef FC_ISA_NAMESPACE

#ifndef FLASHCORE_CPU_MICROKERNEL_CPU_H_
#define FLASHCORE_CPU_MICROKERNEL_CPU_H_

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <new>

#include "../mask.h"
#include "../switches.h"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define FLASHCORE_CPU_HAVE_AVX2 1
#else
#define FLASHCORE_CPU_HAVE_AVX2 0
#endif

namespace flashcore::cpu {

// Packed rows are multiples of this many elements: one GEMM column chunk (two vectors: 16 floats; two chunks of
// 8 doubles), so the micro-kernel never needs a column tail.
constexpr int64_t kPad = 16;
// Rows per micro-kernel call: 6 rows x 2 vectors = 12 accumulators + 2 B vectors + 1 broadcast = 15 of the 16
// ymm registers.
constexpr int kGemmRows = 6;

inline int64_t round_up(int64_t x, int64_t multiple) { return (x + multiple - 1) / multiple * multiple; }

enum class GemmMode {
  kStore,            // C = A B
  kAccumulate,       // C += A B
  kScaleAccumulate,  // C = diag(row_scale) C + A B (the online-softmax rescale of the output accumulator)
};

// Which scores of a query-major block (rows: queries i0 + r, columns: keys j0 + c, c < valid) are visible:
// columns [begin(r), end(r)), from the mask's band (mask.h): key j is visible from query i iff lo <= j - i <= hi.
struct BlockMask {
  int64_t valid;  // keys of the block (columns past it are padding)
  int64_t lo, hi;  // the band relative to the block: c - q in [lo, hi] (band.lo + i0 - j0, band.hi + i0 - j0)
  // Rows of one query head: row r is query i0 + r % period (the forward's packed query heads, fwd_cpu.cpp).
  int64_t period;

  BlockMask(const Band& band, int64_t i0, int64_t j0, int64_t keys,
            int64_t period = std::numeric_limits<int64_t>::max())
      : valid(keys), lo(band.lo + i0 - j0), hi(band.hi + i0 - j0), period(period) {}
  int64_t begin(int64_t r) const { return std::clamp<int64_t>(r % period + lo, 0, valid); }
  int64_t end(int64_t r) const { return std::clamp<int64_t>(r % period + hi + 1, 0, valid); }
};

// One heap allocation per thread chunk, 64-byte aligned, carved into named blocks of the tile workspaces.
template <typename T>
class Scratch {
 public:
  explicit Scratch(int64_t elems)
      : data_(static_cast<T*>(::operator new(sizeof(T) * std::max<int64_t>(elems, 1), std::align_val_t{64}))) {}
  ~Scratch() { ::operator delete(data_, std::align_val_t{64}); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  // Hands out the next `elems` elements, keeping every block 64-byte aligned.
  T* take(int64_t elems) {
    T* p = data_ + used_;
    used_ += round_up(elems, 64 / static_cast<int64_t>(sizeof(T)));
    return p;
  }
  // Size to allocate for blocks of these sizes (same rounding as take).
  static int64_t total(std::initializer_list<int64_t> sizes) {
    int64_t n = 0;
    for (int64_t s : sizes) n += round_up(s, 64 / static_cast<int64_t>(sizeof(T)));
    return n;
  }

 private:
  T* data_;
  int64_t used_ = 0;
};

// True when the CPU runs AVX2 and FMA and FLASHCORE_CPU_ISA is not "portable" (a switch for testing the
// baseline path).
inline bool use_avx2_fma() {
#if FLASHCORE_CPU_HAVE_AVX2
  static const bool yes = [] {
    if (cpu_isa_forced_portable()) return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return yes;
#else
  return false;
#endif
}

}  // namespace flashcore::cpu

// Returning 32-byte vectors from baseline-target helpers "changes the ABI"; they are all inline, so it does not.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
#if FLASHCORE_CPU_HAVE_AVX2
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define FC_ISA_NAMESPACE avx2
#include "microkernel_cpu.h"
#undef FC_ISA_NAMESPACE
#pragma GCC pop_options
#endif
#define FC_ISA_NAMESPACE portable
#include "microkernel_cpu.h"
#undef FC_ISA_NAMESPACE
#pragma GCC diagnostic pop

#endif  // FLASHCORE_CPU_MICROKERNEL_CPU_H_

#else  // FC_ISA_NAMESPACE: the per-target part, compiled once per namespace.

namespace flashcore::cpu::FC_ISA_NAMESPACE {

template <typename T>
struct Vec;

template <>
struct Vec<float> {
  typedef float V __attribute__((vector_size(32)));
  typedef float Unaligned __attribute__((vector_size(32), aligned(4), may_alias));
  typedef int32_t Mask __attribute__((vector_size(32)));  // comparison results; lane indices
  using Index = int32_t;
  static constexpr int kLanes = 8;
  static Mask iota() { return Mask{0, 1, 2, 3, 4, 5, 6, 7}; }
};

template <>
struct Vec<double> {
  typedef double V __attribute__((vector_size(32)));
  typedef double Unaligned __attribute__((vector_size(32), aligned(8), may_alias));
  typedef int64_t Mask __attribute__((vector_size(32)));
  using Index = int64_t;
  static constexpr int kLanes = 4;
  static Mask iota() { return Mask{0, 1, 2, 3}; }
};

template <typename T>
inline typename Vec<T>::V vload(const T* p) {
  return *reinterpret_cast<const typename Vec<T>::Unaligned*>(p);
}

template <typename T>
inline void vstore(T* p, typename Vec<T>::V v) {
  *reinterpret_cast<typename Vec<T>::Unaligned*>(p) = v;
}

// x - 0 folds to x, so this is a single broadcast (vbroadcastss from memory when x is loaded).
template <typename T>
inline typename Vec<T>::V vbroadcast(T x) {
  return x - typename Vec<T>::V{};
}

// Lanes c, c+1, ... of a row that lie in columns [begin, end).
template <typename T>
inline typename Vec<T>::Mask lanes_within(int64_t c, int64_t begin, int64_t end) {
  using Mask = typename Vec<T>::Mask;
  using Index = typename Vec<T>::Index;
  const Mask col = Vec<T>::iota() + static_cast<Index>(c);
  return (col >= (Mask{} + static_cast<Index>(begin))) & (col < (Mask{} + static_cast<Index>(end)));
}

template <typename T>
inline T hmax(typename Vec<T>::V v) {
  T m = v[0];
  for (int i = 1; i < Vec<T>::kLanes; ++i) m = std::max(m, v[i]);
  return m;
}

template <typename T>
inline T hsum(typename Vec<T>::V v) {
  T s = v[0];
  for (int i = 1; i < Vec<T>::kLanes; ++i) s += v[i];
  return s;
}

// exp of 8 floats: Cephes-style range reduction x = n ln2 + r (|r| <= ln2 / 2, ln2 split in two so n ln2 is exact)
// and a degree-7 polynomial for e^r; about 1 ulp over the range used here. Results below FLT_MIN flush to 0, so
// exp(-inf) = 0 exactly (masked scores, empty rows).
inline Vec<float>::V vexp(Vec<float>::V x) {
  using V = Vec<float>::V;
  using Mask = Vec<float>::Mask;
  const Mask underflow = x < vbroadcast(-87.33654475f);
  x = x < vbroadcast(-87.33654475f) ? vbroadcast(-87.33654475f) : x;
  x = x > vbroadcast(88.37626266f) ? vbroadcast(88.37626266f) : x;
  // Round x log2(e) to the nearest integer: adding 1.5 * 2^23 pushes the fraction out of the mantissa.
  const V magic = vbroadcast(12582912.f);
  const V n = (x * vbroadcast(1.44269504088896341f) + magic) - magic;
  V r = x - n * vbroadcast(0.693359375f);
  r = r - n * vbroadcast(-2.12194440e-4f);
  V y = vbroadcast(1.9875691500e-4f);
  y = y * r + vbroadcast(1.3981999507e-3f);
  y = y * r + vbroadcast(8.3334519073e-3f);
  y = y * r + vbroadcast(4.1665795894e-2f);
  y = y * r + vbroadcast(1.6666665459e-1f);
  y = y * r + vbroadcast(5.0000001201e-1f);
  y = y * (r * r) + r + vbroadcast(1.f);
  // 2^n built in the exponent field; n is in [-126, 127] after the clamps.
  const Mask pow2n = (__builtin_convertvector(n, Mask) + 127) << 23;
  const V result = y * (V)pow2n;
  return underflow ? V{} : result;
}

// float64 is the gradcheck path: exactness over speed.
inline Vec<double>::V vexp(Vec<double>::V x) {
  Vec<double>::V r;
  for (int i = 0; i < Vec<double>::kLanes; ++i) r[i] = std::exp(x[i]);
  return r;
}

// tanh of 8 floats as (1 - e) / (1 + e) with e = exp(-2|x|) <= 1 (no overflow), the sign put back. Below |x| = 1/8,
// where 1 - e cancels (relative error ~2^-24 / |x|: a large softcap's small arguments), the series
// x - x^3/3 + 2x^5/15 - 17x^7/315 instead, whose first dropped term is below 2^-29 of x there. float64 per lane
// through std::tanh (the gradcheck path).
inline Vec<float>::V vtanh(Vec<float>::V x) {
  using V = Vec<float>::V;
  const V ax = x < V{} ? -x : x;
  const V e = vexp(vbroadcast(-2.f) * ax);
  const V far = (vbroadcast(1.f) - e) / (vbroadcast(1.f) + e);
  const V x2 = ax * ax;
  const V near = ax * (vbroadcast(1.f) +
                       x2 * (vbroadcast(-1.f / 3) + x2 * (vbroadcast(2.f / 15) + x2 * vbroadcast(-17.f / 315))));
  const V t = ax < vbroadcast(0.125f) ? near : far;
  return x < V{} ? -t : t;
}

inline Vec<double>::V vtanh(Vec<double>::V x) {
  Vec<double>::V r;
  for (int i = 0; i < Vec<double>::kLanes; ++i) r[i] = std::tanh(x[i]);
  return r;
}

// C[R x 2 vectors] (per kMode) A[R x k] B[k x 2 vectors], all accumulators in registers.
template <int R, GemmMode kMode, typename T>
inline void gemm_micro(int64_t k, const T* a, int64_t a_row, int64_t a_col, const T* b, int64_t ldb, T* c,
                       int64_t ldc, const T* row_scale) {
  using V = typename Vec<T>::V;
  constexpr int L = Vec<T>::kLanes;
  V acc0[R], acc1[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    if constexpr (kMode == GemmMode::kStore) {
      acc0[r] = V{};
      acc1[r] = V{};
    } else if constexpr (kMode == GemmMode::kAccumulate) {
      acc0[r] = vload(c + r * ldc);
      acc1[r] = vload(c + r * ldc + L);
    } else {
      const V s = vbroadcast(row_scale[r]);
      acc0[r] = s * vload(c + r * ldc);
      acc1[r] = s * vload(c + r * ldc + L);
    }
  }
  for (int64_t kk = 0; kk < k; ++kk) {
    const V b0 = vload(b + kk * ldb);
    const V b1 = vload(b + kk * ldb + L);
    const T* ak = a + kk * a_col;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const V ar = vbroadcast(ak[r * a_row]);
      acc0[r] += ar * b0;
      acc1[r] += ar * b1;
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    vstore(c + r * ldc, acc0[r]);
    vstore(c + r * ldc + L, acc1[r]);
  }
}

struct BlockOps {
  // C[m x n] (per kMode) A[m x k] B[k x n]; n a multiple of kPad. Column panels outermost: one k x 16 panel of B
  // stays in L1 while every row group of A streams past it.
  template <GemmMode kMode, typename T>
  static void gemm(int64_t m, int64_t n, int64_t k, const T* a, int64_t a_row, int64_t a_col, const T* b,
                   int64_t ldb, T* c, int64_t ldc, const T* row_scale = nullptr) {
    constexpr int64_t kChunk = 2 * Vec<T>::kLanes;
    static_assert(kPad % kChunk == 0, "packed rows must hold whole column chunks");
    for (int64_t j = 0; j < n; j += kChunk) {
      int64_t i = 0;
      for (; i + kGemmRows <= m; i += kGemmRows) {
        gemm_micro<kGemmRows, kMode>(k, a + i * a_row, a_row, a_col, b + j, ldb, c + i * ldc + j, ldc,
                                     row_scale + (row_scale ? i : 0));
      }
      const T* ai = a + i * a_row;
      T* ci = c + i * ldc + j;
      const T* si = row_scale + (row_scale ? i : 0);
      switch (m - i) {
        case 1: gemm_micro<1, kMode>(k, ai, a_row, a_col, b + j, ldb, ci, ldc, si); break;
        case 2: gemm_micro<2, kMode>(k, ai, a_row, a_col, b + j, ldb, ci, ldc, si); break;
        case 3: gemm_micro<3, kMode>(k, ai, a_row, a_col, b + j, ldb, ci, ldc, si); break;
        case 4: gemm_micro<4, kMode>(k, ai, a_row, a_col, b + j, ldb, ci, ldc, si); break;
        case 5: gemm_micro<5, kMode>(k, ai, a_row, a_col, b + j, ldb, ci, ldc, si); break;
        default: break;
      }
    }
  }

  // dst[r, c] = scale * src[r, c] for r < rows, c < cols; zeros in columns [cols, ld) and rows [rows, rows_pad).
  template <typename S, typename T>
  static void pack_rows(const S* src, int64_t src_stride, int64_t rows, int64_t cols, T scale, T* dst, int64_t ld,
                        int64_t rows_pad) {
    for (int64_t r = 0; r < rows; ++r) {
      const S* s = src + r * src_stride;
      T* d = dst + r * ld;
      for (int64_t c = 0; c < cols; ++c) d[c] = static_cast<T>(s[c]) * scale;
      for (int64_t c = cols; c < ld; ++c) d[c] = T(0);
    }
    if (rows_pad > rows) std::memset(dst + rows * ld, 0, sizeof(T) * (rows_pad - rows) * ld);
  }

  // dst[c, r] = src[r, c] (the transpose: cols rows of ld elements); zeros in dst columns [rows, ld).
  template <typename S, typename T>
  static void pack_transposed(const S* src, int64_t src_stride, int64_t rows, int64_t cols, T* dst, int64_t ld) {
    for (int64_t r = 0; r < rows; ++r) {
      const S* s = src + r * src_stride;
      for (int64_t c = 0; c < cols; ++c) dst[c * ld + r] = static_cast<T>(s[c]);
    }
    for (int64_t c = 0; c < cols; ++c) std::fill(dst + c * ld + rows, dst + (c + 1) * ld, T(0));
  }

  // dst[r, c] = src[r, c] * scale * (row_scale ? row_scale[r] : 1), converted to the output dtype.
  template <typename S, typename T>
  static void store_rows(const T* src, int64_t ld, int64_t rows, int64_t cols, const T* row_scale, T scale, S* dst,
                         int64_t dst_stride) {
    for (int64_t r = 0; r < rows; ++r) {
      const T f = row_scale ? row_scale[r] * scale : scale;
      const T* s = src + r * ld;
      S* d = dst + r * dst_stride;
      for (int64_t c = 0; c < cols; ++c) d[c] = static_cast<S>(s[c] * f);
    }
  }

  // s[r, c] = sum_d a[r, d] * k[c, d] for r < rows (at most kDotRows) and keys c < keys, k's rows read in place
  // (each converted once into `row`, depth_pad elements, zeros past depth); s's columns [keys, cols_pad) are 0.
  // The score GEMM of a block of a few query rows (a decode step): it needs no transposed copy of K, whose scalar
  // scatter costs more than those rows' multiply-adds. a: packed rows of depth_pad (zeros past depth).
  static constexpr int64_t kDotRows = 8;
  template <typename S, typename T>
  static void scores_from_key_rows(const T* a, int64_t lda, int64_t rows, const S* k, int64_t k_stride, int64_t keys,
                                   int64_t depth, int64_t depth_pad, T* row, T* s, int64_t lds, int64_t cols_pad) {
    using V = typename Vec<T>::V;
    constexpr int L = Vec<T>::kLanes;
    std::fill(row + depth, row + depth_pad, T(0));
    for (int64_t c = 0; c < keys; ++c) {
      const S* y = k + c * k_stride;
      for (int64_t d = 0; d < depth; ++d) row[d] = static_cast<T>(y[d]);
      V acc[kDotRows];
      for (int64_t r = 0; r < rows; ++r) acc[r] = V{};
      for (int64_t d = 0; d < depth_pad; d += L) {
        const V kv = vload(row + d);
        for (int64_t r = 0; r < rows; ++r) acc[r] += vload(a + r * lda + d) * kv;
      }
      for (int64_t r = 0; r < rows; ++r) s[r * lds + c] = hsum<T>(acc[r]);
    }
    for (int64_t r = 0; r < rows; ++r) std::fill(s + r * lds + keys, s + r * lds + cols_pad, T(0));
  }

  // out[r] = sum_c a[r, c] * b[r, c] (the backward's D_i = dO_i . O_i), a packed, b read in place.
  template <typename S, typename T>
  static void row_dots(const T* a, int64_t lda, const S* b, int64_t b_stride, int64_t rows, int64_t cols, T* out) {
    for (int64_t r = 0; r < rows; ++r) {
      const T* x = a + r * lda;
      const S* y = b + r * b_stride;
      T acc = 0;
      for (int64_t c = 0; c < cols; ++c) acc += x[c] * static_cast<T>(y[c]);
      out[r] = acc;
    }
  }

  // Turns a block of scaled scores (rows: queries i0 + r, columns: keys j0 + c) into logits (score_mod.h):
  // softcap > 0: softcap * tanh(s / softcap), with 1 - tanh^2 in dtanh when given; slope != 0: minus
  // slope * |j - i - alibi_offset|. Columns [0, cols_pad) are all written (padding included: the mask hides it).
  template <typename T>
  static void score_mod(T* s, int64_t lds, int64_t rows, int64_t cols_pad, T softcap, T slope, int64_t i0,
                        int64_t j0, int64_t alibi_offset, T* dtanh) {
    using V = typename Vec<T>::V;
    using Index = typename Vec<T>::Index;
    constexpr int L = Vec<T>::kLanes;
    for (int64_t r = 0; r < rows; ++r) {
      T* x = s + r * lds;
      T* d = dtanh ? dtanh + r * lds : nullptr;
      // j - i - offset of column c: c + base (clamped: only |distance| below 2^30 is ever looked at closely)
      const int64_t base = std::clamp<int64_t>(j0 - (i0 + r) - alibi_offset, -(int64_t(1) << 30), int64_t(1) << 30);
      for (int64_t c = 0; c < cols_pad; c += L) {
        V v = vload(x + c);
        if (softcap > T(0)) {
          const V t = vtanh(v / vbroadcast(softcap));
          if (d) vstore(d + c, vbroadcast(T(1)) - t * t);
          v = vbroadcast(softcap) * t;
        }
        if (slope != T(0)) {
          const auto dist = Vec<T>::iota() + static_cast<Index>(c + base);
          const auto abs_dist = dist < decltype(dist){} ? -dist : dist;
          v = v - vbroadcast(slope) * __builtin_convertvector(abs_dist, V);
        }
        vstore(x + c, v);
      }
    }
  }

  // x[i] *= y[i] for i < n (n a multiple of the vector width).
  template <typename T>
  static void multiply(T* x, const T* y, int64_t n) {
    constexpr int L = Vec<T>::kLanes;
    for (int64_t i = 0; i < n; i += L) vstore(x + i, vload(x + i) * vload(y + i));
  }

  // Online-softmax step over one block of scaled scores s (rows x cols_pad): with m the running row max and l the
  // running sum of exp(s - m), sets m' = max(m, max of visible s), alpha = exp(m - m'), l' = alpha l + sum
  // exp(s - m'), and overwrites s with the probabilities exp(s - m') (0 where masked). A row with nothing
  // visible yet keeps m = -inf, l = 0 and gets alpha = 1.
  template <typename T>
  static void softmax_update(T* s, int64_t lds, int64_t rows, int64_t cols_pad, const BlockMask& mask, T* row_max,
                             T* row_sum, T* alpha) {
    using V = typename Vec<T>::V;
    constexpr int L = Vec<T>::kLanes;
    constexpr T kNegInf = -std::numeric_limits<T>::infinity();
    for (int64_t r = 0; r < rows; ++r) {
      T* x = s + r * lds;
      const int64_t begin = mask.begin(r), end = mask.end(r);
      if (end <= begin) {
        std::fill(x, x + cols_pad, T(0));
        alpha[r] = T(1);
        continue;
      }
      V vmax = vbroadcast(kNegInf);
      for (int64_t c = begin / L * L; c < end; c += L) {
        const V v = vload(x + c);
        const V visible = lanes_within<T>(c, begin, end) ? v : vbroadcast(kNegInf);
        vmax = visible > vmax ? visible : vmax;
      }
      const T m_new = std::max(row_max[r], hmax<T>(vmax));
      // Every visible score so far -inf (from the data, e.g. a -inf in q): exponentiate against 0, so that the
      // probabilities are 0 and the row ends empty (out 0, lse -inf), not exp(-inf - -inf) = NaN.
      const T m_ref = m_new == kNegInf ? T(0) : m_new;
      alpha[r] = std::exp(row_max[r] - m_ref);  // exp(-inf) = 0 on the first visible block
      const V vm = vbroadcast(m_ref);
      V vsum{};
      for (int64_t c = 0; c < cols_pad; c += L) {
        const V p = vexp(vload(x + c) - vm);
        const V visible = lanes_within<T>(c, begin, end) ? p : V{};
        vstore(x + c, visible);
        vsum += visible;
      }
      row_sum[r] = row_sum[r] * alpha[r] + hsum<T>(vsum);
      row_max[r] = m_new;
    }
  }

  // Backward step over one block: P = exp(s - lse_r) (0 where masked; lse_r = +inf for a row that sees nothing)
  // overwrites s, and dS = P * (dP - delta_r) overwrites dp.
  template <typename T>
  static void softmax_grad(T* s, T* dp, int64_t ld, int64_t rows, int64_t cols_pad, const BlockMask& mask,
                           const T* lse, const T* delta) {
    using V = typename Vec<T>::V;
    constexpr int L = Vec<T>::kLanes;
    for (int64_t r = 0; r < rows; ++r) {
      T* x = s + r * ld;
      T* g = dp + r * ld;
      const int64_t begin = mask.begin(r), end = mask.end(r);
      const V vlse = vbroadcast(lse[r]);
      const V vdelta = vbroadcast(delta[r]);
      for (int64_t c = 0; c < cols_pad; c += L) {
        const V p0 = vexp(vload(x + c) - vlse);
        const V p = lanes_within<T>(c, begin, end) ? p0 : V{};
        vstore(x + c, p);
        vstore(g + c, p * (vload(g + c) - vdelta));
      }
    }
  }
};

}  // namespace flashcore::cpu::FC_ISA_NAMESPACE

#endif  // FC_ISA_NAMESPACE
