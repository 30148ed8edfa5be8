"""Ordering constraints as control edges, marked so that a later run can find its own.

Each node that receives tfoverlap control inputs records their names in the attr
``_tfoverlap_gates``. A pass strips exactly those edges before it plans again, so running
it twice yields the same graph, and the edges of a user are never touched.

Grappler runs its optimizers again after TfOverlap's first run. Its dependency optimizer
would remove an arrival gate (an Identity whose only output is a control edge: dropping
it saves a cross-device edge) and hang the edge on the PS-side read instead, which orders
nothing; arrival gates therefore carry ``_grappler_do_not_remove``. It may also gather the
cross-device control inputs of a node into a NoOp of its own; stripping sees through those.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

__all__ = ["GATES_ATTR", "ARRIVAL_ATTR", "ARRIVAL_PREFIX", "strip_ordering_edges",
           "add_ordering_edges", "ArrivalNode"]

GATES_ATTR = "_tfoverlap_gates"
ARRIVAL_ATTR = "_tfoverlap_arrival"
ARRIVAL_PREFIX = "tfoverlap/arrived/"
DO_NOT_REMOVE_ATTR = "_grappler_do_not_remove"
GROUPED_EDGES_PREFIX = "GroupCrossDeviceControlEdges"    # Grappler's dependency optimizer


@dataclasses.dataclass(frozen=True)
class ArrivalNode:
    """A worker-side Identity (IdentityN for several) that runs as soon as its transfers
    have arrived (and no later).

    Its only use is as a gate: it consumes the transferred tensors on the destination
    device (TensorFlow receives a tensor once per device, so this adds no traffic).
    """

    name: str
    tensors: tuple[str, ...]   # the transferred tensors, "node" or "node:slot"
    device: str
    dtypes: tuple[int, ...]    # DataType enum of each tensor


def strip_ordering_edges(graph_def, keep: Iterable[str] = ()):
    """Returns (graph_def without tfoverlap's edges, number of edges removed).

    Arrival gates named in ``keep`` (Grappler must preserve them: they carry
    ``_grappler_do_not_remove``) stay, unused, for a new plan to use again. Returns the
    input object itself when it carries none of tfoverlap's edges.
    """
    if not any(GATES_ATTR in node.attr or ARRIVAL_ATTR in node.attr for node in graph_def.node):
        return graph_def, 0
    stripped = type(graph_def)()
    stripped.CopyFrom(graph_def)
    removed = 0
    keep = set(keep)
    arrivals = {node.name for node in stripped.node
                if ARRIVAL_ATTR in node.attr and node.name not in keep}
    by_name = {node.name: node for node in stripped.node}
    for node in stripped.node:
        if GATES_ATTR not in node.attr:
            continue
        ours = {name.decode() for name in node.attr[GATES_ATTR].list.s}
        kept = [text for text in node.input
                if not (text.startswith("^") and (text[1:] in ours
                                                  or _groups_only(by_name.get(text[1:]), ours)))]
        removed += len(node.input) - len(kept)
        del node.input[:]
        node.input.extend(kept)
        del node.attr[GATES_ATTR]
    for node in stripped.node:     # what still names a removed arrival gate lets go of it
        if node.name not in arrivals and any(t.lstrip("^") in arrivals for t in node.input):
            kept = [t for t in node.input if t.lstrip("^") not in arrivals]
            removed += len(node.input) - len(kept)
            del node.input[:]
            node.input.extend(kept)
    for index in reversed([i for i, node in enumerate(stripped.node) if node.name in arrivals]):
        del stripped.node[index]
    return stripped, removed + len(arrivals)


def _groups_only(node_def, gates: set) -> bool:
    """Whether ``node_def`` is a NoOp that Grappler made to gather some of ``gates``."""
    return (node_def is not None and node_def.op == "NoOp"
            and node_def.name.startswith(GROUPED_EDGES_PREFIX)
            and bool(node_def.input)
            and all(t.startswith("^") and t[1:] in gates for t in node_def.input))


def add_ordering_edges(graph_def, edges: Iterable[tuple[str, str]],
                       arrivals: Iterable[ArrivalNode] = (), marker: str = GATES_ATTR):
    """Returns (a copy of graph_def where each (before, after) makes ``after`` wait for
    ``before`` through a control input, number of edges added).

    ``arrivals`` are gate nodes added first (edges may name them; one that the graph has
    already is used as it is). An edge that already
    exists as a control input is not added again (nor marked). ``marker`` is the attr that
    records the added edges (each pass its own, so one pass never strips another's).
    """
    wanted: dict[str, list[str]] = {}
    for before, after in edges:
        wanted.setdefault(after, [])
        if before not in wanted[after]:
            wanted[after].append(before)
    rewritten = type(graph_def)()
    rewritten.CopyFrom(graph_def)
    existing_names = {node.name for node in rewritten.node}
    for arrival in arrivals:
        if arrival.name in existing_names:
            continue
        several = len(arrival.tensors) > 1
        node = rewritten.node.add(name=arrival.name, op="IdentityN" if several else "Identity",
                                  device=arrival.device)
        node.input.extend(arrival.tensors)
        if several:
            node.attr["T"].list.type.extend(arrival.dtypes)
        else:
            node.attr["T"].type = arrival.dtypes[0]
        node.attr[ARRIVAL_ATTR].b = True
        node.attr[DO_NOT_REMOVE_ATTR].b = True
    added = 0
    for node in rewritten.node:
        gates = wanted.get(node.name)
        if not gates:
            continue
        existing = set(node.input)
        new = [gate for gate in gates if "^" + gate not in existing]
        if not new:
            continue
        node.input.extend("^" + gate for gate in new)
        node.attr[marker].list.s.extend(gate.encode() for gate in new)
        added += len(new)
    return rewritten, added
