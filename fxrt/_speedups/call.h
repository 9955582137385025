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
// form fails, the plain call runs and raises its own error, if any. The slot and CallOp types
// are in call_op.h; the calls made without the dispatcher are in inline_ops.h.

#pragma once

#include "inline_ops.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace fxrt {

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
  if (call.empty_strided.has_value() && !c10::impl::TorchDispatchModeTLS::any_modes_set() &&
      !fills_uninitialized_memory()) {
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
