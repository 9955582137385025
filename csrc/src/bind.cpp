#include "bind.h"

#include "fxrt/model.h"

namespace fxrt::decode {

using json::clip;
using json::Value;

namespace {

// ---- binding a stored call to its op's schema (what bind_python.h does from Python objects)

BoundArg bind_arg(
    const c10::FunctionSchema& schema,
    size_t i,
    const Value& v,
    const RegisterCheck& regs,
    const std::string& where) {
  const c10::Argument& param = schema.arguments()[i];
  const std::string at = where + ": argument " + param.name();
  const c10::TypePtr& type = param.real_type();
  BoundArg arg;
  arg.position = i;
  if (!contains_ref(v)) {
    arg.value = constant(v, type, param.N().value_or(0), at);
    return arg;
  }
  arg.optional = type->kind() == c10::TypeKind::OptionalType;
  arg.accept = accept_for(without_optional(type));
  if (tag_of(v) == "ref") {
    arg.kind = BoundArg::REG;
    arg.reg = regs.use_ref(v.o[0].second, at);
    return arg;
  }
  auto list_type = without_optional(type)->cast<c10::ListType>();
  BoundArg::Kind kind = list_type ? list_kind(list_type->getElementType()) : BoundArg::TREE;
  if (kind == BoundArg::TREE || !is_sequence(v)) {
    fail(at + ": registers inside a " + type->str() + " the C++ runtime does not bind");
  }
  const c10::TypePtr& elem = list_type->getElementType();
  for (const Value& x : v.o[0].second.a) {
    ListItem item;
    if (tag_of(x) == "ref") {
      item.reg = regs.use_ref(x.o[0].second, at);
    } else if (contains_ref(x)) {
      fail(at + ": a nested list of registers");
    } else if (kind == BoundArg::INT_LIST) {
      item.value = constant(x, elem, 0, at);
    } else if (x.is_null() && kind == BoundArg::OPT_TENSOR_LIST) {
      item.value = IValue();
    } else {
      fail(at + ": a constant tensor in a list (tensors are registers)");
    }
    arg.items.push_back(std::move(item));
  }
  arg.kind = kind;
  return arg;
}

}  // namespace

const std::vector<Value>& tuple_items(const Value& v, const std::string& where) {
  if (!is_sequence(v)) {
    fail(where + ": arguments must be a tuple");
  }
  return v.o[0].second.a;
}

CallOp bind_call(
    const c10::OperatorHandle& handle,
    const Value& args_v,
    const Value& kwargs_v,
    std::vector<int64_t> outputs,
    bool multi,
    const RegisterCheck& regs,
    const std::string& where) {
  const c10::FunctionSchema& schema = handle.schema();
  const auto& params = schema.arguments();
  const std::vector<Value>& args = tuple_items(args_v, where);
  if (tag_of(kwargs_v) != "dict" || !kwargs_v.o[0].second.is_object()) {
    fail(where + ": keyword arguments must be a dict");
  }
  const Value& kwargs = kwargs_v.o[0].second;
  if (schema.is_vararg() || args.size() > params.size()) {
    fail(where + ": more arguments than the schema of " + schema.name() + " takes");
  }
  CallOp call{handle, {}, std::move(outputs), schema.returns().size(), multi};
  // torch.ops lets numbers stand for Tensor arguments of prims ops and of a list of aten ops
  // (torch::should_allow_numbers_as_tensors, in libtorch_python, which this runtime does not
  // link). A stored program passes a number where a Tensor is expected only where its graph did
  // under torch.ops (fxrt.load runs the same graph there), so every aten and prims op may here.
  const std::string& name = schema.name();
  call.numbers_as_tensors = name.rfind("aten::", 0) == 0 || name.rfind("prims::", 0) == 0;
  size_t kwargs_used = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const c10::Argument& param = params[i];
    const Value* v = nullptr;
    if (i < args.size()) {
      if (param.kwarg_only()) {
        fail(where + ": positional value for keyword-only argument " + param.name());
      }
      v = &args[i];
    } else {
      v = kwargs.find(param.name());
      kwargs_used += v != nullptr;
    }
    if (v != nullptr) {
      call.args.push_back(bind_arg(schema, i, *v, regs, where));
    } else if (param.default_value().has_value()) {
      BoundArg arg;
      arg.position = i;
      arg.value = *param.default_value();
      call.args.push_back(std::move(arg));
    } else {
      fail(where + ": no value for argument " + param.name() + " of " + schema.name());
    }
  }
  if (kwargs_used != kwargs.o.size()) {
    fail(where + ": a keyword argument the schema of " + schema.name() + " does not have");
  }
  if (call.outputs.empty() || (!multi && call.outputs.size() != 1)) {
    fail(where + ": malformed outputs");
  }
  return call;
}

}  // namespace fxrt::decode
