// The ALLOC and VIEW instructions' forms that need no dispatcher, each made exactly as the op's
// own CPU kernel would: a constant CPU empty_strided, and views (reinterpret_tensor on every call;
// view, t, transpose, permute on calls that use the arena, so autograd records nothing). lower()
// chose them (fxrt/exec/program.py); each returns false when a dispatch mode, a subclass or a
// functional tensor would route the call elsewhere, or when the actual input is not what it
// handles, and the loop then runs the plain call, which behaves (and fails) as it would anyway.

#pragma once

#include "call_op.h"

#include <ATen/Context.h>
#include <ATen/EmptyTensor.h>
#include <ATen/InferSize.h>
#include <ATen/TensorUtils.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace fxrt {

// A tensor the dispatcher would hand straight to its CPU (or other backend) kernel, dispatch
// modes aside: no subclass, no functional wrapper, and strided with a storage.
inline bool plain_layout(const at::Tensor& self) {
  // Functionality keys only: a backend key such as Meta would also match every dense tensor.
  constexpr c10::DispatchKeySet wrapped({c10::DispatchKey::Python, c10::DispatchKey::Functionalize});
  return self.defined() && self.layout() == c10::kStrided && self.has_storage() &&
      !self.key_set().has_any(wrapped);
}

// The same, and no dispatch mode active (what an op called through the dispatcher checks).
inline bool plain_tensor(const at::Tensor& self) {
  return !c10::impl::TorchDispatchModeTLS::any_modes_set() && plain_layout(self);
}

// A new TensorImpl on `self`'s storage with the given geometry, as ATen's CPU view kernels make
// it (alias_with_sizes_and_strides), without autograd's view tracking.
inline at::Tensor raw_alias(
    const at::Tensor& self,
    c10::IntArrayRef sizes,
    c10::IntArrayRef strides,
    int64_t storage_offset) {
  at::Tensor alias = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(self.storage()), self.key_set(), self.dtype());
  c10::TensorImpl* impl = alias.unsafeGetTensorImpl();
  impl->set_storage_offset(storage_offset);
  impl->set_sizes_and_strides(sizes, strides);
  return alias;
}

// True when the geometry reads only bytes of `self`'s storage (what as_strided checks): a graph
// loaded from a file must never alias memory outside its tensors.
inline bool within_storage(
    const at::Tensor& self,
    const std::vector<int64_t>& sizes,
    const std::vector<int64_t>& strides,
    int64_t offset) {
  if (sizes.size() != strides.size() || offset < 0) {
    return false;
  }
  int64_t last = offset;  // the highest element index read
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] < 0 || strides[i] < 0) {
      return false;
    }
    if (sizes[i] == 0) {
      return true;  // reads nothing
    }
    int64_t span = 0;
    if (__builtin_mul_overflow(sizes[i] - 1, strides[i], &span) ||
        __builtin_add_overflow(last, span, &last)) {
      return false;
    }
  }
  const int64_t itemsize = static_cast<int64_t>(self.dtype().itemsize());
  int64_t end = 0;
  return !__builtin_mul_overflow(last + 1, itemsize, &end) &&
      end <= static_cast<int64_t>(self.storage().nbytes());
}

// torch.use_deterministic_algorithms(True) with fill_uninitialized_memory: new tensors are
// filled (NaN), which only the dispatcher's empty_strided does and no reused arena slot is.
inline bool fills_uninitialized_memory() {
  return at::globalContext().deterministicAlgorithms() &&
      at::globalContext().deterministicFillUninitializedMemory();
}

// The thread's modes the inline forms depend on, read once per call (the loop's workers for
// CPU streams get the caller's).
struct CallModes {
  bool dispatch = false;  // a TorchDispatchMode is active: it must see the graph's own ops
  bool fill = false;  // new memory must be filled (fills_uninitialized_memory)

  static CallModes current() {
    return {c10::impl::TorchDispatchModeTLS::any_modes_set(), fills_uninitialized_memory()};
  }
};

// ALLOC's cpu form: aten::empty_strided's CPU kernel is at::detail::empty_strided_cpu; made
// directly, as Inductor's own empty_strided_cpu helper does (about 1 us less per allocation).
inline bool run_cpu_empty(const AllocOp& alloc, std::vector<IValue>& regs, CallModes modes) {
  if (!alloc.cpu.has_value() || modes.dispatch || modes.fill) {
    return false;
  }
  const AllocOp::CpuEmpty& e = *alloc.cpu;
  regs[static_cast<size_t>(alloc.call.outputs[0])] = at::Tensor(at::detail::empty_strided_cpu(
      e.sizes, e.strides, e.dtype, std::nullopt, std::nullopt, std::nullopt));
  return true;
}

// The cpu form of an ALLOC whose plain call is a constant empty_strided (lower() checked the
// arguments: non-negative sizes and strides, CPU, strided, no pinned memory); false if the bound
// arguments are not those.
inline bool bind_cpu_empty(AllocOp& alloc) {
  const auto& args = alloc.call.args;
  if (args.size() != 6) {
    return false;
  }
  for (const BoundArg& arg : args) {
    if (arg.kind != BoundArg::CONST) {
      return false;
    }
  }
  if (!args[0].value.isIntList() || !args[1].value.isIntList()) {
    return false;
  }
  alloc.cpu = AllocOp::CpuEmpty{
      args[0].value.toIntVector(), args[1].value.toIntVector(),
      args[2].value.toOptional<at::ScalarType>()};
  return true;
}

// split.Tensor's pieces along a dimension, as its CPU kernel makes them (narrow: the input's
// strides, the offset moved to each piece); false when the plain call must run it (a 0-d input, a
// dimension out of range, another number of pieces than outputs).
inline bool run_split(const ViewOp& view, const at::Tensor& self, std::vector<IValue>& regs) {
  const int64_t ndim = self.dim();
  if (view.ints.size() != 2 || ndim == 0) {
    return false;
  }
  const int64_t size = view.ints[0], d = view.ints[1] < 0 ? view.ints[1] + ndim : view.ints[1];
  if (size <= 0 || d < 0 || d >= ndim) {
    return false;
  }
  const int64_t length = self.size(d);
  const auto& outputs = view.call.outputs;
  const int64_t pieces = length == 0 ? 1 : (length + size - 1) / size;
  if (pieces != static_cast<int64_t>(outputs.size())) {
    return false;
  }
  c10::DimVector sizes(self.sizes().begin(), self.sizes().end());
  for (int64_t i = 0; i < pieces; ++i) {
    const int64_t start = i * size;
    sizes[static_cast<size_t>(d)] = std::min(size, length - start);
    regs[static_cast<size_t>(outputs[static_cast<size_t>(i)])] =
        raw_alias(self, sizes, self.strides(), self.storage_offset() + start * self.stride(d));
  }
  return true;
}

// A VIEW; false when the plain call must run it (not a plain tensor, a view the sizes cannot
// express, a dimension out of range: it then raises the op's own error).
inline bool run_view(const ViewOp& view, std::vector<IValue>& regs, CallModes modes) {
  const IValue& v = regs[static_cast<size_t>(view.self)];
  if (modes.dispatch || !v.isTensor() || !plain_layout(v.toTensor())) {
    return false;
  }
  const at::Tensor& self = v.toTensor();
  const size_t out = static_cast<size_t>(view.call.outputs[0]);
  if (view.kind == ViewOp::Kind::REINTERPRET) {  // fxrt::reinterpret_tensor: no view tracking
    const int64_t offset = self.storage_offset() + view.offset;
    if (!within_storage(self, view.ints, view.strides, offset)) {
      return false;  // as_strided raises its own error
    }
    regs[out] = raw_alias(self, view.ints, view.strides, offset);
    return true;
  }
  const int64_t ndim = self.dim();
  c10::DimVector sizes(self.sizes().begin(), self.sizes().end());
  c10::DimVector strides(self.strides().begin(), self.strides().end());
  auto wrap = [ndim](int64_t d) -> std::optional<int64_t> {
    int64_t n = std::max<int64_t>(ndim, 1);
    if (d < -n || d >= n) {
      return std::nullopt;
    }
    return d < 0 ? d + n : d;
  };
  switch (view.kind) {
    case ViewOp::Kind::REINTERPRET:
      return false;
    case ViewOp::Kind::SPLIT:
      return run_split(view, self, regs);
    case ViewOp::Kind::VIEW: {
      at::DimVector shape = at::infer_size_dv(view.ints, self.numel());
      std::optional<at::DimVector> st = at::detail::computeStride(self.sizes(), self.strides(), shape);
      if (!st.has_value()) {
        return false;
      }
      sizes.assign(shape.begin(), shape.end());
      strides.assign(st->begin(), st->end());
      break;
    }
    case ViewOp::Kind::T:
    case ViewOp::Kind::TRANSPOSE: {
      const bool t = view.kind == ViewOp::Kind::T;
      if ((t && ndim > 2) || (!t && view.ints.size() != 2)) {
        return false;
      }
      if (ndim < 2) {
        break;  // t and transpose of a 0-d or 1-d tensor alias it as it is
      }
      std::optional<int64_t> a = t ? 0 : wrap(view.ints[0]);
      std::optional<int64_t> b = t ? 1 : wrap(view.ints[1]);
      if (!a.has_value() || !b.has_value()) {
        return false;
      }
      std::swap(sizes[*a], sizes[*b]);
      std::swap(strides[*a], strides[*b]);
      break;
    }
    case ViewOp::Kind::PERMUTE: {
      if (static_cast<int64_t>(view.ints.size()) != ndim) {
        return false;
      }
      std::vector<bool> seen(static_cast<size_t>(ndim), false);
      for (int64_t i = 0; i < ndim; ++i) {
        std::optional<int64_t> d = wrap(view.ints[static_cast<size_t>(i)]);
        if (!d.has_value() || seen[static_cast<size_t>(*d)]) {
          return false;
        }
        seen[static_cast<size_t>(*d)] = true;
        sizes[static_cast<size_t>(i)] = self.sizes()[*d];
        strides[static_cast<size_t>(i)] = self.strides()[*d];
      }
      break;
    }
  }
  regs[out] = raw_alias(self, sizes, strides, self.storage_offset());
  return true;
}

}  // namespace fxrt
