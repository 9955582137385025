// The compiled loop: runs an fxrt Program (fxrt/exec/program.py) on a register file of
// c10::IValue, with the same semantics as the Python loop (fxrt/exec/interp.py).
//
// The Executor here is the loop itself and needs no Python: the Python extension
// (py_executor.h, PyExecutor) and the C++ runtime (csrc/, built with FXRT_NO_PYTHON) both run it.
// It is built once (code.h), instruction by instruction in program order (so an instruction's
// index is the same as in the Program), one add_*_op method per instruction kind, each taking
// the bound instruction: CALL (call.h), OUT, ALLOC and VIEW (their arena and inline forms in
// inline_ops.h, their plain form a CALL), SYM (sym.h), KERNEL (c_kernel.h), PYCALL (pycall.h, a
// placeholder here: its Python form runs it) and FREE. The Executor is immutable afterwards, so
// any number of threads may run it at once.
//
// Per call, the caller takes a register file and stack (take_frame(), frames.h: the Program's
// constants preloaded; or registers() for a fresh register file), writes the inputs, checks them
// (inputs_ok(), inputs.h), and execute() walks the instructions with one stack, switching on
// their kind. The caller's Forms run an instruction's Python
// form (PYCALL, a SYM step on non-integers, every instruction of a call __torch_function__ must
// see); without Python, NoForms refuses. The GIL (GilState, a no-op without Python) is released
// around runs of native instructions, as torch.ops does around each op, and taken back for
// Python calls, slow-path conversions and errors. On failure the register file and the failing
// instruction go back to the caller, which builds the error the Python loop raises
// (fxrt/errors.py).
//
// Per call, the guards lower() computed (guards.h) decide two things. A call that
// __torch_function__ must see (a TorchFunctionMode, a subclass input that overrides it) runs
// every instruction's Python form, without the arena (a separate instantiation of the loop,
// chosen once per call). A call the guards allow an arena takes one from the pool of its
// inference mode and current stream, or has the factory make one, and puts it back after a
// successful run; a failed run drops it (the error may still hold views of it).

#pragma once

#include "arena_pool.h"
#include "call.h"
#include "code.h"
#include "elementwise.h"
#include "guards.h"
#include "inline_ops.h"
#include "inputs.h"
#include "frames.h"
#include "streams.h"
#include "sym.h"

#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace fxrt {

// Filled by run() when an instruction fails: what the caller needs to name the failing node.
struct Failure {
  int64_t pc = -1;
  Registers regs;
};

// The Forms of a build without Python: an instruction that needs Python is an error. (The C++
// runtime refuses programs with PYCALLs when it loads them; a SYM step gets here only on operands
// that are not ints.)
struct NoForms {
  [[noreturn]] void run(size_t pc, std::vector<IValue>&, GilState&) const {
    TORCH_CHECK(false, "instruction ", pc, " needs Python, which this runtime does not have");
  }
};

class Executor : public Code {
 public:
  explicit Executor(int64_t n_regs) : Code(n_regs) {}

  // The arena: `factory()` makes one (one tensor per slot; called with the GIL held in the
  // Python build) on `device`; at most `max_idle` arenas per inference mode and current stream
  // of that device are kept between calls.
  void set_arena_factory(
      std::function<std::unique_ptr<Arena>()> factory,
      int64_t max_idle,
      c10::DeviceType device = c10::DeviceType::CPU) {
    arena_factory_ = std::move(factory);
    arena_device_ = device;
    pool_.set_max_idle(static_cast<size_t>(std::max<int64_t>(max_idle, 0)));
  }

  // The Program's guards (guards.h).
  void set_guards(
      std::vector<InputSpec> specs,
      std::vector<ArenaInput> arena_inputs,
      bool constants_need_grad) {
    guards_.set(std::move(specs), std::move(arena_inputs), constants_need_grad);
  }

  // Free the idle arenas; calls still running keep theirs until they return.
  void release_arenas() {
    pool_.clear();
    frames_.clear();
  }
  size_t idle_arenas() const { return pool_.idle(); }

  // Per-instruction node names (program order), for torch.profiler ranges in timed runs.
  void set_names(const std::vector<std::string>& names) { names_ = names; }

  // A fresh register file: the Program's constants preloaded.
  Registers registers() const { return template_; }

  // Frames (frames.h): the register files and stacks of calls, reused.
  void set_kept_inputs(const std::vector<int64_t>& positions) {
    frames_.keep_inputs(template_.size(), inputs_, positions);
  }
  bool kept(size_t reg) const { return frames_.kept(reg); }
  std::unique_ptr<Frame> take_frame() const { return frames_.take(template_, max_stack_); }
  void give_frame(std::unique_ptr<Frame> frame) const {
    frames_.give_back(std::move(frame), template_, frees_);
  }

  // Whether the inputs in `regs` match the input specs.
  bool inputs_ok(const Registers& regs) const { return guards_.inputs_ok(regs); }

  // Run the instructions on `regs` (inputs written and checked); with `Python`, every
  // instruction's Python form. `Timed` appends pc, start and end (ns, CLOCK_MONOTONIC like
  // Python's perf_counter_ns) of every instruction but FREEs to `timings`; with `ranges`, each
  // runs inside an at::RecordFunction named after its node, so torch.profiler shows it. On an
  // exception `failure` gets the pc and the register file.
  template <bool Timed, bool Python, class Forms>
  void execute(
      Registers& regs,
      const Forms& forms,
      GilState& gil,
      Failure& failure,
      std::vector<int64_t>* timings,
      bool ranges) const {
    Stack stack;
    stack.reserve(max_stack_);
    execute<Timed, Python>(regs, stack, forms, gil, failure, timings, ranges);
  }

  // The same on a frame's stack (take_frame()).
  template <bool Timed, bool Python, class Forms>
  void execute(
      Registers& regs,
      Stack& stack,
      const Forms& forms,
      GilState& gil,
      Failure& failure,
      std::vector<int64_t>* timings,
      bool ranges) const {
    bool inference = c10::InferenceMode::is_enabled();
    const CallModes modes = CallModes::current();  // read once: every instruction uses these
    int64_t stream = arena_factory_ ? stream_key(arena_device_) : 0;
    std::unique_ptr<Arena> arena = Python ? nullptr : take_arena(regs, inference, stream, modes);
    std::optional<DeviceCall> device_call;  // a multi-stream call on a device (streams.h)
    DeviceCall* dev = nullptr;
    size_t pc = 0;
    try {
      if (!Python && streams_.multi()) {
        if (streams_.on_cpu()) {
          run_cpu_streams<Timed>(regs, arena.get(), forms, modes, timings, ranges, pc);
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
            step<Python>(pc, regs, stack, gil, nullptr, forms, modes, dev);
            continue;
          }
          std::optional<at::RecordFunction> range;
          open_range(range, pc, ranges);
          int64_t t0 = now_ns();
          step<Python>(pc, regs, stack, gil, arena.get(), forms, modes, dev);
          int64_t t1 = now_ns();
          if (ins.kind < Instr::STREAM) {
            timings->insert(timings->end(), {static_cast<int64_t>(pc), t0, t1});
          }
        } else {
          step<Python>(pc, regs, stack, gil, arena.get(), forms, modes, dev);
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
  }

 private:
  static int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  // With `ranges`, instruction pc runs inside a torch.profiler range named after its node.
  void open_range(std::optional<at::RecordFunction>& range, size_t pc, bool ranges) const {
    if (ranges && pc < names_.size()) {
      range.emplace(at::RecordScope::USER_SCOPE);
      if (range->isActive()) {
        range->before(std::string_view(names_[pc]), c10::ArrayRef<const IValue>{});
      }
    }
  }


  // A multi-stream program on the CPU (streams.h): the caller's segments here, the others on
  // their workers. Sets `pc` to the failing instruction when it throws.
  template <bool Timed, class Forms>
  void run_cpu_streams(
      Registers& regs,
      const Arena* arena,
      const Forms& forms,
      CallModes modes,
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
            run_on_stream<Timed>(
                pc, regs, stack, gil, arena, forms, modes, call, timings, ranges);
          }
          continue;
        }
        call.task_submitted();
        streams_.worker(seg.stream).submit(
            [this, &call, &regs, &forms, modes, arena, seg, timings, ranges] {
              {  // everything that refers to the call ends before task_done() lets it return
                at::ThreadLocalStateGuard tls(call.tls);
                GilState worker_gil{GilState::Worker{}};
                Stack worker_stack;
                worker_stack.reserve(max_stack_);
                size_t at = seg.begin;
                try {
                  for (; at < seg.end; ++at) {
                    run_on_stream<Timed>(
                        at, regs, worker_stack, worker_gil, arena, forms, modes, call, timings,
                        ranges);
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
  template <bool Timed, class Forms>
  void run_on_stream(
      size_t pc,
      Registers& regs,
      Stack& stack,
      GilState& gil,
      const Arena* arena,
      const Forms& forms,
      CallModes modes,
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
        open_range(range, pc, ranges);
        int64_t t0 = now_ns();
        step<false>(pc, regs, stack, gil, arena, forms, modes, nullptr);
        call.add_timing(timings, static_cast<int64_t>(pc), t0, now_ns());
        return;
      }
    }
    step<false>(pc, regs, stack, gil, arena, forms, modes, nullptr);
  }

  // An arena for this call (see the header comment), or nullptr. Needs the GIL.
  std::unique_ptr<Arena> take_arena(
      const Registers& regs,
      bool inference,
      int64_t stream,
      CallModes modes) const {
    if (!arena_factory_ || !guards_.arena_allowed(regs, inputs_, modes)) {
      return nullptr;
    }
    std::unique_ptr<Arena> arena = pool_.take(inference, stream);
    if (arena != nullptr) {
      return arena;
    }
    return arena_factory_();
  }

  // `dev`: a multi-stream call on a device (STREAM, RECORD and WAIT act on its streams); without
  // it they do nothing: program order is a valid schedule.
  template <bool Python, class Forms>
  void step(
      size_t pc,
      Registers& regs,
      Stack& stack,
      GilState& gil,
      const Arena* arena,
      const Forms& forms,
      CallModes modes,
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
      forms.run(pc, regs, gil);
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
          const at::Tensor& slot = (*arena)[static_cast<size_t>(op.slot)];
          regs[static_cast<size_t>(op.call.outputs[0])] = slot;
          for (size_t k = 1; k < op.call.outputs.size(); ++k) {  // a multi-result call's others
            regs[static_cast<size_t>(op.call.outputs[k])] =
                (*arena)[static_cast<size_t>(op.slot) + k];
          }
          if (op.elementwise.loop != nullptr && run_elementwise(op.elementwise, regs, slot)) {
            return;
          }
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
        } else if (!run_cpu_empty(op, regs, modes)) {
          run_call(op.call, regs, stack, gil);
        }
        return;
      }
      case Instr::VIEW: {
        gil.release();
        const ViewOp& op = views_[ins.index];
        if (!((op.always || arena != nullptr) && run_view(op, regs, modes))) {
          run_call(op.call, regs, stack, gil);
        }
        return;
      }
      case Instr::SYM:
        if (!run_sym(syms_[ins.index], regs)) {
          forms.run(pc, regs, gil);
        }
        return;
      case Instr::KERNEL:
        gil.release();
        run_kernel(kernels_[ins.index], regs);
        return;
      case Instr::PYCALL:
        forms.run(pc, regs, gil);
        return;
      case Instr::FREE:
      case Instr::STREAM:
      case Instr::RECORD:
      case Instr::WAIT:
        return;
    }
  }

  std::function<std::unique_ptr<Arena>()> arena_factory_;
  c10::DeviceType arena_device_ = c10::DeviceType::CPU;
  CallGuards guards_;
  mutable ArenaPool pool_;
  mutable Frames frames_;
};

}  // namespace fxrt
