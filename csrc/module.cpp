// The Python module fastlayers._C. Importing it runs the static op registrations of every
// op family (TORCH_LIBRARY_FRAGMENT in each .cpp/.cu); it also reports how it was built.
#include <Python.h>
#include <torch/library.h>

#ifndef FASTLAYERS_WITH_CUDA
#define FASTLAYERS_WITH_CUDA 0
#endif
#ifndef FASTLAYERS_TORCH_MAJOR  // the torch this was compiled against (set by setup.py)
#define FASTLAYERS_TORCH_MAJOR 0
#define FASTLAYERS_TORCH_MINOR 0
#endif
#ifndef FASTLAYERS_CUDA_ARCHS  // comma-separated compute capabilities, e.g. 80,90
#define FASTLAYERS_CUDA_ARCHS
#endif

// Owns the namespace; each op family adds its ops with TORCH_LIBRARY_FRAGMENT.
TORCH_LIBRARY(fastlayers, m) {}

namespace {

PyObject* build_info(PyObject*, PyObject*) {
  static const int archs[] = {0, FASTLAYERS_CUDA_ARCHS};
  const int n_archs = static_cast<int>(sizeof(archs) / sizeof(archs[0])) - 1;
  PyObject* arch_list = PyList_New(n_archs);
  if (!arch_list) return nullptr;
  for (int i = 0; i < n_archs; ++i) PyList_SET_ITEM(arch_list, i, PyLong_FromLong(archs[i + 1]));
  return Py_BuildValue("{s:O,s:N,s:(ii)}", "cuda", FASTLAYERS_WITH_CUDA ? Py_True : Py_False,
                       "cuda_archs", arch_list, "torch_version", FASTLAYERS_TORCH_MAJOR,
                       FASTLAYERS_TORCH_MINOR);
}

PyMethodDef methods[] = {
    {"build_info", build_info, METH_NOARGS,
     "How this extension was built: {'cuda': bool, 'cuda_archs': [80, 90, ...], "
     "'torch_version': (major, minor)}."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "fastlayers compiled ops", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&module_def); }
