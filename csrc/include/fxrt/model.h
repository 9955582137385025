// fxrt's C++ runtime: runs a package written by fxrt.export(...).save(path) without Python.
//
//   fxrt::Model m("model.fxrt");
//   std::vector<at::Tensor> out = m.run({x});
//   std::vector<c10::IValue> out2 = m.run(std::vector<c10::IValue>{x, int64_t{5}});  // int inputs
//   m.update_weights(new_state_dict);
//
// The Model loads the package's lowered program (validated in full: every op looked up by name
// and its schema compared, every register and slot bounds-checked, every argument bound to its
// schema) onto the compiled loop the Python extension runs (fxrt/_speedups/loop.h), with the
// weights memory-mapped from the file. run() and update_weights() are thread-safe: a call runs
// on the weight set current when it started. Errors are exceptions: PackageError (a file that is
// not a valid package, or one this runtime cannot run), InputError (inputs the package was not
// exported for, naming the input), RunError (an op failed, naming the node) and
// std::invalid_argument (a device that is not available, weights that do not fit).

#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace fxrt {

class PackageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A valid package that this runtime cannot run: one that stores no program for it, switches
// streams, or calls Python. fxrt.load runs such packages (LoadOptions::host_executor); the message
// says why.
class Unsupported : public PackageError {
 public:
  using PackageError::PackageError;
};

class InputError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

class RunError : public std::runtime_error {
 public:
  // What the failed op raised (c10::IndexError, ...), for hosts that map it to their own types.
  enum Cause { OTHER = 0, INDEX = 1, VALUE = 2, TYPE = 3, NOT_IMPLEMENTED = 4, OUT_OF_MEMORY = 5 };
  explicit RunError(const std::string& what, Cause cause = OTHER)
      : std::runtime_error(what), cause(cause) {}
  Cause cause;
};

// What an input of the model takes: a tensor (dtype, device and sizes, with "s0"-style symbols
// for dynamic dims and their range) or an int (a Python int the export kept symbolic, with its
// range).
struct InputInfo {
  std::string name;
  std::string path;  // where it is in the exported call's arguments (e.g. "args[0]")
  bool is_int = false;  // an int input: dtype, sizes, min_sizes and max_sizes are unused
  at::ScalarType dtype = at::kLong;
  std::vector<int64_t> sizes;  // -1 for a dynamic dim
  std::vector<int64_t> min_sizes, max_sizes;  // the range of each dim (max -1: unbounded)
  int64_t min_value = 0, max_value = -1;  // an int input's range (max -1: unbounded)
};

struct LoadOptions {
  bool verify_weights = true;  // check the SHA-256 of the weight bytes (reads all of them)
  // Where the weights go and the program runs (default: the device the package was exported
  // on). On the CPU the weights stay memory-mapped from the file; elsewhere they are copied.
  // A device of another type than the export's runs the program without its arena (its slots
  // and out= choices were planned for the export device). Not available: std::invalid_argument.
  std::optional<c10::Device> device;
  // false: run without the arena (each result allocated, as on another device type), as
  // fxrt.load's options={"arena": False}.
  bool arena = true;
  // How many idle arenas to keep between calls (default: the package's runtime option, else 2).
  std::optional<int64_t> arena_max_idle;
  // false: the inputs are not checked (the package's runtime option check_inputs=False does the
  // same in Python): for callers that know every call matches what the package was exported for.
  // Default: the package's runtime option.
  std::optional<bool> check_inputs;
  // For a host that runs programs itself (fxrt.load's Python face): a valid package this runtime
  // cannot run loads anyway (validated, weights mapped) instead of throwing Unsupported; run()
  // throws Unsupported, Model::unsupported() says why, and run_on() runs it on the host's
  // executor.
  bool host_executor = false;
};

// A host's executor for Model::run_on(): the graph's inputs (user inputs, the current weights and
// the constants the export specialized on, in the graph's order) to the graph's outputs (in its
// order, mutated buffers and inputs included).
using HostExecutor = std::function<std::vector<c10::IValue>(std::vector<c10::IValue>)>;

// An input a host could not convert to a tensor or a number (a Python list where a tensor is
// expected), given to run() so that the input check names it: "expected a tensor, got a list".
c10::IValue foreign_value(const std::string& type_name);

struct RawPackage;  // the runtime's own (src/package.h)

class Model {
 public:
  explicit Model(const std::string& path, LoadOptions options = {});
  // A package given as its bytes (copied; the weights are views of the copy).
  static Model from_bytes(const void* data, size_t size, LoadOptions options = {});
  ~Model();
  Model(Model&&) noexcept;
  Model& operator=(Model&&) noexcept;
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  // Runs the model on its tensor inputs (the exported call's tensor leaves, in order; constants
  // the export specialized on are not passed); returns its outputs (the exported output's
  // leaves, in order; None is an undefined tensor). A model with int inputs, or int outputs,
  // takes the IValue overload. Thread-safe.
  std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs) const;
  std::vector<at::Tensor> run(std::initializer_list<at::Tensor> inputs) const;
  // The same for inputs that are tensors and ints (c10::IValue holding an at::Tensor or an
  // int64_t, in call order); outputs are tensors, ints or None.
  std::vector<c10::IValue> run(const std::vector<c10::IValue>& inputs) const;
  // A call as run() makes it (inputs checked, one weight set, mutations copied back), its graph
  // run by `host` instead of the runtime's loop. Thread-safe if `host` is.
  std::vector<c10::IValue> run_on(
      const std::vector<c10::IValue>& inputs,
      const HostExecutor& host) const;
  // Why run() cannot run this package (loaded with LoadOptions::host_executor); empty: it can.
  const std::string& unsupported() const;

  // Replaces weights by name without reloading, as Python's LoadedModel.update_weights: each
  // tensor must have the weight's shape and dtype (one on another device or with other strides
  // is copied to the package's; otherwise it is used as it is); names tied in the package (one
  // tensor) stay one tensor, and must not be given two different ones; with `strict`, every
  // parameter and persistent buffer must be given (one name of a tied group is enough) and no
  // unknown name. The new set is published atomically: calls already running finish on the old
  // weights, calls that start afterwards see the new ones. Thread-safe. Errors
  // (std::invalid_argument, naming the tensor) change nothing.
  void update_weights(
      const std::unordered_map<std::string, at::Tensor>& weights,
      bool strict = true);
  // The current weights by name (tied names map to one tensor).
  std::unordered_map<std::string, at::Tensor> state_dict() const;

  const std::vector<InputInfo>& inputs() const;  // the user inputs, in call order
  size_t num_outputs() const;
  const std::string& module_name() const;
  size_t num_instructions() const;
  c10::Device device() const;  // where the weights are and the program runs
  std::string_view manifest_json() const;  // the package's manifest (a view of the loaded file)
  // One top-level field of the manifest as JSON text ("signature"), empty if there is none.
  std::string_view manifest_field(std::string_view key) const;
  // The bytes of one entry of the weights section ("graph/<name>": a constant fxrt made, as its
  // graph records it), for a host that decodes the graph; empty if there is none.
  std::string_view entry_bytes(std::string_view name) const;
  // How many of the current weights are views of the memory-mapped file (all of them after a
  // load onto the CPU; fewer after update_weights or on another device).
  size_t mapped_weights() const;
  // How many arenas the model keeps idle between calls now (at most LoadOptions::arena_max_idle;
  // none without an arena).
  size_t idle_arenas() const;

 private:
  struct Impl;
  Model();
  void load(RawPackage raw, const LoadOptions& options);
  std::unique_ptr<Impl> impl_;
};

}  // namespace fxrt
