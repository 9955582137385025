// Helpers the decoder ops share (own_decoder.h, own_rotary.h): which tensors their fast paths
// read, and their results' allocation.

#pragma once

#include "inline_ops.h"
#include "own_attention.h"

#include <ATen/EmptyTensor.h>
#include <c10/core/GradMode.h>

namespace fxrt {
namespace decoder_detail {


using attention_detail::exp_nonpositive;
using attention_detail::kLanes;
using attention_detail::Lanes;
using attention_detail::load_lanes;

// A float32 CPU tensor autograd will not record, whose last dimension is dense.
inline bool plain_rows(const at::Tensor& t) {
  return plain_tensor(t) && t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() >= 1 &&
      (t.size(-1) <= 1 || t.stride(-1) == 1) && !(c10::GradMode::is_enabled() && t.requires_grad());
}

// The distance between consecutive rows when every dimension but the last collapses into one
// (a contiguous tensor, a slice of its columns, a transposed view is not), else -1.
inline int64_t row_stride(const at::Tensor& t) {
  if (t.dim() == 1) {
    return t.size(0);
  }
  const int64_t row = t.stride(-2);
  int64_t expected = row;
  for (int64_t d = t.dim() - 2; d >= 0; --d) {
    if (t.size(d) != 1 && t.stride(d) != expected) {
      return -1;
    }
    expected *= t.size(d);
  }
  return row;
}

inline at::Tensor contiguous_like(const at::Tensor& x) {
  return at::detail::empty_cpu(x.sizes(), at::kFloat, false, c10::MemoryFormat::Contiguous);
}

}  // namespace decoder_detail
}  // namespace fxrt
