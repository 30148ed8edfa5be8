"""Static compute estimates for a graph nobody has profiled yet.

Caramel needs *when* each gradient becomes ready before the first step runs. Without a
profile the times come from TensorFlow itself: the graph is imported into a scratch
``tf.Graph`` (TensorFlow's shape inference fills in every static shape), each op's FLOPs
come from TensorFlow's registered ``flops`` statistics (MatMul, Conv2D and its backprops,
element-wise ops ...), and ops without one cost their output bytes at memory speed. The
result is deterministic for a given graph, so every rank computes the same plan.
"""
from __future__ import annotations

import dataclasses
import logging

__all__ = ["StaticCosts", "static_costs"]

logger = logging.getLogger("tfoverlap")

MEMORY_BYTES_PER_SECOND = 10e9     # streaming bandwidth of one core, roughly
OP_OVERHEAD_SECONDS = 2e-6         # the executor's cost of scheduling any op


@dataclasses.dataclass(frozen=True)
class StaticCosts:
    op_seconds: dict          # node name -> estimated seconds
    tensor_bytes: dict        # "node:slot" -> bytes, where the static shape is known


def _output_bytes(tensor) -> int | None:
    shape = tensor.shape
    if shape.rank is None or not shape.is_fully_defined():
        return None
    try:
        itemsize = tensor.dtype.size
    except (AttributeError, TypeError):
        return None
    return int(shape.num_elements()) * itemsize


def static_costs(graph_def, flops_per_second: float) -> StaticCosts:
    """Estimated op times and known tensor sizes of ``graph_def``.

    Raises whatever TensorFlow raises if the graph cannot be imported (an op type that is
    not registered in this process, for example); callers fall back to unit costs.
    """
    import tensorflow as tf
    from tensorflow.python.framework import ops as tf_ops
    from tensorflow.python.util import deprecation

    if any(node.op.startswith("Horovod") for node in graph_def.node):
        import horovod.tensorflow  # noqa: F401 - registers the Horovod op types
    scratch = tf.Graph()
    with scratch.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    op_seconds, sizes = {}, {}
    for op in scratch.get_operations():
        output_bytes = 0
        for slot, tensor in enumerate(op.outputs):
            size = _output_bytes(tensor)
            if size is not None:
                sizes[f"{op.name}:{slot}"] = size
                output_bytes += size
        try:
            with deprecation.silence():     # TF's FLOP registry calls a TF1-era helper
                flops = tf_ops.get_stats_for_node_def(scratch, op.node_def, "flops").value
        except (ValueError, TypeError, AttributeError):
            flops = None
        seconds = (flops / flops_per_second if flops else
                   output_bytes / MEMORY_BYTES_PER_SECOND)
        op_seconds[op.name] = OP_OVERHEAD_SECONDS + seconds
    return StaticCosts(op_seconds, sizes)
