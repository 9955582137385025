// A package's signature (fxrt/deploy/signature.py) and the per-call checks of the user's inputs,
// as fxrt.deploy.binder makes them in Python: each tensor's dtype, device, rank and static sizes;
// each size symbol within its exported range and bound to one value per call (by tensor dims and
// int inputs alike); derived sizes ("s0 + 1") and int inputs with a derived value evaluated from
// the bound symbols. Errors are InputErrors naming the input, its path and what it was exported
// for. What these checks do not see (strides, the compiled graph's own specs) the compiled loop's
// check refuses, and mismatch() names the input.

#include "model_impl.h"

#include "decode.h"
#include "size_expr.h"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <optional>
#include <sstream>
#include <type_traits>

namespace fxrt {

using json::clip;
using json::Value;
using namespace decode;

bool is_symbol(const std::string& s) {
  return s.size() >= 2 && s.size() <= 20 && (s[0] == 's' || s[0] == 'u') &&
      std::all_of(s.begin() + 1, s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

namespace {

std::string bound_text(int64_t hi) {
  return hi < 0 ? "inf" : std::to_string(hi);
}

// A run() input as a tensor (nullptr if it is not one), and its kind for messages.
const at::Tensor* tensor_of(const at::Tensor& t) {
  return &t;
}
const at::Tensor* tensor_of(const IValue& v) {
  return v.isTensor() ? &v.toTensor() : nullptr;
}
struct Foreign : torch::CustomClassHolder {
  explicit Foreign(std::string name) : name(std::move(name)) {}
  std::string name;
};

// A value's kind as messages name it (Python's names, which read as well from C++).
std::string kind_of(const at::Tensor&) {
  return "Tensor";
}
std::string kind_of(const IValue& v) {
  if (v.isCapsule()) {
    if (auto* f = dynamic_cast<const Foreign*>(v.toCapsule().get())) {
      return clip(f->name, 60);
    }
  }
  if (v.isInt()) return "int";
  if (v.isDouble()) return "float";
  if (v.isBool()) return "bool";
  if (v.isNone()) return "NoneType";
  if (v.isString()) return "str";
  if (v.isList()) return "list";
  if (v.isTuple()) return "tuple";
  if (v.isGenericDict()) return "dict";
  return v.tagKind();
}

}  // namespace

IValue foreign_value(const std::string& type_name) {
  return IValue::make_capsule(c10::make_intrusive<Foreign>(type_name));
}

void Model::Impl::load_signature(const Value& sig) {
  check_signature(sig);
  const std::string at = "signature";
  const Value& ranges = object(sig, "ranges", at);
  const Value& dims = object(sig, "dims", at);
  std::map<std::string, int> symbol_of;
  std::map<std::string, std::string> ranged;  // a size with a range -> "batch (s0) in [2, 16]"
  for (const auto& [name, r] : ranges.o) {
    if (!r.is_array() || r.a.size() != 2 || name.size() > 40) {
      fail("signature: malformed range");
    }
    Symbol s;
    s.raw = name;
    const Value* dim = dims.find(name);
    s.name = dim != nullptr && dim->is_string() ? clip(dim->s, 80) + " (" + name + ")" : name;
    s.lo = integer(r.a[0], at, 0, INT64_MAX);
    s.hi = r.a[1].is_null() ? -1 : integer(r.a[1], at, 0, INT64_MAX);
    ranged[name] = s.name + " in [" + std::to_string(s.lo) + ", " + bound_text(s.hi) + "]";
    if (!is_symbol(name)) {  // a derived size's range ("s0 + 1"): checked with the expression
      derived_ranges[name] = {s.lo, s.hi};
      continue;
    }
    symbol_of[name] = static_cast<int>(symbols.size());
    symbols.push_back(std::move(s));
  }
  // A size: a static one, a symbol (with its range, or unbounded) or a derived expression.
  std::vector<std::string> dim_text;  // the input's sizes as the signature writes them
  auto size_of = [&](const Value& d, UserInput& u, const std::string& where) {
    int sym = -1;
    if (d.is_int()) {
      int64_t n = integer(d, where, 0, INT64_MAX);
      dim_text.push_back(std::to_string(n));
      u.info.sizes.push_back(n);
      u.info.min_sizes.push_back(n);
      u.info.max_sizes.push_back(n);
      u.fixed.push_back(true);
      u.symbol.push_back(-1);
      return;
    }
    const std::string& e = string(d, where + ": size");
    if (e.size() > 2000) {
      fail(where + ": size expression too long");
    }
    dim_text.push_back(e);
    auto it = symbol_of.find(e);
    if (it == symbol_of.end() && is_symbol(e)) {  // a symbol without a range
      it = symbol_of.emplace(e, static_cast<int>(symbols.size())).first;
      symbols.push_back({e, e, 0, -1});
    }
    if (it != symbol_of.end()) {
      sym = it->second;
    } else {
      u.derived.emplace_back(u.info.sizes.size(), e);
    }
    u.info.sizes.push_back(-1);
    u.info.min_sizes.push_back(sym >= 0 ? symbols[static_cast<size_t>(sym)].lo : 0);
    u.info.max_sizes.push_back(sym >= 0 ? symbols[static_cast<size_t>(sym)].hi : -1);
    u.fixed.push_back(false);
    u.symbol.push_back(sym);
  };
  const std::vector<Value>& inputs = array(sig, "inputs", at).a;
  if (inputs.size() != input_regs.size()) {
    fail(std::to_string(inputs.size()) + " signature inputs for " +
         std::to_string(input_regs.size()) + " graph inputs");
  }
  std::map<std::string, size_t> user_of;  // user input name -> index in users
  for (const Value& s : inputs) {
    const std::string& name = string(member(s, "name", at), at + ": input name");
    const std::string& kind = string(member(s, "kind", at), at + ": input kind");
    std::string where = "input '" + clip(name) + "'";
    input_names.push_back(where);
    Source src;
    if (kind == "weight") {
      const std::string& w = string(member(s, "weight", where), where);
      auto it = weight_id.find(w);
      if (it == weight_id.end()) {
        fail(where + " names an unknown weight \"" + clip(w) + "\"");
      }
      src.kind = Source::WEIGHT;
      src.index = it->second;
    } else if (kind == "constant") {
      src.value = plain_constant(member(s, "value", where), where);
    } else if (kind == "tensor" || kind == "symint") {
      UserInput u;
      u.info.name = name;
      u.info.path = string(member(s, "path", where), where);
      u.label = where + " (" + clip(u.info.path) + ")";
      const Value& shape = array(s, "shape", where);
      if (kind == "symint") {
        // An int leaf of the call whose value is the size expression shape[0].
        if (shape.a.size() != 1 || shape.a[0].is_int()) {
          fail(where + ": a symint has one size expression");
        }
        size_of(shape.a[0], u, where);
        u.info.is_int = true;
        u.info.min_value = u.info.min_sizes[0];
        u.info.max_value = u.info.max_sizes[0];
        u.info.sizes.clear();
        u.info.min_sizes.clear();
        u.info.max_sizes.clear();
        ++n_int_users;
      } else {
        u.info.dtype = short_dtype(member(s, "dtype", where), where);
        u.device = decode::device(string(member(s, "device", where), where), where);
        if (shape.a.size() > static_cast<size_t>(kMaxDims)) {
          fail(where + ": too many dims");
        }
        dim_text.clear();
        for (const Value& d : shape.a) {
          size_of(d, u, where);
        }
        // As fxrt.deploy.signature's InputSig.describe: "float32[s0, 8]@cuda:0 with batch (s0)
        // in [2, 16]".
        u.exported = dtype_name(u.info.dtype) + "[";
        std::string with;
        for (size_t d = 0; d < dim_text.size(); ++d) {
          u.exported += (d ? ", " : "") + dim_text[d];
          auto r = ranged.find(dim_text[d]);
          if (r != ranged.end()) {
            with += (with.empty() ? " with " : ", ") + r->second;
          }
        }
        u.exported += "]" + (u.device.is_cpu() ? std::string() : "@" + u.device.str()) + with;
      }
      src.kind = Source::USER;
      src.index = users.size();
      user_of[name] = users.size();
      infos.push_back(u.info);
      users.push_back(std::move(u));
    } else {
      fail(where + ": unknown kind \"" + clip(kind, 20) + "\"");
    }
    sources.push_back(std::move(src));
  }
  const std::vector<Value>& outputs = array(sig, "outputs", at).a;
  if (outputs.size() != outs.size()) {
    fail("signature: " + std::to_string(outputs.size()) + " outputs for " +
         std::to_string(outs.size()) + " graph outputs");
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    const Value& o = outputs[i];
    std::string where = "output " + std::to_string(i);
    const std::string& kind = string(member(o, "kind", where), where);
    if (kind == "user") {
      outs[i].kind = Out::USER;
      ++n_user_outputs;
    } else if (kind == "buffer_mutation") {
      const std::string& target = string(member(o, "target", where), where);
      auto it = weight_id.find(target);
      if (it == weight_id.end()) {
        fail(where + " mutates an unknown buffer \"" + clip(target) + "\"");
      }
      outs[i].kind = Out::WEIGHT_MUTATION;
      outs[i].target = it->second;
    } else if (kind == "input_mutation") {
      const std::string& target = string(member(o, "target", where), where);
      auto it = user_of.find(target);
      if (it == user_of.end() || users[it->second].info.is_int) {
        fail(where + " mutates an unknown input \"" + clip(target) + "\"");
      }
      outs[i].kind = Out::INPUT_MUTATION;
      outs[i].target = it->second;
    } else {
      fail(where + ": unknown kind");
    }
  }
}

// As fxrt.deploy.binder words it: "fxrt: input 'x' (args[0]): <why> (exported: float32[s0, 8]
// with batch (s0) in [2, 16]; got float64[4, 8])"; an int input without the parenthesis.
void Model::Impl::input_error(const UserInput& u, const std::string& why, const at::Tensor* got)
    const {
  std::string text = "fxrt: " + u.label + ": " + why;
  if (!u.info.is_int) {
    text += " (exported: " + u.exported;
    if (got != nullptr) {
      text += "; got " + dtype_name(got->scalar_type()) + "[";
      for (int64_t d = 0; d < got->dim(); ++d) {
        text += (d ? ", " : "") + std::to_string(got->size(d));
      }
      text += "]" + (got->device().is_cpu() ? std::string() : "@" + got->device().str());
    }
    text += ")";
  }
  throw InputError(text);
}

template <class T>
void Model::Impl::check_user_inputs(const std::vector<T>& inputs) const {
  if (inputs.size() != users.size()) {
    throw InputError(
        "fxrt: the model takes " + std::to_string(users.size()) +
        (n_int_users ? " inputs (" + std::to_string(users.size() - n_int_users) + " tensors, " +
                 std::to_string(n_int_users) + " ints)"
                     : std::string(" tensor inputs")) +
        ", got " + std::to_string(inputs.size()));
  }
  if (!check_inputs) {
    return;
  }
  // Per symbol: its value in this call, and where it was first read (user input, dim).
  std::vector<int64_t> bound(symbols.size(), -1);
  std::vector<std::pair<size_t, size_t>> from(symbols.size());
  // The tensor of user input k for the message, or nullptr for an int.
  auto got_of = [&](size_t k) -> const at::Tensor* {
    return users[k].info.is_int ? nullptr : tensor_of(inputs[k]);
  };
  auto bind = [&](size_t k, size_t d, int sym_index, int64_t got, const std::string& what) {
    const Symbol& sym = symbols[static_cast<size_t>(sym_index)];
    const at::Tensor* got_tensor = got_of(k);
    if (got < sym.lo || (sym.hi >= 0 && got > sym.hi)) {
      input_error(
          users[k], what + " is outside the range of " + sym.name + ", [" +
              std::to_string(sym.lo) + ", " + bound_text(sym.hi) + "]", got_tensor);
    }
    int64_t& b = bound[static_cast<size_t>(sym_index)];
    if (b >= 0 && b != got) {
      const auto& [k0, d0] = from[static_cast<size_t>(sym_index)];
      input_error(
          users[k], what + ", but " + sym.name + " = " + std::to_string(b) + " from " +
              users[k0].label + (users[k0].info.is_int ? "" : " dim " + std::to_string(d0)),
          got_tensor);
    }
    if (b < 0) {
      b = got;
      from[static_cast<size_t>(sym_index)] = {k, d};
    }
  };
  bool derived = false;
  for (size_t k = 0; k < users.size(); ++k) {  // tensors first, as fxrt.deploy.binder
    const UserInput& u = users[k];
    derived = derived || !u.derived.empty();
    if (u.info.is_int) {
      continue;
    }
    const at::Tensor* t = tensor_of(inputs[k]);
    if (t == nullptr || !t->defined()) {
      input_error(
          u, "expected a tensor, got " +
              (t == nullptr ? "a " + kind_of(inputs[k]) : std::string("an undefined one")));
    }
    const at::Tensor& x = *t;
    if (x.scalar_type() != u.info.dtype) {
      input_error(
          u, "dtype " + dtype_name(x.scalar_type()) + ", exported for " + dtype_name(u.info.dtype),
          &x);
    }
    if (x.device() != u.device) {
      input_error(u, "device " + x.device().str() + ", exported for " + u.device.str(), &x);
    }
    if (x.dim() != static_cast<int64_t>(u.info.sizes.size())) {
      input_error(
          u, std::to_string(x.dim()) + " dims, exported for " +
              std::to_string(u.info.sizes.size()), &x);
    }
    for (size_t d = 0; d < u.info.sizes.size(); ++d) {
      int64_t got = x.size(static_cast<int64_t>(d));
      if (u.fixed[d] && got != u.info.sizes[d]) {
        input_error(
            u, "dim " + std::to_string(d) + ": size " + std::to_string(got) + ", exported for " +
                std::to_string(u.info.sizes[d]) + " (static)", &x);
      }
      if (u.symbol[d] >= 0) {
        bind(k, d, u.symbol[d], got, "dim " + std::to_string(d) + ": size " + std::to_string(got));
      }
    }
  }
  if constexpr (std::is_same_v<T, IValue>) {
    for (size_t k = 0; k < users.size(); ++k) {
      const UserInput& u = users[k];
      if (!u.info.is_int) {
        continue;
      }
      if (!inputs[k].isInt()) {
        input_error(u, "expected an int, got a " + kind_of(inputs[k]));
      }
      if (u.symbol[0] >= 0) {
        bind(k, 0, u.symbol[0], inputs[k].toInt(), std::to_string(inputs[k].toInt()));
      }
    }
  }
  if (!derived) {
    return;
  }
  std::map<std::string, int64_t> env;
  for (size_t i = 0; i < symbols.size(); ++i) {
    if (bound[i] >= 0) {
      env[symbols[i].raw] = bound[i];
    }
  }
  for (size_t k = 0; k < users.size(); ++k) {
    const UserInput& u = users[k];
    for (const auto& [d, expr] : u.derived) {
      std::optional<int64_t> want = SizeExpr(expr, env).eval();
      int64_t got = 0;
      std::string what;
      if (u.info.is_int) {
        if constexpr (std::is_same_v<T, IValue>) {
          got = inputs[k].toInt();
        }
        what = std::to_string(got);
      } else {
        got = tensor_of(inputs[k])->size(static_cast<int64_t>(d));
        what = "dim " + std::to_string(d) + ": size " + std::to_string(got);
      }
      auto range = derived_ranges.find(expr);
      if (range != derived_ranges.end() &&
          (got < range->second.first || (range->second.second >= 0 && got > range->second.second))) {
        input_error(u, what + " is outside the range of " + expr, got_of(k));
      }
      if (want.has_value() && got != *want) {
        input_error(u, what + ", expected " + expr + " = " + std::to_string(*want), got_of(k));
      }
    }
  }
}

template void Model::Impl::check_user_inputs<at::Tensor>(const std::vector<at::Tensor>&) const;
template void Model::Impl::check_user_inputs<IValue>(const std::vector<IValue>&) const;

// The input the compiled graph's check refused (what check_user_inputs does not see: strides,
// weights), named with what it got and what the graph was compiled for.
void Model::Impl::mismatch(const Registers& regs) const {
  auto dims = [](c10::IntArrayRef v) {
    std::string s;
    for (size_t d = 0; d < v.size(); ++d) {
      s += (d ? ", " : "") + (v[d] < -1 ? "s" + std::to_string(-2 - v[d]) : std::to_string(v[d]));
    }
    return s;
  };
  for (const auto& [pos, spec] : specs) {
    if (inputs_match({spec}, static_cast<size_t>(kMaxDims) + 1, regs)) {
      continue;
    }
    std::string got = "not a tensor";
    const IValue& v = regs[spec.reg];
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      got = std::string(c10::toString(t.scalar_type())) + "[" + dims(t.sizes()) + "] stride (" +
          dims(t.strides()) + ") on " + t.device().str();
    }
    throw InputError(
        "fxrt: " + input_names[static_cast<size_t>(pos)] + ": got " + got + ", compiled for " +
        c10::toString(spec.dtype) + "[" + dims(spec.sizes) + "] stride (" + dims(spec.strides) +
        ") on " + spec.device.str() + " (-1: any)");
  }
  throw InputError("fxrt: the inputs do not match the compiled graph");
}

}  // namespace fxrt
