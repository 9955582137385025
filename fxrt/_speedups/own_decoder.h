// The kernels of fxrt's own decoder ops (own_decoder_ops.h states the ops and registers them):
// the RMS norm's rows (with and without the residual add) and the gated MLP's activation times up,
// each with its reference path, the ATen chain itself; the rotary kernels are in own_rotary.h.

#pragma once

#include "own_rotary.h"
#include "own_rows.h"

#include <ATen/EmptyTensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/div.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/mean.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/neg.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/rsqrt.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/sqrt.h>
#include <ATen/ops/stack.h>
#include <c10/core/GradMode.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <optional>
#include <string_view>
#include <tuple>
#include <type_traits>

namespace fxrt {
namespace decoder_detail {

// --- rms_norm -----------------------------------------------------------------------------------

// Each row: the sum (x + res, add_rms_norm) rounded to T and stored, the mean square of x in
// float32 (summed in vector lanes, then the lanes pairwise: another order of additions than
// ATen's mean), the normalized value rounded to T, then times (w + offset) rounded to T (float32:
// no rounding at all; bfloat16: each step as eager's bfloat16 ops round it, the norm itself in
// float32 as models write it). float32 rows go through V (GCC's vectorizer made a loop over a
// 16-float array, on AVX2, slower than ATen's chain of six ops); bfloat16 rows through plain
// loops, which widen and narrow as they vectorize.
template <class T, class V>
[[gnu::always_inline]] inline void rms_norm_rows_body(
    const T* x,
    const T* res,  // added to x first (add_rms_norm), or nullptr
    T* sum,  // x + res is stored here when res is given
    const T* w,  // or nullptr
    T* y,
    int64_t rows,
    int64_t n,
    float eps,
    float offset,
    bool eps_outside) {
  using Vt = Vec<V>;
  constexpr bool kFloat = std::is_same_v<T, float>;
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * n;
    T* yr = y + r * n;
    if (res != nullptr) {
      const T* rr = res + r * n;
      T* sr = sum + r * n;
      for (int64_t i = 0; i < n; ++i) {
        sr[i] = narrow<T>(widen(xr[i]) + widen(rr[i]));
      }
      xr = sr;
    }
    float total = 0.0f;
    int64_t i = 0;
    if constexpr (kFloat) {
      V acc = Vt::splat(0.0f);
      for (; i + kLanes <= n; i += kLanes) {
        const V v = Vt::load(xr + i);
        acc += v * v;
      }
      total = sum_lanes(acc);
    } else {
      float acc[kLanes] = {};
      for (; i + kLanes <= n; i += kLanes) {
        for (int64_t l = 0; l < kLanes; ++l) {
          const float v = widen(xr[i + l]);
          acc[l] += v * v;
        }
      }
      for (int64_t l = 0; l < kLanes; ++l) {
        total += acc[l];
      }
    }
    for (; i < n; ++i) {
      total += widen(xr[i]) * widen(xr[i]);
    }
    const float ms = total / static_cast<float>(n);
    // One loop per case, each branch-free.
    auto finish = [&](auto norm) {
      if constexpr (kFloat) {
        const V off = Vt::splat(offset);
        for (int64_t j = 0; j < n; j += kLanes) {
          const int64_t m = std::min(kLanes, n - j);
          V v = norm(load_block<V>(xr + j, m));
          if (w != nullptr) {
            v = offset == 0.0f ? v * load_block<V>(w + j, m) : v * (load_block<V>(w + j, m) + off);
          }
          store_block(yr + j, v, m);
        }
      } else if (w == nullptr) {
        for (int64_t j = 0; j < n; ++j) {
          yr[j] = narrow<T>(norm(widen(xr[j])));
        }
      } else if (offset == 0.0f) {
        for (int64_t j = 0; j < n; ++j) {
          yr[j] = narrow<T>(rounded<T>(norm(widen(xr[j]))) * widen(w[j]));
        }
      } else {
        for (int64_t j = 0; j < n; ++j) {
          const float wj = rounded<T>(widen(w[j]) + offset);
          yr[j] = narrow<T>(rounded<T>(norm(widen(xr[j]))) * wj);
        }
      }
    };
    if (eps_outside) {
      const float d = std::sqrt(ms) + eps;
      finish([d](auto v) { return v / d; });
    } else {
      const float inv = 1.0f / std::sqrt(ms + eps);
      finish([inv](auto v) { return v * inv; });
    }
  }
}

#define FXRT_RMS_NORM_ROWS(T)                                                               \
  FXRT_PER_WIDTH(rms_norm_rows, rms_norm_rows_body, T,                                      \
                 (const T* x, const T* res, T* sum, const T* w, T* y, int64_t rows,         \
                  int64_t n, float eps, float offset, bool eps_outside),                    \
                 (x, res, sum, w, y, rows, n, eps, offset, eps_outside))
FXRT_RMS_NORM_ROWS(float)
FXRT_RMS_NORM_ROWS(c10::BFloat16)
#undef FXRT_RMS_NORM_ROWS

inline bool fast_rms_norm(const at::Tensor& x, const at::Tensor& w) {
  return plain_rows(x) && dense_rows(x) && x.size(-1) > 0 && same_dtype(x, w) &&
      (!w.defined() ||
       (plain_rows(w) && w.dim() == 1 && w.size(0) == x.size(-1) && w.is_contiguous()));
}

// eager's chain: input * rsqrt(input.pow(2).mean(-1, keepdim) + eps) * (weight + offset); for a
// bfloat16 input as models write it: the norm of input.float(), rounded to bfloat16, then the
// weight's product in bfloat16.
inline at::Tensor rms_norm_reference(
    const at::Tensor& x,
    const at::Tensor& w,
    double eps,
    double offset,
    bool eps_outside) {
  const bool widened = x.scalar_type() == at::kBFloat16;
  const at::Tensor xf = widened ? x.to(at::kFloat) : x;
  at::Tensor ms = at::mean(at::pow(xf, 2), {-1}, true);
  at::Tensor y = eps_outside ? at::div(xf, at::add(at::sqrt(ms), eps)) : at::mul(xf, at::rsqrt(at::add(ms, eps)));
  if (widened) {
    y = y.to(x.scalar_type());
  }
  if (!w.defined()) {
    return y;
  }
  return at::mul(y, offset != 0.0 ? at::add(w, offset) : w);
}

inline void run_rms_norm(
    const at::Tensor& x,
    const at::Tensor* res,
    at::Tensor* sum,
    const at::Tensor& w,
    double eps,
    double offset,
    bool eps_outside,
    at::Tensor& y) {
  const int64_t n = x.size(-1);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    rms_norm_rows(
        x.const_data_ptr<T>(), res ? res->const_data_ptr<T>() : nullptr,
        sum ? sum->mutable_data_ptr<T>() : nullptr, w.defined() ? w.const_data_ptr<T>() : nullptr,
        y.mutable_data_ptr<T>(), x.numel() / n, n, static_cast<float>(eps),
        static_cast<float>(offset), eps_outside);
  };
  x.scalar_type() == at::kBFloat16 ? run(c10::BFloat16()) : run(0.0f);
}

// --- gated --------------------------------------------------------------------------------------

enum class Act { kSilu, kGeluTanh };

// The activations lane by lane, selecting with bit operations (each form equals the float
// compare it replaces, -0 and NaN included, or differs only where both sides give one value).
constexpr int32_t kSign = static_cast<int32_t>(0x80000000u);

template <class V>
[[gnu::always_inline]] inline V activate(const V& x, Act act) {
  using T = Vec<V>;
  const auto xb = T::bits(x);
  if (act == Act::kSilu) {
    // x / (1 + e^-x), with e^-|x| (never overflows) and x e^x / (1 + e^x) below zero
    const V e = exp_nonpositive_v<V, false>(T::floats(xb | kSign));  // e^-|x|
    const auto below = xb >> 31;  // all ones where x's sign is set
    const V pick = T::floats((T::bits(e) & below) | (T::bits(T::splat(1.0f)) & ~below));
    return x * pick / (1.0f + e);  // one division (x * 1 is x exactly)
  }
  // 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), tanh(|t|) = (1 - e) / (1 + e)
  const V t = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  const auto tb = T::bits(t);
  const auto mag = tb & 0x7fffffff;
  const V e = exp_nonpositive_v<V, false>(-2.0f * T::floats(mag));
  const V th = (1.0f - e) / (1.0f + e);  // >= 0
  const auto nan = (0x7f800000 - mag) >> 31;  // all ones where t is NaN: it stays NaN
  const auto signed_th = T::bits(th) | (tb & kSign);
  return 0.5f * x * (1.0f + T::floats((tb & nan) | (signed_th & ~nan)));
}

// act(gate) * up over rows of n features; each operand's rows `*_row` apart. bfloat16: the
// activation rounded to bfloat16, then the product (eager's two bfloat16 ops).
template <class T, class V>
[[gnu::always_inline]] inline void gated_rows_body(
    const T* g, int64_t g_row, const T* u, int64_t u_row, T* o, int64_t o_row, int64_t rows,
    int64_t n, Act act) {
  // bfloat16: chunks of a row widened to float32 first, by plain loops (which vectorize; lane by
  // lane into the vector type they would not), then the float32 activation, rounded.
  constexpr int64_t kChunk = 256;
  alignas(64) float gf[kChunk], af[kChunk];
  for (int64_t r = 0; r < rows; ++r) {
    const T* gr = g + r * g_row;
    const T* ur = u + r * u_row;
    T* orow = o + r * o_row;
    if constexpr (std::is_same_v<T, float>) {
      for (int64_t i0 = 0; i0 < n; i0 += kLanes) {
        const int64_t m = std::min(kLanes, n - i0);
        store_block(orow + i0, activate(load_block<V>(gr + i0, m), act) * load_block<V>(ur + i0, m), m);
      }
      continue;
    }
    for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
      const int64_t len = std::min(kChunk, n - c0);
      for (int64_t i = 0; i < len; ++i) {
        gf[i] = widen(gr[c0 + i]);
      }
      for (int64_t i0 = 0; i0 < len; i0 += kLanes) {
        const int64_t m = std::min(kLanes, len - i0);
        store_block(af + i0, activate(load_block<V>(gf + i0, m), act), m);
      }
      for (int64_t i = 0; i < len; ++i) {
        orow[c0 + i] = narrow<T>(rounded<T>(af[i]) * widen(ur[c0 + i]));
      }
    }
  }
}

#define FXRT_GATED_ROWS(T)                                                                  \
  FXRT_PER_WIDTH(gated_rows, gated_rows_body, T,                                            \
                 (const T* g, int64_t g_row, const T* u, int64_t u_row, T* o, int64_t o_row, \
                  int64_t rows, int64_t n, Act act),                                        \
                 (g, g_row, u, u_row, o, o_row, rows, n, act))
FXRT_GATED_ROWS(float)
FXRT_GATED_ROWS(c10::BFloat16)
#undef FXRT_GATED_ROWS

inline std::optional<Act> activation(std::string_view name) {
  if (name == "silu") {
    return Act::kSilu;
  }
  if (name == "gelu_tanh") {
    return Act::kGeluTanh;
  }
  return std::nullopt;
}

inline bool fast_gated(const at::Tensor& gate, const at::Tensor& up) {
  return plain_rows(gate) && plain_rows(up) && same_dtype(gate, up) &&
      gate.sizes().equals(up.sizes()) &&
      gate.numel() > 0 && row_stride(gate) >= 0 && row_stride(up) >= 0;
}

inline at::Tensor gated_reference(const at::Tensor& gate, const at::Tensor& up, Act act) {
  return at::mul(act == Act::kSilu ? at::silu(gate) : at::gelu(gate, "tanh"), up);
}

inline void run_gated(const at::Tensor& gate, const at::Tensor& up, Act act, at::Tensor& out) {
  const int64_t n = gate.size(-1);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    gated_rows(
        gate.const_data_ptr<T>(), row_stride(gate), up.const_data_ptr<T>(), row_stride(up),
        out.mutable_data_ptr<T>(), n, gate.numel() / n, n, act);
  };
  gate.scalar_type() == at::kBFloat16 ? run(c10::BFloat16()) : run(0.0f);
}

inline Act checked_activation(c10::string_view name) {
  std::optional<Act> act = activation(std::string_view(name.data(), name.size()));
  TORCH_CHECK(
      act.has_value(), "fxrt::gated: activation must be 'silu' or 'gelu_tanh', got '",
      std::string(name.data(), name.size()), "'");
  return *act;
}

// An absent optional tensor as an undefined one, which the kernels read as "no weight".
inline const at::Tensor& or_undefined(const std::optional<at::Tensor>& t) {
  static const at::Tensor undefined;
  return t.has_value() ? *t : undefined;
}

}  // namespace decoder_detail

}  // namespace fxrt
