#include "fwd_registry.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <vector>

namespace flashcore::cuda {
namespace {

struct Registry {
  std::mutex mutex;
  std::vector<FwdKernelEntry> entries;
};

Registry& registry() {
  static Registry r;  // function-local: safe to use from other files' static initializers
  return r;
}

}  // namespace

bool register_fwd_kernel(const FwdKernelEntry& entry) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.entries.push_back(entry);
  return true;
}

const FwdKernelEntry* find_fwd_kernel(const char* family, int head_dim, DType dtype) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  const FwdKernelEntry* best = nullptr;
  for (const auto& e : r.entries) {
    if (std::strcmp(e.family, family) != 0 || e.dtype != dtype || e.head_dim_tile < head_dim) continue;
    if (best == nullptr || e.head_dim_tile < best->head_dim_tile) best = &e;
  }
  return best;
}

std::string compiled_head_dim_tiles(const char* family, DType dtype) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::vector<int> tiles;
  for (const auto& e : r.entries)
    if (std::strcmp(e.family, family) == 0 && e.dtype == dtype) tiles.push_back(e.head_dim_tile);
  std::sort(tiles.begin(), tiles.end());
  std::string s;
  for (int t : tiles) s += (s.empty() ? "" : ", ") + std::to_string(t);
  return s.empty() ? "none" : s;
}

}  // namespace flashcore::cuda
