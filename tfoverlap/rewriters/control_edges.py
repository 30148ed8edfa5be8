"""Ordering constraints as control edges, marked so that a later run can find its own.

Each node that receives tfoverlap control inputs records their names in the attr
``_tfoverlap_gates``. A pass strips exactly those edges before it plans again, so running
it twice yields the same graph, and the edges of a user are never touched.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

__all__ = ["GATES_ATTR", "ARRIVAL_ATTR", "ARRIVAL_PREFIX", "strip_ordering_edges",
           "add_ordering_edges", "ArrivalNode"]

GATES_ATTR = "_tfoverlap_gates"
ARRIVAL_ATTR = "_tfoverlap_arrival"
ARRIVAL_PREFIX = "tfoverlap/arrived/"


@dataclasses.dataclass(frozen=True)
class ArrivalNode:
    """A worker-side Identity that runs as soon as a transfer has arrived (and no later).

    Its only use is as a gate: it consumes the transferred tensor on the destination device
    (TensorFlow receives a tensor once per device, so this adds no traffic).
    """

    name: str
    tensor: str      # the transferred tensor, "node" or "node:slot"
    device: str
    dtype: int       # DataType enum of the tensor


def strip_ordering_edges(graph_def):
    """Returns (graph_def without tfoverlap's edges, number of edges removed).

    Returns the input object itself when it carries none.
    """
    if not any(GATES_ATTR in node.attr or ARRIVAL_ATTR in node.attr for node in graph_def.node):
        return graph_def, 0
    stripped = type(graph_def)()
    stripped.CopyFrom(graph_def)
    removed = 0
    arrivals = [i for i, node in enumerate(stripped.node) if ARRIVAL_ATTR in node.attr]
    for index in reversed(arrivals):
        del stripped.node[index]
    removed += len(arrivals)
    for node in stripped.node:
        if GATES_ATTR not in node.attr:
            continue
        ours = {"^" + name.decode() for name in node.attr[GATES_ATTR].list.s}
        kept = [text for text in node.input if text not in ours]
        removed += len(node.input) - len(kept)
        del node.input[:]
        node.input.extend(kept)
        del node.attr[GATES_ATTR]
    return stripped, removed


def add_ordering_edges(graph_def, edges: Iterable[tuple[str, str]],
                       arrivals: Iterable[ArrivalNode] = (), marker: str = GATES_ATTR):
    """Returns (a copy of graph_def where each (before, after) makes ``after`` wait for
    ``before`` through a control input, number of edges added).

    ``arrivals`` are new gate nodes added first (edges may name them). An edge that already
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
    for arrival in arrivals:
        node = rewritten.node.add(name=arrival.name, op="Identity", device=arrival.device)
        node.input.append(arrival.tensor)
        node.attr["T"].type = arrival.dtype
        node.attr[ARRIVAL_ATTR].b = True
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
