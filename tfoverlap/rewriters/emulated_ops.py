"""Replacing compute ops by emulated-accelerator kernels (``TfOverlapEmulatedCompute``,
native/emulated_compute.cc), and waiting for them where their results leave the stream.

Each replaced node keeps its name, device, data inputs (in order) and control inputs, so
every consumer and every dependency stays as it was; only what it computes changes: zeros
of the same dtypes and static shapes, taking the given duration of its stream.

Non-blocking kernels complete at launch, as GPU kernels do for TensorFlow's executor;
:func:`insert_stream_waits` then puts a ``TfOverlapStreamWait`` between an emulated
kernel and every consumer that is not one (a host op, a transfer, a collective), which
forwards the values once the kernel has ended, as a device-to-host copy waits for its
stream. Control edges from a kernel keep a GPU's meaning: it was launched.
"""
from __future__ import annotations

import dataclasses

from tfoverlap.costs.trace import EMULATED_OP, STREAM_WAIT_OP
from tfoverlap.graph.model import parse_input

__all__ = ["EMULATED_OP", "STREAM_WAIT_OP", "WAIT_PREFIX", "Emulation",
           "replace_with_emulated_ops", "insert_stream_waits"]

WAIT_PREFIX = "tfoverlap/stream_wait/"


@dataclasses.dataclass(frozen=True)
class Emulation:
    """How one node is emulated."""
    node: str
    input_dtypes: tuple       # DataType enums of its data inputs
    output_dtypes: tuple
    output_shapes: tuple      # tuples of dims, all static
    seconds: float            # wall time of the kernel (dilation applied)
    stream: int = 0


def replace_with_emulated_ops(graph_def, emulations: list[Emulation], blocking: bool = False,
                              pool: int = 0):
    """A copy of ``graph_def`` with each node named in ``emulations`` replaced by an
    emulated kernel (completing at launch, or when it ends if ``blocking``; blocking
    kernels with ``pool`` > 0 run on the first free of that many threads, not on streams)."""
    if pool and not blocking:
        raise ValueError("only blocking emulated kernels run on a pool of threads")
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
        for name in ("Tin", "Tout", "output_shapes"):
            node.attr[name].list.SetInParent()     # present even where empty
        node.attr["Tin"].list.type.extend(emulation.input_dtypes)
        node.attr["Tout"].list.type.extend(emulation.output_dtypes)
        for dims in emulation.output_shapes:
            shape = node.attr["output_shapes"].list.shape.add()
            for size in dims:
                shape.dim.add(size=size)
        node.attr["duration_us"].f = emulation.seconds * 1e6
        node.attr["stream"].i = emulation.stream
        node.attr["blocking"].b = blocking
        if pool:
            node.attr["pool"].i = pool
        node.attr["original_op"].s = original_op.encode()
    return new_graph_def


def insert_stream_waits(graph_def):
    """(``graph_def`` with a stream wait before every consumer of a non-blocking emulated
    kernel that is not one itself, how many waits were added). A copy where any is added;
    consumers already behind a wait keep theirs (idempotent)."""
    from tensorflow.core.framework import graph_pb2
    kernels = {node.name: node for node in graph_def.node
               if node.op == EMULATED_OP and not node.attr["blocking"].b}
    consumed: dict[str, set] = {}
    for node in graph_def.node:
        if node.op == EMULATED_OP or node.op == STREAM_WAIT_OP:
            continue
        for text in node.input:
            name, slot, control = parse_input(text)
            if not control and name in kernels:
                consumed.setdefault(name, set()).add(slot)
    if not consumed:
        return graph_def, 0
    new_graph_def = graph_pb2.GraphDef()
    new_graph_def.CopyFrom(graph_def)
    existing = {node.name for node in graph_def.node}
    renamed = {}
    for name, slots in sorted(consumed.items()):
        kernel = kernels[name]
        wait_name = WAIT_PREFIX + name
        if wait_name in existing:
            raise ValueError(f"{wait_name} exists but does not forward all of {name}'s "
                             "consumed outputs")
        order = sorted(slots)
        wait = new_graph_def.node.add(name=wait_name, op=STREAM_WAIT_OP, device=kernel.device)
        wait.input.extend(f"{name}:{slot}" for slot in order)
        wait.attr["T"].list.type.extend(kernel.attr["Tout"].list.type[slot] for slot in order)
        wait.attr["producers"].list.s.append(name.encode())
        for position, slot in enumerate(order):
            renamed[(name, slot)] = f"{wait_name}:{position}"
    for node in new_graph_def.node:
        if node.op == EMULATED_OP or node.op == STREAM_WAIT_OP:
            continue
        for index, text in enumerate(node.input):
            name, slot, control = parse_input(text)
            if not control and (name, slot) in renamed:
                node.input[index] = renamed[(name, slot)]
    return new_graph_def, len(consumed)
