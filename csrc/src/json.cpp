#include "json.h"

#include "fxrt/model.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <unordered_set>

namespace fxrt::json {

namespace {

constexpr int kMaxDepth = 256;

class Parser {
 public:
  Parser(std::string_view text, const std::string& what) : t_(text), what_(what) {}

  Value document() {
    Value v = value(0);
    skip_ws();
    if (pos_ != t_.size()) {
      fail("trailing characters");
    }
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& why) const {
    throw PackageError(what_ + ": invalid JSON at byte " + std::to_string(pos_) + ": " + why);
  }

  void skip_ws() {
    while (pos_ < t_.size() &&
           (t_[pos_] == ' ' || t_[pos_] == '\n' || t_[pos_] == '\r' || t_[pos_] == '\t')) {
      ++pos_;
    }
  }

  char peek() {
    if (pos_ >= t_.size()) {
      fail("unexpected end");
    }
    return t_[pos_];
  }

  void expect(std::string_view word) {
    if (t_.substr(pos_, word.size()) != word) {
      fail("unexpected character");
    }
    pos_ += word.size();
  }

  Value value(int depth) {
    if (depth > kMaxDepth) {
      fail("nested too deeply");
    }
    skip_ws();
    Value v;
    char c = peek();
    if (c == '{') {
      ++pos_;
      v.type = Value::OBJECT;
      std::unordered_set<std::string> keys;
      skip_ws();
      if (peek() == '}') {
        ++pos_;
        return v;
      }
      while (true) {
        skip_ws();
        if (peek() != '"') {
          fail("expected a string key");
        }
        std::string key = string();
        if (!keys.insert(key).second) {
          fail("duplicate key \"" + clip(key) + "\"");
        }
        skip_ws();
        expect(":");
        v.o.emplace_back(std::move(key), value(depth + 1));
        skip_ws();
        if (peek() == ',') {
          ++pos_;
          continue;
        }
        expect("}");
        return v;
      }
    }
    if (c == '[') {
      ++pos_;
      v.type = Value::ARRAY;
      skip_ws();
      if (peek() == ']') {
        ++pos_;
        return v;
      }
      while (true) {
        v.a.push_back(value(depth + 1));
        skip_ws();
        if (peek() == ',') {
          ++pos_;
          continue;
        }
        expect("]");
        return v;
      }
    }
    if (c == '"') {
      v.type = Value::STRING;
      v.s = string();
      return v;
    }
    if (c == 't') {
      expect("true");
      v.type = Value::BOOL;
      v.b = true;
      return v;
    }
    if (c == 'f') {
      expect("false");
      v.type = Value::BOOL;
      return v;
    }
    if (c == 'n') {
      expect("null");
      return v;
    }
    return number();
  }

  Value number() {
    size_t start = pos_;
    bool integer = true;
    if (peek() == '-') {
      ++pos_;
    }
    if (pos_ < t_.size() && (t_[pos_] == 'N' || t_[pos_] == 'I')) {
      fail("NaN and Infinity are not JSON");
    }
    if (pos_ >= t_.size() || !isdigit(static_cast<unsigned char>(t_[pos_]))) {
      fail("expected a value");
    }
    if (t_[pos_] == '0' && pos_ + 1 < t_.size() && isdigit(static_cast<unsigned char>(t_[pos_ + 1]))) {
      fail("leading zero");
    }
    auto digits = [&] {
      size_t n = 0;
      while (pos_ < t_.size() && isdigit(static_cast<unsigned char>(t_[pos_]))) {
        ++pos_;
        ++n;
      }
      if (n == 0) {
        fail("expected digits");
      }
    };
    digits();
    if (pos_ < t_.size() && t_[pos_] == '.') {
      integer = false;
      ++pos_;
      digits();
    }
    if (pos_ < t_.size() && (t_[pos_] == 'e' || t_[pos_] == 'E')) {
      integer = false;
      ++pos_;
      if (pos_ < t_.size() && (t_[pos_] == '+' || t_[pos_] == '-')) {
        ++pos_;
      }
      digits();
    }
    std::string text(t_.substr(start, pos_ - start));
    Value v;
    errno = 0;
    if (integer) {
      v.type = Value::INT;
      v.i = std::strtoll(text.c_str(), nullptr, 10);
      if (errno == ERANGE) {
        fail("integer out of range");
      }
    } else {
      v.type = Value::FLOAT;
      v.d = std::strtod(text.c_str(), nullptr);
      if (!std::isfinite(v.d)) {
        fail("number out of range");
      }
    }
    return v;
  }

  unsigned hex4() {
    if (pos_ + 4 > t_.size()) {
      fail("short \\u escape");
    }
    unsigned u = 0;
    for (int k = 0; k < 4; ++k) {
      char h = t_[pos_++];
      u <<= 4;
      if (h >= '0' && h <= '9') {
        u |= static_cast<unsigned>(h - '0');
      } else if (h >= 'a' && h <= 'f') {
        u |= static_cast<unsigned>(h - 'a' + 10);
      } else if (h >= 'A' && h <= 'F') {
        u |= static_cast<unsigned>(h - 'A' + 10);
      } else {
        fail("bad \\u escape");
      }
    }
    return u;
  }

  static void utf8(std::string& out, unsigned cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  // One UTF-8 sequence starting at pos_ (validated: no overlongs, no surrogates).
  void copy_utf8(std::string& out) {
    auto byte = [&](size_t k) -> unsigned {
      if (pos_ + k >= t_.size()) {
        fail("truncated UTF-8");
      }
      return static_cast<unsigned char>(t_[pos_ + k]);
    };
    unsigned c = byte(0);
    size_t n = 0;
    unsigned cp = 0;
    if (c < 0x80) {
      n = 1;
      cp = c;
    } else if ((c & 0xE0) == 0xC0) {
      n = 2;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      n = 3;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      n = 4;
      cp = c & 0x07;
    } else {
      fail("invalid UTF-8");
    }
    for (size_t k = 1; k < n; ++k) {
      unsigned b = byte(k);
      if ((b & 0xC0) != 0x80) {
        fail("invalid UTF-8");
      }
      cp = (cp << 6) | (b & 0x3F);
    }
    static const unsigned kMin[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMin[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
      fail("invalid UTF-8");
    }
    out.append(t_.substr(pos_, n));
    pos_ += n;
  }

  std::string string() {
    ++pos_;  // the opening quote
    std::string out;
    while (true) {
      char c = peek();
      if (c == '"') {
        ++pos_;
        return out;
      }
      if (static_cast<unsigned char>(c) < 0x20) {
        fail("control character in a string");
      }
      if (c != '\\') {
        copy_utf8(out);
        continue;
      }
      ++pos_;
      char e = peek();
      ++pos_;
      switch (e) {
        case '"':
        case '\\':
        case '/':
          out += e;
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'n':
          out += '\n';
          break;
        case 'r':
          out += '\r';
          break;
        case 't':
          out += '\t';
          break;
        case 'u': {
          unsigned cp = hex4();
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            expect("\\u");
            unsigned lo = hex4();
            if (lo < 0xDC00 || lo > 0xDFFF) {
              fail("unpaired surrogate");
            }
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            fail("unpaired surrogate");
          }
          utf8(out, cp);
          break;
        }
        default:
          fail("bad escape");
      }
    }
  }

  std::string_view t_;
  const std::string& what_;
  size_t pos_ = 0;
};

}  // namespace

const Value* Value::find(std::string_view key) const {
  if (type != OBJECT) {
    return nullptr;
  }
  for (const auto& [k, v] : o) {
    if (k == key) {
      return &v;
    }
  }
  return nullptr;
}

Value parse(std::string_view text, const std::string& what) {
  return Parser(text, what).document();
}

std::string clip(std::string_view s, size_t max) {
  if (s.size() <= max) {
    return std::string(s);
  }
  return std::string(s.substr(0, max)) + "...";
}

// The text of the top-level member `key` of the JSON object `text` (which parse() accepted), or
// an empty view: a scan of the top level that skips nested values and strings.
std::string_view member_text(std::string_view text, std::string_view key) {
  size_t i = text.find('{');
  int depth = 0;
  size_t value_start = std::string_view::npos;
  bool want = false;
  for (; i < text.size(); ++i) {
    char c = text[i];
    if (c == '"') {
      size_t start = ++i;
      while (i < text.size() && text[i] != '"') {
        i += text[i] == '\\' ? 2 : 1;
      }
      if (depth == 1 && value_start == std::string_view::npos) {
        want = text.substr(start, i - start) == key;  // a key (escaped keys do not match)
      }
    } else if (c == ':' && depth == 1) {
      value_start = i + 1;
    } else if (c == '{' || c == '[') {
      ++depth;
    } else if ((c == ',' && depth == 1) || ((c == '}' || c == ']') && --depth == 0)) {
      if (want && value_start != std::string_view::npos) {
        return text.substr(value_start, i - value_start);
      }
      value_start = std::string_view::npos;
      want = false;
    }
  }
  return {};
}

}  // namespace fxrt::json
