// The shape of a package's signature (fxrt/deploy/signature.py, Signature.from_json, with its
// words): the fields of each input and output by kind, the types and lengths of their strings,
// the Dim names and ranges. inputs.cpp then binds it to the program; what only Python reads (the
// tree specs' node types) the Python face checks.

#include "model_impl.h"

#include "decode.h"

#include <initializer_list>
#include <string>

namespace fxrt {

using json::clip;
using json::Value;
using namespace decode;

namespace {

// An object whose members are exactly `keys`.
bool has_exactly(const Value& v, std::initializer_list<const char*> keys) {
  if (!v.is_object() || v.o.size() != keys.size()) {
    return false;
  }
  for (const char* k : keys) {
    if (v.find(k) == nullptr) {
      return false;
    }
  }
  return true;
}

void text(const Value& obj, const char* key, const std::string& where, size_t limit = 4096) {
  const Value* v = obj.find(key);
  if (v == nullptr || !v->is_string()) {
    fail(where + " " + key + ": expected str, got " + (v == nullptr ? "NoneType" : "another type"));
  }
  if (v->s.size() > limit) {
    fail(where + " " + key + ": too long");
  }
}

void sizes(const Value& obj, const std::string& where) {
  const Value* shape = obj.find("shape");
  if (shape == nullptr || !shape->is_array()) {
    fail(where + ": expected list");
  }
  if (shape->a.size() > static_cast<size_t>(kMaxDims)) {
    fail(where + ": too many dimensions");
  }
  for (const Value& d : shape->a) {
    if (!d.is_int() && !(d.is_string() && d.s.size() <= 2000)) {
      fail(where + ": malformed size");
    }
  }
}

}  // namespace

void check_signature(const Value& sig) {
  if (!has_exactly(sig, {"inputs", "outputs", "ranges", "in_spec", "out_spec", "dims"})) {
    fail("signature: malformed");
  }
  for (const char* spec : {"in_spec", "out_spec"}) {
    if (!sig.find(spec)->is_string()) {
      fail(std::string(spec) + ": expected str");
    }
  }
  const Value& dims = *sig.find("dims");
  if (!dims.is_object()) {
    fail("dims: expected dict");
  }
  for (const auto& [k, v] : dims.o) {
    if (!is_symbol(k) || !v.is_string() || v.s.size() > 200) {
      fail("dims: malformed");
    }
  }
  const Value& ranges = *sig.find("ranges");
  if (!ranges.is_object()) {
    fail("ranges: expected dict");
  }
  for (const auto& [k, r] : ranges.o) {
    if (!is_symbol(k) || !r.is_array() || r.a.size() != 2) {
      fail("ranges: malformed entry '" + clip(k, 20) + "'");
    }
    int64_t lo = integer(r.a[0], "range of " + k, 0, int64_t{1} << 62);
    if (!r.a[1].is_null()) {
      int64_t hi = integer(r.a[1], "range of " + k, 0, int64_t{1} << 62);
      if (hi < lo) {
        fail("range of " + k + ": [" + std::to_string(lo) + ", " + std::to_string(hi) +
             "] is empty");
      }
    }
  }
  const Value& inputs = *sig.find("inputs");
  if (!inputs.is_array()) {
    fail("inputs: expected list");
  }
  for (size_t i = 0; i < inputs.a.size(); ++i) {
    const Value& d = inputs.a[i];
    std::string where = "signature input " + std::to_string(i);
    const Value* kind = d.is_object() ? d.find("kind") : nullptr;
    const std::string k = kind != nullptr && kind->is_string() ? kind->s : "";
    bool ok = k == "weight"     ? has_exactly(d, {"name", "kind", "weight"})
        : k == "tensor"   ? has_exactly(d, {"name", "kind", "path", "dtype", "shape", "device"})
        : k == "constant" ? has_exactly(d, {"name", "kind", "path", "value"})
        : k == "symint"   ? has_exactly(d, {"name", "kind", "path", "shape"})
                          : false;
    if (!ok) {
      fail(where + ": malformed");
    }
    text(d, "name", where);
    text(d, k == "weight" ? "weight" : "path", where);
    if (k == "tensor") {
      text(d, "dtype", where, 40);
      text(d, "device", where, 40);
    }
    if (k == "tensor" || k == "symint") {
      sizes(d, where);
    }
    if (k == "constant") {
      const Value& v = *d.find("value");
      if (v.is_array() || v.is_object()) {
        fail(where + ": a constant must be a number, bool, string or null");
      }
    }
  }
  const Value& outputs = *sig.find("outputs");
  if (!outputs.is_array()) {
    fail("outputs: expected list");
  }
  for (size_t i = 0; i < outputs.a.size(); ++i) {
    const Value& d = outputs.a[i];
    std::string where = "signature output " + std::to_string(i);
    const Value* kind = d.is_object() ? d.find("kind") : nullptr;
    const std::string k = kind != nullptr && kind->is_string() ? kind->s : "";
    if (k == "user" && has_exactly(d, {"kind", "path", "dtype", "shape"})) {
      text(d, "path", where);
      const Value& dtype = *d.find("dtype");
      if (!dtype.is_string() || dtype.s.size() > 40) {
        fail(where + ": malformed dtype");
      }
      sizes(d, where);
    } else if ((k == "buffer_mutation" || k == "input_mutation") && has_exactly(d, {"kind", "target"})) {
      text(d, "target", where);
    } else {
      fail(where + ": malformed");
    }
  }
}

}  // namespace fxrt
