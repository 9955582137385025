#include "package.h"

#include "fxrt/model.h"
#include "sha256.h"

#include <c10/core/ScalarType.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <new>
#include <utility>

namespace fxrt {

namespace {

constexpr char kMagic[8] = {'F', 'X', 'R', 'T', 'P', 'K', 'G', '\0'};
constexpr uint32_t kVersion = 1;
constexpr uint64_t kPrelude = 128;
constexpr uint64_t kAlign = 64;
constexpr uint64_t kMaxManifest = uint64_t{1} << 30;
constexpr uint64_t kMaxHeader = 100'000'000;
constexpr size_t kMaxDims = 64;
constexpr size_t kMaxName = 4096;

[[noreturn]] void fail(const std::string& why) {
  throw PackageError("invalid fxrt package: " + why);
}

uint64_t le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) {
    v = (v << 8) | p[i];
  }
  return v;
}

uint32_t le32(const uint8_t* p) {
  return uint32_t(p[0]) | (uint32_t(p[1]) << 8) | (uint32_t(p[2]) << 16) | (uint32_t(p[3]) << 24);
}

struct DType {
  const char* code;
  c10::ScalarType type;
  int64_t size;
};

const DType kDTypes[] = {
    {"F64", c10::kDouble, 8},
    {"F32", c10::kFloat, 4},
    {"F16", c10::kHalf, 2},
    {"BF16", c10::kBFloat16, 2},
    {"I64", c10::kLong, 8},
    {"I32", c10::kInt, 4},
    {"I16", c10::kShort, 2},
    {"I8", c10::kChar, 1},
    {"U64", c10::kUInt64, 8},
    {"U32", c10::kUInt32, 4},
    {"U16", c10::kUInt16, 2},
    {"U8", c10::kByte, 1},
    {"BOOL", c10::kBool, 1},
    {"F8_E4M3", c10::kFloat8_e4m3fn, 1},
    {"F8_E5M2", c10::kFloat8_e5m2, 1},
    {"C64", c10::kComplexFloat, 8},
};

Entry read_entry(const std::string& name, const json::Value& d, uint64_t data_len) {
  std::string where = "weights header: tensor \"" + json::clip(name) + "\"";
  if (name.size() > kMaxName) {
    fail(where + ": name too long");
  }
  if (!d.is_object() || d.o.size() != 3) {
    fail(where + ": malformed entry");
  }
  const json::Value* dtype = d.find("dtype");
  const json::Value* shape = d.find("shape");
  const json::Value* offsets = d.find("data_offsets");
  if (dtype == nullptr || shape == nullptr || offsets == nullptr) {
    fail(where + ": malformed entry");
  }
  int st = 0;
  int64_t itemsize = 0;
  if (!dtype->is_string() || !safetensors_dtype(dtype->s, st, itemsize)) {
    fail(where + ": unknown dtype");
  }
  Entry e;
  e.dtype = dtype->s;
  if (!shape->is_array() || shape->a.size() > kMaxDims) {
    fail(where + ": malformed shape");
  }
  int64_t numel = 1;
  for (const json::Value& s : shape->a) {
    if (!s.is_int() || s.i < 0 || s.i >= (int64_t{1} << 62)) {
      fail(where + ": malformed shape");
    }
    e.shape.push_back(s.i);
    if (__builtin_mul_overflow(numel, s.i, &numel) || numel >= (int64_t{1} << 62)) {
      fail(where + ": too many elements");
    }
  }
  if (!offsets->is_array() || offsets->a.size() != 2 || !offsets->a[0].is_int() ||
      !offsets->a[1].is_int() || offsets->a[0].i < 0 || offsets->a[1].i < offsets->a[0].i ||
      static_cast<uint64_t>(offsets->a[1].i) > data_len) {
    fail(where + ": data offsets out of range");
  }
  e.begin = static_cast<uint64_t>(offsets->a[0].i);
  e.end = static_cast<uint64_t>(offsets->a[1].i);
  e.numel = numel;
  int64_t nbytes = 0;
  if (__builtin_mul_overflow(numel, itemsize, &nbytes) ||
      static_cast<uint64_t>(nbytes) != e.end - e.begin) {
    fail(where + ": " + std::to_string(e.end - e.begin) + " bytes for its shape and dtype");
  }
  return e;
}

}  // namespace

bool safetensors_dtype(const std::string& code, int& scalar_type, int64_t& itemsize) {
  for (const DType& d : kDTypes) {
    if (code == d.code) {
      scalar_type = static_cast<int>(d.type);
      itemsize = d.size;
      return true;
    }
  }
  return false;
}

MappedFile::MappedFile(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    throw PackageError(path + ": cannot open: " + std::strerror(errno));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw PackageError(path + ": not a regular file");
  }
  size_ = static_cast<size_t>(st.st_size);
  if (size_ == 0) {
    ::close(fd);
    throw PackageError(path + ": empty file, not an fxrt package");
  }
  void* p = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) {
    throw PackageError(path + ": cannot map: " + std::strerror(errno));
  }
  data_ = static_cast<uint8_t*>(p);
}

MappedFile::MappedFile(const uint8_t* bytes, size_t size) : size_(size), mapped_(false) {
  if (size_ == 0) {
    throw PackageError("empty bytes, not an fxrt package");
  }
  data_ = static_cast<uint8_t*>(::operator new(size_, std::align_val_t{kAlign}));
  std::memcpy(data_, bytes, size_);
}

void MappedFile::release_before(size_t offset) const {
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  if (mapped_ && offset / page > 0) {
    ::madvise(data_, offset / page * page, MADV_DONTNEED);
  }
}

MappedFile::~MappedFile() {
  if (data_ != nullptr && mapped_) {
    ::munmap(data_, size_);
  } else if (data_ != nullptr) {
    ::operator delete(data_, std::align_val_t{kAlign});
  }
}

std::map<std::string, Entry> read_safetensors(
    const uint8_t* buf,
    uint64_t start,
    uint64_t length,
    uint64_t& data_start) {
  if (length < 8) {
    fail("weights section out of range");
  }
  uint64_t head_len = le64(buf + start);
  if (head_len > length - 8 || head_len > kMaxHeader || head_len == 0 ||
      buf[start + 8] != '{') {
    fail("weights header: malformed");
  }
  std::map<std::string, Entry> entries;
  data_start = start + 8 + head_len;
  json::Value header = json::parse(
      std::string_view(reinterpret_cast<const char*>(buf + start + 8), head_len),
      "weights header");
  if (!header.is_object()) {
    fail("weights header is not an object");
  }
  uint64_t data_len = length - 8 - head_len;
  for (const auto& [name, d] : header.o) {
    if (name == "__metadata__") {
      if (!d.is_object()) {
        fail("weights header: __metadata__ must map strings to strings");
      }
      for (const auto& [k, v] : d.o) {
        if (!v.is_string()) {
          fail("weights header: __metadata__ must map strings to strings");
        }
      }
      continue;
    }
    entries.emplace(name, read_entry(name, d, data_len));
  }
  std::vector<const Entry*> order;
  for (const auto& [name, e] : entries) {
    order.push_back(&e);
  }
  std::sort(order.begin(), order.end(), [](const Entry* a, const Entry* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  uint64_t cursor = 0;
  for (const Entry* e : order) {
    if (e->begin != cursor) {
      fail("weights header: a hole or an overlap in the data");
    }
    cursor = e->end;
  }
  if (cursor != data_len) {
    fail("weights header: the tensors do not cover the data");
  }
  for (const auto& [name, e] : entries) {
    int st = 0;
    int64_t itemsize = 1;
    safetensors_dtype(e.dtype, st, itemsize);
    if ((data_start + e.begin) % static_cast<uint64_t>(itemsize) != 0) {
      fail("weights header: tensor \"" + json::clip(name) + "\" is not aligned");
    }
  }
  return entries;
}

RawPackage read_package(const std::string& path, bool verify_weights) {
  return read_package(std::make_shared<MappedFile>(path), verify_weights);
}

RawPackage read_package(std::shared_ptr<MappedFile> file, bool verify_weights) {
  RawPackage raw;
  raw.file = std::move(file);
  const uint8_t* buf = raw.file->data();
  const uint64_t size = raw.file->size();
  if (size < kPrelude) {
    fail("not an fxrt package: " + std::to_string(size) + " bytes, shorter than the prelude");
  }
  if (std::memcmp(buf, kMagic, 8) != 0) {
    throw PackageError("not an fxrt package (bad magic)");
  }
  uint32_t version = le32(buf + 8);
  uint32_t flags = le32(buf + 12);
  uint64_t m_off = le64(buf + 16), m_len = le64(buf + 24), w_off = le64(buf + 32),
           w_len = le64(buf + 40), f_len = le64(buf + 48);
  if (version != kVersion) {
    throw PackageError(
        "fxrt package format version " + std::to_string(version) +
        " is not supported (this runtime reads " + std::to_string(kVersion) + ")");
  }
  if (flags != 0) {
    fail("unknown package flags");
  }
  if (f_len != size) {
    fail(
        "package is " + std::to_string(size) + " bytes but says " + std::to_string(f_len) +
        " (truncated or extended)");
  }
  if (m_off != kPrelude || m_len > kMaxManifest || m_off + m_len > w_off || w_off % kAlign != 0 ||
      w_off > f_len || w_len != f_len - w_off || w_len < 8) {
    fail("section offsets out of range");
  }
  for (uint64_t i = 120; i < kPrelude; ++i) {
    if (buf[i] != 0) {
      fail("reserved bytes are not zero");
    }
  }
  for (uint64_t i = m_off + m_len; i < w_off; ++i) {
    if (buf[i] != 0) {
      fail("reserved bytes are not zero");
    }
  }
  uint64_t head_len = le64(buf + w_off);
  if (head_len > w_len - 8) {
    fail("weights header length out of range");
  }
  Sha256 meta;
  meta.update(buf, 56);
  meta.update(buf + m_off, m_len);
  meta.update(buf + w_off, 8 + head_len);
  if (std::memcmp(meta.digest().data(), buf + 56, 32) != 0) {
    throw PackageError("fxrt package is damaged: its structure does not match its SHA-256");
  }
  uint64_t data_start = w_off + 8 + head_len;
  if (verify_weights) {
    Sha256 data;
    data.update(buf + data_start, f_len - data_start);
    if (std::memcmp(data.digest().data(), buf + 88, 32) != 0) {
      throw PackageError("fxrt package is damaged: its weights do not match their SHA-256");
    }
  }
  raw.manifest_text = std::string_view(reinterpret_cast<const char*>(buf + m_off), m_len);
  raw.manifest = json::parse(raw.manifest_text, "manifest");
  const json::Value* format = raw.manifest.find("format");
  if (format == nullptr || !format->is_string() || format->s != "fxrt-package/1") {
    throw PackageError(
        "not an fxrt-package/1 package (format " +
        (format != nullptr && format->is_string() ? "'" + json::clip(format->s, 40) + "'" : "?") + ")");
  }

  raw.entries = read_safetensors(buf, w_off, w_len, raw.data_start);
  if (raw.data_start != data_start) {
    fail("weights header: length mismatch");
  }
  return raw;
}

}  // namespace fxrt
