// Multi-stream programs in the compiled loop: the STREAM, RECORD and WAIT instructions
// (fxrt/exec/program.py, fxrt/exec/streams.py) and the two ways loop.h runs them.
//
// CPU: each side stream is a worker thread with a FIFO of tasks, made once per compiled graph on
// its first multi-stream call. The program is cut into segments, maximal runs of instructions on
// one stream (STREAM instructions are the cuts). The calling thread walks the segments in order:
// it runs those of the caller's stream itself and hands each side segment to its stream's worker
// as one task, without waiting. A RECORD sets one of the call's events (CpuCall), a WAIT blocks
// its thread until its events are set. Program order is a valid schedule and every worker runs
// its tasks in order, so the waits always end. Workers run native ops without the GIL and take it
// (PyGILState) for Python calls; the calling thread releases it whenever it blocks. Each task runs
// under the caller's thread-local state (grad and inference mode, dispatch keys: at::
// ThreadLocalState, as at::launch does). A failure anywhere marks the call failed: waits return,
// the remaining instructions are skipped, the calling thread waits for every task of the call to
// end, then rethrows the first error with its instruction. The calls of one compiled graph that
// use the workers run one at a time (their tasks would interleave in the FIFOs). A forked child
// makes workers of its own.
//
// Devices (CUDA, NPU, PrivateUse1): one thread, as without streams. Each label has a c10::Stream
// from the device's pool, made once per compiled graph and device index; stream 0 is the
// caller's current stream. A call first makes every side stream wait for the caller's stream (its
// inputs are ready there), then runs the instructions in order, a STREAM instruction exchanging
// the current stream (the generic DeviceGuardImplInterface, through c10::impl::
// VirtualGuardImpl), RECORD and WAIT recording and blocking c10::Events, and a WAIT also marking
// the memory of the registers it protects as used by its stream (recordDataPtrOnStream, what
// Tensor.record_stream does), so the caching allocator does not hand it to the stream that made it
// before this one is done. The caller's stream is current again when the call returns or fails.

#pragma once

#include "call_op.h"

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

namespace fxrt {

struct StreamOp {  // STREAM
  int64_t stream = 0;
};
struct RecordOp {  // RECORD
  int64_t stream = 0;
  int64_t event = 0;
};
struct WaitOp {  // WAIT
  int64_t stream = 0;
  std::vector<int64_t> events;
  std::vector<int64_t> protect;
};

// Instructions [begin, end) of the program, all on one stream.
struct Segment {
  int64_t stream = 0;
  size_t begin = 0, end = 0;
};

// A thread that runs tasks in the order they were submitted.
class Worker {
 public:
  Worker() : thread_([this] { loop(); }) {}
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;
  ~Worker() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }
  void submit(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks_.push_back(std::move(task));
      queued_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_one();
  }

 private:
  // After a task the worker polls its queue for kIdleSpinUs before it sleeps: the next call's
  // task, submitted within that time, starts without a wake-up (a sleeping thread's wake-up
  // costs tens of microseconds on a virtual machine, more than a host-bound branch saves).
  static constexpr int kIdleSpinUs = 200;

  void loop() {
    at::init_num_threads();  // the intra-op thread count torch.set_num_threads() set
    for (;;) {
      auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(kIdleSpinUs);
      while (queued_.load(std::memory_order_acquire) == 0 &&
             std::chrono::steady_clock::now() < deadline) {
        std::this_thread::yield();
      }
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return stop_ || !tasks_.empty(); });
        if (tasks_.empty()) {
          return;
        }
        task = std::move(tasks_.front());
        tasks_.pop_front();
        queued_.fetch_sub(1, std::memory_order_relaxed);
      }
      task();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  std::atomic<int64_t> queued_{0};  // tasks_.size(), read without the lock
  bool stop_ = false;
  std::thread thread_;  // last: starts once the members above exist
};

// Thrown on a thread whose wait ended because another thread failed (the call's error is that
// one's).
struct CallAborted : std::runtime_error {
  CallAborted() : std::runtime_error("fxrt: a multi-stream call failed on another stream") {}
};

// One call's state on the CPU: its events, its outstanding tasks, its first failure.
class CpuCall {
 public:
  explicit CpuCall(size_t n_events)
      : set_(std::make_unique<std::atomic<bool>[]>(n_events)) {
    for (size_t i = 0; i < n_events; ++i) {
      set_[i].store(false, std::memory_order_relaxed);
    }
  }

  void record(int64_t event) {
    std::lock_guard<std::mutex> lock(mu_);
    set_[static_cast<size_t>(event)].store(true, std::memory_order_release);
    cv_.notify_all();
  }
  // Blocks until every event is set; throws CallAborted when the call failed meanwhile. Spins
  // for a few microseconds first: a branch that ends soon is joined without a sleep and a
  // wake-up.
  void wait(const std::vector<int64_t>& events) {
    auto ready = [&] {
      for (int64_t e : events) {
        if (!set_[static_cast<size_t>(e)].load(std::memory_order_acquire)) {
          return false;
        }
      }
      return true;
    };
    auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinUs);
    while (!ready() && !failed_.load(std::memory_order_acquire)) {
      if (std::chrono::steady_clock::now() > deadline) {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return failed_.load() || ready(); });
        break;
      }
      std::this_thread::yield();
    }
    if (failed_.load(std::memory_order_acquire)) {
      throw CallAborted();
    }
  }
  // Keeps the first failure; wakes every waiter.
  void fail(size_t pc, std::exception_ptr error) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failed_.load()) {
      error_ = std::move(error);
      pc_ = pc;
      failed_.store(true, std::memory_order_release);
    }
    cv_.notify_all();
  }
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  void task_submitted() {
    std::lock_guard<std::mutex> lock(mu_);
    ++pending_;
  }
  // Notifies under the lock: once it is released, the calling thread may return and destroy
  // this object (a notification after the unlock could touch a condition variable already
  // reused by the next call, and hang it).
  void task_done() {
    std::lock_guard<std::mutex> lock(mu_);
    --pending_;
    cv_.notify_all();
  }
  void wait_tasks() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return pending_ == 0; });
  }
  // After wait_tasks(): rethrows the first failure, setting `pc` to its instruction.
  void rethrow(size_t& pc) {
    if (failed_.load()) {
      pc = pc_;
      std::rethrow_exception(error_);
    }
  }
  void add_timing(std::vector<int64_t>* timings, int64_t pc, int64_t t0, int64_t t1) {
    std::lock_guard<std::mutex> lock(mu_);
    timings->insert(timings->end(), {pc, t0, t1});
  }

  const at::ThreadLocalState tls;  // the calling thread's, for the workers

 private:
  static constexpr int kSpinUs = 20;
  std::mutex mu_;
  std::condition_variable cv_;
  std::unique_ptr<std::atomic<bool>[]> set_;
  size_t pending_ = 0;
  std::atomic<bool> failed_{false};
  std::exception_ptr error_;
  size_t pc_ = 0;
};

// One call's state on a device: the streams, the call's events, the current stream.
class DeviceCall {
 public:
  DeviceCall(c10::DeviceType type, const std::vector<c10::Stream>& side, size_t n_events)
      : impl_(type), caller_(impl_.getStream(impl_.getDevice())) {
    streams_.push_back(caller_);
    streams_.insert(streams_.end(), side.begin(), side.end());
    events_.reserve(n_events);
    for (size_t i = 0; i < n_events; ++i) {
      events_.emplace_back(type);
    }
    if (streams_.size() > 1) {  // side streams start after what the caller's stream has done
      c10::Event entry(type);
      entry.record(caller_);
      for (size_t s = 1; s < streams_.size(); ++s) {
        entry.block(streams_[s]);
      }
    }
  }
  DeviceCall(const DeviceCall&) = delete;
  DeviceCall& operator=(const DeviceCall&) = delete;
  ~DeviceCall() {
    if (current_ != 0) {
      impl_.exchangeStream(caller_);
    }
  }
  void switch_to(int64_t stream) {
    if (stream != current_) {
      impl_.exchangeStream(streams_.at(static_cast<size_t>(stream)));
      current_ = stream;
    }
  }
  void record(const RecordOp& op) {
    events_.at(static_cast<size_t>(op.event)).record(streams_[static_cast<size_t>(current_)]);
  }
  void wait(const WaitOp& op, const std::vector<IValue>& regs) {
    const c10::Stream& here = streams_[static_cast<size_t>(current_)];
    for (int64_t e : op.events) {
      events_.at(static_cast<size_t>(e)).block(here);
    }
    for (int64_t r : op.protect) {
      const IValue& v = regs[static_cast<size_t>(r)];
      if (v.isTensor() && v.toTensor().defined() && v.toTensor().has_storage() &&
          v.toTensor().device().type() == here.device_type()) {
        impl_.recordDataPtrOnStream(v.toTensor().storage().data_ptr(), here);
      }
    }
  }

 private:
  c10::impl::VirtualGuardImpl impl_;
  c10::Stream caller_;
  std::vector<c10::Stream> streams_;
  std::vector<c10::Event> events_;
  int64_t current_ = 0;
};

// A compiled graph's streams: how many, where, its segments, and its workers or device streams.
class StreamSet {
 public:
  void configure(int64_t n_streams, const std::string& device, int64_t n_events) {
    n_streams_ = static_cast<size_t>(std::max<int64_t>(n_streams, 1));
    device_ = c10::Device(device).type();
    if (device_ != c10::DeviceType::CPU && !c10::impl::hasDeviceGuardImpl(device_)) {
      n_streams_ = 1;  // a device without streams: program order, on the caller's thread
    }
    n_events_ = static_cast<size_t>(std::max<int64_t>(n_events, 0));
  }
  bool multi() const { return n_streams_ > 1; }
  bool on_cpu() const { return device_ == c10::DeviceType::CPU; }
  size_t n_events() const { return n_events_; }
  c10::DeviceType device_type() const { return device_; }

  // Cut the program into segments; `stream_of(pc)` is the stream a STREAM instruction at `pc`
  // switches to, or -1 for other instructions.
  template <typename F>
  void cut(size_t n_code, F stream_of) {
    segments_.clear();
    Segment seg;
    for (size_t pc = 0; pc < n_code; ++pc) {
      int64_t s = stream_of(pc);
      if (s < 0) {
        continue;
      }
      seg.end = pc;
      if (seg.end > seg.begin) {
        segments_.push_back(seg);
      }
      seg = Segment{s, pc + 1, pc + 1};
    }
    seg.end = n_code;
    if (seg.end > seg.begin) {
      segments_.push_back(seg);
    }
  }
  const std::vector<Segment>& segments() const { return segments_; }

  // The worker of side stream `s`, made on first use.
  Worker& worker(int64_t s) {
    std::lock_guard<std::mutex> lock(mu_);
    if (owner_ != getpid()) {  // a forked child: its parent's workers are not here
      for (auto& w : workers_) {
        (void)w.release();  // their threads are gone: nothing to stop or join
      }
      workers_.clear();
      owner_ = getpid();
    }
    if (workers_.empty()) {
      workers_.resize(n_streams_);
    }
    auto& w = workers_.at(static_cast<size_t>(s));
    if (!w) {
      w = std::make_unique<Worker>();
    }
    return *w;
  }
  // The side streams (1..n-1) on the current device of the graph's type, made on first use.
  std::vector<c10::Stream> side_streams() {
    c10::impl::VirtualGuardImpl impl(device_);
    c10::Device device = impl.getDevice();
    std::lock_guard<std::mutex> lock(mu_);
    auto& found = pools_[device.index()];
    if (found.empty()) {
      for (size_t s = 1; s < n_streams_; ++s) {
        found.push_back(impl.getStreamFromGlobalPool(device, false));
      }
    }
    return found;
  }
  // Held by a CPU multi-stream call while it uses the workers.
  std::mutex& call_mutex() { return call_mu_; }

 private:
  size_t n_streams_ = 1;
  c10::DeviceType device_ = c10::DeviceType::CPU;
  size_t n_events_ = 0;
  std::vector<Segment> segments_;
  std::mutex mu_;
  std::mutex call_mu_;
  std::vector<std::unique_ptr<Worker>> workers_;
  pid_t owner_ = getpid();  // the process the workers belong to
  std::map<c10::DeviceIndex, std::vector<c10::Stream>> pools_;
};

}  // namespace fxrt
