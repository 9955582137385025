// fxrt::attention's heads and key/value layouts (own_attention.h computes over them).
#pragma once

#include "lanes.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace fxrt::attention_detail {

struct Head {
  const float* q;  // row i at q + i * q_row
  const float* mask;  // element (i, j) at mask + i * mask_row + j * mask_col, or nullptr
  float* out;  // row i at out + i * out_row
  float* lse;  // element i at lse + i * lse_row
  int64_t q_row, mask_row, mask_col, out_row, lse_row;
};

constexpr int64_t kRows = 4;  // queries computed together: independent sums hide FMA latency

// One key/value head as the query heads that read it see it. `kt`: the keys in tiles of kLanes
// keys, tile t at kt + t * D * kLanes holding feature d of its keys at d * kLanes (so a block of
// scores reads contiguous lanes, and writing a tile touches D cache lines, not D pages as one
// transposed D x S matrix would for long S), zero past the last key; or nullptr, the scores then
// being dot products of rows (row j at k + j * k_row), as for a decoding step's few queries, for
// which laying the keys out would cost more than the scores. `v`: row j at v + j * v_row,
// kLanes-padded rows when D is not a multiple of kLanes (a copy, zero where padded).
struct Keys {
  const float* kt;
  const float* k;
  int64_t k_row;
  const float* v;
  int64_t v_row;
};

// Whether L queries per head read the keys from tiles: a prompt's (kRows queries or more), and
// any whose features are not a multiple of kLanes (rows' dot products load whole vectors).
inline bool tiled_keys(int64_t L, int64_t D) {
  return D % kLanes != 0 || L >= kRows;
}

// Lays out one key/value head (S keys of D features, rows at k_row and v_row) for L queries: in
// `kt` (Sp * D floats) when tiled_keys, and, when its rows need padding, in `vp` (S * Dp floats).
inline Keys lay_out_keys(
    const float* k,
    const float* v,
    int64_t k_row,
    int64_t v_row,
    int64_t L,
    int64_t S,
    int64_t D,
    float* kt,
    float* vp) {
  if (!tiled_keys(L, D)) {
    return {nullptr, k, k_row, v, v_row};
  }
  for (int64_t j = 0; j < S; ++j) {
    const float* src = k + j * k_row;
    float* dst = kt + (j / kLanes) * D * kLanes + j % kLanes;
    for (int64_t d = 0; d < D; ++d) {
      dst[d * kLanes] = src[d];
    }
  }
  for (int64_t j = S; j < padded(S); ++j) {
    float* dst = kt + (j / kLanes) * D * kLanes + j % kLanes;
    for (int64_t d = 0; d < D; ++d) {
      dst[d * kLanes] = 0.0f;
    }
  }
  if (D % kLanes == 0) {
    return {kt, k, k_row, v, v_row};
  }
  const int64_t Dp = padded(D);
  for (int64_t j = 0; j < S; ++j) {
    std::memcpy(vp + j * Dp, v + j * v_row, sizeof(float) * D);
    std::fill(vp + j * Dp + D, vp + (j + 1) * Dp, 0.0f);
  }
  return {kt, k, k_row, vp, Dp};
}

// The scores of keys j0 .. j0 + kLanes - 1 (those below n) for one query row, as dot products
// of rows (D a multiple of kLanes); lanes from n on are left for the caller's -inf.
template <class V>
[[gnu::always_inline]] inline V row_scores(
    const float* q, const Keys& kv, int64_t j0, int64_t n, int64_t D) {
  using T = Vec<V>;
  V scores = {};
  const int64_t last = std::min(kLanes, n - j0);
  for (int64_t l = 0; l < last; ++l) {
    const float* k = kv.k + (j0 + l) * kv.k_row;
    V acc = T::load(q) * T::load(k);
    for (int64_t d0 = kLanes; d0 < D; d0 += kLanes) {
      acc += T::load(q + d0) * T::load(k + d0);
    }
    T::set_lane(scores, l, sum_lanes(acc));
  }
  return scores;
}

}  // namespace fxrt::attention_detail
