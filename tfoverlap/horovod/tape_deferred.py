"""Cross-step overlap for ``DistributedGradientTape`` steps that run in a loop inside one
``tf.function`` (``for _ in tf.range(n)``, or ``next(iterator)`` in such a loop).

A function that runs one step per call would leave reductions pending between calls,
where the program reads the weights: there nothing is deferred, and one line says why. A
loop inside the function runs many steps in one call, as Keras' ``steps_per_execution``
does, and the pending state lives inside that call (:mod:`tfoverlap.horovod.pipeline`):

- The tape reduces every gradient of the step as Horovod does, and Caramel plans from the
  step's graph which reductions (of the gradients ready last) go under the next step's
  forward pass.
- When the step's ``apply_gradients`` gets exactly those reduced gradients, and nothing
  else in the step uses them, it stores the unreduced ones in buffers instead (the
  reductions it was given stay unused, and TensorFlow prunes them), first reduces and
  applies what the previous iteration left pending, and then applies the others. The
  step's reads of each deferred variable, traced before, wait for its chunk's update.
  TensorFlow's automatic control dependencies would order those reads before the update
  (they were traced first), so they are kept out of that ordering (:func:`_unordered`).
- After the loop, in the same function, a drain applies what the last iteration left
  pending. When the call returns, nothing is pending: every value the program sees is
  plain Horovod's, and each gradient is applied once. Where a ``next(iterator)`` in the
  loop runs out, the call fails before that drain: a step applies what is pending only
  once it has its batch, and the function drains it before the error reaches the
  program (:func:`_drain_on_error`).

Anything else keeps Horovod's reduction in the step, with one line saying why: another use
of a deferred gradient (clipping by global norm, a logged norm), an optimizer that is not
Keras' own or that clips, a deferred variable used by other than plain reads before the
update. A read of a deferred variable after the step's ``apply_gradients`` in the loop
would see it one update behind: it stops the trace with an error that says what to do.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import weakref

from tfoverlap.horovod.contract import deferral_refused_by_reduction
from tfoverlap.horovod.decisions import record
from tfoverlap.horovod.patching import MARKER, patch
from tfoverlap.horovod.pipeline import (Deferral, apply_pending, build_slots, make_buffers,
                                        optimizer_refused, reduce_without_cond)
from tfoverlap.log import info_once, logger, warn_once

__all__ = ["attach", "install"]

#: the ops that only read a variable: those of a deferred one may come before its update
READ_OPS = frozenset(("ReadVariableOp", "ResourceGather", "ResourceGatherNd", "VariableShape"))
#: the ops that take a batch from an iterator, and fail where it has run out
INPUT_OPS = frozenset(("IteratorGetNext", "IteratorGetNextSync",
                       "MultiDeviceIteratorGetNextFromShard"))

_loops: list = []                            # the while loops being traced, innermost last
_by_gradient: dict = {}                      # reduced gradient (ref) -> its _TapeDeferral
_unordered_reads = weakref.WeakKeyDictionary()   # graph -> names of reads ACD leaves alone
_plans: dict = {}                            # the variables' refs -> (chunks, decision)
_drains_on_error = weakref.WeakKeyDictionary()   # function graph -> pending ref -> drain
_decouplings: dict = {}                      # the variables' refs -> decouple's first plan
_trains = weakref.WeakKeyDictionary()        # function graph -> the shards its calls update


@dataclasses.dataclass
class _Loop:
    """A while loop being traced: the graph it is built in, the deferrals its body
    planned, and those it applied."""
    graph: object
    planned: list = dataclasses.field(default_factory=list)
    deferrals: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _TapeDeferral(Deferral):
    """A tape step's deferral: where it was traced and what the tape returned."""
    body: object = None             # the loop body's graph
    loop: _Loop | None = None
    level: int = logging.INFO       # of its lines: WARNING where cross_step=True asked
    gradients: list = dataclasses.field(default_factory=list)   # unreduced, by index
    reduced: list = dataclasses.field(default_factory=list)     # what the tape returned
    reduction: dict = dataclasses.field(default_factory=dict)   # Horovod's arguments
    optimizer: object = None
    traced: int = 0                 # the body's ops up to the last of the deferral's own
    key: tuple = ()                 # its variables' refs, as _plans keys them
    decoupling: tuple = ()          # decouple's plan: (buckets, all-gather requests)

    def reduce(self, tensors):
        """``tensors`` reduced as Horovod would, marked as deferred reductions."""
        from tfoverlap.horovod.deferred import mark_deferred, reducing_allreduce
        reduced = reduce_without_cond(tensors, self.reduction)
        for tensor in reduced:
            mark_deferred(reducing_allreduce(tensor))
        return reduced

    @property
    def option(self) -> str:
        """The option its lines speak for."""
        return "decouple" if self.decoupling else "cross_step"

    @property
    def done(self) -> str:
        return "decoupled" if self.decoupling else "deferred"

    def finish_pending(self) -> list:
        """What the step before left pending, done: the deferred reductions reduced and
        applied, or (decoupled) the updated shards all-gathered and assigned. Returns each
        chunk's update (a boolean tensor), in order."""
        if self.decoupled is not None:
            return self.decoupled.gather_pending()
        return apply_pending(self.optimizer, self, self.reduce)


def attach(tape, reduction: dict, mode) -> None:
    """Makes Horovod's ``tape`` (its reduction's arguments in ``reduction``) plan
    cross-step overlap (``mode``: "auto" or True) where its ``gradient`` is traced in the
    body of a loop inside a ``tf.function``."""
    import tensorflow as tf
    install()
    _intercept_optimizers()
    plain = tape._allreduce_grads       # noqa: SLF001 - Horovod's hook, as the optimizer's

    @tf.autograph.experimental.do_not_convert     # the program's loop body is converted
    def allreduce_grads(grads, variables, use_generic_names=False):
        return _reduce_and_plan(plain, reduction, mode, grads, variables, use_generic_names)

    tape._allreduce_grads = allreduce_grads     # noqa: SLF001


def _loop_of(graph) -> _Loop | None:
    """The loop whose body ``graph`` is, if it is one being traced."""
    from tensorflow.python.ops.control_flow_v2_func_graphs import WhileBodyFuncGraph
    if _loops and isinstance(graph, WhileBodyFuncGraph) and graph.outer_graph is _loops[-1].graph:
        return _loops[-1]
    return None


def _staging(graph) -> bool:
    """Whether ``graph`` is AutoGraph's trial trace of a loop body (it infers the types of
    variables first set in the loop from it, and drops it)."""
    from tensorflow.python.framework.func_graph import FuncGraph
    return type(graph) is FuncGraph and graph.name == "tmp"


def _reduce_and_plan(plain, reduction, mode, grads, variables, use_generic_names):
    """The tape's reduction: Horovod's own outside a loop body; in one, every gradient
    reduced in the step by plain HorovodAllreduce ops, and the deferral planned."""
    import tensorflow as tf

    from tfoverlap.horovod.deferred import reducing_allreduce
    from tfoverlap.horovod.scheduling import plan_deferral
    from tfoverlap.horovod.settings import wrapper_option
    from tensorflow.python.ops.control_flow_v2_func_graphs import WhileBodyFuncGraph
    level = logging.WARNING if mode is True else logging.INFO
    graph = tf.compat.v1.get_default_graph()
    loop = _loop_of(graph)
    key = tuple(variable.ref() for variable in variables)
    if loop is None:
        if isinstance(graph, WhileBodyFuncGraph):
            # A loop whose trace began before the hooks were installed has no drain; the
            # later traces of it must decide as this one.
            _plans.setdefault(key, ([], {"reason": "the loop was traced before "
                                                   "tfoverlap.horovod was imported"}))
        elif not _staging(graph):
            option = "decouple" if wrapper_option("decouple", False) else "cross_step"
            _say(level, f"DistributedGradientTape: nothing {option}d: one step per call of "
                        "the tf.function (or a step run eagerly); its gradients would stay "
                        "pending between calls, where the program reads the weights. A "
                        "loop of steps inside one tf.function (for _ in tf.range(n)) "
                        "overlaps them with the next step of the call", option)
        return plain(grads, variables, use_generic_names)
    if key in _plans and not _plans[key][0]:      # decided on the first trace: nothing
        return plain(grads, variables, use_generic_names)
    reduced = reduce_without_cond(grads, reduction)
    deferral = _TapeDeferral(decision={"mode": "auto" if mode == "auto" else "on",
                                       "deferred": 0, "api": "tape"},
                             variables=list(variables), body=graph, loop=loop, level=level,
                             reduced=list(reduced), reduction=dict(reduction), key=key)
    dense = reduction.get("sparse_as_dense")
    for gradient in grads:
        if isinstance(gradient, tf.IndexedSlices) and dense:
            gradient = tf.convert_to_tensor(gradient)
        deferral.gradients.append(gradient)
    own = {reducing_allreduce(tensor).name: i
           for i, (tensor, gradient) in enumerate(zip(reduced, deferral.gradients))
           if isinstance(tensor, tf.Tensor) and isinstance(gradient, tf.Tensor)}
    if _decouples(deferral, graph, own):
        return reduced
    if not mode:
        return reduced
    if key not in _plans:
        # The first trace decides for the process: a function traced again (TensorFlow
        # traces twice where a first trace made variables) must make the same steps on
        # every rank, and may not make buffers.
        refused = deferral_refused_by_reduction(reduction)
        _plans[key] = (([], {"mode": deferral.decision["mode"], "deferred": 0,
                             "reason": refused}) if refused else
                       plan_deferral(graph.as_graph_def(add_shapes=True), own, mode))
    chunks, decision = _plans[key]
    deferral.decision.update(decision, api="tape")
    deferred = sum(len(chunk) for chunk in chunks)
    if chunks and deferred >= len(own):
        chunks, deferral.decision["reason"] = [], "every gradient would be deferred"
    if not chunks:
        _record(deferral)
        _say(level, f"nothing deferred: {deferral.decision.get('reason')}")
        return reduced
    deferral.chunks = chunks
    make_buffers(deferral)
    for index in deferral.deferred:
        _by_gradient[reduced[index].ref()] = deferral
    loop.planned.append(deferral)
    return reduced


def _decouples(deferral: _TapeDeferral, graph, own: dict) -> bool:
    """Whether the step is to be decoupled (configure(decouple=...)): planned on the first
    trace, where the reduction allows it; the plan is kept in ``deferral`` for its
    apply_gradients. Else one line says why, and cross-step overlap is planned as
    configured."""
    from tfoverlap.horovod.settings import wrapper_option
    from tfoverlap.horovod.tape_decoupled import plan
    mode = wrapper_option("decouple", False)
    if not mode:
        return False
    level = logging.WARNING if mode is True else logging.INFO
    if deferral.key not in _decouplings:
        _decouplings[deferral.key] = plan(graph, own, len(deferral.gradients),
                                          deferral.reduction, mode)
    buckets, gathers, decision = _decouplings[deferral.key]
    if not buckets:
        _record(dataclasses.replace(deferral, decision=dict(decision, api="tape")))
        _say(level, f"nothing decoupled: {decision.get('reason')}", "decouple")
        return False
    deferral.decision = dict(decision, api="tape")
    deferral.level = level
    deferral.decoupling = (buckets, gathers)
    deferral.chunks = [[i for b in chunk for i in buckets[b]] for chunk in gathers]
    for tensor in deferral.reduced:
        _by_gradient[tensor.ref()] = deferral
    deferral.loop.planned.append(deferral)
    return True


def _record(deferral: _TapeDeferral) -> None:
    """Keeps ``deferral``'s decision for tfoverlap run's summary, once for a step that
    TensorFlow traces again and that decides alike."""
    record(dict(deferral.decision), "tape", key=deferral.key)


def _say(level: int, message: str, option: str = "cross_step") -> None:
    (warn_once if level >= logging.WARNING else info_once)(f"tfoverlap: {option}: {message}")


def install() -> None:
    """Hooks the end of while loops (for the drain), the calls of concrete functions (for
    a drain where the input runs out) and TensorFlow's automatic control dependencies
    (for the reads); cheap, and idle where nothing is deferred. The hooks must be in
    place before a loop's trace begins: ``tfoverlap.horovod`` installs them when imported
    after TensorFlow."""
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
        loop = _Loop(graph=tf.compat.v1.get_default_graph())
        _loops.append(loop)
        try:
            outputs = plain_while(*args, **kwargs)
        finally:
            _loops.pop()
            _forget(loop)
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
        drains = _drains_on_error.get(self._func_graph)  # noqa: SLF001
        if not drains:
            return plain_call(self, *args, **kwargs)
        try:
            return plain_call(self, *args, **kwargs)
        except tf.errors.OutOfRangeError:
            if tf.executing_eagerly():
                for drain in drains.values():
                    drain()
            raise
    return call_flat


def _forget(loop: _Loop) -> None:
    """Drops what ``loop``'s deferrals left for apply_gradients to find; one line for each
    that no apply_gradients took (its gradients were changed or not applied)."""
    for deferral in loop.planned:
        for index in deferral.deferred:
            _by_gradient.pop(deferral.reduced[index].ref(), None)
        if deferral.optimizer is None and not deferral.decision.get("reason"):
            deferral.decision["reason"] = (
                "no apply_gradients of the step got the tape's reduced gradients as they "
                "were (changed first: clipped by global norm, scaled, ...)")
            _record(deferral)
            _say(deferral.level, f"nothing {deferral.done}: {deferral.decision['reason']}",
                 deferral.option)


def _intercept_optimizers() -> None:
    """Makes Keras optimizers' ``apply_gradients`` defer where it gets a tape's
    deferrable gradients (once)."""
    import tensorflow as tf
    for optimizer_class in (tf.keras.optimizers.Optimizer, tf.keras.optimizers.legacy.Optimizer):
        patch(optimizer_class, "apply_gradients", _deferring_apply)


def _deferring_apply(plain_apply):
    """``apply_gradients``, deferring where it gets a tape's deferrable gradients."""
    import tensorflow as tf

    @functools.wraps(plain_apply)
    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        pairs = list(grads_and_vars)
        deferral = _claimed(pairs)
        if deferral is None:
            return plain_apply(self, pairs, *args, **kwargs)
        return _defer(self, deferral, pairs,
                      lambda kept: plain_apply(self, kept, *args, **kwargs))

    return tf.autograph.experimental.do_not_convert(apply_gradients)


def _claimed(pairs) -> _TapeDeferral | None:
    """The deferral whose reduced gradients are among ``pairs``, if any."""
    import tensorflow as tf
    if not _by_gradient or tf.executing_eagerly():
        return None
    for gradient, _ in pairs:
        if isinstance(gradient, tf.Tensor):
            deferral = _by_gradient.get(gradient.ref())
            if deferral is not None:
                return deferral
    return None


def _handle_in(graph, variable):
    """``variable``'s handle as ``graph`` captured it (through its outer graphs), or None."""
    outer = getattr(graph, "outer_graph", None)
    externals = [variable.handle]
    if outer is not None and hasattr(outer, "captures"):
        externals.append(_handle_in(outer, variable))
    for captured, internal in graph.captures:
        if any(captured is external for external in externals):
            return internal
    return None


def _optimizer_variables(optimizer) -> list:
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


def _refused(optimizer, deferral: _TapeDeferral, pairs, reads: dict) -> str:
    """Why this ``apply_gradients`` cannot defer ("" if it can); fills ``reads`` (index ->
    the ops that read the variable before its update)."""
    import tensorflow as tf
    graph = tf.compat.v1.get_default_graph()
    if graph is not deferral.body or deferral.optimizer is not None:
        return "apply_gradients was called outside the step that took the gradients"
    if deferral.decoupling:
        from tfoverlap.horovod.tape_decoupled import refused as decoupling_refused
        refused = decoupling_refused(optimizer, deferral.variables, deferral.gradients)
        if not refused and len(pairs) != len(deferral.variables):
            refused = "apply_gradients got other gradients than the tape's"
    else:
        refused = optimizer_refused(optimizer)
    if refused:
        return refused
    given = {gradient.ref(): variable for gradient, variable in pairs
             if isinstance(gradient, tf.Tensor)}
    for index in deferral.deferred:
        gradient = deferral.reduced[index]
        if given.get(gradient.ref()) is not deferral.variables[index] or gradient.consumers():
            return ("a reduced gradient is used by other ops than the update, or changed "
                    "before it (clipping by global norm, a logged norm)")
    state = _optimizer_variables(optimizer)
    if not deferral.decoupling:     # decoupled: the state it makes is new to the step
        state += [deferral.buffers[i] for i in deferral.deferred] + [deferral.pending]
    state += [deferral.variables[i] for i in deferral.deferred]
    for index in deferral.deferred:
        handle = _handle_in(graph, deferral.variables[index])
        reads[index] = [] if handle is None else list(handle.consumers())
        other = [op.type for op in reads[index] if op.type not in READ_OPS]
        if other:
            return (f"{deferral.variables[index].name} is used by {other[0]} in the step "
                    "(only plain reads may wait for its update)")
    read_ops = {op for ops in reads.values() for op in ops}
    touching = set()
    for variable in state:
        handle = _handle_in(graph, variable)
        if handle is not None:
            touching.update(op for op in handle.consumers() if op not in read_ops)
    if touching & _downstream(read_ops):
        return ("the step uses the optimizer's state after it reads a deferred variable "
                "(the update would wait for itself)")
    return ""


def _downstream(ops) -> set:
    """Every op that depends on one of ``ops`` through data or control edges."""
    seen, stack = set(), list(ops)
    while stack:
        op = stack.pop()
        for successor in [c for output in op.outputs for c in output.consumers()] + list(
                op._control_outputs):  # noqa: SLF001 - the graph's own edges
            if successor not in seen:
                seen.add(successor)
                stack.append(successor)
    return seen


def _defer(optimizer, deferral: _TapeDeferral, pairs, apply_kept):
    """``apply_gradients`` of a tape step that defers: the pending chunks reduced and
    applied first (the step's reads of each deferred variable wait for its chunk), the
    deferred gradients stored, the others applied. Where it cannot defer, every pair is
    applied as given (Horovod's reductions), with one line saying why."""
    import tensorflow as tf
    if not deferral.decoupling:
        build_slots(optimizer, deferral.variables)
    reads: dict = {}
    refused = _refused(optimizer, deferral, pairs, reads)
    if refused:
        if deferral.decoupling:
            from tfoverlap.horovod.tape_decoupled import refuse_again
            refuse_again(optimizer, deferral.variables, refused)
        for index in deferral.deferred:
            _by_gradient.pop(deferral.reduced[index].ref(), None)
        deferral.decision.update(reason=refused, **{deferral.done: 0})
        _record(deferral)
        _say(deferral.level, f"nothing {deferral.done}: {refused}; the step reduces its "
                             "gradients as Horovod does", deferral.option)
        return apply_kept(pairs)
    graph = deferral.body
    deferral.optimizer = optimizer
    if deferral.decoupling:
        from tfoverlap.horovod.tape_decoupled import decoupled_for
        deferral.decoupled = decoupled_for(optimizer, deferral.variables,
                                           *deferral.decoupling, deferral.reduction)
    # Once the step has its batch: where the iterator has run out, the step does nothing
    # and the update stays whole for the drain (else it could be cut off part way).
    with tf.control_dependencies([op for op in graph.get_operations()
                                  if op.type in INPUT_OPS]):
        updates = deferral.finish_pending()
    unordered = _unordered_reads.setdefault(graph, set())
    for chunk, update in zip(deferral.chunks, updates):
        for index in chunk:
            for read in reads[index]:
                read._add_control_input(update.op)  # noqa: SLF001 - see _unordered
                unordered.add(read.name)
    if deferral.decoupled is not None:
        return _decoupled_update(deferral)
    for index in sorted(deferral.deferred):
        deferral.buffers[index].assign(deferral.gradients[index])
    deferral.pending.assign(True)
    deferred = deferral.deferred
    result = apply_kept([pair for pair in pairs
                         if not any(pair[1] is deferral.variables[i] for i in deferred)])
    deferral.traced = len(graph.get_operations())
    deferral.loop.deferrals.append(deferral)
    mb = sum(deferral.buffers[i].shape.num_elements() * deferral.buffers[i].dtype.size
             for i in deferred) / 1e6
    deferral.decision.update(deferred=len(deferred), deferred_mb=round(mb, 3),
                             chunks=len(deferral.chunks))
    _record(deferral)
    logger.info("tfoverlap: cross_step: DistributedGradientTape: %d of %d gradients "
                "(%.3g MB) reduced under the next step's forward pass, in %d chunks "
                "(predicted %s ms a step, in-step %s ms)", len(deferred),
                len(deferral.variables), mb, len(deferral.chunks),
                deferral.decision.get("predicted_step_ms"), deferral.decision.get("in_step_ms"))
    return result


def _decoupled_update(deferral: _TapeDeferral):
    """The decoupled step's update (:meth:`TapeDecoupled.update`), kept for the drain."""
    result = deferral.decoupled.update(deferral.gradients)
    deferral.traced = len(deferral.body.get_operations())
    deferral.loop.deferrals.append(deferral)
    deferral.decision.update(deferral.decoupled.summary())
    _record(deferral)
    deferral.decoupled.say("DistributedGradientTape", deferral.decision)
    return result


def _drain(loop: _Loop, outputs) -> None:
    """After ``loop``: what its last iteration left pending, reduced and applied; an error
    where the body read a deferred variable after its step's update."""
    import tensorflow as tf
    for deferral in loop.deferrals:
        handles = {}
        for index in deferral.deferred:
            handle = _handle_in(deferral.body, deferral.variables[index])
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


def _drain_on_error(loop: _Loop) -> None:
    """Where a ``next(iterator)`` in the loop runs out, the call fails before the drain
    after the loop: the function that holds the loop then drains what the last step left
    pending (every rank runs out at the same step, as Horovod needs) before the error goes
    on to the program."""
    import tensorflow as tf
    drains = _drains_on_error.setdefault(_outermost(loop.graph), {})
    for deferral in loop.deferrals:
        if any(op.type in INPUT_OPS for op in deferral.body.get_operations()):
            pending = (deferral.decoupled or deferral).pending
            drains.setdefault(pending.ref(), tf.function(
                functools.partial(_TapeDeferral.finish_pending, deferral)))


def _outermost(graph):
    """The function graph that holds ``graph`` (itself where it is one), whose calls run
    the loop."""
    from tensorflow.python.framework.func_graph import FuncGraph
    while isinstance(getattr(graph, "outer_graph", None), FuncGraph):
        graph = graph.outer_graph
    return graph


def _unordered(op, reads, writes) -> bool:
    """TensorFlow's automatic control dependencies: the reads of a deferred variable that
    were traced before its update touch no resource (they wait for the update by a
    control edge; ordered as traced, they would also come before it: a cycle)."""
    names = _unordered_reads.get(op.graph)
    if not names or op.name not in names or not (reads or writes):
        return False
    reads.clear()
    writes.clear()
    return True
