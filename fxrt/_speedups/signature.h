// The signature of a call's inputs that whole-graph capture keys its captures on (replays.h;
// fxrt/exec/replays.py, signature(), is the Python twin). Needs the GIL.
#pragma once

#include <Python.h>

#include <ATen/core/Tensor.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace fxrt {

// A call's signature: the grad and inference modes, then per input its kind and what capture
// depends on (a tensor's dtype, device, layout, sizes, strides and storage offset; a number's
// type and value). Any other input is kept as an object and compared with ==, as a Python
// tuple of (type, value) would be.
struct Signature {
  std::vector<int64_t> words;
  std::vector<pybind11::object> objects;
  size_t hash = 0;

  bool operator==(const Signature& o) const {
    if (hash != o.hash || words != o.words || objects.size() != o.objects.size()) {
      return false;
    }
    for (size_t i = 0; i < objects.size(); ++i) {
      int eq = PyObject_RichCompareBool(objects[i].ptr(), o.objects[i].ptr(), Py_EQ);
      if (eq != 1) {
        PyErr_Clear();  // an object that cannot be compared makes a signature of its own
        return false;
      }
    }
    return true;
  }
};

struct SignatureHash {
  size_t operator()(const Signature& s) const { return s.hash; }
};

inline void mix(size_t& h, uint64_t v) {
  h ^= static_cast<size_t>(v) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
}

// The signature of `inputs` (a list or tuple). Returns false with a Python error set when an
// input that is no tensor or number cannot be hashed.
inline bool make_signature(PyObject* inputs, Signature& sig) {
  std::vector<int64_t>& w = sig.words;
  w.clear();
  w.push_back(c10::GradMode::is_enabled());
  w.push_back(c10::InferenceMode::is_enabled());
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(inputs);
  PyObject** items = PySequence_Fast_ITEMS(inputs);
  size_t h = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* x = items[i];
    if (THPVariable_Check(x)) {
      const at::Tensor& t = THPVariable_Unpack(x);
      w.push_back(1);
      w.push_back(static_cast<int64_t>(t.scalar_type()));
      w.push_back(static_cast<int64_t>(t.device().type()));
      w.push_back(t.device().index());
      w.push_back(static_cast<int64_t>(t.layout()));
      w.push_back(t.dim());
      for (int64_t s : t.sizes()) {
        w.push_back(s);
      }
      if (t.layout() == c10::kStrided) {
        for (int64_t s : t.strides()) {
          w.push_back(s);
        }
        w.push_back(t.storage_offset());
      }
      continue;
    }
    int overflow = 0;
    if (x == Py_None) {
      w.push_back(2);
    } else if (PyBool_Check(x)) {
      w.push_back(3);
      w.push_back(x == Py_True);
    } else if (PyLong_CheckExact(x) && (PyLong_AsLongLongAndOverflow(x, &overflow), !overflow)) {
      w.push_back(4);
      w.push_back(PyLong_AsLongLong(x));
    } else if (PyFloat_CheckExact(x)) {
      double v = PyFloat_AS_DOUBLE(x);
      v = v == 0.0 ? 0.0 : v;  // -0.0 == 0.0, as in Python
      int64_t bits = 0;
      std::memcpy(&bits, &v, sizeof bits);
      w.push_back(5);
      w.push_back(bits);
    } else {
      Py_hash_t ph = PyObject_Hash(x);
      if (ph == -1 && PyErr_Occurred()) {
        return false;
      }
      w.push_back(6);
      w.push_back(reinterpret_cast<intptr_t>(Py_TYPE(x)));
      mix(h, static_cast<uint64_t>(ph));
      sig.objects.push_back(pybind11::reinterpret_borrow<pybind11::object>(x));
    }
  }
  for (int64_t v : w) {
    mix(h, static_cast<uint64_t>(v));
  }
  sig.hash = h;
  return true;
}

}  // namespace fxrt
