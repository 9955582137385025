// fxrt::layer_norm_chain: LayerNorm as models write it in ATen ops (Cohere's, ConvNeXt's; the
// chain fxrt/patterns/layer_norm.py rewrites to it), computed as eager computes the chain, bit for
// bit.
//
// fxrt::layer_norm_chain(Tensor input, Tensor? weight, Tensor? bias, float eps,
//                        str root='rsqrt') -> Tensor, and its out= overload.
//   m = mean(x, -1, keepdim); d = x - m; v = mean(d^2, -1, keepdim); then by `root`:
//     'rsqrt'                d * rsqrt(v + eps)
//     'sqrt'                 d / sqrt(v + eps)
//     'sqrt_reciprocal'      d * reciprocal(sqrt(v + eps))
//     'sqrt_eps'             d / (sqrt(v) + eps)
//     'sqrt_eps_reciprocal'  d * reciprocal(sqrt(v) + eps)
//   then y * weight and y + bias where given (1-D, the last dimension's size).
//   A bfloat16 input (and weight and bias) is computed in float32 and the result rounded once,
//   as the chain models write around x.float() and a cast back.
//   Unlike aten::native_layer_norm (one pass, Welford's statistics), the chain's two means are
//   sums in ATen's own order: SumKernel's cascade (4 interleaved accumulators of vectors of the
//   width ATen's mean runs with, added into levels every 2^k vectors, the tail elements after).
//   The fast path sums in that order (the width found once by asking ATen's mean,
//   aten_sum_width) and rounds every other step as eager's ops do, without contractions. aten::sqrt is not always
//   correctly rounded (MKL's vector sqrt, within an ulp), so the forms with a sqrt take the rows'
//   roots from aten::sqrt itself, one call for all rows; rsqrt is ATen's 1 / std::sqrt. Where
//   ATen's reduction would split a row between threads (one row of 32768 elements or more,
//   several threads), the op runs eager's chain.

#pragma once

#include "own_decoder.h"

#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>
#include <ATen/ops/add.h>
#include <ATen/ops/div.h>
#include <ATen/ops/mean.h>
#include <ATen/ops/mean_cpu_dispatch.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/reciprocal.h>
#include <ATen/ops/rsqrt.h>
#include <ATen/ops/sqrt.h>
#include <ATen/ops/sub.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string_view>
#include <vector>

namespace fxrt {
namespace decoder_detail {

// utils::CeilLog2 of ATen's SumKernel (1 for x <= 2).
[[gnu::always_inline]] inline int64_t sum_ceil_log2(int64_t x) {
  return x <= 2 ? 1 : 64 - __builtin_clzll(static_cast<uint64_t>(x - 1));
}

// The four vectors of W floats at q added into four accumulators, one each.
template <int W>
[[gnu::always_inline]] inline void add_group(float (&acc)[4][W], const float* q) {
  for (int k = 0; k < 4; ++k) {
    for (int l = 0; l < W; ++l) {
      acc[k][l] += q[k * W + l];
    }
  }
}

// SumKernel's row_sum over `size` vectors of W floats (vector i at p + i * W; W = 1: scalars):
// multi_row_sum's four interleaved accumulators, each with four levels that take the level below
// every 2^power vectors, then the vectors past the last multiple of four, then the accumulators
// added in order. `out` receives the W lanes.
template <int W>
[[gnu::always_inline]] inline void cascade_sum(const float* p, int64_t size, float* out) {
  constexpr int kIlp = 4, kLevels = 4;
  const int64_t rows = size / kIlp;
  float acc[kLevels][kIlp][W] = {};
  const int64_t power = std::max<int64_t>(4, sum_ceil_log2(rows) / kLevels);
  const int64_t step = int64_t{1} << power, mask = step - 1;
  int64_t i = 0;
  while (i + step <= rows) {
    for (int64_t s = 0; s < step; ++s, ++i) {
      add_group<W>(acc[0], p + i * kIlp * W);
    }
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < kIlp; ++k) {
        for (int l = 0; l < W; ++l) {
          acc[j][k][l] += acc[j - 1][k][l];
          acc[j - 1][k][l] = 0.0f;
        }
      }
      if ((i & (mask << (j * power))) != 0) {
        break;
      }
    }
  }
  for (; i < rows; ++i) {
    add_group<W>(acc[0], p + i * kIlp * W);
  }
  for (int j = 1; j < kLevels; ++j) {
    for (int k = 0; k < kIlp; ++k) {
      for (int l = 0; l < W; ++l) {
        acc[0][k][l] += acc[j][k][l];
      }
    }
  }
  for (int64_t e = rows * kIlp; e < size; ++e) {
    for (int l = 0; l < W; ++l) {
      acc[0][0][l] += p[e * W + l];
    }
  }
  for (int k = 1; k < kIlp; ++k) {
    for (int l = 0; l < W; ++l) {
      acc[0][0][l] += acc[0][k][l];
    }
  }
  for (int l = 0; l < W; ++l) {
    out[l] = acc[0][0][l];
  }
}

// aten::sum of a contiguous row of n floats, as SumKernel computes it with vectors of W floats:
// rows shorter than a vector as scalars (scalar_inner_sum), else vectorized_inner_sum (the
// vectors' cascade, then the tail elements, then the lanes in order); each into an output
// filled with 0.
template <int W>
[[gnu::always_inline]] inline float aten_row_sum(const float* x, int64_t n) {
  if (n < W) {
    float r;
    cascade_sum<1>(x, n, &r);
    return 0.0f + r;
  }
  const int64_t vecs = n / W;
  float part[W];
  cascade_sum<W>(x, vecs, part);
  float total = 0.0f;
  for (int64_t e = vecs * W; e < n; ++e) {
    total += x[e];
  }
  for (int l = 0; l < W; ++l) {
    total += part[l];
  }
  return 0.0f + total;
}

enum class Root { kRsqrt, kSqrt, kSqrtReciprocal, kSqrtEps, kSqrtEpsReciprocal };

inline Root checked_root(c10::string_view name) {
  const std::string_view s(name.data(), name.size());
  if (s == "rsqrt") return Root::kRsqrt;
  if (s == "sqrt") return Root::kSqrt;
  if (s == "sqrt_reciprocal") return Root::kSqrtReciprocal;
  if (s == "sqrt_eps") return Root::kSqrtEps;
  if (s == "sqrt_eps_reciprocal") return Root::kSqrtEpsReciprocal;
  TORCH_CHECK(
      false, "fxrt::layer_norm_chain: root must be 'rsqrt', 'sqrt', 'sqrt_reciprocal', ",
      "'sqrt_eps' or 'sqrt_eps_reciprocal', got '", std::string(s), "'");
}

// Phase 1 writes each row's mean and variance; phase 2 (stats == false) each row's result from
// its mean and `row[r]`, by then its scale (the root to divide by, or the factor to multiply with).
template <class T>
struct NormChainRows {
  const T* x;
  const T* w;  // or nullptr
  const T* b;  // or nullptr
  T* y;
  float* scratch;  // 2 n floats
  float* mean;  // rows
  float* row;  // rows: each row's variance (phase 1), then its scale (phase 2)
  int64_t rows, n;
  bool stats, divide;
  bool wide;  // vectors of 16 floats (ATen's AVX512 kernels), else 8
};

template <class T, int W>
[[gnu::always_inline]] inline void norm_chain_stats(const NormChainRows<T>& p) {
  const int64_t n = p.n;
  const float count = static_cast<float>(n);
  float* d = p.scratch;
  float* sq = p.scratch + n;
  for (int64_t r = 0; r < p.rows; ++r) {
    const T* x = p.x + r * n;
    for (int64_t i = 0; i < n; ++i) {
      d[i] = widen(x[i]);
    }
    const float mean = aten_row_sum<W>(d, n) / count;
    for (int64_t i = 0; i < n; ++i) {
      const float c = d[i] - mean;
      sq[i] = c * c;
    }
    p.mean[r] = mean;
    p.row[r] = aten_row_sum<W>(sq, n) / count;
  }
}

template <class T>
[[gnu::always_inline]] inline void norm_chain_apply(const NormChainRows<T>& p) {
  const int64_t n = p.n;
  float* t = p.scratch;
  for (int64_t r = 0; r < p.rows; ++r) {
    const T* x = p.x + r * n;
    T* y = p.y + r * n;
    const float mean = p.mean[r], s = p.row[r];
    if (p.divide) {
      for (int64_t i = 0; i < n; ++i) {
        t[i] = (widen(x[i]) - mean) / s;
      }
    } else {
      for (int64_t i = 0; i < n; ++i) {
        t[i] = (widen(x[i]) - mean) * s;
      }
    }
    if (p.w != nullptr) {
      for (int64_t i = 0; i < n; ++i) {
        t[i] = t[i] * widen(p.w[i]);
      }
    }
    if (p.b != nullptr) {
      for (int64_t i = 0; i < n; ++i) {
        t[i] = t[i] + widen(p.b[i]);
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      y[i] = narrow<T>(t[i]);
    }
  }
}

template <class T>
[[gnu::always_inline]] inline void norm_chain_body(const NormChainRows<T>& p) {
  if (!p.stats) {
    norm_chain_apply(p);
  } else if (p.wide) {
    norm_chain_stats<T, 16>(p);
  } else {
    norm_chain_stats<T, 8>(p);
  }
}

#if defined(__x86_64__)
FXRT_ROWS_KERNEL(norm_chain, NormChainRows, float)
FXRT_ROWS_KERNEL(norm_chain, NormChainRows, c10::BFloat16)

// The vector width ATen's mean sums a row with, 8 or 16 floats (0: neither order, and the op runs
// eager's chain). It depends on more than the capability ATen runs at (ATEN_CPU_CAPABILITY or the
// CPU's best): a build may register no AVX512 kernel for a reduction and run its AVX2 one there,
// as torch 2.13's mean does. So it is asked once: rows of several lengths, whose sums differ
// between the two orders, against ATen's CPU mean itself (no dispatcher, no mode sees the call).
inline int aten_sum_width() {
  static const int width = [] {
    for (const int w : {8, 16}) {
      uint32_t state = 0x9E3779B9u;
      bool all = true;
      for (const int64_t n : {9, 16, 27, 64, 100, 257, 1000, 4099}) {
        at::Tensor row =
            at::detail::empty_cpu({n}, at::kFloat, false, c10::MemoryFormat::Contiguous);
        float* p = row.mutable_data_ptr<float>();
        for (int64_t i = 0; i < n; ++i) {  // magnitudes spread over six binades
          state = state * 1664525u + 1013904223u;
          p[i] = static_cast<float>(static_cast<int32_t>(state)) * 0x1p-31f * (1 << (i % 6));
        }
        const float want = *at::cpu::mean(row, {0}).const_data_ptr<float>();
        const float sum = w == 16 ? aten_row_sum<16>(p, n) : aten_row_sum<8>(p, n);
        all = all && sum / static_cast<float>(n) == want;
      }
      if (all) {
        return w;
      }
    }
    return 0;
  }();
  return width;
}
#endif

inline bool row_vector_of(const at::Tensor& t, const at::Tensor& x) {
  return !t.defined() ||
      (plain_rows(t) && same_dtype(x, t) && t.dim() == 1 && t.size(0) == x.size(-1) &&
       t.is_contiguous());
}

inline bool fast_norm_chain(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
#if defined(__x86_64__)
  if (!plain_rows(x) || !x.is_contiguous() || x.size(-1) == 0 || !row_vector_of(w, x) ||
      !row_vector_of(b, x) || aten_sum_width() == 0) {
    return false;
  }
  // ATen's parallel reduction splits a lone row between threads (two_pass_reduction).
  return !(x.numel() == x.size(-1) && x.numel() >= at::internal::GRAIN_SIZE &&
           at::get_num_threads() > 1 && !at::in_parallel_region());
#else
  (void)x, (void)w, (void)b;
  return false;  // the vector width ATen sums with is known on x86-64 only
#endif
}

// Each row's root as eager's chain computes it (the factor to multiply with where the chain
// multiplies), from the rows' variances in `var`, which it overwrites.
inline void norm_chain_scales(Root root, float eps, float* var, int64_t rows) {
  if (root == Root::kRsqrt) {
    for (int64_t r = 0; r < rows; ++r) {
      var[r] = 1.0f / std::sqrt(var[r] + eps);  // aten::rsqrt's
    }
    return;
  }
  const bool inside = root == Root::kSqrt || root == Root::kSqrtReciprocal;
  // aten::sqrt on a tensor of its own, as eager's chain allocates it
  at::Tensor in = at::detail::empty_cpu({rows}, at::kFloat, false, c10::MemoryFormat::Contiguous);
  float* p = in.mutable_data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    p[r] = inside ? var[r] + eps : var[r];
  }
  const at::Tensor sq = at::sqrt(in);
  const float* s = sq.const_data_ptr<float>();
  const bool reciprocal = root == Root::kSqrtReciprocal || root == Root::kSqrtEpsReciprocal;
  for (int64_t r = 0; r < rows; ++r) {
    const float d = inside ? s[r] : s[r] + eps;
    var[r] = reciprocal ? 1.0f / d : d;
  }
}

inline void run_norm_chain(
    const at::Tensor& x,
    const at::Tensor& w,
    const at::Tensor& b,
    double eps,
    Root root,
    at::Tensor& y) {
#if defined(__x86_64__)
  const int64_t n = x.size(-1), rows = x.numel() / n;
  if (rows == 0) {
    return;
  }
  std::vector<float> buffer(2 * n + 2 * rows);  // scratch, then the rows' means and variances
  float* const mean = buffer.data() + 2 * n;
  float* const var = mean + rows;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    NormChainRows<T> p{
        x.const_data_ptr<T>(), w.defined() ? w.const_data_ptr<T>() : nullptr,
        b.defined() ? b.const_data_ptr<T>() : nullptr, y.mutable_data_ptr<T>(), buffer.data(),
        mean, var, rows, n, true, false, aten_sum_width() == 16};
    norm_chain(p);
    norm_chain_scales(root, static_cast<float>(eps), var, rows);
    p.stats = false;
    p.divide = root == Root::kSqrt || root == Root::kSqrtEps;
    norm_chain(p);
  };
  x.scalar_type() == at::kBFloat16 ? run(c10::BFloat16()) : run(0.0f);
#else
  (void)x, (void)w, (void)b, (void)eps, (void)root, (void)y;
#endif
}

// eager's chain, op for op; a bfloat16 or float16 input (and weight and bias) widened to float32
// first and the result cast back.
inline at::Tensor norm_chain_reference(
    const at::Tensor& x,
    const at::Tensor& w,
    const at::Tensor& b,
    double eps,
    Root root) {
  const bool widened = at::isReducedFloatingType(x.scalar_type());
  auto f32 = [](const at::Tensor& t) {
    return t.defined() && at::isReducedFloatingType(t.scalar_type()) ? t.to(at::kFloat) : t;
  };
  const at::Tensor xf = f32(x);
  const at::Tensor d = at::sub(xf, at::mean(xf, {-1}, true));
  const at::Tensor v = at::mean(at::pow(d, 2), {-1}, true);
  at::Tensor y;
  switch (root) {
    case Root::kRsqrt:
      y = at::mul(d, at::rsqrt(at::add(v, eps)));
      break;
    case Root::kSqrt:
      y = at::div(d, at::sqrt(at::add(v, eps)));
      break;
    case Root::kSqrtReciprocal:
      y = at::mul(d, at::reciprocal(at::sqrt(at::add(v, eps))));
      break;
    case Root::kSqrtEps:
      y = at::div(d, at::add(at::sqrt(v), eps));
      break;
    case Root::kSqrtEpsReciprocal:
      y = at::mul(d, at::reciprocal(at::add(at::sqrt(v), eps)));
      break;
  }
  if (w.defined()) {
    y = at::mul(y, f32(w));
  }
  if (b.defined()) {
    y = at::add(y, f32(b));
  }
  return widened ? y.to(x.scalar_type()) : y;
}

}  // namespace decoder_detail

inline at::Tensor layer_norm_chain(
    const at::Tensor& input,
    const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias,
    double eps,
    c10::string_view root) {
  using namespace decoder_detail;
  const Root form = checked_root(root);
  const at::Tensor& w = or_undefined(weight);
  const at::Tensor& b = or_undefined(bias);
  if (!fast_norm_chain(input, w, b)) {
    return norm_chain_reference(input, w, b, eps, form);
  }
  at::Tensor out = contiguous_like(input);
  run_norm_chain(input, w, b, eps, form, out);
  return out;
}

inline at::Tensor& layer_norm_chain_out(
    const at::Tensor& input,
    const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias,
    double eps,
    c10::string_view root,
    at::Tensor& out) {
  using namespace decoder_detail;
  const Root form = checked_root(root);
  const at::Tensor& w = or_undefined(weight);
  const at::Tensor& b = or_undefined(bias);
  if (fast_norm_chain(input, w, b) && writable_for(out, input) && out.is_contiguous()) {
    run_norm_chain(input, w, b, eps, form, out);
  } else {
    const at::Tensor y = layer_norm_chain(input, weight, bias, eps, root);
    TORCH_CHECK(
        out.sizes().equals(y.sizes()), "fxrt::layer_norm_chain.out: out has sizes ", out.sizes(),
        " but the result has ", y.sizes());
    out.copy_(y);
  }
  return out;
}

}  // namespace fxrt

TORCH_LIBRARY_FRAGMENT(fxrt, m) {
  m.def(
      "layer_norm_chain(Tensor input, Tensor? weight, Tensor? bias, float eps, "
      "str root='rsqrt') -> Tensor");
  m.def(
      "layer_norm_chain.out(Tensor input, Tensor? weight, Tensor? bias, float eps, "
      "str root='rsqrt', *, Tensor(a!) out) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(fxrt, CompositeImplicitAutograd, m) {
  m.impl("layer_norm_chain", TORCH_FN(fxrt::layer_norm_chain));
}

TORCH_LIBRARY_IMPL(fxrt, CPU, m) {
  m.impl("layer_norm_chain.out", TORCH_FN(fxrt::layer_norm_chain_out));
}
