"""From a GraphDef to plain ids and lists: the graph model every planner works on.

Algorithms never see protobufs: they get a :class:`GraphModel` whose nodes are integers
0..n-1 with their name, op, device and inputs. Only the graph layer and the rewriters read
or write ``GraphDef`` fields.
"""
from __future__ import annotations

import dataclasses

__all__ = ["GraphError", "GraphModel", "is_variable_op", "parse_input", "dtype_bytes",
           "edge_bytes", "output_dtype", "tensor_bytes", "LOOP_BACK_EDGE_OPS", "RESOURCE_HANDLE_OPS",
           "ENTER_OPS", "EXIT_OPS", "Frame"]

# Edges out of these ops close TF1 while loops; they are not ordering constraints.
LOOP_BACK_EDGE_OPS = frozenset({"NextIteration", "RefNextIteration"})
ENTER_OPS = frozenset({"Enter", "RefEnter"})
EXIT_OPS = frozenset({"Exit", "RefExit"})
Frame = tuple  # () is the root frame; one name per nested while loop
# Ops that TensorFlow's placer does not move to the device of their resource inputs: they
# pass the handles on to the ops of their bodies, which are placed one by one.
COLOCATION_EXEMPT_OPS = frozenset({"If", "StatelessIf", "While", "StatelessWhile", "Case",
                                   "StatelessCase", "PartitionedCall",
                                   "StatefulPartitionedCall"})
# Producers whose outputs are resource handles rather than data.
RESOURCE_HANDLE_OPS = frozenset({"VarHandleOp", "_VarHandlesOp", "HashTableV2",
                                 "MutableHashTableV2"})


def is_variable_op(op: str) -> bool:
    """Whether ``op`` makes a variable (a resource handle or a TF1 ref variable)."""
    return op in RESOURCE_HANDLE_OPS or op in ("VariableV2", "Variable")


class GraphError(ValueError):
    """The graph is not a well-formed dataflow graph (dangling input, cycle, ...)."""


def parse_input(text: str) -> tuple[str, int, bool]:
    """Splits a NodeDef input string into (node name, output slot, is_control)."""
    if text.startswith("^"):
        return text[1:], -1, True
    name, sep, slot = text.rpartition(":")
    if sep and slot.isdigit():
        return name, int(slot), False
    return text, 0, False


@dataclasses.dataclass
class GraphModel:
    """A GraphDef's nodes as integers.

    data_inputs[v]:    (producer id, output slot) per data input, in input order.
    control_inputs[v]: producer ids of control inputs.
    frame[v]:          the while-loop frame v runs in (() is the root frame), as
                       TensorFlow's executor sees it; output_frame[v] where its outputs
                       live (a child frame for Enter, the parent for Exit).
    loop_results[v]:   for an Exit, the NextIteration nodes of its loop: what the body
                       computes reaches the Exit only through the loop's back edges, so
                       dependencies count these as its inputs.
    """

    names: list[str]
    ops: list[str]
    devices: list[str]
    data_inputs: list[list[tuple[int, int]]]
    control_inputs: list[list[int]]
    index: dict[str, int]
    frame: list[Frame] = dataclasses.field(default_factory=list)
    output_frame: list[Frame] = dataclasses.field(default_factory=list)
    loop_results: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    frame_conflicts: list[int] = dataclasses.field(default_factory=list)
    _predecessors: list | None = dataclasses.field(default=None, repr=False, compare=False)
    _successors: list | None = dataclasses.field(default=None, repr=False, compare=False)
    _data_consumers: list | None = dataclasses.field(default=None, repr=False, compare=False)
    _order: list | None = dataclasses.field(default=None, repr=False, compare=False)

    @classmethod
    def from_graph_def(cls, graph_def) -> "GraphModel":
        """Raises GraphError on a dangling input or a duplicate node name."""
        nodes = graph_def.node
        names = [node.name for node in nodes]
        index = {name: i for i, name in enumerate(names)}
        if len(index) != len(names):
            seen: set[str] = set()
            duplicate = next(name for name in names if name in seen or seen.add(name))
            raise GraphError(f"node name {duplicate!r} appears twice")
        data_inputs: list[list[tuple[int, int]]] = []
        control_inputs: list[list[int]] = []
        for node in nodes:
            data, control = [], []
            for text in node.input:
                name, slot, is_control = parse_input(text)
                producer = index.get(name)
                if producer is None:
                    raise GraphError(f"node {node.name!r} has input {text!r}, "
                                     "which names no node of the graph")
                if is_control:
                    control.append(producer)
                else:
                    data.append((producer, slot))
            data_inputs.append(data)
            control_inputs.append(control)
        model = cls(names=names, ops=[n.op for n in nodes], devices=[n.device for n in nodes],
                    data_inputs=data_inputs, control_inputs=control_inputs, index=index)
        model._find_frames(graph_def)
        return model

    def _find_frames(self, graph_def) -> None:
        """Each node's frame; an Enter starts the child frame its ``frame_name`` names, an
        Exit returns to the parent. A node whose inputs come from different frames (not a
        graph TensorFlow can run) is listed in ``frame_conflicts``."""
        self.frame = [()] * self.num_nodes
        self.output_frame = [()] * self.num_nodes
        if not any(op in ENTER_OPS for op in self.ops):
            return
        for node in self.topological_order():
            frames = {self.output_frame[p] for p in self.predecessors(node)}
            if len(frames) > 1:
                self.frame_conflicts.append(node)
            self.frame[node] = min(frames, key=len) if frames else ()
            self.output_frame[node] = self.frame[node]
            if self.ops[node] in ENTER_OPS:
                attr = graph_def.node[node].attr.get("frame_name")
                name = attr.s.decode() if attr is not None else self.names[node]
                self.output_frame[node] = self.frame[node] + (name,)
            elif self.ops[node] in EXIT_OPS and self.frame[node]:
                self.output_frame[node] = self.frame[node][:-1]
        next_iterations: dict[Frame, list[int]] = {}
        for node in range(self.num_nodes):
            if self.ops[node] in LOOP_BACK_EDGE_OPS and self.frame[node]:
                next_iterations.setdefault(self.frame[node], []).append(node)
        self.loop_results = {node: next_iterations.get(self.frame[node], [])
                             for node in range(self.num_nodes)
                             if self.ops[node] in EXIT_OPS and self.frame[node]}
        self._predecessors = self._successors = self._order = None   # Exits' inputs changed

    @property
    def num_nodes(self) -> int:
        return len(self.names)

    def colocated_devices(self) -> list[str]:
        """Devices as TensorFlow's placer will see them for resource variables.

        An op that takes a resource handle runs where the resource lives, whatever device
        it asked for (a ReadVariableOp built under a worker's device scope still reads on
        the PS); functional control flow and function calls are exempt. Graphs that
        Grappler sees are placed already; offline graphs may not be.
        """
        devices = list(self.devices)
        for node in range(self.num_nodes):
            if self.ops[node] in COLOCATION_EXEMPT_OPS:
                continue
            for producer, _ in self.data_inputs[node]:
                if self.ops[producer] in RESOURCE_HANDLE_OPS and self.devices[producer]:
                    devices[node] = self.devices[producer]
                    break
        return devices

    def predecessors(self, node: int) -> list[int]:
        """Data and control producers of ``node``, loop back-edges excluded; an Exit also
        follows its loop's NextIteration nodes (see ``loop_results``). Computed once for
        all nodes: callers must not modify it."""
        if self._predecessors is None:
            back = {v for v, op in enumerate(self.ops) if op in LOOP_BACK_EDGE_OPS}
            everything = []
            for v in range(self.num_nodes):
                preds = [p for p, _ in self.data_inputs[v]] + self.control_inputs[v]
                if back:
                    preds = [p for p in preds if p not in back]
                everything.append(preds + self.loop_results[v] if v in self.loop_results
                                  else preds)
            self._predecessors = everything
        return self._predecessors[node]

    def successors(self) -> list[list[int]]:
        """Consumers of each node (data or control, loop back-edges excluded), deduplicated.
        Computed once: callers must not modify it."""
        if self._successors is None:
            succs: list[list[int]] = [[] for _ in self.names]
            for node in range(self.num_nodes):
                for pred in dict.fromkeys(self.predecessors(node)):
                    succs[pred].append(node)
            self._successors = succs
        return self._successors

    def data_consumers(self) -> list[list[int]]:
        """The nodes that take a data input from each node (computed once: callers must
        not modify it)."""
        if self._data_consumers is None:
            consumers: list[list[int]] = [[] for _ in self.names]
            for node in range(self.num_nodes):
                for producer in dict.fromkeys(p for p, _ in self.data_inputs[node]):
                    consumers[producer].append(node)
            self._data_consumers = consumers
        return self._data_consumers

    def topological_order(self) -> list[int]:
        """Kahn's order of all nodes (computed once: callers must not modify it).

        Raises:
          GraphError: the graph has a cycle; names a node on it.
        """
        if self._order is None:
            self._order = self._kahn_order()
        return self._order

    def _kahn_order(self) -> list[int]:
        succs = self.successors()
        indegree = [0] * self.num_nodes
        for node, consumers in enumerate(succs):
            for consumer in consumers:
                indegree[consumer] += 1
        ready = [v for v in range(self.num_nodes) if indegree[v] == 0]
        ready.reverse()
        order = []
        while ready:
            node = ready.pop()
            order.append(node)
            for consumer in succs[node]:
                indegree[consumer] -= 1
                if indegree[consumer] == 0:
                    ready.append(consumer)
        if len(order) != self.num_nodes:
            stuck = next(v for v in range(self.num_nodes) if indegree[v] > 0)
            raise GraphError(f"the graph has a cycle through node {self.names[stuck]!r}")
        return order


# Bytes per element of TensorFlow's DataType enum values (ref types are value + 100).
_DTYPE_BYTES = {1: 4, 2: 8, 3: 4, 4: 1, 5: 2, 6: 1, 8: 8, 9: 8, 10: 1, 14: 2, 17: 2, 18: 16,
                19: 2, 22: 4, 23: 8}
_VARIABLE_OPS = frozenset({"VariableV2", "Variable", "VarHandleOp"})
_PASS_THROUGH_OPS = frozenset({"Identity", "ReadVariableOp", "Snapshot"})


def dtype_bytes(dtype: int) -> int:
    """Bytes per element of a DataType enum value (4 if unknown)."""
    return _DTYPE_BYTES.get(dtype % 100, 4)


def _shape_elements(shape_proto) -> int | None:
    if shape_proto.unknown_rank:
        return None
    elements = 1
    for dim in shape_proto.dim:
        if dim.size < 0:
            return None
        elements *= dim.size
    return elements


def output_dtype(node_def) -> int | None:
    """DataType enum of a node's (first) output from its type attr, refs as plain types."""
    for key in ("dtype", "T", "out_type"):
        if key in node_def.attr and node_def.attr[key].WhichOneof("value") == "type":
            return node_def.attr[key].type % 100
    return None


def tensor_bytes(graph_def, model: GraphModel, node: int, slot: int = 0) -> int | None:
    """Static size of output ``slot`` of ``node`` in bytes, or None if unknown.

    Uses ``_output_shapes`` when present, else follows Identity/ReadVariableOp back to the
    variable whose ``shape`` and ``dtype`` attrs give the size, or, in a tf.function's
    graph, to the resource argument whose handle data (``_handle_shapes``) give it.
    """
    for _ in range(8):
        node_def = graph_def.node[node]
        attrs = node_def.attr
        dtype = output_dtype(node_def)
        if "_output_shapes" in attrs and dtype is not None:
            shapes = attrs["_output_shapes"].list.shape
            if slot < len(shapes):
                elements = _shape_elements(shapes[slot])
                if elements is not None and dtype in _DTYPE_BYTES:
                    return elements * _DTYPE_BYTES[dtype]
        if node_def.op == "Const" and "value" in attrs and dtype in _DTYPE_BYTES:
            elements = _shape_elements(attrs["value"].tensor.tensor_shape)
            return None if elements is None else elements * _DTYPE_BYTES[dtype]
        if node_def.op in _VARIABLE_OPS and "shape" in attrs and dtype is not None:
            elements = _shape_elements(attrs["shape"].shape)
            return None if elements is None or dtype not in _DTYPE_BYTES else (
                elements * _DTYPE_BYTES[dtype])
        if node_def.op == "_Arg" and "_handle_shapes" in attrs and "_handle_dtypes" in attrs:
            shapes, dtypes = attrs["_handle_shapes"].list.shape, attrs["_handle_dtypes"].list.type
            if len(shapes) != 1 or len(dtypes) != 1 or dtypes[0] not in _DTYPE_BYTES:
                return None
            elements = _shape_elements(shapes[0])
            return None if elements is None else elements * _DTYPE_BYTES[dtypes[0]]
        if node_def.op in _PASS_THROUGH_OPS and model.data_inputs[node]:
            node, slot = model.data_inputs[node][0]
            continue
        return None
    return None


#: ops that write the variable of their first input.
_VARIABLE_WRITES = frozenset({"AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp",
                              "Assign", "AssignAdd", "AssignSub"})
#: how many element-wise ops a pushed gradient may pass on the PS before its update.
_UPDATE_HOPS = 4


def _writes_variable(op: str) -> bool:
    return op in _VARIABLE_WRITES or op.startswith(("Apply", "ResourceApply"))


_RESOURCE_DTYPE = 20      # DT_RESOURCE


def is_variable_input(graph_def, model: GraphModel, node: int) -> bool:
    """A variable, or, in a tf.function's graph, a resource argument or the placeholder
    that captures a variable (a FuncGraph's own GraphDef)."""
    op, attr = model.ops[node], graph_def.node[node].attr
    if is_variable_op(op) or (op == "_Arg" and "_handle_shapes" in attr):
        return True
    dtype = attr.get("dtype" if op == "Placeholder" else "T")
    return op in ("Placeholder", "_Arg") and dtype is not None and \
        dtype.type == _RESOURCE_DTYPE


def edge_bytes(graph_def, model: GraphModel, producer: int, consumer: int,
               slot: int = 0) -> int | None:
    """Bytes that ``producer``'s output ``slot`` carries to ``consumer``: its static size,
    or for a gradient pushed to an update op whose shape is unknown, the size of the
    variable that op updates (None if neither is known). The update op may be the consumer
    or, as in Keras optimizers' updates (``m.assign(-gradient * lr + m * momentum)``),
    reached from it through a few ops on the consumer's device."""
    size = tensor_bytes(graph_def, model, producer, slot)
    if size is not None:
        return size
    for source, _ in model.data_inputs[consumer]:
        if is_variable_op(model.ops[source]):
            return tensor_bytes(graph_def, model, source)
    consumers = model.data_consumers()
    frontier, seen = [consumer], {consumer}
    for _ in range(_UPDATE_HOPS):
        following = []
        for node in frontier:
            if _writes_variable(model.ops[node]) and model.data_inputs[node]:
                variable = model.data_inputs[node][0][0]
                if is_variable_input(graph_def, model, variable):
                    return tensor_bytes(graph_def, model, variable)
            following += [c for c in consumers[node]
                          if c not in seen and model.devices[c] == model.devices[consumer]]
        seen.update(following)
        frontier = following
    return None
