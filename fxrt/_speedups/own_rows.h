// Helpers the decoder ops share (own_decoder.h, own_rotary.h): which tensors their fast paths
// read, their results' allocation, lane blocks and the per-vector-width builds.

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
using attention_detail::sum_lanes;

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

// Memory holds `t`'s rows as whole runs of its last dimension: `t` is dense and that dimension
// is its innermost (a contiguous tensor, or a permuted one whose last dimension stays last, as
// Gemma-3's heads after their transpose). A kernel over rows may then run over memory as
// numel / n rows of n, writing a result of the same strides.
inline bool dense_rows(const at::Tensor& t) {
  return t.dim() >= 1 && (t.size(-1) <= 1 || t.stride(-1) == 1) && t.is_non_overlapping_and_dense();
}

// `a` and `b` lay out their elements alike: equal sizes, equal strides where a size is not 1.
inline bool same_layout(const at::Tensor& a, const at::Tensor& b) {
  if (!a.sizes().equals(b.sizes())) {
    return false;
  }
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (a.size(d) != 1 && a.stride(d) != b.stride(d)) {
      return false;
    }
  }
  return true;
}

// A result for a row kernel over `x` (dense_rows): x's strides, so memory's rows map alike.
inline at::Tensor rows_like(const at::Tensor& x) {
  if (x.is_contiguous()) {
    return contiguous_like(x);
  }
  return at::detail::empty_strided_cpu(x.sizes(), x.strides(), x.scalar_type());
}

// A lane block of `m` floats of `p` (zeros past `m`), and back. A whole block is one copy of a
// constant size (a vector load or store); only the tail copies its length.
template <class V>
[[gnu::always_inline]] inline V load_block(const float* p, int64_t m) {
  if (m == kLanes) {
    return Vec<V>::load(p);
  }
  alignas(64) float tail[kLanes] = {};
  std::memcpy(tail, p, sizeof(float) * m);
  return Vec<V>::load(tail);
}
template <class V>
[[gnu::always_inline]] inline void store_block(float* p, const V& v, int64_t m) {
  Vec<V>::store(p, v, m);
}

// One build per vector width (attention_detail::vector_width), as fxrt::attention's: 16-float
// vectors of GCC's extension only where the target has 16-float registers. `name` calls
// body<T, V> ARGS in the build the CPU runs. O3: the plain loops vectorized with their tails
// (-O2's cost model leaves loops of unknown length scalar); no reassociation.
#define FXRT_PER_WIDTH(name, body, T, PARAMS, ARGS)                                           \
  [[gnu::target("avx512f"), gnu::optimize("O3")]] static void name##_avx512f PARAMS {         \
    body<T, Lanes> ARGS;                                                                      \
  }                                                                                           \
  [[gnu::target("avx2,fma"), gnu::optimize("O3")]] static void name##_avx2 PARAMS {           \
    body<T, Pair> ARGS;                                                                       \
  }                                                                                           \
  [[gnu::optimize("O3")]] static void name##_baseline PARAMS { body<T, Pair> ARGS; }          \
  inline void name PARAMS {                                                                   \
    switch (attention_detail::vector_width()) {                                               \
      case attention_detail::Width::k512:                                                     \
        return name##_avx512f ARGS;                                                           \
      case attention_detail::Width::k256:                                                     \
        return name##_avx2 ARGS;                                                              \
      default:                                                                                \
        return name##_baseline ARGS;                                                          \
    }                                                                                         \
  }

// NAME(const PARAMS<T>&), calling NAME_body: O3 as for rms_norm_rows (own_decoder.h), no
// contraction (each product rounds before its sum, as eager's ops), one clone per vector width.
#define FXRT_ROWS_KERNEL(NAME, PARAMS, T)                                                   \
  [[gnu::target_clones("avx512f", "avx2", "default"), gnu::optimize("O3", "fp-contract=off")]] \
  static void NAME(const PARAMS<T>& p) {                                                    \
    NAME##_body(p);                                                                         \
  }

}  // namespace decoder_detail
}  // namespace fxrt
