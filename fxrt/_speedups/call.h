// A CALL instruction run natively: a c10::OperatorHandle and its complete boxed argument list.
//
// bind_call() resolves a Program's Call once. Its arguments become one slot per schema argument,
// in schema order: positional arguments, kwarg-only ones taken from the call's kwargs by name,
// and the schema's default values for what the call omits, so the boxed stack is complete. A
// slot is
//
// * CONST: a constant converted once against the argument's schema type, with torch.ops' own
//   conversion (torch::jit::argumentToIValue);
// * REG: a register read, with a check that its IValue already has the schema's type;
// * TENSOR_LIST / OPT_TENSOR_LIST / INT_LIST: a list literal mixing constants and registers
//   (cat's tensors, an int list of constants and SymInts), assembled per call;
// * TREE: anything else that holds registers.
//
// A register that fails its check (an int where a float is expected, a Python object a fallback
// produced) and every TREE take the slow path: the argument is rebuilt in Python and converted
// as torch.ops converts it, so the op sees what it would see under the Python loop.
//
// run_call() fills the stack, calls callBoxed, and stores the returns in the output registers,
// unpacking a multi-output return (several returns, or one list) in order. Given an arena (see
// fxrt/exec/arena.py) and a call whose result has a slot there, it puts the slot's tensor in the
// result register and runs the call's out= form, bound like any call, whose `out` argument reads
// that register; an allocation has no out= form: the slot's tensor is the result. If the out=
// form fails, the plain call runs and raises its own error, if any.

#pragma once

#include "convert.h"

#include <ATen/EmptyTensor.h>
#include <ATen/InferSize.h>
#include <ATen/TensorUtils.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace fxrt {

using Stack = std::vector<IValue>;

// The GIL, released while native instructions run (when enabled) and taken back on demand.
class GilState {
 public:
  explicit GilState(bool may_release) : may_release_(may_release) {}
  GilState(const GilState&) = delete;
  GilState& operator=(const GilState&) = delete;
  ~GilState() { acquire(); }

  void release() {
    if (may_release_ && saved_ == nullptr) {
      saved_ = PyEval_SaveThread();
    }
  }
  void acquire() {
    if (saved_ != nullptr) {
      PyEval_RestoreThread(saved_);
      saved_ = nullptr;
    }
  }

 private:
  bool may_release_;
  PyThreadState* saved_ = nullptr;
};

// Which register values a REG slot passes to the op as they are.
enum class Accept : uint8_t {
  TENSOR,
  INT,
  SYMINT,
  FLOAT,
  SYMFLOAT,
  BOOL,
  SYMBOOL,
  SCALAR,
  TENSOR_LIST,
  INT_LIST,
  NEVER,  // always convert through Python
};

struct Item {  // one element of a list literal: a register, or a constant when reg < 0
  int64_t reg = -1;
  IValue value;
};

struct Slot {
  enum Kind : uint8_t { CONST, REG, TENSOR_LIST, OPT_TENSOR_LIST, INT_LIST, TREE };
  Kind kind = CONST;
  Accept accept = Accept::NEVER;
  bool optional = false;  // None is accepted too
  int64_t reg = -1;
  size_t position = 0;  // index in the schema's arguments, for the slow path
  IValue value;
  std::vector<Item> items;
  std::optional<Tree> tree;  // the argument as the Program has it: the slow path's input
};

struct CallOp {
  c10::OperatorHandle op;
  std::vector<Slot> slots;
  std::vector<int64_t> outputs;
  size_t n_returns = 0;
  bool multi = false;
  bool numbers_as_tensors = false;  // torch.ops lets Python numbers stand for Tensor arguments
  int64_t arena_slot = -1;  // the result's arena slot, or -1
  std::shared_ptr<const CallOp> out_call;  // writes the slot; null: the slot is the result
  // inductor::_reinterpret_tensor with constant sizes, strides and offset: made inline.
  std::optional<std::vector<int64_t>> reinterpret_sizes, reinterpret_strides;
  int64_t reinterpret_offset = 0;
  // A view made inline on calls without autograd (fxrt/exec/arena.py: inline_views), with its
  // constant arguments: view's sizes or permute's dims in `view_ints`, transpose's dims.
  enum class View : uint8_t { NONE, VIEW, T, TRANSPOSE, PERMUTE } view = View::NONE;
  std::vector<int64_t> view_ints;
  int64_t view_dim0 = 0, view_dim1 = 0;
  // aten::empty_strided on the CPU with constant arguments: allocated inline.
  struct EmptyStrided {
    std::vector<int64_t> sizes, strides;
    std::optional<at::ScalarType> dtype;
    std::optional<at::Layout> layout;
    std::optional<at::Device> device;
    std::optional<bool> pin_memory;
  };
  std::optional<EmptyStrided> empty_strided;
};

using Arena = std::vector<at::Tensor>;

// torch.ops' rule (torch/csrc/jit/python/init.cpp) for which ops take numbers as tensors.
inline bool allows_numbers_as_tensors(const std::string& name) {
  c10::Symbol symbol = c10::Symbol::fromQualString(name);
  return symbol.is_prims() || symbol.is_nvprims() ||
      (symbol.is_aten() && torch::should_allow_numbers_as_tensors(symbol.toUnqualString()));
}

inline Accept accept_for(const c10::TypePtr& type) {
  switch (type->kind()) {
    case c10::TypeKind::TensorType:
      return Accept::TENSOR;
    case c10::TypeKind::IntType:
    case c10::TypeKind::ScalarTypeType:  // dtypes, layouts and memory formats are ints
    case c10::TypeKind::LayoutType:
    case c10::TypeKind::MemoryFormatType:
      return Accept::INT;
    case c10::TypeKind::SymIntType:
      return Accept::SYMINT;
    case c10::TypeKind::FloatType:
      return Accept::FLOAT;
    case c10::TypeKind::SymFloatType:
      return Accept::SYMFLOAT;
    case c10::TypeKind::BoolType:
      return Accept::BOOL;
    case c10::TypeKind::SymBoolType:
      return Accept::SYMBOOL;
    case c10::TypeKind::NumberType:
      return Accept::SCALAR;
    case c10::TypeKind::ListType: {
      c10::TypeKind elem = type->castRaw<c10::ListType>()->getElementType()->kind();
      if (elem == c10::TypeKind::TensorType) {
        return Accept::TENSOR_LIST;
      }
      if (elem == c10::TypeKind::IntType || elem == c10::TypeKind::SymIntType) {
        return Accept::INT_LIST;
      }
      return Accept::NEVER;
    }
    default:  // devices, strings, generators...: registers rarely hold them; convert
      return Accept::NEVER;
  }
}

inline bool accepts(const Slot& s, const IValue& v) {
  if (s.optional && v.isNone()) {
    return true;
  }
  switch (s.accept) {
    case Accept::TENSOR:
      return v.isTensor();
    case Accept::INT:
      return v.isInt();
    case Accept::SYMINT:
      return v.isInt() || v.isSymInt();
    case Accept::FLOAT:
      return v.isDouble();
    case Accept::SYMFLOAT:
      return v.isDouble() || v.isSymFloat();
    case Accept::BOOL:
      return v.isBool();
    case Accept::SYMBOOL:
      return v.isBool() || v.isSymBool();
    case Accept::SCALAR:
      return v.isInt() || v.isDouble() || v.isBool() || v.isComplexDouble() || v.isSymInt() ||
          v.isSymFloat() || v.isSymBool();
    case Accept::TENSOR_LIST:
      return v.isTensorList();
    case Accept::INT_LIST:
      return v.isIntList();
    case Accept::NEVER:
      return false;
  }
  return false;
}

inline c10::TypePtr without_optional(const c10::TypePtr& type) {
  if (auto opt = type->cast<c10::OptionalType>()) {
    return opt->getElementType();
  }
  return type;
}

// The list-literal kind for a list argument with element type `elem`, or TREE.
inline Slot::Kind list_kind(const c10::TypePtr& elem) {
  switch (elem->kind()) {
    case c10::TypeKind::TensorType:
      return Slot::TENSOR_LIST;
    case c10::TypeKind::IntType:
    case c10::TypeKind::SymIntType:
      return Slot::INT_LIST;
    case c10::TypeKind::OptionalType:
      return without_optional(elem)->kind() == c10::TypeKind::TensorType ? Slot::OPT_TENSOR_LIST
                                                                          : Slot::TREE;
    default:
      return Slot::TREE;
  }
}

// Slot i of `schema` for the argument value `value` (borrowed). False if it cannot be bound.
inline bool bind_slot(
    const c10::FunctionSchema& schema,
    size_t i,
    PyObject* value,
    const RefReader& refs,
    Slot& slot) {
  const c10::TypePtr& type = schema.arguments()[i].real_type();
  slot.position = i;
  if (!refs.contains_ref(value)) {
    try {
      slot.value = torch::jit::argumentToIValue(schema, i, value);
    } catch (const std::exception&) {
      PyErr_Clear();
      return false;  // the call raises at run time; a Python fallback reproduces the error
    }
    return true;
  }
  slot.optional = type->kind() == c10::TypeKind::OptionalType;
  slot.accept = accept_for(without_optional(type));
  slot.tree.emplace(value, refs);
  if (refs.is_ref(value)) {
    slot.kind = Slot::REG;
    slot.reg = refs.id(value);
    return true;
  }
  slot.kind = Slot::TREE;
  auto list_type = without_optional(type)->cast<c10::ListType>();
  if (!list_type || !(PyList_Check(value) || PyTuple_Check(value))) {
    return true;
  }
  const c10::TypePtr& elem = list_type->getElementType();
  Slot::Kind kind = list_kind(elem);
  if (kind == Slot::TREE) {
    return true;
  }
  Py_ssize_t n = PySequence_Fast_GET_SIZE(value);
  for (Py_ssize_t k = 0; k < n; ++k) {
    PyObject* x = PySequence_Fast_GET_ITEM(value, k);
    Item item;
    if (refs.is_ref(x)) {
      item.reg = refs.id(x);
    } else if (refs.contains_ref(x)) {
      slot.items.clear();  // a nested list: the slow path's
      return true;
    } else {
      try {
        item.value = torch::jit::toIValue(x, elem);
      } catch (const std::exception&) {
        PyErr_Clear();
        slot.items.clear();  // the slow path raises torch.ops' own error at run time
        return true;
      }
    }
    slot.items.push_back(std::move(item));
  }
  slot.kind = kind;
  return true;
}

// A tensor the dispatcher would hand straight to its CPU (or other backend) kernel: no dispatch
// mode active, no subclass, no functional wrapper, and strided with a storage.
inline bool plain_tensor(const IValue& v) {
  if (!v.isTensor() || c10::impl::TorchDispatchModeTLS::any_modes_set()) {
    return false;
  }
  const at::Tensor& self = v.toTensor();
  // Functionality keys only: a backend key such as Meta would also match every dense tensor.
  constexpr c10::DispatchKeySet wrapped({c10::DispatchKey::Python, c10::DispatchKey::Functionalize});
  return self.defined() && self.layout() == c10::kStrided && self.has_storage() &&
      !self.key_set().has_any(wrapped);
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

// Inductor's reinterpret_tensor (torch/csrc/inductor/inductor_ops.cpp): a new TensorImpl on the
// same storage, the offset an increment of self's; no view tracking, as in Inductor's own Python
// wrapper. Its dispatcher round trip costs several times the alias itself (fxrt's Inductor host
// graphs make one per weight and buffer view), so a call with constant geometry is made inline.
inline void bind_reinterpret(CallOp& call) {
  const c10::FunctionSchema& schema = call.op.schema();
  if (schema.name() != "inductor::_reinterpret_tensor" || !schema.overload_name().empty() ||
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
  regs[static_cast<size_t>(call.outputs[0])] = raw_alias(
      self, *call.reinterpret_sizes, *call.reinterpret_strides,
      self.storage_offset() + call.reinterpret_offset);
  return true;
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

// Resolve a Program Call. nullopt when the op is not in the dispatcher or the call does not bind
// to its schema: the caller then runs it as a Python call, which fails (or not) exactly as the
// Python loop does.
inline std::optional<CallOp> bind_call(
    const std::string& name,
    const std::string& overload,
    PyObject* args,
    PyObject* kwargs,
    const std::vector<int64_t>& outputs,
    bool multi,
    const RefReader& refs) {
  auto handle = c10::Dispatcher::singleton().findSchema({name, overload});
  if (!handle.has_value()) {
    return std::nullopt;
  }
  const c10::FunctionSchema& schema = handle->schema();
  const auto& params = schema.arguments();
  size_t n_args = static_cast<size_t>(PyTuple_GET_SIZE(args));
  if (schema.is_vararg() || n_args > params.size()) {
    return std::nullopt;
  }
  CallOp call{*handle, {}, outputs, schema.returns().size(), multi};
  call.numbers_as_tensors = allows_numbers_as_tensors(schema.name());
  torch::jit::ToIValueAllowNumbersAsTensors numbers_as_tensors(call.numbers_as_tensors);
  Py_ssize_t kwargs_used = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const c10::Argument& param = params[i];
    PyObject* value = nullptr;  // borrowed
    if (i < n_args) {
      if (param.kwarg_only()) {
        return std::nullopt;
      }
      value = PyTuple_GET_ITEM(args, i);
    } else {
      value = PyDict_GetItemString(kwargs, param.name().c_str());
      kwargs_used += value != nullptr;
    }
    Slot slot;
    if (value != nullptr) {
      if (!bind_slot(schema, i, value, refs, slot)) {
        return std::nullopt;
      }
    } else if (param.default_value().has_value()) {
      slot.position = i;
      slot.value = *param.default_value();
    } else {
      return std::nullopt;
    }
    call.slots.push_back(std::move(slot));
  }
  if (kwargs_used != PyDict_GET_SIZE(kwargs)) {
    return std::nullopt;
  }
  bind_reinterpret(call);
  bind_empty_strided(call);
  return call;
}

inline const IValue& item_value(const Item& item, const std::vector<IValue>& regs) {
  return item.reg < 0 ? item.value : regs[static_cast<size_t>(item.reg)];
}

inline std::optional<IValue> tensor_list(const Slot& slot, const std::vector<IValue>& regs) {
  c10::List<at::Tensor> list;
  list.reserve(slot.items.size());
  for (const Item& item : slot.items) {
    const IValue& v = item_value(item, regs);
    if (!v.isTensor()) {
      return std::nullopt;
    }
    list.push_back(v.toTensor());
  }
  return IValue(std::move(list));
}

inline std::optional<IValue> optional_tensor_list(
    const Slot& slot,
    const std::vector<IValue>& regs) {
  c10::List<std::optional<at::Tensor>> list;
  list.reserve(slot.items.size());
  for (const Item& item : slot.items) {
    const IValue& v = item_value(item, regs);
    if (v.isTensor()) {
      list.push_back(v.toTensor());
    } else if (v.isNone()) {
      list.push_back(std::nullopt);
    } else {
      return std::nullopt;
    }
  }
  return IValue(std::move(list));
}

// Like torch.ops: an int list when every element is concrete, a SymInt list otherwise.
inline std::optional<IValue> int_list(const Slot& slot, const std::vector<IValue>& regs) {
  bool symbolic = false;
  for (const Item& item : slot.items) {
    const IValue& v = item_value(item, regs);
    if (v.isSymInt()) {
      symbolic = true;
    } else if (!v.isInt()) {
      return std::nullopt;
    }
  }
  if (!symbolic) {
    c10::List<int64_t> list;
    list.reserve(slot.items.size());
    for (const Item& item : slot.items) {
      list.push_back(item_value(item, regs).toInt());
    }
    return IValue(std::move(list));
  }
  std::vector<c10::SymInt> list;
  list.reserve(slot.items.size());
  for (const Item& item : slot.items) {
    list.push_back(item_value(item, regs).toSymInt());
  }
  return IValue(std::move(list));
}

// The slot's argument as torch.ops converts its Python form: for what the checks do not accept.
inline IValue convert_in_python(
    const CallOp& call,
    const Slot& slot,
    const std::vector<IValue>& regs,
    GilState& gil) {
  gil.acquire();
  py::object value = slot.tree->build(regs);
  torch::jit::ToIValueAllowNumbersAsTensors numbers_as_tensors(call.numbers_as_tensors);
  return torch::jit::argumentToIValue(call.op.schema(), slot.position, value);
}

inline void push_arguments(
    const CallOp& call,
    const std::vector<IValue>& regs,
    Stack& stack,
    GilState& gil) {
  for (const Slot& slot : call.slots) {
    std::optional<IValue> list;
    switch (slot.kind) {
      case Slot::CONST:
        stack.push_back(slot.value);
        continue;
      case Slot::REG: {
        const IValue& v = regs[static_cast<size_t>(slot.reg)];
        if (accepts(slot, v)) {
          stack.push_back(v);
          continue;
        }
        break;
      }
      case Slot::TENSOR_LIST:
        list = tensor_list(slot, regs);
        break;
      case Slot::OPT_TENSOR_LIST:
        list = optional_tensor_list(slot, regs);
        break;
      case Slot::INT_LIST:
        list = int_list(slot, regs);
        break;
      case Slot::TREE:
        break;
    }
    if (list.has_value()) {
      stack.push_back(std::move(*list));
    } else {
      stack.push_back(convert_in_python(call, slot, regs, gil));
    }
  }
}

// The Python loop's ``regs[outs[0]] = res``, or ``for o, v in zip(outs, res): regs[o] = v``.
inline void store_returns(const CallOp& call, std::vector<IValue>& regs, Stack& stack) {
  const auto& outs = call.outputs;
  auto out = [&](size_t i) -> IValue& { return regs[static_cast<size_t>(outs[i])]; };
  if (!call.multi) {
    if (stack.size() == 1) {
      out(0) = std::move(stack[0]);
    } else if (stack.empty()) {
      out(0) = IValue();
    } else {
      out(0) = c10::ivalue::Tuple::create(std::move(stack));
    }
    return;
  }
  if (stack.size() != 1) {  // several returns
    size_t n = std::min(stack.size(), outs.size());
    for (size_t i = 0; i < n; ++i) {
      out(i) = std::move(stack[i]);
    }
    return;
  }
  IValue seq = std::move(stack[0]);  // one sequence return (Tensor[], ...): its elements
  if (seq.isList()) {
    c10::List<IValue> list = std::move(seq).toList();
    size_t n = std::min(list.size(), outs.size());
    for (size_t i = 0; i < n; ++i) {
      out(i) = list.get(i);
    }
    return;
  }
  TORCH_CHECK_TYPE(seq.isTuple(), "cannot unpack a return of type ", seq.tagKind());
  const auto& elems = seq.toTupleRef().elements();
  size_t n = std::min(elems.size(), outs.size());
  for (size_t i = 0; i < n; ++i) {
    out(i) = elems[i];
  }
}

inline void run_call(
    const CallOp& call,
    std::vector<IValue>& regs,
    Stack& stack,
    GilState& gil,
    const Arena* arena) {
  if (arena != nullptr && call.arena_slot >= 0) {
    regs[static_cast<size_t>(call.outputs[0])] = (*arena)[static_cast<size_t>(call.arena_slot)];
    if (call.out_call == nullptr) {
      return;
    }
    try {
      run_call(*call.out_call, regs, stack, gil, nullptr);
      return;
    } catch (const std::exception&) {
      // The plain call below runs it instead, and raises its own error if any.
    }
  }
  if (call.reinterpret_sizes.has_value() && run_reinterpret(call, regs)) {
    return;
  }
  if (call.empty_strided.has_value() && !c10::impl::TorchDispatchModeTLS::any_modes_set()) {
    const CallOp::EmptyStrided& e = *call.empty_strided;
    regs[static_cast<size_t>(call.outputs[0])] = at::Tensor(at::detail::empty_strided_cpu(
        e.sizes, e.strides, e.dtype, e.layout, e.device, e.pin_memory));
    return;
  }
  if (arena != nullptr && call.view != CallOp::View::NONE && run_inline_view(call, regs)) {
    return;
  }
  stack.clear();
  push_arguments(call, regs, stack, gil);
  {
    // torch.ops keeps this flag set while the op runs: Python kernels it reaches (custom ops,
    // prims) re-enter the dispatcher with the numbers it converted back to Python.
    torch::jit::ToIValueAllowNumbersAsTensors numbers_as_tensors(call.numbers_as_tensors);
    call.op.callBoxed(&stack);
  }
  store_returns(call, regs, stack);
}

}  // namespace fxrt
