// fxrt's own ops for CPU calls where ATen's kernel choice costs more host time than the math
// (fxrt/ops/own_ops.py rewrites graphs to them). Each computes what the ATen op computes,
// with one of ATen's own CPU kernels, and calls the ATen op itself whenever its fast path does not
// apply, so autograd, dispatch modes, subclasses and other devices see exactly the ATen op.
//
// fxrt::gelu(Tensor self, *, str approximate='none') -> Tensor, and its out= overload.
//   aten::gelu on a contiguous float32 CPU tensor computes through oneDNN's eltwise primitive,
//   whose per-call set-up costs about 9 us (measured: 1x256, 12.5 us against 3.1 us with oneDNN
//   off); ATen's own vectorized GeluKernel, the one ATen runs whenever oneDNN is off or the input
//   is not contiguous, is faster up to about 16K elements. fxrt::gelu runs that kernel up to
//   kSmallGelu elements. Its results are ATen's GeluKernel's, which differ from oneDNN's in the
//   last bit of some elements (at most 4.8e-7 absolute on N(0, 16) inputs).
//
// fxrt::layer_norm(Tensor input, int[] normalized_shape, Tensor? weight, Tensor? bias,
//                  float eps) -> Tensor, and its out= overload.
//   The first result of aten::native_layer_norm, for graphs that use only that one (inference).
//   native_layer_norm allocates the normalized tensor plus the rows' means and inverse standard
//   deviations, and reshapes the two; on all-float32 contiguous CPU tensors fxrt::layer_norm runs
//   the same kernel (LayerNormKernel, which skips statistics it is given no tensor for) into one
//   result, or into the arena. Results are identical to eager's.
//
// fxrt::attention: aten::_scaled_dot_product_flash_attention_for_cpu's schema (own_attention.h).
// fxrt::sdpa: its output alone, with an out= overload (inference never reads the logsumexp; the
//   arena holds the output).
//
// fxrt::embedding: aten::embedding's forward, the rows copied without the reshape, index_select
//   and view ATen makes of it (own_embedding.h).
//
// fxrt::layer_norm_chain: LayerNorm written out in ATen ops, eager's chain bit for bit
//   (own_layer_norm_chain.h).
//
// fxrt::softcap_sdpa: attention with soft-capped scores (Gemma-2's), with an out= overload
//   (own_softcap.h).
//
// fxrt::tanh(Tensor self) -> Tensor, and its out= overload.
//   aten::tanh on float32 CPU tensors computes through MKL's vector math (VML), which on this
//   project's AMD machines takes 2.7 ns an element (64K elements: 178 us, against 24 us for
//   aten::sigmoid); Inductor's kernels compute tanh with SLEEF's vectorized tanhf (within 1 ulp),
//   which libtorch_cpu exports. fxrt::tanh runs that function on contiguous float32 tensors,
//   AVX-512 or AVX2 picked at load (x86-64 only; elsewhere, or without the symbols, aten::tanh),
//   on the calling thread: with more than one intra-op thread, inputs above kSerialTanh elements
//   go to aten::tanh, which shares them out. Results differ from eager's in the last bit of some
//   elements (docs/numerics.md states the bound); NaN, +-inf, -0 and denormals are eager's.

#pragma once

#include "inline_ops.h"
#include "own_attention.h"
#include "own_decoder_ops.h"
#include "own_embedding.h"
#include "own_layer_norm_chain.h"
#include "own_softcap.h"
#include "own_tanh.h"

#include <ATen/TensorIterator.h>
#include <ATen/native/Activation.h>
#include <ATen/native/layer_norm.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/tanh.h>
#include <ATen/ops/native_layer_norm.h>
#include <c10/core/GradMode.h>
#include <torch/library.h>

#include <cstring>
#include <string_view>


namespace fxrt {

// The largest input fxrt::gelu computes with GeluKernel (measured crossover with oneDNN: between
// 8K and 16K elements on one or two threads).
constexpr int64_t kSmallGelu = 8192;

// ATen's CPU kernels are called through their DispatchStubs only where the build linked a probe
// (cpu_stubs_probe.cpp) with the CPU-capability macros it defines next to FXRT_CPU_STUBS: the
// stubs' declarations depend on the capabilities torch was built with (AVX512 and AVX2 on
// x86-64, SVE on aarch64, ...), which its headers do not record. Elsewhere the fast paths are
// compiled out and the ATen ops run.
#if defined(FXRT_CPU_STUBS)
constexpr bool kCpuStubs = true;
#else
constexpr bool kCpuStubs = false;
#endif

// A float32 contiguous CPU tensor autograd will not record (undefined counts: an absent weight).
inline bool plain_float(const at::Tensor& t) {
  return !t.defined() ||
      (plain_tensor(t) && t.device().is_cpu() && t.scalar_type() == at::kFloat &&
       t.is_contiguous() && !(c10::GradMode::is_enabled() && t.requires_grad()));
}

// Eager's aten::gelu (oneDNN) overflows to inf above FLT_MAX / 2 and turns +inf into NaN, where
// GeluKernel returns x: inputs with such values go to aten::gelu, so results match eager's.
inline bool has_huge_values(const at::Tensor& self) {
  const float* x = self.const_data_ptr<float>();
  bool huge = false;
  for (int64_t i = 0, n = self.numel(); i < n; ++i) {
    huge |= x[i] > 1.0e38f;  // +inf too; NaN compares false, and both kernels return NaN
  }
  return huge;
}

inline bool small_gelu(const at::Tensor& self, std::string_view approximate) {
  return kCpuStubs && approximate == "none" && self.defined() && plain_float(self) &&
      self.numel() <= kSmallGelu && !has_huge_values(self);
}

// The kernel calls are compiled only with FXRT_CPU_STUBS (not `if constexpr`: a discarded
// statement outside a template still instantiates the stub's call, and its reference to a
// DispatchStub symbol this libtorch may not define).
inline void run_gelu_kernel(const at::Tensor& self, at::Tensor& out) {
#if defined(FXRT_CPU_STUBS)
  at::TensorIterator iter = at::TensorIterator::unary_op(out, self);
  at::native::GeluKernel(at::kCPU, iter, at::native::GeluType::None);
#else
  (void)self, (void)out;
#endif
}

// CompositeImplicitAutograd: it runs before autograd and dispatch modes, so everything but the
// fast path is the plain aten::gelu call.
inline at::Tensor gelu(const at::Tensor& self, c10::string_view approximate) {
  if (!small_gelu(self, approximate)) {
    return at::gelu(self, approximate);
  }
  at::Tensor out =
      at::detail::empty_cpu(self.sizes(), at::kFloat, false, c10::MemoryFormat::Contiguous);
  run_gelu_kernel(self, out);
  return out;
}

// CPU only: the arena's out= form (fxrt.exec.arena), called without autograd or dispatch modes.
inline at::Tensor& gelu_out(const at::Tensor& self, c10::string_view approximate, at::Tensor& out) {
  if (small_gelu(self, approximate) && out.scalar_type() == at::kFloat && out.is_contiguous() &&
      out.sizes().equals(self.sizes())) {
    run_gelu_kernel(self, out);
    return out;
  }
  return at::gelu_out(out, self, approximate);
}

inline bool fast_layer_norm(
    const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias) {
  return kCpuStubs && input.defined() && plain_float(input) && plain_float(weight) &&
      plain_float(bias);
}

// Y = layer_norm(input) into `out` (input's sizes, contiguous), as native_layer_norm's CPU kernel.
inline void run_layer_norm_kernel(
    const at::Tensor& input,
    at::IntArrayRef normalized_shape,
    const at::Tensor& weight,
    const at::Tensor& bias,
    double eps,
    at::Tensor& out) {
#if defined(FXRT_CPU_STUBS)
  auto [M, N] = at::native::_check_layer_norm_inputs(input, normalized_shape, weight, bias);
  if (M > 0) {
    at::native::LayerNormKernel(at::kCPU, input, weight, bias, M, N, eps, &out, nullptr, nullptr);
  }
#else
  (void)input, (void)normalized_shape, (void)weight, (void)bias, (void)eps, (void)out;
#endif
}

inline at::Tensor layer_norm(
    const at::Tensor& input,
    at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias,
    double eps) {
  const at::Tensor& w = weight.has_value() ? *weight : at::Tensor();
  const at::Tensor& b = bias.has_value() ? *bias : at::Tensor();
  if (!fast_layer_norm(input, w, b)) {
    return std::get<0>(at::native_layer_norm(input, normalized_shape, weight, bias, eps));
  }
  at::Tensor out =
      at::detail::empty_cpu(input.sizes(), at::kFloat, false, c10::MemoryFormat::Contiguous);
  run_layer_norm_kernel(input, normalized_shape, w, b, eps, out);
  return out;
}

inline at::Tensor& layer_norm_out(
    const at::Tensor& input,
    at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias,
    double eps,
    at::Tensor& out) {
  TORCH_CHECK(
      out.sizes().equals(input.sizes()), "fxrt::layer_norm.out: out has sizes ", out.sizes(),
      " but the input has ", input.sizes());
  const at::Tensor& w = weight.has_value() ? *weight : at::Tensor();
  const at::Tensor& b = bias.has_value() ? *bias : at::Tensor();
  if (fast_layer_norm(input, w, b) && out.scalar_type() == at::kFloat && out.is_contiguous()) {
    run_layer_norm_kernel(input, normalized_shape, w, b, eps, out);
  } else {
    out.copy_(std::get<0>(at::native_layer_norm(input, normalized_shape, weight, bias, eps)));
  }
  return out;
}

// --- tanh ---------------------------------------------------------------------------------------


// Above this many elements, with more than one intra-op thread, aten::tanh (parallel) runs
// (ATen's own grain for element-wise loops).
constexpr int64_t kSerialTanh = 32768;

namespace tanh_detail {

inline bool fast(const at::Tensor& self) {
  return kernel() != nullptr && self.defined() && plain_float(self) &&
      (self.numel() <= kSerialTanh || at::get_num_threads() == 1);
}

}  // namespace tanh_detail

// CompositeImplicitAutograd, as fxrt::gelu.
inline at::Tensor tanh(const at::Tensor& self) {
  if (!tanh_detail::fast(self)) {
    return at::tanh(self);
  }
  at::Tensor out =
      at::detail::empty_cpu(self.sizes(), at::kFloat, false, c10::MemoryFormat::Contiguous);
  tanh_detail::kernel()(self.const_data_ptr<float>(), out.mutable_data_ptr<float>(), self.numel());
  return out;
}

inline at::Tensor& tanh_out(const at::Tensor& self, at::Tensor& out) {
  if (tanh_detail::fast(self) && out.scalar_type() == at::kFloat && out.is_contiguous() &&
      out.sizes().equals(self.sizes())) {
    tanh_detail::kernel()(self.const_data_ptr<float>(), out.mutable_data_ptr<float>(), self.numel());
    return out;
  }
  return at::tanh_out(out, self);
}

}  // namespace fxrt

TORCH_LIBRARY_FRAGMENT(fxrt, m) {
  m.def("gelu(Tensor self, *, str approximate='none') -> Tensor");
  m.def("gelu.out(Tensor self, *, str approximate='none', Tensor(a!) out) -> Tensor(a!)");
  m.def(
      "layer_norm(Tensor input, int[] normalized_shape, Tensor? weight, Tensor? bias, "
      "float eps) -> Tensor");
  m.def(
      "layer_norm.out(Tensor input, int[] normalized_shape, Tensor? weight, Tensor? bias, "
      "float eps, *, Tensor(a!) out) -> Tensor(a!)");
  m.def(
      "attention(Tensor query, Tensor key, Tensor value, float dropout_p=0., "
      "bool is_causal=False, *, Tensor? attn_mask=None, float? scale=None) -> "
      "(Tensor output, Tensor logsumexp)");
  m.def(
      "sdpa(Tensor query, Tensor key, Tensor value, float dropout_p=0., bool is_causal=False, "
      "*, Tensor? attn_mask=None, float? scale=None) -> Tensor");
  m.def(
      "sdpa.out(Tensor query, Tensor key, Tensor value, float dropout_p=0., "
      "bool is_causal=False, *, Tensor? attn_mask=None, float? scale=None, Tensor(a!) out) -> "
      "Tensor(a!)");
  m.def(
      "softcap_sdpa(Tensor query, Tensor key, Tensor value, float softcap, bool is_causal=False, "
      "*, Tensor? attn_mask=None, float? scale=None) -> Tensor");
  m.def(
      "softcap_sdpa.out(Tensor query, Tensor key, Tensor value, float softcap, "
      "bool is_causal=False, *, Tensor? attn_mask=None, float? scale=None, Tensor(a!) out) -> "
      "Tensor(a!)");
  m.def("tanh(Tensor self) -> Tensor");
  m.def("tanh.out(Tensor self, *, Tensor(a!) out) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(fxrt, CompositeImplicitAutograd, m) {
  m.impl("gelu", TORCH_FN(fxrt::gelu));
  m.impl("layer_norm", TORCH_FN(fxrt::layer_norm));
  m.impl("attention", TORCH_FN(fxrt::attention));
  m.impl("sdpa", TORCH_FN(fxrt::sdpa));
  m.impl("softcap_sdpa", TORCH_FN(fxrt::softcap_sdpa));
  m.impl("tanh", TORCH_FN(fxrt::tanh));
}

TORCH_LIBRARY_IMPL(fxrt, CPU, m) {
  m.impl("gelu.out", TORCH_FN(fxrt::gelu_out));
  m.impl("layer_norm.out", TORCH_FN(fxrt::layer_norm_out));
  m.impl("sdpa.out", TORCH_FN(fxrt::sdpa_out));
  m.impl("softcap_sdpa.out", TORCH_FN(fxrt::softcap_sdpa_out));
  m.impl("tanh.out", TORCH_FN(fxrt::tanh_out));
}
