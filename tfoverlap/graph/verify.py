"""The structural invariants every pass output must satisfy before it replaces a graph."""
from __future__ import annotations

from typing import Iterable

from tfoverlap.graph.frames import verify_control_flow
from tfoverlap.graph.model import GraphError, GraphModel

__all__ = ["verify_graph_def"]


def verify_graph_def(graph_def, preserve: Iterable[str] = (), before=None) -> None:
    """The invariants every pass output must satisfy.

    Every input names a node, control inputs follow data inputs and are not repeated, the
    graph is acyclic (TF1 loop back-edges aside), and every node in ``preserve`` exists.
    Given the graph ``before`` the pass, frames and deadness are kept too
    (:func:`tfoverlap.graph.frames.verify_control_flow`).

    Raises:
      GraphError: naming the first violation.
    """
    model = GraphModel.from_graph_def(graph_def)
    for node in graph_def.node:
        seen_control = False
        controls: set[str] = set()
        for text in node.input:
            if text.startswith("^"):
                seen_control = True
                if text in controls:
                    raise GraphError(f"node {node.name!r} lists control input {text!r} twice")
                controls.add(text)
            elif seen_control:
                raise GraphError(f"node {node.name!r} has data input {text!r} after a "
                                 "control input")
    missing = [name for name in preserve if name not in model.index]
    if missing:
        raise GraphError(f"node {missing[0]!r}, which must be preserved, is gone")
    model.topological_order()
    if before is not None:
        verify_control_flow(before, graph_def, model)
