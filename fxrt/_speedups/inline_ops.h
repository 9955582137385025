// Calls the compiled loop makes without the dispatcher, each exactly as the op's own CPU kernel
// would: reinterpret_tensor, CPU empty_strided, and (on calls that use the arena, so
// autograd records nothing) views only read inside the graph. Each falls back to the dispatcher
// when a dispatch mode, a subclass or a functional tensor would route the call elsewhere, or when
// its arguments are not what it handles; the op then runs (and fails) as it would anyway.

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

// A tensor the dispatcher would hand straight to its CPU (or other backend) kernel: no dispatch
// mode active, no subclass, no functional wrapper, and strided with a storage.
inline bool plain_tensor(const at::Tensor& self) {
  if (c10::impl::TorchDispatchModeTLS::any_modes_set()) {
    return false;
  }
  // Functionality keys only: a backend key such as Meta would also match every dense tensor.
  constexpr c10::DispatchKeySet wrapped({c10::DispatchKey::Python, c10::DispatchKey::Functionalize});
  return self.defined() && self.layout() == c10::kStrided && self.has_storage() &&
      !self.key_set().has_any(wrapped);
}

inline bool plain_tensor(const IValue& v) {
  return v.isTensor() && plain_tensor(v.toTensor());
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

// fxrt::reinterpret_tensor (fxrt/ops/reinterpret.py), Inductor's reinterpret_tensor with a view
// schema: a new TensorImpl on the same storage, the offset an increment of self's; no view
// tracking, as in Inductor's own Python wrapper (torch/csrc/inductor/inductor_ops.cpp). Its
// dispatcher round trip costs several times the alias itself (fxrt's Inductor host graphs make
// one per weight and buffer view), so a call with constant geometry is made inline.
inline void bind_reinterpret(CallOp& call) {
  const c10::FunctionSchema& schema = call.op.schema();
  if (schema.name() != "fxrt::reinterpret_tensor" || !schema.overload_name().empty() ||
      call.slots.size() != 4 || call.slots[0].kind != Slot::REG) {
    return;
  }
  const IValue& sizes = call.slots[1].value;
  const IValue& strides = call.slots[2].value;
  const IValue& offset = call.slots[3].value;
  if (call.slots[1].kind != Slot::CONST || call.slots[2].kind != Slot::CONST ||
      call.slots[3].kind != Slot::CONST || !sizes.isIntList() || !strides.isIntList() ||
      !offset.isInt()) {
    return;
  }
  call.reinterpret_sizes = sizes.toIntVector();
  call.reinterpret_strides = strides.toIntVector();
  call.reinterpret_offset = offset.toInt();
}

// The inline reinterpret_tensor; false when the dispatcher would route the call anywhere but the
// op's own kernel (a TorchDispatchMode, a subclass or functional tensor) or the register does
// not hold a plain strided tensor: the dispatcher then runs the op.
inline bool run_reinterpret(const CallOp& call, std::vector<IValue>& regs) {
  const IValue& v = regs[static_cast<size_t>(call.slots[0].reg)];
  if (!plain_tensor(v)) {
    return false;
  }
  const at::Tensor& self = v.toTensor();
  const int64_t offset = self.storage_offset() + call.reinterpret_offset;
  if (!within_storage(self, *call.reinterpret_sizes, *call.reinterpret_strides, offset)) {
    return false;  // as_strided raises its own error
  }
  regs[static_cast<size_t>(call.outputs[0])] = raw_alias(
      self, *call.reinterpret_sizes, *call.reinterpret_strides, offset);
  return true;
}

// torch.use_deterministic_algorithms(True) with fill_uninitialized_memory: new tensors are
// filled (NaN), which only the dispatcher's empty_strided does and no reused arena slot is.
inline bool fills_uninitialized_memory() {
  return at::globalContext().deterministicAlgorithms() &&
      at::globalContext().deterministicFillUninitializedMemory();
}

// aten::empty_strided's CPU kernel is at::detail::empty_strided_cpu; a call with constant
// arguments for the CPU makes its tensor directly, as Inductor's own empty_strided_cpu helper
// does, instead of through the dispatcher (about 1 us less per allocation).
inline void bind_empty_strided(CallOp& call) {
  const c10::FunctionSchema& schema = call.op.schema();
  if (schema.name() != "aten::empty_strided" || !schema.overload_name().empty() ||
      call.slots.size() != 6) {
    return;
  }
  for (const Slot& slot : call.slots) {
    if (slot.kind != Slot::CONST) {
      return;
    }
  }
  const auto& v = [&](size_t i) -> const IValue& { return call.slots[i].value; };
  if (!v(0).isIntList() || !v(1).isIntList()) {
    return;
  }
  CallOp::EmptyStrided e{v(0).toIntVector(), v(1).toIntVector()};
  if (e.sizes.size() != e.strides.size() ||
      std::any_of(e.sizes.begin(), e.sizes.end(), [](int64_t s) { return s < 0; }) ||
      std::any_of(e.strides.begin(), e.strides.end(), [](int64_t s) { return s < 0; })) {
    return;  // the dispatcher raises the op's own error
  }
  e.dtype = v(2).toOptional<at::ScalarType>();
  e.layout = v(3).toOptional<at::Layout>();
  e.device = v(4).toOptional<at::Device>();
  e.pin_memory = v(5).toOptional<bool>();
  if ((e.device.has_value() && !e.device->is_cpu()) ||
      (e.layout.has_value() && *e.layout != c10::kStrided)) {
    return;
  }
  call.empty_strided = std::move(e);
}

// Mark `call` as an inline view if its op is one and its other arguments are constants.
inline void bind_inline_view(CallOp& call) {
  const c10::FunctionSchema& schema = call.op.schema();
  const std::string& name = schema.name();
  const std::string& overload = schema.overload_name();
  const auto& slots = call.slots;
  if (slots.empty() || slots[0].kind != Slot::REG || call.multi) {
    return;
  }
  auto const_ints = [&](size_t i) {
    return slots.size() > i && slots[i].kind == Slot::CONST && slots[i].value.isIntList();
  };
  auto const_int = [&](size_t i) {
    return slots.size() > i && slots[i].kind == Slot::CONST && slots[i].value.isInt();
  };
  if ((name == "aten::view" || name == "aten::_unsafe_view") && overload.empty() &&
      const_ints(1)) {
    call.view = CallOp::View::VIEW;
    call.view_ints = slots[1].value.toIntVector();
  } else if (name == "aten::permute" && overload.empty() && const_ints(1)) {
    call.view = CallOp::View::PERMUTE;
    call.view_ints = slots[1].value.toIntVector();
  } else if (name == "aten::t" && overload.empty()) {
    call.view = CallOp::View::T;
  } else if (name == "aten::transpose" && overload == "int" && const_int(1) && const_int(2)) {
    call.view = CallOp::View::TRANSPOSE;
    call.view_dim0 = slots[1].value.toInt();
    call.view_dim1 = slots[2].value.toInt();
  }
}

// The inline view; false when the dispatcher must run the op (not a plain tensor, a view the
// sizes cannot express, a dimension out of range: it then raises the op's own error).
inline bool run_inline_view(const CallOp& call, std::vector<IValue>& regs) {
  const IValue& v = regs[static_cast<size_t>(call.slots[0].reg)];
  if (!plain_tensor(v)) {
    return false;
  }
  const at::Tensor& self = v.toTensor();
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
  switch (call.view) {
    case CallOp::View::NONE:
      return false;
    case CallOp::View::VIEW: {
      at::DimVector shape = at::infer_size_dv(call.view_ints, self.numel());
      std::optional<at::DimVector> st = at::detail::computeStride(self.sizes(), self.strides(), shape);
      if (!st.has_value()) {
        return false;
      }
      sizes.assign(shape.begin(), shape.end());
      strides.assign(st->begin(), st->end());
      break;
    }
    case CallOp::View::T:
    case CallOp::View::TRANSPOSE: {
      if (call.view == CallOp::View::T && ndim > 2) {
        return false;
      }
      if (ndim < 2) {
        break;  // t and transpose of a 0-d or 1-d tensor alias it as it is
      }
      std::optional<int64_t> a = call.view == CallOp::View::T ? 0 : wrap(call.view_dim0);
      std::optional<int64_t> b = call.view == CallOp::View::T ? 1 : wrap(call.view_dim1);
      if (!a.has_value() || !b.has_value()) {
        return false;
      }
      std::swap(sizes[*a], sizes[*b]);
      std::swap(strides[*a], strides[*b]);
      break;
    }
    case CallOp::View::PERMUTE: {
      if (static_cast<int64_t>(call.view_ints.size()) != ndim) {
        return false;
      }
      std::vector<bool> seen(static_cast<size_t>(ndim), false);
      for (int64_t i = 0; i < ndim; ++i) {
        std::optional<int64_t> d = wrap(call.view_ints[static_cast<size_t>(i)]);
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
  regs[static_cast<size_t>(call.outputs[0])] =
      raw_alias(self, sizes, strides, self.storage_offset());
  return true;
}

}  // namespace fxrt
