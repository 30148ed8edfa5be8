"""Which ops an emulated accelerator takes over, and how long each takes there.

The emulation replaces the *heavy compute* of the workers: every op on a non-PS device
whose FLOPs or bytes moved are above a threshold, with floating-point outputs of static
shape. What stays real:

- anything on a PS device (reads, updates) or colocated with a stateful node (a
  variable's initializer and updates);
- Horovod's and TensorFlow's collectives (not stateful to TensorFlow, but the
  communication being measured), stateful ops (variables and their reads, input
  pipelines, random numbers) and ops reading resources, variants or strings, except the
  optimizer's updates of variables on a worker (Horovod's replicated weights: on a GPU
  cluster the update is GPU work), emulated as memory-bound ops that leave the variable
  as it was;
- control flow (Switch, Merge, Enter, Exit, NextIteration, LoopCond) and every op with a
  non-floating output (predicates, shapes, indices);
- feeds, fetches and kept nodes, views (Reshape, Identity ...), constants, tfoverlap's
  own nodes, and small ops.

Durations come from a :class:`~tfoverlap.costs.accelerators.DeviceModel`, times the
dilation (see docs/benchmarks.md: the testbed divides link rates by the same factor).
Streams are dealt out in turn; a kernel that reads another stream's kernel waits for its
end (:func:`wait_across_streams`).
"""
from __future__ import annotations

import dataclasses
import math

from tfoverlap.costs.accelerators import DeviceModel, load_device_model
from tfoverlap.costs.static import OpShapes, static_costs
from tfoverlap.graph.devices import DeviceMatcher
from tfoverlap.graph.model import dtype_bytes, parse_input
from tfoverlap.rewriters.emulated_ops import (EMULATED_OP, STREAM_WAIT_OP, Emulation,
                                              replace_with_emulated_ops)

__all__ = ["EmulationPlan", "plan_emulation", "emulate_until_done", "wait_across_streams",
           "emulated_op_seconds", "MIN_FLOPS", "MIN_BYTES"]

#: an op is heavy with at least this many FLOPs ...
MIN_FLOPS = 1e6
#: ... or this many bytes of inputs and outputs (about 10-20 µs of a host core).
MIN_BYTES = 256 * 2 ** 10

_FLOATING = frozenset({1, 2, 14, 19})            # float, double, bfloat16, half
_RESOURCE = 20
_OPAQUE = frozenset({7, _RESOURCE, 21})          # string, resource, variant
_KEPT_OPS = frozenset({
    STREAM_WAIT_OP,
    "Switch", "Merge", "Enter", "Exit", "NextIteration", "LoopCond", "RefSwitch",
    "RefMerge", "RefEnter", "RefExit", "RefNextIteration",
    "Placeholder", "PlaceholderWithDefault", "_Arg", "_Retval", "Const", "HostConst",
    "Identity", "IdentityN", "Snapshot", "StopGradient", "PreventGradient", "Reshape",
    "Squeeze", "ExpandDims", "Shape", "ShapeN", "Size", "Rank", "NoOp", "ZerosLike",
    "OnesLike", "Fill", "BroadcastTo", "_Send", "_Recv", "_HostSend", "_HostRecv",
    EMULATED_OP})
_OWN_PREFIX = "tfoverlap/"
#: communication ops, which TensorFlow does not mark stateful (Horovod's are not).
_COLLECTIVE_PREFIXES = ("Horovod", "Collective", "Nccl", "_Nccl")
#: outputs whose static shape TensorFlow leaves open, though the CPU kernel always gives
#: this one (the reserve space of training batch norm, which only cuDNN uses; also in the
#: batch norm + activation that Grappler's remapper fuses before TfOverlap runs).
_CPU_OUTPUT_SHAPES = {("FusedBatchNormV3", 5): (0,), ("_FusedBatchNormEx", 5): (0,)}


@dataclasses.dataclass
class EmulationPlan:
    device: DeviceModel
    dilation: float
    emulations: list[Emulation]
    emulated_seconds: dict        # device -> emulated compute seconds per step (undilated)
    original_ops: dict            # op type -> how many were replaced
    kept_heavy: int               # heavy ops that had to stay real (no static shape ...)


def _work(op_type: str, shapes: OpShapes) -> tuple[float, float]:
    """(FLOPs, bytes moved) of one op; TensorFlow's FLOP statistics, else for the fused
    ops Grappler's remapper creates a count from their shapes."""
    moved = (shapes.input_bytes or 0) + sum(
        math.prod(dims) * dtype_bytes(dtype)
        for dims, dtype in zip(shapes.output_shapes, shapes.output_dtypes) if dims is not None)
    flops = shapes.flops or 0
    if not flops and shapes.output_shapes and shapes.output_shapes[0] is not None:
        out = math.prod(shapes.output_shapes[0])
        inputs = shapes.input_shapes
        if op_type == "_FusedConv2D" and len(inputs) > 1 and inputs[1] and len(inputs[1]) == 4:
            kernel_h, kernel_w, channels_in, _ = inputs[1]
            flops = 2 * out * kernel_h * kernel_w * channels_in
        elif op_type == "_FusedMatMul" and len(inputs) > 1 and inputs[0] and inputs[1] and out:
            inner = math.sqrt(math.prod(inputs[0]) * math.prod(inputs[1]) / out)
            flops = 2 * out * inner
    return float(flops), float(moved)


def _with_stateful(node, ops: dict) -> bool:
    """Colocated with a stateful node (a variable's initializer or update)."""
    for text in node.attr["_class"].list.s if "_class" in node.attr else ():
        target = ops.get(text.decode().removeprefix("loc:@"))
        if target is None or target.stateful:
            return True
    return False


def _is_update(node, shapes: OpShapes) -> bool:
    """An optimizer's update of resource variables (ResourceApplyAdam, ...): no outputs."""
    return node.op.startswith("ResourceApply") and not shapes.output_dtypes


def _update_bytes(shapes: OpShapes) -> float:
    """An update reads and writes the variable and each slot, and reads the gradient:
    about 2 x (1 + slots) + 1 times the gradient's bytes (the largest static input)."""
    gradient = max((math.prod(dims) * dtype_bytes(dtype)
                    for dims, dtype in zip(shapes.input_shapes, shapes.input_dtypes)
                    if dims is not None and dtype not in _OPAQUE), default=0)
    slots = max(0, sum(1 for dtype in shapes.input_dtypes if dtype == _RESOURCE) - 1)
    return float(gradient * (2 * (1 + slots) + 1))


def _emulable(node, shapes: OpShapes | None, is_ps, preserved, ops: dict) -> bool:
    if (shapes is None or node.op in _KEPT_OPS or node.op.startswith(_COLLECTIVE_PREFIXES)
            or node.name.startswith(_OWN_PREFIX) or node.name in preserved
            or is_ps(node.device)):
        return False
    if _is_update(node, shapes):
        return True          # colocated with its own variable
    if shapes.stateful or _with_stateful(node, ops):
        return False
    if not shapes.output_dtypes or any(d not in _FLOATING for d in shapes.output_dtypes):
        return False
    return not any(d in _OPAQUE or d > 100 for d in shapes.input_dtypes)


def plan_emulation(graph_def, options, preserved=()) -> EmulationPlan:
    """The emulated kernels for ``graph_def`` under ``options.emulate`` (a device name or
    file), ``options.dilation`` and ``options.emulate_streams``."""
    device = load_device_model(options.emulate)
    costs = static_costs(graph_def, 1e12)
    is_ps = DeviceMatcher(options.ps_devices)
    preserved = set(preserved)
    emulations, seconds, originals, kept_heavy = [], {}, {}, 0
    for node in graph_def.node:
        shapes = costs.ops.get(node.name)
        if shapes is None or node.op == EMULATED_OP:
            continue
        flops, moved = _work(node.op, shapes)
        if _is_update(node, shapes):
            moved = _update_bytes(shapes)
        if flops < MIN_FLOPS and moved < MIN_BYTES and node.name not in device.op_seconds:
            continue
        if not _emulable(node, shapes, is_ps, preserved, costs.ops):
            continue
        output_shapes = tuple(_CPU_OUTPUT_SHAPES.get((node.op, slot), dims) if dims is None
                              else dims for slot, dims in enumerate(shapes.output_shapes))
        if any(dims is None for dims in output_shapes):
            kept_heavy += 1
            continue
        duration = device.op_time(node.name, node.op, flops, moved)
        emulations.append(Emulation(
            node.name, shapes.input_dtypes, shapes.output_dtypes, output_shapes,
            duration * options.dilation, stream=len(emulations) % options.emulate_streams))
        seconds[node.device] = seconds.get(node.device, 0.0) + duration
        originals[node.op] = originals.get(node.op, 0) + 1
    return EmulationPlan(device, options.dilation, emulations, seconds, originals, kept_heavy)


def emulate_until_done(graph_def, options, preserved=()) -> tuple[object, list[EmulationPlan]]:
    """(``graph_def`` with every emulable op emulated, the plan of each round).

    An emulated kernel declares its static output shapes, which can make shapes static
    downstream that TensorFlow's inference left open (batch norm's reserve space), and so
    make more ops emulable: planning repeats on the rewritten graph until nothing more is.
    """
    current, plans = graph_def, []
    for _ in range(_MAX_ROUNDS):
        plan = plan_emulation(current, options, preserved)
        plans.append(plan)
        if not plan.emulations:
            break
        # CPU semantics: the kernels share the executor's threads, whichever is free.
        current = replace_with_emulated_ops(
            current, plan.emulations, blocking=options.emulate_blocking,
            pool=options.emulate_streams if options.emulate_blocking else 0)
    return current, plans


_MAX_ROUNDS = 4


def wait_across_streams(graph_def) -> tuple[object, int]:
    """(``graph_def`` with each emulated kernel's ``after`` naming the non-blocking emulated
    kernels on other streams whose outputs it reads, how many kernels' ``after`` changed).

    A non-blocking kernel completes at launch, so without this its consumer on another
    stream would run while it still does; a GPU kernel waits for an event recorded after
    its producer. Producers on other devices are named too (a graph's device names are
    often partial); at run time a kernel waits only for those on its own device. A copy
    where any ``after`` changes, else ``graph_def`` itself.
    """
    from tensorflow.core.framework import graph_pb2
    kernels = {node.name: node for node in graph_def.node if node.op == EMULATED_OP}
    streams = {name: (node.device, _attr(node, "stream").i) for name, node in kernels.items()}
    launched = {name for name, node in kernels.items() if not _attr(node, "blocking").b}
    changed = {}
    for name, node in kernels.items():
        producers = list(dict.fromkeys(
            producer for producer, _, control in map(parse_input, node.input)
            if not control and producer in launched and streams[producer] != streams[name]))
        if producers != [text.decode() for text in _attr(node, "after").list.s]:
            changed[name] = producers
    if not changed:
        return graph_def, 0
    new_graph_def = graph_pb2.GraphDef()
    new_graph_def.CopyFrom(graph_def)
    for node in new_graph_def.node:
        if node.name in changed:
            del node.attr["after"].list.s[:]
            node.attr["after"].list.s.extend(text.encode() for text in changed[node.name])
    return new_graph_def, len(changed)


def _attr(node, name: str):
    """``node``'s attr ``name``, its default (empty) where absent, without adding it."""
    from tensorflow.core.framework import attr_value_pb2
    return node.attr[name] if name in node.attr else attr_value_pb2.AttrValue()


def emulated_op_seconds(graph_def, options) -> tuple[dict, str]:
    """(node -> seconds, a description) of the ops the emulate pass will replace, as they
    will run (dilation applied), and of the kernels it already put in ``graph_def`` (their
    own durations, and none for its stream waits, which only forward tensors: Grappler runs
    the passes again on the graph its first round emulated); ({}, "") where there are
    neither. TicTac and Caramel plan on the original graph, with these times for the ops
    that will be emulated."""
    emulated = {node.name: (node.attr["duration_us"].f * 1e-6 if node.op == EMULATED_OP
                            else 0.0)
                for node in graph_def.node if node.op in (EMULATED_OP, STREAM_WAIT_OP)}
    kernels = sum(node.op == EMULATED_OP for node in graph_def.node)
    described = f"{kernels} emulated kernels' own durations" if emulated else ""
    if not options.emulate:
        return emulated, described
    _, plans = emulate_until_done(graph_def, options)
    planned = {emulation.node: emulation.seconds for plan in plans
               for emulation in plan.emulations}
    if planned or not emulated:
        described = f"emulated {plans[0].device.name} x{options.dilation:g}" + (
            f" and {described}" if emulated else "")
    return {**emulated, **planned}, described
