// The compiled loop: runs an fxrt Program (fxrt/exec/program.py) on a register file of
// c10::IValue, with the same semantics as the Python loop (fxrt/exec/interp.py).
//
// The Executor is built once, instruction by instruction in program order (so an instruction's
// index is the same as in the Program): CALLs bound natively (call.h), PYCALLs that call back into
// Python, FREEs. It is immutable afterwards, so any number of threads may run it at once.
//
// run() makes a fresh register file per call, preloads the Program's constants, converts the
// inputs, and walks the instructions with one reused stack: a CALL calls callBoxed, a PYCALL
// converts its registers to Python objects, calls the callable and converts the result back, a
// FREE resets registers. The GIL is released around runs of native instructions, as torch.ops
// does around each op, and taken back for fallbacks, slow-path conversions, errors and the
// outputs. Errors follow torch's own HANDLE_TH_ERRORS protocol (c10::Error -> RuntimeError and
// friends, C++ warnings -> Python warnings); on failure the register file and the failing
// instruction go back to the caller, which builds the ExecutionError the Python loop raises.
//
// With an arena (fxrt/exec/arena.py), run() first decides, as PythonLoop.take_arena does, whether
// this call may use one: not when autograd could record it (grad mode on and an input or constant
// requires grad), when a TorchDispatchMode is active (it must see the graph's own ops), or when an
// input's size or dtype differs from what the graph was compiled for.
// It then takes an arena from the pool of its inference mode, or has the Python factory make one,
// and puts it back after a successful run; a failed run drops it (the error may still hold views
// of it).

#pragma once

#include "call.h"
#include "inputs.h"

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#ifndef FXRT_TORCH_VERSION
#error "FXRT_TORCH_VERSION (torch.__version__ at build time) must be defined; build with setup.py"
#endif

namespace fxrt {

using Registers = std::vector<IValue>;

struct PyCallOp {
  py::object fn;
  std::vector<Tree> args;
  py::object const_kwargs;  // a dict of the constant kwargs, or None when there are none
  std::vector<std::pair<py::object, Tree>> kwargs;  // kwargs that read registers
  std::vector<int64_t> outputs;
  bool multi = false;
};

struct Instr {
  enum Kind : uint8_t { CALL, PYCALL, FREE };
  Kind kind;
  size_t index;  // into calls_, pycalls_ or frees_
};

// An input the arena requires to have the compiled size and dtype.
struct InputGuard {
  size_t reg;
  std::vector<int64_t> sizes;
  at::ScalarType dtype;
};


// Arenas not in use, one pool per inference mode: an arena made in inference mode holds
// inference tensors, which normal mode may not write.
class ArenaPool {
 public:
  std::unique_ptr<Arena> take(bool inference) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& pool = pools_[inference];
    if (pool.empty()) {
      return nullptr;
    }
    std::unique_ptr<Arena> arena = std::move(pool.back());
    pool.pop_back();
    return arena;
  }
  // Keeps at most `max_idle` arenas per pool; one more is freed (on return, outside the lock).
  void give_back(std::unique_ptr<Arena> arena, bool inference) {
    std::lock_guard<std::mutex> lock(mu_);
    if (pools_[inference].size() < max_idle_) {
      pools_[inference].push_back(std::move(arena));
    }
  }
  void set_max_idle(size_t n) { max_idle_ = n; }
  size_t idle() {
    std::lock_guard<std::mutex> lock(mu_);
    return pools_[0].size() + pools_[1].size();
  }
  // Frees every idle arena (CompiledGraph.release_memory()).
  void clear() {
    std::vector<std::unique_ptr<Arena>> dropped[2];
    std::lock_guard<std::mutex> lock(mu_);
    dropped[0].swap(pools_[0]);
    dropped[1].swap(pools_[1]);
  }

 private:
  std::mutex mu_;
  size_t max_idle_ = 2;
  std::vector<std::unique_ptr<Arena>> pools_[2];
};

// Filled by run() when an instruction fails: what the caller needs to name the failing node.
struct Failure {
  int64_t pc = -1;
  Registers regs;
};

class Executor {
 public:
  Executor(PyObject* ref_type, int64_t n_regs, bool release_gil)
      : refs_(ref_type), template_(static_cast<size_t>(n_regs)), release_gil_(release_gil) {}

  void set_inputs(const std::vector<int64_t>& regs) { inputs_ = regs; }

  void set_constant(int64_t reg, PyObject* value) {
    template_.at(static_cast<size_t>(reg)) = from_python(value);
  }

  void set_output(PyObject* tree) { output_.emplace(tree, refs_); }

  void add_free(const std::vector<int64_t>& regs) {
    code_.push_back({Instr::FREE, frees_.size()});
    frees_.push_back(regs);
  }

  // Bind a CALL natively; false (nothing added) when it cannot be (see bind_call).
  bool add_call(
      PyObject* name,
      PyObject* overload,
      PyObject* args,
      PyObject* kwargs,
      const std::vector<int64_t>& outputs,
      bool multi) {
    std::optional<CallOp> call = bind_call(
        py::cast<std::string>(name), py::cast<std::string>(overload), args, kwargs, outputs, multi,
        refs_);
    if (!call.has_value()) {
      return false;
    }
    max_stack_ = std::max({max_stack_, call->slots.size(), call->n_returns});
    code_.push_back({Instr::CALL, calls_.size()});
    calls_.push_back(std::move(*call));
    return true;
  }

  // Give the CALL just added arena slot `slot`, written by the call `out_name`.`out_overload`
  // (`out_args`, `out_kwargs`) whose `out` reads the result register; `out_name` None: an
  // allocation. False (the call stays plain) when the out= call cannot be bound.
  bool set_arena_slot(
      int64_t slot,
      PyObject* out_name,
      PyObject* out_overload,
      PyObject* out_args,
      PyObject* out_kwargs) {
    if (code_.empty() || code_.back().kind != Instr::CALL) {
      return false;
    }
    CallOp& call = calls_.at(code_.back().index);
    if (call.multi) {
      return false;
    }
    if (out_name != Py_None) {
      std::optional<CallOp> out = bind_call(
          py::cast<std::string>(out_name), py::cast<std::string>(out_overload), out_args,
          out_kwargs, call.outputs, false, refs_);
      if (!out.has_value()) {
        return false;
      }
      max_stack_ = std::max({max_stack_, out->slots.size(), out->n_returns});
      call.out_call = std::make_shared<const CallOp>(std::move(*out));
    }
    call.arena_slot = slot;
    return true;
  }

  // Let the CALL just added be made inline as a view on calls with an arena (see
  // bind_inline_view); false when it cannot be.
  bool set_inline_view() {
    if (code_.empty() || code_.back().kind != Instr::CALL) {
      return false;
    }
    CallOp& call = calls_.at(code_.back().index);
    bind_inline_view(call);
    return call.view != CallOp::View::NONE;
  }

  void add_pycall(
      PyObject* fn,
      PyObject* args,
      PyObject* kwargs,
      const std::vector<int64_t>& outputs,
      bool multi) {
    PyCallOp call;
    call.fn = py::reinterpret_borrow<py::object>(fn);
    call.outputs = outputs;
    call.multi = multi;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args); ++i) {
      PyObject* arg = PyTuple_GET_ITEM(args, i);
      call.args.push_back(refs_.contains_ref(arg) ? Tree(arg, refs_) : Tree::constant(arg));
    }
    py::object consts = steal_or_throw(PyDict_New());
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(kwargs, &pos, &key, &value)) {
      if (refs_.contains_ref(value)) {
        call.kwargs.emplace_back(py::reinterpret_borrow<py::object>(key), Tree(value, refs_));
      } else if (PyDict_SetItem(consts.ptr(), key, value) < 0) {
        throw_python_error();
      }
    }
    call.const_kwargs = PyDict_GET_SIZE(consts.ptr()) > 0 ? consts : py::none();
    code_.push_back({Instr::PYCALL, pycalls_.size()});
    pycalls_.push_back(std::move(call));
  }

  // The arena: `factory()` makes one (a list of tensors, one per slot); `guards` are (input
  // position, meta tensor with the compiled size and dtype) pairs; at most `max_idle` arenas per
  // inference mode are kept between calls.
  void set_arena(PyObject* factory, PyObject* guards, bool constants_need_grad, int64_t max_idle) {
    arena_factory_ = py::reinterpret_borrow<py::object>(factory);
    pool_.set_max_idle(static_cast<size_t>(std::max<int64_t>(max_idle, 0)));
    for (py::handle item : py::reinterpret_borrow<py::list>(guards)) {
      auto pair = item.cast<py::tuple>();
      size_t pos = pair[0].cast<size_t>();
      const at::Tensor& meta = THPVariable_Unpack(pair[1].ptr());
      guards_.push_back({static_cast<size_t>(inputs_.at(pos)), meta.sizes().vec(),
                         meta.scalar_type()});
    }
    constants_need_grad_ = constants_need_grad;
  }

  // The per-call input check: `specs` are (input position, meta tensor of the dtype, device
  // string, sizes, strides) tuples; `on_mismatch(inputs)` returns the exception to raise.
  void set_input_specs(PyObject* specs, PyObject* on_mismatch) {
    on_mismatch_ = py::reinterpret_borrow<py::object>(on_mismatch);
    int64_t n_symbols = 0;
    for (py::handle item : py::reinterpret_borrow<py::list>(specs)) {
      auto t = item.cast<py::tuple>();
      InputSpec spec{
          static_cast<size_t>(inputs_.at(t[0].cast<size_t>())),
          THPVariable_Unpack(t[1].ptr()).scalar_type(),
          c10::Device(t[2].cast<std::string>()),
          t[3].cast<std::vector<int64_t>>(),
          t[4].cast<std::vector<int64_t>>()};
      for (int64_t s : spec.sizes) {
        n_symbols = std::max(n_symbols, -1 - s);
      }
      input_specs_.push_back(std::move(spec));
    }
    n_symbols_ = static_cast<size_t>(n_symbols);
  }

  // Free the idle arenas; calls still running keep theirs until they return.
  void release_arenas() { pool_.clear(); }
  size_t idle_arenas() const { return pool_.idle(); }

  // Per-instruction node names (program order), for torch.profiler ranges in timed runs.
  void set_names(const std::vector<std::string>& names) { names_ = names; }

  // Run the program on `inputs` (a list or tuple). Returns the output (a new reference), or
  // nullptr with a Python error set; `failure` then names the instruction when one failed.
  PyObject* run(PyObject* inputs, Failure& failure) const {
    HANDLE_TH_ERRORS
    return run_checked<false>(inputs, failure, nullptr, false);
    END_HANDLE_TH_ERRORS
  }

  // The instrumented loop, for fxrt.profile(): like run(), and appends pc, start and end (ns,
  // CLOCK_MONOTONIC like Python's perf_counter_ns) of every CALL and PYCALL to `timings`. With
  // `ranges`, each runs inside an at::RecordFunction named after its node, so torch.profiler
  // shows it. A separate instantiation: run() pays nothing for it.
  PyObject* run_timed(
      PyObject* inputs, Failure& failure, std::vector<int64_t>& timings, bool ranges) const {
    HANDLE_TH_ERRORS
    return run_checked<true>(inputs, failure, &timings, ranges);
    END_HANDLE_TH_ERRORS
  }

 private:
  static int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  template <bool Timed>
  PyObject* run_checked(
      PyObject* inputs,
      Failure& failure,
      std::vector<int64_t>* timings,
      bool ranges) const {
    py::object seq =
        steal_or_throw(PySequence_Fast(inputs, "compiled graph inputs must be a list or tuple"));
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
    if (static_cast<size_t>(n) != inputs_.size()) {
      PyErr_Format(
          PyExc_TypeError,
          "compiled graph takes %zu inputs, got %zd",
          inputs_.size(),
          n);
      throw_python_error();
    }
    Registers regs(template_);
    for (Py_ssize_t i = 0; i < n; ++i) {
      regs[static_cast<size_t>(inputs_[i])] = from_python(PySequence_Fast_GET_ITEM(seq.ptr(), i));
    }
    if (!input_specs_.empty() && !inputs_match(input_specs_, n_symbols_, regs)) {
      py::object exc = on_mismatch_(seq);
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
      throw_python_error();
    }
    bool inference = c10::InferenceMode::is_enabled();
    std::unique_ptr<Arena> arena = take_arena(regs, inference);
    Stack stack;
    stack.reserve(max_stack_);
    GilState gil(release_gil_);
    size_t pc = 0;
    try {
      for (; pc < code_.size(); ++pc) {
        const Instr& ins = code_[pc];
        if constexpr (Timed) {
          if (ins.kind == Instr::FREE) {
            step(ins, regs, stack, gil, nullptr);
            continue;
          }
          std::optional<at::RecordFunction> range;
          if (ranges && pc < names_.size()) {
            range.emplace(at::RecordScope::USER_SCOPE);
            if (range->isActive()) {
              range->before(std::string_view(names_[pc]), c10::ArrayRef<const IValue>{});
            }
          }
          int64_t t0 = now_ns();
          step(ins, regs, stack, gil, arena.get());
          int64_t t1 = now_ns();
          timings->insert(timings->end(), {static_cast<int64_t>(pc), t0, t1});
        } else {
          step(ins, regs, stack, gil, arena.get());
        }
      }
    } catch (...) {
      gil.acquire();
      stack.clear();
      failure.pc = static_cast<int64_t>(pc);
      failure.regs = std::move(regs);
      throw;
    }
    gil.acquire();
    if (arena != nullptr) {
      pool_.give_back(std::move(arena), inference);
    }
    return output_ ? output_->build(regs).release().ptr() : Py_NewRef(Py_None);
  }

  // An arena for this call (see the header comment), or nullptr. Needs the GIL.
  std::unique_ptr<Arena> take_arena(const Registers& regs, bool inference) const {
    if (arena_factory_.is_none() || c10::impl::TorchDispatchModeTLS::any_modes_set() ||
        fills_uninitialized_memory()) {
      return nullptr;  // a dispatch mode must see the graph's own ops; new memory is filled
    }
    if (c10::GradMode::is_enabled()) {
      if (constants_need_grad_) {
        return nullptr;
      }
      for (int64_t r : inputs_) {
        const IValue& v = regs[static_cast<size_t>(r)];
        if (v.isTensor() && v.toTensor().requires_grad()) {
          return nullptr;
        }
      }
    }
    for (const InputGuard& g : guards_) {
      const IValue& v = regs[g.reg];
      if (!v.isTensor() || v.toTensor().scalar_type() != g.dtype ||
          !v.toTensor().sizes().equals(g.sizes)) {
        return nullptr;
      }
    }
    std::unique_ptr<Arena> arena = pool_.take(inference);
    if (arena != nullptr) {
      return arena;
    }
    py::object made = steal_or_throw(PyObject_CallNoArgs(arena_factory_.ptr()));
    arena = std::make_unique<Arena>();
    for (py::handle t : py::reinterpret_borrow<py::list>(made)) {
      arena->push_back(THPVariable_Unpack(t.ptr()));
    }
    return arena;
  }

  void step(const Instr& ins, Registers& regs, Stack& stack, GilState& gil, const Arena* arena)
      const {
    switch (ins.kind) {
      case Instr::CALL:
        gil.release();
        run_call(calls_[ins.index], regs, stack, gil, arena);
        break;
      case Instr::PYCALL:
        gil.acquire();
        run_pycall(pycalls_[ins.index], regs);
        break;
      case Instr::FREE:
        for (int64_t r : frees_[ins.index]) {
          regs[static_cast<size_t>(r)] = IValue();
        }
        break;
    }
  }

  void run_pycall(const PyCallOp& call, Registers& regs) const {
    py::object args = steal_or_throw(PyTuple_New(static_cast<Py_ssize_t>(call.args.size())));
    for (size_t i = 0; i < call.args.size(); ++i) {
      PyTuple_SET_ITEM(args.ptr(), i, call.args[i].build(regs).release().ptr());
    }
    py::object kwargs = call.const_kwargs;
    if (!call.kwargs.empty()) {
      kwargs = steal_or_throw(kwargs.is_none() ? PyDict_New() : PyDict_Copy(kwargs.ptr()));
      for (const auto& [key, tree] : call.kwargs) {
        if (PyDict_SetItem(kwargs.ptr(), key.ptr(), tree.build(regs).ptr()) < 0) {
          throw_python_error();
        }
      }
    }
    py::object result = steal_or_throw(
        PyObject_Call(call.fn.ptr(), args.ptr(), kwargs.is_none() ? nullptr : kwargs.ptr()));
    if (!call.multi) {
      regs[static_cast<size_t>(call.outputs[0])] = from_python(result.ptr());
      return;
    }
    py::object it = steal_or_throw(PyObject_GetIter(result.ptr()));
    for (int64_t out : call.outputs) {
      PyObject* item = PyIter_Next(it.ptr());
      if (item == nullptr) {
        if (PyErr_Occurred()) {
          throw_python_error();
        }
        break;
      }
      regs[static_cast<size_t>(out)] = from_python(item);
      Py_DECREF(item);
    }
  }

  RefReader refs_;
  Registers template_;
  bool release_gil_;
  std::vector<int64_t> inputs_;
  std::optional<Tree> output_;
  std::vector<Instr> code_;
  std::vector<CallOp> calls_;
  std::vector<PyCallOp> pycalls_;
  std::vector<std::vector<int64_t>> frees_;
  std::vector<std::string> names_;
  size_t max_stack_ = 0;
  py::object arena_factory_ = py::none();
  std::vector<InputSpec> input_specs_;
  size_t n_symbols_ = 0;
  py::object on_mismatch_ = py::none();
  std::vector<InputGuard> guards_;
  bool constants_need_grad_ = false;
  mutable ArenaPool pool_;
};

// Whether torch.ops would route this call's ops through __torch_function__: 0 no, 1 yes (a
// TorchFunctionMode is active), 2 maybe (an input is a tensor subclass, which may override it;
// torch._C._has_torch_function decides). The compiled loop calls ops below that layer, so the
// caller runs such calls on the Python loop instead.
inline int torch_function_state(PyObject* inputs) {
  if (at::impl::torch_function_mode_enabled()) {
    return 1;
  }
  if (PyList_Check(inputs) || PyTuple_Check(inputs)) {
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(inputs); ++i) {
      PyObject* x = PySequence_Fast_GET_ITEM(inputs, i);
      if (!THPVariable_CheckExact(x) && THPVariable_Check(x)) {
        return 2;
      }
    }
  }
  return 0;
}

// The registers of a failed run as a Python list (None where one cannot be converted), for the
// error message.
inline PyObject* failure_registers(Failure& failure) {
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(failure.regs.size()));
  if (list == nullptr) {
    return nullptr;
  }
  for (size_t i = 0; i < failure.regs.size(); ++i) {
    PyObject* obj = nullptr;
    try {
      obj = to_python(failure.regs[i]);
    } catch (...) {
      obj = nullptr;
    }
    if (obj == nullptr) {
      PyErr_Clear();
      Py_INCREF(Py_None);
      obj = Py_None;
    }
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), obj);
  }
  failure.regs.clear();
  return list;
}

// Cython's handler for C++ exceptions thrown while an Executor is built: torch's own translation
// (python_error restored, c10::Error -> RuntimeError, ...). Called inside a catch block.
inline void set_python_error() {
  torch::translate_exception_to_python(std::current_exception());
}

// The torch version this extension was compiled against.
inline const char* built_torch_version() {
  return FXRT_TORCH_VERSION;
}

}  // namespace fxrt
