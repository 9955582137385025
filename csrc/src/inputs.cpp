// A package's signature (fxrt/deploy/signature.py) and the per-call checks of the user's inputs,
// as fxrt.deploy.binder makes them in Python: each tensor's dtype, device, rank and static sizes;
// each size symbol within its exported range and bound to one value per call (by tensor dims and
// int inputs alike); derived sizes ("s0 + 1") and int inputs with a derived value evaluated from
// the bound symbols. Errors are InputErrors naming the input, its path and what it was exported
// for. What these checks do not see (strides, the compiled graph's own specs) the compiled loop's
// check refuses, and mismatch() names the input.

#include "model_impl.h"

#include "decode.h"

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

// A derived size ("2*s0", "s0 + 1", "(s0//2)", "Max(1, s0)") evaluated with the sizes bound to
// its symbols, with Python's integer semantics; nullopt when a symbol is unbound or the
// expression uses anything else (it is then not checked, as in fxrt.deploy.binder).
class SizeExpr {
 public:
  SizeExpr(const std::string& text, const std::map<std::string, int64_t>& env)
      : t_(text), env_(env) {}

  std::optional<int64_t> eval() {
    std::optional<int64_t> v = sum();
    skip();
    return pos_ == t_.size() ? v : std::nullopt;
  }

 private:
  void skip() {
    while (pos_ < t_.size() && t_[pos_] == ' ') {
      ++pos_;
    }
  }
  bool eat(const char* tok) {
    skip();
    size_t n = std::strlen(tok);
    if (t_.compare(pos_, n, tok) == 0) {
      pos_ += n;
      return true;
    }
    return false;
  }
  static std::optional<int64_t> floordiv(int64_t a, int64_t b, bool mod) {
    if (b == 0 || (a == INT64_MIN && b == -1)) {
      return std::nullopt;
    }
    int64_t q = a / b, m = a % b;
    if (m != 0 && ((m < 0) != (b < 0))) {
      q -= 1;
      m += b;
    }
    return mod ? m : q;
  }
  std::optional<int64_t> sum() {
    std::optional<int64_t> v = product();
    while (v) {
      if (eat("+")) {
        std::optional<int64_t> r = product();
        int64_t out = 0;
        v = r && !__builtin_add_overflow(*v, *r, &out) ? std::optional<int64_t>(out) : std::nullopt;
      } else if (eat("-")) {
        std::optional<int64_t> r = product();
        int64_t out = 0;
        v = r && !__builtin_sub_overflow(*v, *r, &out) ? std::optional<int64_t>(out) : std::nullopt;
      } else {
        break;
      }
    }
    return v;
  }
  std::optional<int64_t> product() {
    std::optional<int64_t> v = factor();
    while (v) {
      if (eat("//")) {
        std::optional<int64_t> r = factor();
        v = r ? floordiv(*v, *r, false) : std::nullopt;
      } else if (eat("*")) {
        std::optional<int64_t> r = factor();
        int64_t out = 0;
        v = r && !__builtin_mul_overflow(*v, *r, &out) ? std::optional<int64_t>(out) : std::nullopt;
      } else if (eat("%")) {
        std::optional<int64_t> r = factor();
        v = r ? floordiv(*v, *r, true) : std::nullopt;
      } else {
        break;
      }
    }
    return v;
  }
  std::optional<int64_t> factor() {
    if (++depth_ > 64) {
      return std::nullopt;
    }
    skip();
    if (eat("(")) {
      std::optional<int64_t> v = sum();
      return eat(")") ? v : std::nullopt;
    }
    if (eat("-")) {
      std::optional<int64_t> v = factor();
      return v && *v != INT64_MIN ? std::optional<int64_t>(-*v) : std::nullopt;
    }
    for (const char* fn : {"Max(", "Min("}) {
      if (eat(fn)) {
        std::optional<int64_t> a = sum();
        if (!a || !eat(",")) {
          return std::nullopt;
        }
        std::optional<int64_t> b = sum();
        if (!b || !eat(")")) {
          return std::nullopt;
        }
        return fn[1] == 'a' ? std::max(*a, *b) : std::min(*a, *b);
      }
    }
    size_t start = pos_;
    while (pos_ < t_.size() && std::isalnum(static_cast<unsigned char>(t_[pos_]))) {
      ++pos_;
    }
    std::string word = t_.substr(start, pos_ - start);
    if (!word.empty() && std::all_of(word.begin(), word.end(), ::isdigit) && word.size() < 18) {
      return std::stoll(word);
    }
    auto it = env_.find(word);
    return it != env_.end() ? std::optional<int64_t>(it->second) : std::nullopt;
  }

  const std::string& t_;
  const std::map<std::string, int64_t>& env_;
  size_t pos_ = 0;
  int depth_ = 0;
};

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
std::string kind_of(const at::Tensor&) {
  return "Tensor";
}
std::string kind_of(const IValue& v) {
  return v.tagKind();
}

}  // namespace

void Model::Impl::load_signature(const Value& sig) {
  const std::string at = "signature";
  const Value& ranges = object(sig, "ranges", at);
  const Value& dims = object(sig, "dims", at);
  std::map<std::string, int> symbol_of;
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
    if (!is_symbol(name)) {  // a derived size's range ("s0 + 1"): checked with the expression
      derived_ranges[name] = {s.lo, s.hi};
      continue;
    }
    symbol_of[name] = static_cast<int>(symbols.size());
    symbols.push_back(std::move(s));
  }
  // A size: a static one, a symbol (with its range, or unbounded) or a derived expression.
  auto size_of = [&](const Value& d, UserInput& u, const std::string& where) {
    int sym = -1;
    if (d.is_int()) {
      int64_t n = integer(d, where, 0, INT64_MAX);
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
    fail("signature: " + std::to_string(inputs.size()) + " inputs for " +
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
        for (const Value& d : shape.a) {
          size_of(d, u, where);
        }
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

void Model::Impl::input_error(const UserInput& u, const std::string& why) const {
  std::ostringstream s;
  s << "fxrt: " << u.label << ": " << why << "; exported for ";
  auto dim = [&](size_t d) {
    if (u.symbol[d] >= 0) {
      const Symbol& sym = symbols[static_cast<size_t>(u.symbol[d])];
      s << sym.name << " in [" << sym.lo << ", " << bound_text(sym.hi) << "]";
      return;
    }
    if (u.fixed[d]) {
      s << u.info.sizes[d];
      return;
    }
    for (const auto& [k, expr] : u.derived) {
      if (k == d) {
        s << expr;
        return;
      }
    }
    s << "?";
  };
  if (u.info.is_int) {
    s << "an int, ";
    dim(0);
    throw InputError(s.str());
  }
  s << c10::toString(u.info.dtype) << "[";
  for (size_t d = 0; d < u.info.sizes.size(); ++d) {
    s << (d ? ", " : "");
    dim(d);
  }
  s << "]";
  throw InputError(s.str());
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
  // Per symbol: its value in this call, and where it was first read (user input, dim).
  std::vector<int64_t> bound(symbols.size(), -1);
  std::vector<std::pair<size_t, size_t>> from(symbols.size());
  auto bind = [&](size_t k, size_t d, int sym_index, int64_t got, const std::string& what) {
    const Symbol& sym = symbols[static_cast<size_t>(sym_index)];
    if (got < sym.lo || (sym.hi >= 0 && got > sym.hi)) {
      input_error(
          users[k], what + " is outside the range of " + sym.name + ", [" +
              std::to_string(sym.lo) + ", " + bound_text(sym.hi) + "]");
    }
    int64_t& b = bound[static_cast<size_t>(sym_index)];
    if (b >= 0 && b != got) {
      const auto& [k0, d0] = from[static_cast<size_t>(sym_index)];
      input_error(
          users[k], what + ", but " + sym.name + " = " + std::to_string(b) + " from " +
              users[k0].label + (users[k0].info.is_int ? "" : " dim " + std::to_string(d0)));
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
      input_error(u, std::string("dtype ") + c10::toString(x.scalar_type()));
    }
    if (x.device() != u.device) {
      input_error(u, "device " + x.device().str());
    }
    if (x.dim() != static_cast<int64_t>(u.info.sizes.size())) {
      input_error(u, std::to_string(x.dim()) + " dims");
    }
    for (size_t d = 0; d < u.info.sizes.size(); ++d) {
      int64_t got = x.size(static_cast<int64_t>(d));
      if (u.fixed[d] && got != u.info.sizes[d]) {
        input_error(u, "dim " + std::to_string(d) + ": size " + std::to_string(got) + " (static)");
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
        input_error(u, what + " outside " + expr + "'s range");
      }
      if (want.has_value() && got != *want) {
        input_error(u, what + ", expected " + expr + " = " + std::to_string(*want));
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
