// Helpers the decoder ops share (own_decoder.h, own_rotary.h): which tensors their fast paths
// read, and their results' allocation.

#pragma once

#include "inline_ops.h"
#include "own_attention.h"

#include <ATen/EmptyTensor.h>
#include <c10/core/GradMode.h>
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

namespace fxrt {
namespace decoder_detail {


using attention_detail::exp_nonpositive_v;
using attention_detail::Pair;
using attention_detail::Vec;
using attention_detail::kLanes;
using attention_detail::Lanes;
using attention_detail::load_lanes;

// A float32 or bfloat16 CPU tensor autograd will not record, whose last dimension is dense. (The
// fast paths also need every operand of one dtype: same_dtype.)
inline bool plain_rows(const at::Tensor& t) {
  const at::ScalarType s = t.scalar_type();
  return plain_tensor(t) && t.device().is_cpu() && (s == at::kFloat || s == at::kBFloat16) &&
      t.dim() >= 1 && (t.size(-1) <= 1 || t.stride(-1) == 1) &&
      !(c10::GradMode::is_enabled() && t.requires_grad());
}

inline bool same_dtype(const at::Tensor& a, const at::Tensor& b) {
  return !b.defined() || a.scalar_type() == b.scalar_type();
}

// Element types the row kernels read and write: float32 as it is; bfloat16 widened to float32
// for the arithmetic and each result rounded back (to nearest, ties to even, as ATen's own
// bfloat16 ops round theirs).
// The conversions c10::BFloat16 makes, written on its bits so that the loops around them
// vectorize: widening is exact; narrowing rounds to nearest, ties to even, NaN to 0x7FC0.
inline float widen(float x) {
  return x;
}
inline float widen(c10::BFloat16 x) {
  const uint32_t u = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
template <class T>
inline T narrow(float x) {
  return x;
}
template <>
inline c10::BFloat16 narrow<c10::BFloat16>(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return c10::BFloat16(static_cast<uint16_t>(f != f ? 0x7FC0u : rounded), c10::BFloat16::from_bits());
}
// A bfloat16 op's result as eager rounds it, read back as float32 (float32: the value itself).
template <class T>
inline float rounded(float x) {
  return widen(narrow<T>(x));
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
  return at::detail::empty_cpu(x.sizes(), x.scalar_type(), false, c10::MemoryFormat::Contiguous);
}

}  // namespace decoder_detail
}  // namespace fxrt
