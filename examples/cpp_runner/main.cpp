// fxrt_runner: loads an fxrt package and runs it from C++, without Python.
//
//   fxrt_runner MODEL.fxrt [--inputs IN.safetensors | --random] [--output OUT.safetensors]
//               [--bench N] [--clock wall|cpu] [--threads N] [--parallel K] [--no-verify]
//   fxrt_runner --check FILE...
//   fxrt_runner MODEL.fxrt --inputs IN.safetensors --serve [--clock wall|cpu] [--threads N]
//
// Inputs come from a safetensors file (entries "0", "1", ... in call order; in Python,
// fxrt.deploy.tensorfile.save_tensors writes one) or are random (the exported sizes; the lower
// end of a dynamic dim's range). It prints each output's dtype and shape, and the latency of the
// calls it made; with --bench N it calls the model N times after N/10 warm-up calls and prints
// the median per-call time as one JSON line. --parallel K runs the model from K threads at once,
// 50 calls each, and checks that every call's outputs equal the first call's. Errors go to
// stderr with exit status 2 (package), 3 (inputs) or 1.
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
#include <vector>

namespace {

struct Args {
  std::vector<std::string> check;
  std::string model, inputs, output, clock = "wall";
  bool random = false, verify = true, serve = false;
  int bench = 0, threads = 0, parallel = 0;
};

[[noreturn]] void usage() {
  std::cerr << "usage: fxrt_runner MODEL.fxrt [--inputs IN.safetensors | --random] "
               "[--output OUT.safetensors] [--bench N] [--clock wall|cpu] [--threads N] "
               "[--no-verify]\n";
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
  if ((a.model.empty() && a.check.empty()) || (a.clock != "wall" && a.clock != "cpu")) {
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

std::vector<at::Tensor> random_inputs(const fxrt::Model& m) {
  std::vector<at::Tensor> out;
  for (const fxrt::InputInfo& in : m.inputs()) {
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
    if (c10::isFloatingType(in.dtype)) {
      out.push_back(at::randn(sizes, options));
    } else if (in.dtype == at::kBool) {
      out.push_back(at::zeros(sizes, options));
    } else {
      out.push_back(at::randint(0, 2, sizes, options));  // valid ids and masks alike
    }
  }
  return out;
}

std::vector<at::Tensor> file_inputs(const std::string& path) {
  auto named = fxrt::load_tensors(path);
  std::sort(named.begin(), named.end(), [](const auto& a, const auto& b) {
    return std::atoll(a.first.c_str()) < std::atoll(b.first.c_str());
  });
  std::vector<at::Tensor> out;
  for (auto& [name, t] : named) {
    out.push_back(std::move(t));
  }
  return out;
}

int run(const Args& a) {
  if (a.threads > 0) {
    at::set_num_threads(a.threads);
  }
  c10::InferenceMode inference;
  int64_t t0 = now_ns(false);
  fxrt::Model model(a.model, fxrt::LoadOptions{a.verify});
  int64_t t1 = now_ns(false);
  std::printf(
      "loaded %s: %s, %zu instructions, %zu inputs, %zu outputs, in %.2f ms\n", a.model.c_str(),
      model.module_name().c_str(), model.num_instructions(), model.inputs().size(),
      model.num_outputs(), (t1 - t0) / 1e6);
  std::vector<at::Tensor> inputs = a.inputs.empty() ? random_inputs(model) : file_inputs(a.inputs);
  bool cpu = a.clock == "cpu";
  if (a.serve) {
    std::string line;
    while (std::getline(std::cin, line)) {
      int n = std::max(1, std::atoi(line.c_str()));
      int64_t s = now_ns(cpu);
      for (int i = 0; i < n; ++i) {
        model.run(inputs);
      }
      std::printf("%.4f\n", (now_ns(cpu) - s) / 1e3 / n);
      std::fflush(stdout);
    }
    return 0;
  }
  int64_t c0 = now_ns(cpu);
  std::vector<at::Tensor> outputs = model.run(inputs);
  int64_t c1 = now_ns(cpu);
  for (size_t i = 0; i < outputs.size(); ++i) {
    const at::Tensor& t = outputs[i];
    std::printf("output %zu: ", i);
    if (!t.defined()) {
      std::printf("None\n");
      continue;
    }
    std::printf("%s[", c10::toString(t.scalar_type()));
    for (int64_t d = 0; d < t.dim(); ++d) {
      std::printf(d ? ", %ld" : "%ld", static_cast<long>(t.size(d)));
    }
    std::printf("]\n");
  }
  std::printf("first call: %.1f us (%s clock)\n", (c1 - c0) / 1e3, a.clock.c_str());
  if (!a.output.empty()) {
    std::vector<std::pair<std::string, at::Tensor>> named;
    for (size_t i = 0; i < outputs.size(); ++i) {
      named.emplace_back(std::to_string(i), outputs[i]);
    }
    fxrt::save_tensors(a.output, named);
  }
  if (a.parallel > 0) {
    std::atomic<int> mismatches{0};
    std::vector<std::thread> pool;
    for (int k = 0; k < a.parallel; ++k) {
      pool.emplace_back([&]() {
        c10::InferenceMode guard;
        for (int i = 0; i < 50; ++i) {
          std::vector<at::Tensor> got = model.run(inputs);
          for (size_t j = 0; j < got.size(); ++j) {
            if (got[j].defined() && !got[j].equal(outputs[j])) {
              ++mismatches;
            }
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
      model.run(inputs);
    }
    std::vector<int64_t> times;
    times.reserve(static_cast<size_t>(a.bench));
    for (int i = 0; i < a.bench; ++i) {
      int64_t s = now_ns(cpu);
      model.run(inputs);
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
      model->run(random_inputs(*model));
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
  } catch (const c10::Error& e) {
    std::cerr << "fxrt_runner: " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "fxrt_runner: " << e.what() << "\n";
    return 1;
  }
}
