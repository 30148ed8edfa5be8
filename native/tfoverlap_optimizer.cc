// The TfOverlap Grappler optimizer: a thin shim that hands the graph to Python.
//
// All graph logic lives in the tfoverlap Python package. This library only
//  1. registers a CustomGraphOptimizer named "TfOverlap" (once per process, even if
//     a second copy of the library is loaded),
//  2. serializes the GraphDef, the item's fetch/feed/keep lists and the optimizer's
//     parameter_map, and calls the Python entry point registered through ctypes,
//  3. parses the GraphDef that Python returns.
// The Python entry point is a ctypes callback: ctypes takes the GIL itself for the
// duration of the call, so this library never touches the GIL and never holds it
// while TensorFlow runs.
#include <atomic>
#include <string>

#include "tensorflow/core/grappler/grappler_item.h"
#include "tensorflow/core/grappler/optimizers/custom_graph_optimizer.h"
#include "tensorflow/core/grappler/optimizers/custom_graph_optimizer_registry.h"
#include "tensorflow/core/platform/errors.h"

namespace {

constexpr char kOptimizerName[] = "TfOverlap";
constexpr int kAbiVersion = 1;

// Return codes of the Python entry point.
constexpr int kUnchanged = 0;
constexpr int kRewritten = 1;  // *result holds the serialized rewritten GraphDef
constexpr int kFailed = 2;     // *result holds an error message (strict mode)

using PythonEntryPoint = int (*)(const char* graph, size_t graph_len, const char* item,
                                 size_t item_len, const char* config, size_t config_len,
                                 void* result);

std::atomic<PythonEntryPoint> python_entry_point{nullptr};

std::string DescribeItem(const tensorflow::grappler::GrapplerItem& item) {
  std::string text = "id " + item.id + "\n";
  for (const auto& name : item.fetch) text += "fetch " + name + "\n";
  for (const auto& feed : item.feed) text += "feed " + feed.first + "\n";
  for (const auto& name : item.keep_ops) text += "keep " + name + "\n";
  for (const auto& name : item.NodesToPreserve()) text += "preserve " + name + "\n";
  return text;
}

class TfOverlapOptimizer : public tensorflow::grappler::CustomGraphOptimizer {
 public:
  std::string name() const override { return kOptimizerName; }
  bool UsesFunctionLibrary() const override { return false; }

  tensorflow::Status Init(
      const tensorflow::RewriterConfig_CustomGraphOptimizer* config) override {
    if (config != nullptr) config->SerializeToString(&serialized_config_);
    return tensorflow::OkStatus();
  }

  tensorflow::Status Optimize(tensorflow::grappler::Cluster* /*cluster*/,
                              const tensorflow::grappler::GrapplerItem& item,
                              tensorflow::GraphDef* optimized_graph) override {
    PythonEntryPoint entry_point = python_entry_point.load();
    if (entry_point == nullptr) {
      return tensorflow::errors::Aborted("TfOverlap: the tfoverlap Python package is not loaded");
    }
    std::string graph;
    if (!item.graph.SerializeToString(&graph)) {
      return tensorflow::errors::Aborted("TfOverlap: graph too large to serialize");
    }
    const std::string description = DescribeItem(item);
    std::string result;
    const int code = entry_point(graph.data(), graph.size(), description.data(),
                                 description.size(), serialized_config_.data(),
                                 serialized_config_.size(), &result);
    if (code == kRewritten) {
      if (!optimized_graph->ParseFromString(result)) {
        return tensorflow::errors::Internal("TfOverlap: Python returned an unparsable GraphDef");
      }
      return tensorflow::OkStatus();
    }
    if (code == kFailed) return tensorflow::errors::Internal(result);
    // By Grappler's convention Aborted means "no change"; the input graph is kept.
    return tensorflow::errors::Aborted("TfOverlap: graph unchanged");
  }

 private:
  std::string serialized_config_;
};

// Registers at load time, but only if no other copy of this library did already:
// Grappler aborts the process when one name is registered twice.
struct Registration {
  Registration() {
    using tensorflow::grappler::CustomGraphOptimizerRegistry;
    for (const auto& registered : CustomGraphOptimizerRegistry::GetRegisteredOptimizers()) {
      if (registered == kOptimizerName) return;
    }
    CustomGraphOptimizerRegistry::RegisterOptimizerOrDie(
        [] { return new TfOverlapOptimizer(); }, kOptimizerName);
  }
};
Registration registration;

}  // namespace

extern "C" {

int tfoverlap_abi_version() { return kAbiVersion; }

void tfoverlap_set_entry_point(PythonEntryPoint entry_point) {
  python_entry_point.store(entry_point);
}

void tfoverlap_set_result(void* result, const char* data, size_t size) {
  static_cast<std::string*>(result)->assign(data, size);
}

}  // extern "C"
