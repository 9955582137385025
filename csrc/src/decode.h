// Reading a package manifest: typed field access that fails with a PackageError saying where,
// and fxrt.serialize's argument encoding ({"ref": 3}, {"tuple": [...]}, {"dtype": "torch.float32"},
// plain JSON scalars) converted to c10::IValues, against an op's schema type where there is one,
// as torch.ops converts the Python values.

#pragma once

#include "json.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace fxrt::decode {

constexpr int64_t kMaxRegs = int64_t{1} << 24;  // registers a program may have
constexpr int64_t kMaxDims = 64;

// Throws PackageError("invalid fxrt package: " + why).
[[noreturn]] void fail(const std::string& why);

// Fields of an object, and values of a type; `where` names them in errors.
const json::Value& member(const json::Value& obj, const char* key, const std::string& where);
const json::Value& object(const json::Value& obj, const char* key, const std::string& where);
const json::Value& array(const json::Value& obj, const char* key, const std::string& where);
int64_t integer(const json::Value& v, const std::string& where, int64_t lo, int64_t hi);
bool boolean(const json::Value& v, const std::string& where);
const std::string& string(const json::Value& v, const std::string& where);
std::vector<int64_t> ints(const json::Value& v, const std::string& where, int64_t lo, int64_t hi);

c10::ScalarType dtype(const json::Value& v, const std::string& where);  // "torch.float32"
c10::ScalarType short_dtype(const json::Value& v, const std::string& where);  // "float32"
c10::Device device(const std::string& s, const std::string& where);
std::string dtype_name(c10::ScalarType type);  // as Python writes it, without "torch." ("float32")

// The tag of a tagged value ({"tag": payload}), or "" for a plain JSON value.
std::string tag_of(const json::Value& v);
bool is_sequence(const json::Value& v);  // {"list": [...]} or {"tuple": [...]}
bool contains_ref(const json::Value& v, int depth = 0);
std::optional<double> as_float(const json::Value& v);

// A constant argument converted to the schema type `type` (`n`: the schema's fixed list size,
// 0 if none), as torch.ops converts its Python value.
c10::IValue constant(
    const json::Value& v,
    const c10::TypePtr& type,
    int64_t n,
    const std::string& where);
// A graph constant or output (no schema type): scalars, dtypes, devices, int lists.
c10::IValue plain_constant(const json::Value& v, const std::string& where);

// SymOp::Kind and ViewOp::Kind (call_op.h) by the names the program uses.
int64_t sym_kind(const std::string& name, const std::string& where);
int64_t view_kind(const std::string& name, const std::string& where);

// The highest element index + 1 a geometry reads (0 for no elements); -1 on overflow.
int64_t extent(const std::vector<int64_t>& shape, const std::vector<int64_t>& stride, int64_t offset);

// A schema as Python's str(op._schema) writes it; "aten::add.Tensor" as an OperatorName.
std::string schema_text(const c10::FunctionSchema& schema);
c10::OperatorName op_name(const std::string& name);

}  // namespace fxrt::decode
