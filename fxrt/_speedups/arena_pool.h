// The compiled loop's arenas between calls (fxrt/exec/arena.py plans them): the inputs an arena
// requires in their compiled size and dtype, and the pool of idle arenas.

#pragma once

#include "call_op.h"

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace fxrt {

// An input the arena requires to have the compiled size and dtype.
struct ArenaInput {
  size_t reg;
  std::vector<int64_t> sizes;
  at::ScalarType dtype;
};

// Arenas not in use, one pool per inference mode: an arena made in inference mode holds
// inference tensors, which normal mode may not write.
class ArenaPool {
 public:
  std::unique_ptr<Arena> take(bool inference) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& pool = pools_[inference];
    if (pool.empty()) {
      return nullptr;
    }
    std::unique_ptr<Arena> arena = std::move(pool.back());
    pool.pop_back();
    return arena;
  }
  // Keeps at most `max_idle` arenas per pool; one more is freed (on return, outside the lock).
  void give_back(std::unique_ptr<Arena> arena, bool inference) {
    std::lock_guard<std::mutex> lock(mu_);
    if (pools_[inference].size() < max_idle_) {
      pools_[inference].push_back(std::move(arena));
    }
  }
  void set_max_idle(size_t n) { max_idle_ = n; }
  size_t idle() {
    std::lock_guard<std::mutex> lock(mu_);
    return pools_[0].size() + pools_[1].size();
  }
  // Frees every idle arena (CompiledGraph.release_memory()).
  void clear() {
    std::vector<std::unique_ptr<Arena>> dropped[2];
    std::lock_guard<std::mutex> lock(mu_);
    dropped[0].swap(pools_[0]);
    dropped[1].swap(pools_[1]);
  }

 private:
  std::mutex mu_;
  size_t max_idle_ = 2;
  std::vector<std::unique_ptr<Arena>> pools_[2];
};

}  // namespace fxrt
