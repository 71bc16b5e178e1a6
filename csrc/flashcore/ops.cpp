// The flashcore operator library: schemas defined once here; implementations are registered per dispatch key
// (cpu/attention_cpu.cpp, cuda/attention_cuda.cpp), autograd in C++ (autograd.cpp), the fake (meta) kernels in
// flashcore/ops.py.
//
// Tensors are logical (batch, heads, seq_len, head_dim) with any strides whose last one is 1, so BHSD and
// BSHD (a transposed view) are both accepted without copies. key/value may have fewer heads than query
// (grouped-query attention; heads_q a multiple of heads_kv).
#include <Python.h>
#include <torch/library.h>

#include <cstring>
#include <string>

#include "kernel_trace.h"

namespace {

// _C._last_kernel("fwd" | "bwd") -> str: kernel_trace.h's record of the last call's kernel.
PyObject* py_last_kernel(PyObject* /*self*/, PyObject* args) {
  const char* pass = nullptr;
  if (!PyArg_ParseTuple(args, "s", &pass)) return nullptr;
  if (std::strcmp(pass, "fwd") != 0 && std::strcmp(pass, "bwd") != 0) {
    PyErr_SetString(PyExc_ValueError, "flashcore: last_kernel takes 'fwd' or 'bwd'");
    return nullptr;
  }
  const std::string s =
      flashcore::last_kernel(std::strcmp(pass, "fwd") == 0 ? flashcore::Pass::kFwd : flashcore::Pass::kBwd);
  return PyUnicode_FromString(s.c_str());
}

PyMethodDef methods[] = {
    {"_last_kernel", py_last_kernel, METH_VARARGS, "The kernel the last fwd or bwd call ran."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

extern "C" {
// `import flashcore._C` loads this shared library, which runs the TORCH_LIBRARY registrations below. The module
// holds one introspection function; it uses only the limited (abi3) Python API.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(flashcore, m) {
  // Returns (out, lse): out has query's shape and dtype (and query's layout when query is dense);
  // lse is float32 (float64 for float64 inputs) (batch, heads_q, seq_len_q), the natural-log log-sum-exp of each
  // row's logits (sinks included).
  // Masks (mask.h): is_causal hides keys right of the aligned diagonal; window_left/window_right (-1: unbounded)
  // bound a sliding window around it; causal_bottom_right aligns both bottom-right (flash-attn), else top-left
  // (SDPA). Scores (score_mod.h): softcap (0: off) caps the scaled score, alibi_slopes ((heads_q,) or
  // (batch, heads_q) float32) adds -slope * |i + Sk - Sq - j|, sinks ((heads_q,) float32) adds exp(sink) to each
  // row's denominator. deterministic=True does not change the forward (always reproducible); autograd passes it
  // on to bwd.
  m.def(
      "fwd(Tensor query, Tensor key, Tensor value, float softmax_scale, bool is_causal=False, "
      "bool causal_bottom_right=False, int window_left=-1, int window_right=-1, float softcap=0.0, "
      "bool deterministic=False, Tensor? sinks=None, Tensor? alibi_slopes=None) -> (Tensor out, Tensor lse)");
  // Gradients of fwd's out, for the same options. grad_key/grad_value have key/value's shapes (summed over the query
  // heads that share a key/value head). deterministic=True gives bitwise-identical gradients run to run. Sinks need
  // no argument: lse includes them, and their gradient, -sum over rows of exp(sink - lse) * rowsum(grad_out * out),
  // is taken by the autograd node. lse is float32 (float64 for float64 inputs, as fwd returns it).
  m.def(
      "bwd(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, Tensor lse, float softmax_scale, "
      "bool is_causal=False, bool causal_bottom_right=False, int window_left=-1, int window_right=-1, "
      "float softcap=0.0, bool deterministic=False, Tensor? alibi_slopes=None) "
      "-> (Tensor grad_query, Tensor grad_key, Tensor grad_value)");
  // Variable-length batches (seqlen.h), flash-attn's flash_attn_varlen_func layout: query (total_q, heads_q,
  // head_dim), key/value (total_k, heads_kv, head_dim) packed along the sequence; sequence b is rows
  // [cu_seqlens_q[b], cu_seqlens_q[b+1]) of query and [cu_seqlens_k[b], cu_seqlens_k[b+1]) of key/value (int32,
  // length batch + 1), of which seqused_k[b] keys are used when seqused_k (int32 (batch,)) is given.
  // max_seqlen_q/max_seqlen_k bound the sequences' lengths (Python ints; they size the grids). The causal
  // diagonal and the window are aligned bottom-right in each sequence (flash-attn's rule). lse is (heads_q,
  // total_q); rows outside every sequence get lse = -inf and out = 0.
  m.def(
      "varlen_fwd(Tensor query, Tensor key, Tensor value, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "int max_seqlen_q, int max_seqlen_k, float softmax_scale, bool is_causal=False, int window_left=-1, "
      "int window_right=-1, float softcap=0.0, bool deterministic=False, Tensor? sinks=None, "
      "Tensor? alibi_slopes=None, Tensor? seqused_k=None) -> (Tensor out, Tensor lse)");
  // Gradients of varlen_fwd's out. Rows of grad_key/grad_value outside every sequence's used keys are 0, and so
  // are rows of grad_query outside every sequence.
  m.def(
      "varlen_bwd(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, Tensor lse, "
      "Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, float softmax_scale, "
      "bool is_causal=False, int window_left=-1, int window_right=-1, float softcap=0.0, bool deterministic=False, "
      "Tensor? alibi_slopes=None, Tensor? seqused_k=None) -> (Tensor grad_query, Tensor grad_key, Tensor grad_value)");
  // Attention of new queries against a KV cache (paged_kv.h; flash-attn's flash_attn_with_kvcache without the
  // append, which flashcore.flash_attn_interface does before calling it). query (batch, seqlen_q, heads_q,
  // head_dim); key_cache/value_cache (cache_batch, seqlen_cache, heads_kv, head_dim), or paged
  // (num_pages, page_size, heads_kv, head_dim) with block_table (batch, max_pages) int32. Entry b attends to keys
  // [cache_leftpad[b], cache_seqlens[b]) of cache row cache_batch_idx[b] (b); causal and window aligned
  // bottom-right. num_splits: key splits per (batch, kv head) (0: chosen from the GPU's size; the CPU ignores it).
  // Returns out like query and lse (batch, heads_q, seqlen_q) float32.
  m.def(
      "kvcache_fwd(Tensor query, Tensor key_cache, Tensor value_cache, Tensor cache_seqlens, Tensor? block_table, "
      "Tensor? cache_batch_idx, Tensor? cache_leftpad, float softmax_scale, bool is_causal=False, "
      "int window_left=-1, int window_right=-1, float softcap=0.0, Tensor? sinks=None, Tensor? alibi_slopes=None, "
      "int num_splits=0) -> (Tensor out, Tensor lse)");
  // Name of the CUDA forward kernel family that fwd would run for these inputs on this device ("sm80", "sm90"),
  // for tests and benchmarks; respects FLASHCORE_FORCE_KERNEL.
  m.def("fwd_kernel_name(Tensor query, Tensor key, Tensor value, bool is_causal=False) -> str");
  // The same for the backward path ("sm80", "sm90", "composite"; "cpu" on the CPU), given the call's grad_out and
  // deterministic flag; respects FLASHCORE_FORCE_BWD.
  m.def(
      "bwd_kernel_name(Tensor grad_out, Tensor query, Tensor key, Tensor value, bool deterministic=False) -> str");
}
