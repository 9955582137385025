// The package file's structure (fxrt/deploy/package.py): the prelude, the two SHA-256 hashes,
// the manifest JSON and the safetensors weights section, all checked before anything is used.

#pragma once

#include "json.h"

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace fxrt {

// The file, memory-mapped copy-on-write (writes to weight tensors never reach the file).
class MappedFile {
 public:
  explicit MappedFile(const std::string& path);
  // A package given as bytes: an aligned private copy of them (writable, as a private mapping).
  MappedFile(const uint8_t* bytes, size_t size);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  // Gives the pages before `offset` back (a mapped file's clean pages: read again if touched).
  void release_before(size_t offset) const;

 private:
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  bool mapped_ = true;
};

// One tensor of the weights section: `begin`/`end` are offsets in its data.
struct Entry {
  std::string dtype;  // safetensors code ("F32")
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;
  int64_t numel = 0;
};

struct RawPackage {
  std::shared_ptr<MappedFile> file;
  json::Value manifest;
  std::string_view manifest_text;  // the manifest's JSON, in `file`
  std::map<std::string, Entry> entries;
  uint64_t data_start = 0;  // file offset of the weights' data
};

// The entries of the safetensors file at buf[start, start + length), checked (known dtypes, sizes
// that match the shapes, data covered exactly once, each entry aligned to its item size);
// `data_start` gets the file offset of the data. Throws PackageError.
std::map<std::string, Entry> read_safetensors(
    const uint8_t* buf,
    uint64_t start,
    uint64_t length,
    uint64_t& data_start);

// Reads and checks `path` (or a package's bytes); throws PackageError.
RawPackage read_package(const std::string& path, bool verify_weights);
RawPackage read_package(std::shared_ptr<MappedFile> file, bool verify_weights);

// The torch dtype of a safetensors code, and its item size; false if unknown.
bool safetensors_dtype(const std::string& code, int& scalar_type, int64_t& itemsize);

}  // namespace fxrt
