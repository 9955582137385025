// fxrt::embedding(Tensor weight, Tensor indices, SymInt padding_idx=-1,
//                 bool scale_grad_by_freq=False, bool sparse=False) -> Tensor, and its out=
//                 overload.
//
// aten::embedding's forward: the weight's rows at the indices, laid out as the indices' shape
// plus the row (padding_idx, scale_grad_by_freq and sparse only change the gradient). ATen
// computes it as a reshape, an index_select through the dispatcher and a view: 4-12 us a call on
// a decoder's 16 token ids, where copying the rows takes well under one. fxrt::embedding copies
// the rows itself when the weight is a CPU matrix whose rows are contiguous, the indices are a
// contiguous int64 or int32 CPU tensor, autograd records nothing and no dispatch mode is set;
// the bytes are the weight's, so results are eager's exactly, in any dtype. An index outside
// [0, rows) (eager raises "index out of range in self"), and everything else, is aten::embedding.
#pragma once

#include "inline_ops.h"

#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>  // at::internal::GRAIN_SIZE
#include <ATen/ops/embedding.h>
#include <c10/core/GradMode.h>
#include <torch/library.h>

#include <cstring>

namespace fxrt {

namespace embedding_detail {

template <typename I>
bool in_range(const at::Tensor& indices, int64_t rows) {
  const I* ix = indices.const_data_ptr<I>();
  bool ok = true;
  for (int64_t i = 0, n = indices.numel(); i < n; ++i) {
    ok &= ix[i] >= 0 && ix[i] < rows;
  }
  return ok;
}

inline bool fast(const at::Tensor& weight, const at::Tensor& indices) {
  if (!weight.defined() || !indices.defined() || !plain_tensor(weight) || !plain_tensor(indices)) {
    return false;
  }
  if (!weight.device().is_cpu() || !indices.device().is_cpu() || weight.dim() != 2 ||
      weight.stride(1) != 1 || !indices.is_contiguous()) {
    return false;
  }
  if (c10::GradMode::is_enabled() && weight.requires_grad()) {
    return false;
  }
  switch (indices.scalar_type()) {
    case at::kLong:
      return in_range<int64_t>(indices, weight.size(0));
    case at::kInt:
      return in_range<int32_t>(indices, weight.size(0));
    default:
      return false;
  }
}

template <typename I>
void gather(const at::Tensor& weight, const at::Tensor& indices, at::Tensor& out) {
  const I* ix = indices.const_data_ptr<I>();
  const auto* w = static_cast<const char*>(weight.const_data_ptr());
  auto* o = static_cast<char*>(out.mutable_data_ptr());
  const int64_t row_bytes = weight.size(1) * static_cast<int64_t>(weight.element_size());
  const int64_t step = weight.stride(0) * static_cast<int64_t>(weight.element_size());
  // Shared out between intra-op threads in tasks of ATen's grain for element-wise loops.
  const int64_t grain =
      std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(1, weight.size(1)));
  at::parallel_for(0, indices.numel(), grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      std::memcpy(o + i * row_bytes, w + ix[i] * step, row_bytes);
    }
  });
}

inline void run(const at::Tensor& weight, const at::Tensor& indices, at::Tensor& out) {
  if (indices.scalar_type() == at::kLong) {
    gather<int64_t>(weight, indices, out);
  } else {
    gather<int32_t>(weight, indices, out);
  }
}

inline c10::DimVector result_sizes(const at::Tensor& weight, const at::Tensor& indices) {
  c10::DimVector sizes(indices.sizes().begin(), indices.sizes().end());
  sizes.push_back(weight.size(1));
  return sizes;
}

}  // namespace embedding_detail

// CompositeImplicitAutograd: it runs before autograd and dispatch modes, so everything but the
// fast path is the plain aten::embedding call.
inline at::Tensor embedding(
    const at::Tensor& weight,
    const at::Tensor& indices,
    c10::SymInt padding_idx,
    bool scale_grad_by_freq,
    bool sparse) {
  if (!embedding_detail::fast(weight, indices)) {
    return at::embedding_symint(weight, indices, padding_idx, scale_grad_by_freq, sparse);
  }
  at::Tensor out = at::detail::empty_cpu(
      embedding_detail::result_sizes(weight, indices), weight.scalar_type(), false,
      c10::MemoryFormat::Contiguous);
  embedding_detail::run(weight, indices, out);
  return out;
}

// CPU only: the arena's out= form (fxrt.exec.arena), called without autograd or dispatch modes.
inline at::Tensor& embedding_out(
    const at::Tensor& weight,
    const at::Tensor& indices,
    c10::SymInt padding_idx,
    bool scale_grad_by_freq,
    bool sparse,
    at::Tensor& out) {
  if (embedding_detail::fast(weight, indices) && out.scalar_type() == weight.scalar_type() &&
      out.is_contiguous() &&
      out.sizes().equals(embedding_detail::result_sizes(weight, indices))) {
    embedding_detail::run(weight, indices, out);
    return out;
  }
  at::Tensor result =
      at::embedding_symint(weight, indices, padding_idx, scale_grad_by_freq, sparse);
  TORCH_CHECK(
      out.sizes().equals(result.sizes()), "fxrt::embedding.out: out has sizes ", out.sizes(),
      " but the result has ", result.sizes());
  out.copy_(result);
  return out;
}

}  // namespace fxrt

TORCH_LIBRARY_FRAGMENT(fxrt, m) {
  m.def(
      "embedding(Tensor weight, Tensor indices, SymInt padding_idx=-1, "
      "bool scale_grad_by_freq=False, bool sparse=False) -> Tensor");
  m.def(
      "embedding.out(Tensor weight, Tensor indices, SymInt padding_idx=-1, "
      "bool scale_grad_by_freq=False, bool sparse=False, *, Tensor(a!) out) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(fxrt, CompositeImplicitAutograd, m) {
  m.impl("embedding", TORCH_FN(fxrt::embedding));
}

TORCH_LIBRARY_IMPL(fxrt, CPU, m) {
  m.impl("embedding.out", TORCH_FN(fxrt::embedding_out));
}
