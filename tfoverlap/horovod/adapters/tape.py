"""The tape adapter: ``DistributedGradientTape`` steps in a loop inside one
``tf.function``, planned from the loop body's graph; the step's ``apply_gradients``
defers or decouples where the contract allows (docs/architecture.md, "Tape loops")."""
from __future__ import annotations

import dataclasses
import functools
import logging

from tfoverlap.horovod.core.contract import (deferral_refused_by_reduction,
                                             reduce_without_cond)
from tfoverlap.horovod.core.decisions import planned, record
from tfoverlap.horovod.core.patching import patch
from tfoverlap.horovod.in_call.loops import (INPUT_OPS, READ_OPS, Loop, handle_in, install,
                                             loop_of, staging, unordered_reads)
from tfoverlap.horovod.in_call.pending import (Deferral, PerVariables, build_slots,
                                               optimizer_refused)
from tfoverlap.log import info_once, warn_once

__all__ = ["attach", "install"]

_by_gradient: dict = {}                      # reduced gradient (ref) -> its _TapeDeferral
_plans = PerVariables()                      # the variables -> (chunks, decision)
_decouplings = PerVariables()                # the variables -> decouple's first plan


@dataclasses.dataclass
class _TapeDeferral(Deferral):
    """A tape step's deferral: where it was traced and what the tape returned."""
    body: object = None             # the loop body's graph
    loop: Loop | None = None
    level: int = logging.INFO       # of its lines: WARNING where cross_step=True asked
    gradients: list = dataclasses.field(default_factory=list)   # unreduced, by index
    reduced: list = dataclasses.field(default_factory=list)     # what the tape returned
    traced: int = 0                 # the body's ops up to the last of the deferral's own
    decoupling: tuple = ()          # decouple's plan: (buckets, all-gather requests)
    registered: list = dataclasses.field(default_factory=list)  # its keys in _by_gradient

    @property
    def key(self) -> tuple:
        """Its variables, as its decision is recorded (by id: not kept alive by it)."""
        return tuple(id(variable) for variable in self.variables)

    @property
    def option(self) -> str:      # the option its lines speak for
        return "decouple" if self.decoupling else "cross_step"

    @property
    def done(self) -> str:
        return "decoupled" if self.decoupling else "deferred"

    def register(self, tensors) -> None:
        """Lets apply_gradients find it by any of ``tensors`` (reduced gradients)."""
        for tensor in tensors:
            _by_gradient[tensor.ref()] = self
            self.registered.append(tensor.ref())

    def unregister(self) -> None:
        """Drops every key it registered (they hold its graph's tensors)."""
        for key in self.registered:
            if _by_gradient.get(key) is self:
                del _by_gradient[key]
        self.registered.clear()

    def forget(self) -> None:
        """At the end of its loop's trace: drops what it left for apply_gradients to find,
        with one line where none took it (its gradients changed, or not applied)."""
        self.unregister()
        if self.optimizer is None and not self.decision.get("reason"):
            self.decision["reason"] = (
                "no apply_gradients of the step got the tape's reduced gradients as they "
                "were (changed first: clipped by global norm, scaled, ...)")
            _record(self)
            _say(self.level, f"nothing {self.done}: {self.decision['reason']}", self.option)


def attach(tape, reduction: dict, mode) -> None:
    """Makes Horovod's ``tape`` (reducing with ``reduction``) plan cross-step overlap
    (``mode``) or decoupling where its ``gradient`` is traced in a loop body."""
    import tensorflow as tf
    install()
    _intercept_optimizers()
    plain = tape._allreduce_grads       # noqa: SLF001 - Horovod's hook, as the optimizer's

    @tf.autograph.experimental.do_not_convert     # the program's loop body is converted
    def allreduce_grads(grads, variables, use_generic_names=False):
        return _reduce_and_plan(plain, reduction, mode, grads, variables, use_generic_names)

    tape._allreduce_grads = allreduce_grads     # noqa: SLF001


def _reduce_and_plan(plain, reduction, mode, grads, variables, use_generic_names):
    """The tape's reduction: Horovod's own outside a loop body; in one, every gradient
    reduced in the step by plain HorovodAllreduce ops, and the deferral planned."""
    import tensorflow as tf

    from tfoverlap.horovod.session.deferral import reducing_allreduce
    from tfoverlap.horovod.core.plans import plan_deferral, variable_ops
    from tfoverlap.horovod.settings import wrapper_option
    from tensorflow.python.ops.control_flow_v2_func_graphs import WhileBodyFuncGraph
    level = logging.WARNING if mode is True else logging.INFO
    graph = tf.compat.v1.get_default_graph()
    loop = loop_of(graph)
    if loop is None:
        if isinstance(graph, WhileBodyFuncGraph):
            # A loop whose trace began before the hooks were installed has no drain; the
            # later traces of it must decide as this one.
            _plans.get(variables, lambda: ([], {"reason": "the loop was traced before "
                                                          "tfoverlap.horovod was imported"}))
        elif not staging(graph):
            option = "decouple" if wrapper_option("decouple", False) else "cross_step"
            _say(level, f"DistributedGradientTape: nothing {option}d: one step per call of "
                        "the tf.function (or a step run eagerly); its gradients would stay "
                        "pending between calls, where the program reads the weights. A "
                        "loop of steps inside one tf.function (for _ in tf.range(n)) "
                        "overlaps them with the next step of the call", option)
        return plain(grads, variables, use_generic_names)
    decided = _plans.find(variables)
    if decided is not None and not decided[0]:      # decided on the first trace: nothing
        return plain(grads, variables, use_generic_names)
    reduced = reduce_without_cond(grads, reduction)
    dense = reduction.get("sparse_as_dense")      # unreduced, as Horovod's reduction takes them
    gradients = [tf.convert_to_tensor(g) if dense and isinstance(g, tf.IndexedSlices) else g
                 for g in grads]
    deferral = _TapeDeferral(decision=dict(planned("cross_step", mode), api="tape"),
                             variables=list(variables), body=graph, loop=loop, level=level,
                             gradients=gradients, reduced=list(reduced),
                             reduction=dict(reduction))
    own = {reducing_allreduce(tensor).name: i
           for i, (tensor, gradient) in enumerate(zip(reduced, gradients))
           if isinstance(tensor, tf.Tensor) and isinstance(gradient, tf.Tensor)}
    if _decouples(deferral, graph, own) or not mode:
        return reduced
    def first_plan():
        # The first trace decides for the process: a function traced again (TensorFlow
        # traces twice where a first trace made variables) must make the same steps on
        # every rank, and may not make buffers.
        refused = deferral_refused_by_reduction(reduction)
        return (([], planned("cross_step", mode, refused)) if refused else
                plan_deferral(graph.as_graph_def(add_shapes=True), own, mode,
                              variables=variable_ops(graph, own, list(variables))))
    chunks, decision = _plans.get(variables, first_plan)
    deferral.decision.update(decision, api="tape")
    if not deferral.keep(chunks, len(own)):
        _record(deferral)
        _say(level, f"nothing deferred: {deferral.decision.get('reason')}")
        return reduced
    deferral.register(reduced[index] for index in sorted(deferral.deferred))
    loop.planned.append(deferral)
    return reduced


def _decouples(deferral: _TapeDeferral, graph, own: dict) -> bool:
    """Whether the step is decoupled (configure(decouple=...)), as planned on its first
    trace: the plan kept in ``deferral`` for its apply_gradients; else one line says why."""
    from tfoverlap.horovod.settings import wrapper_option
    from tfoverlap.horovod.in_call.decoupling import plan
    mode = wrapper_option("decouple", False)
    if not mode:
        return False
    level = logging.WARNING if mode is True else logging.INFO
    buckets, gathers, decision = _decouplings.get(deferral.variables, lambda: plan(
        graph, own, len(deferral.gradients), deferral.reduction, mode))
    if not buckets:
        _record(dataclasses.replace(deferral, decision=dict(decision, api="tape")))
        _say(level, f"nothing decoupled: {decision.get('reason')}", "decouple")
        return False
    deferral.decision = dict(decision, api="tape")
    deferral.level = level
    deferral.decoupling = (buckets, gathers)
    deferral.chunks = [[i for b in chunk for i in buckets[b]] for chunk in gathers]
    deferral.register(deferral.reduced)
    deferral.loop.planned.append(deferral)
    return True


def _record(deferral: _TapeDeferral) -> None:
    """Keeps ``deferral``'s decision, once for a step traced again that decides alike."""
    record(dict(deferral.decision), "tape", key=deferral.key)


def _say(level: int, message: str, option: str = "cross_step") -> None:
    (warn_once if level >= logging.WARNING else info_once)(f"tfoverlap: {option}: {message}")


def _intercept_optimizers() -> None:
    """Makes Keras optimizers' ``apply_gradients`` defer where given a tape's gradients."""
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
    return next((_by_gradient[gradient.ref()] for gradient, _ in pairs
                 if isinstance(gradient, tf.Tensor) and gradient.ref() in _by_gradient), None)


def _refused(optimizer, deferral: _TapeDeferral, pairs, reads: dict) -> str:
    """Why this ``apply_gradients`` cannot defer ("" if it can); fills ``reads`` (index ->
    the ops that read the variable before its update)."""
    import tensorflow as tf
    graph = tf.compat.v1.get_default_graph()
    if graph is not deferral.body or deferral.optimizer is not None:
        return "apply_gradients was called outside the step that took the gradients"
    if deferral.decoupling:
        from tfoverlap.horovod.in_call.decoupling import refused as decoupling_refused
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
    state = optimizer.variables
    state = list(state() if callable(state) else state)
    if not deferral.decoupling:     # decoupled: the state it makes is new to the step
        state += [deferral.buffers[i] for i in deferral.deferred] + [deferral.pending]
    state += [deferral.variables[i] for i in deferral.deferred]
    for index in deferral.deferred:
        handle = handle_in(graph, deferral.variables[index])
        reads[index] = [] if handle is None else list(handle.consumers())
        other = [op.type for op in reads[index] if op.type not in READ_OPS]
        if other:
            return (f"{deferral.variables[index].name} is used by {other[0]} in the step "
                    "(only plain reads may wait for its update)")
    read_ops = {op for ops in reads.values() for op in ops}
    touching = set()
    for variable in state:
        handle = handle_in(graph, variable)
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
    """``apply_gradients`` of a tape step that defers (the step's reads of each variable
    wait for its pending update) or decouples; where it cannot, every pair is applied as
    given (Horovod's reductions), with one line saying why."""
    import tensorflow as tf
    if not deferral.decoupling:
        build_slots(optimizer, deferral.variables)
    reads: dict = {}
    refused = _refused(optimizer, deferral, pairs, reads)
    if refused:
        if deferral.decoupling:
            from tfoverlap.horovod.in_call.decoupling import refuse_again
            refuse_again(optimizer, deferral.variables, refused)
        deferral.unregister()
        deferral.decision.update(reason=refused, **{deferral.done: 0})
        _record(deferral)
        _say(deferral.level, f"nothing {deferral.done}: {refused}; the step reduces its "
                             "gradients as Horovod does", deferral.option)
        return apply_kept(pairs)
    graph = deferral.body
    deferral.optimizer = optimizer
    if deferral.decoupling:
        from tfoverlap.horovod.in_call.decoupling import decoupled_for
        deferral.decoupled = decoupled_for(optimizer, deferral.variables,
                                           *deferral.decoupling, deferral.reduction)
    # Once the step has its batch: where the iterator has run out, the step does nothing
    # and the update stays whole for the drain (else it could be cut off part way).
    with tf.control_dependencies([op for op in graph.get_operations()
                                  if op.type in INPUT_OPS]):
        updates = deferral.finish_pending()
    unordered = unordered_reads.setdefault(graph, set())
    for chunk, update in zip(deferral.chunks, updates):
        for index in chunk:
            for read in reads[index]:
                read._add_control_input(update.op)  # noqa: SLF001 - see _unordered
                unordered.add(read.name)
    if deferral.decoupled is not None:      # its update (TapeDecoupled.update)
        result = deferral.decoupled.update(deferral.gradients)
        deferral.decision.update(deferral.decoupled.summary())
        deferral.decoupled.say("DistributedGradientTape", deferral.decision)
    else:
        for index in sorted(deferral.deferred):
            deferral.buffers[index].assign(deferral.gradients[index])
        deferral.pending.assign(True)
        deferred = deferral.deferred
        result = apply_kept([pair for pair in pairs
                             if not any(pair[1] is deferral.variables[i] for i in deferred)])
        deferral.say_deferred("DistributedGradientTape")
    deferral.traced = len(graph.get_operations())
    deferral.loop.deferrals.append(deferral)
    _record(deferral)
    return result
