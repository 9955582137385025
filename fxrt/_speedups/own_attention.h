// fxrt::attention(Tensor query, Tensor key, Tensor value, float dropout_p=0., bool is_causal=False,
//                 *, Tensor? attn_mask=None, float? scale=None) -> (Tensor output, Tensor logsumexp)
//
// aten::_scaled_dot_product_flash_attention_for_cpu (what scaled_dot_product_attention runs on the
// CPU) on the calling thread: ATen's flash kernel allocates its blocks' buffers and goes through a
// parallel loop and two BLAS calls per block, about 20 us on a 4-head 16x16 problem whose math
// takes 1-2 us, and on one thread runs at about half this kernel's speed from 16 to 512 keys. On
// float32 CPU tensors whose last dimension is dense, with no dropout and an additive float mask or
// none, fxrt::attention computes each head directly: scores = scale * q k^T (+ mask; keys after
// the query's position dropped when causal, top-left aligned as ATen's), their softmax, its
// product with v. Each key/value head is laid out once for the query heads that read it: for a
// prompt, its keys in tiles of 16 (one vector of scores per feature, four queries at a time); for
// a decoding step's few queries, which would not repay that, the scores are dot products of rows,
// and one query's heads of a group are the rows of one problem. Results and layouts are ATen's
// (the output laid out as the query, logsumexp [B, H, L] as [B, L, H]); values differ from ATen's
// in the last bits (ATen's exponential is a vectorized approximation, so is this one, within a
// few float32 ulps; docs/numerics.md states the bound). Grouped-query attention (fewer key/value
// heads than query heads) maps query head h to key/value head h / (H / Hk), as ATen does.
// Anything else, a row whose every key is masked (ATen defines its output as zeros), or a large
// problem with more than kSerialThreads intra-op threads to share its heads, is ATen's own call.

#pragma once

#include "inline_ops.h"
#include "lanes.h"
#include "own_attention_keys.h"
#include "own_tanh.h"

#include <ATen/Parallel.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/core/GradMode.h>
#include <c10/util/SmallVector.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>

namespace fxrt {

// The fast path's keys and values (Sp * Dp floats each) are scratch; beyond these sizes, ATen's.
constexpr int64_t kLargestKeys = int64_t{1} << 21;
// Above these multiply-adds (B * H * L * S * D), with more than kSerialThreads intra-op threads,
// ATen's kernel, which shares the heads among them, is faster than this one, which runs on the
// calling thread (about twice ATen's speed on one thread, measured from 16 to 2048 keys).
constexpr int64_t kSerialWork = int64_t{1} << 18;
constexpr int64_t kSerialThreads = 2;

namespace attention_detail {

// How a head's scores are made: scale * q k^T, soft-capped when cap is not 0 (cap * tanh(scores /
// cap), Gemma-2's, before the mask), keys after the query's position dropped when causal.
struct Scores {
  float scale;
  bool causal;
  float cap;
};

// One query head: L queries over S keys of D features. Queries go R at a time, keys in blocks of
// kLanes (scores) and features in blocks of kLanes (the weighted sum of values), each block's sums
// held in registers: R independent sums per step, so the multiply-adds' latency overlaps. `p`
// (R x Sp) is scratch. False when a row has no key left (ATen's call then computes the whole
// problem). Inlined into run_head, compiled for each vector width.
template <int64_t R, class V>
[[gnu::always_inline]] inline bool head_rows(
    const Head& h,
    const Keys& kv,
    int64_t L,
    int64_t S,
    int64_t D,
    const Scores& s,
    float* p) {
  using T = Vec<V>;
  const int64_t Sp = padded(S);
  for (int64_t i0 = 0; i0 < L; i0 += R) {
    const int64_t rows = std::min(R, L - i0);
    // Past the last query, a block's spare rows repeat it; their results are not stored.
    std::array<const float*, R> q;
    std::array<const float*, R> m;
    std::array<int64_t, R> n;  // keys row r sees
    for (int64_t r = 0; r < R; ++r) {
      const int64_t i = i0 + std::min(r, rows - 1);
      q[r] = h.q + i * h.q_row;
      m[r] = h.mask != nullptr ? h.mask + i * h.mask_row : nullptr;
      n[r] = s.causal ? std::min(i + 1, S) : S;
    }
    const int64_t keys = *std::max_element(n.begin(), n.end());
    // Scores, block by block: scaled, capped, masked, keys past n at -inf; each row's maximum.
    std::array<V, R> top;
    top.fill(T::splat(-kInf));
    for (int64_t j0 = 0; j0 < keys; j0 += kLanes) {
      std::array<V, R> acc = zeros<V, R>();
      if (kv.kt != nullptr) {
        const float* tile = kv.kt + j0 * D;
        for (int64_t d = 0; d < D; ++d) {
          const V k = T::load(tile + d * kLanes);
#pragma GCC unroll 4  // kRows: the sums in registers (-O2 keeps a loop over them in memory)
          for (int64_t r = 0; r < R; ++r) {
            acc[r] += q[r][d] * k;
          }
        }
      } else {
        for (int64_t r = 0; r < R; ++r) {
          acc[r] = row_scores<V>(q[r], kv, j0, n[r], D);
        }
      }
      for (int64_t r = 0; r < R; ++r) {
        V a = acc[r] * s.scale;
        if (s.cap != 0.0f) {  // through the row's scratch: tanh is SLEEF's, one call a block
          T::store(p + r * Sp + j0, a / s.cap, kLanes);
          tanh_detail::kernel()(p + r * Sp + j0, p + r * Sp + j0, kLanes);
          a = T::load(p + r * Sp + j0) * s.cap;
        }
        if (m[r] != nullptr) {
          V add = {};
          for (int64_t l = 0; l < std::min(kLanes, n[r] - j0); ++l) {
            T::set_lane(add, l, m[r][(j0 + l) * h.mask_col]);
          }
          a += add;
        }
        a = T::iota_below(a, j0, n[r]);
        top[r] = T::max(top[r], a);
        T::store(p + r * Sp + j0, a, kLanes);
      }
    }
    // Each row's softmax numerators (zero past its keys, up to the block's) and sum.
    std::array<float, R> inv;
    for (int64_t r = 0; r < rows; ++r) {
      const float max = max_lanes(top[r]);
      if (max == -std::numeric_limits<float>::infinity()) {
        return false;
      }
      V total = T::splat(0.0f);
      for (int64_t j0 = 0; j0 < keys; j0 += kLanes) {
        V e = exp_nonpositive_v<V, true>(T::load(p + r * Sp + j0) - max);
        total += e;
        T::store(p + r * Sp + j0, e, kLanes);
      }
      const float sum = sum_lanes(total);
      inv[r] = 1.0f / sum;
      h.lse[(i0 + r) * h.lse_row] = max + std::log(sum);
    }
    // The weighted sums of the values, R rows at a time (spare rows read row 0's weights).
    std::array<const float*, R> w;
    for (int64_t r = 0; r < R; ++r) {
      w[r] = p + (r < rows ? r : 0) * Sp;
    }
    // C feature blocks per pass over the values (R * C sums in registers), each value row read
    // once per pass: one pass for D up to C * kLanes.
    constexpr int64_t C = std::max<int64_t>(T::kSums / R, 1);
    for (int64_t d0 = 0; d0 < D; d0 += C * kLanes) {
      const int64_t blocks = std::min(C, (D - d0 + kLanes - 1) / kLanes);
      std::array<std::array<V, C>, R> acc;
      acc.fill(zeros<V, C>());
      for (int64_t j = 0; j < keys; ++j) {
        const float* vj = kv.v + j * kv.v_row + d0;
#pragma GCC unroll 8  // kSums, at most
        for (int64_t c = 0; c < C; ++c) {
          if (c < blocks) {
            const V v = T::load(vj + c * kLanes);
#pragma GCC unroll 4
            for (int64_t r = 0; r < R; ++r) {
              acc[r][c] += w[r][j] * v;
            }
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < blocks; ++c) {
          const int64_t d = d0 + c * kLanes;
          T::store(h.out + (i0 + r) * h.out_row + d, acc[r][c] * inv[r], std::min(kLanes, D - d));
        }
      }
    }
  }
  return true;
}

// Picks the rows per step: kRows, or one at a time for fewer queries (a decoding step's one
// query would otherwise compute kRows - 1 spare rows).
template <class V>
[[gnu::always_inline]] inline bool run_head_for(
    const Head& h, const Keys& kv, int64_t L, int64_t S, int64_t D, const Scores& s,
    float* p) {
  return L >= kRows ? head_rows<kRows, V>(h, kv, L, S, D, s, p)
                    : head_rows<1, V>(h, kv, L, S, D, s, p);
}

// One build per vector width, picked at load time: AVX-512 over Lanes, AVX2 with FMA and the
// baseline over Pair.
[[gnu::target("avx512f")]] static bool run_head_avx512f(
    const Head& h, const Keys& kv, int64_t L, int64_t S, int64_t D, const Scores& s,
    float* p) {
  return run_head_for<Lanes>(h, kv, L, S, D, s, p);
}

[[gnu::target("avx2,fma")]] static bool run_head_avx2(
    const Head& h, const Keys& kv, int64_t L, int64_t S, int64_t D, const Scores& s,
    float* p) {
  return run_head_for<Pair>(h, kv, L, S, D, s, p);
}

static bool run_head_baseline(
    const Head& h, const Keys& kv, int64_t L, int64_t S, int64_t D, const Scores& s,
    float* p) {
  return run_head_for<Pair>(h, kv, L, S, D, s, p);
}

inline bool run_head(
    const Head& h, const Keys& kv, int64_t L, int64_t S, int64_t D, const Scores& s,
    float* p) {
  switch (vector_width()) {
    case Width::k512:
      return run_head_avx512f(h, kv, L, S, D, s, p);
    case Width::k256:
      return run_head_avx2(h, kv, L, S, D, s, p);
    default:
      return run_head_baseline(h, kv, L, S, D, s, p);
  }
}

inline bool plain_f32(const at::Tensor& t) {
  return plain_tensor(t) && t.device().is_cpu() && t.scalar_type() == at::kFloat &&
      !(c10::GradMode::is_enabled() && t.requires_grad());
}

// Whether the fast path takes these arguments.
inline bool fast_attention(
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& v,
    double dropout_p,
    const std::optional<at::Tensor>& mask) {
  if (dropout_p != 0.0 || !plain_f32(q) || !plain_f32(k) || !plain_f32(v) || q.dim() != 4 ||
      k.dim() != 4 || v.dim() != 4) {
    return false;
  }
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), D = q.size(3);
  const int64_t Hk = k.size(1), S = k.size(2);
  if (k.size(0) != B || v.size(0) != B || v.size(1) != Hk || v.size(2) != S || k.size(3) != D ||
      v.size(3) != D || Hk == 0 || H % Hk != 0 || L == 0 || S == 0 || D == 0) {
    return false;
  }
  if (q.stride(3) != 1 || k.stride(3) != 1 || v.stride(3) != 1) {
    return false;
  }
  if (padded(S) * padded(D) > kLargestKeys) {
    return false;
  }
  if (B * H * L * S * D > kSerialWork && at::get_num_threads() > kSerialThreads) {
    return false;
  }
  if (mask.has_value() && mask->defined()) {
    const at::Tensor& m = *mask;
    if (!plain_f32(m) || m.dim() > 4) {
      return false;
    }
    const std::array<int64_t, 4> shape{B, H, L, S};
    for (int64_t d = 0; d < m.dim(); ++d) {
      int64_t size = m.size(m.dim() - 1 - d);
      if (size != 1 && size != shape[3 - d]) {
        return false;
      }
    }
  }
  return true;
}

}  // namespace attention_detail

// The fast path into `out` ([B, H, L, D], any strides with dense features) and `lse` ([B, L, H],
// contiguous); false when a row has no key left (ATen's call then computes the whole problem).
// fast_attention said yes.
inline bool attention_into(
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& value,
    bool is_causal,
    const std::optional<at::Tensor>& attn_mask,
    std::optional<double> scale,
    at::Tensor& out,
    float* ld,
    float cap = 0.0f) {
  using namespace attention_detail;
  const int64_t B = query.size(0), H = query.size(1), L = query.size(2), D = query.size(3);
  const int64_t Hk = key.size(1), S = key.size(2);
  const Scores scores{
      scale.has_value() ? static_cast<float>(*scale)
                        : static_cast<float>(1.0 / std::sqrt(static_cast<double>(D))),
      is_causal, cap};
  at::Tensor mask;
  if (attn_mask.has_value() && attn_mask->defined()) {
    mask = attn_mask->expand({B, H, L, S});
  }
  const int64_t Sp = padded(S), Dp = padded(D), G = H / Hk;
  const float* qd = query.const_data_ptr<float>();
  const float* kd = key.const_data_ptr<float>();
  const float* vd = value.const_data_ptr<float>();
  const float* md = mask.defined() ? mask.const_data_ptr<float>() : nullptr;
  float* od = out.mutable_data_ptr<float>();
  // Scratch: on the stack up to 16 KiB (the client models' sizes), every element written
  // before it is read.
  c10::SmallVector<float, 4096> scratch;
  const int64_t kt_size = tiled_keys(L, D) ? Sp * D : 0;
  const int64_t vp_size = D % kLanes == 0 ? 0 : S * Dp;
  scratch.resize_for_overwrite(static_cast<size_t>(kt_size + vp_size + kRows * Sp));
  float* kt = scratch.data();
  float* vp = kt + kt_size;
  float* p = vp + vp_size;
  // One query (a decoding step) without a causal cut: a group's G query heads are the rows of
  // one problem over its keys.
  const bool fold = L == 1 && !is_causal;
  const int64_t row = fold ? 1 : 2;  // the dimension a row steps along
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t hk = 0; hk < Hk; ++hk) {
      // Each key/value head laid out once for the G query heads that read it.
      const Keys kv = lay_out_keys(
          kd + b * key.stride(0) + hk * key.stride(1),
          vd + b * value.stride(0) + hk * value.stride(1), key.stride(2), value.stride(2), L, S,
          D, kt, vp);
      for (int64_t hq = hk * G; hq < (hk + 1) * G; hq += fold ? G : 1) {
        const Head h{
            qd + b * query.stride(0) + hq * query.stride(1),
            md != nullptr ? md + b * mask.stride(0) + hq * mask.stride(1) : nullptr,
            od + b * out.stride(0) + hq * out.stride(1),
            ld + b * L * H + hq,
            query.stride(row),
            md != nullptr ? mask.stride(row) : 0,
            md != nullptr ? mask.stride(3) : 0,
            out.stride(row),
            fold ? 1 : H};
        if (!run_head(h, kv, fold ? G : L, S, D, scores, p)) {
          return false;
        }
      }
    }
  }
  return true;
}

inline std::tuple<at::Tensor, at::Tensor> attention(
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& value,
    double dropout_p,
    bool is_causal,
    const std::optional<at::Tensor>& attn_mask,
    std::optional<double> scale) {
  if (attention_detail::fast_attention(query, key, value, dropout_p, attn_mask)) {
    // ATen's layout: the query's when it is dense, else contiguous; features dense either way.
    at::Tensor out = at::empty_like(query);
    at::Tensor lse = at::empty({query.size(0), query.size(2), query.size(1)}, query.options());
    if (attention_into(
            query, key, value, is_causal, attn_mask, scale, out, lse.mutable_data_ptr<float>())) {
      return {out, lse.transpose(1, 2)};
    }
  }
  return at::_scaled_dot_product_flash_attention_for_cpu(
      query, key, value, dropout_p, is_causal, attn_mask, scale);
}

// The fast path into `out` alone, the logsumexp into scratch.
inline bool output_into(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, bool is_causal,
    const std::optional<at::Tensor>& attn_mask, std::optional<double> scale, at::Tensor& out,
    float cap = 0.0f) {
  c10::SmallVector<float, 1024> lse;
  lse.resize_for_overwrite(static_cast<size_t>(query.size(0) * query.size(1) * query.size(2)));
  return attention_into(query, key, value, is_causal, attn_mask, scale, out, lse.data(), cap);
}

// fxrt::sdpa: fxrt::attention's output alone (what inference reads; the logsumexp goes to
// scratch), so that the arena can hold it through sdpa.out.
inline at::Tensor sdpa(
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& value,
    double dropout_p,
    bool is_causal,
    const std::optional<at::Tensor>& attn_mask,
    std::optional<double> scale) {
  if (attention_detail::fast_attention(query, key, value, dropout_p, attn_mask)) {
    at::Tensor out = at::empty_like(query);
    if (output_into(query, key, value, is_causal, attn_mask, scale, out)) {
      return out;
    }
  }
  return std::get<0>(at::_scaled_dot_product_flash_attention_for_cpu(
      query, key, value, dropout_p, is_causal, attn_mask, scale));
}

inline at::Tensor& sdpa_out(
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& value,
    double dropout_p,
    bool is_causal,
    const std::optional<at::Tensor>& attn_mask,
    std::optional<double> scale,
    at::Tensor& out) {
  const bool sized = query.dim() == 4 && value.dim() == 4 && out.dim() == 4 &&
      out.size(0) == query.size(0) && out.size(1) == query.size(1) &&
      out.size(2) == query.size(2) && out.size(3) == value.size(3);
  TORCH_CHECK(
      sized, "fxrt::sdpa.out: out has sizes ", out.sizes(), " but the attention's output has ",
      "[B, H, L, D] of query ", query.sizes(), " and value ", value.sizes());
  if (attention_detail::fast_attention(query, key, value, dropout_p, attn_mask) &&
      out.scalar_type() == at::kFloat && out.stride(3) == 1 &&
      output_into(query, key, value, is_causal, attn_mask, scale, out)) {
    return out;
  }
  out.copy_(std::get<0>(at::_scaled_dot_product_flash_attention_for_cpu(
      query, key, value, dropout_p, is_causal, attn_mask, scale)));
  return out;
}

}  // namespace fxrt
