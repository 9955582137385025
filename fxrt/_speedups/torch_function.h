// The __torch_function__ test both Cython faces (_loop.pyx, _runtime.pyx) make before a call.

#pragma once

#include <Python.h>

#include <ATen/PythonTorchFunctionTLS.h>
#include <torch/csrc/autograd/python_variable.h>

namespace fxrt {

// Whether torch.ops would route this call's ops through __torch_function__: 0 no, 1 yes (a
// TorchFunctionMode is active), 2 maybe (an input is a tensor subclass, which may override it;
// torch._C._has_torch_function decides). The compiled loop calls ops below that layer, so the
// loop runs such calls through each instruction's Python form.
inline int torch_function_state(PyObject* inputs) {
  if (at::impl::torch_function_mode_enabled()) {
    return 1;
  }
  if (PyList_Check(inputs) || PyTuple_Check(inputs)) {
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(inputs); ++i) {
      PyObject* x = PySequence_Fast_GET_ITEM(inputs, i);
      if (!THPVariable_CheckExact(x) && THPVariable_Check(x)) {
        return 2;
      }
    }
  }
  return 0;
}

}  // namespace fxrt
