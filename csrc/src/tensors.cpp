#include "fxrt/tensors.h"

#include "fxrt/model.h"
#include "json.h"
#include "package.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>

namespace fxrt {

std::vector<std::pair<std::string, at::Tensor>> load_tensors(const std::string& path) {
  MappedFile file(path);
  uint64_t data_start = 0;
  std::map<std::string, Entry> entries = read_safetensors(file.data(), 0, file.size(), data_start);
  std::vector<std::pair<std::string, const Entry*>> order;
  for (const auto& [name, e] : entries) {
    order.emplace_back(name, &e);
  }
  std::sort(order.begin(), order.end(), [](const auto& a, const auto& b) {
    return a.second->begin < b.second->begin;
  });
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& [name, e] : order) {
    int st = 0;
    int64_t itemsize = 0;
    safetensors_dtype(e->dtype, st, itemsize);
    auto options = at::TensorOptions().dtype(static_cast<c10::ScalarType>(st));
    at::Tensor t = at::empty(e->shape, options);
    if (e->numel > 0) {
      t.copy_(at::from_blob(file.data() + data_start + e->begin, e->shape, options));
    }
    out.emplace_back(name, std::move(t));
  }
  return out;
}

namespace {

const char* code_of(c10::ScalarType t) {
  switch (t) {
    case c10::kDouble:
      return "F64";
    case c10::kFloat:
      return "F32";
    case c10::kHalf:
      return "F16";
    case c10::kBFloat16:
      return "BF16";
    case c10::kLong:
      return "I64";
    case c10::kInt:
      return "I32";
    case c10::kShort:
      return "I16";
    case c10::kChar:
      return "I8";
    case c10::kByte:
      return "U8";
    case c10::kBool:
      return "BOOL";
    default:
      throw std::invalid_argument(std::string("save_tensors: dtype ") + c10::toString(t));
  }
}

std::string quoted(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

}  // namespace

void save_tensors(
    const std::string& path,
    const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  std::vector<at::Tensor> data;
  std::string header = "{";
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    at::Tensor c = t.detach().to(at::kCPU).contiguous();
    uint64_t n = static_cast<uint64_t>(c.nbytes());
    header += (header.size() > 1 ? "," : "") + quoted(name) + ":{\"dtype\":\"" +
        code_of(c.scalar_type()) + "\",\"shape\":[";
    for (int64_t d = 0; d < c.dim(); ++d) {
      header += (d ? "," : "") + std::to_string(c.size(d));
    }
    header += "],\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(offset + n) +
        "]}";
    offset += n;
    data.push_back(std::move(c));
  }
  header += "}";
  while ((8 + header.size()) % 8 != 0) {
    header += ' ';
  }
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  uint64_t len = header.size();
  char le[8];
  for (int i = 0; i < 8; ++i) {
    le[i] = static_cast<char>(len >> (8 * i));
  }
  f.write(le, 8);
  f.write(header.data(), static_cast<std::streamsize>(header.size()));
  for (const at::Tensor& c : data) {
    f.write(static_cast<const char*>(c.const_data_ptr()), static_cast<std::streamsize>(c.nbytes()));
  }
  if (!f) {
    throw std::runtime_error("save_tensors: cannot write " + path);
  }
}

}  // namespace fxrt
