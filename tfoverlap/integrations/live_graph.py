"""A pass's output applied to a ``tf.Graph`` that is still being built.

The passes work on GraphDefs. A graph-mode program that has not run yet can take the
same rewrite in place: nodes the pass added are imported, inputs it changed are
re-pointed, control inputs it added are added. Nodes it removed stay, unused (a session
runs only what its fetches need). TensorFlow has no public API for changing an existing
op's inputs; the two private methods used here exist in TF 2.x.
"""
from __future__ import annotations

from tfoverlap.graph.model import parse_input

__all__ = ["apply_rewrite"]


def _tensor(graph, text: str):
    name, slot, _ = parse_input(text)
    return graph.get_operation_by_name(name).outputs[slot]


def apply_rewrite(graph, before, after) -> int:
    """Makes ``graph`` (whose GraphDef was ``before``) compute ``after``; returns the number
    of nodes added. Must run before the graph's first ``Session.run``."""
    import tensorflow as tf
    existing = {node.name for node in before.node}
    added = [node for node in after.node if node.name not in existing]
    fragment = tf.compat.v1.GraphDef()
    fragment.node.extend(added)
    fragment.library.CopyFrom(after.library)
    fragment.versions.CopyFrom(after.versions)
    added_names = {node.name for node in added}
    input_map = {}
    # import_graph_def maps only tensors into an unnamed import: control inputs on ops
    # that exist already are added once the new nodes are in.
    later_controls: dict[str, list[str]] = {}
    for node in fragment.node:
        kept = []
        for text in node.input:
            name, _, control = parse_input(text)
            if name in added_names:
                kept.append(text)
            elif control:
                later_controls.setdefault(node.name, []).append(name)
            else:
                input_map[text] = _tensor(graph, text)
                kept.append(text)
        del node.input[:]
        node.input.extend(kept)
    with graph.as_default():
        tf.graph_util.import_graph_def(fragment, input_map=input_map, name="")
    for name, controls in later_controls.items():
        graph.get_operation_by_name(name)._add_control_inputs(  # noqa: SLF001 - module doc
            [graph.get_operation_by_name(control) for control in controls])
    old = {node.name: node for node in before.node}
    for node in after.node:
        previous = old.get(node.name)
        if previous is None or list(previous.input) == list(node.input):
            continue
        op = graph.get_operation_by_name(node.name)
        data = [text for text in node.input if not text.startswith("^")]
        for index, text in enumerate(data):
            if index < len(previous.input) and previous.input[index] == text:
                continue
            op._update_input(index, _tensor(graph, text))  # noqa: SLF001 - see module doc
        had = {text for text in previous.input if text.startswith("^")}
        new_controls = [graph.get_operation_by_name(text[1:]) for text in node.input
                        if text.startswith("^") and text not in had]
        if new_controls:
            op._add_control_inputs(new_controls)  # noqa: SLF001 - see module doc
    return len(added)
