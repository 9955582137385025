// A package's tensors in the C++ runtime, as fxrt.deploy.loaded handles them in Python: the
// weights, views of their entries in the memory-mapped file (tied names, the same entry and
// geometry, are one tensor), moved to the load's device when it is not the CPU; the graph's
// constants; the retargeting of a manifest's devices for that device; and update_weights, which replaces weights by name with the checks
// and tie semantics of LoadedModel.update_weights and publishes the new set atomically
// (model_impl.h).

#include "model_impl.h"

#include "decode.h"
#include "sha256.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <optional>
#include <set>
#include <sstream>
#include <tuple>

namespace fxrt {

using json::clip;
using json::Value;
using namespace decode;

c10::Device resolve_device(const c10::Device& device) {
  try {
    return at::empty({0}, at::TensorOptions().device(device)).device();
  } catch (const c10::Error& e) {
    std::string why = e.what_without_backtrace();
    throw std::invalid_argument(
        "fxrt: device " + device.str() + " is not available in this process (" +
        why.substr(0, why.find('\n')) + ")");
  }
}

void retarget(Value& doc, const c10::Device& from, const c10::Device& to) {
  auto same = [&](const std::string& s) {
    try {
      c10::Device d(s);
      return d == from || (d.type() == from.type() && !d.has_index());
    } catch (const std::exception&) {
      return false;
    }
  };
  std::vector<Value*> todo{&doc};
  while (!todo.empty()) {  // iterative: the reader bounds the nesting, this needs no stack
    Value* v = todo.back();
    todo.pop_back();
    if (v->is_object()) {
      for (auto& [key, member] : v->o) {
        if (key == "device" && member.is_string() && same(member.s)) {
          member.s = to.str();
        } else {
          todo.push_back(&member);
        }
      }
    } else if (v->is_array()) {
      for (Value& item : v->a) {
        todo.push_back(&item);
      }
    }
  }
  // The program's guarded inputs: [position, dtype, device, sizes, strides].
  auto find = [](Value& obj, const char* key) -> Value* {
    for (auto& [k, v] : obj.o) {
      if (k == key) {
        return &v;
      }
    }
    return nullptr;
  };
  Value* guards = doc.is_object() ? find(doc, "guards") : nullptr;
  Value* specs = guards != nullptr && guards->is_object() ? find(*guards, "inputs") : nullptr;
  if (specs != nullptr && specs->is_array()) {
    for (Value& spec : specs->a) {
      if (spec.is_array() && spec.a.size() == 5 && spec.a[2].is_string() && same(spec.a[2].s)) {
        spec.a[2].s = to.str();
      }
    }
  }
}

void Model::Impl::load_weights(const RawPackage& raw, const Value& records) {
  std::map<std::string, at::Tensor> bases;
  // (entry, shape, stride, offset) -> weight id: tied names are one tensor, as in Python.
  std::map<std::tuple<std::string, std::vector<int64_t>, std::vector<int64_t>, int64_t>, size_t>
      views;
  auto set = std::make_shared<WeightSet>();
  for (const auto& [name, r] : records.o) {
    std::string where = "weight \"" + clip(name) + "\"";
    if (name.size() > 4096 || !r.is_object() || r.o.size() != 6) {
      fail(where + ": malformed");
    }
    const std::string& entry = string(member(r, "entry", where), where);
    auto e = raw.entries.find(entry);
    if (e == raw.entries.end()) {
      fail(where + ": no weights entry \"" + clip(entry) + "\"");
    }
    const std::string& kind = string(member(r, "kind", where), where);
    if (kind != "parameter" && kind != "buffer" && kind != "nonpersistent_buffer" &&
        kind != "constant") {
      fail(where + ": unknown kind");
    }
    int st = 0;
    int64_t itemsize = 0;
    safetensors_dtype(e->second.dtype, st, itemsize);
    auto type = static_cast<c10::ScalarType>(st);
    if (short_dtype(member(r, "dtype", where), where) != type) {
      fail(where + ": dtype " + clip(member(r, "dtype", where).s, 20) + " but its entry is " +
           e->second.dtype);
    }
    std::vector<int64_t> shape = ints(member(r, "shape", where), where, 0, int64_t{1} << 62);
    std::vector<int64_t> stride = ints(member(r, "stride", where), where, 0, int64_t{1} << 62);
    int64_t offset = integer(member(r, "offset", where), where, 0, int64_t{1} << 62);
    if (shape.size() != stride.size() || shape.size() > kMaxDims) {
      fail(where + ": malformed geometry");
    }
    int64_t end = extent(shape, stride, offset);
    if (end < 0 || end > e->second.numel) {
      fail(where + ": view reaches past its entry");
    }
    at::Tensor& base = bases[entry];
    if (!base.defined()) {
      auto options = at::TensorOptions().dtype(type);
      if (e->second.numel > 0) {
        std::shared_ptr<MappedFile> keep = raw.file;
        base = at::from_blob(
            raw.file->data() + raw.data_start + e->second.begin, {e->second.numel},
            [keep](void*) mutable { keep.reset(); }, options);
      } else {
        base = at::empty({0}, options);
      }
      if (device != base.device()) {
        base = base.to(device);
      }
    }
    size_t id = weight_names.size();
    weight_names.push_back(name);
    weight_kinds.push_back(kind);
    weight_id[name] = id;
    auto [tied, fresh] = views.try_emplace({entry, shape, stride, offset}, id);
    if (fresh) {
      group_of.push_back(groups.size());
      groups.push_back({id});
      set->tensors.push_back(base.as_strided(shape, stride, offset));
    } else {
      size_t g = group_of[tied->second];
      group_of.push_back(g);
      groups[g].push_back(id);
      set->tensors.push_back(set->tensors[tied->second]);
    }
  }
  current.store(std::move(set));
}

// After the program and signature are loaded: each weight has the geometry the program was
// compiled for (its guard), and every entry of the weights section is used by a weight or a
// graph tensor, as fxrt.deploy.loaded requires.
void Model::Impl::check_weights(const RawPackage& raw, const Value& manifest) const {
  std::shared_ptr<const WeightSet> set = current.load();
  for (const auto& [pos, spec] : specs) {
    const Source& s = sources[static_cast<size_t>(pos)];
    if (s.kind != Source::WEIGHT) {
      continue;
    }
    const at::Tensor& t = set->tensors[s.index];
    bool ok = t.scalar_type() == spec.dtype && t.dim() == static_cast<int64_t>(spec.sizes.size());
    for (size_t d = 0; ok && d < spec.sizes.size(); ++d) {
      ok = (spec.sizes[d] < 0 || spec.sizes[d] == t.size(static_cast<int64_t>(d))) &&
          (spec.strides.size() != spec.sizes.size() || spec.strides[d] < 0 ||
           spec.strides[d] == t.stride(static_cast<int64_t>(d)));
    }
    if (!ok) {
      fail("weight \"" + clip(weight_names[s.index]) + "\" does not match graph " +
           input_names[static_cast<size_t>(pos)]);
    }
  }
  std::set<std::string> used;
  for (const auto& [name, r] : object(manifest, "weights", "manifest").o) {
    used.insert(string(member(r, "entry", name), name));
  }
  const Value* graph = manifest.find("graph");
  const Value* tensors = graph != nullptr ? graph->find("tensors") : nullptr;
  if (tensors != nullptr && tensors->is_object()) {
    for (const auto& [name, r] : tensors->o) {
      used.insert("graph/" + name);
    }
  }
  for (const auto& [name, e] : raw.entries) {
    if (used.count(name) == 0) {
      fail("weights section entries used by nothing: [" + clip(name) + "]");
    }
  }
}

// The graph's constants (tensors fxrt made, stored as "graph/<name>" entries; scalars): each
// tensor rebuilt from its bytes, its digest checked, on its (retargeted) device.
std::vector<IValue> Model::Impl::graph_constants(
    const RawPackage& raw,
    const Value& graph,
    int64_t n_regs,
    std::vector<int64_t>& regs_out) {
  const Value& records = object(graph, "tensors", "graph");
  std::vector<IValue> out;
  for (const Value& item : array(graph, "constants", "graph").a) {
    if (!item.is_array() || item.a.size() != 2) {
      fail("graph constants: malformed");
    }
    std::string where = "graph constant " + (item.a[0].is_int() ? std::to_string(item.a[0].i) : "?");
    regs_out.push_back(integer(item.a[0], where, 0, n_regs - 1));
    const Value& v = item.a[1];
    if (tag_of(v) != "tensor") {
      out.push_back(plain_constant(v, where));
      continue;
    }
    const std::string& name = string(v.o[0].second, where);
    const Value* rec = records.find(name);
    auto e = raw.entries.find("graph/" + name);
    if (rec == nullptr || !rec->is_object() || e == raw.entries.end() || e->second.dtype != "U8") {
      fail(where + ": no graph tensor \"" + clip(name) + "\"");
    }
    auto type = dtype(member(*rec, "dtype", where), where);
    std::vector<int64_t> shape = ints(member(*rec, "shape", where), where, 0, int64_t{1} << 62);
    std::vector<int64_t> stride = ints(member(*rec, "stride", where), where, 0, int64_t{1} << 62);
    int64_t nbytes = integer(member(*rec, "nbytes", where), where, 0, int64_t{1} << 62);
    bool requires_grad = boolean(member(*rec, "requires_grad", where), where);
    c10::Device dev = decode::device(string(member(*rec, "device", where), where), where);
    const std::string& digest = string(member(*rec, "sha256", where), where);
    int64_t span = shape.size() == stride.size() ? extent(shape, stride, 0) : -1;
    int64_t want = 0;
    if (span < 0 || shape.size() > kMaxDims ||
        __builtin_mul_overflow(span, static_cast<int64_t>(c10::elementSize(type)), &want) ||
        want != nbytes || static_cast<uint64_t>(nbytes) != e->second.end - e->second.begin) {
      fail(where + ": its record does not match its bytes");
    }
    uint8_t* bytes = raw.file->data() + raw.data_start + e->second.begin;
    Sha256 h;
    h.update(bytes, static_cast<size_t>(nbytes));
    if (Sha256::hex(h.digest()) != digest) {
      fail(where + ": tensor bytes do not match their hash");
    }
    // The bytes are the storage the tensor spans, first element to last, as fxrt.artifact
    // writes them: the tensor is a view with its strides of their copy.
    at::Tensor t;
    if (span > 0) {
      at::TensorOptions options = at::TensorOptions().dtype(type);
      t = at::from_blob(bytes, {span}, options).clone().as_strided(shape, stride);
    } else {
      t = at::empty_strided(shape, stride, at::TensorOptions().dtype(type));
    }
    if (dev != t.device()) {
      t = t.to(dev);
    }
    if (requires_grad && c10::isFloatingType(type)) {
      t.set_requires_grad(true);
    }
    out.emplace_back(std::move(t));
  }
  return out;
}

size_t Model::Impl::mapped(const WeightSet& set) const {
  const uint8_t* begin = file->data();
  const uint8_t* end = begin + file->size();
  size_t n = 0;
  for (const at::Tensor& t : set.tensors) {
    const auto* p = static_cast<const uint8_t*>(t.storage().data());
    n += t.device().is_cpu() && p != nullptr && p >= begin && p < end;
  }
  return n;
}

namespace {

std::string meta(const at::Tensor& t) {
  std::string s = dtype_name(t.scalar_type()) + "[";
  for (int64_t d = 0; d < t.dim(); ++d) {
    s += (d ? ", " : "") + std::to_string(t.size(d));
  }
  return s + "]";
}

// As Python prints a list of names (its first 10).
std::string names(const std::vector<std::string>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size() && i < 10; ++i) {
    s += (i ? ", '" : "'") + clip(v[i], 200) + "'";
  }
  return s + "]";
}

bool same_tensor(const at::Tensor& a, const at::Tensor& b) {
  return a.is_same(b) ||
      (a.device() == b.device() && a.storage().data() == b.storage().data() &&
       a.storage_offset() == b.storage_offset() && a.sizes().equals(b.sizes()) &&
       a.strides().equals(b.strides()));
}

}  // namespace

void Model::update_weights(
    const std::unordered_map<std::string, at::Tensor>& weights,
    bool strict) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> one_at_a_time(m.update_mutex);
  std::shared_ptr<const WeightSet> now = m.current.load();
  std::vector<std::string> given;  // in name order: errors do not depend on the map's order
  std::vector<std::string> unknown;
  for (const auto& [name, t] : weights) {
    (m.weight_id.count(name) ? given : unknown).push_back(name);
  }
  std::sort(given.begin(), given.end());
  std::sort(unknown.begin(), unknown.end());
  if (!unknown.empty() && strict) {
    throw std::invalid_argument("fxrt: update_weights: unknown weights " + names(unknown));
  }
  struct Chosen {
    std::string name;
    const at::Tensor* given;
    at::Tensor tensor;
  };
  std::vector<std::optional<Chosen>> chosen(m.groups.size());
  for (const std::string& name : given) {
    size_t id = m.weight_id.at(name);
    const at::Tensor& t = weights.at(name);
    const at::Tensor& old = now->tensors[id];
    if (!t.defined()) {
      throw std::invalid_argument(
          "fxrt: weight '" + name + "': expected a tensor, got an undefined one");
    }
    if (!t.sizes().equals(old.sizes()) || t.scalar_type() != old.scalar_type()) {
      throw std::invalid_argument(
          "fxrt: weight '" + name + "': the package has " + meta(old) + ", got " + meta(t) +
          " (shapes and dtypes must match: the graph is not recompiled)");
    }
    at::Tensor fresh = t.detach();
    if (fresh.device() != old.device() || !fresh.strides().equals(old.strides())) {
      fresh = at::empty_strided(old.sizes(), old.strides(), old.options()).copy_(fresh);
    }
    std::optional<Chosen>& group = chosen[m.group_of[id]];
    if (group.has_value() && !same_tensor(*group->given, t)) {
      throw std::invalid_argument(
          "fxrt: weights '" + group->name + "' and '" + name +
          "' are tied in the package (one tensor) but were given different tensors");
    }
    if (!group.has_value()) {
      group = Chosen{name, &t, std::move(fresh)};
    }
  }
  if (strict) {
    std::vector<std::string> missing;
    for (size_t id = 0; id < m.weight_names.size(); ++id) {
      const std::string& kind = m.weight_kinds[id];
      if (!chosen[m.group_of[id]].has_value() && (kind == "parameter" || kind == "buffer")) {
        missing.push_back(m.weight_names[id]);
      }
    }
    std::sort(missing.begin(), missing.end());
    if (!missing.empty()) {
      throw std::invalid_argument("fxrt: update_weights: missing weights " + names(missing));
    }
  }
  auto next = std::make_shared<WeightSet>(*now);
  for (size_t g = 0; g < chosen.size(); ++g) {
    if (chosen[g].has_value()) {
      for (size_t id : m.groups[g]) {
        next->tensors[id] = chosen[g]->tensor;
      }
    }
  }
  m.current.store(std::move(next));
}

std::unordered_map<std::string, at::Tensor> Model::state_dict() const {
  std::shared_ptr<const WeightSet> now = impl_->current.load();
  std::unordered_map<std::string, at::Tensor> out;
  for (size_t id = 0; id < impl_->weight_names.size(); ++id) {
    out.emplace(impl_->weight_names[id], now->tensors[id]);
  }
  return out;
}

size_t Model::mapped_weights() const {
  return impl_->mapped(*impl_->current.load());
}

}  // namespace fxrt
