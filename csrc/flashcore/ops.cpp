// The flashcore operator library: schemas defined once here; implementations are registered per dispatch key
// (cpu/attention_cpu.cpp, cuda/attention_cuda.cpp), the fake (meta) kernels and autograd in flashcore/ops.py.
//
// Tensors are logical (batch, heads, seq_len, head_dim) with any strides whose last one is 1, so BHSD and
// BSHD (a transposed view) are both accepted without copies. key/value may have fewer heads than query
// (grouped-query attention; heads_q a multiple of heads_kv).
//
// Room kept in the schema for what is coming: window_left/window_right (sliding window, -1 = unbounded) and
// softcap (0 = off) are accepted and checked now (NotImplementedError until a kernel implements them);
// variable-length batches and a KV cache will be separate ops (fwd_varlen, fwd_kvcache) that share the kernels.
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
  // lse is float32 (batch, heads_q, seq_len_q), the natural-log log-sum-exp of each row's scaled scores.
  // deterministic=True does not change the forward (always reproducible); autograd passes it on to bwd.
  m.def(
      "fwd(Tensor query, Tensor key, Tensor value, float softmax_scale, bool is_causal=False, "
      "bool causal_bottom_right=False, int window_left=-1, int window_right=-1, float softcap=0.0, "
      "bool deterministic=False) -> (Tensor out, Tensor lse)");
  // Gradients of fwd's out. grad_key/grad_value have key/value's shapes (summed over the query heads that share
  // a key/value head). deterministic=True gives bitwise-identical gradients run to run.
  m.def(
      "bwd(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, Tensor lse, float softmax_scale, "
      "bool is_causal=False, bool causal_bottom_right=False, int window_left=-1, int window_right=-1, "
      "float softcap=0.0, bool deterministic=False) -> (Tensor grad_query, Tensor grad_key, Tensor grad_value)");
  // Name of the CUDA forward kernel family that fwd would run for these inputs on this device ("sm80", "sm90"),
  // for tests and benchmarks; respects FLASHCORE_FORCE_KERNEL.
  m.def("fwd_kernel_name(Tensor query, Tensor key, Tensor value, bool is_causal=False) -> str");
  // The same for the backward path ("sm80", "sm90", "composite"; "cpu" on the CPU), given the call's grad_out and
  // deterministic flag; respects FLASHCORE_FORCE_BWD.
  m.def(
      "bwd_kernel_name(Tensor grad_out, Tensor query, Tensor key, Tensor value, bool deterministic=False) -> str");
}
