// Slots: idle objects kept between calls and handed to the next call with one atomic exchange,
// without a lock. The register files and stacks of calls (frames.h) and the arenas of the CPU
// (arena_pool.h) are kept so: one compiled graph called from N threads at once keeps up to N of
// each, so no call allocates either once every thread has had one.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <memory>

namespace fxrt {

template <class T>
class Slots {
 public:
  static constexpr size_t kMax = 8;

  Slots() = default;
  Slots(const Slots&) = delete;
  Slots& operator=(const Slots&) = delete;
  ~Slots() { clear(); }

  // Keep at most `n` (at most kMax) idle objects.
  void set_capacity(size_t n) { capacity_ = n < kMax ? n : kMax; }

  // An idle object, or nullptr when there is none.
  std::unique_ptr<T> take() {
    for (size_t i = 0; i < capacity_; ++i) {
      if (slots_[i].load(std::memory_order_relaxed) != nullptr) {
        T* got = slots_[i].exchange(nullptr, std::memory_order_acquire);
        if (got != nullptr) {
          return std::unique_ptr<T>(got);
        }
      }
    }
    return nullptr;
  }

  // Keeps `object` for a later take(), or frees it when every slot is full.
  void give_back(std::unique_ptr<T> object) {
    for (size_t i = 0; i < capacity_; ++i) {
      T* expected = nullptr;
      if (slots_[i].compare_exchange_strong(
              expected, object.get(), std::memory_order_release, std::memory_order_relaxed)) {
        object.release();
        return;
      }
    }
  }

  size_t idle() const {
    size_t n = 0;
    for (const auto& s : slots_) {
      n += s.load(std::memory_order_relaxed) != nullptr;
    }
    return n;
  }

  // Frees every idle object; calls running keep theirs.
  void clear() {
    for (auto& s : slots_) {
      delete s.exchange(nullptr, std::memory_order_acq_rel);
    }
  }

 private:
  std::array<std::atomic<T*>, kMax> slots_{};
  size_t capacity_ = kMax;
};

}  // namespace fxrt
