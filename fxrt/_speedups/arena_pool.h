// The compiled loop's arenas between calls (fxrt/exec/arena.py plans them): the inputs an arena
// requires in their compiled size and dtype, and the pool of idle arenas.

#pragma once

#include "call_op.h"
#include "slots.h"

#include <c10/core/impl/VirtualGuardImpl.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace fxrt {

// An input the arena requires to have the compiled size and dtype.
struct ArenaInput {
  size_t reg;
  std::vector<int64_t> sizes;
  at::ScalarType dtype;
};

// The pool key of calls on the current stream of `device` (0 on the CPU).
inline int64_t stream_key(c10::DeviceType device) {
  if (device == c10::DeviceType::CPU) {
    return 0;
  }
  c10::impl::VirtualGuardImpl impl(device);
  c10::Stream s = impl.getStream(impl.getDevice());
  return s.id() * 64 + s.device_index();
}

// Arenas not in use, one pool per inference mode (an arena made in inference mode holds
// inference tensors, which normal mode may not write) and current stream of the arena's device
// (`stream`, a key: a call's work on one stream may still read its arena when a call on another
// stream starts).
class ArenaPool {
 public:
  // The CPU's calls (stream key 0) take and give back arenas without a lock (slots.h) when at
  // most Slots::kMax are kept.
  ArenaPool() { set_max_idle(2); }

  std::unique_ptr<Arena> take(bool inference, int64_t stream) {
    if (stream == 0 && max_idle_ <= Slots<Arena>::kMax) {
      return cpu_[inference].take();
    }
    std::lock_guard<std::mutex> lock(mu_);
    auto& pool = pools_[{inference, stream}];
    if (pool.empty()) {
      return nullptr;
    }
    std::unique_ptr<Arena> arena = std::move(pool.back());
    pool.pop_back();
    return arena;
  }
  // Keeps at most `max_idle` arenas per pool; one more is freed (on return, outside the lock).
  void give_back(std::unique_ptr<Arena> arena, bool inference, int64_t stream) {
    if (stream == 0 && max_idle_ <= Slots<Arena>::kMax) {
      cpu_[inference].give_back(std::move(arena));
      return;
    }
    std::lock_guard<std::mutex> lock(mu_);
    auto& pool = pools_[{inference, stream}];
    if (pool.size() < max_idle_) {
      pool.push_back(std::move(arena));
    }
  }
  void set_max_idle(size_t n) {
    max_idle_ = n;
    for (auto& slots : cpu_) {
      slots.set_capacity(n);
    }
  }
  size_t idle() {
    std::lock_guard<std::mutex> lock(mu_);
    size_t n = cpu_[0].idle() + cpu_[1].idle();
    for (const auto& [key, pool] : pools_) {
      n += pool.size();
    }
    return n;
  }
  // Frees every idle arena (CompiledGraph.release_memory()).
  void clear() {
    std::map<std::pair<bool, int64_t>, std::vector<std::unique_ptr<Arena>>> dropped;
    cpu_[0].clear();
    cpu_[1].clear();
    std::lock_guard<std::mutex> lock(mu_);
    dropped.swap(pools_);
  }

 private:
  std::mutex mu_;
  size_t max_idle_ = 2;
  Slots<Arena> cpu_[2];  // by inference mode
  std::map<std::pair<bool, int64_t>, std::vector<std::unique_ptr<Arena>>> pools_;
};

}  // namespace fxrt
