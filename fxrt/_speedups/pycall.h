// PYCALL instructions, and the Python form of every other kind: a Python callable called on
// arguments rebuilt from the registers (convert.h's Tree, fxrt.ir.graph.map_refs in C++), its
// result stored back, unpacked into several registers for a multi-output call. Needs the GIL.

#pragma once

#include "call_op.h"

#include <cstdint>
#include <vector>

namespace fxrt {

// `fn(*args, **kwargs)` into `outputs`; arguments without registers are passed as they are.
inline PyCallOp bind_pycall(
    PyObject* fn,
    PyObject* args,
    PyObject* kwargs,
    const std::vector<int64_t>& outputs,
    bool multi,
    const RefReader& refs) {
  PyCallOp call;
  call.fn = py::reinterpret_borrow<py::object>(fn);
  call.outputs = outputs;
  call.multi = multi;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args); ++i) {
    PyObject* arg = PyTuple_GET_ITEM(args, i);
    call.args.push_back(refs.contains_ref(arg) ? Tree(arg, refs) : Tree::constant(arg));
  }
  py::object consts = steal_or_throw(PyDict_New());
  PyObject *key, *value;
  Py_ssize_t pos = 0;
  while (PyDict_Next(kwargs, &pos, &key, &value)) {
    if (refs.contains_ref(value)) {
      call.kwargs.emplace_back(py::reinterpret_borrow<py::object>(key), Tree(value, refs));
    } else if (PyDict_SetItem(consts.ptr(), key, value) < 0) {
      throw_python_error();
    }
  }
  call.const_kwargs = PyDict_GET_SIZE(consts.ptr()) > 0 ? consts : py::none();
  return call;
}

inline void run_pycall(const PyCallOp& call, std::vector<IValue>& regs) {
  py::object args = steal_or_throw(PyTuple_New(static_cast<Py_ssize_t>(call.args.size())));
  for (size_t i = 0; i < call.args.size(); ++i) {
    PyTuple_SET_ITEM(args.ptr(), i, call.args[i].build(regs).release().ptr());
  }
  py::object kwargs = call.const_kwargs;
  if (!call.kwargs.empty()) {
    kwargs = steal_or_throw(kwargs.is_none() ? PyDict_New() : PyDict_Copy(kwargs.ptr()));
    for (const auto& [key, tree] : call.kwargs) {
      if (PyDict_SetItem(kwargs.ptr(), key.ptr(), tree.build(regs).ptr()) < 0) {
        throw_python_error();
      }
    }
  }
  py::object result = steal_or_throw(
      PyObject_Call(call.fn.ptr(), args.ptr(), kwargs.is_none() ? nullptr : kwargs.ptr()));
  if (!call.multi) {
    regs[static_cast<size_t>(call.outputs[0])] = from_python(result.ptr());
    return;
  }
  py::object it = steal_or_throw(PyObject_GetIter(result.ptr()));
  for (int64_t out : call.outputs) {
    PyObject* item = PyIter_Next(it.ptr());
    if (item == nullptr) {
      if (PyErr_Occurred()) {
        throw_python_error();
      }
      break;
    }
    regs[static_cast<size_t>(out)] = from_python(item);
    Py_DECREF(item);
  }
}

}  // namespace fxrt
