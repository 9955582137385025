// KERNEL instructions: a C function compiled ahead of time (one of Inductor's C++ kernels,
// `extern "C" void kernel(const float* in_ptr0, float* out_ptr0, const int64_t ks0)`), called
// directly with the data pointers of its tensor registers and its integers, as its Python binding
// would call it (fxrt/ops/c_kernels.py), without making Python objects.
//
// On x86-64 and AArch64 a pointer and an int64_t are passed alike (the same integer registers,
// then the same 8-byte stack slots), so a function of N such parameters is called through the
// signature void(int64_t x N): one entry per arity, up to kMaxKernelArgs. Elsewhere no KERNEL is
// bound (the instruction stays a Python call).

#pragma once

#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace fxrt {

#if defined(__x86_64__) || defined(__aarch64__)
constexpr bool kKernelCallsSupported = true;
#else
constexpr bool kKernelCallsSupported = false;
#endif

constexpr size_t kMaxKernelArgs = 64;  // fxrt/ops/c_kernels.py MAX_ARGS

struct KernelArg {
  enum Kind : uint8_t { POINTER, INT, CONSTANT };
  Kind kind;
  int64_t value;  // the register (POINTER, INT) or the constant
};

struct KernelOp {
  void* fn = nullptr;
  std::vector<KernelArg> args;
  int64_t output = -1;  // the node's register: None after the call
};

namespace detail {

using KernelEntry = void (*)(void*, const int64_t*);

template <size_t... I>
void call_kernel_with(void* fn, const int64_t* a, std::index_sequence<I...>) {
  using Fn = void (*)(decltype(static_cast<void>(I), int64_t{})...);
  reinterpret_cast<Fn>(fn)(a[I]...);
}

template <size_t N>
void call_kernel_n(void* fn, const int64_t* a) {
  call_kernel_with(fn, a, std::make_index_sequence<N>{});
}

template <size_t... N>
constexpr std::array<KernelEntry, sizeof...(N)> kernel_entries(std::index_sequence<N...>) {
  return {&call_kernel_n<N>...};
}

inline constexpr std::array<KernelEntry, kMaxKernelArgs + 1> kKernelEntries =
    kernel_entries(std::make_index_sequence<kMaxKernelArgs + 1>{});

}  // namespace detail

inline void run_kernel(const KernelOp& op, std::vector<c10::IValue>& regs) {
  std::array<int64_t, kMaxKernelArgs> a;
  for (size_t i = 0; i < op.args.size(); ++i) {
    const KernelArg& arg = op.args[i];
    if (arg.kind == KernelArg::CONSTANT) {
      a[i] = arg.value;
      continue;
    }
    const c10::IValue& v = regs[static_cast<size_t>(arg.value)];
    if (arg.kind == KernelArg::POINTER) {
      TORCH_CHECK(
          v.isTensor() && v.toTensor().defined(), "kernel argument ", i,
          " is not a defined tensor but ", v.tagKind());
      a[i] = reinterpret_cast<intptr_t>(v.toTensor().data_ptr());
    } else if (v.isInt()) {
      a[i] = v.toInt();
    } else {
      TORCH_CHECK(v.isBool(), "kernel argument ", i, " is not an int but ", v.tagKind());
      a[i] = v.toBool() ? 1 : 0;  // what the binding reads from a Python bool
    }
  }
  detail::kKernelEntries[op.args.size()](op.fn, a.data());
  regs[static_cast<size_t>(op.output)] = c10::IValue();
}

}  // namespace fxrt
