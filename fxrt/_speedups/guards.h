// A Program's guards (fxrt/exec/guards.py, whose Python twins the Python loop runs), as the
// compiled loop checks them on each call: the input specs (inputs.h), and whether the call may
// run on an arena. A call may not when autograd could record it (grad mode on and an input or
// constant requires grad), a TorchDispatchMode is active (it must see the graph's own ops), new
// memory must be filled, or an input's size or dtype differs from what the arena was planned for.
#pragma once

#include "arena_pool.h"
#include "inline_ops.h"
#include "inputs.h"

#include <ATen/core/ivalue.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace fxrt {

class CallGuards {
 public:
  // `specs`: what every call checks; `arena_inputs`: the inputs the arena needs in their compiled
  // size and dtype; `constants_need_grad`: whether a constant requires grad.
  void set(
      std::vector<InputSpec> specs,
      std::vector<ArenaInput> arena_inputs,
      bool constants_need_grad) {
    int64_t n_symbols = 0;
    for (InputSpec& spec : specs) {
      set_dense(spec);
      for (int64_t s : spec.sizes) {
        n_symbols = std::max(n_symbols, -1 - s);
      }
    }
    n_symbols_ = static_cast<size_t>(n_symbols);
    specs_ = std::move(specs);
    arena_inputs_ = std::move(arena_inputs);
    constants_need_grad_ = constants_need_grad;
  }

  // Whether the inputs in `regs` match the input specs.
  bool inputs_ok(const std::vector<c10::IValue>& regs) const {
    return specs_.empty() || inputs_match(specs_, n_symbols_, regs);
  }

  // Whether a call on `regs` (the graph inputs in registers `inputs`) may use an arena.
  bool arena_allowed(
      const std::vector<c10::IValue>& regs,
      const std::vector<int64_t>& inputs,
      CallModes modes) const {
    if (modes.dispatch || modes.fill) {
      return false;  // a dispatch mode must see the graph's own ops; new memory is filled
    }
    if (c10::GradMode::is_enabled()) {
      if (constants_need_grad_) {
        return false;
      }
      for (int64_t r : inputs) {
        const c10::IValue& v = regs[static_cast<size_t>(r)];
        if (v.isTensor() && v.toTensor().requires_grad()) {
          return false;
        }
      }
    }
    for (const ArenaInput& g : arena_inputs_) {
      const c10::IValue& v = regs[g.reg];
      if (!v.isTensor() || v.toTensor().scalar_type() != g.dtype ||
          !v.toTensor().sizes().equals(g.sizes)) {
        return false;
      }
    }
    return true;
  }

 private:
  std::vector<InputSpec> specs_;
  size_t n_symbols_ = 0;
  std::vector<ArenaInput> arena_inputs_;
  bool constants_need_grad_ = false;
};

}  // namespace fxrt
