// The compiled loop's program (loop.h runs it): the bound instructions in program order, one
// table per kind (Instr says which table and where), the register template (the Program's
// constants preloaded), the input registers and the stream schedule. Built once, instruction by
// instruction, by the add_* methods; immutable afterwards.
#pragma once

#include "c_kernel.h"
#include "call.h"
#include "inline_ops.h"
#include "streams.h"
#include "sym.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace fxrt {

using Registers = std::vector<IValue>;

struct Instr {
  enum Kind : uint8_t { CALL, OUT, ALLOC, VIEW, SYM, KERNEL, PYCALL, FREE, STREAM, RECORD, WAIT };
  Kind kind;
  // into calls_, outs_, allocs_, views_, syms_, kernels_, frees_, stream_ops_, records_ or
  // waits_; the pc for PYCALL
  size_t index;
};

class Code {
 public:
  explicit Code(int64_t n_regs) : template_(static_cast<size_t>(n_regs)) {}

  void set_inputs(const std::vector<int64_t>& regs) { inputs_ = regs; }
  const std::vector<int64_t>& inputs() const { return inputs_; }

  void set_constant_value(int64_t reg, IValue value) {
    template_.at(static_cast<size_t>(reg)) = std::move(value);
  }

  void add_free(const std::vector<int64_t>& regs) {
    code_.push_back({Instr::FREE, frees_.size()});
    frees_.push_back(regs);
  }

  // The bound instructions, in program order.
  void add_call_op(CallOp call) {
    grow_stack(call);
    code_.push_back({Instr::CALL, calls_.size()});
    calls_.push_back(std::move(call));
  }
  void add_out_op(OutOp out) {
    grow_stack(out.call);
    grow_stack(out.out);
    code_.push_back({Instr::OUT, outs_.size()});
    outs_.push_back(std::move(out));
  }
  void add_alloc_op(AllocOp alloc) {
    grow_stack(alloc.call);
    code_.push_back({Instr::ALLOC, allocs_.size()});
    allocs_.push_back(std::move(alloc));
  }
  void add_view_op(ViewOp view) {
    grow_stack(view.call);
    code_.push_back({Instr::VIEW, views_.size()});
    views_.push_back(std::move(view));
  }
  void add_sym_op(SymOp sym) {
    code_.push_back({Instr::SYM, syms_.size()});
    syms_.push_back(std::move(sym));
  }
  void add_kernel_op(KernelOp kernel) {
    code_.push_back({Instr::KERNEL, kernels_.size()});
    kernels_.push_back(std::move(kernel));
  }
  void add_python_op() { code_.push_back({Instr::PYCALL, code_.size()}); }

  // STREAM, RECORD and WAIT (streams.h); set_streams() once they are all added.
  void add_stream(int64_t stream) {
    code_.push_back({Instr::STREAM, stream_ops_.size()});
    stream_ops_.push_back({stream});
  }
  void add_record(int64_t stream, int64_t event) {
    code_.push_back({Instr::RECORD, records_.size()});
    records_.push_back({stream, event});
  }
  void add_wait(
      int64_t stream,
      const std::vector<int64_t>& events,
      const std::vector<int64_t>& protect) {
    code_.push_back({Instr::WAIT, waits_.size()});
    waits_.push_back({stream, events, protect});
  }
  // A multi-stream program: `n_streams` streams (the caller's included) on device type
  // `device` ("cpu": worker threads), `n_events` events per call.
  void set_streams(int64_t n_streams, const std::string& device, int64_t n_events) {
    streams_.configure(n_streams, device, n_events);
    streams_.cut(code_.size(), [this](size_t pc) -> int64_t {
      return code_[pc].kind == Instr::STREAM ? stream_ops_[code_[pc].index].stream : -1;
    });
  }

  size_t size() const { return code_.size(); }

 protected:
  void grow_stack(const CallOp& call) {
    max_stack_ = std::max({max_stack_, call.args.size(), call.n_returns});
  }
  Registers template_;
  std::vector<int64_t> inputs_;
  std::vector<Instr> code_;
  std::vector<CallOp> calls_;
  std::vector<OutOp> outs_;
  std::vector<AllocOp> allocs_;
  std::vector<ViewOp> views_;
  std::vector<SymOp> syms_;
  std::vector<KernelOp> kernels_;
  std::vector<std::vector<int64_t>> frees_;
  std::vector<StreamOp> stream_ops_;
  std::vector<RecordOp> records_;
  std::vector<WaitOp> waits_;
  mutable StreamSet streams_;
  std::vector<std::string> names_;
  size_t max_stack_ = 0;
};

}  // namespace fxrt
