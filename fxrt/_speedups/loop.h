// The compiled loop: runs an fxrt Program (fxrt/exec/program.py) on a register file of
// c10::IValue, with the same semantics as the Python loop (fxrt/exec/interp.py).
//
// The Executor is built once, instruction by instruction in program order (so an instruction's
// index is the same as in the Program), one add_* method per instruction kind: CALL (call.h), OUT,
// ALLOC and VIEW (their arena and inline forms in inline_ops.h, their plain form a CALL), SYM
// (sym.h), PYCALL (pycall.h) and FREE. Every kind but FREE also gets its Python form, the call
// torch.ops would make. An add_* method that cannot bind its instruction adds nothing and returns
// why; fxrt/exec/native.py then adds the demoted instruction and writes the demotion back into
// the Program. The Executor is immutable afterwards, so any number of threads may run it at once.
//
// run() makes a fresh register file per call, preloads the Program's constants, converts and
// checks the inputs (inputs.h), and walks the instructions with one reused stack, switching on
// their kind. The GIL is released around runs of native instructions, as torch.ops does around
// each op, and taken back for Python calls, slow-path conversions, errors and the outputs.
// Errors follow torch's own HANDLE_TH_ERRORS protocol (c10::Error -> RuntimeError and friends,
// C++ warnings -> Python warnings); on failure the register file and the failing instruction go
// back to the caller, which builds the error the Python loop raises (fxrt/errors.py).
//
// Per call, the guards lower() computed (fxrt/exec/guards.py, whose Python twins the Python loop
// runs) decide two things. A call that __torch_function__ must see (a TorchFunctionMode, a
// subclass input that overrides it) runs every instruction's Python form, without the arena (a
// separate instantiation of the loop, chosen once per call). A call may use the arena unless
// autograd could record it (grad mode on and an input or constant requires grad), a
// TorchDispatchMode is active (it must see the graph's own ops), new memory must be filled, or an
// input's size or dtype differs from what the arena was planned for. It then takes an arena from
// the pool of its inference mode, or has the Python factory make one, and puts it back after a
// successful run; a failed run drops it (the error may still hold views of it).

#pragma once

#include "arena_pool.h"
#include "call.h"
#include "inline_ops.h"
#include "inputs.h"
#include "pycall.h"
#include "streams.h"
#include "sym.h"

#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#ifndef FXRT_TORCH_VERSION
#error "FXRT_TORCH_VERSION (torch.__version__ at build time) must be defined; build with setup.py"
#endif

namespace fxrt {

using Registers = std::vector<IValue>;

struct Instr {
  enum Kind : uint8_t { CALL, OUT, ALLOC, VIEW, SYM, PYCALL, FREE, STREAM, RECORD, WAIT };
  Kind kind;
  // into calls_, outs_, allocs_, views_, syms_, forms_ (PYCALL), frees_, stream_ops_, records_
  // or waits_
  size_t index;
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
    forms_.emplace_back();
  }

  // The add_* methods of CALL, OUT, ALLOC and VIEW take the instruction's plain form as one
  // tuple, `(fn, name, overload, args, kwargs, outputs)`: `fn` is its Python form, and
  // `name`.`overload`(*args, **kwargs) into `outputs` the op through the dispatcher. Each returns
  // "" when added, else why it cannot be bound (nothing added).

  // CALL: the plain form.
  std::string add_call(PyObject* plain, bool multi) {
    Plain p(plain);
    std::string why;
    std::optional<CallOp> call = bind(p, multi, why);
    if (!call.has_value()) {
      return why;
    }
    push(Instr::CALL, calls_.size(), p, multi);
    calls_.push_back(std::move(*call));
    return "";
  }

  // OUT: the plain form, and its out= form `out_name`.`out_overload`(*out_args, **out_kwargs)
  // writing arena slot `slot`.
  std::string add_out(
      PyObject* plain,
      int64_t slot,
      PyObject* out_name,
      PyObject* out_overload,
      PyObject* out_args,
      PyObject* out_kwargs) {
    Plain p(plain);
    std::string why;
    std::optional<CallOp> call = bind(p, false, why);
    if (!call.has_value()) {
      return why;
    }
    std::optional<CallOp> out = bind_call(
        py::cast<std::string>(out_name), py::cast<std::string>(out_overload), out_args,
        out_kwargs, p.outputs, false, refs_, why);
    if (!out.has_value()) {
      return "out= form: " + why;
    }
    max_stack_ = std::max({max_stack_, out->args.size(), out->n_returns});
    push(Instr::OUT, outs_.size(), p, false);
    outs_.push_back({std::move(*call), std::move(*out), slot});
    return "";
  }

  // ALLOC: arena slot `slot` (-1: none); with `cpu`, the plain call is a constant CPU
  // empty_strided made directly.
  std::string add_alloc(PyObject* plain, int64_t slot, bool cpu) {
    Plain p(plain);
    std::string why;
    std::optional<CallOp> call = bind(p, false, why);
    if (!call.has_value()) {
      return why;
    }
    AllocOp alloc{std::move(*call), slot, std::nullopt};
    if (cpu && !bind_cpu_empty(alloc)) {
      return "empty_strided's arguments are not constants";
    }
    push(Instr::ALLOC, allocs_.size(), p, false);
    allocs_.push_back(std::move(alloc));
    return "";
  }

  // VIEW of kind `kind` (ViewOp::Kind) on the register the first argument reads.
  std::string add_view(
      PyObject* plain,
      int64_t kind,
      bool always,
      const std::vector<int64_t>& ints,
      const std::vector<int64_t>& strides,
      int64_t offset) {
    Plain p(plain);
    std::string why;
    std::optional<CallOp> call = bind(p, false, why);
    if (!call.has_value()) {
      return why;
    }
    if (call->args.empty() || call->args[0].kind != BoundArg::REG ||
        kind > static_cast<int64_t>(ViewOp::Kind::REINTERPRET) || kind < 0) {
      return "the view's input is not a register";
    }
    ViewOp view{std::move(*call), static_cast<ViewOp::Kind>(kind), always};
    view.self = view.call.args[0].reg;
    view.ints = ints;
    view.strides = strides;
    view.offset = offset;
    push(Instr::VIEW, views_.size(), p, false);
    views_.push_back(std::move(view));
    return "";
  }

  // SYM step `kind` (SymOp::Kind) on `args` (registers or ints) into `output`; `fn` computes it
  // in Python.
  std::string add_sym(PyObject* fn, int64_t kind, PyObject* args, int64_t output) {
    if (kind < 0 || kind > static_cast<int64_t>(SymOp::Kind::MIN)) {
      return "unknown arithmetic step";
    }
    SymOp sym{static_cast<SymOp::Kind>(kind), {}, output};
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args); ++i) {
      PyObject* a = PyTuple_GET_ITEM(args, i);
      ListItem item;
      if (refs_.is_ref(a)) {
        item.reg = refs_.id(a);
      } else if (PyLong_CheckExact(a)) {
        item.value = from_python(a);
      } else {
        return "an operand is neither a register nor an int";
      }
      sym.args.push_back(std::move(item));
    }
    if (sym.args.size() != (sym.kind == SymOp::Kind::NEG ? 1u : 2u)) {
      return "wrong number of operands";
    }
    py::object kwargs = steal_or_throw(PyDict_New());
    forms_.push_back(bind_pycall(fn, args, kwargs.ptr(), {output}, false, refs_));
    code_.push_back({Instr::SYM, syms_.size()});
    syms_.push_back(std::move(sym));
    return "";
  }

  // STREAM, RECORD and WAIT (streams.h); set_streams() once they are all added.
  void add_stream(int64_t stream) {
    code_.push_back({Instr::STREAM, stream_ops_.size()});
    stream_ops_.push_back({stream});
    forms_.emplace_back();
  }
  void add_record(int64_t stream, int64_t event) {
    code_.push_back({Instr::RECORD, records_.size()});
    records_.push_back({stream, event});
    forms_.emplace_back();
  }
  void add_wait(
      int64_t stream,
      const std::vector<int64_t>& events,
      const std::vector<int64_t>& protect) {
    code_.push_back({Instr::WAIT, waits_.size()});
    waits_.push_back({stream, events, protect});
    forms_.emplace_back();
  }
  // A multi-stream program: `n_streams` streams (the caller's included) on device type
  // `device` ("cpu": worker threads), `n_events` events per call.
  void set_streams(int64_t n_streams, const std::string& device, int64_t n_events) {
    streams_.configure(n_streams, device, n_events);
    streams_.cut(code_.size(), [this](size_t pc) -> int64_t {
      return code_[pc].kind == Instr::STREAM ? stream_ops_[code_[pc].index].stream : -1;
    });
  }

  void add_pycall(
      PyObject* fn,
      PyObject* args,
      PyObject* kwargs,
      const std::vector<int64_t>& outputs,
      bool multi) {
    forms_.push_back(bind_pycall(fn, args, kwargs, outputs, multi, refs_));
    code_.push_back({Instr::PYCALL, code_.size()});
  }

  // The arena: `factory()` makes one (a list of tensors, one per slot); at most `max_idle`
  // arenas per inference mode are kept between calls.
  // `device` is the arena's: its pools are kept per current stream of that device.
  void set_arena(PyObject* factory, int64_t max_idle, const std::string& device) {
    arena_factory_ = py::reinterpret_borrow<py::object>(factory);
    arena_device_ = c10::Device(device).type();
    pool_.set_max_idle(static_cast<size_t>(std::max<int64_t>(max_idle, 0)));
  }

  // The Program's guards (fxrt/exec/guards.py): `specs` are (input position, meta tensor of the
  // dtype, device string, sizes, strides) tuples and `on_mismatch(inputs)` returns the exception
  // a mismatch raises; `arena_inputs` are (input position, meta tensor with the size and dtype
  // the arena needs) pairs.
  void set_guards(
      PyObject* specs,
      PyObject* on_mismatch,
      PyObject* arena_inputs,
      bool constants_need_grad) {
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
    for (py::handle item : py::reinterpret_borrow<py::list>(arena_inputs)) {
      auto pair = item.cast<py::tuple>();
      const at::Tensor& meta = THPVariable_Unpack(pair[1].ptr());
      arena_inputs_.push_back({static_cast<size_t>(inputs_.at(pair[0].cast<size_t>())),
                               meta.sizes().vec(), meta.scalar_type()});
    }
    constants_need_grad_ = constants_need_grad;
  }

  // Free the idle arenas; calls still running keep theirs until they return.
  void release_arenas() { pool_.clear(); }
  size_t idle_arenas() const { return pool_.idle(); }

  // Per-instruction node names (program order), for torch.profiler ranges in timed runs.
  void set_names(const std::vector<std::string>& names) { names_ = names; }

  // Run the program on `inputs` (a list or tuple); with `through_python`, every instruction's
  // Python form (a call __torch_function__ must see). Returns the output (a new reference), or
  // nullptr with a Python error set; `failure` then names the instruction when one failed.
  PyObject* run(PyObject* inputs, Failure& failure, bool through_python) const {
    HANDLE_TH_ERRORS
    return through_python ? run_checked<false, true>(inputs, failure, nullptr, false)
                          : run_checked<false, false>(inputs, failure, nullptr, false);
    END_HANDLE_TH_ERRORS
  }

  // The instrumented loop, for fxrt.profile(): like run(), and appends pc, start and end (ns,
  // CLOCK_MONOTONIC like Python's perf_counter_ns) of every instruction but FREEs to `timings`.
  // With `ranges`, each runs inside an at::RecordFunction named after its node, so
  // torch.profiler shows it. A separate instantiation: run() pays nothing for it.
  PyObject* run_timed(
      PyObject* inputs,
      Failure& failure,
      std::vector<int64_t>& timings,
      bool ranges,
      bool through_python) const {
    HANDLE_TH_ERRORS
    return through_python ? run_checked<true, true>(inputs, failure, &timings, ranges)
                          : run_checked<true, false>(inputs, failure, &timings, ranges);
    END_HANDLE_TH_ERRORS
  }

 private:
  static int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  // A plain form tuple (see add_call), borrowed from the caller's reference.
  struct Plain {
    explicit Plain(PyObject* tuple) {
      if (!PyTuple_Check(tuple) || PyTuple_GET_SIZE(tuple) != 6) {
        throw std::invalid_argument("a plain form is (fn, name, overload, args, kwargs, outputs)");
      }
      fn = PyTuple_GET_ITEM(tuple, 0);
      name = PyTuple_GET_ITEM(tuple, 1);
      overload = PyTuple_GET_ITEM(tuple, 2);
      args = PyTuple_GET_ITEM(tuple, 3);
      kwargs = PyTuple_GET_ITEM(tuple, 4);
      outputs = py::cast<std::vector<int64_t>>(PyTuple_GET_ITEM(tuple, 5));
    }
    PyObject *fn, *name, *overload, *args, *kwargs;
    std::vector<int64_t> outputs;
  };

  std::optional<CallOp> bind(const Plain& p, bool multi, std::string& why) {
    std::optional<CallOp> call = bind_call(
        py::cast<std::string>(p.name), py::cast<std::string>(p.overload), p.args, p.kwargs,
        p.outputs, multi, refs_, why);
    if (call.has_value()) {
      max_stack_ = std::max({max_stack_, call->args.size(), call->n_returns});
    }
    return call;
  }

  // Appends an instruction and its Python form.
  void push(Instr::Kind kind, size_t index, const Plain& p, bool multi) {
    forms_.push_back(bind_pycall(p.fn, p.args, p.kwargs, p.outputs, multi, refs_));
    code_.push_back({kind, index});
  }

  template <bool Timed, bool Python>
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
    int64_t stream = arena_stream();
    std::unique_ptr<Arena> arena = Python ? nullptr : take_arena(regs, inference, stream);
    Stack stack;
    stack.reserve(max_stack_);
    std::optional<DeviceCall> device_call;  // a multi-stream call on a device (streams.h)
    GilState gil(release_gil_ && !Python);
    DeviceCall* dev = nullptr;
    size_t pc = 0;
    try {
      if (!Python && streams_.multi()) {
        if (streams_.on_cpu()) {
          run_cpu_streams<Timed>(regs, arena.get(), timings, ranges, pc);
          pc = code_.size();
        } else {
          device_call.emplace(
              streams_.device_type(), streams_.side_streams(), streams_.n_events());
          dev = &*device_call;
        }
      }
      for (; pc < code_.size(); ++pc) {
        const Instr& ins = code_[pc];
        if constexpr (Timed) {
          if (ins.kind == Instr::FREE) {
            step<Python>(pc, regs, stack, gil, nullptr, dev);
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
          step<Python>(pc, regs, stack, gil, arena.get(), dev);
          int64_t t1 = now_ns();
          if (ins.kind < Instr::STREAM) {
            timings->insert(timings->end(), {static_cast<int64_t>(pc), t0, t1});
          }
        } else {
          step<Python>(pc, regs, stack, gil, arena.get(), dev);
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
    device_call.reset();  // the caller's stream is current again
    if (arena != nullptr) {
      pool_.give_back(std::move(arena), inference, stream);
    }
    return output_ ? output_->build(regs).release().ptr() : Py_NewRef(Py_None);
  }

  // An arena for this call (see the header comment), or nullptr. Needs the GIL.
  // The key of the arena pool for calls on the current stream of the arena's device.
  int64_t arena_stream() const {
    if (arena_device_ == c10::DeviceType::CPU || arena_factory_.is_none()) {
      return 0;
    }
    c10::impl::VirtualGuardImpl impl(arena_device_);
    c10::Stream s = impl.getStream(impl.getDevice());
    return s.id() * 64 + s.device_index();
  }

  // A multi-stream program on the CPU (streams.h): the caller's segments here, the others on
  // their workers. Sets `pc` to the failing instruction when it throws.
  template <bool Timed>
  void run_cpu_streams(
      Registers& regs,
      const Arena* arena,
      std::vector<int64_t>* timings,
      bool ranges,
      size_t& pc) const {
    GilState gil(true);  // released whenever this thread blocks: a worker may need it
    gil.release();
    std::lock_guard<std::mutex> one_at_a_time(streams_.call_mutex());
    CpuCall call(streams_.n_events());
    Stack stack;
    stack.reserve(max_stack_);
    try {
      for (const Segment& seg : streams_.segments()) {
        if (seg.stream == 0) {
          for (pc = seg.begin; pc < seg.end; ++pc) {
            run_on_stream<Timed>(pc, regs, stack, gil, arena, call, timings, ranges);
          }
          continue;
        }
        call.task_submitted();
        streams_.worker(seg.stream).submit([this, &call, &regs, arena, seg, timings, ranges] {
          {  // everything that refers to the call ends before task_done() lets it return
            at::ThreadLocalStateGuard tls(call.tls);
            GilState worker_gil{GilState::Worker{}};
            Stack worker_stack;
            worker_stack.reserve(max_stack_);
            size_t at = seg.begin;
            try {
              for (; at < seg.end; ++at) {
                run_on_stream<Timed>(
                    at, regs, worker_stack, worker_gil, arena, call, timings, ranges);
              }
            } catch (...) {
              call.fail(at, std::current_exception());
            }
            worker_stack.clear();
            worker_gil.release();
          }
          call.task_done();
        });
      }
    } catch (...) {
      call.fail(pc, std::current_exception());
    }
    gil.release();
    call.wait_tasks();
    gil.acquire();
    call.rethrow(pc);
  }

  // One instruction of a multi-stream CPU call, on whichever thread runs its stream.
  template <bool Timed>
  void run_on_stream(
      size_t pc,
      Registers& regs,
      Stack& stack,
      GilState& gil,
      const Arena* arena,
      CpuCall& call,
      std::vector<int64_t>* timings,
      bool ranges) const {
    const Instr& ins = code_[pc];
    switch (ins.kind) {
      case Instr::STREAM:
        return;
      case Instr::RECORD:
        call.record(records_[ins.index].event);
        return;
      case Instr::WAIT:
        gil.release();
        call.wait(waits_[ins.index].events);
        return;
      default:
        break;
    }
    if (call.failed()) {
      throw CallAborted();
    }
    if constexpr (Timed) {
      if (ins.kind != Instr::FREE) {
        std::optional<at::RecordFunction> range;
        if (ranges && pc < names_.size()) {
          range.emplace(at::RecordScope::USER_SCOPE);
          if (range->isActive()) {
            range->before(std::string_view(names_[pc]), c10::ArrayRef<const IValue>{});
          }
        }
        int64_t t0 = now_ns();
        step<false>(pc, regs, stack, gil, arena, nullptr);
        call.add_timing(timings, static_cast<int64_t>(pc), t0, now_ns());
        return;
      }
    }
    step<false>(pc, regs, stack, gil, arena, nullptr);
  }

  std::unique_ptr<Arena> take_arena(const Registers& regs, bool inference, int64_t stream) const {
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
    for (const ArenaInput& g : arena_inputs_) {
      const IValue& v = regs[g.reg];
      if (!v.isTensor() || v.toTensor().scalar_type() != g.dtype ||
          !v.toTensor().sizes().equals(g.sizes)) {
        return nullptr;
      }
    }
    std::unique_ptr<Arena> arena = pool_.take(inference, stream);
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

  // `dev`: a multi-stream call on a device (STREAM, RECORD and WAIT act on its streams); without
  // it they do nothing: program order is a valid schedule.
  template <bool Python>
  void step(
      size_t pc,
      Registers& regs,
      Stack& stack,
      GilState& gil,
      const Arena* arena,
      DeviceCall* dev) const {
    const Instr& ins = code_[pc];
    if (ins.kind == Instr::FREE) {
      for (int64_t r : frees_[ins.index]) {
        regs[static_cast<size_t>(r)] = IValue();
      }
      return;
    }
    if (ins.kind >= Instr::STREAM) {
      if (dev != nullptr) {
        if (ins.kind == Instr::STREAM) {
          dev->switch_to(stream_ops_[ins.index].stream);
        } else if (ins.kind == Instr::RECORD) {
          dev->record(records_[ins.index]);
        } else {
          dev->wait(waits_[ins.index], regs);
        }
      }
      return;
    }
    if constexpr (Python) {
      run_pycall(forms_[pc], regs);
      return;
    }
    switch (ins.kind) {
      case Instr::CALL:
        gil.release();
        run_call(calls_[ins.index], regs, stack, gil);
        return;
      case Instr::OUT: {
        gil.release();
        const OutOp& op = outs_[ins.index];
        if (arena != nullptr) {
          regs[static_cast<size_t>(op.call.outputs[0])] = (*arena)[static_cast<size_t>(op.slot)];
          try {
            run_call(op.out, regs, stack, gil);
            return;
          } catch (const std::exception&) {
            // The plain call below runs it instead, and raises its own error if any.
          }
        }
        run_call(op.call, regs, stack, gil);
        return;
      }
      case Instr::ALLOC: {
        gil.release();
        const AllocOp& op = allocs_[ins.index];
        if (arena != nullptr && op.slot >= 0) {
          regs[static_cast<size_t>(op.call.outputs[0])] = (*arena)[static_cast<size_t>(op.slot)];
        } else if (!run_cpu_empty(op, regs)) {
          run_call(op.call, regs, stack, gil);
        }
        return;
      }
      case Instr::VIEW: {
        gil.release();
        const ViewOp& op = views_[ins.index];
        if (!((op.always || arena != nullptr) && run_view(op, regs))) {
          run_call(op.call, regs, stack, gil);
        }
        return;
      }
      case Instr::SYM:
        if (!run_sym(syms_[ins.index], regs)) {
          gil.acquire();
          run_pycall(forms_[pc], regs);
        }
        return;
      case Instr::PYCALL:
        gil.acquire();
        run_pycall(forms_[pc], regs);
        return;
      case Instr::FREE:
      case Instr::STREAM:
      case Instr::RECORD:
      case Instr::WAIT:
        return;
    }
  }

  RefReader refs_;
  Registers template_;
  bool release_gil_;
  std::vector<int64_t> inputs_;
  std::optional<Tree> output_;
  std::vector<Instr> code_;
  std::vector<CallOp> calls_;
  std::vector<OutOp> outs_;
  std::vector<AllocOp> allocs_;
  std::vector<ViewOp> views_;
  std::vector<SymOp> syms_;
  std::vector<std::vector<int64_t>> frees_;
  std::vector<StreamOp> stream_ops_;
  std::vector<RecordOp> records_;
  std::vector<WaitOp> waits_;
  mutable StreamSet streams_;
  std::vector<PyCallOp> forms_;  // per pc: the instruction's Python form (empty for FREEs)
  std::vector<std::string> names_;
  size_t max_stack_ = 0;
  py::object arena_factory_ = py::none();
  c10::DeviceType arena_device_ = c10::DeviceType::CPU;
  std::vector<InputSpec> input_specs_;
  size_t n_symbols_ = 0;
  py::object on_mismatch_ = py::none();
  std::vector<ArenaInput> arena_inputs_;
  bool constants_need_grad_ = false;
  mutable ArenaPool pool_;
};

}  // namespace fxrt
