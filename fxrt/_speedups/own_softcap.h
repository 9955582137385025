// fxrt::softcap_sdpa(Tensor query, Tensor key, Tensor value, float softcap, bool is_causal=False,
//                    *, Tensor? attn_mask=None, float? scale=None) -> Tensor, and its out= overload.
//
// Attention with soft-capped scores, as Gemma-2 writes it out (ATen has no op for it):
//   scores = softcap * tanh(scale * q k^T / softcap)  (+ attn_mask; keys after the query's
//   position at -inf when is_causal), softmax over the keys, times v.
// q [B, H, L, D], k and v [B, Hk, S, D] with H a multiple of Hk (grouped-query heads read
// un-repeated: query head h reads key/value head h / (H / Hk)). fxrt::attention's kernel computes
// it (own_attention.h; tanh is SLEEF's, as fxrt::tanh's), where that kernel takes the arguments
// and the CPU has a SLEEF tanh; anything else, and a row every key of which is masked (NaN, as
// eager's softmax gives), is the ATen chain eager runs. The result is laid out as the query (the
// layout fxrt::sdpa gives), whichever computes it.
#pragma once

#include "own_attention.h"
#include "own_tanh.h"

#include <ATen/ops/_softmax.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/repeat_interleave.h>
#include <ATen/ops/tanh.h>

#include <cmath>
#include <limits>
#include <optional>

namespace fxrt {

namespace softcap_detail {

inline void check(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double softcap) {
  TORCH_CHECK(
      q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
      "fxrt::softcap_sdpa: query, key and value must be 4-D [B, H, L, D], got ", q.sizes(), ", ",
      k.sizes(), " and ", v.sizes());
  TORCH_CHECK(
      k.size(1) > 0 && q.size(1) % k.size(1) == 0 && v.size(1) == k.size(1),
      "fxrt::softcap_sdpa: the query's heads (", q.size(1), ") must be a multiple of the key's (",
      k.size(1), "), and the value's equal to the key's (", v.size(1), ")");
  TORCH_CHECK(
      std::isfinite(softcap) && softcap != 0.0,
      "fxrt::softcap_sdpa: softcap must be a finite non-zero number, got ", softcap);
}

// What eager computes, op by op, into a tensor laid out as the query.
inline at::Tensor reference(
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& v,
    double softcap,
    bool is_causal,
    const std::optional<at::Tensor>& attn_mask,
    std::optional<double> scale) {
  const int64_t groups = q.size(1) / k.size(1);
  const at::Tensor keys = groups == 1 ? k : k.repeat_interleave(groups, 1);
  const at::Tensor values = groups == 1 ? v : v.repeat_interleave(groups, 1);
  const double s = scale.value_or(1.0 / std::sqrt(static_cast<double>(q.size(3))));
  at::Tensor w = at::matmul(q, keys.transpose(-2, -1)).mul(s);
  w = at::tanh(w.div(softcap)).mul(softcap);
  if (is_causal) {
    const at::Tensor later =
        at::ones({q.size(2), k.size(2)}, q.options().dtype(at::kBool)).triu(1);
    w = w.masked_fill(later, -std::numeric_limits<double>::infinity());
  }
  if (attn_mask.has_value() && attn_mask->defined()) {
    w = w.add(*attn_mask);
  }
  const at::Tensor product = at::matmul(at::_softmax(w, -1, false), values);
  if (product.sizes() != q.sizes()) {
    return product;
  }
  at::Tensor out = at::empty_like(q);
  out.copy_(product);
  return out;
}

inline bool fast(
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& v,
    const std::optional<at::Tensor>& attn_mask) {
  return tanh_detail::kernel() != nullptr &&
      attention_detail::fast_attention(q, k, v, 0.0, attn_mask);
}

}  // namespace softcap_detail

// CompositeImplicitAutograd, as fxrt::sdpa.
inline at::Tensor softcap_sdpa(
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& value,
    double softcap,
    bool is_causal,
    const std::optional<at::Tensor>& attn_mask,
    std::optional<double> scale) {
  softcap_detail::check(query, key, value, softcap);
  if (softcap_detail::fast(query, key, value, attn_mask)) {
    at::Tensor out = at::empty_like(query);
    if (output_into(
            query, key, value, is_causal, attn_mask, scale, out, static_cast<float>(softcap))) {
      return out;
    }
  }
  return softcap_detail::reference(query, key, value, softcap, is_causal, attn_mask, scale);
}

inline at::Tensor& softcap_sdpa_out(
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& value,
    double softcap,
    bool is_causal,
    const std::optional<at::Tensor>& attn_mask,
    std::optional<double> scale,
    at::Tensor& out) {
  softcap_detail::check(query, key, value, softcap);
  const bool sized = out.dim() == 4 && out.size(0) == query.size(0) &&
      out.size(1) == query.size(1) && out.size(2) == query.size(2) &&
      out.size(3) == value.size(3);
  TORCH_CHECK(
      sized, "fxrt::softcap_sdpa.out: out has sizes ", out.sizes(), " but the attention's output ",
      "has [B, H, L, D] of query ", query.sizes(), " and value ", value.sizes());
  if (softcap_detail::fast(query, key, value, attn_mask) && out.scalar_type() == at::kFloat &&
      out.stride(3) == 1 &&
      output_into(
          query, key, value, is_causal, attn_mask, scale, out, static_cast<float>(softcap))) {
    return out;
  }
  out.copy_(softcap_detail::reference(query, key, value, softcap, is_causal, attn_mask, scale));
  return out;
}

}  // namespace fxrt
