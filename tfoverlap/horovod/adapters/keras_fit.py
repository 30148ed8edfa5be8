"""The Keras adapter: ``model.fit`` with ``steps_per_execution=N > 1``, planned from a trace
of its ``train_step`` (AutoGraph's trial trace of the multi-step loop, where there is one);
a drain after each call leaves nothing pending where user code runs (docs/architecture.md,
"Keras fit"; the hooks: :mod:`.keras_hooks`)."""
from __future__ import annotations

import logging
import time
import weakref

from tfoverlap.horovod.core.contract import (deferral_refused_by_reduction,
                                             reduce_without_cond)
from tfoverlap.horovod.core.decisions import planned, record
from tfoverlap.horovod.in_call.pending import Deferral, build_slots, optimizer_refused
from tfoverlap.horovod.settings import wrapper_option
from tfoverlap.log import logger

__all__ = ["register", "decision_for", "deferral_refused"]

_deferrals = weakref.WeakKeyDictionary()    # Keras model -> Deferral
_optimizers = weakref.WeakKeyDictionary()   # optimizer -> its Horovod reduction arguments
_active: list = []                          # the Deferral of the step being traced
_fit_batch = [None]                         # the batch size of the last Keras data handler


def decision_for(model) -> dict | None:
    """The decision for ``model``'s train function (the Caramel report's ``cross_step``
    entry, with the drains made and the median time of one), or None before its trace."""
    deferral = _deferrals.get(model)
    if deferral is None:
        return None
    decision = dict(deferral.decision)
    if deferral.drain_seconds:      # the first call's drain includes its trace
        later = sorted(deferral.drain_seconds[1:] or deferral.drain_seconds)
        decision.update(drains=len(deferral.drain_seconds),
                        drain_ms=round(later[len(later) // 2] * 1e3, 3))
    return decision


def deferral_refused(model, optimizer) -> str:
    """Why ``model.fit`` with ``optimizer`` cannot defer ("" if it can)."""
    import tensorflow as tf
    refused = (optimizer_refused(optimizer)
               or deferral_refused_by_reduction(_optimizers[optimizer]))
    if refused:
        return refused
    if getattr(optimizer, "_local_vars", None):
        return "local variables (register_local_var) are reduced apart"
    if model.run_eagerly or model.jit_compile:
        return "run_eagerly or jit_compile (the steps of a call are not one graph)"
    if getattr(model, "_cluster_coordinator", None):
        return "a ParameterServerStrategy coordinator"
    steps = model._steps_per_execution  # noqa: SLF001 - what compile(steps_per_execution=) set
    with tf.init_scope():
        steps = None if steps is None else int(steps.numpy())
    if model.autotune_steps_per_execution or steps is None or steps < 2:
        return ("one step per call of the train function: a step's gradients would have "
                "to be reduced before the call returns; compile(steps_per_execution=N) "
                "with N > 1 overlaps them with the next step of the call")
    return ""


def register(optimizer, reduction: dict) -> None:
    """Marks ``optimizer`` (Horovod's Keras wrapper, reducing with ``reduction``) as
    deferring: its ``minimize`` defers in the pipelined steps (:func:`_pipelined`)."""
    import types
    _optimizers[optimizer] = reduction
    plain_minimize = optimizer.minimize

    def minimize(self, loss, var_list, tape=None, **kwargs):
        deferral = _active[-1] if _active else None
        if deferral is None or kwargs:
            return plain_minimize(loss, var_list, tape=tape, **kwargs)
        return _minimize(self, deferral, loss, var_list, tape)

    optimizer.minimize = types.MethodType(minimize, optimizer)


def _local_gradients(optimizer, loss, var_list, tape):
    """The step's unreduced (gradient, variable) pairs, densified as Horovod would."""
    import tensorflow as tf
    tape = tf.GradientTape() if tape is None else tape
    base = super(type(optimizer), optimizer)     # the program's class, Horovod's base
    if hasattr(base, "_compute_gradients"):          # the legacy optimizers
        pairs = base._compute_gradients(loss, var_list, None, tape=tape)  # noqa: SLF001
    else:
        pairs = base.compute_gradients(loss, var_list, tape=tape)
    if _optimizers[optimizer].get("sparse_as_dense"):
        pairs = [(tf.convert_to_tensor(gradient) if isinstance(gradient, tf.IndexedSlices)
                  else gradient, variable) for gradient, variable in pairs]
    return list(pairs)


def _minimize(optimizer, deferral, loss, var_list, tape):
    """The step's gradients: the deferred ones stored and marked pending, the others
    reduced and applied as Horovod would; or decoupled."""
    import tensorflow as tf
    if deferral.decoupled is not None:
        return _decoupled_update(optimizer, deferral, loss, var_list, tape)
    pairs = _local_gradients(optimizer, loss, var_list, tape)
    gradients = [gradient for gradient, _ in pairs]
    index_of = {variable.ref(): i for i, variable in enumerate(deferral.variables)}
    positions = [index_of.get(variable.ref()) for _, variable in pairs]
    deferred = deferral.deferred
    stored = [i for i, position in enumerate(positions) if position in deferred]
    if any(not isinstance(gradients[i], tf.Tensor) for i in stored):
        # Not the step that was planned (a gradient gone or sparse): reduce all of it in
        # the step; nothing is marked pending, so no deferred update ever runs.
        logger.warning("tfoverlap: cross_step: a deferred variable has no dense gradient "
                       "in this trace of the step; its gradients are reduced in the step")
        stored = []
    kept = [i for i in range(len(pairs)) if i not in stored]
    reduced = reduce_without_cond([gradients[i] for i in kept], deferral.reduction)
    if deferral.planning is not None:
        from tfoverlap.horovod.session.deferral import reducing_allreduce
        for i, tensor in zip(kept, reduced):
            if isinstance(tensor, tf.Tensor) and positions[i] is not None:
                deferral.planning[reducing_allreduce(tensor).name] = positions[i]
    for i in stored:
        deferral.buffers[positions[i]].assign(gradients[i])
    if stored:
        deferral.pending.assign(True)
    if deferral.planning is not None and wrapper_option("decouple", False):
        return optimizer.iterations     # planning decoupling: the optimizer stays unbuilt
    return optimizer.apply_gradients([(gradient, pairs[i][1])
                                      for i, gradient in zip(kept, reduced)])


def _decoupled_update(optimizer, deferral, loss, var_list, tape):
    """The decoupled step's update (:meth:`TapeDecoupled.update`) of every variable."""
    import tensorflow as tf
    by_variable = {variable.ref(): gradient
                   for gradient, variable in _local_gradients(optimizer, loss, var_list, tape)}
    gradients = [by_variable.get(variable.ref()) for variable in deferral.variables]
    if not all(isinstance(gradient, tf.Tensor) for gradient in gradients):
        raise ValueError("tfoverlap: decouple: this trace of the train step lacks a dense "
                         "gradient of a decoupled variable, whose optimizer state is "
                         "sharded; train with configure(decouple=False)")
    return deferral.decoupled.update(gradients)


def _plan(model, optimizer, train_step, data) -> tuple[Deferral, list | None]:
    """Plans from a trace of ``train_step``: decoupled, deferred (the buffers built), or
    nothing, with the reason. The trace is the one AutoGraph makes anyway where the step is
    first traced in its trial trace of the multi-step loop (dropped after it: the second
    item holds that trace's outputs, for the trial); else the step is traced apart (None)."""
    import tensorflow as tf

    from tfoverlap.horovod.core.plans import plan_deferral, variable_ops
    from tfoverlap.horovod.in_call.loops import staging
    mode = wrapper_option("cross_step", "auto")
    decouple = wrapper_option("decouple", False)
    level = logging.WARNING if (decouple or mode) is True else logging.INFO
    unbuilt = _build_before_the_step(model, data)
    deferral = Deferral(decision=planned("cross_step", mode), optimizer=optimizer,
                        variables=[] if unbuilt else list(model.trainable_variables),
                        reduction=_optimizers[optimizer])
    refused = unbuilt or deferral_refused(model, optimizer)
    if refused:
        if decouple:
            deferral.decision["decoupled"] = 0
        deferral.decision["reason"] = refused
        logger.log(level, "tfoverlap: %s: %s; nothing %s", "decouple" if decouple else
                   "cross_step", refused, "decoupled" if decouple else "deferred")
        return deferral, None
    deferral.planning = {}
    trial = None
    try:
        if not decouple:
            build_slots(optimizer, deferral.variables)
        _active.append(deferral)
        try:
            graph = tf.compat.v1.get_default_graph()
            if staging(graph):
                trial = [train_step(tf.nest.map_structure(
                    lambda value: _batch_shaped(value, _fit_batch[0]), data))]
            else:
                spec = tf.nest.map_structure(lambda value: _batch_spec(value, _fit_batch[0]),
                                             data)
                graph = tf.function(train_step).get_concrete_function(spec).graph
        finally:
            _active.pop()
    except Exception as error:  # noqa: BLE001 - nothing is built yet: train in-step
        deferral.planning = None
        deferral.decision["reason"] = f"the step could not be traced for the plan ({error})"
        logger.warning("tfoverlap: cross_step: nothing deferred: the step could not be "
                       "traced for the plan (%s: %s)", type(error).__name__, error)
        return deferral, None
    own, deferral.planning = deferral.planning, None
    if decouple:
        if _decouples(model, optimizer, deferral, graph, own, decouple) or not mode:
            return deferral, trial
        build_slots(optimizer, deferral.variables)
        deferral.decision = planned("cross_step", mode)
    with tf.init_scope():
        steps = int(model._steps_per_execution.numpy())  # noqa: SLF001 - checked above
    chunks, deferral.decision = plan_deferral(
        graph.as_graph_def(add_shapes=True), own, mode, drain_every=steps,
        variables=variable_ops(graph, own, deferral.variables))
    if not deferral.keep(chunks, len(deferral.variables)):
        logger.log(level, "tfoverlap: cross_step: nothing deferred: %s",
                   deferral.decision.get("reason"))
        return deferral, trial
    deferral.drain = tf.function(lambda: deferral.finish_pending())
    deferral.say_deferred("model.fit")
    return deferral, trial


def _build_before_the_step(model, data) -> str:
    """Builds a model that makes its weights on its first call (a Sequential without an
    input shape, as in Horovod's Keras examples), by a call traced apart on the batch's
    specs, as the step's own first call would: the plan needs the weights before the step
    is traced. Why it cannot be built ("" where it is)."""
    import tensorflow as tf
    if model.built:
        return ""
    inputs, _, _ = tf.keras.utils.unpack_x_y_sample_weight(data)
    spec = tf.nest.map_structure(lambda value: _batch_spec(value, _fit_batch[0]), inputs)
    try:
        tf.function(lambda batch: model(batch, training=True)).get_concrete_function(spec)
    except Exception as error:  # noqa: BLE001 - the step builds it then, in-step
        return f"the model could not be built before its first step ({error})"
    return "" if model.built else "the model is not built by a call on its inputs"


def _decouples(model, optimizer, deferral, graph, own: dict, mode) -> bool:
    """Whether ``model.fit``'s steps are decoupled (``deferral`` then holds the
    TapeDecoupled and the drain); else one line says why, and the decision is kept."""
    import tensorflow as tf

    from tfoverlap.horovod.in_call.decoupling import decoupled_for, plan, refused
    level = logging.WARNING if mode is True else logging.INFO
    variables = deferral.variables
    buckets, gathers, decision = plan(graph, own, len(variables), deferral.reduction, mode,
                                      refused(optimizer, variables))
    decision["api"] = "keras"
    if not buckets:
        logger.log(level, "tfoverlap: decouple: nothing decoupled: %s", decision.get("reason"))
        record(decision, "keras", key=weakref.ref(model), name=model.name)
        deferral.decision = decision
        return False
    deferral.decoupled = decoupled_for(optimizer, variables, buckets, gathers,
                                       deferral.reduction)
    deferral.decision = {**decision, **deferral.decoupled.summary()}
    deferral.chunks = deferral.decoupled.chunks
    deferral.drain = tf.function(deferral.decoupled.gather_pending)
    deferral.decoupled.say("model.fit", deferral.decision)
    return True


def _batch_spec(value, batch):
    """The spec of one input, an unknown batch dimension set to ``batch`` (for the plan's
    compute estimates); other values as they are."""
    import tensorflow as tf
    if not isinstance(value, tf.Tensor):
        return value
    shape = value.shape
    if batch and shape.rank and shape[0] is None:
        shape = tf.TensorShape([batch]).concatenate(shape[1:])
    return tf.TensorSpec(shape, value.dtype)


def _batch_shaped(value, batch):
    """``value`` with an unknown batch dimension set to ``batch`` in its static shape (for
    the plan's compute estimates, in a trace that never runs); other values as they are."""
    import tensorflow as tf
    spec = _batch_spec(value, batch)
    return tf.ensure_shape(value, spec.shape) if isinstance(spec, tf.TensorSpec) else value


def _pipelined(model, train_step, own_step):
    """``train_step``, first finishing what the step before left pending (``own_step``:
    the train_step the program set on the model, if any)."""
    import tensorflow as tf

    def step(data):
        deferral = _deferrals.get(model)
        if deferral is None:
            deferral, trial = _plan(model, model.optimizer, train_step, data)
            _deferrals[model] = deferral
            model_ref = weakref.ref(model)
            record(lambda: None if model_ref() is None else decision_for(model_ref()), "keras",
                   key=model_ref, name=model.name)
            if trial is not None:
                return trial[0]
        if not deferral.chunks:
            return train_step(data)
        # Once the step has its data: where the input runs out the step does nothing, and
        # the update stays whole for the drain (else it could be cut off part way).
        with tf.control_dependencies([t for t in tf.nest.flatten(data, expand_composites=True)
                                      if isinstance(t, tf.Tensor)]):
            deferral.finish_pending()
        _active.append(deferral)
        try:
            return train_step(data)
        finally:
            _active.pop()
    step.tfoverlap_own = own_step
    return step


def _drained(model, train_function):
    """``train_function``, then the drain of what its last step left pending, also where
    the input ran out in the call (every rank runs out at the same step)."""
    import tensorflow as tf

    def call(*args, **kwargs):
        try:
            outputs = train_function(*args, **kwargs)
        except tf.errors.OutOfRangeError:
            _drain(model)
            raise
        finally:
            decoupled = getattr(_deferrals.get(model), "decoupled", None)
            if decoupled is not None:
                decoupled.trained()          # the shards changed: whole values are stale
        _drain(model)
        return outputs
    call.__wrapped__ = train_function
    return call


def _drain(model) -> None:
    deferral = _deferrals.get(model)
    if deferral is not None and deferral.drain is not None:
        started = time.perf_counter()
        deferral.drain()
        deferral.drain_seconds.append(time.perf_counter() - started)


