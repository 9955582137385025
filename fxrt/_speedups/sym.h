// SYM instructions: scalar arithmetic on sizes (fxrt/exec/program.py, SYM_OPS), computed on
// int64 with Python's semantics: floor division and modulo round toward negative infinity, the
// comparisons give bools. An operand that is not an int (a SymInt while tracing, a float, a
// bool), a division by zero or a result that would overflow returns false: the loop then runs
// the step's Python form, which gives Python's answer or error.

#pragma once

#include "call_op.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace fxrt {

inline bool sym_operand(const ListItem& item, const std::vector<IValue>& regs, int64_t& out) {
  const IValue& v = item.reg < 0 ? item.value : regs[static_cast<size_t>(item.reg)];
  if (!v.isInt()) {
    return false;
  }
  out = v.toInt();
  return true;
}

inline bool run_sym(const SymOp& sym, std::vector<IValue>& regs) {
  using K = SymOp::Kind;
  int64_t a = 0, b = 0, r = 0;
  if (!sym_operand(sym.args[0], regs, a)) {
    return false;
  }
  if (sym.kind == K::NEG) {
    if (__builtin_sub_overflow(int64_t{0}, a, &r)) {
      return false;
    }
    regs[static_cast<size_t>(sym.output)] = r;
    return true;
  }
  if (!sym_operand(sym.args[1], regs, b)) {
    return false;
  }
  IValue& out = regs[static_cast<size_t>(sym.output)];
  switch (sym.kind) {
    case K::ADD:
      if (__builtin_add_overflow(a, b, &r)) {
        return false;
      }
      break;
    case K::SUB:
      if (__builtin_sub_overflow(a, b, &r)) {
        return false;
      }
      break;
    case K::MUL:
      if (__builtin_mul_overflow(a, b, &r)) {
        return false;
      }
      break;
    case K::FLOORDIV:
    case K::MOD: {
      if (b == 0 || (a == INT64_MIN && b == -1)) {
        return false;
      }
      int64_t q = a / b, m = a % b;
      if (m != 0 && ((m < 0) != (b < 0))) {  // round toward negative infinity
        q -= 1;
        m += b;
      }
      r = sym.kind == K::FLOORDIV ? q : m;
      break;
    }
    case K::MAX:
      r = std::max(a, b);
      break;
    case K::MIN:
      r = std::min(a, b);
      break;
    case K::EQ:
      out = a == b;
      return true;
    case K::NE:
      out = a != b;
      return true;
    case K::LT:
      out = a < b;
      return true;
    case K::LE:
      out = a <= b;
      return true;
    case K::GT:
      out = a > b;
      return true;
    case K::GE:
      out = a >= b;
      return true;
    case K::NEG:
      return false;
  }
  out = r;
  return true;
}

}  // namespace fxrt
