// The rotary embedding's kernels (the ops' contracts: own_decoder_ops.h, where they are
// registered with the other decoder ops): the rotate-half / interleaved form over cos and sin,
// and the complex-product form over (c, s) pairs.

#pragma once

#include "own_rows.h"

#include <ATen/ops/add.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/neg.h>
#include <ATen/ops/select.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/sub.h>
#include <ATen/ops/view_as_real.h>

#include <tuple>

namespace fxrt {
namespace decoder_detail {

// --- rotary -------------------------------------------------------------------------------------

template <class T>
struct RopeRows {
  const T* x;
  const T* cos;
  const T* sin;
  T* out;
  int64_t sizes[3];  // the leading dimensions (x padded to 4-D on the left)
  int64_t xs[3], cs[3], ss[3], os[3];  // their strides (0 where cos/sin broadcast)
  int64_t d, rot;  // features, rotated features
  bool interleaved;
};

// No fused multiply-adds: each product is rounded before the sum, as eager's mul and add (to
// float32, or to bfloat16 for bfloat16 tensors: every product and the sum, as eager's bfloat16
// ops round them; the negation is exact).
template <class T>
[[gnu::always_inline]] inline void rope_rows_body(const RopeRows<T>& p) {
  const int64_t half = p.rot / 2;
  auto mul = [](T a, T b) { return rounded<T>(widen(a) * widen(b)); };
  auto neg_mul = [](T a, T b) { return rounded<T>(-widen(a) * widen(b)); };
  for (int64_t a = 0; a < p.sizes[0]; ++a) {
    for (int64_t b = 0; b < p.sizes[1]; ++b) {
      for (int64_t c = 0; c < p.sizes[2]; ++c) {
        const T* x = p.x + a * p.xs[0] + b * p.xs[1] + c * p.xs[2];
        const T* cs = p.cos + a * p.cs[0] + b * p.cs[1] + c * p.cs[2];
        const T* sn = p.sin + a * p.ss[0] + b * p.ss[1] + c * p.ss[2];
        T* o = p.out + a * p.os[0] + b * p.os[1] + c * p.os[2];
        if (p.interleaved) {
          for (int64_t i = 0; i < half; ++i) {
            const T x0 = x[2 * i], x1 = x[2 * i + 1];
            const float a0 = mul(x0, cs[2 * i]), b0 = neg_mul(x1, sn[2 * i]);
            const float a1 = mul(x1, cs[2 * i + 1]), b1 = mul(x0, sn[2 * i + 1]);
            o[2 * i] = narrow<T>(a0 + b0);
            o[2 * i + 1] = narrow<T>(a1 + b1);
          }
        } else {
          for (int64_t i = 0; i < half; ++i) {
            const float a0 = mul(x[i], cs[i]), b0 = neg_mul(x[i + half], sn[i]);
            o[i] = narrow<T>(a0 + b0);
          }
          for (int64_t i = half; i < p.rot; ++i) {
            const float a1 = mul(x[i], cs[i]), b1 = mul(x[i - half], sn[i]);
            o[i] = narrow<T>(a1 + b1);
          }
        }
        for (int64_t i = p.rot; i < p.d; ++i) {
          o[i] = x[i];
        }
      }
    }
  }
}

FXRT_ROWS_KERNEL(rope_rows, RopeRows, float)
FXRT_ROWS_KERNEL(rope_rows, RopeRows, c10::BFloat16)

// The stride of dimension d of `t` read as broadcast to x's 4-D shape (right-aligned).
inline int64_t broadcast_stride(const at::Tensor& t, int64_t d, int64_t x_dim) {
  const int64_t td = d - (x_dim - t.dim());
  return td < 0 || t.size(td) == 1 ? 0 : t.stride(td);
}

// x's leading dimensions (all but the last) right-aligned into the 3 slots of a row kernel's
// parameters: their sizes and x's and out's strides, then each operand's through `operands`.
template <class P, class F>
inline void lead_dims(const at::Tensor& x, const at::Tensor& out, P& p, F&& operands) {
  const int64_t lead = x.dim() - 1;
  for (int64_t i = 0; i < lead; ++i) {
    const int64_t slot = 3 - lead + i;
    p.sizes[slot] = x.size(i);
    p.xs[slot] = x.stride(i);
    p.os[slot] = out.stride(i);
    operands(slot, i);
  }
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
  if (!plain_rows(x) || !plain_rows(cos) || !plain_rows(sin) || x.dim() < 1 || x.dim() > 4 ||
      !same_dtype(x, cos) || !same_dtype(x, sin)) {
    return false;
  }
  const int64_t d = x.size(-1);
  return rot > 0 && rot <= d && rot % 2 == 0 && broadcasts_to(cos, x, rot) &&
      broadcasts_to(sin, x, rot);
}

// Eager's layout: the elementwise ops' (TensorIterator's): x's when it is dense, else the dense
// layout that keeps its order of dimensions, as empty_like makes it; after cat: contiguous.
inline at::Tensor rope_out(const at::Tensor& x, bool cat_layout) {
  return cat_layout ? contiguous_like(x) : at::empty_like(x);
}

// Whether the fast paths can write `out` for x: x's sizes and dtype, rows of adjacent features.
inline bool writable_for(const at::Tensor& out, const at::Tensor& x) {
  return plain_rows(out) && same_dtype(out, x) && out.sizes().equals(x.sizes());
}

// The fast path into `out` (writable_for x).
inline void rotary_into(
    const at::Tensor& x,
    const at::Tensor& cos,
    const at::Tensor& sin,
    int64_t rot,
    bool inter,
    at::Tensor& out) {
  auto run = [&](auto tag) {
    using T = decltype(tag);
    RopeRows<T> p{
        x.const_data_ptr<T>(), cos.const_data_ptr<T>(), sin.const_data_ptr<T>(),
        out.mutable_data_ptr<T>(), {1, 1, 1}, {0, 0, 0}, {0, 0, 0}, {0, 0, 0}, {0, 0, 0},
        x.size(-1), rot, inter};
    lead_dims(x, out, p, [&](int64_t slot, int64_t i) {
      p.cs[slot] = broadcast_stride(cos, i, x.dim());
      p.ss[slot] = broadcast_stride(sin, i, x.dim());
    });
    if (out.numel() > 0) {
      rope_rows(p);
    }
  };
  x.scalar_type() == at::kBFloat16 ? run(c10::BFloat16()) : run(0.0f);
}

inline at::Tensor run_rotary(
    const at::Tensor& x,
    const at::Tensor& cos,
    const at::Tensor& sin,
    int64_t rot,
    bool inter,
    bool cat_layout) {
  at::Tensor out = rope_out(x, cat_layout);
  rotary_into(x, cos, sin, rot, inter, out);
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

// --- rotary as a complex product ------------------------------------------------------------

// x's features as pairs (x[2i], x[2i+1]) times the complex frequencies (c[i], s[i]):
// (x0 c - x1 s, x0 s + x1 c), each product rounded to float32, then the difference and the sum
// (no fused multiply-adds), the result rounded to T once (bfloat16 x: widened, as x.float()).
template <class T>
struct PairRows {
  const T* x;
  const float* f;  // (c, s) pairs, adjacent
  T* out;
  int64_t sizes[3];
  int64_t xs[3], fs[3], os[3];
  int64_t half;  // pairs per row
};

template <class T>
[[gnu::always_inline]] inline void pair_rows_body(const PairRows<T>& p) {
  for (int64_t a = 0; a < p.sizes[0]; ++a) {
    for (int64_t b = 0; b < p.sizes[1]; ++b) {
      for (int64_t c = 0; c < p.sizes[2]; ++c) {
        const T* x = p.x + a * p.xs[0] + b * p.xs[1] + c * p.xs[2];
        const float* f = p.f + a * p.fs[0] + b * p.fs[1] + c * p.fs[2];
        T* o = p.out + a * p.os[0] + b * p.os[1] + c * p.os[2];
        for (int64_t i = 0; i < p.half; ++i) {
          const float x0 = widen(x[2 * i]), x1 = widen(x[2 * i + 1]);
          // x0 c + x1 (-s), not x0 c - x1 s: the same value (negation is exact), and GCC 12
          // makes the latter a fused multiply-add-subtract whatever fp-contract says.
          const float neg_s = -f[2 * i + 1];
          const float re = x0 * f[2 * i] + x1 * neg_s;
          const float im = x0 * f[2 * i + 1] + x1 * f[2 * i];
          o[2 * i] = narrow<T>(re);
          o[2 * i + 1] = narrow<T>(im);
        }
      }
    }
  }
}

FXRT_ROWS_KERNEL(pair_rows, PairRows, float)
FXRT_ROWS_KERNEL(pair_rows, PairRows, c10::BFloat16)

// The frequencies as real (c, s) pairs: a complex tensor's real view, or the pairs themselves.
inline at::Tensor freq_pairs(const at::Tensor& freqs) {
  return freqs.is_complex() ? at::view_as_real(freqs) : freqs;
}

// The fast path reads x's rows (up to 3 leading dimensions) and float32 (c, s) pairs that sit
// side by side, one per pair of x's features, broadcast over x's leading dimensions.
inline bool fast_pairs(const at::Tensor& x, const at::Tensor& f) {
  if (!plain_rows(x) || x.dim() > 4 || x.size(-1) % 2 || !plain_tensor(f) || !f.device().is_cpu() ||
      f.scalar_type() != at::kFloat || f.dim() < 2 || f.dim() - 1 > x.dim() || f.size(-1) != 2 ||
      f.stride(-1) != 1 || f.size(-2) != x.size(-1) / 2 || (f.size(-2) > 1 && f.stride(-2) != 2) ||
      (c10::GradMode::is_enabled() && f.requires_grad())) {
    return false;
  }
  for (int64_t d = 0; d < f.dim() - 2; ++d) {  // right-aligned with x's leading dimensions
    const int64_t s = f.size(f.dim() - 3 - d);
    if (s != 1 && s != x.size(x.dim() - 2 - d)) {
      return false;
    }
  }
  return true;
}

inline void pairs_into(const at::Tensor& x, const at::Tensor& f, at::Tensor& out) {
  auto run = [&](auto tag) {
    using T = decltype(tag);
    PairRows<T> p{
        x.const_data_ptr<T>(), f.const_data_ptr<float>(), out.mutable_data_ptr<T>(), {1, 1, 1},
        {0, 0, 0}, {0, 0, 0}, {0, 0, 0}, x.size(-1) / 2};
    lead_dims(x, out, p, [&](int64_t slot, int64_t i) {
      p.fs[slot] = broadcast_stride(f, i, x.dim() + 1);  // f: one more trailing dim (the pair)
    });
    if (out.numel() > 0) {
      pair_rows(p);
    }
  };
  x.scalar_type() == at::kBFloat16 ? run(c10::BFloat16()) : run(0.0f);
}

// The same as ATen ops on real pairs (the chain gpt-fast-style code writes).
inline at::Tensor pairs_reference(const at::Tensor& x, const at::Tensor& f) {
  const bool low = x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf;
  const at::Tensor xp = (low ? x.to(at::kFloat) : x).unflatten(-1, {-1, 2});
  const at::Tensor x0 = xp.select(-1, 0), x1 = xp.select(-1, 1);
  const at::Tensor c = f.select(-1, 0), s = f.select(-1, 1);
  const at::Tensor re = at::sub(at::mul(x0, c), at::mul(x1, s));
  const at::Tensor im = at::add(at::mul(x0, s), at::mul(x1, c));
  const at::Tensor y = at::stack({re, im}, -1).flatten(-2);
  return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
}

inline at::Tensor rotary_pairs(const at::Tensor& x, const at::Tensor& f) {
  if (!fast_pairs(x, f)) {
    return pairs_reference(x, f);
  }
  at::Tensor out = contiguous_like(x);
  pairs_into(x, f, out);
  return out;
}

}  // namespace decoder_detail

}  // namespace fxrt
