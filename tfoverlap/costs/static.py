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
import hashlib
import logging
import threading

__all__ = ["StaticCosts", "OpShapes", "static_costs"]

logger = logging.getLogger("tfoverlap")

MEMORY_BYTES_PER_SECOND = 10e9     # streaming bandwidth of one core, roughly
OP_OVERHEAD_SECONDS = 2e-6         # the executor's cost of scheduling any op
#: ops that hand on a buffer (or only its shape) without touching its bytes: a variable's
#: read, views, constants, shape queries. They cost the executor's overhead alone.
NO_COPY_OPS = frozenset({
    "Const", "HostConst", "VarHandleOp", "VariableV2", "ReadVariableOp", "Placeholder",
    "PlaceholderWithDefault", "_Arg", "_Retval", "Identity", "IdentityN", "StopGradient",
    "PreventGradient", "Reshape", "Squeeze", "ExpandDims", "Shape", "ShapeN", "Size", "Rank",
    "NoOp"})


@dataclasses.dataclass(frozen=True)
class OpShapes:
    """What shape inference knows of one op."""
    input_dtypes: tuple       # DataType enums of the data inputs (ref types as such)
    input_shapes: tuple       # per data input: a tuple of dims, or None where not static
    output_dtypes: tuple
    output_shapes: tuple      # per output: a tuple of dims, or None where not static
    input_bytes: int | None   # all data inputs, None if any is not static
    flops: int | None         # TensorFlow's registered FLOP count, where it has one
    stateful: bool


@dataclasses.dataclass(frozen=True)
class StaticCosts:
    op_seconds: dict          # node name -> estimated seconds
    tensor_bytes: dict        # "node:slot" -> bytes, where the static shape is known
    ops: dict = dataclasses.field(default_factory=dict)   # node name -> OpShapes


def _output_bytes(tensor) -> int | None:
    shape = tensor.shape
    if shape.rank is None or not shape.is_fully_defined():
        return None
    try:
        itemsize = tensor.dtype.size
    except (AttributeError, TypeError):
        return None
    return int(shape.num_elements()) * itemsize


def _static_dims(tensor) -> tuple | None:
    shape = tensor.shape
    return tuple(shape.as_list()) if shape.is_fully_defined() else None


def static_costs(graph_def, flops_per_second: float) -> StaticCosts:
    """Estimated op times and known tensor sizes of ``graph_def``.

    Importing a large graph takes a second or more, and Grappler shows the pass the same
    graph twice (the second time with tfoverlap's own nodes and edges), so the FLOP counts
    are remembered per graph (its nodes' names, ops and data inputs, tfoverlap's own
    left out) for the last few graphs.

    Raises whatever TensorFlow raises if the graph cannot be imported (an op type that is
    not registered in this process, for example); callers fall back to unit costs.
    """
    key = _fingerprint(graph_def)
    with _cache_lock:
        work = _cache.get(key)
    if work is None:
        work = _op_work(graph_def)
        with _cache_lock:
            _cache[key] = work
            while len(_cache) > _CACHE_SIZE:
                _cache.pop(next(iter(_cache)))
    op_flops, op_bytes, sizes, ops, op_types = work
    op_seconds = {}
    for name, output_bytes in op_bytes.items():
        flops = op_flops.get(name)
        if op_types[name] in NO_COPY_OPS:
            seconds = 0.0
        else:
            seconds = (flops / flops_per_second if flops else
                       output_bytes / MEMORY_BYTES_PER_SECOND)
        op_seconds[name] = OP_OVERHEAD_SECONDS + seconds
    return StaticCosts(op_seconds, dict(sizes), ops)


_CACHE_SIZE = 4
_cache: dict = {}
_cache_lock = threading.Lock()
OWN_PREFIX = "tfoverlap/"          # tfoverlap's own nodes (gates, buckets) cost nothing


def _fingerprint(graph_def) -> str:
    digest = hashlib.sha1()
    for node in graph_def.node:
        if node.name.startswith(OWN_PREFIX):
            continue
        digest.update(node.name.encode())
        digest.update(node.op.encode())
        for text in node.input:
            if not text.startswith("^"):
                digest.update(text.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def _op_work(graph_def) -> tuple[dict, dict, dict, dict, dict]:
    """(node -> FLOPs where TensorFlow counts them, node -> output bytes, known sizes,
    node -> OpShapes, node -> op type)."""
    import tensorflow as tf
    from tensorflow.python.framework import ops as tf_ops
    from tensorflow.python.util import deprecation

    if any(node.op.startswith("Horovod") for node in graph_def.node):
        import horovod.tensorflow  # noqa: F401 - registers the Horovod op types
    scratch = tf.Graph()
    with scratch.as_default():
        tf.graph_util.import_graph_def(_importable(graph_def), name="")
    op_flops, op_bytes, sizes, ops = {}, {}, {}, {}
    op_types = {op.name: op.type for op in scratch.get_operations()}
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
        if flops:
            op_flops[op.name] = flops
        op_bytes[op.name] = output_bytes
        input_sizes = [_output_bytes(tensor) for tensor in op.inputs]
        ops[op.name] = OpShapes(
            input_dtypes=tuple(tensor.dtype.as_datatype_enum for tensor in op.inputs),
            input_shapes=tuple(_static_dims(tensor) for tensor in op.inputs),
            output_dtypes=tuple(tensor.dtype.as_datatype_enum for tensor in op.outputs),
            output_shapes=tuple(_static_dims(tensor) for tensor in op.outputs),
            input_bytes=None if None in input_sizes else sum(input_sizes),
            flops=flops or None, stateful=bool(op.op_def.is_stateful))
    return op_flops, op_bytes, sizes, ops, op_types


def _importable(graph_def):
    """A copy of ``graph_def`` that imports into a scratch graph with as many static shapes
    as TensorFlow can infer:

    - a tf.function's resource argument that carries its variable's dtype and shape
      (``_handle_dtypes``/``_handle_shapes``) becomes a ``VarHandleOp`` of that dtype and
      shape, so that the reads, and everything computed from them, have shapes;
    - colocation constraints are dropped (they can name nodes outside a function's graph,
      which import rejects, and costs do not depend on them).
    """
    from tensorflow.core.framework import graph_pb2
    copy = graph_pb2.GraphDef()
    copy.CopyFrom(graph_def)
    for node in copy.node:
        if "_class" in node.attr:
            del node.attr["_class"]
        if (node.op == "_Arg" and len(node.attr["_handle_dtypes"].list.type) == 1
                and len(node.attr["_handle_shapes"].list.shape) == 1):
            dtype = node.attr["_handle_dtypes"].list.type[0]
            shape = type(node.attr["_handle_shapes"].list.shape[0])()
            shape.CopyFrom(node.attr["_handle_shapes"].list.shape[0])
            node.op = "VarHandleOp"
            node.ClearField("attr")
            node.attr["dtype"].type = dtype
            node.attr["shape"].shape.CopyFrom(shape)
            node.attr["shared_name"].s = node.name.encode()
    return copy
