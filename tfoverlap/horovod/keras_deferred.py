"""Cross-step overlap in Keras ``model.fit`` (``tfoverlap.horovod.keras``).

Keras owns the loop, so no update may stay pending where user code runs: callbacks,
evaluation, checkpoints and ``get_weights`` come between calls of the train function. Here
the pending state lives inside one call. With ``compile(steps_per_execution=N)`` a call
runs N steps in one ``tf.function``:

- Each step keeps the unreduced gradients that become ready last (the first layers') in
  buffers instead of reducing them, and marks them pending.
- The next step starts, before its forward pass, by reducing the pending buffers, chunk
  by chunk, first layers first, and applying them with the optimizer's own
  ``apply_gradients`` at the step count they came from (the iteration counter is set one
  back around it, so a schedule's rate and Adam's bias correction are the earlier step's).
  The forward pass reads each variable after its chunk's update (TensorFlow orders the ops
  of a variable as they were written), so the reductions of the later chunks run under
  the forward pass of the layers before them.
- After the call, a small ``tf.function`` (the drain) applies what the last step left
  pending, on every rank alike; also where the input ran out inside the call (a step
  applies what is pending only once it has its input, so a step that found none leaves
  the update whole). So between calls nothing is pending: every value user
  code sees is plain Horovod's, and each gradient is applied once.

What to defer is planned by Caramel from a trace of the model's ``train_step`` (the same
plan as graph mode, the drain charged to the steps of a call): "auto" (the default) defers
where that plan predicts ``min_gain``, ``cross_step=True`` wherever a reduction fits. At 8
emulated ranks, with each layer's weight gradient gated as the Caramel pass does, default
options measured 1.23x over Horovod with 4 steps per call (1.13x in-step). Outside what
is known to be exact (a gradient changed between the reduction and the update, loss
scaling, moving averages, XLA, eager runs, one step per call), nothing is deferred and
one line says why.

With ``configure(decouple=True|"auto")`` the steps of a call are decoupled instead
(:mod:`tfoverlap.horovod.tape_decoupled`): each step all-gathers what the step before
updated, reduce-scatters its gradients and updates this rank's shards; the drain
all-gathers the last step's, and every rank gathers the sharded state at the end of each
epoch, and at the batch ends where a callback of rank 0 saves every N batches (rank 0
says where, one flag per call), so that checkpoint callbacks on rank 0 alone write it
whole.
"""
from __future__ import annotations

import copy
import logging
import sys
import time
import weakref

from tfoverlap.horovod.contract import deferral_refused_by_reduction
from tfoverlap.horovod.decisions import record
from tfoverlap.horovod.patching import patch
from tfoverlap.horovod.pipeline import (Deferral, apply_pending, build_slots, make_buffers,
                                        optimizer_refused, reduce_without_cond)
from tfoverlap.horovod.settings import wrapper_option
from tfoverlap.log import logger

__all__ = ["install", "register", "decision_for", "deferral_refused"]

_deferrals = weakref.WeakKeyDictionary()    # Keras model -> Deferral
_optimizers = weakref.WeakKeyDictionary()   # optimizer -> its Horovod reduction arguments
_active: list = []                          # the Deferral of the step being traced
_fit_batch = [None]                         # the batch size of the last Keras data handler


def decision_for(model) -> dict | None:
    """The cross-step decision for ``model``'s train function (as the Caramel report's
    ``cross_step`` entry: mode, deferred, predicted and in-step step, reason; and the
    drains made and the median time of one, after the first), or None before its first
    trace."""
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
    """Marks ``optimizer`` (Horovod's Keras wrapper) as deferring, with the arguments of
    its reduction (device_dense, device_sparse, compression, sparse_as_dense, op,
    gradient_predivide_factor, process_set), and makes its ``minimize`` defer in the
    steps that :func:`install`'s train function traces."""
    import types
    _optimizers[optimizer] = reduction
    plain_minimize = optimizer.minimize

    def minimize(self, loss, var_list, tape=None, **kwargs):
        deferral = _active[-1] if _active else None
        if deferral is None or kwargs:
            return plain_minimize(loss, var_list, tape=tape, **kwargs)
        return _minimize(self, deferral, loss, var_list, tape)

    optimizer.minimize = types.MethodType(minimize, optimizer)


def _reduce(optimizer, gradients, deferred: bool):
    """Horovod's reduction of ``gradients`` as plain HorovodAllreduce ops (those Horovod's
    cond holds), marked as deferred ones where ``deferred``."""
    from tfoverlap.horovod.deferred import mark_deferred, reducing_allreduce
    reduced = reduce_without_cond(gradients, _optimizers[optimizer])
    if deferred:
        for tensor in reduced:
            mark_deferred(reducing_allreduce(tensor))
    return reduced


def _base(optimizer):
    """The class Horovod's wrapper derives from: the program's optimizer class."""
    return super(type(optimizer), optimizer)


def _local_gradients(optimizer, loss, var_list, tape):
    """(gradient, variable) pairs of the step, unreduced (densified where Horovod's
    reduction would densify them first)."""
    import tensorflow as tf
    tape = tf.GradientTape() if tape is None else tape
    base = _base(optimizer)
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
    reduced and applied as Horovod would (decoupled: :func:`_decoupled_update`)."""
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
    reduced = _reduce(optimizer, [gradients[i] for i in kept], deferred=False)
    if deferral.planning is not None:
        from tfoverlap.horovod.deferred import reducing_allreduce
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


def _apply_pending(optimizer, deferral) -> list:
    """What the step before left pending, reduced and applied (:func:`apply_pending`)."""
    return apply_pending(optimizer, deferral,
                         lambda tensors: _reduce(optimizer, tensors, deferred=True))


def _plan(model, optimizer, train_step, data) -> Deferral:
    """Traces ``train_step`` apart, plans the deferral from that graph, and builds the
    buffers; a deferral of nothing (with the reason) where it should not defer."""
    import tensorflow as tf

    from tfoverlap.horovod.scheduling import plan_deferral
    mode = wrapper_option("cross_step", "auto")
    decouple = wrapper_option("decouple", False)
    level = logging.WARNING if (decouple or mode) is True else logging.INFO
    deferral = Deferral(decision={"mode": "auto" if mode == "auto" else "on", "deferred": 0},
                         variables=list(model.trainable_variables))
    refused = deferral_refused(model, optimizer)
    if refused:
        if decouple:
            deferral.decision["decoupled"] = 0
        deferral.decision["reason"] = refused
        logger.log(level, "tfoverlap: %s: %s; nothing %s", "decouple" if decouple else
                   "cross_step", refused, "decoupled" if decouple else "deferred")
        return deferral
    deferral.planning = {}
    try:
        if not decouple:
            build_slots(optimizer, deferral.variables)
        spec = tf.nest.map_structure(lambda value: _batch_spec(value, _fit_batch[0]), data)
        _active.append(deferral)
        try:
            graph = tf.function(train_step).get_concrete_function(spec).graph
        finally:
            _active.pop()
    except Exception as error:  # noqa: BLE001 - nothing is built yet: train in-step
        deferral.planning = None
        deferral.decision["reason"] = f"the step could not be traced apart ({error})"
        logger.warning("tfoverlap: cross_step: nothing deferred: the step could not be "
                       "traced apart (%s: %s)", type(error).__name__, error)
        return deferral
    own, deferral.planning = deferral.planning, None
    if decouple:
        if _decouples(model, optimizer, deferral, graph, own, decouple):
            return deferral
        if not mode:
            return deferral
        build_slots(optimizer, deferral.variables)
        deferral.decision = {"mode": "auto" if mode == "auto" else "on", "deferred": 0}
    with tf.init_scope():
        steps = int(model._steps_per_execution.numpy())  # noqa: SLF001 - checked above
    chunks, deferral.decision = plan_deferral(graph.as_graph_def(add_shapes=True), own, mode,
                                              drain_every=steps)
    deferred = sum(len(chunk) for chunk in chunks)
    if chunks and deferred >= len(deferral.variables):
        chunks, deferral.decision["reason"] = [], "every gradient would be deferred"
    if not chunks:
        logger.log(level, "tfoverlap: cross_step: nothing deferred: %s",
                   deferral.decision.get("reason"))
        return deferral
    deferral.chunks = chunks
    make_buffers(deferral)
    deferral.drain = tf.function(lambda: _apply_pending(optimizer, deferral))
    mb = sum(deferral.buffers[i].shape.num_elements() * deferral.buffers[i].dtype.size
             for i in deferral.deferred) / 1e6
    deferral.decision.update(deferred=deferred, deferred_mb=round(mb, 3),
                             chunks=len(chunks))
    logger.info("tfoverlap: cross_step: %d of %d gradients (%.3g MB) reduced under the "
                "next step's forward pass, in %d chunks (predicted %s ms a step, in-step "
                "%s ms)", deferred, len(deferral.variables), mb, len(chunks),
                deferral.decision.get("predicted_step_ms"),
                deferral.decision.get("in_step_ms"))
    return deferral


def _decouples(model, optimizer, deferral, graph, own: dict, mode) -> bool:
    """Whether ``model.fit``'s steps are decoupled (configure(decouple=...)): planned from
    the step traced apart, where the program and its optimizer allow it; then ``deferral``
    holds its TapeDecoupled and the drain. Else one line says why (and the decision is
    kept for the summary)."""
    import tensorflow as tf

    from tfoverlap.horovod.tape_decoupled import decoupled_for, plan, refused
    level = logging.WARNING if mode is True else logging.INFO
    variables = deferral.variables
    buckets, gathers, decision = plan(graph, own, len(variables), _optimizers[optimizer],
                                      mode, refused(optimizer, variables))
    decision["api"] = "keras"
    if not buckets:
        logger.log(level, "tfoverlap: decouple: nothing decoupled: %s", decision.get("reason"))
        record(decision, "keras", key=weakref.ref(model), name=model.name)
        deferral.decision = decision
        return False
    deferral.decoupled = decoupled_for(optimizer, variables, buckets, gathers,
                                       _optimizers[optimizer])
    deferral.decision = {**decision, **deferral.decoupled.summary()}
    deferral.chunks = deferral.decoupled.chunks
    deferral.drain = tf.function(deferral.decoupled.gather_pending)
    deferral.decoupled.say("model.fit", deferral.decision)
    return True


def _batch_spec(value, batch):
    """The spec of one input of the step, its unknown batch dimension set to ``batch`` (the
    plan's compute estimates need it); other values as they are."""
    import tensorflow as tf
    if not isinstance(value, tf.Tensor):
        return value
    shape = value.shape
    if batch and shape.rank and shape[0] is None:
        shape = tf.TensorShape([batch]).concatenate(shape[1:])
    return tf.TensorSpec(shape, value.dtype)


def _pipelined(model, train_step, own_step):
    """``train_step`` that first applies what the step before left pending (``own_step``:
    the train_step the program set on the model itself, if any)."""
    import tensorflow as tf

    def step(data):
        deferral = _deferrals.get(model)
        if deferral is None:
            deferral = _deferrals[model] = _plan(model, model.optimizer, train_step, data)
            model_ref = weakref.ref(model)
            record(lambda: None if model_ref() is None else decision_for(model_ref()), "keras",
                   key=model_ref, name=model.name)
        if not deferral.chunks:
            return train_step(data)
        # Once the step has its data: where the input runs out the step does nothing, and
        # the update stays whole for the drain (else it could be cut off part way).
        with tf.control_dependencies([t for t in tf.nest.flatten(data, expand_composites=True)
                                      if isinstance(t, tf.Tensor)]):
            if deferral.decoupled is not None:
                deferral.decoupled.gather_pending()
            else:
                _apply_pending(model.optimizer, deferral)
        _active.append(deferral)
        try:
            return train_step(data)
        finally:
            _active.pop()
    step.tfoverlap_own = own_step
    return step


def _drained(model, train_function):
    """``train_function`` followed by the drain of what its last step left pending, also
    where the input ran out inside the call (Keras ends the epoch there; every rank runs
    out at the same step, as Horovod needs)."""
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


def install() -> None:
    """Makes Keras' ``Model.make_train_function`` build the pipelined step and the drain
    for models compiled with a registered optimizer (others are left as they are), and
    Keras' callbacks gather a decoupled state where a save may follow."""
    import tensorflow as tf
    patch(tf.keras.Model, "make_train_function", _making_train_function)
    # Keras' fit makes its data handler (which knows the batch size) before it makes and
    # first calls the train function.
    patch(sys.modules[tf.keras.Model.__module__].data_adapter, "get_data_handler",
          _noting_batch_size)
    patch(tf.keras.callbacks.CallbackList, "on_epoch_end", _consolidating_at_epoch_end)
    patch(tf.keras.callbacks.CallbackList, "on_train_batch_end",
          _consolidating_before_batch_saves)


def _making_train_function(plain_make):
    def make_train_function(self, force=False):
        if self.train_function is not None and not force:
            return self.train_function
        current = self.__dict__.get("train_step")    # a train_step set on the instance
        if hasattr(current, "tfoverlap_own"):           # ours, from an earlier compile
            del self.__dict__["train_step"]
            if current.tfoverlap_own is not None:
                self.__dict__["train_step"] = current.tfoverlap_own
            current = current.tfoverlap_own
        if getattr(self, "optimizer", None) not in _optimizers:
            return plain_make(self, force)
        _deferrals.pop(self, None)
        # Keras looks train_step up on the model when it traces the train function.
        self.__dict__["train_step"] = _pipelined(
            self, current or type(self).train_step.__get__(self), current)
        function = plain_make(self, force)
        self.train_function = _drained(self, function)
        return self.train_function
    return make_train_function


def _noting_batch_size(plain_handler):
    def get_data_handler(*args, **kwargs):
        handler = plain_handler(*args, **kwargs)
        adapter = getattr(handler, "_adapter", None)
        try:
            _fit_batch[0] = adapter.representative_batch_size()
        except Exception:  # noqa: BLE001 - an adapter that cannot tell: static shapes
            _fit_batch[0] = None
        return handler
    return get_data_handler


def _consolidating_at_epoch_end(plain_epoch_end):
    def on_epoch_end(self, epoch, logs=None):
        # Every rank ends the epoch alike: the sharded state is gathered there, so that
        # a checkpoint callback on rank 0 alone writes it whole.
        decoupled = getattr(_deferrals.get(getattr(self, "model", None)), "decoupled", None)
        if decoupled is not None and not decoupled.savable:
            decoupled.consolidate()
        return plain_epoch_end(self, epoch, logs)
    return on_epoch_end


def _consolidating_before_batch_saves(plain_batch_end):
    def on_train_batch_end(self, batch, logs=None):
        decoupled = getattr(_deferrals.get(getattr(self, "model", None)), "decoupled", None)
        if decoupled is not None and _batch_save_due(self, decoupled, batch):
            decoupled.consolidate()
        return plain_batch_end(self, batch, logs)
    return on_train_batch_end


def _saves_by_batch(callback) -> bool:
    """Whether Keras ``callback`` writes checkpoints every N batches (ModelCheckpoint,
    BackupAndRestore with an integer ``save_freq``)."""
    frequency = getattr(callback, "save_freq", None)
    return isinstance(frequency, int) and not isinstance(frequency, bool) and frequency > 0


def _saves_at(callback, batch: int) -> bool:
    """Whether ``callback`` (saving by batch) writes a checkpoint at the end of ``batch``:
    its own rule, tried on a copy (ModelCheckpoint, BackupAndRestore); at every batch end
    for a rule not known."""
    if hasattr(callback, "_should_save_on_batch"):
        return bool(copy.copy(callback)._should_save_on_batch(batch))  # noqa: SLF001
    count = getattr(callback, "_batches_count", None)
    if isinstance(count, int):          # BackupAndRestore counts the batch ends it saw
        return count + 1 >= callback.save_freq
    return True


def _batch_save_due(callback_list, decoupled, batch: int) -> bool:
    """Whether a callback of rank 0 writes a checkpoint at the end of ``batch`` while
    this rank holds only its shards of the state. Collective, on every rank alike: once
    per fit a flag from rank 0 (does any of its callbacks save by batch?), and where one
    does, a flag from rank 0 at each batch end (does one save now?)."""
    import horovod.tensorflow as hvd
    import tensorflow as tf
    savers = [callback for callback in callback_list.callbacks if _saves_by_batch(callback)]
    known = callback_list.__dict__.get("_tfoverlap_batch_saves")
    if known is None:
        known = bool(int(hvd.broadcast(tf.constant(int(bool(savers))), 0,
                                       process_set=decoupled.process_set)))
        callback_list._tfoverlap_batch_saves = known  # noqa: SLF001 - this fit's answer
    if not known or decoupled.savable:
        return False
    due = any(_saves_at(callback, batch) for callback in savers)
    return bool(int(hvd.broadcast(tf.constant(int(due)), 0,
                                  process_set=decoupled.process_set)))
