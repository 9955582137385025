// Runs CALLs: an op of the Program (fxrt/exec/program.py) resolved once to a
// c10::OperatorHandle with one BoundArg per schema argument (call_op.h), positional arguments
// first, then the rest taken from the call's kwargs by name, and the schema's default values for
// what the call omits, so the boxed stack is complete. (bind_python.h binds them from the
// Program's Python objects, csrc/src/bind.cpp from a package's stored program.) An argument is
//
// * CONST: a constant converted once against the argument's schema type, with torch.ops' own
//   conversion (torch::jit::argumentToIValue);
// * REG: a register read, with a check that its IValue already has the schema's type;
// * TENSOR_LIST / OPT_TENSOR_LIST / INT_LIST: a list literal mixing constants and registers
//   (cat's tensors, an int list of constants and SymInts), assembled per call;
// * TREE: anything else that holds registers (Python build only).
//
// A register that fails its check (an int where a float is expected, a Python object a fallback
// produced) and every TREE take the slow path: the argument is rebuilt in Python and converted
// as torch.ops converts it, so the op sees what it would see under the Python loop. Without
// Python (FXRT_NO_PYTHON) the slow path converts ints to floats and numbers to tensors as
// torch.ops would, and raises otherwise.
//
// run_call() fills the stack, calls callBoxed, and stores the returns in the output registers,
// unpacking a multi-output return (several returns, or one list) in order.

#pragma once

#include "call_op.h"

#ifndef FXRT_NO_PYTHON
#include <torch/csrc/jit/python/pybind_utils.h>
#else
#include <ATen/ScalarOps.h>
#endif

#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace fxrt {

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

#ifdef FXRT_NO_PYTHON
// What the checks do not accept, without Python, converted as torch.ops converts the Python
// value: an int register where a float is expected becomes that float; a number (an int input
// of the graph, a SYM step's result) where a Tensor is expected becomes a 0-dim tensor marked as
// a wrapped number, as Python's scalars are (so `x * n` promotes as eager does), for the ops
// that take numbers as tensors (call.numbers_as_tensors). Anything else is an error naming the
// argument, where the Python build would convert the value as torch.ops does.
inline IValue convert_slow(
    const CallOp& call,
    const BoundArg& arg,
    const std::vector<IValue>& regs,
    GilState&) {
  const c10::Argument& param = call.op.schema().arguments()[arg.position];
  if (arg.kind == BoundArg::REG) {
    const IValue& v = regs[static_cast<size_t>(arg.reg)];
    if ((arg.accept == Accept::FLOAT || arg.accept == Accept::SYMFLOAT) && v.isInt()) {
      return IValue(static_cast<double>(v.toInt()));
    }
    if (arg.accept == Accept::TENSOR && call.numbers_as_tensors &&
        (v.isInt() || v.isDouble() || v.isBool())) {
      at::Tensor t = at::scalar_to_tensor(v.toScalar());
      t.unsafeGetTensorImpl()->set_wrapped_number(true);
      return IValue(std::move(t));
    }
    TORCH_CHECK_TYPE(
        false, call.op.schema().name(), ": argument ", param.name(), " expects ",
        param.real_type()->str(), ", got a register holding ", v.tagKind());
  }
  TORCH_CHECK_TYPE(
      false, call.op.schema().name(), ": argument ", param.name(), " (", param.real_type()->str(),
      ") has a register of another type in its list");
}
#else
// The argument as torch.ops converts its Python form: for what the checks do not accept.
inline IValue convert_slow(
    const CallOp& call,
    const BoundArg& arg,
    const std::vector<IValue>& regs,
    GilState& gil) {
  gil.acquire();
  py::object value = arg.tree->build(regs);
  torch::jit::ToIValueAllowNumbersAsTensors numbers_as_tensors(call.numbers_as_tensors);
  return torch::jit::argumentToIValue(call.op.schema(), arg.position, value);
}

#endif

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
      stack.push_back(convert_slow(call, arg, regs, gil));
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
#ifndef FXRT_NO_PYTHON
    // torch.ops keeps this flag set while the op runs: Python kernels it reaches (custom ops,
    // prims) re-enter the dispatcher with the numbers it converted back to Python.
    torch::jit::ToIValueAllowNumbersAsTensors numbers_as_tensors(call.numbers_as_tensors);
#endif
    call.op.callBoxed(&stack);
  }
  store_returns(call, regs, stack);
}

}  // namespace fxrt
