// Binding a stored call (fxrt/deploy/program_data.py) to its op's schema, as bind_python.h
// binds one from the Program's Python objects: positional arguments, then keyword arguments by
// name, then the schema's defaults; a constant converted to the schema type once; a register
// (or a list literal of registers) read per call, checked to be in range and written before the
// instruction. Anything else is a PackageError naming the instruction.

#pragma once

#include "call.h"
#include "decode.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace fxrt::decode {

// ---- registers: the validator's view of the register file

class RegisterCheck {
 public:
  explicit RegisterCheck(int64_t n) : defined_(static_cast<size_t>(n), false) {}

  int64_t reg(const json::Value& v, const std::string& where) const {
    return integer(v, where + ": register", 0, static_cast<int64_t>(defined_.size()) - 1);
  }
  void define(int64_t r) { defined_.at(static_cast<size_t>(r)) = true; }
  void undefine(int64_t r) { defined_.at(static_cast<size_t>(r)) = false; }
  // An OUT's out= form reads its own results.
  void allow(std::vector<int64_t> rs) { allowed_ = std::move(rs); }
  bool defined(int64_t r) const {
    return defined_[static_cast<size_t>(r)] ||
        std::find(allowed_.begin(), allowed_.end(), r) != allowed_.end();
  }
  int64_t use_ref(const json::Value& ref, const std::string& where) const {
    int64_t r = reg(ref, where);
    if (!defined(r)) {
      fail(where + ": reads register " + std::to_string(r) + " before it is written");
    }
    return r;
  }

 private:
  std::vector<bool> defined_;
  std::vector<int64_t> allowed_;
};

// The arguments of a stored call (an encoded tuple).
const std::vector<json::Value>& tuple_items(const json::Value& v, const std::string& where);

// `op`(*args, **kwargs) into `outputs`, bound to the op's schema.
CallOp bind_call(
    const c10::OperatorHandle& handle,
    const json::Value& args,
    const json::Value& kwargs,
    std::vector<int64_t> outputs,
    bool multi,
    const RegisterCheck& regs,
    const std::string& where);

}  // namespace fxrt::decode
