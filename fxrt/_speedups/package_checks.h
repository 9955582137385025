// What a loaded package checks on each call before its graph runs (fxrt/deploy/binder.py,
// Binder.quick, is the Python twin and words every error): each size symbol within its exported
// range, each constant input equal to the exported one, and each int input an int within its
// symbol's range and equal to the value a tensor dimension bound that symbol to. The compiled
// graph checks the rest (dtypes, devices, static sizes, strides: inputs.h). Anything that does
// not pass, or that this cannot read, makes ok() false: the Python binder then runs and raises
// the error that names the input. Needs the GIL.
#pragma once

#include <Python.h>

#include <ATen/core/Tensor.h>
#include <c10/util/SmallVector.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace fxrt {

class PackageChecks {
 public:
  // Tensor argument `leaf`'s size `dim` lies in [lo, hi].
  void add_range(int64_t leaf, int64_t dim, int64_t lo, int64_t hi) {
    ranges_.push_back({leaf, dim, lo, hi});
  }

  // Argument `leaf` has the type of `value` and equals it.
  void add_constant(int64_t leaf, PyObject* value) {
    constants_.emplace_back(leaf, pybind11::reinterpret_borrow<pybind11::object>(value));
  }

  // Size symbol `sym` is bound by argument `leaf`: its size `dim`, or (dim -1) its int value.
  void add_site(int64_t sym, int64_t leaf, int64_t dim) {
    sites_.push_back({sym, leaf, dim});
    n_syms_ = std::max(n_syms_, static_cast<size_t>(sym) + 1);
  }

  // Argument `leaf` is an int in [lo, hi] equal to symbol `sym`'s value.
  void add_int(int64_t leaf, int64_t sym, int64_t lo, int64_t hi) {
    ints_.push_back({leaf, sym, lo, hi});
    n_syms_ = std::max(n_syms_, static_cast<size_t>(sym) + 1);
  }

  // Whether the call's arguments (a tuple of the exported leaves) pass.
  bool ok(PyObject* args) const {
    PyObject** items = PySequence_Fast_ITEMS(args);
    const int64_t n = PySequence_Fast_GET_SIZE(args);
    for (const Range& r : ranges_) {
      int64_t size = 0;
      if (r.leaf >= n || !size_of(items[r.leaf], r.dim, size) || size < r.lo || size > r.hi) {
        return false;
      }
    }
    for (const auto& [leaf, value] : constants_) {
      if (leaf >= n || Py_TYPE(items[leaf]) != Py_TYPE(value.ptr())) {
        return false;
      }
      int eq = PyObject_RichCompareBool(items[leaf], value.ptr(), Py_EQ);
      if (eq != 1) {
        PyErr_Clear();
        return false;
      }
    }
    if (ints_.empty()) {
      return true;
    }
    c10::SmallVector<int64_t, 8> env(n_syms_, 0);  // each symbol's value, from its site
    for (const Site& s : sites_) {
      if (s.leaf >= n) {
        return false;
      }
      int64_t v = 0;
      if (s.dim >= 0 ? !size_of(items[s.leaf], s.dim, v) : !int_of(items[s.leaf], v)) {
        return false;
      }
      env[static_cast<size_t>(s.sym)] = v;
    }
    for (const IntCheck& c : ints_) {
      int64_t v = 0;
      if (c.leaf >= n || !int_of(items[c.leaf], v) || v < c.lo || v > c.hi ||
          env[static_cast<size_t>(c.sym)] != v) {
        return false;
      }
    }
    return true;
  }

 private:
  struct Range {
    int64_t leaf, dim, lo, hi;
  };
  struct Site {
    int64_t sym, leaf, dim;
  };
  struct IntCheck {
    int64_t leaf, sym, lo, hi;
  };

  static bool size_of(PyObject* x, int64_t dim, int64_t& size) {
    if (!THPVariable_Check(x)) {
      return false;
    }
    const at::Tensor& t = THPVariable_Unpack(x);
    if (dim >= t.dim() || t.layout() != c10::kStrided) {
      return false;
    }
    size = t.sizes()[static_cast<size_t>(dim)];
    return true;
  }

  // An int (not a bool, as Python's `type(x) is int`) that fits in 64 bits.
  static bool int_of(PyObject* x, int64_t& v) {
    if (!PyLong_CheckExact(x)) {
      return false;
    }
    int overflow = 0;
    v = PyLong_AsLongLongAndOverflow(x, &overflow);
    return overflow == 0 && !(v == -1 && PyErr_Occurred());
  }

  std::vector<Range> ranges_;
  std::vector<std::pair<int64_t, pybind11::object>> constants_;
  std::vector<Site> sites_;
  std::vector<IntCheck> ints_;
  size_t n_syms_ = 0;
};

}  // namespace fxrt
