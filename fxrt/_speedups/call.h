// Binds and runs CALLs: an op of the Program (fxrt/exec/program.py) resolved once to a
// c10::OperatorHandle with one BoundArg per schema argument (call_op.h), positional arguments
// first, then the rest taken from the call's kwargs by name, and the schema's default values for
// what the call omits, so the boxed stack is complete. An argument is
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
// unpacking a multi-output return (several returns, or one list) in order.

#pragma once

#include "call_op.h"

#include <torch/csrc/jit/python/pybind_utils.h>

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

inline bool accepts(const BoundArg& s, const IValue& v) {
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
inline BoundArg::Kind list_kind(const c10::TypePtr& elem) {
  switch (elem->kind()) {
    case c10::TypeKind::TensorType:
      return BoundArg::TENSOR_LIST;
    case c10::TypeKind::IntType:
    case c10::TypeKind::SymIntType:
      return BoundArg::INT_LIST;
    case c10::TypeKind::OptionalType:
      return without_optional(elem)->kind() == c10::TypeKind::TensorType ? BoundArg::OPT_TENSOR_LIST
                                                                          : BoundArg::TREE;
    default:
      return BoundArg::TREE;
  }
}

// Argument i of `schema` for the argument value `value` (borrowed). False if it cannot be bound.
inline bool bind_arg(
    const c10::FunctionSchema& schema,
    size_t i,
    PyObject* value,
    const RefReader& refs,
    BoundArg& arg) {
  const c10::TypePtr& type = schema.arguments()[i].real_type();
  arg.position = i;
  if (!refs.contains_ref(value)) {
    try {
      arg.value = torch::jit::argumentToIValue(schema, i, value);
    } catch (const std::exception&) {
      PyErr_Clear();
      return false;  // the call raises at run time; a Python fallback reproduces the error
    }
    return true;
  }
  arg.optional = type->kind() == c10::TypeKind::OptionalType;
  arg.accept = accept_for(without_optional(type));
  arg.tree.emplace(value, refs);
  if (refs.is_ref(value)) {
    arg.kind = BoundArg::REG;
    arg.reg = refs.id(value);
    return true;
  }
  arg.kind = BoundArg::TREE;
  auto list_type = without_optional(type)->cast<c10::ListType>();
  if (!list_type || !(PyList_Check(value) || PyTuple_Check(value))) {
    return true;
  }
  const c10::TypePtr& elem = list_type->getElementType();
  BoundArg::Kind kind = list_kind(elem);
  if (kind == BoundArg::TREE) {
    return true;
  }
  Py_ssize_t n = PySequence_Fast_GET_SIZE(value);
  for (Py_ssize_t k = 0; k < n; ++k) {
    PyObject* x = PySequence_Fast_GET_ITEM(value, k);
    ListItem item;
    if (refs.is_ref(x)) {
      item.reg = refs.id(x);
    } else if (refs.contains_ref(x)) {
      arg.items.clear();  // a nested list: the slow path's
      return true;
    } else {
      try {
        item.value = torch::jit::toIValue(x, elem);
      } catch (const std::exception&) {
        PyErr_Clear();
        arg.items.clear();  // the slow path raises torch.ops' own error at run time
        return true;
      }
    }
    arg.items.push_back(std::move(item));
  }
  arg.kind = kind;
  return true;
}

// Resolve a Program Call. nullopt, with `why` set, when the op is not in the dispatcher or the
// call does not bind to its schema: the compiled loop then demotes it to a Python call, which
// fails (or not) exactly as the Python loop does.
inline std::optional<CallOp> bind_call(
    const std::string& name,
    const std::string& overload,
    PyObject* args,
    PyObject* kwargs,
    const std::vector<int64_t>& outputs,
    bool multi,
    const RefReader& refs,
    std::string& why) {
  auto handle = c10::Dispatcher::singleton().findSchema({name, overload});
  if (!handle.has_value()) {
    why = "no dispatcher op " + name + (overload.empty() ? "" : "." + overload);
    return std::nullopt;
  }
  const c10::FunctionSchema& schema = handle->schema();
  const auto& params = schema.arguments();
  size_t n_args = static_cast<size_t>(PyTuple_GET_SIZE(args));
  if (schema.is_vararg() || n_args > params.size()) {
    why = "more arguments than the schema takes";
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
        why = "positional value for keyword-only argument " + param.name();
        return std::nullopt;
      }
      value = PyTuple_GET_ITEM(args, i);
    } else {
      value = PyDict_GetItemString(kwargs, param.name().c_str());
      kwargs_used += value != nullptr;
    }
    BoundArg arg;
    if (value != nullptr) {
      if (!bind_arg(schema, i, value, refs, arg)) {
        why = "constant for argument " + param.name() + " does not convert to its schema type";
        return std::nullopt;
      }
    } else if (param.default_value().has_value()) {
      arg.position = i;
      arg.value = *param.default_value();
    } else {
      why = "no value for argument " + param.name();
      return std::nullopt;
    }
    call.args.push_back(std::move(arg));
  }
  if (kwargs_used != PyDict_GET_SIZE(kwargs)) {
    why = "a keyword argument the schema does not have";
    return std::nullopt;
  }
  return call;
}

inline const IValue& item_value(const ListItem& item, const std::vector<IValue>& regs) {
  return item.reg < 0 ? item.value : regs[static_cast<size_t>(item.reg)];
}

inline std::optional<IValue> tensor_list(const BoundArg& arg, const std::vector<IValue>& regs) {
  c10::List<at::Tensor> list;
  list.reserve(arg.items.size());
  for (const ListItem& item : arg.items) {
    const IValue& v = item_value(item, regs);
    if (!v.isTensor()) {
      return std::nullopt;
    }
    list.push_back(v.toTensor());
  }
  return IValue(std::move(list));
}

inline std::optional<IValue> optional_tensor_list(
    const BoundArg& arg,
    const std::vector<IValue>& regs) {
  c10::List<std::optional<at::Tensor>> list;
  list.reserve(arg.items.size());
  for (const ListItem& item : arg.items) {
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
inline std::optional<IValue> int_list(const BoundArg& arg, const std::vector<IValue>& regs) {
  bool symbolic = false;
  for (const ListItem& item : arg.items) {
    const IValue& v = item_value(item, regs);
    if (v.isSymInt()) {
      symbolic = true;
    } else if (!v.isInt()) {
      return std::nullopt;
    }
  }
  if (!symbolic) {
    c10::List<int64_t> list;
    list.reserve(arg.items.size());
    for (const ListItem& item : arg.items) {
      list.push_back(item_value(item, regs).toInt());
    }
    return IValue(std::move(list));
  }
  std::vector<c10::SymInt> list;
  list.reserve(arg.items.size());
  for (const ListItem& item : arg.items) {
    list.push_back(item_value(item, regs).toSymInt());
  }
  return IValue(std::move(list));
}

// The argument as torch.ops converts its Python form: for what the checks do not accept.
inline IValue convert_in_python(
    const CallOp& call,
    const BoundArg& arg,
    const std::vector<IValue>& regs,
    GilState& gil) {
  gil.acquire();
  py::object value = arg.tree->build(regs);
  torch::jit::ToIValueAllowNumbersAsTensors numbers_as_tensors(call.numbers_as_tensors);
  return torch::jit::argumentToIValue(call.op.schema(), arg.position, value);
}

inline void push_arguments(
    const CallOp& call,
    const std::vector<IValue>& regs,
    Stack& stack,
    GilState& gil) {
  for (const BoundArg& arg : call.args) {
    std::optional<IValue> list;
    switch (arg.kind) {
      case BoundArg::CONST:
        stack.push_back(arg.value);
        continue;
      case BoundArg::REG: {
        const IValue& v = regs[static_cast<size_t>(arg.reg)];
        if (accepts(arg, v)) {
          stack.push_back(v);
          continue;
        }
        break;
      }
      case BoundArg::TENSOR_LIST:
        list = tensor_list(arg, regs);
        break;
      case BoundArg::OPT_TENSOR_LIST:
        list = optional_tensor_list(arg, regs);
        break;
      case BoundArg::INT_LIST:
        list = int_list(arg, regs);
        break;
      case BoundArg::TREE:
        break;
    }
    if (list.has_value()) {
      stack.push_back(std::move(*list));
    } else {
      stack.push_back(convert_in_python(call, arg, regs, gil));
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

inline void run_call(const CallOp& call, std::vector<IValue>& regs, Stack& stack, GilState& gil) {
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
