// The vector layer of fxrt's CPU kernels (own_attention.h, own_decoder.h): kLanes floats as one
// value, either one AVX-512 vector of GCC's extension (Lanes) or a pair of AVX2 ones (Pair), with
// what the kernels do with either (Vec), the exponential they share, and the build a CPU runs.

#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace fxrt {
namespace attention_detail {

constexpr int64_t kLanes = 16;  // the width of the blocks whose sums stay in vector registers

// kLanes floats as one value (GCC's vector extension: one AVX-512 register).
using Lanes = float __attribute__((vector_size(kLanes * sizeof(float))));

using IntLanes = int32_t __attribute__((vector_size(kLanes * sizeof(int32_t))));

constexpr Lanes kIota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr Lanes kNegInf = {-kInf, -kInf, -kInf, -kInf, -kInf, -kInf, -kInf, -kInf,
                           -kInf, -kInf, -kInf, -kInf, -kInf, -kInf, -kInf, -kInf};

[[gnu::always_inline]] inline Lanes load_lanes(const float* src) {
  Lanes v;
  std::memcpy(&v, src, sizeof(v));
  return v;
}

// kLanes floats as two halves of kLanes / 2 (two AVX2 registers). Without AVX-512, GCC keeps a
// 64-byte vector of its extension in memory, moving it in 8-byte pieces around every operation,
// and turns each compare of one into a branch per lane (the kernel then ran 10x slower than
// ATen's on AVX2); a pair of halves stays in registers. The attention kernel is written over
// either (template parameter V): Lanes where the target has 16-float registers, Pair elsewhere.
using Half = float __attribute__((vector_size(kLanes / 2 * sizeof(float))));
using IntHalf = int32_t __attribute__((vector_size(kLanes / 2 * sizeof(int32_t))));

template <class H>
struct Two {
  H lo, hi;
};
using Pair = Two<Half>;
using IntPair = Two<IntHalf>;

#define FXRT_TWO_OP(op)                                                                      \
  template <class H>                                                                         \
  [[gnu::always_inline]] inline Two<H> operator op(Two<H> a, Two<H> b) {                     \
    return {a.lo op b.lo, a.hi op b.hi};                                                     \
  }                                                                                          \
  template <class H, class S, class = std::enable_if_t<std::is_arithmetic_v<S>>>             \
  [[gnu::always_inline]] inline Two<H> operator op(Two<H> a, S s) {                          \
    return {a.lo op s, a.hi op s};                                                           \
  }                                                                                          \
  template <class H, class S, class = std::enable_if_t<std::is_arithmetic_v<S>>>             \
  [[gnu::always_inline]] inline Two<H> operator op(S s, Two<H> a) {                          \
    return {s op a.lo, s op a.hi};                                                           \
  }                                                                                          \
  template <class H, class B>                                                                \
  [[gnu::always_inline]] inline Two<H>& operator op##=(Two<H>& a, B b) {                     \
    return a = a op b;                                                                       \
  }
FXRT_TWO_OP(+)
FXRT_TWO_OP(-)
FXRT_TWO_OP(*)
FXRT_TWO_OP(/)
FXRT_TWO_OP(&)
FXRT_TWO_OP(|)
FXRT_TWO_OP(<<)
FXRT_TWO_OP(>>)
#undef FXRT_TWO_OP

template <class H>
[[gnu::always_inline]] inline Two<H> operator~(Two<H> a) {
  return {~a.lo, ~a.hi};
}

// What the kernel does with a V of either kind.
template <class V>
struct Vec;

template <>
struct Vec<Lanes> {
  using Int = IntLanes;
  // Vector sums a step of attention's weighted sum of values keeps in registers (of 32).
  static constexpr int64_t kSums = 8;
  [[gnu::always_inline]] static Lanes load(const float* src) { return load_lanes(src); }
  // The first m lanes; a whole vector as one store (a copy of a length not known at compile
  // time goes through memory, 8 bytes at a time).
  [[gnu::always_inline]] static void store(float* dst, const Lanes& v, int64_t m) {
    if (m == kLanes) {
      std::memcpy(dst, &v, sizeof(v));
    } else {
      std::memcpy(dst, &v, sizeof(float) * m);
    }
  }
  [[gnu::always_inline]] static Lanes splat(float x) { return Lanes{} + x; }
  [[gnu::always_inline]] static float lane(const Lanes& v, int64_t l) { return v[l]; }
  [[gnu::always_inline]] static void set_lane(Lanes& v, int64_t l, float x) { v[l] = x; }
  [[gnu::always_inline]] static IntLanes to_int(const Lanes& v) { return __builtin_convertvector(v, IntLanes); }
  [[gnu::always_inline]] static IntLanes bits(const Lanes& v) { return __builtin_bit_cast(IntLanes, v); }
  [[gnu::always_inline]] static Lanes floats(const IntLanes& v) { return __builtin_bit_cast(Lanes, v); }
  // all ones where x is not at most c (NaN included)
  [[gnu::always_inline]] static IntLanes not_at_most(const Lanes& x, float c) { return ~(x <= c); }
  [[gnu::always_inline]] static Lanes iota_below(const Lanes& x, int64_t j0, int64_t n) {
    return kIota + static_cast<float>(j0) < static_cast<float>(n) ? x : kNegInf;
  }
  [[gnu::always_inline]] static Lanes max(const Lanes& a, const Lanes& b) { return a > b ? a : b; }
};

template <>
struct Vec<Pair> {
  using Int = IntPair;
  // Two registers each, of 16: eight sums would spill (with the value and weight loaded).
  static constexpr int64_t kSums = 4;
  [[gnu::always_inline]] static Pair load(const float* src) {
    Pair v;
    std::memcpy(&v.lo, src, sizeof(Half));
    std::memcpy(&v.hi, src + kLanes / 2, sizeof(Half));
    return v;
  }
  [[gnu::always_inline]] static void store(float* dst, const Pair& v, int64_t m) {
    constexpr int64_t h = kLanes / 2;
    if (m == kLanes) {
      std::memcpy(dst, &v.lo, sizeof(Half));
      std::memcpy(dst + h, &v.hi, sizeof(Half));
      return;
    }
    std::memcpy(dst, &v.lo, sizeof(float) * std::min(m, h));
    if (m > h) {
      std::memcpy(dst + h, &v.hi, sizeof(float) * (m - h));
    }
  }
  [[gnu::always_inline]] static Pair splat(float x) { return {Half{} + x, Half{} + x}; }
  [[gnu::always_inline]] static float lane(const Pair& v, int64_t l) { return l < kLanes / 2 ? v.lo[l] : v.hi[l - kLanes / 2]; }
  [[gnu::always_inline]] static void set_lane(Pair& v, int64_t l, float x) {
    if (l < kLanes / 2) {
      v.lo[l] = x;
    } else {
      v.hi[l - kLanes / 2] = x;
    }
  }
  [[gnu::always_inline]] static IntPair to_int(const Pair& v) {
    return {__builtin_convertvector(v.lo, IntHalf), __builtin_convertvector(v.hi, IntHalf)};
  }
  [[gnu::always_inline]] static IntPair bits(const Pair& v) {
    return {__builtin_bit_cast(IntHalf, v.lo), __builtin_bit_cast(IntHalf, v.hi)};
  }
  [[gnu::always_inline]] static Pair floats(const IntPair& v) {
    return {__builtin_bit_cast(Half, v.lo), __builtin_bit_cast(Half, v.hi)};
  }
  [[gnu::always_inline]] static IntPair not_at_most(const Pair& x, float c) { return {~(x.lo <= c), ~(x.hi <= c)}; }
  [[gnu::always_inline]] static Pair iota_below(const Pair& x, int64_t j0, int64_t n) {
    constexpr Half lo = {0, 1, 2, 3, 4, 5, 6, 7};
    const Half inf = Half{} - kInf;
    const float j = static_cast<float>(j0), end = static_cast<float>(n);
    return {lo + j < end ? x.lo : inf, lo + (j + kLanes / 2) < end ? x.hi : inf};
  }
  [[gnu::always_inline]] static Pair max(const Pair& a, const Pair& b) {
    return {a.lo > b.lo ? a.lo : b.lo, a.hi > b.hi ? a.hi : b.hi};
  }
};

// N zero vectors, lane by lane: `std::array<V, N> a{}` zeroes them through memory (`rep stos`,
// tens of cycles per block of scores), and the sums then start from memory.
template <class V, size_t N>
[[gnu::always_inline]] inline std::array<V, N> zeros() {
  std::array<V, N> a;
#pragma GCC unroll 8
  for (size_t i = 0; i < N; ++i) {
    a[i] = Vec<V>::splat(0.0f);
  }
  return a;
}

// e^x for x <= 0, lane by lane (x below -87, -inf included, gives 0; NaN stays NaN, so that a NaN
// score makes its row NaN, as eager's softmax does): Cephes' expf polynomial after reducing by
// ln 2, within a few float32 ulps. kCompare: the kept lanes by a compare (in attention's builds,
// whose vectors the target compares natively); else by integer arithmetic, which vectorizes
// whatever the target.
template <class V, bool kCompare>
[[gnu::always_inline]] inline V exp_nonpositive_v(V x) {
  using T = Vec<V>;
  const V round = x * 1.44269504088896341f + 12582912.0f;  // + 1.5 * 2^23: to nearest
  const V n = round - 12582912.0f;
  const V r = x - n * 0.693359375f + n * 2.12194440e-4f;
  V p = 1.9875691500e-4f + r * 0.0f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  typename T::Int bits = T::bits(p);
  bits += T::to_int(n) << 23;
  if constexpr (kCompare) {
    bits &= T::not_at_most(x, -87.0f);  // all ones where kept (NaN compares false: kept)
  } else {
    // x <= -87 as integers: negative, magnitude at least 87's bits, and not a NaN's (above
    // infinity's); each test the sign of a difference that cannot overflow.
    const typename T::Int xi = T::bits(x);
    const typename T::Int mag = xi & 0x7fffffff;
    bits &= ~((xi >> 31) & ~((mag - 0x42ae0000) >> 31) & ~((0x7f800000 - mag) >> 31));
  }
  return T::floats(bits);
}

// n rounded up to whole blocks of kLanes.
inline int64_t padded(int64_t n) {
  return (n + kLanes - 1) / kLanes * kLanes;
}

// The vector builds a CPU runs: AVX-512 (over Lanes), AVX2 with FMA (over Pair), or the
// baseline (over Pair); decided once.
enum class Width { k512, k256, kBase };

inline Width vector_width() {
  static const Width width = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) {
      return Width::k512;
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
      return Width::k256;
    }
    return Width::kBase;
  }();
  return width;
}

// The sum of x's lanes, halves added pairwise (each level's adds independent).
[[gnu::always_inline]] inline float sum_half(Half h) {
  using Quarter = float __attribute__((vector_size(kLanes / 4 * sizeof(float))));
  Quarter a, b;
  std::memcpy(&a, &h, sizeof(a));
  std::memcpy(&b, reinterpret_cast<const char*>(&h) + sizeof(a), sizeof(b));
  const Quarter q = a + b;
  return (q[0] + q[2]) + (q[1] + q[3]);
}

[[gnu::always_inline]] inline float sum_lanes(Lanes x) {
  Half lo, hi;
  std::memcpy(&lo, &x, sizeof(lo));
  std::memcpy(&hi, reinterpret_cast<const char*>(&x) + sizeof(lo), sizeof(hi));
  return sum_half(lo + hi);
}

[[gnu::always_inline]] inline float sum_lanes(Pair x) {
  return sum_half(x.lo + x.hi);
}

// The largest of x's lanes, halves compared pairwise as T::max does (a NaN lane may give NaN,
// which makes the row NaN, as a NaN score does in eager).
[[gnu::always_inline]] inline float max_half(Half h) {
  using Quarter = float __attribute__((vector_size(kLanes / 4 * sizeof(float))));
  Quarter a, b;
  std::memcpy(&a, &h, sizeof(a));
  std::memcpy(&b, reinterpret_cast<const char*>(&h) + sizeof(a), sizeof(b));
  const Quarter q = a > b ? a : b;
  const float x = q[0] > q[2] ? q[0] : q[2], y = q[1] > q[3] ? q[1] : q[3];
  return x > y ? x : y;
}

[[gnu::always_inline]] inline float max_lanes(Lanes x) {
  Half lo, hi;
  std::memcpy(&lo, &x, sizeof(lo));
  std::memcpy(&hi, reinterpret_cast<const char*>(&x) + sizeof(lo), sizeof(hi));
  return max_half(lo > hi ? lo : hi);
}

[[gnu::always_inline]] inline float max_lanes(Pair x) {
  return max_half(x.lo > x.hi ? x.lo : x.hi);
}

}  // namespace attention_detail
}  // namespace fxrt
