// Emulated accelerator kernels.
//
// TfOverlapEmulatedCompute stands in for a heavy compute op. It takes the original op's
// inputs (so every dependency stays), gives outputs of the original dtypes and static
// shapes, and occupies an emulated stream (a device name plus the `stream` attr) for
// `duration_us`: kernels on one stream run one at a time in the order they were issued,
// as on one CUDA stream, so a kernel issued at t ends at max(t, the end of the stream's
// previous kernel) + duration.
//
// With `pool` > 0 it instead takes whichever of the device's `pool` slots frees first: the
// inter-op threads of a CPU executor, which run any ready op on any idle thread.
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
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/types.h"

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
         "issue order; complete at launch unless blocking.");

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
    .Doc("Forwards its inputs once the emulated kernels named in producers (on this "
         "device) have ended on their streams.");

// The process's emulated streams and the one timer thread that completes their kernels.
class EmulatedStreams {
 public:
  static EmulatedStreams& Get() {
    static EmulatedStreams* streams = new EmulatedStreams();  // lives as long as the process
    return *streams;
  }

  // Queues a kernel of `duration` on `stream` and records its end under `kernel`;
  // returns the end.
  Clock::time_point Issue(const std::string& stream, const std::string& kernel,
                          std::chrono::nanoseconds duration) {
    const Clock::time_point now = Clock::now();
    std::lock_guard<std::mutex> lock(mutex_);
    Clock::time_point& busy_until = busy_until_[stream];
    const Clock::time_point end = std::max(now, busy_until) + duration;
    busy_until = end;
    last_end_[kernel] = end;
    return end;
  }

  // Queues a kernel of `duration` on the earliest free of `slots` slots of `pool`;
  // returns its end.
  Clock::time_point IssueOnPool(const std::string& pool, int64_t slots,
                                std::chrono::nanoseconds duration) {
    const Clock::time_point now = Clock::now();
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<Clock::time_point>& free_at = pools_[pool];
    free_at.resize(static_cast<size_t>(slots));
    auto earliest = std::min_element(free_at.begin(), free_at.end());
    *earliest = std::max(now, *earliest) + duration;
    return *earliest;
  }

  // When the last kernel issued under `kernel` ends (the epoch if none was).
  Clock::time_point LastEnd(const std::string& kernel) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = last_end_.find(kernel);
    return found == last_end_.end() ? Clock::time_point() : found->second;
  }

  // Runs `callback` on the timer thread at `when` (it must be short: hand work elsewhere).
  void At(Clock::time_point when, std::function<void()> callback) {
    std::lock_guard<std::mutex> lock(mutex_);
    const bool earliest = ends_.empty() || when < ends_.begin()->first;
    ends_.emplace(when, std::move(callback));
    if (earliest) wake_.notify_one();
  }

 private:
  EmulatedStreams() : timer_([this] { Run(); }) { timer_.detach(); }

  void Run() {
    // Wake as close to each deadline as the kernel allows (the default slack is 50 µs).
    prctl(PR_SET_TIMERSLACK, 1UL);
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      if (ends_.empty()) {
        wake_.wait(lock);
        continue;
      }
      const Clock::time_point next = ends_.begin()->first;
      if (Clock::now() < next) {
        wake_.wait_until(lock, next);
        continue;
      }
      std::function<void()> on_end = std::move(ends_.begin()->second);
      ends_.erase(ends_.begin());
      lock.unlock();
      on_end();
      lock.lock();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::unordered_map<std::string, Clock::time_point> busy_until_;
  std::unordered_map<std::string, Clock::time_point> last_end_;
  std::unordered_map<std::string, std::vector<Clock::time_point>> pools_;
  std::multimap<Clock::time_point, std::function<void()>> ends_;
  std::thread timer_;
};

// The name under which a kernel's ends are recorded: its device and node.
std::string KernelKey(const std::string& device, const std::string& node) {
  return device + "|" + node;
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
    pool_ = context->device()->name() + "/pool";
    stream_ = context->device()->name() + "/stream:" + std::to_string(stream);
    kernel_ = KernelKey(context->device()->name(), name());
  }

  void ComputeAsync(OpKernelContext* context, DoneCallback done) override {
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
    if (!blocking_) {
      EmulatedStreams::Get().Issue(stream_, kernel_, duration_);
      done();  // launched: the stream does the rest
      return;
    }
    const Clock::time_point end =
        pool_slots_ > 0 ? EmulatedStreams::Get().IssueOnPool(pool_, pool_slots_, duration_)
                        : EmulatedStreams::Get().Issue(stream_, kernel_, duration_);
    EmulatedStreams::Get().At(end, std::move(done));
  }

 private:
  std::vector<DataType> dtypes_;
  std::vector<TensorShape> shapes_;
  std::chrono::nanoseconds duration_{0};
  std::string stream_;
  std::string kernel_;
  bool blocking_ = false;
  int64_t pool_slots_ = 0;
  std::string pool_;
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
      producers_.push_back(KernelKey(context->device()->name(), producer));
    }
  }

  void ComputeAsync(OpKernelContext* context, DoneCallback done) override {
    for (int i = 0; i < context->num_inputs(); ++i) {
      context->set_output(i, context->input(i));
    }
    Clock::time_point ready;
    for (const std::string& producer : producers_) {
      ready = std::max(ready, EmulatedStreams::Get().LastEnd(producer));
    }
    if (ready <= Clock::now()) {
      done();
      return;
    }
    auto* workers = context->device()->tensorflow_cpu_worker_threads()->workers;
    EmulatedStreams::Get().At(ready, [workers, done = std::move(done)]() {
      workers->Schedule(done);
    });
  }

 private:
  std::vector<std::string> producers_;
};

REGISTER_KERNEL_BUILDER(Name("TfOverlapStreamWait").Device(::tensorflow::DEVICE_CPU),
                        StreamWaitOp);

}  // namespace
}  // namespace tfoverlap
