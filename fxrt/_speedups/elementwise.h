// OUT's inline elementwise form (lower() chose it: OutCall.elementwise): add, sub and mul of two
// float32 CPU tensors, or of one and a number, and clamp_min against a number (relu), written
// into the arena slot by a loop of this file instead of the out= op through the dispatcher. The
// out= op builds a TensorIterator per call, about 0.5 us, which is most of a small op's time.
//
// Each result is the out= op's, bit for bit: one IEEE operation per element (add and sub with
// alpha 1, mul), the number rounded to float first as ATen's kernels take it, and clamp_min's
// `x < m ? m : x` (NaN stays NaN, -0.0 stays -0.0, as eager's). A second operand may cover the
// trailing dimensions of the first (a bias): it repeats per row, as broadcasting does.
//
// run_elementwise() checks the actual tensors (plain, float32, CPU, contiguous, the sizes the
// form was made for) and returns false when anything differs; the loop then runs the out= op.
// It runs on calls with an arena only, which no dispatch mode sees (CallGuards).
#pragma once

#include "call_op.h"
#include "inline_ops.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace fxrt {

namespace elementwise_detail {

// The loops: `o[i] = a[i] op b[i]` with `na` and `nb` the operands' element counts (n, or the
// length of a row they repeat over; nb 0: the number s). O3 vectorizes them with their tails.
#define FXRT_ELEMENTWISE_LOOP(NAME, EXPR)                                                       \
  [[gnu::target_clones("avx512f", "avx2", "default"), gnu::optimize("O3", "fp-contract=off")]] \
  static void NAME(                                                                             \
      float* o, const float* a, const float* b, float s, int64_t n, int64_t na, int64_t nb) {   \
    if (nb == 0) {                                                                              \
      for (int64_t i = 0; i < n; ++i) {                                                         \
        const float x = a[i], y = s;                                                            \
        o[i] = (EXPR);                                                                          \
      }                                                                                         \
    } else if (na == n && nb == n) {                                                            \
      for (int64_t i = 0; i < n; ++i) {                                                         \
        const float x = a[i], y = b[i];                                                         \
        o[i] = (EXPR);                                                                          \
      }                                                                                         \
    } else if (na == n) {                                                                       \
      for (int64_t r = 0; r < n; r += nb) {                                                     \
        for (int64_t j = 0; j < nb; ++j) {                                                      \
          const float x = a[r + j], y = b[j];                                                   \
          o[r + j] = (EXPR);                                                                    \
        }                                                                                       \
      }                                                                                         \
    } else {                                                                                    \
      for (int64_t r = 0; r < n; r += na) {                                                     \
        for (int64_t j = 0; j < na; ++j) {                                                      \
          const float x = a[j], y = b[r + j];                                                   \
          o[r + j] = (EXPR);                                                                    \
        }                                                                                       \
      }                                                                                         \
    }                                                                                           \
  }

FXRT_ELEMENTWISE_LOOP(add_loop, x + y)
FXRT_ELEMENTWISE_LOOP(sub_loop, x - y)
FXRT_ELEMENTWISE_LOOP(mul_loop, x * y)
FXRT_ELEMENTWISE_LOOP(clamp_min_loop, x < y ? y : x)
#undef FXRT_ELEMENTWISE_LOOP

// A number operand: an int or float constant (not a bool), or the wrapped number torch.ops makes
// of one for a Tensor argument.
inline std::optional<double> number(const BoundArg& arg) {
  if (arg.kind != BoundArg::CONST) {
    return std::nullopt;
  }
  const IValue& v = arg.value;
  if (v.isDouble()) {
    return v.toDouble();
  }
  if (v.isInt()) {
    return static_cast<double>(v.toInt());
  }
  if (v.isTensor()) {
    // Read where it lies, not through item(): binding may run under a dispatch mode (AOTAutograd
    // compiles under its fake mode), which must not see this.
    const at::Tensor& t = v.toTensor();
    if (t.defined() && t.unsafeGetTensorImpl()->is_wrapped_number() && t.device().is_cpu() &&
        t.has_storage() && t.numel() == 1) {
      if (t.scalar_type() == at::kDouble) {
        return *t.const_data_ptr<double>();
      }
      if (t.scalar_type() == at::kLong) {
        return static_cast<double>(*t.const_data_ptr<int64_t>());
      }
    }
  }
  return std::nullopt;
}

// Whether `t` is a float32 CPU tensor that the loop reads as dense memory.
inline bool dense_float(const at::Tensor& t) {
  return plain_layout(t) && t.scalar_type() == at::kFloat && t.device().is_cpu() &&
      t.is_contiguous();
}

// How many elements of `t` an element of the `out.numel()` results reads in turn: all of them,
// or a row that repeats (t's sizes, leading 1s dropped, are out's trailing sizes); 0 for neither.
inline int64_t operand_length(const at::Tensor& t, const at::Tensor& out) {
  if (!dense_float(t)) {
    return 0;
  }
  c10::IntArrayRef ts = t.sizes(), os = out.sizes();
  size_t lead = 0;
  while (lead < ts.size() && ts[lead] == 1) {
    ++lead;
  }
  const size_t k = ts.size() - lead;
  if (k > os.size()) {
    return 0;
  }
  for (size_t d = 0; d < k; ++d) {
    if (ts[lead + d] != os[os.size() - k + d]) {
      return 0;
    }
  }
  return t.numel();
}

}  // namespace elementwise_detail

// The form of `out` (the bound out= call of an OUT) that `kind` names ("add", "sub", "mul",
// "clamp_min"), or why there is none: the op must be that op's out= overload, its operands
// registers or (the second; clamp_min's always) a number, and alpha 1.
inline std::optional<Elementwise> bind_elementwise(
    const CallOp& out,
    std::string_view kind,
    std::string& why) {
  namespace d = elementwise_detail;
  struct Form {
    std::string_view name;
    Elementwise::Loop loop;
    size_t n_args;  // the out= overload's: self, other or min, [alpha,] out
    bool alpha;
  };
  static const Form kForms[] = {
      {"add", d::add_loop, 4, true},
      {"sub", d::sub_loop, 4, true},
      {"mul", d::mul_loop, 3, false},
      {"clamp_min", d::clamp_min_loop, 3, false},
  };
  const Form* form = nullptr;
  for (const Form& f : kForms) {
    form = f.name == kind ? &f : form;
  }
  if (form == nullptr) {
    why = "no elementwise form " + std::string(kind);
    return std::nullopt;
  }
  const c10::OperatorName& name = out.op.operator_name();
  if (name.name != "aten::" + std::string(kind) || name.overload_name != "out" ||
      out.args.size() != form->n_args || out.args[0].kind != BoundArg::REG) {
    why = "the elementwise form " + std::string(kind) + " of another op";
    return std::nullopt;
  }
  Elementwise e;
  e.loop = form->loop;
  e.a = out.args[0].reg;
  const BoundArg& other = out.args[1];
  std::optional<double> s = d::number(other);
  if (other.kind == BoundArg::REG && form->name != "clamp_min") {
    e.b = other.reg;
  } else if (s.has_value()) {
    e.scalar = static_cast<float>(*s);  // as ATen's CPU kernels read a number for float32
  } else {
    why = "an elementwise operand that is neither a register nor a number";
    return std::nullopt;
  }
  std::optional<double> alpha = form->alpha ? d::number(out.args[2]) : 1.0;
  if (!alpha.has_value() || *alpha != 1.0) {
    why = "an elementwise " + std::string(kind) + " with alpha other than 1";
    return std::nullopt;
  }
  return e;
}

// Runs `e` into `out` (the arena slot's tensor); false, having written nothing, when the tensors
// are not what the form handles.
inline bool run_elementwise(
    const Elementwise& e,
    const std::vector<IValue>& regs,
    const at::Tensor& out) {
  namespace d = elementwise_detail;
  const IValue& av = regs[static_cast<size_t>(e.a)];
  if (!av.isTensor() || !d::dense_float(out)) {
    return false;
  }
  // A row length divides n (operand_length: the row is out's trailing dimensions).
  const int64_t n = out.numel();
  const int64_t na = d::operand_length(av.toTensor(), out);
  int64_t nb = 0;
  const float* bp = nullptr;
  if (e.b >= 0) {
    const IValue& bv = regs[static_cast<size_t>(e.b)];
    nb = bv.isTensor() ? d::operand_length(bv.toTensor(), out) : 0;
    if (nb == 0) {
      return false;
    }
    bp = bv.toTensor().const_data_ptr<float>();
  }
  if (na == 0 || (na != n && (e.b < 0 || nb != n))) {
    return false;  // not an operand, or a row with a number or with another row
  }
  e.loop(out.mutable_data_ptr<float>(), av.toTensor().const_data_ptr<float>(), bp, e.scalar, n,
         na, nb);
  return true;
}

}  // namespace fxrt
