// The compiled loop's Python side: PyExecutor builds the Executor (loop.h) from a Program's
// Python objects and runs it on Python inputs. fxrt/exec/native.py feeds it through the Cython
// face (_loop.pyx).
//
// Each add_* method binds one instruction from its Python form (bind_python.h) and adds it to
// the Executor, with its Python form (pycall.h), the call torch.ops would make. One that cannot
// bind its instruction adds nothing and returns why; fxrt/exec/native.py then adds the demoted
// instruction and writes the demotion back into the Program.
//
// run() converts the inputs into a frame's register file (frames.h), checks them, runs the
// Executor and builds the output. Errors follow torch's own HANDLE_TH_ERRORS protocol (c10::Error ->
// RuntimeError and friends, C++ warnings -> Python warnings).

#pragma once

#include "bind_python.h"
#include "loop.h"
#include "pycall.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#ifndef FXRT_TORCH_VERSION
#error "FXRT_TORCH_VERSION (torch.__version__ at build time) must be defined; build with setup.py"
#endif

namespace fxrt {

class PyExecutor : public Executor {
 public:
  PyExecutor(PyObject* ref_type, int64_t n_regs, bool release_gil)
      : Executor(n_regs), refs_(ref_type), release_gil_(release_gil) {}

  void set_constant(int64_t reg, PyObject* value) { set_constant_value(reg, from_python(value)); }

  void set_output(PyObject* tree) { output_.emplace(tree, refs_); }

  void add_free(const std::vector<int64_t>& regs) {
    Executor::add_free(regs);
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
    add_form(p, multi);
    add_call_op(std::move(*call));
    return "";
  }

  // OUT: the plain form, and its out= form `out_name`.`out_overload`(*out_args, **out_kwargs)
  // writing arena slot `slot` (`multi`: one slot per output, from `slot` on); `elementwise`
  // names its inline form (elementwise.h), if any.
  std::string add_out(
      PyObject* plain,
      bool multi,
      int64_t slot,
      PyObject* out_name,
      PyObject* out_overload,
      PyObject* out_args,
      PyObject* out_kwargs,
      const std::string& elementwise) {
    Plain p(plain);
    std::string why;
    std::optional<CallOp> call = bind(p, multi, why);
    if (!call.has_value()) {
      return why;
    }
    std::optional<CallOp> out = bind_call(
        py::cast<std::string>(out_name), py::cast<std::string>(out_overload), out_args,
        out_kwargs, p.outputs, multi, refs_, why);
    if (!out.has_value()) {
      return "out= form: " + why;
    }
    OutOp op{std::move(*call), std::move(*out), slot};
    if (!elementwise.empty()) {
      std::optional<Elementwise> form = bind_elementwise(op.out, elementwise, why);
      if (!form.has_value()) {
        return why;
      }
      op.elementwise = *form;
    }
    add_form(p, multi);
    add_out_op(std::move(op));
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
    add_form(p, false);
    add_alloc_op(std::move(alloc));
    return "";
  }

  // VIEW of kind `kind` (ViewOp::Kind) on the register the first argument reads.
  std::string add_view(
      PyObject* plain,
      int64_t kind,
      bool multi,
      bool always,
      const std::vector<int64_t>& ints,
      const std::vector<int64_t>& strides,
      int64_t offset) {
    Plain p(plain);
    std::string why;
    std::optional<CallOp> call = bind(p, multi, why);
    if (!call.has_value()) {
      return why;
    }
    if (call->args.empty() || call->args[0].kind != BoundArg::REG ||
        kind > static_cast<int64_t>(ViewOp::Kind::SPLIT) || kind < 0) {
      return "the view's input is not a register";
    }
    if (multi != (kind == static_cast<int64_t>(ViewOp::Kind::SPLIT))) {
      return "only a split view has several outputs";
    }
    ViewOp view{std::move(*call), static_cast<ViewOp::Kind>(kind), always};
    view.self = view.call.args[0].reg;
    view.ints = ints;
    view.strides = strides;
    view.offset = offset;
    add_form(p, multi);
    add_view_op(std::move(view));
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
    add_sym_op(std::move(sym));
    return "";
  }

  // KERNEL: the C function at `address` (c_kernel.h) on `args`, registers and ints; `kinds` per
  // parameter, 0 a pointer and 1 an integer; `fn(*args)` its Python form.
  std::string add_kernel(
      PyObject* fn,
      PyObject* args,
      int64_t address,
      const std::vector<int64_t>& kinds,
      int64_t output) {
    if (!kKernelCallsSupported) {
      return "this machine's calling convention is not supported";
    }
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    if (address == 0 || static_cast<size_t>(n) != kinds.size() ||
        kinds.size() > kMaxKernelArgs) {
      return "no native entry for these arguments";
    }
    KernelOp op{reinterpret_cast<void*>(static_cast<intptr_t>(address)), {}, output};
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* a = PyTuple_GET_ITEM(args, i);
      bool pointer = kinds[static_cast<size_t>(i)] == 0;
      if (refs_.is_ref(a)) {
        op.args.push_back({pointer ? KernelArg::POINTER : KernelArg::INT, refs_.id(a)});
      } else if (!pointer && PyLong_CheckExact(a)) {
        op.args.push_back({KernelArg::CONSTANT, PyLong_AsLongLong(a)});
        if (PyErr_Occurred()) {
          PyErr_Clear();
          return "an integer argument does not fit in int64";
        }
      } else {
        return "argument " + std::to_string(i) + " is neither a register nor an int";
      }
    }
    py::object kwargs = steal_or_throw(PyDict_New());
    forms_.push_back(bind_pycall(fn, args, kwargs.ptr(), {output}, false, refs_));
    add_kernel_op(std::move(op));
    return "";
  }

  void add_pycall(
      PyObject* fn,
      PyObject* args,
      PyObject* kwargs,
      const std::vector<int64_t>& outputs,
      bool multi) {
    forms_.push_back(bind_pycall(fn, args, kwargs, outputs, multi, refs_));
    add_python_op();
  }

  // STREAM, RECORD and WAIT (loop.h, streams.h): no Python form (a call through Python runs in
  // program order, a valid schedule).
  void add_stream(int64_t stream) {
    Executor::add_stream(stream);
    forms_.emplace_back();
  }
  void add_record(int64_t stream, int64_t event) {
    Executor::add_record(stream, event);
    forms_.emplace_back();
  }
  void add_wait(
      int64_t stream,
      const std::vector<int64_t>& events,
      const std::vector<int64_t>& protect) {
    Executor::add_wait(stream, events, protect);
    forms_.emplace_back();
  }

  // The arena: `factory()` makes one (a list of tensors, one per slot) on `device`; at most
  // `max_idle` arenas per inference mode and current stream of that device are kept between
  // calls.
  void set_arena(PyObject* factory, int64_t max_idle, const std::string& device) {
    arena_factory_ = py::reinterpret_borrow<py::object>(factory);
    set_arena_factory(
        [this]() {
          py::object made = steal_or_throw(PyObject_CallNoArgs(arena_factory_.ptr()));
          auto arena = std::make_unique<Arena>();
          for (py::handle t : py::reinterpret_borrow<py::list>(made)) {
            arena->push_back(THPVariable_Unpack(t.ptr()));
          }
          return arena;
        },
        max_idle,
        c10::Device(device).type());
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
    const std::vector<int64_t>& regs = inputs();
    std::vector<InputSpec> input_specs;
    for (py::handle item : py::reinterpret_borrow<py::list>(specs)) {
      auto t = item.cast<py::tuple>();
      input_specs.push_back(
          {static_cast<size_t>(regs.at(t[0].cast<size_t>())),
           THPVariable_Unpack(t[1].ptr()).scalar_type(), c10::Device(t[2].cast<std::string>()),
           t[3].cast<std::vector<int64_t>>(), t[4].cast<std::vector<int64_t>>()});
    }
    std::vector<ArenaInput> guards;
    for (py::handle item : py::reinterpret_borrow<py::list>(arena_inputs)) {
      auto pair = item.cast<py::tuple>();
      const at::Tensor& meta = THPVariable_Unpack(pair[1].ptr());
      guards.push_back({static_cast<size_t>(regs.at(pair[0].cast<size_t>())),
                        meta.sizes().vec(), meta.scalar_type()});
    }
    Executor::set_guards(std::move(input_specs), std::move(guards), constants_need_grad);
  }

  // Run the program on `inputs` (a list or tuple); with `through_python`, every instruction's
  // Python form (a call __torch_function__ must see). Returns the output (a new reference), or
  // nullptr with a Python error set; `failure` then names the instruction when one failed.
  PyObject* run(PyObject* inputs, Failure& failure, bool through_python) const {
    HANDLE_TH_ERRORS
    return through_python ? run_checked<false, true>(inputs, failure, nullptr, false)
                          : run_checked<false, false>(inputs, failure, nullptr, false);
    END_HANDLE_TH_ERRORS
  }

  // The instrumented loop, for fxrt.profile(): like run(), and appends pc, start and end of
  // every instruction but FREEs to `timings` (Executor::execute). A separate instantiation:
  // run() pays nothing for it.
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
  // The Forms the Executor calls: each instruction's Python form, by pc.
  struct Forms {
    const std::vector<PyCallOp>& forms;
    void run(size_t pc, Registers& regs, GilState& gil) const {
      gil.acquire();
      run_pycall(forms[pc], regs);
    }
  };

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
    return bind_call(
        py::cast<std::string>(p.name), py::cast<std::string>(p.overload), p.args, p.kwargs,
        p.outputs, multi, refs_, why);
  }

  // Appends an instruction's Python form.
  void add_form(const Plain& p, bool multi) {
    forms_.push_back(bind_pycall(p.fn, p.args, p.kwargs, p.outputs, multi, refs_));
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
    const std::vector<int64_t>& input_regs = this->inputs();
    if (static_cast<size_t>(n) != input_regs.size()) {
      PyErr_Format(
          PyExc_TypeError,
          "compiled graph takes %zu inputs, got %zd",
          input_regs.size(),
          n);
      throw_python_error();
    }
    std::unique_ptr<Frame> frame = take_frame();  // dropped, not kept, if the call fails
    Registers& regs = frame->regs;
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* obj = PySequence_Fast_GET_ITEM(seq.ptr(), i);
      IValue& reg = regs[static_cast<size_t>(input_regs[i])];
      if (kept(static_cast<size_t>(input_regs[i])) && THPVariable_CheckExact(obj)) {
        // A static input: the frame still holds the tensor when it is the last call's.
        const at::Tensor& t = THPVariable_Unpack(obj);
        if (!reg.isTensor() || reg.unsafeToTensorImpl() != t.unsafeGetTensorImpl()) {
          reg = IValue(t);
        }
      } else {
        reg = from_python(obj);
      }
    }
    if (!inputs_ok(regs)) {
      py::object exc = on_mismatch_(seq);
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
      throw_python_error();
    }
    GilState gil(release_gil_ && !Python);
    execute<Timed, Python>(regs, frame->stack, Forms{forms_}, gil, failure, timings, ranges);
    PyObject* out = output_ ? output_->build(regs).release().ptr() : Py_NewRef(Py_None);
    give_frame(std::move(frame));
    return out;
  }

  RefReader refs_;
  bool release_gil_;
  std::optional<Tree> output_;
  std::vector<PyCallOp> forms_;  // per pc: the instruction's Python form (empty for FREEs)
  py::object arena_factory_ = py::none();
  py::object on_mismatch_ = py::none();
};

}  // namespace fxrt
