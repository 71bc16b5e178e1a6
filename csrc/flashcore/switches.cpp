#include "switches.h"

#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>

namespace flashcore {
namespace {

const char* env(const char* name) { return std::getenv(name); }

// A 0/1 switch: -1 when unset, else its value; anything else is refused, naming the variable.
int forced_bit(const char* name) {
  const char* v = env(name);
  if (v == nullptr) return -1;
  TORCH_CHECK(std::strcmp(v, "0") == 0 || std::strcmp(v, "1") == 0, "flashcore: ", name, " must be 0 or 1, got '", v,
              "'");
  return v[0] - '0';
}

}  // namespace

std::string forced_fwd_family() {
  const char* v = env("FLASHCORE_FORCE_KERNEL");
  return v ? std::string(v) : std::string();
}

std::string forced_bwd_path() {
  const char* v = env("FLASHCORE_FORCE_BWD");
  return v ? std::string(v) : std::string();
}

int key_split_cap() {
  const char* v = env("FLASHCORE_KEY_SPLITS");
  if (v == nullptr) return 0;
  const int n = std::atoi(v);
  TORCH_CHECK(n >= 1, "flashcore: FLASHCORE_KEY_SPLITS must be a positive integer, got '", v, "'");
  return n;
}

int fwd_warpgroups_forced() {
  const char* v = env("FLASHCORE_FWD_WARPGROUPS");
  if (v == nullptr) return 0;
  const int n = std::atoi(v);
  TORCH_CHECK(n >= 1 && n <= 3, "flashcore: FLASHCORE_FWD_WARPGROUPS must be 1, 2 or 3, got '", v, "'");
  return n;
}

bool pdl_allowed() {
  const char* v = env("FLASHCORE_PDL");
  return v == nullptr || std::strcmp(v, "0") != 0;
}

bool poison_outputs() {
  const char* v = env("FLASHCORE_POISON");
  return v != nullptr && std::strcmp(v, "0") != 0;
}

bool cpu_isa_forced_portable() {
  const char* v = env("FLASHCORE_CPU_ISA");
  return v != nullptr && std::strcmp(v, "portable") == 0;
}

bool check_varlen_offsets() {
  const char* v = env("FLASHCORE_CHECK_VARLEN");
  return v != nullptr && std::strcmp(v, "0") != 0;
}

bool varlen_schedule_enabled() {
  const char* v = env("FLASHCORE_VARLEN_SCHEDULE");
  return v == nullptr || std::strcmp(v, "0") != 0;
}

int pack_gqa_mode() {
  const char* v = env("FLASHCORE_PACK_GQA");
  if (v == nullptr) return 1;
  if (std::strcmp(v, "always") == 0) return 2;
  return std::strcmp(v, "0") != 0 ? 1 : 0;
}

bool varlen_fwd_packed_grid_enabled() {
  const char* v = env("FLASHCORE_VARLEN_FWD_PACKED");
  return v == nullptr || std::strcmp(v, "0") != 0;
}

bool decode_longest_first_enabled() {
  const char* v = env("FLASHCORE_DECODE_LONGEST_FIRST");
  return v == nullptr || std::strcmp(v, "0") != 0;
}

bool bwd_wide_steps_enabled() {
  const char* v = env("FLASHCORE_BWD_WIDE_STEPS");
  return v == nullptr || std::strcmp(v, "0") != 0;
}

bool bwd_tma_epilogue_enabled() {
  const char* v = env("FLASHCORE_BWD_TMA_EPILOGUE");
  return v == nullptr || std::strcmp(v, "0") != 0;
}

bool dq_convert_kernel_enabled() {
  const char* v = env("FLASHCORE_DQ_CONVERT");
  return v == nullptr || std::strcmp(v, "aten") != 0;
}

bool bwd_dq_overlap_enabled() {
  const char* v = env("FLASHCORE_BWD_DQ_OVERLAP");
  return v == nullptr || std::strcmp(v, "0") != 0;
}

int decode_tma_forced() { return forced_bit("FLASHCORE_DECODE_TMA"); }

int decode_cluster_forced() { return forced_bit("FLASHCORE_DECODE_CLUSTER"); }

int fwd_persistent_forced() { return forced_bit("FLASHCORE_FWD_PERSISTENT"); }

int decode_blocks_per_sm_forced() {
  const char* v = env("FLASHCORE_DECODE_BLOCKS_PER_SM");
  if (v == nullptr) return 0;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  TORCH_CHECK(end != v && *end == '\0' && n >= 1 && n <= 64,
              "flashcore: FLASHCORE_DECODE_BLOCKS_PER_SM must be an integer from 1 to 64, got '", v, "'");
  return (int)n;
}

int decode_stages_forced() {
  const char* v = env("FLASHCORE_DECODE_STAGES");
  if (v == nullptr) return 0;
  TORCH_CHECK(std::strcmp(v, "2") == 0 || std::strcmp(v, "3") == 0,
              "flashcore: FLASHCORE_DECODE_STAGES must be 2 or 3, got '", v, "'");
  return v[0] - '0';
}

}  // namespace flashcore
