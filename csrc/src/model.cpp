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
// 3. the program (program.cpp): each instruction's kind, node, op (which must be in the checked table),
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

#ifndef FXRT_OWN_OPS_REGISTERED
#include "own_ops.h"  // fxrt's own CPU ops, which graphs may call (in Python: the extension's)
#endif

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/Device.h>
#include <c10/util/Exception.h>

#include <algorithm>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include <cctype>
#include <cstring>
#include <optional>
#include <type_traits>
#include <utility>

namespace fxrt {

using json::clip;
using json::Value;
using namespace decode;

namespace {

bool is_identifier(std::string_view s) {
  return !s.empty() && !std::isdigit(static_cast<unsigned char>(s[0])) &&
      std::all_of(s.begin(), s.end(), [](char c) {
        return std::isalnum(static_cast<unsigned char>(c)) || c == '_';
      });
}

// "ns::name" or "ns::name.overload", each part an identifier (as fxrt.serialize's resolve_op).
bool is_op_name(std::string_view s) {
  size_t sep = s.find("::");
  if (sep == std::string_view::npos) {
    return false;
  }
  std::string_view rest = s.substr(sep + 2);
  size_t dot = rest.find('.');
  return is_identifier(s.substr(0, sep)) && is_identifier(rest.substr(0, dot)) &&
      (dot == std::string_view::npos || is_identifier(rest.substr(dot + 1)));
}

}  // namespace

const c10::OperatorHandle& Model::Impl::op(const Value& name, const std::string& where) const {
  const std::string& s = string(name, where + ": op");
  auto it = ops.find(s);
  if (it == ops.end()) {
    fail(where + ": op " + clip(s) + " is not in the package's op table");
  }
  return it->second;
}

void Model::Impl::unrunnable(const std::string& why) {
  if (!host) {
    throw Unsupported(why);
  }
  if (unsupported.empty()) {
    unsupported = why;
  }
}

void Model::Impl::check_ops(const Value& table, const Value& producer) {
  const Value* torch = producer.find("torch");
  std::string made_by = torch != nullptr && torch->is_string() ? clip(torch->s, 40) : "?";
  for (const auto& [name, schema] : table.o) {
    if (!schema.is_string() || name.size() > 200) {
      fail("ops: malformed entry " + clip(name));
    }
    if (!is_op_name(name)) {
      fail("ops: " + clip(name, 80) + " is not an op name");
    }
    auto handle = c10::Dispatcher::singleton().findSchema(op_name(name));
    bool stream_op = false;
    for (const char* op : {"::scope_enter", "::scope_exit", "::record", "::wait"}) {
      stream_op = stream_op ||
          (!handle.has_value() && name.size() > std::strlen(op) &&
           name.compare(name.size() - std::strlen(op), std::string::npos, op) == 0 &&
           (name.rfind("fxrt::", 0) == 0 || name.rfind("air::", 0) == 0));
    }
    if (stream_op) {  // not registered here; a host resolves it when it decodes the graph
      unrunnable(
          "fxrt package: op " + clip(name, 200) +
          " switches streams; the C++ runtime runs single-stream programs only (fxrt.load runs "
          "this package)");
      continue;
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


// ---------------------------------------------------------------------------------------------

Model::Model() : impl_(std::make_unique<Impl>()) {}

Model::Model(const std::string& path, LoadOptions options) : Model() {
  load(read_package(path, options.verify_weights), options);
}

Model Model::from_bytes(const void* data, size_t size, LoadOptions options) {
  Model model;
  auto file = std::make_shared<MappedFile>(static_cast<const uint8_t*>(data), size);
  model.load(read_package(std::move(file), options.verify_weights), options);
  return model;
}

void Model::load(RawPackage raw, const LoadOptions& options) {
  Impl& m = *impl_;
  m.file = raw.file;
  m.manifest_text = raw.manifest_text;
  Value& manifest = raw.manifest;
  if (!manifest.is_object()) {
    fail("the manifest is not an object");
  }
  // The fields of fxrt.deploy.build's manifest, every one required but the program.
  static const char* const kFields[] = {
      "format", "producer", "module", "device", "options", "runtime_options", "graph", "ops",
      "signature", "weights", "info", "program"};
  size_t known = 0;
  bool complete = true;
  for (const char* f : kFields) {
    bool here = manifest.find(f) != nullptr;
    known += here ? 1 : 0;
    complete = complete && (here || std::string_view(f) == "program");
  }
  if (known != manifest.o.size() || !complete) {
    std::string names;
    for (const auto& [k, v] : manifest.o) {
      names += (names.empty() ? "'" : ", '") + clip(k, 40) + "'";
    }
    fail("manifest fields [" + names + "]");
  }
  const Value* module = manifest.find("module");
  m.module = module != nullptr && module->is_string() ? clip(module->s, 200) : "?";
  m.host = options.host_executor;
  const Value* program = manifest.find("program");
  if (program == nullptr || program->is_null()) {
    const Value* info = manifest.find("info");
    const Value* why = info != nullptr ? info->find("cpp") : nullptr;
    m.unrunnable(
        "fxrt package: it stores no program for the C++ runtime (" +
        (why != nullptr && why->is_string() ? clip(why->s, 300)
                                           : std::string("made by an older fxrt; export it again")) +
        ")");
  } else if (!program->is_object()) {
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
  // The options of fxrt.load the package defaults to (the stored program was lowered with them):
  // arena_max_idle and check_inputs are this runtime's defaults too, pure_python a host's.
  for (const auto& [key, v] : object(manifest, "runtime_options", "manifest").o) {
    if (key == "arena_max_idle") {
      m.arena_max_idle = integer(v, "runtime_options: arena_max_idle", 0, int64_t{1} << 20);
    } else if (key != "pure_python" && key != "arena" && key != "check_inputs") {
      fail("unknown runtime options [" + clip(key, 40) + "]");
    } else if (v.type != Value::BOOL) {
      fail("runtime_options: " + key + " must be a bool");
    } else if (key == "check_inputs") {
      m.check_inputs = v.b;
    }
  }
  m.arena_max_idle = options.arena_max_idle.value_or(m.arena_max_idle);
  if (m.arena_max_idle < 0) {
    throw std::invalid_argument("fxrt: LoadOptions::arena_max_idle must be 0 or more");
  }
  m.use_arena = options.arena && !m.cross_type;
  m.check_inputs = options.check_inputs.value_or(m.check_inputs);
  m.check_ops(object(manifest, "ops", "manifest"), object(manifest, "producer", "manifest"));
  m.load_weights(raw, object(manifest, "weights", "manifest"));
  if (program != nullptr && program->is_object()) {
    m.load_program(raw, manifest, *program);
  } else {  // a host's: the graph's inputs and outputs are the signature's
    const Value& sig = object(manifest, "signature", "manifest");
    m.input_regs.assign(array(sig, "inputs", "signature").a.size(), -1);
    m.outs.resize(array(sig, "outputs", "signature").a.size());
  }
  m.load_signature(object(manifest, "signature", "manifest"));
  m.check_weights(raw, manifest);
  // The prelude, manifest and weights header are parsed: their pages leave the process (the
  // weights are the pages after them), and the memory the parse took goes back to the system.
  // The small fields a host reads after the load are kept as text.
  for (const char* key : {"signature", "runtime_options", "module", "device", "producer"}) {
    m.small_fields.emplace(key, json::member_text(m.manifest_text, key));
  }
  if (m.host) {
    m.entries.insert(raw.entries.begin(), raw.entries.end());
    m.data_start = raw.data_start;
  }
  raw.file->release_before(static_cast<size_t>(raw.data_start));
  raw.manifest = Value();
#if defined(__GLIBC__)
  ::malloc_trim(0);
#endif
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
  } catch (const std::exception& e) {
    std::string at = failure.pc >= 0 && static_cast<size_t>(failure.pc) < where.size()
        ? where[static_cast<size_t>(failure.pc)]
        : "the program";
    const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
    RunError::Cause cause = dynamic_cast<const c10::IndexError*>(&e) ? RunError::INDEX
        : dynamic_cast<const c10::ValueError*>(&e)                  ? RunError::VALUE
        : dynamic_cast<const c10::TypeError*>(&e)                   ? RunError::TYPE
        : dynamic_cast<const c10::NotImplementedError*>(&e)         ? RunError::NOT_IMPLEMENTED
        : dynamic_cast<const c10::OutOfMemoryError*>(&e) || dynamic_cast<const std::bad_alloc*>(&e)
        ? RunError::OUT_OF_MEMORY
        : RunError::OTHER;
    throw RunError(
        "fxrt: " + at + " failed: " + (c10_error ? c10_error->what_without_backtrace() : e.what()),
        cause);
  }
  return regs;
}

// One call: the inputs checked, written with the weight set current at its start (one reference
// for the whole call: an update_weights meanwhile does not mix in), the program run, the
// mutations copied back; `emit` gets each user output.
template <class T, class Emit>
void Model::Impl::call(const std::vector<T>& inputs, Emit emit, const HostExecutor* host) const {
  if (host == nullptr && !unsupported.empty()) {
    throw Unsupported(unsupported);
  }
  check_user_inputs(inputs);
  std::shared_ptr<const WeightSet> weights = current.load();
  auto input = [&](const Source& s) -> IValue {
    if (s.kind == Source::USER) {
      return inputs[s.index];
    }
    return s.kind == Source::WEIGHT ? IValue(weights->tensors[s.index]) : s.value;
  };
  Registers regs;
  std::vector<IValue> results;
  if (host == nullptr) {
    regs = exec->registers();
    for (size_t i = 0; i < sources.size(); ++i) {
      regs[static_cast<size_t>(input_regs[i])] = input(sources[i]);
    }
    regs = execute(std::move(regs));
  } else {
    std::vector<IValue> graph_inputs;
    graph_inputs.reserve(sources.size());
    for (const Source& s : sources) {
      graph_inputs.push_back(input(s));
    }
    results = (*host)(std::move(graph_inputs));
    if (results.size() != outs.size()) {
      throw RunError(
          "fxrt: the host's executor returned " + std::to_string(results.size()) +
          " outputs for the graph's " + std::to_string(outs.size()));
    }
  }
  size_t index = 0;
  for (size_t i = 0; i < outs.size(); ++i) {
    const Out& o = outs[i];
    const IValue& v = host != nullptr ? results[i]
        : o.reg >= 0                  ? regs[static_cast<size_t>(o.reg)]
                                      : o.value;
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

std::vector<IValue> Model::run_on(const std::vector<IValue>& inputs, const HostExecutor& host) const {
  const Impl& m = *impl_;
  std::vector<IValue> out;
  out.reserve(m.n_user_outputs);
  m.call(inputs, [&](size_t, const IValue& v) { out.push_back(v); }, &host);
  return out;
}

const std::string& Model::unsupported() const {
  return impl_->unsupported;
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
  return impl_->exec != nullptr ? impl_->exec->size() : 0;
}

c10::Device Model::device() const {
  return impl_->device;
}

size_t Model::idle_arenas() const {
  return impl_->exec != nullptr ? impl_->exec->idle_arenas() : 0;
}

std::string_view Model::manifest_json() const {
  return impl_->manifest_text;
}

std::string_view Model::manifest_field(std::string_view key) const {
  auto it = impl_->small_fields.find(key);
  return it != impl_->small_fields.end() ? std::string_view(it->second)
                                         : json::member_text(impl_->manifest_text, key);
}

std::string_view Model::entry_bytes(std::string_view name) const {
  auto it = impl_->entries.find(name);
  if (it == impl_->entries.end()) {
    return {};
  }
  const Entry& e = it->second;
  return {reinterpret_cast<const char*>(impl_->file->data() + impl_->data_start + e.begin),
          static_cast<size_t>(e.end - e.begin)};
}

}  // namespace fxrt
