// A probe the builds (setup.py through cpu_stubs.py, csrc/cmake/cpu_stubs.cmake) compile and link
// against the installed torch to learn how it declares ATen's CPU DispatchStubs, which fxrt's own
// ops call (own_ops.h).
//
// DispatchStub.h declares DispatchStubImpl::get_call_ptr with one parameter per CPU capability
// torch was built with (HAVE_AVX512_CPU_DEFINITION, HAVE_SVE_CPU_DEFINITION, ...: macros torch's
// build sets and its headers do not record), and each stub's operator() reads one static kernel
// pointer per capability. Both are symbols of libtorch_cpu named after those parameters and
// capabilities, so this program links only when the macros it is compiled with are the ones
// torch was built with: the build tries the known sets and defines the one that links (with
// FXRT_CPU_STUBS), or none, and the own ops then call the ATen op instead of the kernel.

#include <ATen/TensorIterator.h>
#include <ATen/native/Activation.h>
#include <ATen/native/layer_norm.h>

namespace {

void use_stubs(at::TensorIterator& iter, const at::Tensor& t, at::Tensor* out) {
  at::native::GeluKernel(at::kCPU, iter, at::native::GeluType::None);
  at::native::LayerNormKernel(at::kCPU, t, t, t, 1, 1, 1e-5, out, nullptr, nullptr);
}

}  // namespace

int main(int argc, char** argv) {
  // Never runs the kernels: the calls only need to link.
  if (argc > 1000) {
    use_stubs(*reinterpret_cast<at::TensorIterator*>(argv), at::Tensor(), nullptr);
  }
  return 0;
}
