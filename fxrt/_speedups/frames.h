// Frames: a call's register file and stack, kept between calls (slots.h) instead of made and
// freed by each one. An idle frame holds the Program's constants and the kept inputs, every other
// register empty: a successful call empties the registers it left set (the inputs, the outputs and
// what aliases them), and a failed one drops its frame (the error holds its registers).
//
// Kept inputs are the static ones (parameters and buffers, by input position): their register
// keeps the tensor between calls, so that a call passing the same tensor again writes nothing
// there and takes no reference (a tensor Python owns pays for each new C++ reference with one to
// its Python object). A frame so holds the last tensors it ran with until a call passes others,
// or release_arenas() frees the idle frames. The static inputs are chosen before calls start (in
// the Python build, with the GIL held, as every call reads them).
#pragma once

#include "call_op.h"
#include "slots.h"

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace fxrt {

struct Frame {
  std::vector<IValue> regs;
  Stack stack;
};

class Frames {
 public:
  // `positions`: indices into `input_regs` (the registers of the graph inputs). Idle frames
  // are dropped: they were emptied for the previous choice.
  void keep_inputs(
      size_t n_regs,
      const std::vector<int64_t>& input_regs,
      const std::vector<int64_t>& positions) {
    std::lock_guard<std::mutex> lock(mu_);
    kept_.assign(n_regs, 0);
    for (int64_t i : positions) {
      kept_.at(static_cast<size_t>(input_regs.at(static_cast<size_t>(i)))) = 1;
    }
    leftover_.clear();
    known_.store(false, std::memory_order_release);
    slots_.clear();
  }

  bool kept(size_t reg) const { return !kept_.empty() && kept_[reg] != 0; }

  // An idle frame, or a new one made from the Program's register template.
  std::unique_ptr<Frame> take(const std::vector<IValue>& tmpl, size_t max_stack) {
    std::unique_ptr<Frame> frame = slots_.take();
    if (frame == nullptr) {
      frame = std::make_unique<Frame>();
      frame->regs = tmpl;
      frame->stack.reserve(max_stack);
    }
    return frame;
  }

  // After a successful call (the GIL held in the Python build: emptied registers may drop the
  // last reference to a tensor Python made). `frees`: the Program's FREE instructions.
  void give_back(
      std::unique_ptr<Frame> frame,
      const std::vector<IValue>& tmpl,
      const std::vector<std::vector<int64_t>>& frees) {
    if (!known_.load(std::memory_order_acquire)) {
      find_leftover(tmpl, frees);
    }
    for (size_t r : leftover_) {
      frame->regs[r] = IValue();
    }
    frame->stack.clear();
    slots_.give_back(std::move(frame));
  }

  void clear() { slots_.clear(); }

 private:
  void find_leftover(const std::vector<IValue>& tmpl, const std::vector<std::vector<int64_t>>& frees) {
    std::lock_guard<std::mutex> lock(mu_);
    if (known_.load(std::memory_order_relaxed)) {
      return;
    }
    std::vector<char> fixed(tmpl.size(), 0);  // a constant, a kept input, or freed by the run
    for (size_t r = 0; r < tmpl.size(); ++r) {
      fixed[r] = !tmpl[r].isNone() || kept(r);
    }
    for (const auto& regs : frees) {
      for (int64_t r : regs) {
        fixed[static_cast<size_t>(r)] = 1;
      }
    }
    for (size_t r = 0; r < fixed.size(); ++r) {
      if (!fixed[r]) {
        leftover_.push_back(r);
      }
    }
    known_.store(true, std::memory_order_release);
  }

  std::vector<char> kept_;  // per register
  Slots<Frame> slots_;
  std::mutex mu_;
  std::atomic<bool> known_{false};  // leftover_ computed
  std::vector<size_t> leftover_;  // the registers a successful call leaves set
};

}  // namespace fxrt
