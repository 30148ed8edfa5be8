"""The in-call backend's hooks on TensorFlow, where a tape loop's pending work ends: a
drain after the loop (:func:`_drain`) and where its input runs out
(:func:`_drain_on_error`), and reads that wait for an update left out of automatic
control dependencies (:func:`_unordered`; docs/architecture.md, "Tape loops")."""
from __future__ import annotations

import dataclasses
import functools
import weakref

from tfoverlap.horovod.core.patching import MARKER, patch

__all__ = ["install", "loop_of", "staging", "handle_in", "Loop", "READ_OPS", "INPUT_OPS",
           "unordered_reads"]


#: the ops that only read a variable: those of a deferred one may come before its update
READ_OPS = frozenset(("ReadVariableOp", "ResourceGather", "ResourceGatherNd", "VariableShape"))
#: the ops that take a batch from an iterator, and fail where it has run out
INPUT_OPS = frozenset(("IteratorGetNext", "IteratorGetNextSync",
                       "MultiDeviceIteratorGetNextFromShard"))


_loops: list = []                               # the while loops being traced, innermost last
unordered_reads = weakref.WeakKeyDictionary()   # graph -> names of reads ACD leaves alone
_drains_on_error = weakref.WeakKeyDictionary()  # function graph -> pending ref -> drain
_trains = weakref.WeakKeyDictionary()           # function graph -> the shards its calls update


@dataclasses.dataclass
class Loop:
    """A while loop being traced: its graph, the deferrals its body planned and applied."""
    graph: object
    planned: list = dataclasses.field(default_factory=list)
    deferrals: list = dataclasses.field(default_factory=list)


def loop_of(graph) -> Loop | None:
    """The loop whose body ``graph`` is, if it is one being traced."""
    from tensorflow.python.ops.control_flow_v2_func_graphs import WhileBodyFuncGraph
    if _loops and isinstance(graph, WhileBodyFuncGraph) and graph.outer_graph is _loops[-1].graph:
        return _loops[-1]
    return None


def staging(graph) -> bool:
    """Whether ``graph`` is AutoGraph's trial trace of a loop body (dropped after it)."""
    from tensorflow.python.framework.func_graph import FuncGraph
    return type(graph) is FuncGraph and graph.name == "tmp"


def install() -> None:
    """Hooks while loops, concrete functions' calls and automatic control dependencies
    (idle where nothing is deferred). They must be in place before a loop's trace begins:
    ``tfoverlap.horovod`` installs them when imported after TensorFlow."""
    from tensorflow.python.eager.polymorphic_function import concrete_function
    from tensorflow.python.framework import auto_control_deps
    from tensorflow.python.ops import while_v2
    if hasattr(while_v2.while_loop, MARKER):
        return
    patch(while_v2, "while_loop", _draining_loops)
    patch(concrete_function.ConcreteFunction, "_call_flat", _draining_on_error)
    auto_control_deps.register_acd_resource_resolver(_unordered)


def _draining_loops(plain_while):
    import tensorflow as tf

    @functools.wraps(plain_while)
    def while_loop(*args, **kwargs):
        loop = Loop(graph=tf.compat.v1.get_default_graph())
        _loops.append(loop)
        try:
            outputs = plain_while(*args, **kwargs)
        finally:
            _loops.pop()
            for deferral in loop.planned:
                deferral.forget()
        if loop.deferrals:
            _drain(loop, outputs)
            _drain_on_error(loop)
            trains = _trains.setdefault(_outermost(loop.graph), [])
            trains.extend({id(d.decoupled): d.decoupled for d in loop.deferrals
                           if d.decoupled is not None and d.decoupled not in trains}.values())
        return outputs
    return while_loop


def _draining_on_error(plain_call):
    import tensorflow as tf

    @functools.wraps(plain_call)
    def call_flat(self, *args, **kwargs):
        for decoupled in _trains.get(self._func_graph, ()):  # noqa: SLF001
            decoupled.trained()
        try:
            return plain_call(self, *args, **kwargs)
        except tf.errors.OutOfRangeError:
            if tf.executing_eagerly():
                for drain in _drains_on_error.get(self._func_graph, {}).values():  # noqa: SLF001
                    drain()
            raise
    return call_flat


def handle_in(graph, variable):
    """``variable``'s handle as ``graph`` captured it (through its outer graphs), or None."""
    outer = getattr(graph, "outer_graph", None)
    externals = [variable.handle]
    if outer is not None and hasattr(outer, "captures"):
        externals.append(handle_in(outer, variable))
    for captured, internal in graph.captures:
        if any(captured is external for external in externals):
            return internal
    return None


def _drain(loop: Loop, outputs) -> None:
    """After ``loop``: what its last iteration left pending, reduced and applied; an error
    where the body read a deferred variable after its step's update."""
    import tensorflow as tf
    for deferral in loop.deferrals:
        handles = {}
        for index in deferral.deferred:
            handle = handle_in(deferral.body, deferral.variables[index])
            if handle is not None:
                handles[handle.ref()] = deferral.variables[index]
        for op in deferral.body.get_operations()[deferral.traced:]:
            late = [handles[t.ref()] for t in op.inputs if t.ref() in handles]
            if late:
                raise ValueError(
                    f"tfoverlap: {deferral.option}: the loop's step uses {late[0].name} "
                    f"({op.type}) after its apply_gradients, where that variable's update "
                    "is still pending; use it before apply_gradients or after the loop, or "
                    f"turn it off (tfoverlap.horovod.configure({deferral.option}=False))")
    after = [t for t in tf.nest.flatten(outputs, expand_composites=True)
             if isinstance(t, tf.Tensor)]
    with tf.control_dependencies(after):
        for deferral in loop.deferrals:
            deferral.finish_pending()


def _drain_on_error(loop: Loop) -> None:
    """Where a ``next(iterator)`` in the loop runs out, the call fails before the drain
    after the loop: the function that holds it then drains before the error goes on
    (every rank runs out at the same step)."""
    import tensorflow as tf
    drains = _drains_on_error.setdefault(_outermost(loop.graph), {})
    for deferral in loop.deferrals:
        if any(op.type in INPUT_OPS for op in deferral.body.get_operations()):
            pending = (deferral.decoupled or deferral).pending
            drains.setdefault(pending.ref(), tf.function(
                functools.partial(type(deferral).finish_pending, deferral)))


def _outermost(graph):
    """The function graph that holds ``graph`` (itself where it is one)."""
    from tensorflow.python.framework.func_graph import FuncGraph
    while isinstance(getattr(graph, "outer_graph", None), FuncGraph):
        graph = graph.outer_graph
    return graph


def _unordered(op, reads, writes) -> bool:
    """Automatic control dependencies: the reads of a deferred variable traced before its
    update touch no resource (they wait for it by a control edge; ordered as traced, they
    would also come before it: a cycle)."""
    names = unordered_reads.get(op.graph)
    if not names or op.name not in names or not (reads or writes):
        return False
    reads.clear()
    writes.clear()
    return True
