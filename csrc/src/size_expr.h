// SizeExpr: a derived size of a package's signature evaluated with Python's integer semantics,
// as fxrt.deploy.binder evaluates it with sympy. Used by inputs.cpp's per-call checks.
#pragma once

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <map>
#include <optional>
#include <string>

namespace fxrt {

// A derived size ("2*s0", "s0 + 1", "(s0//2)", "Max(1, s0)") evaluated with the sizes bound to
// its symbols, with Python's integer semantics; nullopt when a symbol is unbound or the
// expression uses anything else (it is then not checked, as in fxrt.deploy.binder).
class SizeExpr {
 public:
  SizeExpr(const std::string& text, const std::map<std::string, int64_t>& env)
      : t_(text), env_(env) {}

  std::optional<int64_t> eval() {
    std::optional<int64_t> v = sum();
    skip();
    return pos_ == t_.size() ? v : std::nullopt;
  }

 private:
  void skip() {
    while (pos_ < t_.size() && t_[pos_] == ' ') {
      ++pos_;
    }
  }
  bool eat(const char* tok) {
    skip();
    size_t n = std::strlen(tok);
    if (t_.compare(pos_, n, tok) == 0) {
      pos_ += n;
      return true;
    }
    return false;
  }
  static std::optional<int64_t> floordiv(int64_t a, int64_t b, bool mod) {
    if (b == 0 || (a == INT64_MIN && b == -1)) {
      return std::nullopt;
    }
    int64_t q = a / b, m = a % b;
    if (m != 0 && ((m < 0) != (b < 0))) {
      q -= 1;
      m += b;
    }
    return mod ? m : q;
  }
  std::optional<int64_t> sum() {
    std::optional<int64_t> v = product();
    while (v) {
      if (eat("+")) {
        std::optional<int64_t> r = product();
        int64_t out = 0;
        v = r && !__builtin_add_overflow(*v, *r, &out) ? std::optional<int64_t>(out) : std::nullopt;
      } else if (eat("-")) {
        std::optional<int64_t> r = product();
        int64_t out = 0;
        v = r && !__builtin_sub_overflow(*v, *r, &out) ? std::optional<int64_t>(out) : std::nullopt;
      } else {
        break;
      }
    }
    return v;
  }
  std::optional<int64_t> product() {
    std::optional<int64_t> v = factor();
    while (v) {
      if (eat("//")) {
        std::optional<int64_t> r = factor();
        v = r ? floordiv(*v, *r, false) : std::nullopt;
      } else if (eat("*")) {
        std::optional<int64_t> r = factor();
        int64_t out = 0;
        v = r && !__builtin_mul_overflow(*v, *r, &out) ? std::optional<int64_t>(out) : std::nullopt;
      } else if (eat("%")) {
        std::optional<int64_t> r = factor();
        v = r ? floordiv(*v, *r, true) : std::nullopt;
      } else {
        break;
      }
    }
    return v;
  }
  std::optional<int64_t> factor() {
    if (++depth_ > 64) {
      return std::nullopt;
    }
    skip();
    if (eat("(")) {
      std::optional<int64_t> v = sum();
      return eat(")") ? v : std::nullopt;
    }
    if (eat("-")) {
      std::optional<int64_t> v = factor();
      return v && *v != INT64_MIN ? std::optional<int64_t>(-*v) : std::nullopt;
    }
    for (const char* fn : {"Max(", "Min("}) {
      if (eat(fn)) {
        std::optional<int64_t> a = sum();
        if (!a || !eat(",")) {
          return std::nullopt;
        }
        std::optional<int64_t> b = sum();
        if (!b || !eat(")")) {
          return std::nullopt;
        }
        return fn[1] == 'a' ? std::max(*a, *b) : std::min(*a, *b);
      }
    }
    size_t start = pos_;
    while (pos_ < t_.size() && std::isalnum(static_cast<unsigned char>(t_[pos_]))) {
      ++pos_;
    }
    std::string word = t_.substr(start, pos_ - start);
    if (!word.empty() && std::all_of(word.begin(), word.end(), ::isdigit) && word.size() < 18) {
      return std::stoll(word);
    }
    auto it = env_.find(word);
    return it != env_.end() ? std::optional<int64_t>(it->second) : std::nullopt;
  }

  const std::string& t_;
  const std::map<std::string, int64_t>& env_;
  size_t pos_ = 0;
  int depth_ = 0;
};

}  // namespace fxrt
