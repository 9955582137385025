// The data of the compiled loop's instructions, one struct per kind of fxrt/exec/program.py:
// CallOp (CALL, and the plain form every other kind falls back to), OutOp (OUT), AllocOp
// (ALLOC), ViewOp (VIEW), SymOp (SYM) and PyCallOp (PYCALL, and every instruction's Python form).
// call.h binds and runs a CallOp, inline_ops.h the ALLOC and VIEW forms, sym.h the SYM steps,
// pycall.h the Python calls; loop.h switches on the kind.
//
// Built with FXRT_NO_PYTHON (the C++ runtime, csrc/), everything Python is left out: the GIL is a
// no-op, arguments have no Python form and there is no PyCallOp. The structs are otherwise the
// same, so both builds run the same loop.

#pragma once

#ifdef FXRT_NO_PYTHON
#include <ATen/core/ivalue.h>
#else
#include "convert.h"
#endif

#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace fxrt {

#ifdef FXRT_NO_PYTHON
using c10::IValue;
#endif
using Stack = std::vector<IValue>;
using Arena = std::vector<at::Tensor>;

#ifdef FXRT_NO_PYTHON
class GilState {  // no interpreter, no lock
 public:
  explicit GilState(bool) {}
  struct Worker {};
  explicit GilState(Worker) {}
  GilState(const GilState&) = delete;
  GilState& operator=(const GilState&) = delete;
  void release() {}
  void acquire() {}
};
#else
// The GIL, released while native instructions run (when enabled) and taken back on demand.
// On a thread that does not hold it (a stream worker, streams.h), the GIL starts released, is
// taken with PyGILState_Ensure and given back on release and at the end.
class GilState {
 public:
  explicit GilState(bool may_release) : may_release_(may_release) {}
  struct Worker {};
  explicit GilState(Worker) : may_release_(true), worker_(true) {}
  GilState(const GilState&) = delete;
  GilState& operator=(const GilState&) = delete;
  ~GilState() {
    if (worker_) {
      release();
    } else {
      acquire();
    }
  }

  void release() {
    if (worker_) {
      if (worker_holds_) {
        PyGILState_Release(worker_state_);
        worker_holds_ = false;
      }
    } else if (may_release_ && saved_ == nullptr) {
      saved_ = PyEval_SaveThread();
    }
  }
  void acquire() {
    if (worker_) {
      if (!worker_holds_) {
        worker_state_ = PyGILState_Ensure();
        worker_holds_ = true;
      }
    } else if (saved_ != nullptr) {
      PyEval_RestoreThread(saved_);
      saved_ = nullptr;
    }
  }

 private:
  bool may_release_;
  PyThreadState* saved_ = nullptr;
  bool worker_ = false;
  bool worker_holds_ = false;
  PyGILState_STATE worker_state_{};
};
#endif

// Which register values a REG argument passes to the op as they are.
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

struct ListItem {  // one element of a list literal: a register, or a constant when reg < 0
  int64_t reg = -1;
  IValue value;
};

// One schema argument of a bound call: how its boxed stack entry is made per call.
struct BoundArg {
  enum Kind : uint8_t { CONST, REG, TENSOR_LIST, OPT_TENSOR_LIST, INT_LIST, TREE };
  Kind kind = CONST;
  Accept accept = Accept::NEVER;
  bool optional = false;  // None is accepted too
  int64_t reg = -1;
  size_t position = 0;  // index in the schema's arguments, for the slow path
  IValue value;
  std::vector<ListItem> items;
#ifndef FXRT_NO_PYTHON
  std::optional<Tree> tree;  // the argument as the Program has it: the slow path's input
#endif
};

// CALL: an op through the dispatcher.
struct CallOp {
  c10::OperatorHandle op;
  std::vector<BoundArg> args;
  std::vector<int64_t> outputs;
  size_t n_returns = 0;
  bool multi = false;
  bool numbers_as_tensors = false;  // torch.ops lets Python numbers stand for Tensor arguments
};

// OUT's inline elementwise form (elementwise.h); `loop` null when it has none.
struct Elementwise {
  // o[i] = a[i] op b[i] over n elements; na, nb: the operands' element counts (n, or the length
  // of a row they repeat; nb 0: the number s instead of b).
  using Loop = void (*)(float* o, const float* a, const float* b, float s, int64_t n,
                        int64_t na, int64_t nb);
  Loop loop = nullptr;
  int64_t a = -1;  // register of the first operand
  int64_t b = -1;  // register of the second, or -1: the number `scalar`
  float scalar = 0.0f;
};

// OUT: with an arena, the result register gets slot `slot`'s tensor (a multi-result call's
// output k: slot `slot` + k) and `out` (the out= form, whose written arguments read those
// registers) writes it, or `elementwise` when it can; without an arena, `call`.
struct OutOp {
  CallOp call;
  CallOp out;
  int64_t slot = -1;
  Elementwise elementwise;
};

// ALLOC: with an arena and a slot, the slot's tensor is the result; else `cpu` (a constant CPU
// empty_strided made directly) when set; else `call`.
struct AllocOp {
  struct CpuEmpty {
    std::vector<int64_t> sizes, strides;
    std::optional<at::ScalarType> dtype;
  };
  CallOp call;
  int64_t slot = -1;
  std::optional<CpuEmpty> cpu;
};

// VIEW: a view made inline from the input register `self` (see inline_ops.h); `call` otherwise.
struct ViewOp {
  enum class Kind : uint8_t { VIEW, T, TRANSPOSE, PERMUTE, REINTERPRET, SPLIT };
  CallOp call;
  Kind kind = Kind::VIEW;
  bool always = false;  // on every call; else only on calls with an arena
  int64_t self = -1;
  std::vector<int64_t> ints, strides;  // sizes, dims, split's size and dim; reinterpret's strides
  int64_t offset = 0;  // reinterpret: added to the input's storage offset
};

#ifndef FXRT_NO_PYTHON
// PYCALL, and the Python form of every other kind (what a call __torch_function__ must see
// runs, and what a SYM step on non-integers runs).
struct PyCallOp {
  py::object fn;
  std::vector<Tree> args;
  py::object const_kwargs;  // a dict of the constant kwargs, or None when there are none
  std::vector<std::pair<py::object, Tree>> kwargs;  // kwargs that read registers
  std::vector<int64_t> outputs;
  bool multi = false;
};
#endif

// SYM: outputs = op(args) on int64, Python's semantics; `py` when an operand is not an int or
// the result would not fit.
struct SymOp {
  enum class Kind : uint8_t { ADD, SUB, MUL, FLOORDIV, MOD, NEG, EQ, NE, LT, LE, GT, GE, MAX, MIN };
  Kind kind = Kind::ADD;
  std::vector<ListItem> args;
  int64_t output = -1;
};

}  // namespace fxrt
