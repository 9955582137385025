// Conversions between Python objects and the c10::IValue registers of the compiled loop.
//
// A register holds whatever the Python loop's register would hold, in IValue form:
//
// * tensors, None, bools, ints, floats and SymInt/SymFloat/SymBool become the matching IValue,
//   so native ops read them without touching Python;
// * any other Python object (a GraphModule constant, a list built by a Python fallback, a dtype,
//   a string...) is kept as it is, wrapped in a PyObject holder (IValue tag PyObject). Only Python
//   fallbacks read it as such; a native op that receives one converts it against its schema type,
//   exactly as torch.ops would (the slow path in call.h).
//
// Going back, a holder gives back the very object it holds and a tensor gives back its Python
// object (THPVariable_Wrap returns the existing one), so identities survive the round trip.
// Everything here needs the GIL.

#pragma once

#include <Python.h>

#include <ATen/core/ivalue.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/python_symnode.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace fxrt {

namespace py = pybind11;
using c10::IValue;

// Raise the pending Python error through C++ frames; torch's error macros restore it.
[[noreturn]] inline void throw_python_error() {
  python_error err;
  err.persist();
  throw std::move(err);
}

// A Python object in a register. (torch's ConcretePyObjectHolder cannot be used from an
// extension: its inline type inference calls a function libtorch_python does not export.)
class PyHolder final : public c10::ivalue::PyObjectHolder {
 public:
  explicit PyHolder(PyObject* obj) : obj_(obj) { Py_INCREF(obj); }
  PyHolder(const PyHolder&) = delete;
  PyHolder& operator=(const PyHolder&) = delete;
  ~PyHolder() override {
    py::gil_scoped_acquire gil;  // registers may be freed while the GIL is released
    Py_DECREF(obj_);
  }

  PyObject* getPyObject() override { return obj_; }

  c10::InferredType tryToInferType() override {
    return c10::InferredType("fxrt register holding a Python object: type not inferred");
  }

  IValue toIValue(const c10::TypePtr& type, std::optional<int32_t> N) override {
    py::gil_scoped_acquire gil;
    return torch::jit::toIValue(obj_, type, N);
  }

  std::string toStr() override {
    py::gil_scoped_acquire gil;
    return py::str(obj_);
  }

  std::vector<at::Tensor> extractTensors() override {
    py::gil_scoped_acquire gil;
    std::vector<at::Tensor> out;
    collect_tensors(obj_, out);
    return out;
  }

 private:
  static void collect_tensors(PyObject* obj, std::vector<at::Tensor>& out) {
    if (THPVariable_Check(obj)) {
      out.push_back(THPVariable_Unpack(obj));
    } else if (PyTuple_Check(obj) || PyList_Check(obj)) {
      for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(obj); ++i) {
        collect_tensors(PySequence_Fast_GET_ITEM(obj, i), out);
      }
    }
  }

  PyObject* obj_;
};

inline IValue hold_python_object(PyObject* obj) {
  return IValue(c10::intrusive_ptr<c10::ivalue::PyObjectHolder>(c10::make_intrusive<PyHolder>(obj)));
}

// The register value for a Python object (a graph input or a fallback's result).
inline IValue from_python(PyObject* obj) {
  if (THPVariable_Check(obj)) {
    return IValue(THPVariable_Unpack(obj));
  }
  if (obj == Py_None) {
    return IValue();
  }
  if (PyBool_Check(obj)) {
    return IValue(obj == Py_True);
  }
  if (PyLong_CheckExact(obj)) {
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (overflow == 0 && !(v == -1 && PyErr_Occurred())) {
      return IValue(static_cast<int64_t>(v));
    }
    PyErr_Clear();  // too big for int64: keep the Python int, as the Python loop would
    return hold_python_object(obj);
  }
  if (PyFloat_CheckExact(obj)) {
    return IValue(PyFloat_AS_DOUBLE(obj));
  }
  py::handle h(obj);
  if (torch::is_symint(h)) {
    return torch::jit::toIValue(h, c10::SymIntType::get());
  }
  if (torch::is_symfloat(h)) {
    return torch::jit::toIValue(h, c10::SymFloatType::get());
  }
  if (torch::is_symbool(h)) {
    return torch::jit::toIValue(h, c10::SymBoolType::get());
  }
  return hold_python_object(obj);
}

// A new reference to the Python form of a register.
inline PyObject* to_python(const IValue& v) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    // torch.ops turns wrapped numbers back into Python scalars; keep that behaviour.
    if (!t.defined() || !t.unsafeGetTensorImpl()->is_wrapped_number()) {
      return THPVariable_Wrap(t);
    }
  } else if (v.isPyObject()) {
    PyObject* obj = v.toPyObject();
    Py_INCREF(obj);
    return obj;
  } else if (v.isNone()) {
    Py_RETURN_NONE;
  } else if (v.isInt()) {
    return PyLong_FromLongLong(v.toInt());
  } else if (v.isDouble()) {
    return PyFloat_FromDouble(v.toDouble());
  } else if (v.isBool()) {
    return PyBool_FromLong(v.toBool());
  }
  return torch::jit::toPyObject(v).release().ptr();
}

// Reads Ref objects (fxrt.ir.graph.Ref) of one Program, at construction time only.
class RefReader {
 public:
  explicit RefReader(PyObject* ref_type) : type_(reinterpret_cast<PyTypeObject*>(ref_type)) {
    Py_INCREF(ref_type);
  }
  RefReader(const RefReader&) = delete;
  RefReader& operator=(const RefReader&) = delete;
  ~RefReader() { Py_DECREF(reinterpret_cast<PyObject*>(type_)); }

  bool is_ref(PyObject* obj) const { return PyObject_TypeCheck(obj, type_); }

  int64_t id(PyObject* ref) const {
    PyObject* id = PyObject_GetAttrString(ref, "id");
    if (id == nullptr) {
      throw_python_error();
    }
    int64_t value = PyLong_AsLongLong(id);
    Py_DECREF(id);
    if (value == -1 && PyErr_Occurred()) {
      throw_python_error();
    }
    return value;
  }

  // True if a Ref occurs in a nest of tuples, lists, slices and dict values
  // (fxrt.ir.graph.refs_in).
  bool contains_ref(PyObject* tree) const {
    if (is_ref(tree)) {
      return true;
    }
    if (PySlice_Check(tree)) {
      auto* sl = reinterpret_cast<PySliceObject*>(tree);
      return contains_ref(sl->start) || contains_ref(sl->stop) || contains_ref(sl->step);
    }
    if (PyTuple_Check(tree) || PyList_Check(tree)) {
      Py_ssize_t n = PySequence_Fast_GET_SIZE(tree);
      for (Py_ssize_t i = 0; i < n; ++i) {
        if (contains_ref(PySequence_Fast_GET_ITEM(tree, i))) {
          return true;
        }
      }
    } else if (PyDict_Check(tree)) {
      PyObject *key, *value;
      Py_ssize_t pos = 0;
      while (PyDict_Next(tree, &pos, &key, &value)) {
        if (contains_ref(value)) {
          return true;
        }
      }
    }
    return false;
  }

 private:
  PyTypeObject* type_;
};

inline py::object steal_or_throw(PyObject* obj) {
  if (obj == nullptr) {
    throw_python_error();
  }
  return py::reinterpret_steal<py::object>(obj);
}

// A nest of tuples, lists, slices and dicts with registers and constants at its leaves, resolved once:
// build() is fxrt.ir.graph.map_refs with every Ref replaced by its register. As in map_refs,
// tuples, lists and dicts come back as new plain tuple/list/dict objects on every call and any
// other object is passed through as it is.
class Tree {
 public:
  Tree(PyObject* obj, const RefReader& refs) {
    if (refs.is_ref(obj)) {
      kind_ = REG;
      reg_ = refs.id(obj);
    } else if (PyTuple_Check(obj) || PyList_Check(obj)) {
      kind_ = PyTuple_Check(obj) ? TUPLE : LIST;
      Py_ssize_t n = PySequence_Fast_GET_SIZE(obj);
      items_.reserve(static_cast<size_t>(n));
      for (Py_ssize_t i = 0; i < n; ++i) {
        items_.emplace_back(PySequence_Fast_GET_ITEM(obj, i), refs);
      }
    } else if (PySlice_Check(obj)) {
      kind_ = SLICE;
      auto* sl = reinterpret_cast<PySliceObject*>(obj);
      for (PyObject* part : {sl->start, sl->stop, sl->step}) {
        items_.emplace_back(part, refs);
      }
    } else if (PyDict_Check(obj)) {
      kind_ = DICT;
      PyObject *key, *value;
      Py_ssize_t pos = 0;
      while (PyDict_Next(obj, &pos, &key, &value)) {
        keys_.push_back(py::reinterpret_borrow<py::object>(key));
        items_.emplace_back(value, refs);
      }
    } else {
      kind_ = CONST;
      obj_ = py::reinterpret_borrow<py::object>(obj);
    }
  }

  // A leaf passed as it is, even a list: the Python loop passes arguments without Refs as they
  // are, and rebuilds only the ones that hold Refs.
  static Tree constant(PyObject* obj) {
    Tree tree;
    tree.obj_ = py::reinterpret_borrow<py::object>(obj);
    return tree;
  }

  py::object build(const std::vector<IValue>& regs) const {
    switch (kind_) {
      case REG:
        return steal_or_throw(to_python(regs[static_cast<size_t>(reg_)]));
      case CONST:
        return obj_;
      case TUPLE:
      case LIST: {
        Py_ssize_t n = static_cast<Py_ssize_t>(items_.size());
        py::object out = steal_or_throw(kind_ == TUPLE ? PyTuple_New(n) : PyList_New(n));
        for (Py_ssize_t i = 0; i < n; ++i) {
          PyObject* item = items_[static_cast<size_t>(i)].build(regs).release().ptr();
          if (kind_ == TUPLE) {
            PyTuple_SET_ITEM(out.ptr(), i, item);
          } else {
            PyList_SET_ITEM(out.ptr(), i, item);
          }
        }
        return out;
      }
      case SLICE:
        return steal_or_throw(PySlice_New(
            items_[0].build(regs).ptr(), items_[1].build(regs).ptr(), items_[2].build(regs).ptr()));
      case DICT: {
        py::object out = steal_or_throw(PyDict_New());
        for (size_t i = 0; i < items_.size(); ++i) {
          if (PyDict_SetItem(out.ptr(), keys_[i].ptr(), items_[i].build(regs).ptr()) < 0) {
            throw_python_error();
          }
        }
        return out;
      }
    }
    return obj_;
  }

 private:
  Tree() = default;

  enum Kind : uint8_t { REG, CONST, TUPLE, LIST, SLICE, DICT };
  Kind kind_ = CONST;
  int64_t reg_ = -1;
  py::object obj_;
  std::vector<py::object> keys_;
  std::vector<Tree> items_;
};

}  // namespace fxrt
