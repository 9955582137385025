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
//   An input whose rows lie whole in memory (decoder_detail::dense_rows: contiguous, or permuted
//   with the last dimension innermost) gives a result of its strides, as eager's chain does.
//
// fxrt::add_rms_norm(Tensor input, Tensor residual, Tensor? weight, float eps,
//                    float weight_offset=0., bool eps_outside=False) -> (Tensor, Tensor),
//                    and its out= overload (out, residual_out)
//   (rms_norm(input + residual), input + residual): the residual stream's add and the next norm.
//
// fxrt::rotary(Tensor q, Tensor k, Tensor cos, Tensor sin, int rotary_dim=-1,
//              bool interleaved=False) -> (Tensor, Tensor), and its out= overload (q_out, k_out)
//   x * cos + rotate(x) * sin for x = q and x = k in one call. rotary_dim -1: every feature, the
//   result laid out as eager's elementwise ops lay it out; rotary_dim r: the first r features,
//   the rest passed through (none when r is all of them), as partial rotary embeddings cat them
//   back: cat's contiguous layout. rotate is rotate_half (cat(-x2, x1)), or with interleaved the
//   pairs' (-x[2i+1], x[2i]). Every product and sum is eager's, in eager's order: results are
//   eager's, bit for bit.
//
// fxrt::rotary_complex(Tensor q, Tensor k, Tensor freqs) -> (Tensor, Tensor), and its out=
//                      overload (q_out, k_out)
//   The rotary embedding written as a complex product (view_as_complex(x.reshape(..., -1, 2)) *
//   freqs, or the same on real pairs): each pair (x[2i], x[2i+1]) times freqs[..., i] (complex,
//   or real (cos, sin) pairs in a last dimension of 2), broadcast over x's leading dimensions;
//   contiguous results of x's dtype (bfloat16 x: computed in float32, rounded once, as x.float()
//   and a cast back). Each component is x0 c - x1 s and x0 s + x1 c with each product rounded:
//   the real-pair chain's values bit for bit (eager's complex multiply sometimes fuses one of the
//   two products; docs/numerics.md gives the bound).
//
// fxrt::gated(Tensor gate, Tensor up, str activation='silu') -> Tensor, and its out= overload.
//   act(gate) * up, act = silu or gelu(approximate='tanh'), the gated MLP's product. The
//   activations use a vectorized exponential (within a few float32 ulps of ATen's).

//
// The out= overloads write the results into the tensors given (the arena's slots), which must
// have the results' sizes: the fast path when they are rows of the input's dtype, else the
// functional op's results copied in. Either way the values are the functional op's, bit for bit.
#pragma once

#include "own_decoder.h"
#include "own_rotary.h"

#include <ATen/ops/add.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

namespace fxrt {

namespace decoder_detail {

inline bool fast_add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& w) {
  return fast_rms_norm(x, w) && x.is_contiguous() && plain_rows(residual) &&
      same_dtype(x, residual) && residual.is_contiguous() && residual.sizes().equals(x.sizes());
}

// An out= overload whose outs its fast path cannot write (or whose inputs it does not read)
// copies the functional op's results in: the outs must have their sizes (copy_ would broadcast).
inline void copy_results(
    const char* op,
    const std::tuple<at::Tensor, at::Tensor>& results,
    at::Tensor& a,
    at::Tensor& b) {
  const at::Tensor* given[] = {&a, &b};
  const at::Tensor* made[] = {&std::get<0>(results), &std::get<1>(results)};
  for (int i = 0; i < 2; ++i) {
    TORCH_CHECK(
        given[i]->sizes().equals(made[i]->sizes()), op, ": an out tensor has sizes ",
        given[i]->sizes(), " but its result has ", made[i]->sizes());
  }
  a.copy_(*made[0]);
  b.copy_(*made[1]);
}

inline int64_t checked_rotary_dim(const at::Tensor& q, const at::Tensor& k, int64_t rotary_dim) {
  const int64_t rot = rotary_dim < 0 ? q.size(-1) : rotary_dim;
  TORCH_CHECK(
      rot <= q.size(-1) && rot <= k.size(-1) && rot % 2 == 0, "fxrt::rotary: rotary_dim ", rot,
      " must be even and at most the features of q (", q.size(-1), ") and k (", k.size(-1), ")");
  return rot;
}

// The frequencies as (c, s) pairs, after checking q, k and them.
inline at::Tensor checked_freqs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& freqs) {
  TORCH_CHECK(
      q.size(-1) % 2 == 0 && k.size(-1) % 2 == 0, "fxrt::rotary_complex: q and k need an even ",
      "number of features (pairs), got ", q.size(-1), " and ", k.size(-1));
  const at::Tensor f = freq_pairs(freqs);
  TORCH_CHECK(
      f.dim() >= 2 && f.size(-1) == 2, "fxrt::rotary_complex: freqs must be complex, or real ",
      "(cos, sin) pairs in a last dimension of 2; got shape ", freqs.sizes());
  return f;
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
  const at::Tensor& w = or_undefined(weight);
  if (!fast_rms_norm(input, w)) {
    return rms_norm_reference(input, w, eps, weight_offset, eps_outside);
  }
  at::Tensor out = rows_like(input);
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
  const at::Tensor& w = or_undefined(weight);
  if (fast_rms_norm(input, w) && same_dtype(input, out) && same_layout(out, input)) {
    run_rms_norm(input, nullptr, nullptr, w, eps, weight_offset, eps_outside, out);
  } else {
    out.copy_(rms_norm(input, weight, eps, weight_offset, eps_outside));
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
  const at::Tensor& w = or_undefined(weight);
  if (fast_add_rms_norm(input, residual, w)) {
    at::Tensor sum = contiguous_like(input);
    at::Tensor out = contiguous_like(input);
    run_rms_norm(input, &residual, &sum, w, eps, weight_offset, eps_outside, out);
    return {out, sum};
  }
  at::Tensor sum = at::add(input, residual);
  return {rms_norm_reference(sum, w, eps, weight_offset, eps_outside), sum};
}

inline std::tuple<at::Tensor&, at::Tensor&> add_rms_norm_out(
    const at::Tensor& input,
    const at::Tensor& residual,
    const std::optional<at::Tensor>& weight,
    double eps,
    double weight_offset,
    bool eps_outside,
    at::Tensor& out,
    at::Tensor& residual_out) {
  using namespace decoder_detail;
  const at::Tensor& w = or_undefined(weight);
  if (fast_add_rms_norm(input, residual, w) && writable_for(out, input) &&
      writable_for(residual_out, input) && out.is_contiguous() && residual_out.is_contiguous()) {
    run_rms_norm(input, &residual, &residual_out, w, eps, weight_offset, eps_outside, out);
  } else {
    copy_results(
        "fxrt::add_rms_norm.out",
        add_rms_norm(input, residual, weight, eps, weight_offset, eps_outside), out, residual_out);
  }
  return {out, residual_out};
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
  if (fast_gated(gate, up) && same_dtype(gate, out) && out.is_contiguous() &&
      out.sizes().equals(gate.sizes())) {
    run_gated(gate, up, act, out);
  } else {
    out.copy_(gated(gate, up, activation));
  }
  return out;
}

inline std::tuple<at::Tensor, at::Tensor> rotary(
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& cos,
    const at::Tensor& sin,
    int64_t rotary_dim,
    bool interleaved) {
  using namespace decoder_detail;
  const int64_t rot = checked_rotary_dim(q, k, rotary_dim);
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

inline std::tuple<at::Tensor&, at::Tensor&> rotary_out(
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& cos,
    const at::Tensor& sin,
    int64_t rotary_dim,
    bool interleaved,
    at::Tensor& q_out,
    at::Tensor& k_out) {
  using namespace decoder_detail;
  const int64_t rot = checked_rotary_dim(q, k, rotary_dim);
  if (fast_rotary(q, cos, sin, rot) && fast_rotary(k, cos, sin, rot) && writable_for(q_out, q) &&
      writable_for(k_out, k)) {
    rotary_into(q, cos, sin, rot, interleaved, q_out);
    rotary_into(k, cos, sin, rot, interleaved, k_out);
  } else {
    copy_results("fxrt::rotary.out", rotary(q, k, cos, sin, rotary_dim, interleaved), q_out, k_out);
  }
  return {q_out, k_out};
}

inline std::tuple<at::Tensor, at::Tensor> rotary_complex(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& freqs) {
  using namespace decoder_detail;
  const at::Tensor f = checked_freqs(q, k, freqs);
  return {rotary_pairs(q, f), rotary_pairs(k, f)};
}


inline std::tuple<at::Tensor&, at::Tensor&> rotary_complex_out(
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& freqs,
    at::Tensor& q_out,
    at::Tensor& k_out) {
  using namespace decoder_detail;
  const at::Tensor f = checked_freqs(q, k, freqs);
  if (fast_pairs(q, f) && fast_pairs(k, f) && writable_for(q_out, q) && writable_for(k_out, k)) {
    pairs_into(q, f, q_out);
    pairs_into(k, f, k_out);
  } else {
    copy_results("fxrt::rotary_complex.out", rotary_complex(q, k, freqs), q_out, k_out);
  }
  return {q_out, k_out};
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
      "add_rms_norm.out(Tensor input, Tensor residual, Tensor? weight, float eps, "
      "float weight_offset=0., bool eps_outside=False, *, Tensor(a!) out, "
      "Tensor(b!) residual_out) -> (Tensor(a!), Tensor(b!))");
  m.def(
      "rotary(Tensor q, Tensor k, Tensor cos, Tensor sin, int rotary_dim=-1, "
      "bool interleaved=False) -> (Tensor, Tensor)");
  m.def(
      "rotary.out(Tensor q, Tensor k, Tensor cos, Tensor sin, int rotary_dim=-1, "
      "bool interleaved=False, *, Tensor(a!) q_out, Tensor(b!) k_out) -> "
      "(Tensor(a!), Tensor(b!))");
  m.def("rotary_complex(Tensor q, Tensor k, Tensor freqs) -> (Tensor, Tensor)");
  m.def(
      "rotary_complex.out(Tensor q, Tensor k, Tensor freqs, *, Tensor(a!) q_out, "
      "Tensor(b!) k_out) -> (Tensor(a!), Tensor(b!))");
  m.def("gated(Tensor gate, Tensor up, str activation='silu') -> Tensor");
  m.def(
      "gated.out(Tensor gate, Tensor up, str activation='silu', *, Tensor(a!) out) -> "
      "Tensor(a!)");
}

TORCH_LIBRARY_IMPL(fxrt, CompositeImplicitAutograd, m) {
  m.impl("rms_norm", TORCH_FN(fxrt::rms_norm));
  m.impl("add_rms_norm", TORCH_FN(fxrt::add_rms_norm));
  m.impl("rotary", TORCH_FN(fxrt::rotary));
  m.impl("rotary_complex", TORCH_FN(fxrt::rotary_complex));
  m.impl("gated", TORCH_FN(fxrt::gated));
}

TORCH_LIBRARY_IMPL(fxrt, CPU, m) {
  m.impl("rms_norm.out", TORCH_FN(fxrt::rms_norm_out));
  m.impl("add_rms_norm.out", TORCH_FN(fxrt::add_rms_norm_out));
  m.impl("rotary.out", TORCH_FN(fxrt::rotary_out));
  m.impl("rotary_complex.out", TORCH_FN(fxrt::rotary_complex_out));
  m.impl("gated.out", TORCH_FN(fxrt::gated_out));
}
