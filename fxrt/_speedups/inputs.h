// The per-call input check of the compiled loop (fxrt/exec/inputs.py words the error): each tensor
// input against the dtype, device, rank, sizes and strides its graph was compiled for.

#pragma once

#include <ATen/core/ivalue.h>
#include <c10/core/Device.h>
#include <c10/util/SmallVector.h>

#include <cstdint>
#include <vector>

namespace fxrt {

// What each call checks about one tensor input (fxrt/exec/inputs.py, InputSpec): sizes and strides
// >= 0 must match exactly, -1 is not checked, a size -2 - k is size symbol k (one value per call).
// Strides -2 - k (all of an input's, or none) say the input must be dense in the order they give,
// k = 0 the innermost dimension (a symbolic-size input traced contiguous, or permuted).
struct InputSpec {
  size_t reg;
  at::ScalarType dtype;
  c10::Device device;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  std::vector<size_t> dense;  // with strides -2 - k: the dimensions, innermost first (set_dense)
};

// Fills spec.dense from the stride codes (once, when the specs are set).
inline void set_dense(InputSpec& spec) {
  spec.dense.clear();
  if (spec.strides.empty() || spec.strides[0] >= -1) {
    return;
  }
  spec.dense.resize(spec.strides.size());
  for (size_t d = 0; d < spec.strides.size(); ++d) {
    spec.dense[static_cast<size_t>(-2 - spec.strides[d])] = d;
  }
}

// True when every input in `regs` matches its spec; `n_symbols` size symbols are bound per call.
inline bool inputs_match(
    const std::vector<InputSpec>& specs,
    size_t n_symbols,
    const std::vector<c10::IValue>& regs) {
  c10::SmallVector<int64_t, 8> bound(n_symbols, -1);
  for (const InputSpec& spec : specs) {
    const c10::IValue& v = regs[spec.reg];
    if (!v.isTensor()) {
      return false;
    }
    const at::Tensor& t = v.toTensor();
    if (t.scalar_type() != spec.dtype || t.device() != spec.device ||
        t.dim() != static_cast<int64_t>(spec.sizes.size())) {
      return false;
    }
    c10::IntArrayRef sizes = t.sizes();
    c10::IntArrayRef strides = t.strides();
    const size_t rank = spec.sizes.size();
    if (!spec.dense.empty()) {
      int64_t expected = 1;
      for (size_t d : spec.dense) {
        if (sizes[d] != 1 && strides[d] != expected) {
          return false;
        }
        expected *= sizes[d];
      }
    }
    for (size_t d = 0; d < rank; ++d) {
      int64_t want = spec.sizes[d];
      if (want >= 0) {
        if (sizes[d] != want) {
          return false;
        }
      } else if (want != -1) {
        int64_t& b = bound[static_cast<size_t>(-2 - want)];
        if (b < 0) {
          b = sizes[d];
        } else if (b != sizes[d]) {
          return false;
        }
      }
      if (spec.strides[d] >= 0 && strides[d] != spec.strides[d]) {
        return false;
      }
    }
  }
  return true;
}

}  // namespace fxrt
