"""Replacing compute ops by emulated-accelerator kernels (``TfOverlapEmulatedCompute``,
native/emulated_compute.cc).

Each replaced node keeps its name, device, data inputs (in order) and control inputs, so
every consumer and every dependency stays as it was; only what it computes changes: zeros
of the same dtypes and static shapes, after the given duration.
"""
from __future__ import annotations

import dataclasses

__all__ = ["EMULATED_OP", "Emulation", "replace_with_emulated_ops"]

EMULATED_OP = "TfOverlapEmulatedCompute"


@dataclasses.dataclass(frozen=True)
class Emulation:
    """How one node is emulated."""
    node: str
    input_dtypes: tuple       # DataType enums of its data inputs
    output_dtypes: tuple
    output_shapes: tuple      # tuples of dims, all static
    seconds: float            # wall time of the kernel (dilation applied)
    stream: int = 0


def replace_with_emulated_ops(graph_def, emulations: list[Emulation]):
    """A copy of ``graph_def`` with each node named in ``emulations`` replaced by an
    emulated kernel."""
    from tensorflow.core.framework import graph_pb2
    by_name = {emulation.node: emulation for emulation in emulations}
    new_graph_def = graph_pb2.GraphDef()
    new_graph_def.CopyFrom(graph_def)
    for node in new_graph_def.node:
        emulation = by_name.get(node.name)
        if emulation is None:
            continue
        original_op = node.op
        data_inputs = [text for text in node.input if not text.startswith("^")]
        if len(data_inputs) != len(emulation.input_dtypes):
            raise ValueError(f"{node.name}: {len(data_inputs)} data inputs in the graph, "
                             f"{len(emulation.input_dtypes)} in its emulation")
        node.op = EMULATED_OP
        node.ClearField("attr")
        node.attr["Tin"].list.type.extend(emulation.input_dtypes)
        node.attr["Tout"].list.type.extend(emulation.output_dtypes)
        for dims in emulation.output_shapes:
            shape = node.attr["output_shapes"].list.shape.add()
            for size in dims:
                shape.dim.add(size=size)
        node.attr["duration_us"].f = emulation.seconds * 1e6
        node.attr["stream"].i = emulation.stream
        node.attr["original_op"].s = original_op.encode()
    return new_graph_def
