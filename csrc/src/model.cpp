// fxrt::Model: a package's stored program (fxrt/deploy/program_data.py) loaded onto the compiled
// loop (fxrt/_speedups/loop.h, built here with FXRT_NO_PYTHON).
//
// Loading trusts nothing in the file. read_package() checks the structure and hashes; then:
//
// 1. ops: every op of the manifest's table is looked up in the dispatcher by its qualified name
//    and its schema compared with the stored one (a package from another torch loads only if
//    they all agree, else the error names the op);
// 2. weights: views of their entries in the mapped file, geometry checked against the entry;
//    graph tensors (constants fxrt made): rebuilt from their entries, digests checked;
// 3. the program: each instruction's kind, node, op (which must be in the checked table),
//    registers (in range, defined before they are read, not after a FREE), arena slots (in
//    range, inside the arena), and arguments, bound to the op's schema as the Python extension
//    binds them (positional, then keyword, then the schema's defaults; constants converted to the
//    schema's type). Anything else is a PackageError naming the instruction and its node. A
//    PYCALL (a node that runs Python) is refused, naming the node.
// 4. the signature: which graph input is a weight, a user tensor or a constant; which output is
//    the user's or a buffer/input mutation to copy back.
//
// run() writes the inputs into a fresh register file, checks them as the Python binder and loop
// do (naming the input), and runs the Executor. decode.h reads the manifest's values, bind.h
// binds stored calls to their schemas.

#include "fxrt/model.h"

#include "bind.h"
#include "decode.h"
#include "json.h"
#include "package.h"
#include "sha256.h"

#include "loop.h"
#include "own_ops.h"  // fxrt's own CPU ops, which graphs may call

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/Device.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <optional>
#include <map>
#include <sstream>
#include <unordered_map>
#include <utility>

namespace fxrt {

using json::clip;
using json::Value;
using namespace decode;

namespace {

struct Symbol {
  std::string raw;  // "s0"
  std::string name;  // as messages say it: "batch (s0)"
  int64_t lo = 0, hi = -1;
};

bool is_symbol(const std::string& s) {
  return s.size() >= 2 && s.size() <= 20 && (s[0] == 's' || s[0] == 'u') &&
      std::all_of(s.begin() + 1, s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

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

}  // namespace

// ---------------------------------------------------------------------------------------------

struct Model::Impl {
  std::shared_ptr<MappedFile> file;
  std::string module;
  std::unique_ptr<Executor> exec;
  std::vector<int64_t> input_regs;

  struct Source {
    int kind = 0;  // 0 weight/constant (value), 1 the index-th user tensor
    size_t index = 0;
    IValue value;
  };
  std::vector<Source> sources;  // per graph input

  struct UserInput {
    InputInfo info;
    std::string label;  // "input 'x' (args[0])"
    c10::Device device{c10::kCPU};
    std::vector<int> symbol;  // per dim: index into symbols, or -1 (static or derived)
    std::vector<bool> fixed;  // per dim: a static size
    std::vector<std::pair<size_t, std::string>> derived;  // dim, size expression
  };
  std::vector<UserInput> users;
  std::vector<Symbol> symbols;
  std::map<std::string, std::pair<int64_t, int64_t>> derived_ranges;  // expression -> lo, hi

  struct Out {
    int kind = 0;  // 0 user, 1 weight mutation, 2 input mutation
    int64_t reg = -1;
    IValue value;  // when reg < 0
    at::Tensor target;  // weight mutation
    size_t user = 0;  // input mutation
  };
  std::vector<Out> outs;
  size_t n_user_outputs = 0;
  std::vector<std::string> where;  // per pc: "node <name> (<op>)"
  std::vector<InputInfo> infos;
  std::vector<std::pair<int64_t, InputSpec>> specs;  // graph input position, spec: for errors
  std::vector<std::string> input_names;  // per graph input

  std::unordered_map<std::string, c10::OperatorHandle> ops;
  std::map<std::string, at::Tensor> weights;

  void check_ops(const Value& table, const Value& producer);
  void load_weights(const RawPackage& raw, const Value& records, const c10::Device& device);
  std::vector<IValue> graph_constants(const RawPackage& raw, const Value& graph, int64_t n_regs,
                                      std::vector<int64_t>& regs_out);
  void load_program(const RawPackage& raw, const Value& manifest, const Value& program,
                    const c10::Device& device);
  void load_signature(const Value& sig);
  const c10::OperatorHandle& op(const Value& name, const std::string& where) const;
  void check_user_inputs(const std::vector<at::Tensor>& inputs) const;
  [[noreturn]] void input_error(const UserInput& u, const std::string& why) const;
  [[noreturn]] void mismatch(const Registers& regs) const;
};

const c10::OperatorHandle& Model::Impl::op(const Value& name, const std::string& where) const {
  const std::string& s = string(name, where + ": op");
  auto it = ops.find(s);
  if (it == ops.end()) {
    fail(where + ": op " + clip(s) + " is not in the package's op table");
  }
  return it->second;
}

void Model::Impl::check_ops(const Value& table, const Value& producer) {
  const Value* torch = producer.find("torch");
  std::string made_by = torch != nullptr && torch->is_string() ? clip(torch->s, 40) : "?";
  for (const auto& [name, schema] : table.o) {
    if (!schema.is_string() || name.size() > 200) {
      fail("ops: malformed entry " + clip(name));
    }
    auto handle = c10::Dispatcher::singleton().findSchema(op_name(name));
    for (const char* op : {"::scope_enter", "::scope_exit", "::record", "::wait"}) {
      if (!handle.has_value() && name.size() > std::strlen(op) &&
          name.compare(name.size() - std::strlen(op), std::string::npos, op) == 0 &&
          (name.rfind("fxrt::", 0) == 0 || name.rfind("air::", 0) == 0)) {
        throw PackageError(
            "fxrt package: op " + clip(name, 200) +
            " switches streams; the C++ runtime runs single-stream programs only (fxrt.load runs "
            "this package)");
      }
    }
    if (!handle.has_value()) {
      throw PackageError(
          "fxrt package: op " + clip(name, 200) + " is not registered in this process (made by "
          "torch " + made_by + ")");
    }
    std::string now = schema_text(handle->schema());
    if (now != schema.s) {
      throw PackageError(
          "fxrt package: op " + name + " changed its schema since the package was made (torch " +
          made_by + ": `" + clip(schema.s, 300) + "`; this libtorch: `" + now +
          "`); export the model again");
    }
    ops.emplace(name, *handle);
  }
}

void Model::Impl::load_weights(
    const RawPackage& raw,
    const Value& records,
    const c10::Device& dev) {
  std::map<std::string, at::Tensor> bases;
  for (const auto& [name, r] : records.o) {
    std::string where = "weight \"" + clip(name) + "\"";
    if (name.size() > 4096 || !r.is_object() || r.o.size() != 6) {
      fail(where + ": malformed");
    }
    const std::string& entry = string(member(r, "entry", where), where);
    auto e = raw.entries.find(entry);
    if (e == raw.entries.end()) {
      fail(where + ": no weights entry \"" + clip(entry) + "\"");
    }
    const std::string& kind = string(member(r, "kind", where), where);
    if (kind != "parameter" && kind != "buffer" && kind != "nonpersistent_buffer" &&
        kind != "constant") {
      fail(where + ": unknown kind");
    }
    int st = 0;
    int64_t itemsize = 0;
    safetensors_dtype(e->second.dtype, st, itemsize);
    auto type = static_cast<c10::ScalarType>(st);
    if (short_dtype(member(r, "dtype", where), where) != type) {
      fail(where + ": dtype does not match its entry's");
    }
    std::vector<int64_t> shape = ints(member(r, "shape", where), where, 0, int64_t{1} << 62);
    std::vector<int64_t> stride = ints(member(r, "stride", where), where, 0, int64_t{1} << 62);
    int64_t offset = integer(member(r, "offset", where), where, 0, int64_t{1} << 62);
    if (shape.size() != stride.size() || shape.size() > kMaxDims) {
      fail(where + ": malformed geometry");
    }
    int64_t end = extent(shape, stride, offset);
    if (end < 0 || end > e->second.numel) {
      fail(where + ": view reaches past its entry");
    }
    at::Tensor& base = bases[entry];
    if (!base.defined()) {
      auto options = at::TensorOptions().dtype(type);
      if (e->second.numel > 0) {
        std::shared_ptr<MappedFile> keep = raw.file;
        base = at::from_blob(
            raw.file->data() + raw.data_start + e->second.begin, {e->second.numel},
            [keep](void*) mutable { keep.reset(); }, options);
      } else {
        base = at::empty({0}, options);
      }
      if (dev != base.device()) {
        base = base.to(dev);
      }
    }
    weights[name] = base.as_strided(shape, stride, offset);
  }
}

std::vector<IValue> Model::Impl::graph_constants(
    const RawPackage& raw,
    const Value& graph,
    int64_t n_regs,
    std::vector<int64_t>& regs_out) {
  const Value& records = object(graph, "tensors", "graph");
  std::vector<IValue> out;
  for (const Value& item : array(graph, "constants", "graph").a) {
    if (!item.is_array() || item.a.size() != 2) {
      fail("graph constants: malformed");
    }
    std::string where = "graph constant " + (item.a[0].is_int() ? std::to_string(item.a[0].i) : "?");
    regs_out.push_back(integer(item.a[0], where, 0, n_regs - 1));
    const Value& v = item.a[1];
    if (tag_of(v) != "tensor") {
      out.push_back(plain_constant(v, where));
      continue;
    }
    const std::string& name = string(v.o[0].second, where);
    const Value* rec = records.find(name);
    auto e = raw.entries.find("graph/" + name);
    if (rec == nullptr || !rec->is_object() || e == raw.entries.end() || e->second.dtype != "U8") {
      fail(where + ": no graph tensor \"" + clip(name) + "\"");
    }
    auto type = dtype(member(*rec, "dtype", where), where);
    std::vector<int64_t> shape = ints(member(*rec, "shape", where), where, 0, int64_t{1} << 62);
    std::vector<int64_t> stride = ints(member(*rec, "stride", where), where, 0, int64_t{1} << 62);
    int64_t nbytes = integer(member(*rec, "nbytes", where), where, 0, int64_t{1} << 62);
    bool requires_grad = boolean(member(*rec, "requires_grad", where), where);
    c10::Device dev = device(string(member(*rec, "device", where), where), where);
    const std::string& digest = string(member(*rec, "sha256", where), where);
    int64_t numel = 1;
    for (int64_t s : shape) {
      if (__builtin_mul_overflow(numel, s, &numel)) {
        fail(where + ": too many elements");
      }
    }
    int64_t want = 0;
    if (shape.size() != stride.size() || shape.size() > kMaxDims ||
        __builtin_mul_overflow(numel, static_cast<int64_t>(c10::elementSize(type)), &want) ||
        want != nbytes || static_cast<uint64_t>(nbytes) != e->second.end - e->second.begin ||
        (numel > 0 && !dense(shape, stride))) {
      fail(where + ": its record does not match its bytes");
    }
    uint8_t* bytes = raw.file->data() + raw.data_start + e->second.begin;
    Sha256 h;
    h.update(bytes, static_cast<size_t>(nbytes));
    if (Sha256::hex(h.digest()) != digest) {
      fail(where + ": tensor bytes do not match their hash");
    }
    at::Tensor t = at::empty_strided(shape, stride, at::TensorOptions().dtype(type));
    if (numel > 0) {
      // The bytes are in the order of the strides (largest first), as fxrt.artifact writes them.
      std::vector<int64_t> order(shape.size());
      for (size_t d = 0; d < order.size(); ++d) {
        order[d] = static_cast<int64_t>(d);
      }
      std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
        return stride[static_cast<size_t>(a)] > stride[static_cast<size_t>(b)];
      });
      std::vector<int64_t> permuted;
      for (int64_t d : order) {
        permuted.push_back(shape[static_cast<size_t>(d)]);
      }
      at::Tensor src = at::from_blob(bytes, permuted, at::TensorOptions().dtype(type));
      t.permute(order).copy_(src);
    }
    if (dev != t.device()) {
      t = t.to(dev);
    }
    if (requires_grad && c10::isFloatingType(type)) {
      t.set_requires_grad(true);
    }
    out.emplace_back(std::move(t));
  }
  return out;
}

void Model::Impl::load_program(
    const RawPackage& raw,
    const Value& m,
    const Value& p,
    const c10::Device& dev) {
  const std::string fmt = "program";
  if (string(member(p, "format", fmt), fmt) != "fxrt-program/1") {
    fail("program: unknown format");
  }
  int64_t n_regs = integer(member(p, "n_regs", fmt), "program: n_regs", 0, kMaxRegs);
  input_regs = ints(array(p, "inputs", fmt), "program: inputs", 0, n_regs - 1);
  const Value& nodes = array(p, "nodes", fmt);
  for (const Value& n : nodes.a) {
    string(n, "program: node name");
  }
  RegisterCheck regs(n_regs);
  exec = std::make_unique<Executor>(n_regs);
  exec->set_inputs(input_regs);
  for (int64_t r : input_regs) {
    regs.define(r);
  }
  std::vector<int64_t> const_regs;
  std::vector<IValue> consts = graph_constants(raw, object(m, "graph", "manifest"), n_regs, const_regs);
  for (size_t i = 0; i < consts.size(); ++i) {
    exec->set_constant_value(const_regs[i], consts[i]);
    regs.define(const_regs[i]);
  }

  // The arena plan: slots are views of one buffer and must lie inside it.
  struct SlotPlan {
    int64_t offset, nbytes;
    std::vector<int64_t> shape, stride;
    c10::ScalarType dtype;
  };
  std::vector<SlotPlan> slots;
  int64_t arena_bytes = 0;
  c10::Device arena_device = dev;
  const Value& arena = member(p, "arena", fmt);
  if (!arena.is_null()) {
    const std::string where = "program: arena";
    if (!arena.is_object()) {
      fail(where + ": malformed");
    }
    arena_bytes = integer(member(arena, "nbytes", where), where, 0, int64_t{1} << 50);
    arena_device = device(string(member(arena, "device", where), where), where);
    for (const Value& s : array(arena, "slots", where).a) {
      if (!s.is_array() || s.a.size() != 5) {
        fail(where + ": malformed slot");
      }
      SlotPlan slot{
          integer(s.a[0], where, 0, arena_bytes), integer(s.a[1], where, 0, arena_bytes),
          ints(s.a[2], where, 0, int64_t{1} << 50), ints(s.a[3], where, 0, int64_t{1} << 50),
          dtype(s.a[4], where)};
      int64_t end = extent(slot.shape, slot.stride, 0);
      int64_t bytes = 0;
      if (slot.shape.size() != slot.stride.size() || slot.shape.size() > kMaxDims || end < 0 ||
          __builtin_mul_overflow(end, static_cast<int64_t>(c10::elementSize(slot.dtype)), &bytes) ||
          bytes > slot.nbytes || slot.offset + slot.nbytes > arena_bytes) {
        fail(where + ": slot " + std::to_string(slots.size()) + " lies outside the arena");
      }
      slots.push_back(std::move(slot));
    }
  }

  const std::vector<Value>& code = array(p, "code", fmt).a;
  where.reserve(code.size());
  for (size_t pc = 0; pc < code.size(); ++pc) {
    const Value& ins = code[pc];
    std::string at = "program: instruction " + std::to_string(pc);
    if (!ins.is_object()) {
      fail(at + ": malformed");
    }
    const std::string& kind = string(member(ins, "kind", at), at + ": kind");
    if (kind == "FREE") {
      std::vector<int64_t> freed = ints(array(ins, "regs", at), at, 0, n_regs - 1);
      for (int64_t r : freed) {
        regs.undefine(r);
      }
      exec->add_free(freed);
      where.emplace_back("FREE");
      continue;
    }
    int64_t node = integer(member(ins, "node", at), at + ": node", 0,
                           static_cast<int64_t>(nodes.a.size()) - 1);
    const std::string& node_name = nodes.a[static_cast<size_t>(node)].s;
    at += " (node " + clip(node_name) + ")";
    if (kind == "STREAM" || kind == "RECORD" || kind == "WAIT") {
      throw PackageError(
          "fxrt package: node " + clip(node_name) +
          " switches streams; the C++ runtime runs single-stream programs only (fxrt.load runs "
          "this package)");
    }
    std::vector<int64_t> outputs = ints(array(ins, "outputs", at), at + ": outputs", 0, n_regs - 1);
    if (outputs.empty()) {
      fail(at + ": no outputs");
    }
    const std::string& opname = string(member(ins, "op", at), at + ": op");
    if (kind == "PYCALL") {
      throw PackageError(
          "fxrt package: node " + clip(node_name) + " runs Python (" + clip(opname, 80) +
          "); the C++ runtime cannot run this package (python -m fxrt inspect lists such nodes)");
    }
    if (kind == "SYM") {
      SymOp sym;
      sym.kind = static_cast<SymOp::Kind>(sym_kind(opname, at));
      for (const Value& a : tuple_items(member(ins, "args", at), at)) {
        ListItem item;
        if (tag_of(a) == "ref") {
          item.reg = regs.use_ref(a.o[0].second, at);
        } else {
          item.value = IValue(integer(a, at + ": operand", INT64_MIN, INT64_MAX));
        }
        sym.args.push_back(std::move(item));
      }
      if (sym.args.size() != (sym.kind == SymOp::Kind::NEG ? 1u : 2u) || outputs.size() != 1) {
        fail(at + ": wrong number of operands");
      }
      sym.output = outputs[0];
      exec->add_sym_op(std::move(sym));
      regs.define(outputs[0]);
      where.push_back("node " + node_name + " (" + opname + ")");
      continue;
    }
    bool multi = boolean(member(ins, "multi", at), at + ": multi");
    CallOp call = bind_call(
        op(member(ins, "op", at), at), member(ins, "args", at), member(ins, "kwargs", at), outputs,
        multi, regs, at);
    if (kind == "CALL") {
      exec->add_call_op(std::move(call));
    } else if (kind == "OUT") {
      if (multi) {
        fail(at + ": an OUT has one output");
      }
      int64_t slot = integer(member(ins, "slot", at), at + ": slot", 0,
                             static_cast<int64_t>(slots.size()) - 1);
      regs.allow(outputs[0]);
      CallOp out = bind_call(
          op(member(ins, "out_op", at), at), member(ins, "out_args", at),
          member(ins, "out_kwargs", at), outputs, false, regs, at + ": out= form");
      regs.allow(-1);
      exec->add_out_op({std::move(call), std::move(out), slot});
    } else if (kind == "ALLOC") {
      int64_t slot = integer(member(ins, "slot", at), at + ": slot", -1,
                             static_cast<int64_t>(slots.size()) - 1);
      AllocOp alloc{std::move(call), slot, std::nullopt};
      if (boolean(member(ins, "cpu", at), at + ": cpu")) {
        const auto& a = alloc.call.args;
        if (opname != "aten::empty_strided" || !bind_cpu_empty(alloc) ||
            !(a[3].value.isNone() || (a[3].value.isDevice() && a[3].value.toDevice().is_cpu())) ||
            !(a[4].value.isNone() || !a[4].value.toBool())) {
          fail(at + ": a cpu ALLOC that is not a constant CPU empty_strided");
        }
      }
      exec->add_alloc_op(std::move(alloc));
    } else if (kind == "VIEW") {
      if (multi || call.args.empty() || call.args[0].kind != BoundArg::REG) {
        fail(at + ": the view's input is not a register");
      }
      ViewOp view{std::move(call)};
      view.kind = static_cast<ViewOp::Kind>(
          view_kind(string(member(ins, "view", at), at), at));
      view.always = boolean(member(ins, "always", at), at + ": always");
      view.self = view.call.args[0].reg;
      view.ints = ints(member(ins, "ints", at), at + ": ints", INT64_MIN / 4, INT64_MAX / 4);
      view.strides = ints(member(ins, "strides", at), at + ": strides", INT64_MIN / 4, INT64_MAX / 4);
      view.offset = integer(member(ins, "offset", at), at + ": offset", INT64_MIN / 4, INT64_MAX / 4);
      exec->add_view_op(std::move(view));
    } else {
      fail(at + ": unknown instruction kind \"" + clip(kind, 20) + "\"");
    }
    for (int64_t r : outputs) {
      regs.define(r);
    }
    where.push_back("node " + node_name + " (" + opname + ")");
  }

  // Guards: the input specs and what the arena needs.
  const Value& guards = object(p, "guards", fmt);
  std::vector<InputSpec> specs;
  for (const Value& s : array(guards, "inputs", "program: guards").a) {
    const std::string at = "program: input spec";
    if (!s.is_array() || s.a.size() != 5) {
      fail(at + ": malformed");
    }
    int64_t pos = integer(s.a[0], at, 0, static_cast<int64_t>(input_regs.size()) - 1);
    InputSpec spec{
        static_cast<size_t>(input_regs[static_cast<size_t>(pos)]), dtype(s.a[1], at),
        device(string(s.a[2], at), at), ints(s.a[3], at, -2 - kMaxDims, int64_t{1} << 62),
        ints(s.a[4], at, -2 - kMaxDims, int64_t{1} << 62)};
    if (spec.sizes.size() != spec.strides.size() || spec.sizes.size() > kMaxDims) {
      fail(at + ": malformed");
    }
    // Strides -2 - k (dense in an order): all of them, a permutation of the dimensions.
    std::vector<bool> seen(spec.strides.size(), false);
    size_t codes = 0;
    for (int64_t st : spec.strides) {
      if (st < -1) {
        size_t k = static_cast<size_t>(-2 - st);
        if (k >= seen.size() || seen[k]) {
          fail(at + ": malformed dense strides");
        }
        seen[k] = true;
        ++codes;
      }
    }
    if (codes != 0 && codes != spec.strides.size()) {
      fail(at + ": malformed dense strides");
    }
    this->specs.emplace_back(pos, spec);
    specs.push_back(std::move(spec));
  }
  std::vector<ArenaInput> arena_inputs;
  for (const Value& s : array(guards, "arena_inputs", "program: guards").a) {
    const std::string at = "program: arena input";
    if (!s.is_array() || s.a.size() != 3) {
      fail(at + ": malformed");
    }
    int64_t pos = integer(s.a[0], at, 0, static_cast<int64_t>(input_regs.size()) - 1);
    arena_inputs.push_back({static_cast<size_t>(input_regs[static_cast<size_t>(pos)]),
                            ints(s.a[1], at, 0, int64_t{1} << 62), dtype(s.a[2], at)});
  }
  exec->set_guards(
      std::move(specs), std::move(arena_inputs),
      boolean(member(guards, "constants_need_grad", "program: guards"), "constants_need_grad"));
  if (!arena.is_null()) {
    exec->set_arena_factory(
        [slots, arena_bytes, arena_device]() {
          c10::Storage buffer =
              at::empty({arena_bytes}, at::TensorOptions().dtype(at::kByte).device(arena_device))
                  .storage();
          auto made = std::make_unique<Arena>();
          for (const SlotPlan& s : slots) {
            // A storage of its own over the slot's bytes, not resizable (as ArenaPlan.allocate).
            auto* keep = new c10::Storage(buffer);
            c10::DataPtr ptr(
                static_cast<uint8_t*>(buffer.mutable_data()) + s.offset, keep,
                [](void* ctx) { delete static_cast<c10::Storage*>(ctx); }, arena_device);
            c10::Storage storage(
                c10::Storage::use_byte_size_t(), s.nbytes, std::move(ptr), nullptr, false);
            at::Tensor t = at::empty({0}, at::TensorOptions().dtype(s.dtype).device(arena_device));
            t.set_(storage, 0, s.shape, s.stride);
            made->push_back(std::move(t));
          }
          return made;
        },
        2, arena_device.type());
  }

  // The output: a tuple of registers (and constants), one per signature output.
  const Value& output = member(p, "output", fmt);
  std::vector<const Value*> leaves;
  if (is_sequence(output)) {
    for (const Value& x : output.o[0].second.a) {
      leaves.push_back(&x);
    }
  } else {
    leaves.push_back(&output);
  }
  for (const Value* leaf : leaves) {
    Out o;
    if (tag_of(*leaf) == "ref") {
      o.reg = regs.use_ref(leaf->o[0].second, "program: output");
    } else {
      o.value = plain_constant(*leaf, "program: output");
    }
    outs.push_back(std::move(o));
  }
}

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
      auto it = weights.find(w);
      if (it == weights.end()) {
        fail(where + " names an unknown weight \"" + clip(w) + "\"");
      }
      src.value = it->second;
    } else if (kind == "constant") {
      src.value = plain_constant(member(s, "value", where), where);
    } else if (kind == "tensor") {
      UserInput u;
      u.info.name = name;
      u.info.path = string(member(s, "path", where), where);
      u.label = where + " (" + clip(u.info.path) + ")";
      u.info.dtype = short_dtype(member(s, "dtype", where), where);
      u.device = device(string(member(s, "device", where), where), where);
      const Value& shape = array(s, "shape", where);
      if (shape.a.size() > static_cast<size_t>(kMaxDims)) {
        fail(where + ": too many dims");
      }
      for (const Value& d : shape.a) {
        int sym = -1;
        if (d.is_int()) {
          int64_t n = integer(d, where, 0, INT64_MAX);
          u.info.sizes.push_back(n);
          u.info.min_sizes.push_back(n);
          u.info.max_sizes.push_back(n);
          u.fixed.push_back(true);
        } else {
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
        }
        u.symbol.push_back(sym);
      }
      src.kind = 1;
      src.index = users.size();
      user_of[name] = users.size();
      infos.push_back(u.info);
      users.push_back(std::move(u));
    } else {
      throw PackageError(
          "fxrt package: " + where + " is a " + clip(kind, 20) +
          "; the C++ runtime takes tensor inputs only");
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
      outs[i].kind = 0;
      ++n_user_outputs;
    } else if (kind == "buffer_mutation") {
      const std::string& target = string(member(o, "target", where), where);
      auto it = weights.find(target);
      if (it == weights.end()) {
        fail(where + " mutates an unknown buffer \"" + clip(target) + "\"");
      }
      outs[i].kind = 1;
      outs[i].target = it->second;
    } else if (kind == "input_mutation") {
      const std::string& target = string(member(o, "target", where), where);
      auto it = user_of.find(target);
      if (it == user_of.end()) {
        fail(where + " mutates an unknown input \"" + clip(target) + "\"");
      }
      outs[i].kind = 2;
      outs[i].user = it->second;
    } else {
      fail(where + ": unknown kind");
    }
  }
}

void Model::Impl::input_error(const UserInput& u, const std::string& why) const {
  std::ostringstream s;
  s << "fxrt: " << u.label << ": " << why << "; exported for " << c10::toString(u.info.dtype)
    << "[";
  size_t k = 0;
  for (size_t d = 0; d < u.info.sizes.size(); ++d) {
    s << (d ? ", " : "");
    if (u.symbol[d] >= 0) {
      const Symbol& sym = symbols[static_cast<size_t>(u.symbol[d])];
      s << sym.name << " in [" << sym.lo << ", " << (sym.hi < 0 ? "inf" : std::to_string(sym.hi))
        << "]";
    } else if (u.fixed[d]) {
      s << u.info.sizes[d];
    } else {
      while (k < u.derived.size() && u.derived[k].first < d) {
        ++k;
      }
      s << (k < u.derived.size() && u.derived[k].first == d ? u.derived[k].second : "?");
    }
  }
  s << "]";
  throw InputError(s.str());
}

void Model::Impl::check_user_inputs(const std::vector<at::Tensor>& inputs) const {
  if (inputs.size() != users.size()) {
    throw InputError(
        "fxrt: the model takes " + std::to_string(users.size()) + " tensor inputs, got " +
        std::to_string(inputs.size()));
  }
  std::vector<int64_t> bound(symbols.size(), -1);
  bool derived = false;
  for (size_t k = 0; k < users.size(); ++k) {
    const UserInput& u = users[k];
    const at::Tensor& x = inputs[k];
    derived = derived || !u.derived.empty();
    if (!x.defined()) {
      input_error(u, "expected a tensor, got an undefined one");
    }
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
        const Symbol& sym = symbols[static_cast<size_t>(u.symbol[d])];
        if (got < sym.lo || (sym.hi >= 0 && got > sym.hi)) {
          input_error(
              u, "dim " + std::to_string(d) + ": size " + std::to_string(got) + " outside " +
                  sym.name + "'s range");
        }
        int64_t& b = bound[static_cast<size_t>(u.symbol[d])];
        if (b >= 0 && b != got) {
          input_error(
              u, "dim " + std::to_string(d) + ": size " + std::to_string(got) + ", but " +
                  sym.name + " is " + std::to_string(b) + " in an earlier input");
        }
        b = got;
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
    for (const auto& [d, expr] : users[k].derived) {
      std::optional<int64_t> want = SizeExpr(expr, env).eval();
      int64_t got = inputs[k].size(static_cast<int64_t>(d));
      auto range = derived_ranges.find(expr);
      if (range != derived_ranges.end() &&
          (got < range->second.first || (range->second.second >= 0 && got > range->second.second))) {
        input_error(
            users[k], "dim " + std::to_string(d) + ": size " + std::to_string(got) + " outside " +
                expr + "'s range");
      }
      if (want.has_value() && got != *want) {
        input_error(
            users[k], "dim " + std::to_string(d) + ": size " + std::to_string(got) +
                ", expected " + expr + " = " + std::to_string(*want));
      }
    }
  }
}

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

// ---------------------------------------------------------------------------------------------

Model::Model(const std::string& path, LoadOptions options) : impl_(std::make_unique<Impl>()) {
  RawPackage raw = read_package(path, options.verify_weights);
  Impl& m = *impl_;
  m.file = raw.file;
  const Value& manifest = raw.manifest;
  if (!manifest.is_object()) {
    fail("the manifest is not an object");
  }
  const Value* module = manifest.find("module");
  m.module = module != nullptr && module->is_string() ? clip(module->s, 200) : "?";
  const Value* program = manifest.find("program");
  if (program == nullptr || program->is_null()) {
    const Value* info = manifest.find("info");
    const Value* why = info != nullptr ? info->find("cpp") : nullptr;
    throw PackageError(
        "fxrt package: it stores no program for the C++ runtime (" +
        (why != nullptr && why->is_string() ? clip(why->s, 300)
                                           : std::string("made by an older fxrt; export it again")) +
        ")");
  }
  if (!program->is_object()) {
    fail("program must be an object");
  }
  c10::Device dev = device(string(member(manifest, "device", "manifest"), "device"), "device");
  m.check_ops(object(manifest, "ops", "manifest"), object(manifest, "producer", "manifest"));
  m.load_weights(raw, object(manifest, "weights", "manifest"), dev);
  m.load_program(raw, manifest, *program, dev);
  m.load_signature(object(manifest, "signature", "manifest"));
}

Model::~Model() = default;
Model::Model(Model&&) noexcept = default;
Model& Model::operator=(Model&&) noexcept = default;

std::vector<at::Tensor> Model::run(const std::vector<at::Tensor>& inputs) const {
  const Impl& m = *impl_;
  m.check_user_inputs(inputs);
  Registers regs = m.exec->registers();
  for (size_t i = 0; i < m.sources.size(); ++i) {
    const Impl::Source& s = m.sources[i];
    regs[static_cast<size_t>(m.input_regs[i])] = s.kind == 1 ? IValue(inputs[s.index]) : s.value;
  }
  if (!m.exec->inputs_ok(regs)) {
    m.mismatch(regs);
  }
  Failure failure;
  GilState gil(false);
  try {
    m.exec->execute<false, false>(regs, NoForms{}, gil, failure, nullptr, false);
  } catch (const c10::Error& e) {
    std::string at = failure.pc >= 0 && static_cast<size_t>(failure.pc) < m.where.size()
        ? m.where[static_cast<size_t>(failure.pc)]
        : "the program";
    throw RunError("fxrt: " + at + " failed: " + e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::string at = failure.pc >= 0 && static_cast<size_t>(failure.pc) < m.where.size()
        ? m.where[static_cast<size_t>(failure.pc)]
        : "the program";
    throw RunError("fxrt: " + at + " failed: " + e.what());
  }
  std::vector<at::Tensor> out;
  out.reserve(m.n_user_outputs);
  for (const Impl::Out& o : m.outs) {
    const IValue& v = o.reg >= 0 ? regs[static_cast<size_t>(o.reg)] : o.value;
    if (o.kind == 0) {
      if (v.isTensor()) {
        out.push_back(v.toTensor());
      } else if (v.isNone()) {
        out.emplace_back();
      } else {
        throw RunError(std::string("fxrt: an output is a ") + v.tagKind() + ", not a tensor");
      }
    } else if (v.isTensor()) {
      (o.kind == 1 ? o.target : inputs[o.user]).copy_(v.toTensor());
    }
  }
  return out;
}

const std::vector<InputInfo>& Model::inputs() const {
  return impl_->infos;
}

size_t Model::num_outputs() const {
  return impl_->n_user_outputs;
}

const std::string& Model::module_name() const {
  return impl_->module;
}

size_t Model::num_instructions() const {
  return impl_->exec->size();
}

}  // namespace fxrt
