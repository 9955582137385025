#include "decode.h"

#include "call.h"  // without_optional
#include "fxrt/model.h"

#include <ATen/ScalarOps.h>

#include <algorithm>
#include <limits>
#include <sstream>

namespace fxrt::decode {

using json::clip;
using json::Value;

[[noreturn]] void fail(const std::string& why) {
  throw PackageError("invalid fxrt package: " + why);
}

const Value& member(const Value& obj, const char* key, const std::string& where) {
  const Value* v = obj.find(key);
  if (v == nullptr) {
    fail(where + ": no field \"" + key + "\"");
  }
  return *v;
}

const Value& object(const Value& obj, const char* key, const std::string& where) {
  const Value& v = member(obj, key, where);
  if (!v.is_object()) {
    fail(where + ": \"" + key + "\" must be an object");
  }
  return v;
}

const Value& array(const Value& obj, const char* key, const std::string& where) {
  const Value& v = member(obj, key, where);
  if (!v.is_array()) {
    fail(where + ": \"" + key + "\" must be a list");
  }
  return v;
}

int64_t integer(const Value& v, const std::string& where, int64_t lo, int64_t hi) {
  if (!v.is_int() || v.i < lo || v.i > hi) {
    fail(where + ": expected an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) +
         "]");
  }
  return v.i;
}

bool boolean(const Value& v, const std::string& where) {
  if (v.type != Value::BOOL) {
    fail(where + ": expected a bool");
  }
  return v.b;
}

const std::string& string(const Value& v, const std::string& where) {
  if (!v.is_string()) {
    fail(where + ": expected a string");
  }
  return v.s;
}

std::vector<int64_t> ints(const Value& v, const std::string& where, int64_t lo, int64_t hi) {
  if (!v.is_array() || v.a.size() > static_cast<size_t>(kMaxRegs)) {
    fail(where + ": expected a list of integers");
  }
  std::vector<int64_t> out;
  out.reserve(v.a.size());
  for (const Value& x : v.a) {
    out.push_back(integer(x, where, lo, hi));
  }
  return out;
}

// ---- dtypes, devices and the other tagged constants of fxrt.serialize's argument encoding

namespace {

struct Named {
  const char* name;
  int64_t value;
};

template <size_t N>
int64_t named(const Named (&table)[N], const std::string& s, const char* what, const std::string& where) {
  for (const Named& n : table) {
    if (s == n.name) {
      return n.value;
    }
  }
  fail(where + ": unknown " + what + " \"" + clip(s, 40) + "\"");
}

const Named kDTypes[] = {
    {"torch.float32", static_cast<int64_t>(c10::kFloat)},
    {"torch.float64", static_cast<int64_t>(c10::kDouble)},
    {"torch.float16", static_cast<int64_t>(c10::kHalf)},
    {"torch.bfloat16", static_cast<int64_t>(c10::kBFloat16)},
    {"torch.int64", static_cast<int64_t>(c10::kLong)},
    {"torch.int32", static_cast<int64_t>(c10::kInt)},
    {"torch.int16", static_cast<int64_t>(c10::kShort)},
    {"torch.int8", static_cast<int64_t>(c10::kChar)},
    {"torch.uint8", static_cast<int64_t>(c10::kByte)},
    {"torch.uint16", static_cast<int64_t>(c10::kUInt16)},
    {"torch.uint32", static_cast<int64_t>(c10::kUInt32)},
    {"torch.uint64", static_cast<int64_t>(c10::kUInt64)},
    {"torch.bool", static_cast<int64_t>(c10::kBool)},
    {"torch.complex64", static_cast<int64_t>(c10::kComplexFloat)},
    {"torch.complex128", static_cast<int64_t>(c10::kComplexDouble)},
    {"torch.float8_e4m3fn", static_cast<int64_t>(c10::kFloat8_e4m3fn)},
    {"torch.float8_e5m2", static_cast<int64_t>(c10::kFloat8_e5m2)},
};
const Named kLayouts[] = {{"torch.strided", static_cast<int64_t>(c10::kStrided)}};
const Named kFormats[] = {
    {"torch.contiguous_format", static_cast<int64_t>(c10::MemoryFormat::Contiguous)},
    {"torch.preserve_format", static_cast<int64_t>(c10::MemoryFormat::Preserve)},
    {"torch.channels_last", static_cast<int64_t>(c10::MemoryFormat::ChannelsLast)},
    {"torch.channels_last_3d", static_cast<int64_t>(c10::MemoryFormat::ChannelsLast3d)},
};

}  // namespace

c10::ScalarType dtype(const Value& v, const std::string& where) {
  return static_cast<c10::ScalarType>(named(kDTypes, string(v, where), "dtype", where));
}

// A dtype as the signature and weight records write it ("float32").
c10::ScalarType short_dtype(const Value& v, const std::string& where) {
  return static_cast<c10::ScalarType>(
      named(kDTypes, "torch." + string(v, where), "dtype", where));
}

std::string dtype_name(c10::ScalarType type) {
  for (const Named& n : kDTypes) {
    if (n.value == static_cast<int64_t>(type)) {
      return std::string(n.name).substr(6);
    }
  }
  return c10::toString(type);
}

c10::Device device(const std::string& s, const std::string& where) {
  if (s.size() > 40) {
    fail(where + ": malformed device");
  }
  try {
    return c10::Device(s);
  } catch (const std::exception&) {
    fail(where + ": \"" + clip(s, 40) + "\" is not a device");
  }
}

// A tagged value {"tag": payload}: its tag, or "" for a plain JSON value.
std::string tag_of(const Value& v) {
  return v.is_object() && v.o.size() == 1 ? v.o[0].first : std::string();
}

bool is_sequence(const Value& v) {
  std::string t = tag_of(v);
  return (t == "list" || t == "tuple") && v.o[0].second.is_array();
}

bool contains_ref(const Value& v, int depth) {
  if (depth > 64 || !v.is_object()) {
    return depth > 64;
  }
  for (const auto& [k, x] : v.o) {
    if (k == "ref") {
      return true;
    }
    if (x.is_array()) {
      for (const Value& y : x.a) {
        if (contains_ref(y, depth + 1)) {
          return true;
        }
      }
    } else if (contains_ref(x, depth + 1)) {
      return true;
    }
  }
  return false;
}

// The number a JSON value encodes (an int or float, or {"float": "inf"/"-inf"/"nan"}).
std::optional<double> as_float(const Value& v) {
  if (v.is_int()) {
    return static_cast<double>(v.i);
  }
  if (v.type == Value::FLOAT) {
    return v.d;
  }
  if (tag_of(v) == "float" && v.o[0].second.is_string()) {
    const std::string& s = v.o[0].second.s;
    if (s == "inf") {
      return std::numeric_limits<double>::infinity();
    }
    if (s == "-inf") {
      return -std::numeric_limits<double>::infinity();
    }
    if (s == "nan") {
      return std::numeric_limits<double>::quiet_NaN();
    }
  }
  return std::nullopt;
}

// A constant argument converted to the schema type `type`, as torch.ops would convert its
// Python value.
IValue constant(const Value& v, const c10::TypePtr& type, int64_t n, const std::string& where) {
  using K = c10::TypeKind;
  if (v.is_null()) {
    if (type->kind() == K::OptionalType || type->kind() == K::NoneType) {
      return IValue();
    }
    fail(where + ": None for a " + type->str());
  }
  const c10::TypePtr t = without_optional(type);
  const std::string tag = tag_of(v);
  switch (t->kind()) {
    case K::IntType:
    case K::SymIntType:
      if (v.is_int()) {
        return IValue(v.i);
      }
      if (v.type == Value::BOOL) {
        return IValue(static_cast<int64_t>(v.b));
      }
      break;
    case K::FloatType:
    case K::SymFloatType:
      if (auto f = as_float(v)) {
        return IValue(*f);
      }
      break;
    case K::BoolType:
    case K::SymBoolType:
      if (v.type == Value::BOOL) {
        return IValue(v.b);
      }
      break;
    case K::NumberType:
      if (v.is_int()) {
        return IValue(v.i);
      }
      if (v.type == Value::BOOL) {
        return IValue(v.b);
      }
      if (auto f = as_float(v)) {
        return IValue(*f);
      }
      break;
    case K::StringType:
      if (v.is_string()) {
        return IValue(v.s);
      }
      break;
    case K::ScalarTypeType:
      if (tag == "dtype") {
        return IValue(static_cast<int64_t>(dtype(v.o[0].second, where)));
      }
      break;
    case K::LayoutType:
      if (tag == "layout") {
        return IValue(named(kLayouts, string(v.o[0].second, where), "layout", where));
      }
      break;
    case K::MemoryFormatType:
      if (tag == "memory_format") {
        return IValue(named(kFormats, string(v.o[0].second, where), "memory format", where));
      }
      break;
    case K::TensorType:
      // torch.ops passes a Python number for a Tensor argument as a wrapped-number tensor
      // (aten::add.Tensor(x, 1.0)), which type promotion treats as a scalar.
      if (v.is_int() || v.type == Value::BOOL || as_float(v).has_value()) {
        c10::Scalar s = v.is_int()           ? c10::Scalar(v.i)
            : v.type == Value::BOOL ? c10::Scalar(v.b)
                                    : c10::Scalar(*as_float(v));
        at::Tensor t = c10::scalar_to_tensor(s);
        t.unsafeGetTensorImpl()->set_wrapped_number(true);
        return IValue(std::move(t));
      }
      break;
    case K::DeviceObjType:
      if (tag == "device") {
        return IValue(device(string(v.o[0].second, where), where));
      }
      break;
    case K::ListType: {
      const c10::TypePtr elem = t->castRaw<c10::ListType>()->getElementType();
      std::vector<const Value*> items;
      if (is_sequence(v)) {
        for (const Value& x : v.o[0].second.a) {
          items.push_back(&x);
        }
      } else if (v.is_int() && n > 0 && (elem->kind() == K::IntType || elem->kind() == K::SymIntType)) {
        return IValue(std::vector<int64_t>(static_cast<size_t>(n), v.i));  // int[2] given an int
      } else {
        break;
      }
      switch (elem->kind()) {
        case K::IntType:
        case K::SymIntType: {
          std::vector<int64_t> out;
          for (const Value* x : items) {
            out.push_back(constant(*x, elem, 0, where).toInt());
          }
          return IValue(out);
        }
        case K::FloatType: {
          std::vector<double> out;
          for (const Value* x : items) {
            out.push_back(constant(*x, elem, 0, where).toDouble());
          }
          return IValue(out);
        }
        case K::BoolType: {
          c10::List<bool> out;
          for (const Value* x : items) {
            out.push_back(constant(*x, elem, 0, where).toBool());
          }
          return IValue(out);
        }
        case K::TensorType:
          if (items.empty()) {
            return IValue(c10::List<at::Tensor>());
          }
          break;
        case K::OptionalType:
          if (without_optional(elem)->kind() == K::TensorType) {
            c10::List<std::optional<at::Tensor>> out;
            for (const Value* x : items) {
              if (!x->is_null()) {
                fail(where + ": a constant tensor in a list (tensors are registers)");
              }
              out.push_back(std::nullopt);
            }
            return IValue(out);
          }
          break;
        default:
          break;
      }
      break;
    }
    default:
      break;
  }
  fail(where + ": a constant the C++ runtime cannot convert to " + type->str());
}

// A graph constant (no schema to convert against): scalars, dtypes, devices, int lists.
IValue plain_constant(const Value& v, const std::string& where) {
  switch (v.type) {
    case Value::NUL:
      return IValue();
    case Value::BOOL:
      return IValue(v.b);
    case Value::INT:
      return IValue(v.i);
    case Value::FLOAT:
      return IValue(v.d);
    case Value::STRING:
      return IValue(v.s);
    default:
      break;
  }
  std::string tag = tag_of(v);
  if (tag == "float") {
    return IValue(*as_float(v));
  }
  if (tag == "dtype") {
    return IValue(static_cast<int64_t>(dtype(v.o[0].second, where)));
  }
  if (tag == "device") {
    return IValue(device(string(v.o[0].second, where), where));
  }
  if (is_sequence(v)) {
    std::vector<int64_t> out;
    for (const Value& x : v.o[0].second.a) {
      out.push_back(integer(x, where, INT64_MIN, INT64_MAX));
    }
    return IValue(out);
  }
  fail(where + ": a constant the C++ runtime cannot hold");
}

std::string schema_text(const c10::FunctionSchema& schema) {
  std::ostringstream s;
  s << schema;
  return s.str();
}

// "aten::add.Tensor" -> ("aten::add", "Tensor"); "aten::relu" -> ("aten::relu", "").
c10::OperatorName op_name(const std::string& name) {
  size_t ns = name.find("::");
  size_t dot = ns == std::string::npos ? std::string::npos : name.find('.', ns + 2);
  if (dot == std::string::npos) {
    return {name, ""};
  }
  return {name.substr(0, dot), name.substr(dot + 1)};
}

namespace {

const Named kSymOps[] = {
    {"add", 0}, {"sub", 1}, {"mul", 2},  {"floordiv", 3}, {"mod", 4}, {"neg", 5},  {"eq", 6},
    {"ne", 7},  {"lt", 8},  {"le", 9},   {"gt", 10},       {"ge", 11}, {"max", 12}, {"min", 13},
};
const Named kViews[] = {
    {"view", 0}, {"t", 1}, {"transpose", 2}, {"permute", 3}, {"reinterpret", 4}, {"split", 5},
};

}  // namespace

int64_t sym_kind(const std::string& name, const std::string& where) {
  return named(kSymOps, name, "arithmetic step", where);
}

int64_t view_kind(const std::string& name, const std::string& where) {
  return named(kViews, name, "view kind", where);
}

// Highest element index + 1 a geometry reads (0 for no elements); -1 on overflow.
int64_t extent(const std::vector<int64_t>& shape, const std::vector<int64_t>& stride, int64_t offset) {
  int64_t last = offset;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == 0) {
      return 0;
    }
    int64_t span = 0;
    if (__builtin_mul_overflow(shape[i] - 1, stride[i], &span) ||
        __builtin_add_overflow(last, span, &last)) {
      return -1;
    }
  }
  return last + 1;
}

}  // namespace fxrt::decode
