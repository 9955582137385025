// SLEEF's vectorized tanhf within 1 ulp (what Inductor's CPU kernels call, exported by
// libtorch_cpu), as a kernel over rows of floats: the widest this CPU runs and this libtorch
// exports (AVX-512 or AVX2, x86-64 only), or none. fxrt::tanh (own_ops.h) and the soft-capped
// attention's scores (own_attention.h) call it.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
// Weak, so that a libtorch without them leaves the fast paths off.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
extern "C" {
[[gnu::weak]] __m512 Sleef_tanhf16_u10avx512f(__m512);
[[gnu::weak]] __m256 Sleef_tanhf8_u10avx2(__m256);
}
#pragma GCC diagnostic pop
#endif

namespace fxrt {

namespace tanh_detail {

using Rows = void (*)(const float*, float*, int64_t);

#if defined(__x86_64__)
// Whole vectors straight through; the tail through a zero-padded vector.
#define FXRT_SLEEF_TANH(NAME, TARGET, WIDTH, LOAD, STORE, FN)            \
  [[gnu::target(TARGET)]] static void NAME(const float* x, float* y, int64_t n) { \
    int64_t i = 0;                                                         \
    for (; i + WIDTH <= n; i += WIDTH) {                                   \
      STORE(y + i, FN(LOAD(x + i)));                                       \
    }                                                                      \
    if (i < n) {                                                           \
      float buf[WIDTH] = {};                                               \
      std::memcpy(buf, x + i, sizeof(float) * (n - i));                    \
      STORE(buf, FN(LOAD(buf)));                                           \
      std::memcpy(y + i, buf, sizeof(float) * (n - i));                    \
    }                                                                      \
  }
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
FXRT_SLEEF_TANH(tanh_avx512, "avx512f", 16, _mm512_loadu_ps, _mm512_storeu_ps,
                Sleef_tanhf16_u10avx512f)
FXRT_SLEEF_TANH(tanh_avx2, "avx2,fma", 8, _mm256_loadu_ps, _mm256_storeu_ps,
                Sleef_tanhf8_u10avx2)
#pragma GCC diagnostic pop
#undef FXRT_SLEEF_TANH
#endif

// The widest kernel this CPU runs and this libtorch exports, or nullptr.
inline Rows pick() {
#if defined(__x86_64__)
  if (Sleef_tanhf16_u10avx512f != nullptr && __builtin_cpu_supports("avx512f")) {
    return tanh_avx512;
  }
  if (Sleef_tanhf8_u10avx2 != nullptr && __builtin_cpu_supports("avx2") &&
      __builtin_cpu_supports("fma")) {
    return tanh_avx2;
  }
#endif
  return nullptr;
}

inline Rows kernel() {
  static const Rows rows = pick();
  return rows;
}

}  // namespace tanh_detail

}  // namespace fxrt
