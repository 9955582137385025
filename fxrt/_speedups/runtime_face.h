// What the Cython face of the C++ runtime (_runtime.pyx) needs: fxrt::Model loaded from a path or
// from bytes, its calls with Python values (tensors, ints, floats, bools, None) converted to and
// from c10::IValue, and the runtime's exceptions raised as fxrt's Python ones. The runtime itself
// (csrc/src, built with FXRT_NO_PYTHON) is the one the C++ API ships; this header is the only
// code that knows both.

#pragma once

#include <Python.h>

#include <torch/csrc/autograd/python_variable.h>

#include "fxrt/model.h"

#include <c10/util/Exception.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace fxrt {

// The Python exception types the runtime's errors become (fxrt.deploy sets them once).
struct FaceErrors {
  PyObject* package = nullptr;  // PackageError
  PyObject* unsupported = nullptr;  // a valid package the runtime cannot run
  PyObject* input = nullptr;  // InputError
  PyObject* run = nullptr;  // a callable(message, cause) -> exception, for RunError
};

inline FaceErrors& face_errors() {
  static FaceErrors errors;
  return errors;
}

inline void set_face_errors(PyObject* package, PyObject* unsupported, PyObject* input, PyObject* run) {
  FaceErrors& e = face_errors();
  for (PyObject* o : {package, unsupported, input, run}) {
    Py_INCREF(o);
  }
  e = {package, unsupported, input, run};
}

// A Python exception raised inside a call into Python the runtime made (a host executor's), carried
// through the runtime's C++ frames and raised again as it was.
struct PythonRaised {
  PyObject *type = nullptr, *value = nullptr, *traceback = nullptr;
  PythonRaised() { PyErr_Fetch(&type, &value, &traceback); }
  PythonRaised(PythonRaised&& o) noexcept : type(o.type), value(o.value), traceback(o.traceback) {
    o.type = o.value = o.traceback = nullptr;
  }
  PythonRaised(const PythonRaised&) = delete;
  ~PythonRaised() {
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(traceback);
  }
  void restore() {
    PyErr_Restore(type, value, traceback);
    type = value = traceback = nullptr;
  }
};

// The Cython `except +` handler: the exception in flight as the Python exception fxrt raises.
inline void raise_runtime_error() {
  const FaceErrors& e = face_errors();
  try {
    throw;
  } catch (PythonRaised& x) {
    x.restore();
  } catch (const Unsupported& x) {
    PyErr_SetString(e.unsupported ? e.unsupported : PyExc_ValueError, x.what());
  } catch (const PackageError& x) {
    PyErr_SetString(e.package ? e.package : PyExc_ValueError, x.what());
  } catch (const InputError& x) {
    PyErr_SetString(e.input ? e.input : PyExc_ValueError, x.what());
  } catch (const RunError& x) {
    if (e.run == nullptr) {
      PyErr_SetString(PyExc_RuntimeError, x.what());
      return;
    }
    PyObject* exc = PyObject_CallFunction(e.run, "si", x.what(), static_cast<int>(x.cause));
    if (exc != nullptr) {
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc)), exc);
      Py_DECREF(exc);
    }
  } catch (const std::invalid_argument& x) {
    PyErr_SetString(PyExc_ValueError, x.what());
  } catch (const c10::Error& x) {
    PyErr_SetString(PyExc_RuntimeError, x.what_without_backtrace());
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
  } catch (const std::exception& x) {
    PyErr_SetString(PyExc_RuntimeError, x.what());
  }
}

// A Python value as a run() input. Tensors, ints, floats, bools and None convert; any other
// object becomes an opaque value that names its type, so that the runtime's input check words the
// error ("expected a tensor, got a list") as for any other wrong input.
inline c10::IValue to_ivalue(PyObject* x) {
  if (THPVariable_Check(x)) {
    return THPVariable_Unpack(x);
  }
  if (PyBool_Check(x)) {
    return x == Py_True;
  }
  if (PyLong_Check(x)) {
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(x, &overflow);
    if (overflow == 0) {
      return static_cast<int64_t>(v);
    }
  } else if (PyFloat_Check(x)) {
    return PyFloat_AS_DOUBLE(x);
  } else if (x == Py_None) {
    return c10::IValue();
  }
  return foreign_value(Py_TYPE(x)->tp_name);
}

inline PyObject* from_ivalue(const c10::IValue& v) {
  if (v.isTensor()) {
    return THPVariable_Wrap(v.toTensor());
  }
  if (v.isInt()) {
    return PyLong_FromLongLong(v.toInt());
  }
  if (v.isDouble()) {
    return PyFloat_FromDouble(v.toDouble());
  }
  if (v.isBool()) {
    return PyBool_FromLong(v.toBool());
  }
  if (v.isNone()) {
    Py_RETURN_NONE;
  }
  PyErr_Format(PyExc_TypeError, "fxrt: the runtime returned a %s", v.tagKind().c_str());
  return nullptr;
}

// One loaded model and its calls from Python.
class FaceModel {
 public:
  // `source`: a str path, or an object with the buffer protocol (the package's bytes).
  // `arena_max_idle` -1: the package's.
  FaceModel(
      PyObject* source,
      const std::string& device,
      bool verify_weights,
      bool arena,
      int64_t arena_max_idle,
      int check_inputs,
      bool host_executor) {
    LoadOptions options;
    options.verify_weights = verify_weights;
    options.arena = arena;
    options.host_executor = host_executor;
    if (check_inputs >= 0) {
      options.check_inputs = check_inputs != 0;
    }
    if (arena_max_idle >= 0) {
      options.arena_max_idle = arena_max_idle;
    }
    if (!device.empty()) {
      options.device = c10::Device(device);
    }
    if (PyUnicode_Check(source)) {
      const char* path = PyUnicode_AsUTF8(source);
      if (path == nullptr) {
        throw std::invalid_argument("fxrt.load: the path is not valid UTF-8");
      }
      std::string p(path);
      Py_BEGIN_ALLOW_THREADS;
      try {
        model_ = std::make_unique<Model>(p, options);
      } catch (...) {
        Py_BLOCK_THREADS;
        throw;
      }
      Py_END_ALLOW_THREADS;
      return;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(source, &view, PyBUF_SIMPLE) != 0) {
      PyErr_Clear();
      throw std::invalid_argument("fxrt.load: expected a path or the package's bytes");
    }
    try {
      model_ = std::make_unique<Model>(Model::from_bytes(view.buf, static_cast<size_t>(view.len), options));
    } catch (...) {
      PyBuffer_Release(&view);
      throw;
    }
    PyBuffer_Release(&view);
  }

  // The outputs of a call on `args` (a tuple or list of the user inputs, in call order), as a
  // list. The GIL is released while the program runs.
  PyObject* run(PyObject* args) const {
    std::vector<c10::IValue> inputs = values(args);
    std::vector<c10::IValue> out;
    Py_BEGIN_ALLOW_THREADS;
    try {
      out = model_->run(inputs);
    } catch (...) {
      Py_BLOCK_THREADS;
      throw;
    }
    Py_END_ALLOW_THREADS;
    return list_of(out);
  }

  // As run(), the graph run by `executor` (a Python callable: the list of graph inputs to the
  // sequence of graph outputs; Model::run_on), with the GIL held.
  PyObject* run_on(PyObject* args, PyObject* executor) const {
    std::vector<c10::IValue> out = model_->run_on(values(args), [executor](std::vector<c10::IValue> in) {
      PyObject* list = list_of(in);
      PyObject* got = list != nullptr ? PyObject_CallOneArg(executor, list) : nullptr;
      Py_XDECREF(list);
      PyObject* seq = got != nullptr ? PySequence_Fast(got, "fxrt: the executor returns a sequence") : nullptr;
      Py_XDECREF(got);
      if (seq == nullptr) {
        throw PythonRaised();
      }
      std::vector<c10::IValue> results = values_of(seq);
      Py_DECREF(seq);
      return results;
    });
    return list_of(out);
  }

  // name -> tensor, as Model::state_dict.
  PyObject* state_dict() const {
    PyObject* d = PyDict_New();
    if (d == nullptr) {
      return nullptr;
    }
    for (const auto& [name, t] : model_->state_dict()) {
      PyObject* v = THPVariable_Wrap(t);
      if (v == nullptr || PyDict_SetItemString(d, name.c_str(), v) != 0) {
        Py_XDECREF(v);
        Py_DECREF(d);
        return nullptr;
      }
      Py_DECREF(v);
    }
    return d;
  }

  // `weights`: a dict of name -> tensor (the face checks the types).
  void update_weights(PyObject* weights, bool strict) const {
    std::unordered_map<std::string, at::Tensor> w;
    PyObject *key = nullptr, *value = nullptr;
    Py_ssize_t pos = 0;
    while (PyDict_Next(weights, &pos, &key, &value)) {
      const char* name = PyUnicode_AsUTF8(key);
      if (name == nullptr || !THPVariable_Check(value)) {
        PyErr_Clear();
        throw std::invalid_argument("fxrt: update_weights takes a dict of str -> torch.Tensor");
      }
      w.emplace(name, THPVariable_Unpack(value));
    }
    model_->update_weights(w, strict);
  }

  // The user inputs in call order: (name, path, is_int) each.
  PyObject* inputs() const {
    const std::vector<InputInfo>& infos = model_->inputs();
    PyObject* list = PyList_New(static_cast<Py_ssize_t>(infos.size()));
    for (size_t i = 0; list != nullptr && i < infos.size(); ++i) {
      PyObject* t = Py_BuildValue(
          "(ssO)", infos[i].name.c_str(), infos[i].path.c_str(), infos[i].is_int ? Py_True : Py_False);
      if (t == nullptr) {
        Py_DECREF(list);
        return nullptr;
      }
      PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), t);
    }
    return list;
  }

  PyObject* manifest_json() const {
    std::string_view text = model_->manifest_json();
    return PyBytes_FromStringAndSize(text.data(), static_cast<Py_ssize_t>(text.size()));
  }

  PyObject* manifest_field(const std::string& key) const {
    std::string_view text = model_->manifest_field(key);
    return PyBytes_FromStringAndSize(text.data(), static_cast<Py_ssize_t>(text.size()));
  }

  PyObject* entry_bytes(const std::string& name) const {
    std::string_view bytes = model_->entry_bytes(name);
    return PyBytes_FromStringAndSize(bytes.data(), static_cast<Py_ssize_t>(bytes.size()));
  }

  const Model& model() const { return *model_; }

 private:
  static std::vector<c10::IValue> values_of(PyObject* seq) {
    std::vector<c10::IValue> inputs;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    inputs.reserve(static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
      inputs.push_back(to_ivalue(PySequence_Fast_GET_ITEM(seq, i)));
    }
    return inputs;
  }

  static std::vector<c10::IValue> values(PyObject* args) {
    PyObject* seq = PySequence_Fast(args, "fxrt: run() takes a sequence of inputs");
    if (seq == nullptr) {
      throw PythonRaised();
    }
    std::vector<c10::IValue> inputs = values_of(seq);
    Py_DECREF(seq);
    return inputs;
  }

  static PyObject* list_of(const std::vector<c10::IValue>& values) {
    PyObject* list = PyList_New(static_cast<Py_ssize_t>(values.size()));
    if (list == nullptr) {
      return nullptr;
    }
    for (size_t i = 0; i < values.size(); ++i) {
      PyObject* o = from_ivalue(values[i]);
      if (o == nullptr) {
        Py_DECREF(list);
        return nullptr;
      }
      PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), o);
    }
    return list;
  }

  std::unique_ptr<Model> model_;
};

}  // namespace fxrt
