// fxrt::Model's state, shared by its translation units: model.cpp (loading the ops; run),
// program.cpp (the program), inputs.cpp (the signature and the per-call input checks) and
// weights.cpp (the weights and graph constants, device retargeting and update_weights).
//
// Everything here is immutable after the constructor except the weight set, which
// update_weights() replaces as a whole: `current` holds a shared_ptr to an immutable WeightSet,
// each run() takes one reference to it for the whole call (so a call never mixes two sets), and
// an update builds the next set beside it and publishes it with one atomic store.

#pragma once

#include "fxrt/model.h"

#include "json.h"
#include "package.h"

#include "loop.h"

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace fxrt {

// A size symbol of the signature ("s0"), named in messages as "batch (s0)" when it came from a
// torch.export.Dim.
struct Symbol {
  std::string raw;
  std::string name;
  int64_t lo = 0, hi = -1;  // hi -1: unbounded
};

bool is_symbol(const std::string& s);

// The signature's fields and types, as fxrt.deploy.signature reads them (signature.cpp); throws
// PackageError.
void check_signature(const json::Value& sig);

// One immutable set of weights: a tensor per weight id (tied ids hold the same tensor).
struct WeightSet {
  std::vector<at::Tensor> tensors;
};

struct Model::Impl {
  std::shared_ptr<MappedFile> file;
  std::string_view manifest_text;  // in `file` (its pages given back after the load)
  std::map<std::string, std::string, std::less<>> small_fields;  // their text, kept
  std::string module;
  c10::Device device{c10::kCPU};
  bool cross_type = false;  // running on another device type than the export's: no arena
  bool use_arena = true;  // the program's arena, if it has one (not across device types)
  int64_t arena_max_idle = 2;
  bool check_inputs = true;  // the inputs checked on every call (the count always is)
  bool host = false;  // LoadOptions::host_executor
  std::string unsupported;  // with `host`: why run() cannot run the package (empty: it can)
  std::map<std::string, Entry, std::less<>> entries;  // the weights section, for the host
  uint64_t data_start = 0;
  std::unique_ptr<Executor> exec;  // null: no stored program (a host's only)
  std::vector<int64_t> input_regs;

  // ---- weights (weights.cpp)
  std::vector<std::string> weight_names;  // per weight id
  std::vector<std::string> weight_kinds;  // "parameter", "buffer", ...
  std::unordered_map<std::string, size_t> weight_id;
  std::vector<size_t> group_of;  // per weight id: its tie group (names that are one tensor)
  std::vector<std::vector<size_t>> groups;
  std::atomic<std::shared_ptr<const WeightSet>> current;
  std::mutex update_mutex;  // one update_weights at a time

  // ---- graph inputs and outputs
  struct Source {
    enum Kind { VALUE, USER, WEIGHT } kind = VALUE;
    size_t index = 0;  // USER: the user input; WEIGHT: the weight id
    IValue value;  // VALUE: a constant the export specialized on
  };
  std::vector<Source> sources;  // per graph input

  struct UserInput {
    InputInfo info;
    std::string label;  // "input 'x' (args[0])"
    c10::Device device{c10::kCPU};
    std::vector<int> symbol;  // per dim (an int: one entry): index into symbols, or -1
    std::vector<bool> fixed;  // per dim: a static size
    std::vector<std::pair<size_t, std::string>> derived;  // dim (an int: 0), size expression
    std::string exported;  // what it was exported for, as messages say it ("float32[s0, 8] with ...")
  };
  std::vector<UserInput> users;
  size_t n_int_users = 0;
  std::vector<Symbol> symbols;
  std::map<std::string, std::pair<int64_t, int64_t>> derived_ranges;  // expression -> lo, hi

  struct Out {
    enum Kind { USER, WEIGHT_MUTATION, INPUT_MUTATION } kind = USER;
    int64_t reg = -1;
    IValue value;  // when reg < 0
    size_t target = 0;  // WEIGHT_MUTATION: the weight id; INPUT_MUTATION: the user input
  };
  std::vector<Out> outs;
  size_t n_user_outputs = 0;
  std::vector<std::string> where;  // per pc: "node <name> (<op>)"
  std::vector<InputInfo> infos;
  std::vector<std::pair<int64_t, InputSpec>> specs;  // graph input position, spec: for errors
  std::vector<std::string> input_names;  // per graph input

  std::unordered_map<std::string, c10::OperatorHandle> ops;

  // model.cpp (ops, run) and program.cpp (load_program)
  // What this runtime cannot run (`why`): Unsupported, or with `host` noted for run().
  void unrunnable(const std::string& why);
  void check_ops(const json::Value& table, const json::Value& producer);
  std::vector<IValue> graph_constants(
      const RawPackage& raw,
      const json::Value& graph,
      int64_t n_regs,
      std::vector<int64_t>& regs_out);
  void load_program(const RawPackage& raw, const json::Value& manifest, const json::Value& program);
  const c10::OperatorHandle& op(const json::Value& name, const std::string& where) const;
  Registers execute(Registers regs) const;
  template <class T, class Emit>
  void call(const std::vector<T>& inputs, Emit emit, const HostExecutor* host = nullptr) const;

  // weights.cpp
  void load_weights(const RawPackage& raw, const json::Value& records);
  size_t mapped(const WeightSet& set) const;
  void check_weights(const RawPackage& raw, const json::Value& manifest) const;

  // inputs.cpp
  void load_signature(const json::Value& sig);
  template <class T>
  void check_user_inputs(const std::vector<T>& inputs) const;
  [[noreturn]] void input_error(
      const UserInput& u, const std::string& why, const at::Tensor* got = nullptr) const;
  [[noreturn]] void mismatch(const Registers& regs) const;
};

// The device a LoadOptions::device names, as tensors made there report it ("cuda" -> "cuda:0");
// std::invalid_argument when this process cannot make tensors there.
c10::Device resolve_device(const c10::Device& device);

// Every device of `doc` (a manifest's program, graph or signature) that is `from` (or of its type
// without an index) replaced by `to`, as fxrt.deploy.loaded retargets a graph for fxrt.load's
// device=: "device" members of objects, and the device of each guarded input.
void retarget(json::Value& doc, const c10::Device& from, const c10::Device& to);

}  // namespace fxrt
