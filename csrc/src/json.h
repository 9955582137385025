// A small strict JSON reader for package manifests and safetensors headers: UTF-8 text, no
// duplicate keys, no NaN or Infinity, integers kept exact (int64, else an error), nesting bounded.
// Untrusted input: every error is a PackageError with the byte offset, never a crash.

#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace fxrt::json {

struct Value {
  enum Type : uint8_t { NUL, BOOL, INT, FLOAT, STRING, ARRAY, OBJECT };
  Type type = NUL;
  bool b = false;
  int64_t i = 0;
  double d = 0;
  std::string s;
  std::vector<Value> a;
  std::vector<std::pair<std::string, Value>> o;  // in document order

  bool is_null() const { return type == NUL; }
  bool is_int() const { return type == INT; }
  bool is_number() const { return type == INT || type == FLOAT; }
  bool is_string() const { return type == STRING; }
  bool is_array() const { return type == ARRAY; }
  bool is_object() const { return type == OBJECT; }

  // The member `key` of an object, or nullptr (also when this is not an object).
  const Value* find(std::string_view key) const;
};

// Parses `text` (one JSON value, whitespace around it allowed). Throws PackageError naming
// `what` and the byte offset.
Value parse(std::string_view text, const std::string& what);

// The text of the top-level member `key` of a JSON object parse() accepted (empty: none, or a key
// written with escapes).
std::string_view member_text(std::string_view text, std::string_view key);

// Short text for messages: the first `max` characters of a string.
std::string clip(std::string_view s, size_t max = 60);

}  // namespace fxrt::json
