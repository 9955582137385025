// fxrt::Model: a package's stored program (fxrt/deploy/program_data.py) loaded onto the compiled
// loop (fxrt/_speedups/loop.h, built here with FXRT_NO_PYTHON).
//
// Loading trusts nothing in the file. read_package() checks the structure and hashes; then:
//
// 1. ops: every op of the manifest's table is looked up in the dispatcher by its qualified name
//    and its schema compared with the stored one (a package from another torch loads only if
//    they all agree, else the error names the op);
// 2. weights (weights.cpp): views of their entries in the mapped file, geometry checked against
//    the entry, on the load's device (the manifest's devices retargeted to it, as fxrt.load's
//    device= does); graph tensors (constants fxrt made): rebuilt from their entries, digests
//    checked;
// 3. the program: each instruction's kind, node, op (which must be in the checked table),
//    registers (in range, defined before they are read, not after a FREE), arena slots (in
//    range, inside the arena), and arguments, bound to the op's schema as the Python extension
//    binds them (positional, then keyword, then the schema's defaults; constants converted to the
//    schema's type). Anything else is a PackageError naming the instruction and its node. A
//    PYCALL (a node that runs Python) is refused, naming the node.
// 4. the signature (inputs.cpp): which graph input is a weight, a user tensor or int, or a
//    constant; which output is the user's or a buffer/input mutation to copy back.
//
// run() checks the inputs as the Python binder and loop do (naming the input), writes them and
// the current weight set into a fresh register file, and runs the Executor. decode.h reads the
// manifest's values, bind.h binds stored calls to their schemas.

#include "model_impl.h"

#include "bind.h"
#include "decode.h"
#include "sha256.h"

#include "own_ops.h"  // fxrt's own CPU ops, which graphs may call

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/Device.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <type_traits>
#include <utility>

namespace fxrt {

using json::clip;
using json::Value;
using namespace decode;

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

void Model::Impl::load_program(const RawPackage& raw, const Value& m, const Value& p) {
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
  c10::Device arena_device = device;
  const Value& arena = member(p, "arena", fmt);
  if (!arena.is_null()) {
    const std::string where = "program: arena";
    if (!arena.is_object()) {
      fail(where + ": malformed");
    }
    arena_bytes = integer(member(arena, "nbytes", where), where, 0, int64_t{1} << 50);
    arena_device = decode::device(string(member(arena, "device", where), where), where);
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
      // On another device type the fast CPU form does not apply (Python lowers without it).
      if (boolean(member(ins, "cpu", at), at + ": cpu") && !cross_type) {
        const auto& a = alloc.call.args;
        if (opname != "aten::empty_strided" || !bind_cpu_empty(alloc) ||
            !(a[3].value.isNone() || (a[3].value.isDevice() && a[3].value.toDevice().is_cpu())) ||
            !(a[4].value.isNone() || !a[4].value.toBool())) {
          fail(at + ": a cpu ALLOC that is not a constant CPU empty_strided");
        }
      }
      exec->add_alloc_op(std::move(alloc));
    } else if (kind == "VIEW") {
      if (call.args.empty() || call.args[0].kind != BoundArg::REG) {
        fail(at + ": the view's input is not a register");
      }
      ViewOp view{std::move(call)};
      view.kind = static_cast<ViewOp::Kind>(
          view_kind(string(member(ins, "view", at), at), at));
      if (multi != (view.kind == ViewOp::Kind::SPLIT)) {
        fail(at + ": only a split view has several outputs");
      }
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
        decode::device(string(s.a[2], at), at), ints(s.a[3], at, -2 - kMaxDims, int64_t{1} << 62),
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
    set_dense(spec);
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
  if (!arena.is_null() && !cross_type) {  // the plan and out= forms are the export device's
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

// ---------------------------------------------------------------------------------------------

Model::Model(const std::string& path, LoadOptions options) : impl_(std::make_unique<Impl>()) {
  RawPackage raw = read_package(path, options.verify_weights);
  Impl& m = *impl_;
  m.file = raw.file;
  Value& manifest = raw.manifest;
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
  c10::Device exported = decode::device(string(member(manifest, "device", "manifest"), "device"), "device");
  m.device = options.device.has_value() ? resolve_device(*options.device) : exported;
  if (m.device != exported) {
    // As fxrt.load(device=...): every device of the program, graph and signature that is the
    // export's becomes the load's.
    for (auto& [key, part] : manifest.o) {
      if (key == "program" || key == "graph" || key == "signature") {
        retarget(part, exported, m.device);
      }
    }
    m.cross_type = m.device.type() != exported.type();
  }
  m.check_ops(object(manifest, "ops", "manifest"), object(manifest, "producer", "manifest"));
  m.load_weights(raw, object(manifest, "weights", "manifest"));
  m.load_program(raw, manifest, *manifest.find("program"));
  m.load_signature(object(manifest, "signature", "manifest"));
}

Model::~Model() = default;
Model::Model(Model&&) noexcept = default;
Model& Model::operator=(Model&&) noexcept = default;

// The program on a register file whose inputs are written (and checked by the caller): the
// registers after it ran. An op's failure is a RunError naming its node.
Registers Model::Impl::execute(Registers regs) const {
  if (!exec->inputs_ok(regs)) {
    mismatch(regs);
  }
  Failure failure;
  GilState gil(false);
  try {
    exec->execute<false, false>(regs, NoForms{}, gil, failure, nullptr, false);
  } catch (const c10::Error& e) {
    std::string at = failure.pc >= 0 && static_cast<size_t>(failure.pc) < where.size()
        ? where[static_cast<size_t>(failure.pc)]
        : "the program";
    throw RunError("fxrt: " + at + " failed: " + e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::string at = failure.pc >= 0 && static_cast<size_t>(failure.pc) < where.size()
        ? where[static_cast<size_t>(failure.pc)]
        : "the program";
    throw RunError("fxrt: " + at + " failed: " + e.what());
  }
  return regs;
}

// One call: the inputs checked, written with the weight set current at its start (one reference
// for the whole call: an update_weights meanwhile does not mix in), the program run, the
// mutations copied back; `emit` gets each user output.
template <class T, class Emit>
void Model::Impl::call(const std::vector<T>& inputs, Emit emit) const {
  check_user_inputs(inputs);
  std::shared_ptr<const WeightSet> weights = current.load();
  Registers regs = exec->registers();
  for (size_t i = 0; i < sources.size(); ++i) {
    const Source& s = sources[i];
    IValue& r = regs[static_cast<size_t>(input_regs[i])];
    if (s.kind == Source::USER) {
      r = inputs[s.index];
    } else if (s.kind == Source::WEIGHT) {
      r = weights->tensors[s.index];
    } else {
      r = s.value;
    }
  }
  regs = execute(std::move(regs));
  size_t index = 0;
  for (const Out& o : outs) {
    const IValue& v = o.reg >= 0 ? regs[static_cast<size_t>(o.reg)] : o.value;
    if (o.kind == Out::USER) {
      emit(index++, v);
    } else if (!v.isTensor()) {
      continue;
    } else if (o.kind == Out::WEIGHT_MUTATION) {
      weights->tensors[o.target].copy_(v.toTensor());
    } else if constexpr (std::is_same_v<T, at::Tensor>) {
      inputs[o.target].copy_(v.toTensor());
    } else {
      inputs[o.target].toTensor().copy_(v.toTensor());
    }
  }
}

std::vector<at::Tensor> Model::run(const std::vector<at::Tensor>& inputs) const {
  const Impl& m = *impl_;
  if (m.n_int_users != 0) {
    for (const Impl::UserInput& u : m.users) {
      if (u.info.is_int) {
        throw InputError(
            "fxrt: " + u.label + " is an int: call run() with std::vector<c10::IValue> "
            "(tensors and ints)");
      }
    }
  }
  std::vector<at::Tensor> out;
  out.reserve(m.n_user_outputs);
  m.call(inputs, [&](size_t i, const IValue& v) {
    if (v.isTensor()) {
      out.push_back(v.toTensor());
    } else if (v.isNone()) {
      out.emplace_back();
    } else {
      throw RunError(
          "fxrt: output " + std::to_string(i) + " is a" + (v.isInt() ? "n " : " ") + v.tagKind() +
          ", not a tensor: call run() with std::vector<c10::IValue> to get it");
    }
  });
  return out;
}

std::vector<at::Tensor> Model::run(std::initializer_list<at::Tensor> inputs) const {
  return run(std::vector<at::Tensor>(inputs));
}

std::vector<IValue> Model::run(const std::vector<IValue>& inputs) const {
  const Impl& m = *impl_;
  std::vector<IValue> out;
  out.reserve(m.n_user_outputs);
  m.call(inputs, [&](size_t, const IValue& v) { out.push_back(v); });
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

c10::Device Model::device() const {
  return impl_->device;
}

}  // namespace fxrt
