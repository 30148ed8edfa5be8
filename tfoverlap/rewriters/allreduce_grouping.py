"""Horovod AllReduce ops rewritten into planned buckets, and the rank agreement check.

A bucket becomes one ``HorovodGroupedAllreduce`` node: Horovod negotiates and reduces its
tensors as one request, and TensorFlow issues it the moment its last input exists. A
gradient split into pieces is flattened, cut with ``SplitV``, its pieces reduced in their
buckets, and joined and reshaped back; consumers of the old ``HorovodAllreduce`` read the
bucket's output (or the joined tensor) instead, so every update waits only for the
bucket(s) of its own gradient.

The plan check makes a rank never start a bucket of a plan the other ranks do not share:
each rank reduces (MAX) a fixed-length vector describing its plan, and its negation; if
the maximum and minimum differ anywhere, an ``Assert`` that every bucket waits for fails on
every rank with a message, instead of the ranks waiting forever for each other's buckets.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

__all__ = ["CARAMEL_ATTR", "PREFIX", "CHECK_LENGTH", "GROUP_ATTRS", "BucketPieces",
           "free_prefix", "group_allreduces", "add_plan_check", "is_plan_check"]

CARAMEL_ATTR = "_tfoverlap_caramel"
PREFIX = "tfoverlap/caramel/"
CHECK_LENGTH = 64
GROUP_ATTRS = ("T", "reduce_op", "prescale_factor", "postscale_factor", "process_set_id",
               "ignore_name_scope")
_MAX = 4           # horovod's ReduceOp.MAX
_INT32, _INT64, _BOOL, _STRING = 3, 9, 10, 7


@dataclasses.dataclass(frozen=True)
class BucketPieces:
    """One planned request: (AllReduce node name, piece index) per member, in order."""

    members: tuple[tuple[str, int], ...]


def free_prefix(graph_def) -> str:
    """:data:`PREFIX`, or ``tfoverlap/caramel_N/`` if a node already uses it (a second
    optimizer in the same graph)."""
    used = {node.name.split("/")[1] for node in graph_def.node
            if node.name.startswith("tfoverlap/") and node.name.count("/") >= 2}
    base, number = PREFIX.rstrip("/").split("/")[1], 0
    name = base
    while name in used:
        number += 1
        name = f"{base}_{number}"
    return f"tfoverlap/{name}/"


def _set_attr_from(target, source, names) -> None:
    for name in names:
        if name in source.attr:
            target.attr[name].CopyFrom(source.attr[name])


def _const(graph_def, name: str, device: str, dtype: int, values: Sequence, shape=None):
    node = graph_def.node.add(name=name, op="Const", device=device)
    node.attr["dtype"].type = dtype
    tensor = node.attr["value"].tensor
    tensor.dtype = dtype
    dims = [len(values)] if shape is None else shape
    for size in dims:
        tensor.tensor_shape.dim.add(size=size)
    if dtype == _INT32:
        tensor.int_val.extend(int(v) for v in values)
    elif dtype == _INT64:
        tensor.int64_val.extend(int(v) for v in values)
    elif dtype == _STRING:
        tensor.string_val.extend(v.encode() for v in values)
    node.attr[CARAMEL_ATTR].b = True
    return node


def _node(graph_def, name: str, op: str, inputs: Sequence[str], device: str):
    node = graph_def.node.add(name=name, op=op, device=device)
    node.input.extend(inputs)
    node.attr[CARAMEL_ATTR].b = True
    return node


def _retarget(text: str, replacement: dict[str, str]) -> str:
    if text.startswith("^"):
        target = replacement.get(text[1:])
        return "^" + target.split(":")[0] if target else text
    name, _, slot = text.partition(":")
    if name in replacement and slot in ("", "0"):
        return replacement[name]
    return text


def group_allreduces(graph_def, buckets: Sequence[BucketPieces],
                     piece_elements: dict[str, list[int]], prefix: str = PREFIX):
    """A copy of ``graph_def`` with its HorovodAllreduce nodes reduced as ``buckets``.

    ``piece_elements[name]`` lists the element counts of the pieces of a split gradient
    (the last piece takes whatever remains); gradients not in it are one piece. Every
    AllReduce node named in a bucket must be a ``HorovodAllreduce``, and the members of one
    bucket must agree on :data:`GROUP_ATTRS` and device. New nodes are named under
    ``prefix``, which names Horovod's requests too (the same on every rank).

    Raises:
      ValueError: a bucket names an unknown node, mixes attributes, or a piece is missing.
    """
    rewritten = type(graph_def)()
    rewritten.CopyFrom(graph_def)
    nodes = {node.name: node for node in rewritten.node}
    named = [name for bucket in buckets for name, _ in bucket.members]
    for name in named:
        if name not in nodes or nodes[name].op != "HorovodAllreduce":
            raise ValueError(f"bucket member {name!r} is not a HorovodAllreduce node")
    pieces: dict[tuple[str, int], str] = {}
    for index, name in enumerate(dict.fromkeys(named)):
        source, device = nodes[name].input[0], nodes[name].device
        counts = piece_elements.get(name)
        if not counts or len(counts) < 2:
            pieces[(name, 0)] = source
            continue
        scope = f"{prefix}split_{index}/"
        _const(rewritten, scope + "flat_shape", device, _INT32, [-1])
        flat = _node(rewritten, scope + "flat", "Reshape", [source, scope + "flat_shape"],
                     device)
        _set_attr_from(flat, nodes[name], ["T"])
        flat.attr["Tshape"].type = _INT32
        _const(rewritten, scope + "sizes", device, _INT64, list(counts[:-1]) + [-1])
        _const(rewritten, scope + "axis", device, _INT32, [0], shape=[])
        split = _node(rewritten, scope + "pieces", "SplitV",
                      [flat.name, scope + "sizes", scope + "axis"], device)
        _set_attr_from(split, nodes[name], ["T"])
        split.attr["Tlen"].type = _INT64
        split.attr["num_split"].i = len(counts)
        for piece in range(len(counts)):
            pieces[(name, piece)] = f"{split.name}:{piece}"
    outputs: dict[tuple[str, int], str] = {}
    for number, bucket in enumerate(buckets):
        first = nodes[bucket.members[0][0]]
        key = [first.attr[a].SerializeToString() if a in first.attr else b""
               for a in GROUP_ATTRS] + [first.device]
        for name, _ in bucket.members:
            member = nodes[name]
            other = [member.attr[a].SerializeToString() if a in member.attr else b""
                     for a in GROUP_ATTRS] + [member.device]
            if other != key:
                raise ValueError(f"bucket {number} mixes AllReduce attributes or devices "
                                 f"({first.name!r} and {name!r})")
        inputs = []
        for member in bucket.members:
            if member not in pieces:
                raise ValueError(f"bucket {number} names piece {member[1]} of {member[0]!r}, "
                                 "which has no such piece")
            inputs.append(pieces[member])
        controls = dict.fromkeys(text for name, _ in bucket.members
                                 for text in nodes[name].input if text.startswith("^"))
        grouped = _node(rewritten, f"{prefix}bucket_{number}", "HorovodGroupedAllreduce",
                        inputs + list(controls), first.device)
        _set_attr_from(grouped, first, GROUP_ATTRS)
        grouped.attr["num_tensors"].i = len(inputs)
        for slot, member in enumerate(bucket.members):
            outputs[member] = f"{grouped.name}:{slot}"
    replacement: dict[str, str] = {}
    for index, name in enumerate(dict.fromkeys(named)):
        counts = piece_elements.get(name)
        if not counts or len(counts) < 2:
            replacement[name] = outputs[(name, 0)]
            continue
        scope = f"{prefix}split_{index}/"
        device = nodes[name].device
        missing = [p for p in range(len(counts)) if (name, p) not in outputs]
        if missing:
            raise ValueError(f"piece {missing[0]} of {name!r} is in no bucket")
        joined = _node(rewritten, scope + "joined", "ConcatV2",
                       [outputs[(name, p)] for p in range(len(counts))] + [scope + "axis"],
                       device)
        _set_attr_from(joined, nodes[name], ["T"])
        joined.attr["N"].i = len(counts)
        joined.attr["Tidx"].type = _INT32
        shape = _node(rewritten, scope + "shape", "Shape", [nodes[name].input[0]], device)
        _set_attr_from(shape, nodes[name], ["T"])
        shape.attr["out_type"].type = _INT32
        restored = _node(rewritten, scope + "restored", "Reshape", [joined.name, shape.name],
                         device)
        _set_attr_from(restored, nodes[name], ["T"])
        restored.attr["Tshape"].type = _INT32
        replacement[name] = restored.name
    gone = set(named)
    kept = [node for node in rewritten.node if node.name not in gone]
    del rewritten.node[:]
    rewritten.node.extend(kept)
    for node in rewritten.node:
        inputs = [_retarget(text, replacement) for text in node.input]
        if inputs != list(node.input):
            data = [text for text in inputs if not text.startswith("^")]
            control = list(dict.fromkeys(t for t in inputs if t.startswith("^")))
            del node.input[:]
            node.input.extend(data + control)
    return rewritten


def is_plan_check(node_name: str) -> bool:
    """Whether ``node_name`` is a node of a plan check (under any prefix)."""
    return node_name.startswith("tfoverlap/") and "/plan_check/" in node_name


def add_plan_check(graph_def, vector: Sequence[int], message: str, gated: Sequence[str],
                   device: str, prefix: str = PREFIX):
    """Adds the rank agreement check for a plan described by ``vector`` (CHECK_LENGTH
    int32 values); every node in ``gated`` waits for it. Modifies ``graph_def`` in place."""
    if len(vector) != CHECK_LENGTH:
        raise ValueError(f"the plan check needs {CHECK_LENGTH} values, got {len(vector)}")
    scope = prefix + "plan_check/"
    # Grappler's constant folding would run an AllReduce of constants at optimization
    # time, on each rank on its own; a zero drawn from a stateful op keeps it in the step.
    _const(graph_def, scope + "scalar_shape", device, _INT32, [], shape=[0])
    draw = _node(graph_def, scope + "draw", "RandomUniform", [scope + "scalar_shape"], device)
    draw.attr["dtype"].type = 1
    draw.attr["T"].type = _INT32
    draw.attr["seed"].i = 0
    draw.attr["seed2"].i = 0
    floor = _node(graph_def, scope + "zero_float", "Floor", [draw.name], device)
    floor.attr["T"].type = 1
    zero = _node(graph_def, scope + "zero", "Cast", [floor.name], device)
    zero.attr["SrcT"].type = 1
    zero.attr["DstT"].type = _INT32
    zero.attr["Truncate"].b = False
    _const(graph_def, scope + "plan", device, _INT32, list(vector))
    local = _node(graph_def, scope + "local", "AddV2", [scope + "plan", zero.name], device)
    local.attr["T"].type = _INT32
    negated = _node(graph_def, scope + "local_neg", "Neg", [local.name], device)
    negated.attr["T"].type = _INT32
    reduced = []
    for label, source in (("max", local.name), ("neg_max", negated.name)):
        node = _node(graph_def, scope + label, "HorovodAllreduce", [source], device)
        node.attr["T"].type = _INT32
        node.attr["reduce_op"].i = _MAX
        node.attr["prescale_factor"].f = 1.0
        node.attr["postscale_factor"].f = 1.0
        node.attr["ignore_name_scope"].b = False
        node.attr["process_set_id"].i = 0
        reduced.append(node.name)
    minimum = _node(graph_def, scope + "min", "Neg", [reduced[1]], device)
    minimum.attr["T"].type = _INT32
    same = _node(graph_def, scope + "same", "Equal", [reduced[0], minimum.name], device)
    same.attr["T"].type = _INT32
    same.attr["incompatible_shape_error"].b = True
    _const(graph_def, scope + "axis", device, _INT32, [0], shape=[])
    agree = _node(graph_def, scope + "agree", "All", [same.name, scope + "axis"], device)
    agree.attr["Tidx"].type = _INT32
    agree.attr["keep_dims"].b = False
    as_int = _node(graph_def, scope + "same_int", "Cast", [same.name], device)
    as_int.attr["SrcT"].type = _BOOL
    as_int.attr["DstT"].type = _INT32
    as_int.attr["Truncate"].b = False
    first = _node(graph_def, scope + "first_difference", "ArgMin",
                  [as_int.name, scope + "axis"], device)
    first.attr["T"].type = _INT32
    first.attr["Tidx"].type = _INT32
    first.attr["output_type"].type = _INT64
    _const(graph_def, scope + "message", device, _STRING, [message], shape=[])
    check = _node(graph_def, scope + "assert", "Assert",
                  [agree.name, scope + "message", first.name], device)
    check.attr["T"].list.type.extend([_STRING, _INT64])
    check.attr["summarize"].i = 3
    by_name = {node.name: node for node in graph_def.node}
    for name in gated:
        by_name[name].input.append("^" + check.name)
    return check.name
