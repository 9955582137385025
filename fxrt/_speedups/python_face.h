// What the Cython face (_loop.pyx) needs besides the Executor: the __torch_function__ test made
// before each call, a failed run's registers for the error message, the exception handler used
// while an Executor is built, and the torch version the extension was compiled against.

#pragma once

#include "py_executor.h"
#include "torch_function.h"

namespace fxrt {

// The registers of a failed run as a Python list (None where one cannot be converted), for the
// error message.
inline PyObject* failure_registers(Failure& failure) {
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(failure.regs.size()));
  if (list == nullptr) {
    return nullptr;
  }
  for (size_t i = 0; i < failure.regs.size(); ++i) {
    PyObject* obj = nullptr;
    try {
      obj = to_python(failure.regs[i]);
    } catch (...) {
      obj = nullptr;
    }
    if (obj == nullptr) {
      PyErr_Clear();
      Py_INCREF(Py_None);
      obj = Py_None;
    }
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), obj);
  }
  failure.regs.clear();
  return list;
}

// Cython's handler for C++ exceptions thrown while an Executor is built: torch's own translation
// (python_error restored, c10::Error -> RuntimeError, ...). Called inside a catch block.
inline void set_python_error() {
  torch::translate_exception_to_python(std::current_exception());
}

// The torch version this extension was compiled against.
inline const char* built_torch_version() {
  return FXRT_TORCH_VERSION;
}

}  // namespace fxrt
