#include "kernel_registry.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <vector>

namespace flashcore::cuda {
namespace {

template <typename Entry>
struct Registry {
  std::mutex mutex;
  std::vector<Entry> entries;
};

template <typename Entry>
Registry<Entry>& registry() {
  static Registry<Entry> r;  // function-local: safe to use from other files' static initializers
  return r;
}

template <typename Entry>
bool add(const Entry& entry) {
  Registry<Entry>& r = registry<Entry>();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.entries.push_back(entry);
  return true;
}

template <typename Entry>
const Entry* find(const char* family, int head_dim, DType dtype, bool score_mod) {
  Registry<Entry>& r = registry<Entry>();
  std::lock_guard<std::mutex> lock(r.mutex);
  const Entry* best = nullptr;
  for (const auto& e : r.entries) {
    if (std::strcmp(e.family, family) != 0 || e.dtype != dtype || e.score_mod != score_mod ||
        e.head_dim_tile < head_dim)
      continue;
    if (best == nullptr || e.head_dim_tile < best->head_dim_tile) best = &e;
  }
  return best;
}

}  // namespace

bool register_fwd_kernel(const FwdKernelEntry& entry) { return add(entry); }
bool register_bwd_kernel(const BwdKernelEntry& entry) { return add(entry); }

const FwdKernelEntry* find_fwd_kernel(const char* family, int head_dim, DType dtype, bool score_mod) {
  return find<FwdKernelEntry>(family, head_dim, dtype, score_mod);
}
const BwdKernelEntry* find_bwd_kernel(const char* family, int head_dim, DType dtype, bool score_mod) {
  return find<BwdKernelEntry>(family, head_dim, dtype, score_mod);
}

std::string compiled_head_dim_tiles(const char* family, DType dtype) {
  Registry<FwdKernelEntry>& r = registry<FwdKernelEntry>();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::vector<int> tiles;
  for (const auto& e : r.entries)
    if (std::strcmp(e.family, family) == 0 && e.dtype == dtype && !e.score_mod) tiles.push_back(e.head_dim_tile);
  std::sort(tiles.begin(), tiles.end());
  std::string s;
  for (int t : tiles) s += (s.empty() ? "" : ", ") + std::to_string(t);
  return s.empty() ? "none" : s;
}

}  // namespace flashcore::cuda
