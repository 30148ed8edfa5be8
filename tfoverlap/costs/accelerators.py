"""Device models of accelerators: how long one op would take on a GPU of a named class.

An op's time is a roofline with efficiencies, plus a launch overhead:

    seconds = launch + max(flops / (peak × efficiency), bytes / (memory bandwidth × efficiency))

where ``peak`` is the tensor-core rate for matrix ops (convolutions, matmuls and their
gradients: mixed-precision training) and the FP32 rate for everything else, and ``bytes``
are the op's inputs and outputs at the graph's dtypes. The peaks are NVIDIA's datasheet
figures (dense, no sparsity):

- ``v100``: Tesla V100 SXM2 — 125 TFLOP/s FP16 tensor, 15.7 TFLOP/s FP32, 900 GB/s HBM2
  (NVIDIA Tesla V100 datasheet);
- ``a100``: A100 SXM4 40 GB — 312 TFLOP/s FP16 tensor, 19.5 TFLOP/s FP32, 1555 GB/s HBM2
  (NVIDIA A100 datasheet);
- ``h100``: H100 SXM5 — 989 TFLOP/s FP16 tensor, 67 TFLOP/s FP32, 3350 GB/s HBM3 (NVIDIA
  H100 datasheet).

The efficiencies (matrix 0.4, vector 0.5, memory 0.7) and the 5 µs launch are round
figures of what cuDNN/cuBLAS kernels reach on ResNet-class layers. Training on these GPUs
is mixed precision: activations and gradients move as 16-bit values, so an op's bytes
count at half the graph's 32-bit sizes (``bytes_scale`` 0.5). docs/benchmarks.md compares
the resulting ResNet-50 and VGG-16 steps with published throughput.

A JSON device file can be given instead of a name: the same fields, any of them, on top of
a named model (``"base": "v100"``), and ``op_seconds``, per-op times by node name (for
example measured on a real GPU), which win over the roofline. A profile written by
``tfoverlap.profile`` is a device file too: it replays the measured op times (each op's share
of the step's compute time, where the profile has them, else their means, else medians),
and ops it did not see take no time (the emulation's own validation replays this CPU's
profile, one kernel at a time).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os

from tfoverlap.costs.profile import PROFILE_FORMAT, ProfileError, load_profile

__all__ = ["DeviceModel", "DEVICE_MODELS", "MATRIX_OPS", "load_device_model"]

#: op types that run on tensor cores.
MATRIX_OPS = frozenset({
    "Conv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter", "Conv3D",
    "Conv3DBackpropInputV2", "Conv3DBackpropFilterV2", "DepthwiseConv2dNative",
    "DepthwiseConv2dNativeBackpropInput", "DepthwiseConv2dNativeBackpropFilter",
    "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum",
    "_FusedConv2D", "_FusedMatMul"})


@dataclasses.dataclass(frozen=True)
class DeviceModel:
    name: str
    matrix_flops: float            # FLOP/s peak of the matrix units
    vector_flops: float            # FLOP/s peak of the general cores (FP32)
    memory_bandwidth: float        # bytes/s
    matrix_efficiency: float = 0.4
    vector_efficiency: float = 0.5
    memory_efficiency: float = 0.7
    launch_seconds: float = 5e-6
    bytes_scale: float = 0.5       # bytes moved per byte of the graph's dtypes
    op_seconds: dict = dataclasses.field(default_factory=dict)   # node name -> seconds

    def op_time(self, name: str, op_type: str, flops: float, moved_bytes: float) -> float:
        """Seconds op ``name`` of type ``op_type`` takes on this device."""
        if name in self.op_seconds:
            return self.op_seconds[name]
        matrix = op_type in MATRIX_OPS
        rate = (self.matrix_flops * self.matrix_efficiency if matrix
                else self.vector_flops * self.vector_efficiency)
        memory = self.memory_bandwidth * self.memory_efficiency
        return self.launch_seconds + max(flops / rate, moved_bytes * self.bytes_scale / memory)


DEVICE_MODELS = {
    "v100": DeviceModel("v100", matrix_flops=125e12, vector_flops=15.7e12,
                        memory_bandwidth=900e9),
    "a100": DeviceModel("a100", matrix_flops=312e12, vector_flops=19.5e12,
                        memory_bandwidth=1555e9),
    "h100": DeviceModel("h100", matrix_flops=989e12, vector_flops=67e12,
                        memory_bandwidth=3350e9),
}

_NUMBER_FIELDS = ("matrix_flops", "vector_flops", "memory_bandwidth", "matrix_efficiency",
                  "vector_efficiency", "memory_efficiency", "launch_seconds", "bytes_scale")


def load_device_model(spec: str) -> DeviceModel:
    """The device model named ``spec`` (v100, a100, h100) or read from the JSON file at
    ``spec``. ValueError names what is wrong (an unknown name, a missing or corrupt file,
    a field out of range)."""
    key = spec.strip().lower()
    if key in DEVICE_MODELS:
        return DEVICE_MODELS[key]
    if not os.path.isfile(spec):
        raise ValueError(f"emulate: {spec!r} is neither a device model "
                         f"({', '.join(DEVICE_MODELS)}) nor a device file")
    try:
        with open(spec) as stream:
            data = json.load(stream)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"emulate: cannot read device file {spec}: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"emulate: device file {spec} must hold a JSON object")
    if data.get("format") == PROFILE_FORMAT:
        try:
            profile = load_profile(spec)
        except ProfileError as error:
            raise ValueError(f"emulate: {error}") from None
        return DeviceModel(f"profile {os.path.basename(spec)}", matrix_flops=math.inf,
                           vector_flops=math.inf, memory_bandwidth=math.inf,
                           launch_seconds=0.0,
                           op_seconds=dict(profile.op_share_seconds or profile.op_mean_seconds
                                           or profile.op_seconds))
    unknown = sorted(set(data) - {"name", "base", "op_seconds", *_NUMBER_FIELDS})
    if unknown:
        raise ValueError(f"emulate: device file {spec}: unknown field {unknown[0]!r}")
    base_name = str(data.get("base", "v100")).lower()
    if base_name not in DEVICE_MODELS:
        raise ValueError(f"emulate: device file {spec}: base {base_name!r} is not one of "
                         f"{', '.join(DEVICE_MODELS)}")
    fields = {}
    for field in _NUMBER_FIELDS:
        if field in data:
            value = data[field]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    value >= 0 and value != float("inf")):
                raise ValueError(f"emulate: device file {spec}: {field} must be a "
                                 f"non-negative number, got {value!r}")
            fields[field] = float(value)
    op_seconds = data.get("op_seconds", {})
    if not isinstance(op_seconds, dict) or not all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
            and 0 <= v < float("inf") for k, v in op_seconds.items()):
        raise ValueError(f"emulate: device file {spec}: op_seconds must map node names to "
                         "non-negative seconds")
    name = str(data.get("name", os.path.splitext(os.path.basename(spec))[0]))
    return dataclasses.replace(DEVICE_MODELS[base_name], name=name, **fields,
                               op_seconds={k: float(v) for k, v in op_seconds.items()})
