// SHA-256 (FIPS 180-4), for the package's two hashes and its graph tensors' digests.

#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace fxrt {

class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t n);
  std::array<uint8_t, 32> digest();  // once; the object is spent afterwards
  static std::string hex(const std::array<uint8_t, 32>& d);

 private:
  void block(const uint8_t* p);
  uint32_t h_[8];
  uint8_t buf_[64];
  size_t used_ = 0;
  uint64_t bytes_ = 0;
};

}  // namespace fxrt
