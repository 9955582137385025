// fxrt::Model's program: a package's stored program (fxrt/deploy/program_data.py) checked
// instruction by instruction and built onto the compiled loop's Executor (step 3 of model.cpp's
// list): each instruction's kind, node, op, registers, arena slots and arguments, bound to the
// op's schema (bind.h). Anything else is a PackageError naming the instruction and its node.

#include "model_impl.h"

#include "bind.h"
#include "decode.h"


#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <c10/core/Device.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <utility>

namespace fxrt {

using json::clip;
using json::Value;
using namespace decode;

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
    // What this runtime does not run: a host runs the package (its graph, which it checks
    // against this program); the instruction's results count as written.
    auto host_runs = [&](const std::string& why, const std::vector<int64_t>& outputs) {
      unrunnable(why);
      for (int64_t r : outputs) {
        regs.define(r);
      }
      exec->add_python_op();
      where.push_back("node " + node_name);
    };
    if (kind == "STREAM" || kind == "RECORD" || kind == "WAIT") {
      const Value* made = ins.find("outputs");
      host_runs(
          "fxrt package: node " + clip(node_name) +
              " switches streams; the C++ runtime runs single-stream programs only (fxrt.load "
              "runs this package)",
          made != nullptr && made->is_array() ? ints(*made, at + ": outputs", 0, n_regs - 1)
                                              : std::vector<int64_t>{});
      continue;
    }
    std::vector<int64_t> outputs = ints(array(ins, "outputs", at), at + ": outputs", 0, n_regs - 1);
    if (outputs.empty()) {
      fail(at + ": no outputs");
    }
    const std::string& opname = string(member(ins, "op", at), at + ": op");
    if (kind == "PYCALL") {
      host_runs(
          "fxrt package: node " + clip(node_name) + " runs Python (" + clip(opname, 80) +
              "); the C++ runtime cannot run this package (python -m fxrt inspect lists such "
              "nodes)",
          outputs);
      continue;
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
      // Its results are the slots from `slot` on, one per output (bind_call checked them).
      const auto n_out = static_cast<int64_t>(outputs.size());
      int64_t slot = integer(member(ins, "slot", at), at + ": slot", 0,
                             static_cast<int64_t>(slots.size()) - n_out);
      regs.allow(outputs);
      CallOp out = bind_call(
          op(member(ins, "out_op", at), at), member(ins, "out_args", at),
          member(ins, "out_kwargs", at), outputs, multi, regs, at + ": out= form");
      regs.allow({});
      OutOp op{std::move(call), std::move(out), slot};
      if (const json::Value* form = ins.find("elementwise")) {
        std::string why;
        std::optional<Elementwise> e =
            bind_elementwise(op.out, string(*form, at + ": elementwise"), why);
        if (!e.has_value()) {
          fail(at + ": " + why);
        }
        op.elementwise = *e;
      }
      exec->add_out_op(std::move(op));
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
  if (!check_inputs) {
    specs.clear();  // this->specs stay: the weights are checked against them at load
  }
  exec->set_guards(
      std::move(specs), std::move(arena_inputs),
      boolean(member(guards, "constants_need_grad", "program: guards"), "constants_need_grad"));
  if (!arena.is_null() && use_arena) {  // the plan and out= forms are the export device's
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
        arena_max_idle, arena_device.type());
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

}  // namespace fxrt
