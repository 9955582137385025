// fxrt_runner: loads an fxrt package and runs it from C++, without Python.
//
//   fxrt_runner MODEL.fxrt [--inputs IN.safetensors | --random] [--output OUT.safetensors]
//               [--device DEV] [--weights W.safetensors [--non-strict]]
//               [--bench N] [--clock wall|cpu] [--threads N] [--parallel K [--swap W.safetensors]]
//               [--no-verify]
//   fxrt_runner --check FILE...
//   fxrt_runner MODEL.fxrt --inputs IN.safetensors --serve [--clock wall|cpu] [--threads N]
//
// Inputs come from a safetensors file (entries "0", "1", ... in call order, an int input as a
// 0-dim int64 tensor; in Python, fxrt.deploy.tensorfile.save_tensors writes one) or are random
// (the exported sizes; the lower end of a dynamic dim's or int's range, at least 2), on the
// model's device. It prints each output's dtype and shape (an int output: its value; saved as a
// 0-dim int64 tensor), and the latency of the calls it made; with --bench N it calls the model N
// times after N/10 warm-up calls and prints the median per-call time as one JSON line.
// --device loads the weights onto DEV (LoadOptions::device). --weights replaces weights by name
// (Model::update_weights; strict unless --non-strict) before the first call. --parallel K runs
// the model from K threads at once, 50 calls each, and checks that every call's outputs equal
// the first call's; with --swap, another thread meanwhile alternates the weights between the
// current set and the file's, and every call's outputs must equal what one of the two sets gives,
// never a mix. Errors go to stderr with exit status 2 (package), 3 (inputs), 4 (a device or
// weights that do not fit) or 1.
//
// --check loads each FILE in turn and, when it loads, runs it once on random inputs, printing
// one line per file (loaded / refused / failed, and the message): a test of many hostile files
// in one process. --serve reads a count N per line on stdin, makes N calls and prints the mean
// time per call in microseconds, one line each, until stdin closes: benchmarks/deploy.py times
// the runner that way, interleaved with the Python competitors.

#include <fxrt/model.h>
#include <fxrt/tensors.h>

#include <ATen/Parallel.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <iostream>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

struct Args {
  std::vector<std::string> check;
  std::string model, inputs, output, clock = "wall", device, weights, swap;
  bool random = false, verify = true, serve = false, strict = true;
  int bench = 0, threads = 0, parallel = 0;
};

[[noreturn]] void usage() {
  std::cerr << "usage: fxrt_runner MODEL.fxrt [--inputs IN.safetensors | --random] "
               "[--output OUT.safetensors] [--device DEV] [--weights W.safetensors "
               "[--non-strict]] [--bench N] [--clock wall|cpu] [--threads N] [--parallel K "
               "[--swap W.safetensors]] [--no-verify]\n";
  std::exit(64);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string s = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        usage();
      }
      return argv[++i];
    };
    if (s == "--inputs") {
      a.inputs = next();
    } else if (s == "--random") {
      a.random = true;
    } else if (s == "--output") {
      a.output = next();
    } else if (s == "--bench") {
      a.bench = std::atoi(next().c_str());
    } else if (s == "--clock") {
      a.clock = next();
    } else if (s == "--threads") {
      a.threads = std::atoi(next().c_str());
    } else if (s == "--parallel") {
      a.parallel = std::atoi(next().c_str());
    } else if (s == "--serve") {
      a.serve = true;
    } else if (s == "--device") {
      a.device = next();
    } else if (s == "--weights") {
      a.weights = next();
    } else if (s == "--non-strict") {
      a.strict = false;
    } else if (s == "--swap") {
      a.swap = next();
    } else if (s == "--no-verify") {
      a.verify = false;
    } else if (s == "--check") {
      for (++i; i < argc; ++i) {
        a.check.push_back(argv[i]);
      }
    } else if (!s.empty() && s[0] != '-' && a.model.empty()) {
      a.model = s;
    } else {
      usage();
    }
  }
  if ((a.model.empty() && a.check.empty()) || (a.clock != "wall" && a.clock != "cpu") ||
      (!a.swap.empty() && a.parallel <= 0)) {
    usage();
  }
  return a;
}

// Nanoseconds on the chosen clock: wall (steady) or this thread's CPU time.
int64_t now_ns(bool cpu) {
  if (cpu) {
    timespec ts{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
  }
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// A call's inputs: IValues (tensors and ints), and the tensors alone when there are no ints
// (the tensor overload of run(), which the benchmarks time).
struct Inputs {
  std::vector<c10::IValue> values;
  std::vector<at::Tensor> tensors;
  bool ints = false;
};

Inputs random_inputs(const fxrt::Model& m) {
  Inputs out;
  for (const fxrt::InputInfo& in : m.inputs()) {
    if (in.is_int) {
      out.values.emplace_back(std::max<int64_t>(in.min_value, 2));
      out.ints = true;
      continue;
    }
    std::vector<int64_t> sizes;
    for (size_t d = 0; d < in.sizes.size(); ++d) {
      sizes.push_back(in.sizes[d] >= 0 ? in.sizes[d] : std::max<int64_t>(in.min_sizes[d], 2));
    }
    auto options = at::TensorOptions().dtype(in.dtype);
    int64_t bytes = static_cast<int64_t>(c10::elementSize(in.dtype));
    for (int64_t n : sizes) {
      if (__builtin_mul_overflow(bytes, n, &bytes) || bytes > (int64_t{1} << 30)) {
        throw std::invalid_argument(
            "random inputs: " + in.name + " would take over 1 GiB; give --inputs");
      }
    }
    at::Tensor t;
    if (c10::isFloatingType(in.dtype)) {
      t = at::randn(sizes, options);
    } else if (in.dtype == at::kBool) {
      t = at::zeros(sizes, options);
    } else {
      t = at::randint(0, 2, sizes, options);  // valid ids and masks alike
    }
    out.values.emplace_back(t.to(m.device()));
  }
  for (const c10::IValue& v : out.values) {
    if (v.isTensor()) {
      out.tensors.push_back(v.toTensor());
    }
  }
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> sorted_file(const std::string& path) {
  auto named = fxrt::load_tensors(path);
  std::sort(named.begin(), named.end(), [](const auto& a, const auto& b) {
    return std::atoll(a.first.c_str()) < std::atoll(b.first.c_str());
  });
  return named;
}

Inputs file_inputs(const fxrt::Model& m, const std::string& path) {
  Inputs out;
  auto named = sorted_file(path);
  const auto& infos = m.inputs();
  out.ints = std::any_of(infos.begin(), infos.end(), [](const auto& in) { return in.is_int; });
  for (size_t i = 0; i < named.size(); ++i) {
    at::Tensor& t = named[i].second;
    if (i < infos.size() && infos[i].is_int && t.dim() == 0 && !t.is_floating_point()) {
      out.values.emplace_back(t.item<int64_t>());
    } else {
      out.values.emplace_back(t);
      out.tensors.push_back(t);
    }
  }
  return out;
}

std::unordered_map<std::string, at::Tensor> file_weights(const std::string& path) {
  std::unordered_map<std::string, at::Tensor> out;
  for (auto& [name, t] : fxrt::load_tensors(path)) {
    out.emplace(name, std::move(t));
  }
  return out;
}

std::vector<c10::IValue> call(const fxrt::Model& model, const Inputs& in) {
  if (in.ints) {
    return model.run(in.values);
  }
  std::vector<c10::IValue> out;
  for (at::Tensor& t : model.run(in.tensors)) {
    out.emplace_back(t.defined() ? c10::IValue(std::move(t)) : c10::IValue());
  }
  return out;
}

bool same(const std::vector<c10::IValue>& a, const std::vector<c10::IValue>& b) {
  if (a.size() != b.size()) {
    return false;
  }
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].isTensor() != b[i].isTensor() ||
        (a[i].isTensor() ? !a[i].toTensor().equal(b[i].toTensor()) : !(a[i] == b[i]))) {
      return false;
    }
  }
  return true;
}

// --parallel K --swap FILE: K threads call the model while another alternates its weights between
// the current set and the file's; every call must give what one of the two sets gives.
int swap_test(fxrt::Model& model, const Inputs& inputs, const Args& a) {
  auto first = model.state_dict();
  auto second = file_weights(a.swap);
  std::vector<c10::IValue> want_first = call(model, inputs);
  model.update_weights(second, a.strict);
  std::vector<c10::IValue> want_second = call(model, inputs);
  model.update_weights(first);
  std::atomic<int> mixes{0}, seen_first{0}, seen_second{0}, swaps{0};
  std::atomic<bool> stop{false};
  std::thread swapper([&]() {
    c10::InferenceMode guard;
    for (int k = 0; !stop.load(); ++k) {
      model.update_weights(k % 2 ? first : second, k % 2 ? true : a.strict);
      ++swaps;
    }
  });
  std::vector<std::thread> pool;
  for (int k = 0; k < a.parallel; ++k) {
    pool.emplace_back([&]() {
      c10::InferenceMode guard;
      for (int i = 0; i < 50; ++i) {
        std::vector<c10::IValue> got = call(model, inputs);
        if (same(got, want_first)) {
          ++seen_first;
        } else if (same(got, want_second)) {
          ++seen_second;
        } else {
          ++mixes;
        }
      }
    });
  }
  for (std::thread& t : pool) {
    t.join();
  }
  stop = true;
  swapper.join();
  std::printf(
      "swap: %d threads x 50 calls, %d swaps, %d on the first set, %d on the second, %d mixes, "
      "sets differ: %s\n",
      a.parallel, swaps.load(), seen_first.load(), seen_second.load(), mixes.load(),
      same(want_first, want_second) ? "no" : "yes");
  return mixes.load() == 0 ? 0 : 1;
}

int run(const Args& a) {
  if (a.threads > 0) {
    at::set_num_threads(a.threads);
  }
  c10::InferenceMode inference;
  int64_t t0 = now_ns(false);
  fxrt::LoadOptions options{a.verify};
  if (!a.device.empty()) {
    options.device = c10::Device(a.device);
  }
  fxrt::Model model(a.model, options);
  int64_t t1 = now_ns(false);
  std::printf(
      "loaded %s: %s, %zu instructions, %zu inputs, %zu outputs, in %.2f ms\n", a.model.c_str(),
      model.module_name().c_str(), model.num_instructions(), model.inputs().size(),
      model.num_outputs(), (t1 - t0) / 1e6);
  if (!a.weights.empty()) {
    model.update_weights(file_weights(a.weights), a.strict);
  }
  std::printf(
      "weights: %zu of %zu mapped from the file, on %s\n", model.mapped_weights(),
      model.state_dict().size(), model.device().str().c_str());
  Inputs inputs = a.inputs.empty() ? random_inputs(model) : file_inputs(model, a.inputs);
  bool cpu = a.clock == "cpu";
  // The timed calls: the tensor overload when there are no int inputs (no output conversion).
  auto once = [&]() {
    if (inputs.ints) {
      model.run(inputs.values);
    } else {
      model.run(inputs.tensors);
    }
  };
  if (a.serve) {
    std::string line;
    while (std::getline(std::cin, line)) {
      int n = std::max(1, std::atoi(line.c_str()));
      int64_t s = now_ns(cpu);
      for (int i = 0; i < n; ++i) {
        once();
      }
      std::printf("%.4f\n", (now_ns(cpu) - s) / 1e3 / n);
      std::fflush(stdout);
    }
    return 0;
  }
  int64_t c0 = now_ns(cpu);
  std::vector<c10::IValue> outputs = call(model, inputs);
  int64_t c1 = now_ns(cpu);
  std::vector<std::pair<std::string, at::Tensor>> named;
  for (size_t i = 0; i < outputs.size(); ++i) {
    const c10::IValue& v = outputs[i];
    std::printf("output %zu: ", i);
    if (v.isInt()) {
      std::printf("int %ld\n", static_cast<long>(v.toInt()));
      named.emplace_back(std::to_string(i), at::scalar_tensor(v.toInt(), at::kLong));
      continue;
    }
    if (!v.isTensor()) {
      std::printf("%s\n", v.tagKind().c_str());
      named.emplace_back(std::to_string(i), at::Tensor());
      continue;
    }
    const at::Tensor& t = v.toTensor();
    named.emplace_back(std::to_string(i), t);
    std::printf("%s[", c10::toString(t.scalar_type()));
    for (int64_t d = 0; d < t.dim(); ++d) {
      std::printf(d ? ", %ld" : "%ld", static_cast<long>(t.size(d)));
    }
    std::printf("]%s\n", t.device().is_cpu() ? "" : (" on " + t.device().str()).c_str());
  }
  std::printf("first call: %.1f us (%s clock)\n", (c1 - c0) / 1e3, a.clock.c_str());
  if (!a.output.empty()) {
    fxrt::save_tensors(a.output, named);
  }
  if (!a.swap.empty()) {
    return swap_test(model, inputs, a);
  }
  if (a.parallel > 0) {
    std::atomic<int> mismatches{0};
    std::vector<std::thread> pool;
    for (int k = 0; k < a.parallel; ++k) {
      pool.emplace_back([&]() {
        c10::InferenceMode guard;
        for (int i = 0; i < 50; ++i) {
          if (!same(call(model, inputs), outputs)) {
            ++mismatches;
          }
        }
      });
    }
    for (std::thread& t : pool) {
      t.join();
    }
    std::printf("parallel: %d threads x 50 calls, %d mismatches\n", a.parallel, mismatches.load());
    if (mismatches.load() != 0) {
      return 1;
    }
  }
  if (a.bench > 0) {
    for (int i = 0; i < std::max(1, a.bench / 10); ++i) {
      once();
    }
    std::vector<int64_t> times;
    times.reserve(static_cast<size_t>(a.bench));
    for (int i = 0; i < a.bench; ++i) {
      int64_t s = now_ns(cpu);
      once();
      times.push_back(now_ns(cpu) - s);
    }
    std::sort(times.begin(), times.end());
    double median = times[times.size() / 2] / 1e3;
    std::printf(
        "{\"bench\": %d, \"clock\": \"%s\", \"median_us\": %.3f, \"min_us\": %.3f}\n", a.bench,
        a.clock.c_str(), median, times.front() / 1e3);
  }
  return 0;
}

std::string one_line(std::string s) {
  std::replace(s.begin(), s.end(), '\n', ' ');
  return s;
}

int check(const Args& a) {
  c10::InferenceMode inference;
  for (const std::string& path : a.check) {
    std::unique_ptr<fxrt::Model> model;
    try {
      model = std::make_unique<fxrt::Model>(path);
    } catch (const std::exception& e) {
      std::printf("%s\trefused\t%s\n", path.c_str(), one_line(e.what()).c_str());
      continue;
    }
    try {
      call(*model, random_inputs(*model));
      std::printf("%s\tloaded\n", path.c_str());
    } catch (const c10::Error& e) {
      std::printf("%s\tfailed\t%s\n", path.c_str(), one_line(e.what_without_backtrace()).c_str());
    } catch (const std::exception& e) {
      std::printf("%s\tfailed\t%s\n", path.c_str(), one_line(e.what()).c_str());
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a = parse(argc, argv);
  if (!a.check.empty()) {
    return check(a);
  }
  try {
    return run(a);
  } catch (const fxrt::PackageError& e) {
    std::cerr << "fxrt_runner: " << e.what() << "\n";
    return 2;
  } catch (const fxrt::InputError& e) {
    std::cerr << "fxrt_runner: " << e.what() << "\n";
    return 3;
  } catch (const std::invalid_argument& e) {
    std::cerr << "fxrt_runner: " << e.what() << "\n";
    return 4;
  } catch (const c10::Error& e) {
    std::cerr << "fxrt_runner: " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "fxrt_runner: " << e.what() << "\n";
    return 1;
  }
}
