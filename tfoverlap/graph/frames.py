"""Control flow as TensorFlow's executor sees it: when a node can be dead, over the
while-loop frames of the graph model.

TF1 control flow (and functional ``If``/``While`` once lowered) is made of Switch, Merge,
Enter, Exit and NextIteration. A Switch sends its input to one output and a *dead* tensor
to the other; deadness flows through every op but Merge (live when any input is live). An
Enter starts a child frame (a while loop), an Exit returns to the parent. A control edge
between frames, or from an op that may be dead to one that never is, hangs a step or kills
its fetches. A rewrite therefore only adds edges between *plain* nodes: in the root frame
and live in every step.

Deadness is tracked as the Switch outputs a node needs: a conjunction of
``(predicate, port)`` literals, keyed by the predicate tensor (a lowered ``If`` gives each
input its own Switch on one predicate). A Merge of all sides of one predicate is live
whenever the rest of its inputs' conditions hold; any Merge the analysis cannot prove live
keeps every literal of its inputs, so "always live" is only ever claimed when it is true.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading

from tfoverlap.graph.model import (ENTER_OPS, EXIT_OPS, LOOP_BACK_EDGE_OPS, Frame, GraphError,
                                   GraphModel, parse_input)

__all__ = ["ControlFlow", "control_flow", "analysed", "remembering_analyses",
           "verify_control_flow", "has_control_flow",
           "SWITCH_OPS", "MERGE_OPS", "CONTROL_FLOW_OPS"]

SWITCH_OPS = frozenset({"Switch", "RefSwitch", "_SwitchN"})
MERGE_OPS = frozenset({"Merge", "RefMerge"})
CONTROL_FLOW_OPS = SWITCH_OPS | MERGE_OPS | ENTER_OPS | EXIT_OPS | LOOP_BACK_EDGE_OPS

# A condition is a frozenset of literals (predicate node id, its output slot, Switch port).
_NO_CONDITION: frozenset = frozenset()


@dataclasses.dataclass(frozen=True)
class ControlFlow:
    """Per node: the frame it runs in, the frame its outputs live in, and the Switch
    outputs it needs to be live (empty: live in every step)."""

    frame: list[Frame]
    output_frame: list[Frame]
    live_when: list[frozenset]
    switch_predicate: dict      # Switch node id -> (predicate node id, slot)

    def output_condition(self, node: int, slot: int) -> frozenset:
        """What output ``slot`` of ``node`` needs to be live (a data edge's deadness)."""
        predicate = self.switch_predicate.get(node)
        if predicate is not None and slot >= 0:
            return self.live_when[node] | {(*predicate, slot)}
        return self.live_when[node]

    def is_plain(self, node: int) -> bool:
        """Runs in the root frame, outputs there, and is live in every step: a node that
        may wait for, or be waited for by, another plain node."""
        return (not self.frame[node] and not self.output_frame[node]
                and not self.live_when[node] and node not in self.switch_predicate)

    def is_plain_output(self, node: int, slot: int) -> bool:
        """A tensor of the root frame that exists in every step (an Exit's output is one,
        when the loop itself always runs)."""
        return not self.output_frame[node] and not self.output_condition(node, slot)

    def why_not_plain(self, node: int) -> str:
        """A short reason for reports: "in a while loop", "in a cond branch" or ""."""
        if self.frame[node] or self.output_frame[node]:
            return "in a while loop"
        return ("in a cond branch" if self.live_when[node] or node in self.switch_predicate
                else "")


def _merge_condition(conditions: list[frozenset], arity: dict) -> frozenset:
    """Live when any input is. Proven when an input needs no more than the others have in
    common, or when the inputs differ only in the port of one predicate and cover all its
    ports; otherwise every literal is kept (never claimed live more often than it is)."""
    if not conditions:
        return _NO_CONDITION
    common = frozenset.intersection(*conditions)
    residuals = [c - common for c in conditions]
    if any(not r for r in residuals):
        return common
    if all(len(r) == 1 for r in residuals):
        literals = [next(iter(r)) for r in residuals]
        predicates = {literal[:2] for literal in literals}
        if len(predicates) == 1:
            predicate = predicates.pop()
            if {literal[2] for literal in literals} >= set(range(arity[predicate])):
                return common
    return frozenset.union(*conditions)


_FORWARDING_OPS = frozenset({"Identity", "RefIdentity", "Snapshot"})


def _predicate(model: GraphModel, node: int) -> tuple[int, int]:
    """The tensor a Switch decides on, looking through Identities (so that the Switches of
    one lowered cond, each with its own copy of the predicate, agree)."""
    producer, slot = model.data_inputs[node][1]
    for _ in range(32):
        if model.ops[producer] not in _FORWARDING_OPS or not model.data_inputs[producer]:
            break
        producer, slot = model.data_inputs[producer][0]
    return producer, slot


def has_control_flow(graph_def) -> bool:
    """Whether the graph holds TF1 control flow (functional If/While are plain ops)."""
    return any(node.op in CONTROL_FLOW_OPS for node in graph_def.node)


_remembered = threading.local()


@contextlib.contextmanager
def remembering_analyses():
    """Within this block (one pipeline run, whose graphs are never changed in place) the
    latest analysis of this thread is reused: a pass and the verification of its output
    both analyse the pass's input."""
    _remembered.last = None
    _remembered.active = True
    try:
        yield
    finally:
        _remembered.active = False
        _remembered.last = None


def analysed(graph_def) -> tuple[GraphModel, "ControlFlow"]:
    """(model, control flow) of ``graph_def`` (see :func:`remembering_analyses`)."""
    last = getattr(_remembered, "last", None)
    if last is not None and last[0] is graph_def:
        return last[1], last[2]
    model = GraphModel.from_graph_def(graph_def)
    flow = control_flow(model, graph_def)
    if getattr(_remembered, "active", False):
        _remembered.last = (graph_def, model, flow)
    return model, flow


def control_flow(model: GraphModel, graph_def) -> ControlFlow:
    """Deadness of every node, over the model's frames (loop back-edges aside)."""
    num_nodes = model.num_nodes
    frame, output_frame = model.frame, model.output_frame
    live_when: list[frozenset] = [_NO_CONDITION] * num_nodes
    if not any(op in CONTROL_FLOW_OPS for op in model.ops):
        return ControlFlow(frame, output_frame, live_when, {})
    switch_predicate, arity = {}, {}
    for v in range(num_nodes):
        if model.ops[v] in SWITCH_OPS and len(model.data_inputs[v]) >= 2:
            predicate = switch_predicate[v] = _predicate(model, v)
            outputs = graph_def.node[v].attr["num_outs"].i if model.ops[v] == "_SwitchN" else 2
            arity[predicate] = max(arity.get(predicate, 0), outputs)
    flow = ControlFlow(frame, output_frame, live_when, switch_predicate)
    for node in model.topological_order():
        forward = set(model.predecessors(node))     # loop back-edges left out
        data = [(p, s) for p, s in model.data_inputs[node] if p in forward]
        control = [p for p in model.control_inputs[node] if p in forward]
        data_conditions = [flow.output_condition(p, s) for p, s in data]
        control_conditions = [live_when[p] for p in control]
        if model.ops[node] in MERGE_OPS:
            condition = _merge_condition(data_conditions, arity).union(*control_conditions)
        else:
            condition = _NO_CONDITION.union(*data_conditions, *control_conditions)
        if model.ops[node] in EXIT_OPS and frame[node]:
            # The loop's own predicates decide iterations, not whether the loop ran.
            condition = frozenset(literal for literal in condition
                                  if frame[literal[0]][:len(frame[node])] != frame[node])
        live_when[node] = condition
    return flow


def verify_control_flow(before, after, after_model: GraphModel | None = None) -> None:
    """What a rewrite must keep: every node of ``before`` that is still in ``after`` runs
    in the same frame, and one that was live in every step still is; every edge ``after``
    adds joins two nodes of one frame.

    Raises:
      GraphError: naming the first node or edge that breaks this.
    """
    if not has_control_flow(before) and not has_control_flow(after):
        return
    old_model, old_flow = analysed(before)
    new_model = after_model or GraphModel.from_graph_def(after)
    new_flow = control_flow(new_model, after)
    conflicts = set(new_model.frame_conflicts) - {
        new_model.index.get(old_model.names[v]) for v in old_model.frame_conflicts}
    if conflicts:
        raise GraphError(f"node {new_model.names[min(conflicts)]!r} now has inputs from "
                         "different while-loop frames")
    for name, old in old_model.index.items():
        new = new_model.index.get(name)
        if new is None:
            continue
        if old_flow.frame[old] != new_flow.frame[new]:
            raise GraphError(f"node {name!r} moved from while-loop frame "
                             f"{old_flow.frame[old]} to {new_flow.frame[new]}")
        if not old_flow.live_when[old] and new_flow.live_when[new]:
            raise GraphError(f"node {name!r}, live in every step before, may now be dead "
                             "(it waits for an op in a cond branch)")
    for node in range(new_model.num_nodes):
        old = old_model.index.get(new_model.names[node])
        old_inputs = set(before.node[old].input) if old is not None else set()
        for text in after.node[node].input:
            if text in old_inputs:
                continue
            producer = new_model.index[parse_input(text)[0]]
            if new_flow.output_frame[producer] != new_flow.frame[node]:
                raise GraphError(f"the edge {text!r} -> {new_model.names[node]!r} crosses "
                                 "a while-loop frame")

