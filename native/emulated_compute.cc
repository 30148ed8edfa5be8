// Emulated accelerator kernels.
//
// TfOverlapEmulatedCompute stands in for a heavy compute op. It takes the original op's
// inputs (so every dependency stays), gives outputs of the original dtypes and static
// shapes, and occupies an emulated stream (a device name plus the `stream` attr) for
// `duration_us`: kernels on one stream run one at a time in the order they were issued,
// as on one CUDA stream. A kernel issued at t starts at the latest of t, the end of its
// stream's previous kernel, and the ends of the kernels named in `after`: the emulated
// kernels on other streams whose outputs it reads, which a CUDA kernel waits for through
// an event, so dependent kernels never overlap.
//
// With `pool` > 0 it instead takes whichever of the device's `pool` slots frees first: the
// inter-op threads of a CPU executor, which run any ready op on any idle thread. Pools of
// different sizes are different pools, so that none loses a busy slot.
//
// When the executor sees it complete depends on `blocking`:
// - false (the default, a GPU's semantics): at once, as TensorFlow's GPU executor treats a
//   launched kernel, so the host runs ahead issuing more kernels while the stream works.
//   Where a result leaves the stream (a host op, a transfer, a collective consumes it),
//   the rewrite puts a TfOverlapStreamWait, which forwards its inputs once the kernels
//   that produced them have ended: a device-to-host copy waiting on its stream event.
// - true: when the kernel ends (a CPU's semantics: the executor waits for every op). The
//   timer thread calls `done` itself: the executor only propagates outputs and hands the
//   ready ops to its threads, and a second hand-over would add tens of µs to every op.
//
// Steps: kernel ends are recorded by step (OpKernelContext::step_id), device and node, so
// a stream wait or an `after` sees the kernels of its own step only, never those of
// another session or graph with the same node names. Streams and pools belong to the
// device and are shared by all steps; each of their slots keeps the last end of each step
// on it. An end that has passed is forgotten (it means what no end means: nothing to
// wait for), so memory stays bounded however many steps run.
//
// Cancellation: a blocking kernel or a stream wait that waits for the timer registers with
// its step's cancellation manager. If the step is cancelled first (a RunOptions timeout,
// an error elsewhere), it completes at once with Cancelled, and the step's kernels leave
// every stream and pool, so that an aborted step delays no later one. A kernel of a step
// already cancelled is not issued.
//
// Waiting takes no thread and no CPU: one timer thread per process sleeps until the
// earliest pending end, then completes a blocking kernel itself and hands a stream wait's
// `done` callback to the device's worker threads.
//
// Outputs: views of one zero buffer per dtype and process, as large as the largest output
// asked for (it grows when a larger one is). Each kernel takes its views once and returns
// them every step: no allocation and no memset per step, and memory for one output, not
// for all of them (a model's activations would not fit 8 emulated workers in host memory).
// The pool holds a reference to the buffer, so no consumer ever writes into it in place.
#include <sys/prctl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tensorflow/core/framework/cancellation.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/platform/threadpool.h"

namespace tfoverlap {
namespace {

using ::tensorflow::AsyncOpKernel;
using ::tensorflow::DataType;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::PartialTensorShape;
using ::tensorflow::Status;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
using Clock = std::chrono::steady_clock;

REGISTER_OP("TfOverlapEmulatedCompute")
    .Input("inputs: Tin")
    .Output("outputs: Tout")
    .Attr("Tin: list(type) >= 0")
    .Attr("Tout: list(type) >= 0")
    .Attr("output_shapes: list(shape) >= 0")
    .Attr("duration_us: float")
    .Attr("stream: int = 0")
    .Attr("blocking: bool = false")
    .Attr("pool: int = 0")
    .Attr("original_op: string = ''")
    .Attr("after: list(string) = []")
    // Stateful: Grappler must neither fold, deduplicate nor prune it as a pure function.
    .SetIsStateful()
    .SetShapeFn([](::tensorflow::shape_inference::InferenceContext* context) {
      std::vector<PartialTensorShape> shapes;
      TF_RETURN_IF_ERROR(context->GetAttr("output_shapes", &shapes));
      if (static_cast<int>(shapes.size()) != context->num_outputs()) {
        return ::tensorflow::errors::InvalidArgument(
            "TfOverlapEmulatedCompute: ", shapes.size(), " output_shapes for ",
            context->num_outputs(), " outputs");
      }
      for (int i = 0; i < context->num_outputs(); ++i) {
        ::tensorflow::shape_inference::ShapeHandle shape;
        TF_RETURN_IF_ERROR(context->MakeShapeFromPartialTensorShape(shapes[i], &shape));
        context->set_output(i, shape);
      }
      return ::tensorflow::OkStatus();
    })
    .Doc("Emulates a compute op of an accelerator: zeros of the given dtypes and shapes, "
         "taking duration_us of its stream, one kernel at a time per (device, stream), in "
         "issue order, and not before the kernels named in after (of its step, on this "
         "device) have ended; complete at launch unless blocking.");

REGISTER_OP("TfOverlapStreamWait")
    .Input("inputs: T")
    .Output("outputs: T")
    .Attr("T: list(type) >= 1")
    .Attr("producers: list(string) >= 1")
    .SetIsStateful()
    .SetShapeFn([](::tensorflow::shape_inference::InferenceContext* context) {
      for (int i = 0; i < context->num_inputs(); ++i) {
        context->set_output(i, context->input(i));
      }
      return ::tensorflow::OkStatus();
    })
    .Doc("Forwards its inputs once the emulated kernels named in producers (of its step, "
         "on this device) have ended on their streams.");

using StepId = int64_t;

// One slot of an emulated stream or pool: when each step's last kernel on it ends, so that
// a cancelled step's kernels can leave it.
class Slot {
 public:
  // When the slot is free; forgets the steps whose kernels on it have ended by `now`.
  Clock::time_point FreeAt(Clock::time_point now) {
    Clock::time_point free_at = now;
    for (auto step = last_ends_.begin(); step != last_ends_.end();) {
      if (step->second <= now) {
        step = last_ends_.erase(step);
      } else {
        free_at = std::max(free_at, step->second);
        ++step;
      }
    }
    return free_at;
  }

  void Occupy(StepId step, Clock::time_point end) { last_ends_[step] = end; }

  void Release(StepId step) { last_ends_.erase(step); }

 private:
  std::unordered_map<StepId, Clock::time_point> last_ends_;
};

// A kernel's run in one step.
struct StepKernel {
  StepId step;
  int64_t kernel;

  bool operator==(const StepKernel& other) const {
    return step == other.step && kernel == other.kernel;
  }
};

struct StepKernelHash {
  size_t operator()(const StepKernel& key) const {
    return static_cast<size_t>(key.step) * 0x9E3779B97F4A7C15ull ^
           static_cast<size_t>(key.kernel);
  }
};

// The process's emulated streams and pools (queues of one slot, or of several), when the
// kernels of each step end, and the one timer thread that completes kernels and waits.
class EmulatedStreams {
 public:
  static EmulatedStreams& Get() {
    static EmulatedStreams* streams = new EmulatedStreams();  // lives as long as the process
    return *streams;
  }

  // The id of the queue called `name`, which has `slots` slots.
  int64_t QueueId(const std::string& name, int64_t slots) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto [id, added] = queue_ids_.emplace(name, static_cast<int64_t>(queues_.size()));
    if (added) queues_.emplace_back(static_cast<size_t>(slots));
    return id->second;
  }

  // The id under which the ends of the kernel called `name` are recorded.
  int64_t KernelId(const std::string& name) {
    std::lock_guard<std::mutex> lock(mutex_);
    return kernel_ids_.emplace(name, static_cast<int64_t>(kernel_ids_.size())).first->second;
  }

  // Queues `kernel` of `step` for `duration` on the first free slot of `queue`, starting
  // no earlier than the ends of the step's kernels `after`; records its end and returns it.
  Clock::time_point Issue(StepId step, int64_t queue, int64_t kernel,
                          const std::vector<int64_t>& after,
                          std::chrono::nanoseconds duration) {
    const Clock::time_point now = Clock::now();
    std::lock_guard<std::mutex> lock(mutex_);
    Slot* slot = nullptr;
    Clock::time_point start;
    for (Slot& candidate : queues_[queue]) {
      const Clock::time_point free_at = candidate.FreeAt(now);
      if (slot == nullptr || free_at < start) {
        slot = &candidate;
        start = free_at;
      }
    }
    for (int64_t producer : after) start = std::max(start, EndLocked(step, producer));
    const Clock::time_point end = start + duration;
    slot->Occupy(step, end);
    ForgetPastEnds(now);
    kernel_ends_[{step, kernel}] = end;
    return end;
  }

  // When the last of `kernels` issued in `step` ends (the epoch if none was, or all ended
  // long ago).
  Clock::time_point LastEnd(StepId step, const std::vector<int64_t>& kernels) {
    std::lock_guard<std::mutex> lock(mutex_);
    Clock::time_point last;
    for (int64_t kernel : kernels) last = std::max(last, EndLocked(step, kernel));
    return last;
  }

  // Takes the kernels of `step` off every stream and pool: a cancelled step's queued work.
  void Release(StepId step) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (std::vector<Slot>& queue : queues_) {
      for (Slot& slot : queue) slot.Release(step);
    }
  }

  // Runs `callback` on the timer thread at `when` (it must be short: hand work elsewhere).
  void At(Clock::time_point when, std::function<void()> callback) {
    std::lock_guard<std::mutex> lock(mutex_);
    const bool earliest = timers_.empty() || when < timers_.begin()->first;
    timers_.emplace(when, std::move(callback));
    if (earliest) wake_.notify_one();
  }

 private:
  // Kernel ends are swept once at least this many are recorded.
  static constexpr size_t kMinSweep = 4096;

  EmulatedStreams() : timer_([this] { Run(); }) { timer_.detach(); }

  Clock::time_point EndLocked(StepId step, int64_t kernel) const {
    auto found = kernel_ends_.find({step, kernel});
    return found == kernel_ends_.end() ? Clock::time_point() : found->second;
  }

  // Forgets the ends that have passed, once their number has doubled since the last sweep:
  // memory stays proportional to the kernels still queued, at a constant amortized cost.
  void ForgetPastEnds(Clock::time_point now) {
    if (kernel_ends_.size() < sweep_at_) return;
    for (auto end = kernel_ends_.begin(); end != kernel_ends_.end();) {
      end = end->second <= now ? kernel_ends_.erase(end) : std::next(end);
    }
    sweep_at_ = std::max(kMinSweep, 2 * kernel_ends_.size());
  }

  void Run() {
    // Wake as close to each deadline as the kernel allows (the default slack is 50 µs).
    prctl(PR_SET_TIMERSLACK, 1UL);
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      if (timers_.empty()) {
        wake_.wait(lock);
        continue;
      }
      const Clock::time_point next = timers_.begin()->first;
      if (Clock::now() < next) {
        wake_.wait_until(lock, next);
        continue;
      }
      std::function<void()> on_time = std::move(timers_.begin()->second);
      timers_.erase(timers_.begin());
      lock.unlock();
      on_time();
      lock.lock();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::unordered_map<std::string, int64_t> queue_ids_;
  std::vector<std::vector<Slot>> queues_;
  std::unordered_map<std::string, int64_t> kernel_ids_;
  std::unordered_map<StepKernel, Clock::time_point, StepKernelHash> kernel_ends_;
  size_t sweep_at_ = kMinSweep;
  std::multimap<Clock::time_point, std::function<void()>> timers_;
  std::thread timer_;
};

// The name under which a kernel's ends are recorded: its device and node.
std::string KernelName(const std::string& device, const std::string& node) {
  return device + "|" + node;
}

Status StepCancelled(const ::tensorflow::OpKernel& kernel) {
  return ::tensorflow::errors::Cancelled(kernel.type_string(), " ", kernel.name(),
                                         ": its step was cancelled");
}

// An op waiting on the timer. It completes exactly once: when its time comes, or, if its
// step is cancelled first, at once.
struct PendingOp {
  OpKernelContext* context;
  AsyncOpKernel::DoneCallback done;
  ::tensorflow::thread::ThreadPool* workers;        // run `done`; nullptr: the thread that
                                                    // completes the op does
  ::tensorflow::CancellationManager* cancellation;  // nullptr: the step cannot be cancelled
  ::tensorflow::CancellationToken token;
  std::atomic<bool> completed{false};
};

void RunDone(PendingOp& op) {
  AsyncOpKernel::DoneCallback done = std::move(op.done);  // frees what it holds once run
  if (op.workers == nullptr) {
    done();
  } else {
    op.workers->Schedule(std::move(done));
  }
}

// Completes `op` with Cancelled and takes its step's kernels off the streams, so that an
// aborted step delays no later one.
void CompleteCancelled(PendingOp& op) {
  EmulatedStreams::Get().Release(op.context->step_id());
  op.context->SetStatus(StepCancelled(op.context->op_kernel()));
  RunDone(op);
}

// Completes the op of `context` at `when`, or when its step is cancelled (see PendingOp).
void CompleteAt(Clock::time_point when, OpKernelContext* context,
                AsyncOpKernel::DoneCallback done, ::tensorflow::thread::ThreadPool* workers) {
  auto op = std::make_shared<PendingOp>();
  op->context = context;
  op->done = std::move(done);
  op->workers = workers;
  op->cancellation = context->cancellation_manager();
  if (op->cancellation != nullptr) {
    op->token = op->cancellation->get_cancellation_token();
    const bool registered = op->cancellation->RegisterCallback(op->token, [op] {
      if (!op->completed.exchange(true)) CompleteCancelled(*op);
    });
    if (!registered) {
      CompleteCancelled(*op);
      return;
    }
  }
  EmulatedStreams::Get().At(when, [op] {
    if (op->completed.exchange(true)) return;
    // Before `done`, after which the step and its manager may end. This waits for a
    // cancellation under way, whose callback then finds the op completed.
    if (op->cancellation != nullptr) op->cancellation->DeregisterCallback(op->token);
    RunDone(*op);
  });
}

// Process-wide zeros, one growing buffer per dtype.
class ZeroPool {
 public:
  static ZeroPool& Get() {
    static ZeroPool* pool = new ZeroPool();
    return *pool;
  }

  // A tensor of `shape` whose buffer is all zeros and shared with other views.
  Status View(DataType dtype, const TensorShape& shape, Tensor* view) {
    const int64_t elements = shape.num_elements();
    std::lock_guard<std::mutex> lock(mutex_);
    Tensor& buffer = buffers_[dtype];
    if (!buffer.IsInitialized() || buffer.NumElements() < std::max<int64_t>(elements, 1)) {
      Tensor larger(dtype, TensorShape({std::max<int64_t>(elements, 1)}));
      if (!larger.IsInitialized()) {
        return ::tensorflow::errors::ResourceExhausted(
            "TfOverlapEmulatedCompute: cannot allocate ", elements, " zeros of ",
            ::tensorflow::DataTypeString(dtype));
      }
      auto bytes = larger.tensor_data();
      std::memset(const_cast<char*>(bytes.data()), 0, bytes.size());
      buffer = larger;  // views handed out before keep the old buffer alive
    }
    if (!view->CopyFrom(buffer.Slice(0, elements), shape)) {
      return ::tensorflow::errors::Internal("TfOverlapEmulatedCompute: cannot view ",
                                            elements, " zeros as ", shape.DebugString());
    }
    return ::tensorflow::OkStatus();
  }

 private:
  std::mutex mutex_;
  std::map<DataType, Tensor> buffers_;
};

class EmulatedComputeOp : public AsyncOpKernel {
 public:
  explicit EmulatedComputeOp(OpKernelConstruction* context) : AsyncOpKernel(context) {
    std::vector<PartialTensorShape> shapes;
    OP_REQUIRES_OK(context, context->GetAttr("Tout", &dtypes_));
    OP_REQUIRES_OK(context, context->GetAttr("output_shapes", &shapes));
    for (DataType dtype : dtypes_) {
      OP_REQUIRES(context, ::tensorflow::DataTypeCanUseMemcpy(dtype),
                  ::tensorflow::errors::InvalidArgument(
                      "TfOverlapEmulatedCompute: outputs must be plain numbers, not ",
                      ::tensorflow::DataTypeString(dtype)));
    }
    OP_REQUIRES(context, shapes.size() == dtypes_.size(),
                ::tensorflow::errors::InvalidArgument(
                    "TfOverlapEmulatedCompute: ", shapes.size(), " output_shapes for ",
                    dtypes_.size(), " outputs"));
    for (const PartialTensorShape& partial : shapes) {
      TensorShape shape;
      OP_REQUIRES(context, partial.AsTensorShape(&shape),
                  ::tensorflow::errors::InvalidArgument(
                      "TfOverlapEmulatedCompute needs static output shapes, got ",
                      partial.DebugString()));
      shapes_.push_back(shape);
    }
    float duration_us = 0;
    OP_REQUIRES_OK(context, context->GetAttr("duration_us", &duration_us));
    OP_REQUIRES(context, duration_us >= 0,
                ::tensorflow::errors::InvalidArgument(
                    "TfOverlapEmulatedCompute: duration_us must be >= 0, got ", duration_us));
    duration_ = std::chrono::nanoseconds(static_cast<int64_t>(duration_us * 1000.0));
    int64_t stream = 0;
    OP_REQUIRES_OK(context, context->GetAttr("stream", &stream));
    OP_REQUIRES_OK(context, context->GetAttr("blocking", &blocking_));
    OP_REQUIRES_OK(context, context->GetAttr("pool", &pool_slots_));
    OP_REQUIRES(context, pool_slots_ >= 0 && (pool_slots_ == 0 || blocking_),
                ::tensorflow::errors::InvalidArgument(
                    "TfOverlapEmulatedCompute: pool must be >= 0, and only blocking kernels "
                    "take a pool, got pool=", pool_slots_));
    std::vector<std::string> after;
    OP_REQUIRES_OK(context, context->GetAttr("after", &after));
    const std::string& device = context->device()->name();
    EmulatedStreams& streams = EmulatedStreams::Get();
    // A pool's size is part of its name: one of another size never drops a busy slot.
    queue_ = pool_slots_ > 0
                 ? streams.QueueId(device + "/pool:" + std::to_string(pool_slots_), pool_slots_)
                 : streams.QueueId(device + "/stream:" + std::to_string(stream), 1);
    kernel_ = streams.KernelId(KernelName(device, name()));
    for (const std::string& producer : after) {
      after_.push_back(streams.KernelId(KernelName(device, producer)));
    }
  }

  void ComputeAsync(OpKernelContext* context, DoneCallback done) override {
    ::tensorflow::CancellationManager* cancellation = context->cancellation_manager();
    if (cancellation != nullptr && cancellation->IsCancelled()) {
      context->SetStatus(StepCancelled(*this));  // its queued work is gone: add none
      done();
      return;
    }
    {
      std::lock_guard<std::mutex> lock(zeros_mutex_);
      if (zeros_.empty()) {
        for (size_t i = 0; i < dtypes_.size(); ++i) {
          Tensor zero;
          Status status = ZeroPool::Get().View(dtypes_[i], shapes_[i], &zero);
          if (!status.ok()) {
            zeros_.clear();
            context->SetStatus(status);
            done();
            return;
          }
          zeros_.push_back(zero);
        }
      }
      for (size_t i = 0; i < zeros_.size(); ++i) context->set_output(i, zeros_[i]);
    }
    const Clock::time_point end =
        EmulatedStreams::Get().Issue(context->step_id(), queue_, kernel_, after_, duration_);
    if (!blocking_) {
      done();  // launched: the stream does the rest
      return;
    }
    CompleteAt(end, context, std::move(done), nullptr);
  }

 private:
  std::vector<DataType> dtypes_;
  std::vector<TensorShape> shapes_;
  std::chrono::nanoseconds duration_{0};
  int64_t queue_ = 0;
  int64_t kernel_ = 0;
  std::vector<int64_t> after_;
  bool blocking_ = false;
  int64_t pool_slots_ = 0;
  std::mutex zeros_mutex_;
  std::vector<Tensor> zeros_;
};

REGISTER_KERNEL_BUILDER(Name("TfOverlapEmulatedCompute").Device(::tensorflow::DEVICE_CPU),
                        EmulatedComputeOp);

class StreamWaitOp : public AsyncOpKernel {
 public:
  explicit StreamWaitOp(OpKernelConstruction* context) : AsyncOpKernel(context) {
    std::vector<std::string> producers;
    OP_REQUIRES_OK(context, context->GetAttr("producers", &producers));
    for (const std::string& producer : producers) {
      producers_.push_back(
          EmulatedStreams::Get().KernelId(KernelName(context->device()->name(), producer)));
    }
  }

  void ComputeAsync(OpKernelContext* context, DoneCallback done) override {
    for (int i = 0; i < context->num_inputs(); ++i) {
      context->set_output(i, context->input(i));
    }
    const Clock::time_point ready =
        EmulatedStreams::Get().LastEnd(context->step_id(), producers_);
    if (ready <= Clock::now()) {
      done();
      return;
    }
    CompleteAt(ready, context, std::move(done),
               context->device()->tensorflow_cpu_worker_threads()->workers);
  }

 private:
  std::vector<int64_t> producers_;
};

REGISTER_KERNEL_BUILDER(Name("TfOverlapStreamWait").Device(::tensorflow::DEVICE_CPU),
                        StreamWaitOp);

}  // namespace
}  // namespace tfoverlap
