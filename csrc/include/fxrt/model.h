// fxrt's C++ runtime: runs a package written by fxrt.export(...).save(path) without Python.
//
//   fxrt::Model m("model.fxrt");
//   std::vector<at::Tensor> out = m.run({x});
//
// The Model loads the package's lowered program (validated in full: every op looked up by name
// and its schema compared, every register and slot bounds-checked, every argument bound to its
// schema) onto the compiled loop the Python extension runs (fxrt/_speedups/loop.h), with the
// weights memory-mapped from the file. run() is thread-safe. Errors are exceptions:
// PackageError (a file that is not a valid package, or one this runtime cannot run), InputError
// (inputs the package was not exported for, naming the input) and RunError (an op failed,
// naming the node).

#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace fxrt {

class PackageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class InputError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

class RunError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// What a tensor input of the model takes: dtype, device and sizes ("s0"-style symbols for
// dynamic dims, with their range).
struct InputInfo {
  std::string name;
  std::string path;  // where it is in the exported call's arguments (e.g. "args[0]")
  at::ScalarType dtype;
  std::vector<int64_t> sizes;  // -1 for a dynamic dim
  std::vector<int64_t> min_sizes, max_sizes;  // the range of each dim (max -1: unbounded)
};

struct LoadOptions {
  bool verify_weights = true;  // check the SHA-256 of the weight bytes (reads all of them)
};

class Model {
 public:
  explicit Model(const std::string& path, LoadOptions options = {});
  ~Model();
  Model(Model&&) noexcept;
  Model& operator=(Model&&) noexcept;
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  // Runs the model on its tensor inputs (the exported call's tensor leaves, in order); returns
  // its outputs (the exported output's leaves, in order). Thread-safe.
  std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs) const;

  const std::vector<InputInfo>& inputs() const;
  size_t num_outputs() const;
  const std::string& module_name() const;
  size_t num_instructions() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace fxrt
