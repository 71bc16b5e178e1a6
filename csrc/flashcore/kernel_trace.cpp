#include "kernel_trace.h"

#include <mutex>

namespace flashcore {
namespace {

// Process-wide, not per thread: autograd runs a CUDA backward on its own device thread, and the caller asks from
// another one.
std::mutex trace_mutex;
KernelTrace last_fwd, last_bwd;

}  // namespace

void record_kernel(Pass pass, const KernelTrace& trace) {
  std::lock_guard<std::mutex> lock(trace_mutex);
  (pass == Pass::kFwd ? last_fwd : last_bwd) = trace;
}

std::string last_kernel(Pass pass) {
  KernelTrace t;
  {
    std::lock_guard<std::mutex> lock(trace_mutex);
    t = pass == Pass::kFwd ? last_fwd : last_bwd;
  }
  std::string s = t.family;
  if (t.head_dim_tile > 0) s += " hdim" + std::to_string(t.head_dim_tile);
  if (t.warpgroups > 0) s += " wg" + std::to_string(t.warpgroups);
  if (t.key_splits > 1) s += " splits" + std::to_string(t.key_splits);
  if (t.compact) s += " compact";
  if (t.score_mod) s += " mod";
  if (t.pack_gqa > 1) s += " pack" + std::to_string(t.pack_gqa);
  if (t.packed_grid) s += " packed-grid";
  if (t.varlen) s += " varlen";
  if (t.longest_first) s += " longest-first";
  if (t.cluster_merge) s += " cluster";
  if (t.dq_overlap) s += " dq-overlap";
  if (t.deterministic) s += " deterministic";
  if (t.wide_block_m > 0) s += " m" + std::to_string(t.wide_block_m);
  return s;
}

}  // namespace flashcore
