// fxrt's own CPU ops for the pieces of a decoder block that models write as chains of small ATen
// ops (fxrt/patterns rewrites the chains to them). Each op has a reference path that is the ATen
// chain itself, op for op, which runs whenever the fast path does not apply (another device or
// dtype, a layout the fast path does not read, autograd recording, a dispatch mode, a subclass,
// the meta device while fxrt computes a rewrite's shapes), so nothing but the fast path differs
// from eager. The fast paths read float32 CPU tensors once and write their results once.
//
// fxrt::rms_norm(Tensor input, Tensor? weight, float eps, float weight_offset=0.,
//                bool eps_outside=False) -> Tensor, and its out= overload.
//   y = input * rsqrt(mean(input^2, -1) + eps) * (weight + weight_offset), or with eps_outside
//   y = input / (sqrt(mean(input^2, -1)) + eps) * (...). Each row's sum of squares is taken in
//   vector lanes (another order of additions than ATen's mean); the rest rounds as eager does.
//
// fxrt::add_rms_norm(Tensor input, Tensor residual, Tensor? weight, float eps,
//                    float weight_offset=0., bool eps_outside=False) -> (Tensor, Tensor)
//   (rms_norm(input + residual), input + residual): the residual stream's add and the next norm.
//
// fxrt::rotary(Tensor q, Tensor k, Tensor cos, Tensor sin, int rotary_dim=-1,
//              bool interleaved=False) -> (Tensor, Tensor)
//   x * cos + rotate(x) * sin for x = q and x = k in one call. rotary_dim -1: every feature, the
//   result laid out as eager's elementwise ops lay it out; rotary_dim r: the first r features,
//   the rest passed through (none when r is all of them), as partial rotary embeddings cat them
//   back: cat's contiguous layout. rotate is rotate_half (cat(-x2, x1)), or with interleaved the
//   pairs' (-x[2i+1], x[2i]). Every product and sum is eager's, in eager's order: results are
//   eager's, bit for bit.
//
// fxrt::gated(Tensor gate, Tensor up, str activation='silu') -> Tensor, and its out= overload.
//   act(gate) * up, act = silu or gelu(approximate='tanh'), the gated MLP's product. The
//   activations use a vectorized exponential (within a few float32 ulps of ATen's).

#pragma once

#include "inline_ops.h"
#include "own_attention.h"

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

// --- rms_norm -----------------------------------------------------------------------------------

// O3: the elementwise loops vectorized with their tails (-O2's cost model leaves loops of
// unknown length scalar); no reassociation, so each element rounds as before.
[[gnu::target_clones("avx512f", "avx2", "default"), gnu::optimize("O3")]] static void
rms_norm_rows(
    const float* x,
    const float* res,  // added to x first (add_rms_norm), or nullptr
    float* sum,  // x + res is stored here when res is given
    const float* w,  // or nullptr
    float* y,
    int64_t rows,
    int64_t n,
    float eps,
    float offset,
    bool eps_outside) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float* yr = y + r * n;
    if (res != nullptr) {
      const float* rr = res + r * n;
      float* sr = sum + r * n;
      for (int64_t i = 0; i < n; ++i) {
        sr[i] = xr[i] + rr[i];
      }
      xr = sr;
    }
    Lanes acc = {};
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) {
      const Lanes v = load_lanes(xr + i);
      acc += v * v;
    }
    float total = 0.0f;
    for (int64_t l = 0; l < kLanes; ++l) {
      total += acc[l];
    }
    for (; i < n; ++i) {
      total += xr[i] * xr[i];
    }
    const float ms = total / static_cast<float>(n);
    if (eps_outside) {
      const float d = std::sqrt(ms) + eps;
      for (int64_t j = 0; j < n; ++j) {
        yr[j] = w != nullptr ? xr[j] / d * (w[j] + offset) : xr[j] / d;
      }
    } else {
      const float inv = 1.0f / std::sqrt(ms + eps);
      for (int64_t j = 0; j < n; ++j) {
        yr[j] = w != nullptr ? xr[j] * inv * (w[j] + offset) : xr[j] * inv;
      }
    }
  }
}

inline bool fast_rms_norm(const at::Tensor& x, const at::Tensor& w) {
  return plain_rows(x) && x.is_contiguous() && x.size(-1) > 0 &&
      (!w.defined() ||
       (plain_rows(w) && w.dim() == 1 && w.size(0) == x.size(-1) && w.is_contiguous()));
}

// eager's chain: input * rsqrt(input.pow(2).mean(-1, keepdim) + eps) * (weight + offset)
inline at::Tensor rms_norm_reference(
    const at::Tensor& x,
    const at::Tensor& w,
    double eps,
    double offset,
    bool eps_outside) {
  at::Tensor ms = at::mean(at::pow(x, 2), {-1}, true);
  at::Tensor y = eps_outside ? at::div(x, at::add(at::sqrt(ms), eps)) : at::mul(x, at::rsqrt(at::add(ms, eps)));
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
  rms_norm_rows(
      x.const_data_ptr<float>(), res ? res->const_data_ptr<float>() : nullptr,
      sum ? sum->mutable_data_ptr<float>() : nullptr, w.defined() ? w.const_data_ptr<float>() : nullptr,
      y.mutable_data_ptr<float>(), x.numel() / n, n, static_cast<float>(eps),
      static_cast<float>(offset), eps_outside);
}

inline at::Tensor contiguous_like(const at::Tensor& x) {
  return at::detail::empty_cpu(x.sizes(), at::kFloat, false, c10::MemoryFormat::Contiguous);
}

// --- rotary -------------------------------------------------------------------------------------

struct RopeRows {
  const float* x;
  const float* cos;
  const float* sin;
  float* out;
  int64_t sizes[3];  // the leading dimensions (x padded to 4-D on the left)
  int64_t xs[3], cs[3], ss[3], os[3];  // their strides (0 where cos/sin broadcast)
  int64_t d, rot;  // features, rotated features
  bool interleaved;
};

// No fused multiply-adds: each product is rounded before the sum, as eager's mul and add. O3 as
// for rms_norm_rows.
[[gnu::target_clones("avx512f", "avx2", "default"), gnu::optimize("O3", "fp-contract=off")]]
static void rope_rows(const RopeRows& p) {
  const int64_t half = p.rot / 2;
  for (int64_t a = 0; a < p.sizes[0]; ++a) {
    for (int64_t b = 0; b < p.sizes[1]; ++b) {
      for (int64_t c = 0; c < p.sizes[2]; ++c) {
        const float* x = p.x + a * p.xs[0] + b * p.xs[1] + c * p.xs[2];
        const float* cs = p.cos + a * p.cs[0] + b * p.cs[1] + c * p.cs[2];
        const float* sn = p.sin + a * p.ss[0] + b * p.ss[1] + c * p.ss[2];
        float* o = p.out + a * p.os[0] + b * p.os[1] + c * p.os[2];
        if (p.interleaved) {
          for (int64_t i = 0; i < half; ++i) {
            const float x0 = x[2 * i], x1 = x[2 * i + 1];
            const float a0 = x0 * cs[2 * i], b0 = -x1 * sn[2 * i];
            const float a1 = x1 * cs[2 * i + 1], b1 = x0 * sn[2 * i + 1];
            o[2 * i] = a0 + b0;
            o[2 * i + 1] = a1 + b1;
          }
        } else {
          for (int64_t i = 0; i < half; ++i) {
            const float a0 = x[i] * cs[i], b0 = -x[i + half] * sn[i];
            o[i] = a0 + b0;
          }
          for (int64_t i = half; i < p.rot; ++i) {
            const float a1 = x[i] * cs[i], b1 = x[i - half] * sn[i];
            o[i] = a1 + b1;
          }
        }
        for (int64_t i = p.rot; i < p.d; ++i) {
          o[i] = x[i];
        }
      }
    }
  }
}

// The stride of dimension d of `t` read as broadcast to x's 4-D shape (right-aligned).
inline int64_t broadcast_stride(const at::Tensor& t, int64_t d, int64_t x_dim) {
  const int64_t td = d - (x_dim - t.dim());
  return td < 0 || t.size(td) == 1 ? 0 : t.stride(td);
}

inline bool broadcasts_to(const at::Tensor& t, const at::Tensor& x, int64_t rot) {
  if (t.dim() > x.dim() || t.size(-1) != rot || (rot > 1 && t.stride(-1) != 1)) {
    return false;
  }
  for (int64_t d = 1; d < t.dim(); ++d) {
    const int64_t s = t.size(t.dim() - 1 - d);
    if (s != 1 && s != x.size(x.dim() - 1 - d)) {
      return false;
    }
  }
  return true;
}

inline bool fast_rotary(
    const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t rot) {
  if (!plain_rows(x) || !plain_rows(cos) || !plain_rows(sin) || x.dim() < 1 || x.dim() > 4) {
    return false;
  }
  const int64_t d = x.size(-1);
  return rot > 0 && rot <= d && rot % 2 == 0 && broadcasts_to(cos, x, rot) &&
      broadcasts_to(sin, x, rot);
}

// Eager's layout: the elementwise ops' (TensorIterator's): x's when it is dense, else the dense
// layout that keeps its order of dimensions, as empty_like makes it; after cat: contiguous.
inline at::Tensor rope_out(const at::Tensor& x, bool partial) {
  return partial ? contiguous_like(x) : at::empty_like(x);
}

inline at::Tensor run_rotary(
    const at::Tensor& x,
    const at::Tensor& cos,
    const at::Tensor& sin,
    int64_t rot,
    bool inter,
    bool cat_layout) {
  at::Tensor out = rope_out(x, cat_layout);
  RopeRows p{
      x.const_data_ptr<float>(), cos.const_data_ptr<float>(), sin.const_data_ptr<float>(),
      out.mutable_data_ptr<float>(), {1, 1, 1}, {0, 0, 0}, {0, 0, 0}, {0, 0, 0}, {0, 0, 0},
      x.size(-1), rot, inter};
  const int64_t lead = x.dim() - 1;
  for (int64_t i = 0; i < lead; ++i) {
    const int64_t slot = 3 - lead + i;
    p.sizes[slot] = x.size(i);
    p.xs[slot] = x.stride(i);
    p.os[slot] = out.stride(i);
    p.cs[slot] = broadcast_stride(cos, i, x.dim());
    p.ss[slot] = broadcast_stride(sin, i, x.dim());
  }
  if (out.numel() > 0) {
    rope_rows(p);
  }
  return out;
}

// eager's chain: x_rot * cos + rotate(x_rot) * sin, then cat with the features not rotated.
inline at::Tensor rotary_reference(
    const at::Tensor& x,
    const at::Tensor& cos,
    const at::Tensor& sin,
    int64_t rot,
    bool inter,
    bool cat_layout) {
  const int64_t d = x.size(-1);
  const at::Tensor xr = rot == d ? x : x.slice(-1, 0, rot);
  at::Tensor rotated;
  if (inter) {
    const at::Tensor x1 = xr.slice(-1, 0, rot, 2), x2 = xr.slice(-1, 1, rot, 2);
    rotated = at::stack({at::neg(x2), x1}, -1).flatten(-2);
  } else {
    rotated = at::cat({at::neg(xr.slice(-1, rot / 2, rot)), xr.slice(-1, 0, rot / 2)}, -1);
  }
  at::Tensor y = at::add(at::mul(xr, cos), at::mul(rotated, sin));
  return cat_layout ? at::cat({y, x.slice(-1, rot, d)}, -1) : y;
}

// --- gated --------------------------------------------------------------------------------------

enum class Act { kSilu, kGeluTanh };

// act(gate) * up over rows of n features; each operand's rows `*_row` apart.
[[gnu::target_clones("avx512f", "avx2", "default")]] static void gated_rows(
    const float* g,
    int64_t g_row,
    const float* u,
    int64_t u_row,
    float* o,
    int64_t o_row,
    int64_t rows,
    int64_t n,
    Act act) {
  const Lanes zero = {};
  for (int64_t r = 0; r < rows; ++r) {
    const float* gr = g + r * g_row;
    const float* ur = u + r * u_row;
    float* orow = o + r * o_row;
    for (int64_t i0 = 0; i0 < n; i0 += kLanes) {
      const int64_t m = std::min(kLanes, n - i0);
      Lanes x = {}, up = {};
      std::memcpy(&x, gr + i0, sizeof(float) * m);
      std::memcpy(&up, ur + i0, sizeof(float) * m);
      Lanes a;
      if (act == Act::kSilu) {
        // x / (1 + e^-x), with e^-|x| (never overflows) and x e^x / (1 + e^x) below zero
        const Lanes neg = x < zero ? x : -x;
        const Lanes e = exp_nonpositive(neg);
        a = x < zero ? x * e / (1.0f + e) : x / (1.0f + e);
      } else {
        // 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), tanh(|t|) = (1 - e) / (1 + e)
        const Lanes t = 0.7978845608028654f * (x + 0.044715f * x * x * x);
        const Lanes abs = t < zero ? -t : t;
        const Lanes e = exp_nonpositive(-2.0f * abs);
        Lanes th = (1.0f - e) / (1.0f + e);
        th = t < zero ? -th : th;
        th = t != t ? t : th;  // NaN stays NaN
        a = 0.5f * x * (1.0f + th);
      }
      const Lanes y = a * up;
      std::memcpy(orow + i0, &y, sizeof(float) * m);
    }
  }
}

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
  return plain_rows(gate) && plain_rows(up) && gate.sizes().equals(up.sizes()) &&
      gate.numel() > 0 && row_stride(gate) >= 0 && row_stride(up) >= 0;
}

inline at::Tensor gated_reference(const at::Tensor& gate, const at::Tensor& up, Act act) {
  return at::mul(act == Act::kSilu ? at::silu(gate) : at::gelu(gate, "tanh"), up);
}

inline void run_gated(const at::Tensor& gate, const at::Tensor& up, Act act, at::Tensor& out) {
  const int64_t n = gate.size(-1);
  gated_rows(
      gate.const_data_ptr<float>(), row_stride(gate), up.const_data_ptr<float>(), row_stride(up),
      out.mutable_data_ptr<float>(), n, gate.numel() / n, n, act);
}

inline Act checked_activation(c10::string_view name) {
  std::optional<Act> act = activation(std::string_view(name.data(), name.size()));
  TORCH_CHECK(
      act.has_value(), "fxrt::gated: activation must be 'silu' or 'gelu_tanh', got '",
      std::string(name.data(), name.size()), "'");
  return *act;
}

}  // namespace decoder_detail

// --- the ops ------------------------------------------------------------------------------------

inline at::Tensor rms_norm(
    const at::Tensor& input,
    const std::optional<at::Tensor>& weight,
    double eps,
    double weight_offset,
    bool eps_outside) {
  using namespace decoder_detail;
  const at::Tensor& w = weight.has_value() ? *weight : at::Tensor();
  if (!fast_rms_norm(input, w)) {
    return rms_norm_reference(input, w, eps, weight_offset, eps_outside);
  }
  at::Tensor out = contiguous_like(input);
  run_rms_norm(input, nullptr, nullptr, w, eps, weight_offset, eps_outside, out);
  return out;
}

inline at::Tensor& rms_norm_out(
    const at::Tensor& input,
    const std::optional<at::Tensor>& weight,
    double eps,
    double weight_offset,
    bool eps_outside,
    at::Tensor& out) {
  using namespace decoder_detail;
  const at::Tensor& w = weight.has_value() ? *weight : at::Tensor();
  if (fast_rms_norm(input, w) && out.scalar_type() == at::kFloat && out.is_contiguous() &&
      out.sizes().equals(input.sizes())) {
    run_rms_norm(input, nullptr, nullptr, w, eps, weight_offset, eps_outside, out);
  } else {
    out.copy_(rms_norm_reference(input, w, eps, weight_offset, eps_outside));
  }
  return out;
}

inline std::tuple<at::Tensor, at::Tensor> add_rms_norm(
    const at::Tensor& input,
    const at::Tensor& residual,
    const std::optional<at::Tensor>& weight,
    double eps,
    double weight_offset,
    bool eps_outside) {
  using namespace decoder_detail;
  const at::Tensor& w = weight.has_value() ? *weight : at::Tensor();
  if (fast_rms_norm(input, w) && plain_rows(residual) && residual.is_contiguous() &&
      residual.sizes().equals(input.sizes())) {
    at::Tensor sum = contiguous_like(input);
    at::Tensor out = contiguous_like(input);
    run_rms_norm(input, &residual, &sum, w, eps, weight_offset, eps_outside, out);
    return {out, sum};
  }
  at::Tensor sum = at::add(input, residual);
  return {rms_norm_reference(sum, w, eps, weight_offset, eps_outside), sum};
}

inline std::tuple<at::Tensor, at::Tensor> rotary(
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& cos,
    const at::Tensor& sin,
    int64_t rotary_dim,
    bool interleaved) {
  using namespace decoder_detail;
  const int64_t rot = rotary_dim < 0 ? q.size(-1) : rotary_dim;
  TORCH_CHECK(
      rot <= q.size(-1) && rot <= k.size(-1) && rot % 2 == 0, "fxrt::rotary: rotary_dim ", rot,
      " must be even and at most the features of q (", q.size(-1), ") and k (", k.size(-1), ")");
  const bool cat_layout = rotary_dim >= 0;
  if (fast_rotary(q, cos, sin, rot) && fast_rotary(k, cos, sin, rot)) {
    return {
        run_rotary(q, cos, sin, rot, interleaved, cat_layout),
        run_rotary(k, cos, sin, rot, interleaved, cat_layout)};
  }
  return {
      rotary_reference(q, cos, sin, rot, interleaved, cat_layout),
      rotary_reference(k, cos, sin, rot, interleaved, cat_layout)};
}

inline at::Tensor gated(const at::Tensor& gate, const at::Tensor& up, c10::string_view activation) {
  using namespace decoder_detail;
  const Act act = checked_activation(activation);
  if (!fast_gated(gate, up)) {
    return gated_reference(gate, up, act);
  }
  at::Tensor out = contiguous_like(gate);
  run_gated(gate, up, act, out);
  return out;
}

inline at::Tensor& gated_out(
    const at::Tensor& gate, const at::Tensor& up, c10::string_view activation, at::Tensor& out) {
  using namespace decoder_detail;
  const Act act = checked_activation(activation);
  if (fast_gated(gate, up) && out.scalar_type() == at::kFloat && out.is_contiguous() &&
      out.sizes().equals(gate.sizes())) {
    run_gated(gate, up, act, out);
  } else {
    out.copy_(gated_reference(gate, up, act));
  }
  return out;
}

}  // namespace fxrt

TORCH_LIBRARY_FRAGMENT(fxrt, m) {
  m.def(
      "rms_norm(Tensor input, Tensor? weight, float eps, float weight_offset=0., "
      "bool eps_outside=False) -> Tensor");
  m.def(
      "rms_norm.out(Tensor input, Tensor? weight, float eps, float weight_offset=0., "
      "bool eps_outside=False, *, Tensor(a!) out) -> Tensor(a!)");
  m.def(
      "add_rms_norm(Tensor input, Tensor residual, Tensor? weight, float eps, "
      "float weight_offset=0., bool eps_outside=False) -> (Tensor, Tensor)");
  m.def(
      "rotary(Tensor q, Tensor k, Tensor cos, Tensor sin, int rotary_dim=-1, "
      "bool interleaved=False) -> (Tensor, Tensor)");
  m.def("gated(Tensor gate, Tensor up, str activation='silu') -> Tensor");
  m.def(
      "gated.out(Tensor gate, Tensor up, str activation='silu', *, Tensor(a!) out) -> "
      "Tensor(a!)");
}

TORCH_LIBRARY_IMPL(fxrt, CompositeImplicitAutograd, m) {
  m.impl("rms_norm", TORCH_FN(fxrt::rms_norm));
  m.impl("add_rms_norm", TORCH_FN(fxrt::add_rms_norm));
  m.impl("rotary", TORCH_FN(fxrt::rotary));
  m.impl("gated", TORCH_FN(fxrt::gated));
}

TORCH_LIBRARY_IMPL(fxrt, CPU, m) {
  m.impl("rms_norm.out", TORCH_FN(fxrt::rms_norm_out));
  m.impl("gated.out", TORCH_FN(fxrt::gated_out));
}
