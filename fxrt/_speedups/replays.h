// Whole-graph capture's per-call work (fxrt/exec/capture.py; fxrt/exec/replays.py is the Python
// twin, which the Python loop uses and the tests hold this one to): the signature of a call's
// inputs, the lookup of its entry, and for an entry that holds a capture the replay itself:
// every fixed input where the capture read it, each copied input into its static buffer, a wait
// for the stream of the previous replay, the graph's replay and the call's outputs. Python keeps
// everything that happens once per signature (warm-up counts, captures, reports).
//
// Everything here runs with the GIL held, under the capture runner's lock.
#pragma once

#include <Python.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/autograd/python_variable.h>

#include "convert.h"
#include "signature.h"

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace fxrt {

// What a replay does, set once a signature is captured (ReplayIndex::arm).
struct Replay {
  struct Copy {
    size_t input;
    at::Tensor target;  // the static buffer (the whole storage as bytes, with `whole`)
    bool whole;  // the copy takes the input's whole storage
  };
  struct Leaf {
    int kind;  // 0 the object `value`, 1 a view of input `index`, 2 of pool buffer `index`
    py::object value;
    size_t index = 0;
    at::ScalarType dtype = at::kFloat;
    std::vector<int64_t> sizes, strides;
    int64_t offset = 0;
  };
  std::vector<std::pair<size_t, intptr_t>> fixed;  // (input, data_ptr) read in place
  std::vector<Copy> copies;
  py::object replay;  // the device graph's replay
  std::vector<Leaf> leaves;
  std::vector<at::Tensor> pool;  // byte views of the pool storages that outputs live in
  bool clone = true;  // each call's outputs on clones of the pool storages
  py::object build;  // builds the output structure from the list of leaves
};

inline at::Tensor on_storage(
    const c10::Storage& storage,
    at::ScalarType dtype,
    c10::Device device,
    int64_t offset,
    c10::IntArrayRef sizes,
    c10::IntArrayRef strides) {
  at::Tensor t = at::empty({0}, at::TensorOptions().dtype(dtype).device(device));
  return t.set_(storage, offset, sizes, strides);
}

inline at::Tensor bytes_of(const c10::Storage& storage, c10::Device device) {
  int64_t n = static_cast<int64_t>(storage.nbytes());
  return on_storage(storage, at::kByte, device, 0, {n}, {1});
}

// The signatures of one capture runner, by id in order of first sight, and the replays of those
// that hold a capture.
class ReplayIndex {
 public:
  // On the device of `device`, a torch.device.
  explicit ReplayIndex(PyObject* device) : device_(device_of(device)) {}

  // The id of the signature of `inputs` (a list or tuple), or -1 when it has none yet.
  int64_t find(PyObject* inputs) const {
    Signature sig = signature(inputs);
    auto it = ids_.find(sig);
    return it == ids_.end() ? -1 : it->second;
  }

  // A new id for the signature of `inputs`, which find() does not know.
  int64_t add(PyObject* inputs) {
    const int64_t id = static_cast<int64_t>(replays_.size());
    TORCH_CHECK_VALUE(
        ids_.emplace(signature(inputs), id).second, "fxrt: this input signature already has an id");
    replays_.emplace_back();
    counts_.push_back(0);
    return id;
  }

  // Signature `id` holds a capture: what its replays do, from the runner's plan (capture.py,
  // CaptureRunner._arm): `fixed` as (input, data_ptr) pairs; `copies` as (input, static buffer,
  // whole); `leaves` as ("value", object), ("input", i, like) or ("pool", k, like), `like` a
  // tensor whose dtype, sizes, strides and storage offset the output has; `pool` the byte views
  // of the pool storages; `build` makes the output structure from the list of leaves.
  void arm(
      int64_t id,
      py::handle fixed,
      py::handle copies,
      py::handle replay,
      py::handle leaves,
      py::handle pool,
      bool clone,
      py::handle build) {
    std::optional<Replay>& slot = at_(id);
    auto tensor = [](py::handle obj) -> const at::Tensor& {
      TORCH_CHECK_TYPE(THPVariable_Check(obj.ptr()), "fxrt: a replay's plan holds a tensor here");
      return THPVariable_Unpack(obj.ptr());
    };
    Replay r;
    for (py::handle f : fixed) {
      r.fixed.emplace_back(py::cast<size_t>(f[py::int_(0)]), py::cast<intptr_t>(f[py::int_(1)]));
    }
    for (py::handle c : copies) {
      const at::Tensor& target = tensor(c[py::int_(1)]);
      bool whole = py::cast<bool>(c[py::int_(2)]);
      r.copies.push_back({py::cast<size_t>(c[py::int_(0)]),
                          whole ? bytes_of(target.storage(), device_) : target, whole});
    }
    for (py::handle l : leaves) {
      Replay::Leaf leaf;
      const std::string kind = py::cast<std::string>(l[py::int_(0)]);
      if (kind == "value") {
        leaf.kind = 0;
        leaf.value = py::reinterpret_borrow<py::object>(l[py::int_(1)]);
      } else {
        leaf.kind = kind == "input" ? 1 : 2;
        leaf.index = py::cast<size_t>(l[py::int_(1)]);
        const at::Tensor& like = tensor(l[py::int_(2)]);
        leaf.dtype = like.scalar_type();
        leaf.sizes = like.sizes().vec();
        leaf.strides = like.strides().vec();
        leaf.offset = like.storage_offset();
      }
      r.leaves.push_back(std::move(leaf));
    }
    for (py::handle b : pool) {
      r.pool.push_back(tensor(b));
    }
    r.replay = py::reinterpret_borrow<py::object>(replay);
    r.build = py::reinterpret_borrow<py::object>(build);
    r.clone = clone;
    slot = std::move(r);
  }

  // Signature `id` holds no capture (any more).
  void disarm(int64_t id) { at_(id).reset(); }

  // Replays when the signature of `inputs` holds a capture and every fixed input is where the
  // capture read it: returns the outputs (a new reference) and sets `replayed`. Otherwise
  // returns None, having run nothing, and says why in last_id (the signature's id or -1), moved
  // (the input that moved, or -1) and why (1 its address changed, 2 its storage's size).
  PyObject* call(PyObject* inputs) {
    Signature sig = signature(inputs);
    auto it = ids_.find(sig);
    last_id = it == ids_.end() ? -1 : it->second;
    replayed = false;
    moved = -1;
    why = 0;
    if (last_id < 0 || !replays_[static_cast<size_t>(last_id)].has_value()) {
      Py_RETURN_NONE;
    }
    const Replay& r = *replays_[static_cast<size_t>(last_id)];
    PyObject** items = PySequence_Fast_ITEMS(inputs);
    for (const auto& [i, ptr] : r.fixed) {
      if (reinterpret_cast<intptr_t>(THPVariable_Unpack(items[i]).const_data_ptr()) != ptr) {
        moved = static_cast<int64_t>(i);
        why = 1;
        Py_RETURN_NONE;
      }
    }
    for (const Replay::Copy& c : r.copies) {
      if (c.whole &&
          THPVariable_Unpack(items[c.input]).storage().nbytes() != c.target.storage().nbytes()) {
        moved = static_cast<int64_t>(c.input);
        why = 2;
        Py_RETURN_NONE;
      }
    }
    wait_for_previous_stream();
    for (const Replay::Copy& c : r.copies) {
      const at::Tensor& x = THPVariable_Unpack(items[c.input]);
      at::Tensor target = c.target;  // a handle: copy_ writes the buffer it shares
      target.copy_(c.whole ? bytes_of(x.storage(), device_) : x);
    }
    py::object done = py::reinterpret_steal<py::object>(PyObject_CallNoArgs(r.replay.ptr()));
    if (!done) {
      throw_python_error();
    }
    replayed = true;
    ++counts_[static_cast<size_t>(last_id)];
    return outputs(r, items);
  }

  // How many replays signature `id` ran.
  int64_t replays(int64_t id) {
    at_(id);
    return counts_[static_cast<size_t>(id)];
  }

  // Forget every signature.
  void clear() {
    replays_.clear();
    counts_.clear();
    ids_.clear();
    previous_.reset();
  }

  int64_t last_id = -1;
  bool replayed = false;
  int64_t moved = -1;
  int why = 0;

 private:
  static c10::Device device_of(PyObject* obj) {
    TORCH_CHECK_TYPE(THPDevice_Check(obj), "fxrt: a replay index runs on a torch.device");
    return reinterpret_cast<THPDevice*>(obj)->device;
  }

  static Signature signature(PyObject* inputs) {
    TORCH_CHECK_TYPE(
        PyList_Check(inputs) || PyTuple_Check(inputs),
        "fxrt: capture takes the graph inputs as a list or tuple");
    Signature sig;
    if (!make_signature(inputs, sig)) {
      throw_python_error();
    }
    return sig;
  }

  std::optional<Replay>& at_(int64_t id) {
    TORCH_CHECK_INDEX(
        id >= 0 && static_cast<size_t>(id) < replays_.size(),
        "fxrt: no input signature has id ",
        id);
    return replays_[static_cast<size_t>(id)];
  }

  // A replay on another stream than the previous one waits for that stream.
  void wait_for_previous_stream() {
    const auto* impl = c10::impl::getDeviceGuardImpl(device_.type());
    c10::Stream current = impl->getStream(device_);
    if (previous_.has_value() && *previous_ != current) {
      c10::Event done(device_.type());
      done.record(*previous_);
      done.block(current);
    }
    previous_ = current;
  }

  PyObject* outputs(const Replay& r, PyObject** items) const {
    std::vector<c10::Storage> clones;
    if (r.clone) {
      for (const at::Tensor& b : r.pool) {
        clones.push_back(b.clone().storage());
      }
    }
    PyObject* list = PyList_New(static_cast<Py_ssize_t>(r.leaves.size()));
    if (list == nullptr) {
      throw_python_error();
    }
    for (size_t k = 0; k < r.leaves.size(); ++k) {
      const Replay::Leaf& leaf = r.leaves[k];
      PyObject* obj = nullptr;
      if (leaf.kind == 0) {
        obj = leaf.value.inc_ref().ptr();
      } else {
        const c10::Storage& storage = leaf.kind == 1
            ? THPVariable_Unpack(items[leaf.index]).storage()
            : clones.at(leaf.index);
        obj = THPVariable_Wrap(
            on_storage(storage, leaf.dtype, device_, leaf.offset, leaf.sizes, leaf.strides));
      }
      if (obj == nullptr) {
        Py_DECREF(list);
        throw_python_error();
      }
      PyList_SET_ITEM(list, static_cast<Py_ssize_t>(k), obj);
    }
    PyObject* out = PyObject_CallOneArg(r.build.ptr(), list);
    Py_DECREF(list);
    if (out == nullptr) {
      throw_python_error();
    }
    return out;
  }

  c10::Device device_;
  std::unordered_map<Signature, int64_t, SignatureHash> ids_;
  std::vector<std::optional<Replay>> replays_;  // by id; empty: no capture (yet)
  std::vector<int64_t> counts_;  // replays run, by id
  std::optional<c10::Stream> previous_;
};

}  // namespace fxrt
