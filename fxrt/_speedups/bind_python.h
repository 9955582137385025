// Binds CALLs from the Program's Python objects (fxrt/exec/native.py hands them over): the op
// by name through the dispatcher, each argument from the call's args and kwargs against its
// schema type, with torch.ops' own conversions (torch::jit::argumentToIValue). call.h runs them.
// Python build only.

#pragma once

#include "call.h"

#include <torch/csrc/jit/python/pybind_utils.h>

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

}  // namespace fxrt
