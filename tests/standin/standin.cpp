// fxrt's stand-in accelerator: a PrivateUse1 backend whose memory is host memory and whose
// streams are worker threads, so device code paths (streams, events, the caching allocator,
// record_stream, copies to and from the host) run, asynchronously, on a machine without a GPU or
// NPU. Test infrastructure only; tests/standin/__init__.py builds and loads it.
//
// Streams. Two devices, each with a default stream (id 0) and a pool of kPool streams (ids
// 1..kPool) handed out round-robin by getNewStream / getStreamFromGlobalPool, as CUDA's pool does.
// A stream is a FIFO of tasks run by its own worker thread (started on first use). Every task
// has a sequence number (1, 2, ...); `completed` counts the tasks that finished, so "the stream
// has passed task n" is `completed >= n`. One global condition variable is notified whenever any
// task finishes; everything that waits (host synchronize, an event wait inside another stream's
// queue, the allocator) waits on it for a counter to pass a value.
//
// Events are markers in those queues: record() enqueues a task that stamps the time and keeps
// (stream, sequence number); block() enqueues, on the waiting stream, a task that waits until the
// recording stream has passed that number; query/synchronize compare or wait on the counter.
//
// Delay knob. Each worker sleeps `delay` microseconds before each task: FXRT_STANDIN_DELAY_US (or
// set_delay_us) sets it for every stream except the devices' default streams, so side streams lag
// behind the default stream and the host, which is what makes a missing wait_stream /
// wait_event / record_stream give a wrong answer deterministically; a stream's own delay
// (set_delay_us(us, stream)), the default streams' included, overrides it.
//
// Ops. One boxed fallback serves every op without a kernel of its own here. It runs the op's
// Meta kernel on meta tensors that mirror the arguments (sizes, strides, storage offset and size)
// to learn the results' metadata, then:
//   * results that are views of an argument (schema alias, not written) are made at once as new
//     TensorImpls on the argument's storage: views and metadata-only ops never reach a stream;
//   * results that are fresh are allocated now on the device (current stream), and
//   * the computation is enqueued on the current stream: the worker calls the op's CPU kernel on
//     CPU tensors that alias the same memory (non-owning) and copies fresh results into place.
//     Arguments the op writes (in-place, out=) are written through their aliases; when the Meta
//     kernel resized an out= argument, the device tensor is resized here first.
// ATen ops that have a CPU kernel and a composite one are routed to the fallback too (a math
// composite gives other bits than the CPU kernel eager runs; a real device has its own kernels).
// Ops whose results the host must read (a Scalar or bool result, data-dependent shapes such as
// nonzero, ops without a Meta kernel) synchronize the current stream and run on the host thread.
// Copies between the host and the device enqueue the copy on the device's current stream and
// wait for it (what non_blocking=False does on CUDA); device-to-device copies are asynchronous.
// A task that throws records the error; the next synchronization on the host raises it.
//
// Allocator: a caching allocator on host memory (malloc), one pool per (device, stream). A block
// freed by the host goes back to its allocation stream's pool at once (that stream's later work
// is ordered after its earlier work), unless recordDataPtrOnStream (Tensor.record_stream) named
// other streams: then it waits until each of them has passed everything enqueued on it at the
// time of the free. New host memory is filled with 0xFF bytes (NaN for floating point) so reads
// of memory nothing wrote show up; FXRT_STANDIN_POISON=0 turns that off. Counters as CUDA's
// (DeviceStats): allocations, bytes, reserved bytes, device mallocs/frees.
//
// Graphs (capture_begin/capture_end/replay, CUDA graphs' semantics): Stream::submit, the one
// place a task enters a queue, records into the capturing graph instead; allocations on a
// capturing stream come from the graph's private pool; the host may not wait for, or copy
// through, a capturing stream (that invalidates the capture). A task captures only raw pointers
// and copies of host values, so a replay runs it again on the same memory. Replay submits the
// recorded tasks as one task: one host launch, counted per stream. A stream that waits for an
// event recorded in the capture joins it (fork/join, as on CUDA) and must be joined back before
// the capture ends; a replay then launches once on each stream that took part.
//
// Like CUDA, the device cannot be used in a forked child (its worker threads are not there).

#include <Python.h>
#include <pybind11/pybind11.h>

#include <ATen/EmptyTensor.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/strides.h>
#include <torch/library.h>

#include <pthread.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace standin {

using c10::DeviceIndex;
using c10::DeviceType;
using c10::IValue;
using torch::jit::Stack;

constexpr DeviceIndex kDevices = 2;
constexpr int kPool = 8;  // pool streams per device
constexpr int kStreams = 1 + kPool;
constexpr DeviceType kDev = DeviceType::PrivateUse1;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int64_t env_int(const char* name, int64_t dflt) {
  const char* v = std::getenv(name);
  return (v && *v) ? std::atoll(v) : dflt;
}

// ---- asynchronous errors -----------------------------------------------------------------------

std::mutex g_err_mu;
std::string g_err;

void set_async_error(const std::string& msg) {
  std::lock_guard<std::mutex> lk(g_err_mu);
  if (g_err.empty()) {
    g_err = msg;
  }
}

void check_async_error() {
  std::string msg;
  {
    std::lock_guard<std::mutex> lk(g_err_mu);
    msg.swap(g_err);
  }
  TORCH_CHECK(msg.empty(), "fxrt stand-in: an asynchronous task failed: ", msg);
}

// Waits on the host may block on a task that runs a Python kernel, which needs the GIL.
template <class F>
void without_gil(F&& f) {
  if (Py_IsInitialized() && PyGILState_Check()) {
    PyThreadState* st = PyEval_SaveThread();
    try {
      f();
    } catch (...) {
      PyEval_RestoreThread(st);
      throw;
    }
    PyEval_RestoreThread(st);
  } else {
    f();
  }
}

// ---- streams -----------------------------------------------------------------------------------

std::mutex g_progress_mu;
std::condition_variable g_progress_cv;
std::atomic<bool> g_bad_fork{false};
std::atomic<int64_t> g_side_delay_us{0};

using Task = std::function<void()>;

struct Stream;

// A graph (capture_begin/capture_end/replay, CUDA graphs' semantics): while a stream captures,
// the tasks submitted to it are recorded here instead of run, and the allocations made on it
// come from the graph's private pool; replay() submits the recorded tasks, in order, as one task
// (one host launch) on the current stream. The tasks hold raw pointers, so every replay reads
// and writes the memory the capture used.
//
// Several streams (fork/join, as CUDA does it): a stream that waits for an event recorded in the
// capture joins it and records into a branch of its own, whose first step waits for the point
// the event marks; a wait between two branches is a step too. Every side branch must be joined
// back (some other branch waits for its last step) before capture_end(), else the capture is
// invalid ("unjoined work"). replay() submits each branch as one task on the stream that
// recorded it (the first branch on the current stream); a branch publishes its progress step by
// step, and a wait step blocks until the other branch has passed the point.
struct Step {
  Task task;  // empty for a wait
  int wait_branch = -1;  // a wait: until that branch has run `wait_steps` steps
  size_t wait_steps = 0;
};

struct Branch {
  Stream* stream;
  std::vector<Step> steps;
};

struct Graph {
  DeviceIndex device = 0;
  Stream* stream = nullptr;  // the capturing (origin) stream, while capturing
  std::shared_ptr<std::deque<Branch>> branches = std::make_shared<std::deque<Branch>>();
  uint64_t pool = 0;  // its private memory pool (0: none yet)
  bool capturing = false;
  bool captured = false;
  std::string invalid;  // why the capture was invalidated (empty: it was not)

  size_t num_tasks() const {
    size_t n = 0;
    for (const Branch& b : *branches) {
      for (const Step& s : b.steps) {
        n += s.task ? 1 : 0;
      }
    }
    return n;
  }
};

struct Stream {
  DeviceIndex device;
  int index;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Task> queue;  // guarded by mu
  uint64_t enqueued = 0;  // guarded by mu: tasks submitted so far (the last one's number)
  bool started = false;  // guarded by mu
  std::atomic<uint64_t> completed{0};
  std::atomic<int64_t> delay_us{-1};  // -1: the side-stream delay (0 for a default stream)
  Graph* capture = nullptr;  // guarded by mu: the graph it records into, while capturing
  int branch = -1;  // guarded by mu: its branch of `capture`

  Stream(DeviceIndex d, int i) : device(d), index(i) {}

  // The one entry point of work into the queue. Returns the task's number (0 when a capture
  // recorded it instead).
  uint64_t submit(Task t) {
    TORCH_CHECK(
        !g_bad_fork.load(),
        "fxrt stand-in: cannot use the device in a forked subprocess (its streams' threads are "
        "in the parent); use the 'spawn' start method");
    std::unique_lock<std::mutex> lk(mu);
    if (capture) {
      (*capture->branches)[static_cast<size_t>(branch)].steps.push_back(Step{std::move(t)});
      return 0;
    }
    if (!started) {
      started = true;
      std::thread([this] { run(); }).detach();
    }
    queue.push_back(std::move(t));
    uint64_t seq = ++enqueued;
    lk.unlock();
    cv.notify_one();
    return seq;
  }

  uint64_t last() {
    std::lock_guard<std::mutex> lk(mu);
    return enqueued;
  }

  int64_t delay() const {
    int64_t d = delay_us.load();
    if (d >= 0) {
      return d;
    }
    return index == 0 ? 0 : g_side_delay_us.load();
  }

  bool passed(uint64_t seq) const {
    return completed.load() >= seq;
  }

  // Block the calling thread (a worker, or the host without the GIL) until task `seq` finished.
  void wait_raw(uint64_t seq) {
    if (passed(seq)) {
      return;
    }
    std::unique_lock<std::mutex> lk(g_progress_mu);
    g_progress_cv.wait(lk, [&] { return passed(seq); });
  }

  void wait(uint64_t seq) {
    if (!passed(seq)) {
      without_gil([&] { wait_raw(seq); });
    }
  }

  Graph* capturing() {
    std::lock_guard<std::mutex> lk(mu);
    return capture;
  }

  // What the host may not do with a capturing stream (wait for it, copy through it): as on
  // CUDA, it invalidates the capture, and raises.
  void forbid_while_capturing(const char* what) {
    std::lock_guard<std::mutex> lk(mu);
    if (capture) {
      if (capture->invalid.empty()) {
        capture->invalid = what;
      }
      TORCH_CHECK(
          false, "fxrt stand-in: ", what, " is not permitted while stream ", index, " of device ",
          int(device), " is capturing a graph; the capture is invalidated");
    }
  }

  void synchronize() {
    forbid_while_capturing("synchronizing the stream");
    wait(last());
  }

  void run() {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    for (;;) {
      Task t;
      {
        std::unique_lock<std::mutex> lk(mu);
        cv.wait(lk, [&] { return !queue.empty(); });
        t = std::move(queue.front());
        queue.pop_front();
      }
      int64_t d = delay();
      if (d > 0) {
        std::this_thread::sleep_for(std::chrono::microseconds(d));
      }
      try {
        t();
      } catch (const c10::Error& e) {
        set_async_error(e.what_without_backtrace());
      } catch (const std::exception& e) {
        set_async_error(e.what());
      } catch (...) {
        set_async_error("unknown exception");
      }
      t = nullptr;  // captures die before the task counts as done
      {
        std::lock_guard<std::mutex> lk(g_progress_mu);
        completed.fetch_add(1);
      }
      g_progress_cv.notify_all();
    }
  }
};

Stream* g_streams[kDevices][kStreams];
std::atomic<unsigned> g_next_pool[kDevices];
thread_local DeviceIndex tls_device = 0;
thread_local int tls_stream[kDevices] = {0, 0};

void init_streams() {
  for (DeviceIndex d = 0; d < kDevices; ++d) {
    for (int i = 0; i < kStreams; ++i) {
      g_streams[d][i] = new Stream(d, i);  // never freed: workers outlive static destructors
    }
  }
  int64_t delay = env_int("FXRT_STANDIN_DELAY_US", 0);
  g_side_delay_us.store(delay > 0 ? delay : 0);
  pthread_atfork(nullptr, nullptr, [] { g_bad_fork.store(true); });
}

DeviceIndex check_device(DeviceIndex d) {
  TORCH_CHECK(
      d >= 0 && d < kDevices, "fxrt stand-in: invalid device index ", int(d), " (it has ",
      int(kDevices), " devices)");
  return d;
}

DeviceIndex resolve(DeviceIndex d) {
  return d < 0 ? tls_device : check_device(d);
}

Stream& stream_at(DeviceIndex d, int64_t id) {
  check_device(d);
  TORCH_CHECK(id >= 0 && id < kStreams, "fxrt stand-in: invalid stream id ", id);
  return *g_streams[d][id];
}

Stream& stream_of(const c10::Stream& s) {
  return stream_at(resolve(s.device_index()), s.id());
}

Stream& current_stream(DeviceIndex d) {
  d = resolve(d);
  return *g_streams[d][tls_stream[d]];
}

c10::Stream as_c10(const Stream& s) {
  return c10::Stream(c10::Stream::UNSAFE, c10::Device(kDev, s.device), s.index);
}

void synchronize_device(DeviceIndex d) {
  d = resolve(d);
  for (int i = 0; i < kStreams; ++i) {
    g_streams[d][i]->synchronize();
  }
}

// Wait for every stream of the device, capturing or not (before memory is returned).
void drain_device(DeviceIndex d) {
  for (int i = 0; i < kStreams; ++i) {
    g_streams[d][i]->wait(g_streams[d][i]->last());
  }
}

void synchronize_all() {
  for (DeviceIndex d = 0; d < kDevices; ++d) {
    synchronize_device(d);
  }
}

// ---- events ------------------------------------------------------------------------------------

struct Event {
  c10::EventFlag flag;
  bool in_capture = false;  // last recorded by a capturing stream (into its graph)
  Stream* stream = nullptr;  // where it was last recorded (null: never, or in a capture)
  uint64_t seq = 0;
  Graph* graph = nullptr;  // in a capture: the graph, the branch and its step count then
  int branch = -1;
  size_t steps = 0;
  std::shared_ptr<std::atomic<int64_t>> time_ns;  // stamped when the marker runs
};

// ---- allocator ---------------------------------------------------------------------------------

struct Block {
  void* ptr;
  size_t size;  // rounded
  DeviceIndex device;
  int stream;  // the allocation stream's index
  size_t requested;  // bytes asked for
  uint64_t pool;  // the graph pool it belongs to (0: the stream's)
  std::vector<Stream*> uses;  // other streams recorded by recordDataPtrOnStream
};

struct Pending {
  Block* block;
  std::vector<std::pair<Stream*, uint64_t>> marks;  // stream must pass this task
};

bool g_poison = env_int("FXRT_STANDIN_POISON", 1) != 0;
bool g_debug = env_int("FXRT_STANDIN_DEBUG", 0) != 0;

struct Pool {
  std::mutex mu;
  std::multimap<size_t, Block*> free[kStreams];
  std::vector<Pending> pending;
  std::unordered_map<void*, Block*> live;
  std::unordered_map<uint64_t, std::multimap<size_t, Block*>> privates;  // graph pools
  std::unordered_map<uint64_t, int> pool_users;  // graphs using each graph pool
  c10::CachingDeviceAllocator::DeviceStats stats;
};

Pool g_pools[kDevices];

constexpr size_t kRound = 512;

void free_block(void* ctx);

// Where a free block goes: its graph pool while that exists, else its stream's pool (mu held).
std::multimap<size_t, Block*>& home(Pool& p, Block* b) {
  if (b->pool) {
    auto it = p.privates.find(b->pool);
    if (it != p.privates.end()) {
      return it->second;
    }
    b->pool = 0;
  }
  return p.free[b->stream];
}

// Blocks whose recorded streams have passed their marks go back to their pool (mu held).
void process_pending(Pool& p) {
  auto it = p.pending.begin();
  while (it != p.pending.end()) {
    bool ready = true;
    for (auto& m : it->marks) {
      ready = ready && m.first->passed(m.second);
    }
    if (ready) {
      Block* b = it->block;
      home(p, b).emplace(b->size, b);
      it = p.pending.erase(it);
    } else {
      ++it;
    }
  }
}

c10::DataPtr allocate_on(DeviceIndex d, size_t n) {
  d = resolve(d);
  c10::Device device(kDev, d);
  if (n == 0) {
    return c10::DataPtr(nullptr, device);
  }
  int si = tls_stream[d];
  size_t size = (n + kRound - 1) / kRound * kRound;
  Graph* capture = g_streams[d][si]->capturing();
  uint64_t graph_pool = capture ? capture->pool : 0;
  Pool& p = g_pools[d];
  std::lock_guard<std::mutex> lk(p.mu);
  process_pending(p);
  Block* b = nullptr;
  auto& fl = graph_pool ? p.privates[graph_pool] : p.free[si];
  auto it = fl.lower_bound(size);
  if (it != fl.end() && it->first < 2 * size) {
    b = it->second;
    fl.erase(it);
  } else {
    void* ptr = nullptr;
    if (posix_memalign(&ptr, kRound, size) != 0 || ptr == nullptr) {
      TORCH_CHECK_WITH(
          OutOfMemoryError, false, "fxrt stand-in: out of host memory allocating ", size,
          " bytes");
    }
    if (g_poison) {
      std::memset(ptr, 0xFF, size);
    }
    b = new Block{ptr, size, d, si, n, graph_pool, {}};
    p.stats.segment[0].increase(1);
    p.stats.reserved_bytes[0].increase(size);
    p.stats.num_device_alloc += 1;
  }
  b->stream = si;
  b->requested = n;
  b->uses.clear();
  p.live[b->ptr] = b;
  p.stats.allocation[0].increase(1);
  p.stats.allocated_bytes[0].increase(b->size);
  p.stats.active[0].increase(1);
  p.stats.active_bytes[0].increase(b->size);
  p.stats.requested_bytes[0].increase(n);
  return c10::DataPtr(b->ptr, b, &free_block, device);
}

void free_block(void* ctx) {
  Block* b = static_cast<Block*>(ctx);
  Pool& p = g_pools[b->device];
  // Work enqueued on the streams that used the block must pass before it is reused; read the
  // counters before taking the pool's lock (a stream's lock is never taken under it elsewhere).
  std::vector<std::pair<Stream*, uint64_t>> marks;
  std::vector<Stream*> uses;
  {
    std::lock_guard<std::mutex> lk(p.mu);
    uses.swap(b->uses);
  }
  for (Stream* s : uses) {
    marks.emplace_back(s, s->last());
  }
  std::lock_guard<std::mutex> lk(p.mu);
  p.live.erase(b->ptr);
  p.stats.allocation[0].decrease(1);
  p.stats.allocated_bytes[0].decrease(b->size);
  p.stats.active[0].decrease(1);
  p.stats.active_bytes[0].decrease(b->size);
  p.stats.requested_bytes[0].decrease(b->requested);
  if (marks.empty()) {
    home(p, b).emplace(b->size, b);
  } else {
    p.pending.push_back(Pending{b, std::move(marks)});
  }
}

void record_stream(const c10::DataPtr& ptr, Stream& s) {
  if (ptr.get_deleter() != &free_block) {
    return;  // not ours (empty tensors have no block)
  }
  Block* b = static_cast<Block*>(ptr.get_context());
  Pool& p = g_pools[b->device];
  std::lock_guard<std::mutex> lk(p.mu);
  if (s.index == b->stream && s.device == b->device) {
    return;
  }
  for (Stream* u : b->uses) {
    if (u == &s) {
      return;
    }
  }
  b->uses.push_back(&s);
}

void empty_cache(DeviceIndex d) {
  d = resolve(d);
  synchronize_device(d);
  Pool& p = g_pools[d];
  std::lock_guard<std::mutex> lk(p.mu);
  process_pending(p);
  for (auto& fl : p.free) {
    for (auto& kv : fl) {
      Block* b = kv.second;
      p.stats.segment[0].decrease(1);
      p.stats.reserved_bytes[0].decrease(b->size);
      p.stats.num_device_free += 1;
      std::free(b->ptr);
      delete b;
    }
    fl.clear();
  }
}

void pool_use(DeviceIndex d, uint64_t id) {
  Pool& p = g_pools[d];
  std::lock_guard<std::mutex> lk(p.mu);
  p.pool_users[id] += 1;
  p.privates[id];
}

// The last graph using a pool is gone: its free blocks go back to the host once the device is
// idle (a replay may still be running); blocks still allocated go to their stream's pool when
// freed.
void pool_release(DeviceIndex d, uint64_t id) {
  Pool& p = g_pools[d];
  {
    std::lock_guard<std::mutex> lk(p.mu);
    if (--p.pool_users[id] > 0) {
      return;
    }
    p.pool_users.erase(id);
  }
  drain_device(d);
  std::lock_guard<std::mutex> lk(p.mu);
  auto it = p.privates.find(id);
  if (it == p.privates.end()) {
    return;
  }
  for (auto& kv : it->second) {
    Block* b = kv.second;
    p.stats.segment[0].decrease(1);
    p.stats.reserved_bytes[0].decrease(b->size);
    p.stats.num_device_free += 1;
    std::free(b->ptr);
    delete b;
  }
  p.privates.erase(it);
}

std::atomic<uint64_t> g_next_graph_pool{1};

void capture_begin(Graph& g, uint64_t pool) {
  TORCH_CHECK(!g.capturing && !g.captured, "fxrt stand-in: the graph was captured; reset() it first");
  Stream& s = current_stream(-1);
  TORCH_CHECK(
      s.index != 0,
      "fxrt stand-in: capturing on a default stream is not permitted (as on CUDA's legacy "
      "stream): capture on a side stream");
  TORCH_CHECK(!s.capturing(), "fxrt stand-in: the stream is already capturing a graph");
  g.device = s.device;
  g.stream = &s;
  g.pool = pool ? pool : g_next_graph_pool++;
  g.branches = std::make_shared<std::deque<Branch>>();
  g.branches->push_back(Branch{&s, {}});
  g.invalid.clear();
  pool_use(g.device, g.pool);
  g.capturing = true;
  std::lock_guard<std::mutex> lk(s.mu);
  s.capture = &g;
  s.branch = 0;
}

// Every stream recording into `g` stops (mu of each taken in turn).
void stop_recording(Graph& g) {
  for (Branch& b : *g.branches) {
    std::lock_guard<std::mutex> lk(b.stream->mu);
    if (b.stream->capture == &g) {
      b.stream->capture = nullptr;
      b.stream->branch = -1;
    }
  }
}

void graph_reset(Graph& g) {
  if (g.capturing) {
    stop_recording(g);
  }
  if (g.capturing || g.captured) {
    pool_release(g.device, g.pool);
  }
  g.capturing = g.captured = false;
  g.stream = nullptr;
  g.branches = std::make_shared<std::deque<Branch>>();
}

void capture_end(Graph& g) {
  TORCH_CHECK(g.capturing, "fxrt stand-in: capture_end() without capture_begin()");
  TORCH_CHECK(
      current_stream(g.device).index == g.stream->index,
      "fxrt stand-in: capture_end() on another stream than the one that began the capture");
  stop_recording(g);
  const std::deque<Branch>& branches = *g.branches;
  for (size_t b = 1; b < branches.size() && g.invalid.empty(); ++b) {
    bool joined = false;
    for (size_t o = 0; o < branches.size() && !joined; ++o) {
      for (const Step& st : branches[o].steps) {
        if (o != b && st.wait_branch == int(b) && st.wait_steps == branches[b].steps.size()) {
          joined = true;
          break;
        }
      }
    }
    if (!joined) {
      g.invalid = "unjoined work on stream " + std::to_string(branches[b].stream->index) +
          " (no stream of the capture waits for its last task)";
    }
  }
  g.capturing = false;
  g.captured = true;
  if (!g.invalid.empty()) {
    std::string why = g.invalid;
    graph_reset(g);
    TORCH_CHECK(false, "fxrt stand-in: the capture was invalidated (", why, " while capturing)");
  }
}

void graph_replay(Graph& g) {
  TORCH_CHECK(g.captured, "fxrt stand-in: replay() of a graph that was not captured");
  std::shared_ptr<std::deque<Branch>> branches = g.branches;
  auto progress = std::make_shared<std::vector<std::atomic<size_t>>>(branches->size());
  for (size_t b = 0; b < branches->size(); ++b) {
    Stream& on = b == 0 ? current_stream(g.device) : *(*branches)[b].stream;
    on.submit([branches, progress, b] {
      for (const Step& st : (*branches)[b].steps) {
        if (st.task) {
          try {
            st.task();
          } catch (const std::exception& e) {  // the other branches must not wait forever
            set_async_error(e.what());
          }
        } else {
          std::atomic<size_t>& other = (*progress)[static_cast<size_t>(st.wait_branch)];
          std::unique_lock<std::mutex> lk(g_progress_mu);
          g_progress_cv.wait(lk, [&] { return other.load() >= st.wait_steps; });
        }
        {
          std::lock_guard<std::mutex> lk(g_progress_mu);
          (*progress)[b].fetch_add(1);
        }
        g_progress_cv.notify_all();
      }
    });
  }
}

c10::CachingDeviceAllocator::DeviceStats get_stats(DeviceIndex d) {
  Pool& p = g_pools[resolve(d)];
  std::lock_guard<std::mutex> lk(p.mu);
  return p.stats;
}

// The allocator of one device (a storage keeps it for resizing), and the registered one, which
// allocates on the current device.
struct Allocator final : c10::DeviceAllocator {
  DeviceIndex device;  // -1: the current device
  explicit Allocator(DeviceIndex d) : device(d) {}

  c10::DataPtr allocate(size_t n) override {
    return allocate_on(device, n);
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return nullptr;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    synchronize_all();
    std::memcpy(dest, src, count);
  }
  bool initialized() override {
    return true;
  }
  void emptyCache(c10::MempoolId_t) override {
    for (DeviceIndex d = 0; d < kDevices; ++d) {
      standin::empty_cache(d);
    }
  }
  void recordStream(const c10::DataPtr& ptr, c10::Stream stream) override {
    record_stream(ptr, stream_of(stream));
  }
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(DeviceIndex d) override {
    return get_stats(d);
  }
  void resetAccumulatedStats(DeviceIndex d) override {
    Pool& p = g_pools[resolve(d)];
    std::lock_guard<std::mutex> lk(p.mu);
    auto& s = p.stats;
    for (auto* a : {&s.allocation, &s.segment, &s.active, &s.allocated_bytes, &s.reserved_bytes,
                    &s.active_bytes, &s.requested_bytes}) {
      for (auto& st : *a) {
        st.reset_accumulated();
      }
    }
    s.num_device_alloc = 0;
    s.num_device_free = 0;
  }
  void resetPeakStats(DeviceIndex d) override {
    Pool& p = g_pools[resolve(d)];
    std::lock_guard<std::mutex> lk(p.mu);
    auto& s = p.stats;
    for (auto* a : {&s.allocation, &s.segment, &s.active, &s.allocated_bytes, &s.reserved_bytes,
                    &s.active_bytes, &s.requested_bytes}) {
      for (auto& st : *a) {
        st.reset_peak();
      }
    }
  }
  std::pair<size_t, size_t> getMemoryInfo(DeviceIndex) override {
    return {size_t(1) << 34, size_t(1) << 34};
  }
};

Allocator g_allocator(-1);
Allocator g_device_allocators[kDevices] = {Allocator(0), Allocator(1)};

// ---- tensors -----------------------------------------------------------------------------------

void noop_delete(void*) {}

// A CPU tensor on the same bytes (non-owning): what a task computes on.
at::Tensor cpu_alias(const at::Tensor& t) {
  if (!t.defined()) {
    return t;
  }
  const c10::Storage& st = t.storage();
  void* base = st.data_ptr().get();
  c10::Storage cs(
      c10::Storage::use_byte_size_t(), st.nbytes(),
      c10::DataPtr(base, base, &noop_delete, c10::Device(DeviceType::CPU)), nullptr, false);
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      std::move(cs), c10::DispatchKeySet(c10::DispatchKey::CPU), t.dtype());
  impl->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  impl->_set_conj(t.is_conj());
  impl->_set_neg(t.is_neg());
  return at::Tensor(std::move(impl));
}

// A meta tensor with the same geometry, storage size and flags.
at::Tensor meta_mirror(const at::Tensor& t) {
  if (!t.defined() || (t.device().is_cpu() && t.dim() == 0)) {
    return t;  // CPU scalars stay what they are (wrapped numbers must be CPU tensors)
  }
  size_t nbytes = t.has_storage() ? t.storage().nbytes() : 0;
  c10::Storage ms(
      c10::Storage::use_byte_size_t(), nbytes, c10::DataPtr(nullptr, c10::Device(DeviceType::Meta)),
      c10::GetAllocator(DeviceType::Meta), true);
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      std::move(ms), c10::DispatchKeySet(c10::DispatchKey::Meta), t.dtype());
  impl->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  impl->_set_conj(t.is_conj());
  impl->_set_neg(t.is_neg());
  return at::Tensor(std::move(impl));
}

at::Tensor alloc_tensor(
    c10::IntArrayRef sizes,
    c10::IntArrayRef strides,
    int64_t offset,
    caffe2::TypeMeta dtype,
    DeviceIndex d) {
  size_t nbytes = at::detail::computeStorageNbytes(sizes, strides, dtype.itemsize(), offset);
  d = resolve(d);
  c10::Storage st(
      c10::Storage::use_byte_size_t(), nbytes, allocate_on(d, nbytes), &g_device_allocators[d],
      true);
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      std::move(st), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), dtype);
  impl->set_sizes_and_strides(sizes, strides, offset);
  return at::Tensor(std::move(impl));
}

// Make a storage at least `nbytes` long; its old bytes are copied in stream order.
void grow_storage(const c10::Storage& storage, size_t nbytes) {
  size_t old = storage.nbytes();
  if (nbytes <= old) {
    return;
  }
  TORCH_CHECK(storage.resizable(), "fxrt stand-in: trying to resize a storage that is not resizable");
  DeviceIndex d = storage.device().index();
  Stream& s = current_stream(d);
  c10::DataPtr fresh = allocate_on(d, nbytes);
  if (old > 0) {
    void* dst = fresh.get();
    const void* src = storage.data_ptr().get();
    record_stream(storage.data_ptr(), s);
    s.submit([dst, src, old] { std::memcpy(dst, src, old); });
  }
  auto* impl = storage.unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(std::move(fresh));
  impl->set_nbytes(nbytes);
}

void set_geometry(const at::Tensor& t, c10::IntArrayRef sizes, c10::IntArrayRef strides, int64_t off) {
  if (t.sizes() == sizes && t.strides() == strides && t.storage_offset() == off) {
    return;
  }
  size_t need = at::detail::computeStorageNbytes(sizes, strides, t.dtype().itemsize(), off);
  grow_storage(t.storage(), need);
  t.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides, off);
}

// ---- the boxed fallback ------------------------------------------------------------------------

template <class F>
IValue map_tensors(const IValue& v, F&& f) {
  if (v.isTensor()) {
    return f(v.toTensor());
  }
  if (v.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const at::Tensor& t : v.toTensorList()) {
      out.push_back(f(t));
    }
    return out;
  }
  if (v.isList()) {
    auto l = v.toList();
    c10::impl::GenericList out(l.elementType());
    for (const IValue& e : l) {
      out.push_back(map_tensors(e, f));
    }
    return out;
  }
  return v;
}

template <class F>
void each_tensor(const IValue& v, F&& f) {
  if (v.isTensor()) {
    f(v.toTensor());
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorList()) {
      f(t);
    }
  } else if (v.isList()) {
    for (const IValue& e : v.toList()) {
      each_tensor(e, f);
    }
  }
}

IValue map_device(const IValue& v, DeviceType to) {
  if (v.isDevice() && v.toDevice().type() == kDev) {
    return c10::Device(to);
  }
  return v;
}

const c10::AliasInfo* alias_of(const c10::Argument& a) {
  const c10::AliasInfo* ai = a.alias_info();
  if (ai && ai->beforeSets().empty() && !ai->containedTypes().empty()) {
    return &ai->containedTypes()[0];
  }
  return ai;
}

bool writes(const c10::Argument& a) {
  const c10::AliasInfo* ai = alias_of(a);
  return ai && ai->isWrite();
}

bool tensorish(const c10::TypePtr& t) {
  if (t->kind() == c10::TypeKind::TensorType) {
    return true;
  }
  if (t->kind() == c10::TypeKind::OptionalType || t->kind() == c10::TypeKind::ListType) {
    return tensorish(t->containedType(0));
  }
  return false;
}

// The argument a result aliases (same alias set), or -1.
int alias_arg(const c10::FunctionSchema& schema, const c10::Argument& ret) {
  const c10::AliasInfo* r = alias_of(ret);
  if (!r) {
    return -1;
  }
  const auto& args = schema.arguments();
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::AliasInfo* a = alias_of(args[i]);
    if (a && a->beforeSets() == r->beforeSets()) {
      return static_cast<int>(i);
    }
  }
  return -1;
}

at::Tensor make_view(const at::Tensor& base, const at::Tensor& like) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      c10::TensorImpl::VIEW, c10::Storage(base.storage()), base.key_set(), like.dtype());
  impl->set_sizes_and_strides(like.sizes(), like.strides(), like.storage_offset());
  impl->_set_conj(like.is_conj());
  impl->_set_neg(like.is_neg());
  return at::Tensor(std::move(impl));
}

bool mixed_cpu_allowed(const std::string& name) {
  return name == "aten::index" || name == "aten::index_put_" || name == "aten::index_put" ||
      name == "aten::_index_put_impl_";
}

// The device an op runs on: its stand-in tensors' (which must agree), else a Device argument's,
// else the current device. Also rejects CPU tensors of rank > 0 among the arguments, as CUDA's
// kernels do (CPU scalars are fine).
DeviceIndex op_device(const c10::OperatorHandle& op, const std::vector<IValue>& in) {
  DeviceIndex dev = -1;
  bool big_cpu = false;
  for (const IValue& v : in) {
    each_tensor(v, [&](const at::Tensor& t) {
      if (!t.defined()) {
        return;
      }
      if (t.device().type() == kDev) {
        DeviceIndex d = t.device().index();
        TORCH_CHECK(
            dev < 0 || dev == d,
            "Expected all tensors to be on the same device, but found at least two devices, ",
            c10::Device(kDev, dev), " and ", t.device(), "! (in ", op.schema().name(), ")");
        dev = d;
      } else if (t.device().is_cpu() && t.dim() > 0) {
        big_cpu = true;
      }
    });
  }
  if (dev >= 0) {
    TORCH_CHECK(
        !big_cpu || mixed_cpu_allowed(op.schema().name()),
        "Expected all tensors to be on the same device, but found at least two devices, cpu and ",
        c10::Device(kDev, dev), "! (in ", op.schema().name(), ")");
    return dev;
  }
  for (const IValue& v : in) {
    if (v.isDevice() && v.toDevice().type() == kDev) {
      return resolve(v.toDevice().index());
    }
  }
  return tls_device;
}

void copy_result(const IValue& dst, const IValue& src) {
  if (dst.isTensor() && src.isTensor()) {
    const at::Tensor& d = dst.toTensor();
    const at::Tensor& s = src.toTensor();
    if (d.defined() && s.defined() && !d.is_same(s)) {
      if (s.numel() == 0 && d.numel() != 0) {
        return;  // an output the CPU kernel leaves empty where Meta sizes it (save_mean...)
      }
      d.copy_(s);
    }
    return;
  }
  if (dst.isTensorList() && src.isTensorList()) {
    auto dl = dst.toTensorList();
    auto sl = src.toTensorList();
    TORCH_CHECK(dl.size() == sl.size(), "fxrt stand-in: result list length differs from meta's");
    for (size_t i = 0; i < dl.size(); ++i) {
      copy_result(IValue(dl.get(i)), IValue(sl.get(i)));
    }
    return;
  }
  if (dst.isList() && src.isList()) {
    auto dl = dst.toList();
    auto sl = src.toList();
    for (size_t i = 0; i < dl.size() && i < sl.size(); ++i) {
      copy_result(dl.get(i), sl.get(i));
    }
  }
}

// Run on the host after the current stream finished: for results the host reads (Scalars,
// data-dependent shapes) and ops without a Meta kernel.
void run_synchronously(
    const c10::OperatorHandle& op,
    Stack* stack,
    std::vector<IValue>& in,
    DeviceIndex dev) {
  const auto& schema = op.schema();
  current_stream(dev).synchronize();
  check_async_error();
  std::vector<at::Tensor> dev_args, cpu_args;
  Stack cpu_stack;
  for (const IValue& v : in) {
    cpu_stack.push_back(map_device(
        map_tensors(
            v,
            [&](const at::Tensor& t) {
              if (!t.defined() || t.device().type() != kDev) {
                return t;
              }
              at::Tensor a = cpu_alias(t);
              dev_args.push_back(t);
              cpu_args.push_back(a);
              return a;
            }),
        DeviceType::CPU));
  }
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    op.callBoxed(cpu_stack);
  }
  const auto& rets = schema.returns();
  for (size_t r = 0; r < rets.size(); ++r) {
    int a = alias_arg(schema, rets[r]);
    if (a >= 0 && writes(rets[r])) {
      stack->push_back(in[a]);
      continue;
    }
    stack->push_back(map_tensors(cpu_stack[r], [&](const at::Tensor& t) -> at::Tensor {
      if (!t.defined() || !t.device().is_cpu()) {
        return t;
      }
      for (size_t i = 0; i < cpu_args.size(); ++i) {
        if (t.storage().unsafeGetStorageImpl() == cpu_args[i].storage().unsafeGetStorageImpl()) {
          return make_view(dev_args[i], t);  // a view of an argument
        }
      }
      at::Tensor out = alloc_tensor(t.sizes(), t.strides(), 0, t.dtype(), dev);
      at::Tensor alias = cpu_alias(out);
      {
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        alias.copy_(t);
      }
      return out;
    }));
  }
}

void fallback(const c10::OperatorHandle& op, Stack* stack) {
  const auto& schema = op.schema();
  const auto& args = schema.arguments();
  const auto& rets = schema.returns();
  std::vector<IValue> in(stack->end() - args.size(), stack->end());
  torch::jit::drop(*stack, args.size());
  DeviceIndex dev = op_device(op, in);

  bool host_results = false;
  for (const auto& r : rets) {
    host_results = host_results || !tensorish(r.type());
  }
  // Metadata of the results from the Meta kernel, on mirrors of the arguments.
  std::vector<IValue> meta_in;
  Stack meta_stack;
  bool have_meta = false;
  if (!host_results) {
    for (const IValue& v : in) {
      meta_in.push_back(map_device(map_tensors(v, meta_mirror), DeviceType::Meta));
    }
    meta_stack = meta_in;
    try {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      op.callBoxed(meta_stack);
      have_meta = true;
    } catch (const std::exception& e) {
      have_meta = false;  // no Meta kernel, or data-dependent shapes: the host runs it
      if (g_debug) {
        std::fprintf(stderr, "fxrt stand-in: %s runs on the host: %s\n", schema.name().c_str(),
                     e.what());
      }
    }
  }
  if (!have_meta) {
    run_synchronously(op, stack, in, dev);
    return;
  }

  Stream& s = current_stream(dev);
  // out= arguments the Meta kernel resized: resize the device tensors now, in program order.
  for (size_t i = 0; i < args.size(); ++i) {
    if (!writes(args[i])) {
      continue;
    }
    std::vector<at::Tensor> real, meta;
    each_tensor(in[i], [&](const at::Tensor& t) { real.push_back(t); });
    each_tensor(meta_in[i], [&](const at::Tensor& t) { meta.push_back(t); });
    for (size_t k = 0; k < real.size() && k < meta.size(); ++k) {
      if (!real[k].defined()) {
        continue;
      }
      TORCH_CHECK(
          real[k].device().type() == kDev, "fxrt stand-in: ", schema.name(),
          " writes a tensor on ", real[k].device(), ", expected ", c10::Device(kDev, dev));
      set_geometry(real[k], meta[k].sizes(), meta[k].strides(), meta[k].storage_offset());
    }
  }

  bool task = rets.empty();
  std::vector<IValue> outs(rets.size()), fresh(rets.size());
  std::vector<bool> is_fresh(rets.size(), false);
  for (size_t r = 0; r < rets.size(); ++r) {
    int a = alias_arg(schema, rets[r]);
    if (a >= 0 && writes(rets[r])) {
      outs[r] = in[a];
      task = true;
    } else if (a >= 0 && in[a].isTensor() && meta_stack[r].isTensor() &&
               meta_stack[r].toTensor().defined() &&
               meta_stack[r].toTensor().storage().unsafeGetStorageImpl() ==
                   meta_in[a].toTensor().storage().unsafeGetStorageImpl()) {
      outs[r] = make_view(in[a].toTensor(), meta_stack[r].toTensor());
    } else if (a >= 0 && in[a].isTensor() && meta_stack[r].isTensorList()) {
      const at::Tensor& base = in[a].toTensor();
      outs[r] = map_tensors(meta_stack[r], [&](const at::Tensor& m) { return make_view(base, m); });
    } else {
      outs[r] = map_tensors(meta_stack[r], [&](const at::Tensor& m) -> at::Tensor {
        if (!m.defined()) {
          return m;
        }
        return alloc_tensor(m.sizes(), m.strides(), m.storage_offset(), m.dtype(), dev);
      });
      fresh[r] = map_tensors(outs[r], cpu_alias);
      is_fresh[r] = true;
      task = true;
    }
  }
  for (size_t i = 0; i < args.size() && !task; ++i) {
    task = writes(args[i]);
  }
  if (task) {
    // Arguments as the worker sees them: stand-in tensors as CPU aliases of their memory, CPU
    // tensors as copies taken now (the host may change them before the task runs).
    std::vector<IValue> cpu_in;
    cpu_in.reserve(in.size());
    for (const IValue& v : in) {
      cpu_in.push_back(map_device(
          map_tensors(
              v,
              [](const at::Tensor& t) -> at::Tensor {
                if (!t.defined()) {
                  return t;
                }
                if (t.device().type() == kDev) {
                  return cpu_alias(t);
                }
                if (t.device().is_cpu()) {
                  at::Tensor c;
                  {
                    at::AutoDispatchBelowADInplaceOrView below_autograd;
                    c = t.clone();
                  }
                  if (t.unsafeGetTensorImpl()->is_wrapped_number()) {
                    c.unsafeGetTensorImpl()->set_wrapped_number(true);
                  }
                  return c;
                }
                return t;
              }),
          DeviceType::CPU));
    }
    s.submit([op, cpu_in = std::move(cpu_in), fresh = std::move(fresh),
              is_fresh = std::move(is_fresh)]() mutable {
      Stack st(cpu_in.begin(), cpu_in.end());  // a replayed graph runs it again
      op.callBoxed(st);
      for (size_t r = 0; r < is_fresh.size(); ++r) {
        if (is_fresh[r]) {
          copy_result(fresh[r], st[r]);
        }
      }
    });
  }
  for (auto& o : outs) {
    stack->push_back(std::move(o));
  }
}

// ---- kernels of its own ------------------------------------------------------------------------

at::Tensor empty_memory_format(
    c10::IntArrayRef size,
    std::optional<c10::ScalarType> dtype,
    std::optional<c10::Layout> layout,
    std::optional<c10::Device> device,
    std::optional<bool> pin_memory,
    std::optional<c10::MemoryFormat> memory_format) {
  TORCH_CHECK(!pin_memory.value_or(false), "fxrt stand-in: device memory cannot be pinned");
  DeviceIndex d = resolve(device ? device->index() : -1);
  return at::detail::empty_generic(
      size, &g_device_allocators[d], c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
      c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(
    c10::IntArrayRef size,
    c10::IntArrayRef stride,
    std::optional<c10::ScalarType> dtype,
    std::optional<c10::Layout> layout,
    std::optional<c10::Device> device,
    std::optional<bool> pin_memory) {
  TORCH_CHECK(!pin_memory.value_or(false), "fxrt stand-in: device memory cannot be pinned");
  DeviceIndex d = resolve(device ? device->index() : -1);
  return at::detail::empty_strided_generic(
      size, stride, &g_device_allocators[d], c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
      c10::dtype_or_default(dtype));
}

// Copies. Host <-> device: on the device's current stream, and the host waits for it.
at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  at::Tensor src = self;
  bool src_dev = src.device().type() == kDev, dst_dev = dst.device().type() == kDev;
  if (src_dev && dst_dev) {
    DeviceIndex ds = src.device().index(), dd = dst.device().index();
    at::Tensor a = cpu_alias(src), b = cpu_alias(dst);
    Stream& sd = current_stream(dd);
    if (ds != dd) {  // order the copy after the source device's work, and its frees after it
      Stream& ss = current_stream(ds);
      ss.forbid_while_capturing("copying between devices");
      sd.forbid_while_capturing("copying between devices");
      uint64_t mark = ss.last();
      sd.submit([&ss, mark] { ss.wait_raw(mark); });
      sd.submit([a, b]() mutable { b.copy_(a); });
      uint64_t done = sd.last();
      ss.submit([&sd, done] { sd.wait_raw(done); });
    } else {
      sd.submit([a, b]() mutable { b.copy_(a); });
    }
    return dst;
  }
  TORCH_CHECK(
      (src_dev && dst.device().is_cpu()) || (src.device().is_cpu() && dst_dev),
      "fxrt stand-in: cannot copy from ", src.device(), " to ", dst.device());
  Stream& s = current_stream(src_dev ? src.device().index() : dst.device().index());
  s.forbid_while_capturing("copying between the host and the device");
  at::Tensor a = src_dev ? cpu_alias(src) : src;
  at::Tensor b = dst_dev ? cpu_alias(dst) : dst;
  uint64_t seq = s.submit([a, b]() mutable { b.copy_(a); });
  s.wait(seq);
  check_async_error();
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  if (dst.device().type() == kDev) {
    auto strides = c10::contiguous_strides(self.sizes());
    set_geometry(dst, self.sizes(), c10::IntArrayRef(strides), dst.storage_offset());
  } else {
    dst.resize_(self.sizes());
  }
  return copy_from(self, dst, false);
}

const at::Tensor& resize_(
    const at::Tensor& self,
    c10::SymIntArrayRef size,
    std::optional<c10::MemoryFormat> memory_format) {
  auto sizes = C10_AS_INTARRAYREF_SLOW(size);
  auto fmt = memory_format.value_or(c10::MemoryFormat::Contiguous);
  std::vector<int64_t> strides;
  if (fmt == c10::MemoryFormat::ChannelsLast && sizes.size() == 4) {
    strides = c10::get_channels_last_strides_2d(sizes);
  } else if (fmt == c10::MemoryFormat::ChannelsLast3d && sizes.size() == 5) {
    strides = c10::get_channels_last_strides_3d(sizes);
  } else {
    auto c = c10::contiguous_strides(sizes);
    strides.assign(c.begin(), c.end());
  }
  set_geometry(self, sizes, strides, self.storage_offset());
  return self;
}

at::Tensor& set_storage(
    at::Tensor& self,
    c10::Storage source,
    int64_t offset,
    c10::IntArrayRef size,
    c10::IntArrayRef stride) {
  TORCH_CHECK(
      !source.data_ptr().get() || source.device().type() == kDev,
      "fxrt stand-in: set_ with a storage on ", source.device());
  size_t need = at::detail::computeStorageNbytes(size, stride, self.dtype().itemsize(), offset);
  grow_storage(source, need);
  self.unsafeGetTensorImpl()->set_storage_keep_dtype(std::move(source));
  self.unsafeGetTensorImpl()->set_sizes_and_strides(size, stride, offset);
  return self;
}

at::Tensor& set_source_storage_offset(
    at::Tensor& self,
    c10::Storage source,
    c10::SymInt offset,
    c10::SymIntArrayRef size,
    c10::SymIntArrayRef stride) {
  return set_storage(
      self, std::move(source), offset.expect_int(), C10_AS_INTARRAYREF_SLOW(size),
      C10_AS_INTARRAYREF_SLOW(stride));
}

at::Tensor& set_source_storage(at::Tensor& self, c10::Storage source) {
  int64_t n = static_cast<int64_t>(source.nbytes() / self.dtype().itemsize());
  return set_storage(self, std::move(source), 0, {n}, {1});
}

at::Tensor& set_source_tensor(at::Tensor& self, const at::Tensor& src) {
  if (self.is_same(src)) {
    return self;
  }
  return set_storage(self, src.storage(), src.storage_offset(), src.sizes(), src.strides());
}

at::Tensor& set_empty(at::Tensor& self) {
  DeviceIndex d = self.device().index();
  c10::Storage st(
      c10::Storage::use_byte_size_t(), 0, allocate_on(d, 0), &g_device_allocators[d], true);
  return set_storage(self, std::move(st), 0, {0}, {1});
}

void record_stream_op(at::Tensor& self, c10::Stream s) {
  record_stream(self.storage().data_ptr(), stream_of(s));
}

// ---- device guard, hooks -----------------------------------------------------------------------

void set_device(DeviceIndex d) {
  tls_device = check_device(d);
}

struct GuardImpl final : c10::impl::DeviceGuardImplInterface {
  DeviceType type() const override {
    return kDev;
  }
  c10::Device exchangeDevice(c10::Device d) const override {
    DeviceIndex old = tls_device;
    if (d.index() >= 0) {
      set_device(d.index());
    }
    return c10::Device(kDev, old);
  }
  c10::Device getDevice() const override {
    return c10::Device(kDev, tls_device);
  }
  void setDevice(c10::Device d) const override {
    if (d.index() >= 0) {
      set_device(d.index());
    }
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0 && d.index() < kDevices) {
      tls_device = d.index();
    }
  }
  c10::Stream getStream(c10::Device d) const override {
    return as_c10(current_stream(d.index()));
  }
  c10::Stream getDefaultStream(c10::Device d) const override {
    return as_c10(stream_at(resolve(d.index()), 0));
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override {
    DeviceIndex i = resolve(d.index());
    return as_c10(stream_at(i, 1 + int(g_next_pool[i]++ % kPool)));
  }
  c10::Stream getNewStream(c10::Device d, int) const override {
    return getStreamFromGlobalPool(d, false);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    Stream& st = stream_of(s);
    Stream& old = current_stream(st.device);
    tls_stream[st.device] = st.index;
    return as_c10(old);
  }
  void destroyEvent(void* event, const DeviceIndex) const noexcept override {
    delete static_cast<Event*>(event);
  }
  void record(void** event, const c10::Stream& stream, const DeviceIndex, const c10::EventFlag flag)
      const override {
    Event* e = static_cast<Event*>(*event);
    if (!e) {
      e = new Event{flag};
      *event = e;
    }
    Stream& s = stream_of(stream);
    auto stamp = std::make_shared<std::atomic<int64_t>>(-1);
    e->time_ns = stamp;
    Graph* g = nullptr;
    int branch = -1;
    {
      std::lock_guard<std::mutex> lk(s.mu);
      g = s.capture;
      branch = s.branch;
    }
    e->in_capture = g != nullptr;
    e->stream = e->in_capture ? nullptr : &s;
    e->seq = s.submit([stamp] { stamp->store(now_ns()); });
    e->graph = g;
    e->branch = branch;
    e->steps = g ? (*g->branches)[static_cast<size_t>(branch)].steps.size() : 0;
  }
  void block(void* event, const c10::Stream& stream) const override {
    Event* e = static_cast<Event*>(event);
    Stream& s = stream_of(stream);
    if (e && e->in_capture) {  // a fork (the stream joins the capture) or a wait inside it
      Graph* g = e->graph;
      std::lock_guard<std::mutex> lk(s.mu);
      if (s.capture == nullptr) {
        TORCH_CHECK(
            g->capturing,
            "fxrt stand-in: waiting for an event recorded in a capture that has ended");
        TORCH_CHECK(s.device == g->device, "fxrt stand-in: a capture spans one device");
        g->branches->push_back(Branch{&s, {}});
        s.capture = g;
        s.branch = int(g->branches->size()) - 1;
      }
      TORCH_CHECK(
          s.capture == g, "fxrt stand-in: waiting for an event of another graph's capture");
      if (s.branch != e->branch) {
        (*g->branches)[static_cast<size_t>(s.branch)].steps.push_back(
            Step{Task(), e->branch, e->steps});
      }
      return;
    }
    if (!e || !e->stream) {
      return;
    }
    if (s.capturing()) {
      s.forbid_while_capturing("waiting for an event recorded outside the capture");
    }
    Stream* src = e->stream;
    uint64_t seq = e->seq;
    if (src == &s) {
      return;
    }
    s.submit([src, seq] { src->wait_raw(seq); });
  }
  bool queryEvent(void* event) const override {
    Event* e = static_cast<Event*>(event);
    return !e || !e->stream || e->stream->passed(e->seq);
  }
  DeviceIndex deviceCount() const noexcept override {
    return kDevices;
  }
  bool queryStream(const c10::Stream& stream) const override {
    Stream& s = stream_of(stream);
    return s.passed(s.last());
  }
  void synchronizeStream(const c10::Stream& stream) const override {
    stream_of(stream).synchronize();
    check_async_error();
  }
  void synchronizeEvent(void* event) const override {
    Event* e = static_cast<Event*>(event);
    if (e && e->stream) {
      e->stream->wait(e->seq);
    }
    check_async_error();
  }
  void synchronizeDevice(const DeviceIndex d) const override {
    synchronize_device(d);
    check_async_error();
  }
  void recordDataPtrOnStream(const c10::DataPtr& ptr, const c10::Stream& stream) const override {
    record_stream(ptr, stream_of(stream));
  }
  double elapsedTime(void* a, void* b, const DeviceIndex) const override {
    Event* e1 = static_cast<Event*>(a);
    Event* e2 = static_cast<Event*>(b);
    TORCH_CHECK(
        e1 && e2 && e1->stream && e2->stream,
        "fxrt stand-in: both events must be recorded before calculating elapsed time");
    TORCH_CHECK(
        e1->flag == c10::EventFlag::BACKEND_DEFAULT && e2->flag == c10::EventFlag::BACKEND_DEFAULT,
        "fxrt stand-in: both events must be created with enable_timing=True to measure time");
    TORCH_CHECK(
        e1->stream->passed(e1->seq) && e2->stream->passed(e2->seq),
        "fxrt stand-in: both events must have completed before calculating elapsed time");
    return double(e2->time_ns->load() - e1->time_ns->load()) / 1e6;
  }
};

struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override {
    return true;
  }
  bool isAvailable() const override {
    return true;
  }
  bool hasPrimaryContext(DeviceIndex) const override {
    return true;
  }
  void init() const override {}
  DeviceIndex deviceCount() const override {
    return kDevices;
  }
  void setCurrentDevice(DeviceIndex d) const override {
    set_device(d);
  }
  DeviceIndex getCurrentDevice() const override {
    return tls_device;
  }
  DeviceIndex exchangeDevice(DeviceIndex d) const override {
    DeviceIndex old = tls_device;
    if (d >= 0) {
      set_device(d);
    }
    return old;
  }
  DeviceIndex maybeExchangeDevice(DeviceIndex d) const override {
    return exchangeDevice(d);
  }
  at::Device getDeviceFromPtr(void* data) const override {
    for (DeviceIndex d = 0; d < kDevices; ++d) {
      Pool& p = g_pools[d];
      std::lock_guard<std::mutex> lk(p.mu);
      for (auto& kv : p.live) {
        char* base = static_cast<char*>(kv.first);
        if (data >= base && data < base + kv.second->size) {
          return at::Device(kDev, d);
        }
      }
    }
    TORCH_CHECK(false, "fxrt stand-in: pointer is not stand-in memory");
  }
  bool isPinnedPtr(const void*) const override {
    return false;
  }
  c10::Allocator* getPinnedMemoryAllocator() const override {
    return c10::GetCPUAllocator();
  }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    grow_storage(storage, newsize);
    storage.unsafeGetStorageImpl()->set_nbytes(newsize);
  }
};

const bool g_registered = [] {
  init_streams();
  at::RegisterPrivateUse1HooksInterface(new Hooks());
  c10::SetAllocator(kDev, &g_allocator);
  return true;
}();

C10_REGISTER_GUARD_IMPL(PrivateUse1, GuardImpl);

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("resize_", resize_);
  m.impl("set_.source_Storage_storage_offset", set_source_storage_offset);
  m.impl("set_.source_Storage", set_source_storage);
  m.impl("set_.source_Tensor", set_source_tensor);
  m.impl("set_", set_empty);
  m.impl("record_stream", record_stream_op);
  // Composite kernels that would pick a backend-specific kernel (convolution_overrideable) for
  // an unknown device: run the CPU composite on aliases through the fallback instead.
  m.impl("convolution", torch::CppFunction::makeFromBoxedFunction<&fallback>());
  m.impl("convolution_backward", torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

// ATen ops with a CPU kernel and a composite one run their CPU kernel here, through the
// fallback, as they do on the CPU: the composite (a math version, e.g. native_layer_norm's) gives
// other bits, and a device has kernels of its own for such ops anyway.
void route_cpu_kernels() {
  static auto* lib = new torch::Library(
      torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) {
      continue;
    }
    auto op = dispatcher.findOp(name);
    if (!op || !op->hasKernelForDispatchKey(c10::DispatchKey::CPU) ||
        op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1) ||
        !(op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) ||
          op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional))) {
      continue;
    }
    std::string qual = name.name.substr(6);
    if (!name.overload_name.empty()) {
      qual += "." + name.overload_name;
    }
    lib->impl(qual.c_str(), torch::CppFunction::makeFromBoxedFunction<&fallback>());
  }
}

// ---- Python ------------------------------------------------------------------------------------

namespace py = pybind11;

template <class F>
auto translated(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const c10::Error& e) {
    throw std::runtime_error(e.what_without_backtrace());
  }
}

py::dict stat_dict(const c10::CachingAllocator::Stat& s) {
  py::dict d;
  d["current"] = s.current;
  d["peak"] = s.peak;
  d["allocated"] = s.allocated;
  d["freed"] = s.freed;
  return d;
}

}  // namespace standin

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace standin;
  route_cpu_kernels();
  m.attr("DEVICE_COUNT") = int(kDevices);
  m.attr("POOL_STREAMS") = kPool;
  m.def("current_device", [] { return int(tls_device); });
  m.def("set_device", [](int d) { translated([&] { set_device(DeviceIndex(d)); }); });
  m.def("exchange_device", [](int d) {
    int old = tls_device;
    if (d >= 0) {
      translated([&] { set_device(DeviceIndex(d)); });
    }
    return old;
  });
  m.def("synchronize", [](int d) {
    translated([&] {
      synchronize_device(DeviceIndex(d));
      check_async_error();
    });
  });
  m.def("synchronize_all", [] {
    translated([&] {
      synchronize_all();
      check_async_error();
    });
  });
  m.def("check_error", [] { translated([] { check_async_error(); }); });
  m.def("stream_tasks", [](int d, int64_t id) {
    return translated([&] {
      Stream& s = stream_at(DeviceIndex(d), id);
      uint64_t last = s.last();
      return py::make_tuple(last, s.completed.load());
    });
  });
  m.def("set_delay_us", [](int64_t us, int d, int64_t id) {
    translated([&] {
      if (d < 0) {
        g_side_delay_us.store(us < 0 ? 0 : us);
      } else {
        stream_at(DeviceIndex(d), id).delay_us.store(us);
      }
    });
  });
  m.def("get_delay_us", [](int d, int64_t id) {
    return translated([&]() -> int64_t {
      if (d < 0) {
        return g_side_delay_us.load();
      }
      return stream_at(DeviceIndex(d), id).delay();
    });
  });
  m.def("set_poison", [](bool on) { g_poison = on; });
  m.def("in_bad_fork", [] { return g_bad_fork.load(); });
  m.def("empty_cache", [](int d) { translated([&] { empty_cache(DeviceIndex(d)); }); });
  m.def("reset_peak", [](int d) { translated([&] { g_allocator.resetPeakStats(DeviceIndex(d)); }); });
  m.def("reset_accumulated", [](int d) {
    translated([&] { g_allocator.resetAccumulatedStats(DeviceIndex(d)); });
  });
  m.def("memory_stats", [](int d) {
    auto s = translated([&] { return get_stats(DeviceIndex(d)); });
    py::dict out;
    out["allocation"] = stat_dict(s.allocation[0]);
    out["allocated_bytes"] = stat_dict(s.allocated_bytes[0]);
    out["requested_bytes"] = stat_dict(s.requested_bytes[0]);
    out["active"] = stat_dict(s.active[0]);
    out["active_bytes"] = stat_dict(s.active_bytes[0]);
    out["segment"] = stat_dict(s.segment[0]);
    out["reserved_bytes"] = stat_dict(s.reserved_bytes[0]);
    out["num_device_alloc"] = s.num_device_alloc;
    out["num_device_free"] = s.num_device_free;
    return out;
  });
  // Graphs, by handle.
  static std::mutex graphs_mu;
  static std::unordered_map<int64_t, std::shared_ptr<Graph>> graphs;
  static int64_t next_graph = 1;
  auto graph = [](int64_t h) {
    std::lock_guard<std::mutex> lk(graphs_mu);
    auto it = graphs.find(h);
    TORCH_CHECK(it != graphs.end(), "fxrt stand-in: no graph ", h);
    return it->second;
  };
  m.def("graph_create", [] {
    std::lock_guard<std::mutex> lk(graphs_mu);
    graphs[next_graph] = std::make_shared<Graph>();
    return next_graph++;
  });
  m.def("graph_destroy", [graph](int64_t h) {
    translated([&] {
      std::shared_ptr<Graph> g;
      {
        std::lock_guard<std::mutex> lk(graphs_mu);
        auto it = graphs.find(h);
        if (it == graphs.end()) {
          return;
        }
        g = it->second;
        graphs.erase(it);
      }
      graph_reset(*g);
    });
  });
  m.def("capture_begin", [graph](int64_t h, uint64_t pool) {
    translated([&] { capture_begin(*graph(h), pool); });
  });
  m.def("capture_end", [graph](int64_t h) { translated([&] { capture_end(*graph(h)); }); });
  m.def("graph_replay", [graph](int64_t h) { translated([&] { graph_replay(*graph(h)); }); });
  m.def("graph_reset", [graph](int64_t h) { translated([&] { graph_reset(*graph(h)); }); });
  m.def("graph_pool", [graph](int64_t h) { return translated([&] { return graph(h)->pool; }); });
  m.def("graph_tasks", [graph](int64_t h) {
    return translated([&] { return graph(h)->num_tasks(); });
  });
  m.def("graph_pool_handle", [] { return g_next_graph_pool++; });
  m.def("is_capturing", [](int d, int64_t id) {
    return translated([&] { return stream_at(DeviceIndex(d), id).capturing() != nullptr; });
  });
  m.def("pending_frees", [](int d) {
    return translated([&] {
      Pool& p = g_pools[check_device(DeviceIndex(d))];
      std::lock_guard<std::mutex> lk(p.mu);
      process_pending(p);
      return p.pending.size();
    });
  });
}
