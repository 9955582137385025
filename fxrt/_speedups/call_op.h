// The data of a CALL instruction bound natively (call.h binds and runs it): the boxed argument
// slots, the CallOp with its optional arena and inline forms, and the GIL state the loop threads
// through calls.

#pragma once

#include "convert.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace fxrt {

using Stack = std::vector<IValue>;

// The GIL, released while native instructions run (when enabled) and taken back on demand.
class GilState {
 public:
  explicit GilState(bool may_release) : may_release_(may_release) {}
  GilState(const GilState&) = delete;
  GilState& operator=(const GilState&) = delete;
  ~GilState() { acquire(); }

  void release() {
    if (may_release_ && saved_ == nullptr) {
      saved_ = PyEval_SaveThread();
    }
  }
  void acquire() {
    if (saved_ != nullptr) {
      PyEval_RestoreThread(saved_);
      saved_ = nullptr;
    }
  }

 private:
  bool may_release_;
  PyThreadState* saved_ = nullptr;
};

// Which register values a REG slot passes to the op as they are.
enum class Accept : uint8_t {
  TENSOR,
  INT,
  SYMINT,
  FLOAT,
  SYMFLOAT,
  BOOL,
  SYMBOOL,
  SCALAR,
  TENSOR_LIST,
  INT_LIST,
  NEVER,  // always convert through Python
};

struct Item {  // one element of a list literal: a register, or a constant when reg < 0
  int64_t reg = -1;
  IValue value;
};

struct Slot {
  enum Kind : uint8_t { CONST, REG, TENSOR_LIST, OPT_TENSOR_LIST, INT_LIST, TREE };
  Kind kind = CONST;
  Accept accept = Accept::NEVER;
  bool optional = false;  // None is accepted too
  int64_t reg = -1;
  size_t position = 0;  // index in the schema's arguments, for the slow path
  IValue value;
  std::vector<Item> items;
  std::optional<Tree> tree;  // the argument as the Program has it: the slow path's input
};

struct CallOp {
  c10::OperatorHandle op;
  std::vector<Slot> slots;
  std::vector<int64_t> outputs;
  size_t n_returns = 0;
  bool multi = false;
  bool numbers_as_tensors = false;  // torch.ops lets Python numbers stand for Tensor arguments
  int64_t arena_slot = -1;  // the result's arena slot, or -1
  std::shared_ptr<const CallOp> out_call;  // writes the slot; null: the slot is the result
  // fxrt::reinterpret_tensor with constant sizes, strides and offset: made inline.
  std::optional<std::vector<int64_t>> reinterpret_sizes, reinterpret_strides;
  int64_t reinterpret_offset = 0;
  // A view made inline on calls without autograd (fxrt/exec/arena.py: inline_views), with its
  // constant arguments: view's sizes or permute's dims in `view_ints`, transpose's dims.
  enum class View : uint8_t { NONE, VIEW, T, TRANSPOSE, PERMUTE } view = View::NONE;
  std::vector<int64_t> view_ints;
  int64_t view_dim0 = 0, view_dim1 = 0;
  // aten::empty_strided on the CPU with constant arguments: allocated inline.
  struct EmptyStrided {
    std::vector<int64_t> sizes, strides;
    std::optional<at::ScalarType> dtype;
    std::optional<at::Layout> layout;
    std::optional<at::Device> device;
    std::optional<bool> pin_memory;
  };
  std::optional<EmptyStrided> empty_strided;
};

using Arena = std::vector<at::Tensor>;

}  // namespace fxrt
