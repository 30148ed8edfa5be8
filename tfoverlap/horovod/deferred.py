"""Cross-step overlap (``tfoverlap.horovod.configure(cross_step=True)``, graph mode).

Within one ``session.run`` the ring cannot start before the first gradient exists, and on
the emulated 8-rank rows it is then busy to the end of the step: no order or bucketing
inside the step gets past forward pass + ring. This moves the reductions of the gradients
that become ready last (the first layers') into the next run, under its forward pass:

- at the end of a step each such gradient is stored in a buffer variable, not reduced;
- at the start of the next run the buffers are reduced, in chunks, first layers first, and
  applied by the optimizer; each forward read of a deferred variable waits for its update.

The forward pass of step t therefore reads every variable updated with the gradients of
step t-1, as in synchronous training, and the losses are Horovod's. Between runs the
deferred variables lag one update: :func:`flush_op` applies it (run it once after the last
step, before exporting the weights). The buffers are global variables, so a checkpoint
holds them and a restored job resumes exactly.

Only ``GradientDescentOptimizer`` and ``MomentumOptimizer`` with a constant learning rate
and resource variables are deferred: their update of one variable reads no state shared
with others, and a zero gradient on zero-initialized slots changes nothing, which makes
the first step (empty buffers) exact. Every variable needs a dense gradient, reduced with
Horovod's none or fp16 compression. Anything else keeps the in-step plan, with a warning.
"""
from __future__ import annotations

import numbers
import weakref

import numpy as np

from tfoverlap.log import logger

__all__ = ["deferral_refused", "reducing_allreduce", "defer_updates", "flush_op",
           "deferral_summary", "DEFERRABLE_OPTIMIZERS"]

DEFERRABLE_OPTIMIZERS = ("GradientDescentOptimizer", "MomentumOptimizer")
_APPLY_OPS = frozenset({"ResourceApplyGradientDescent", "ResourceApplyMomentum"})
_flush_ops = weakref.WeakKeyDictionary()      # graph -> the flush op of its deferred updates
_summaries = weakref.WeakKeyDictionary()      # graph -> what was deferred


def _is_constant_number(value) -> bool:
    """A real number: a Python or NumPy scalar or a 0-d array (not a bool, a tensor, a
    callable)."""
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def deferral_refused(optimizer, variables, reduced, compression) -> str:
    """Why updates of ``optimizer`` to ``variables`` with the ``reduced`` gradients (what
    Horovod's reduction with ``compression`` returned for each) cannot be deferred ("" if
    they can)."""
    import horovod.tensorflow as hvd
    import tensorflow as tf
    name = type(optimizer).__name__
    if name not in DEFERRABLE_OPTIMIZERS:
        return (f"{name}: only {' and '.join(DEFERRABLE_OPTIMIZERS)} update each variable "
                "from its own gradient and state alone")
    if not _is_constant_number(getattr(optimizer, "_learning_rate", None)):
        return "the learning rate is not a constant number (a schedule would be read a step late)"
    if any(not isinstance(v, tf.Variable) or not hasattr(v, "handle") or
           v.handle.dtype != tf.resource for v in variables):
        return "some variables are not resource variables"
    if compression not in (hvd.Compression.none, hvd.Compression.fp16):
        return (f"compression {getattr(compression, '__name__', compression)}: only "
                "Horovod's none and fp16 are known to reduce a stored gradient exactly")
    for gradient, variable in zip(reduced, variables):
        if gradient is None:
            return (f"{variable.op.name} has no gradient (the loss does not reach it): leave "
                    "it out of var_list to defer the others")
        if not isinstance(gradient, tf.Tensor):
            return (f"the gradient of {variable.op.name} is sparse (IndexedSlices): "
                    "DistributedOptimizer(..., sparse_as_dense=True) reduces it dense, which "
                    "can be deferred")
    return ""


def reducing_allreduce(reduced):
    """The HorovodAllreduce op that computed the ``reduced`` tensor (fp16 compression casts
    its output back)."""
    return reduced.op.inputs[0].op if reduced.op.type == "Cast" else reduced.op


def _mark_deferred(allreduce) -> None:
    """Keeps ``allreduce`` out of Caramel's in-step plan (it reduces a stored gradient)."""
    from tensorflow.core.framework import attr_value_pb2

    from tfoverlap.planning.caramel import DEFERRED_ATTR
    allreduce._set_attr(DEFERRED_ATTR,  # noqa: SLF001 - see live_graph
                        attr_value_pb2.AttrValue(b=True))


def _ancestors(tensors) -> set:
    seen, frontier = set(), [t.op for t in tensors]
    while frontier:
        op = frontier.pop()
        if op in seen:
            continue
        seen.add(op)
        frontier.extend(t.op for t in op.inputs)
        frontier.extend(op.control_inputs)
    return seen


def _reaches_other_updates(allreduce, own: set) -> bool:
    """Whether the reduced gradient flows into an update other than ``own`` (gradients
    combined after the reduction: clipped by their global norm, for example)."""
    frontier, seen = [allreduce], set()
    while frontier:
        op = frontier.pop()
        for output in op.outputs:
            for consumer in output.consumers():
                if consumer in seen:
                    continue
                seen.add(consumer)
                if consumer.type in _APPLY_OPS:
                    if consumer not in own:
                        return True
                else:
                    frontier.append(consumer)
    return False


def defer_updates(train, optimizer, grads, variables, allreduces, chunks, reduce_like):
    """Rewrites the graph of ``train`` (the optimizer's update op, built) so that the
    gradients ``chunks`` name (lists of indices into ``grads``/``variables``/``allreduces``,
    first chunk first) are reduced and applied at the start of the next run; returns the
    new train op. ``allreduces[i]`` is the HorovodAllreduce op of ``grads[i]``;
    ``reduce_like(tensor)`` reduces a tensor as the gradients are reduced (the flush).
    Nothing is deferred (with a warning) where a deferred variable has no update op this
    knows (its forward reads could not be made to wait), or where a deferred gradient is
    combined with others after the reduction (a global-norm clip would mix two steps)."""
    import tensorflow as tf
    graph = train.graph
    deferred = [i for chunk in chunks for i in chunk]
    unknown = [variables[i].op.name for i in deferred
               if not any(op.type in _APPLY_OPS for op in variables[i].handle.consumers())]
    if unknown:
        logger.warning("tfoverlap: cross_step: no update op of %s is known (%s); nothing "
                       "deferred", unknown[0], ", ".join(sorted(_APPLY_OPS)))
        return train
    combined = [variables[i].op.name for i in deferred if _reaches_other_updates(
        allreduces[i], {op for op in variables[i].handle.consumers()
                        if op.type in _APPLY_OPS})]
    if combined:
        logger.warning("tfoverlap: cross_step: the reduced gradient of %s reaches other "
                       "variables' updates (gradients combined after the reduction, e.g. "
                       "clipped by their global norm); nothing deferred", combined[0])
        return train
    forward = _ancestors([grads[i] for i in range(len(grads)) if grads[i] is not None])
    stores, buffers, chained = [], [], []
    with graph.as_default():
        for chunk in chunks:
            reduced_chunk = []
            for index in chunk:
                variable, allreduce = variables[index], allreduces[index]
                with graph.name_scope(f"tfoverlap/deferred/{variable.op.name}/"):
                    buffer = tf.compat.v1.Variable(
                        tf.zeros(variable.shape, variable.dtype.base_dtype),
                        trainable=False, use_resource=True, name="gradient")
                # A chunk is reduced once the one before it is: the first layers first.
                with tf.control_dependencies(chained):
                    previous = buffer.read_value()
                # The stored gradient enters the reduction where the gradient did: at the
                # AllReduce, or at the Cast before it (fp16 compression).
                entry = (allreduce if allreduce.inputs[0].dtype == previous.dtype
                         else allreduce.inputs[0].op)
                entry._update_input(0, previous)  # noqa: SLF001 - see live_graph
                _mark_deferred(allreduce)
                with tf.control_dependencies([previous.op]):
                    stores.append(buffer.assign(grads[index], read_value=False))
                buffers.append((buffer, variable))
                reduced_chunk.append(allreduce)
                applies = [op for op in variable.handle.consumers() if op.type in _APPLY_OPS]
                # Every use on the way to the gradients (reads, gathers) waits.
                reads = [op for op in variable.handle.consumers()
                         if op in forward and op.type not in _APPLY_OPS]
                for read in reads:
                    read._add_control_inputs(applies)  # noqa: SLF001 - see live_graph
            chained = reduced_chunk
        with tf.control_dependencies([train]):
            train = tf.group(*stores, name="tfoverlap/deferred/train")
        flush_gradients = [(reduce_like(buffer.read_value()), variable)
                           for buffer, variable in buffers]
        for reduced, _ in flush_gradients:      # run once after the steps, not in them
            _mark_deferred(reducing_allreduce(reduced))
        flushed = optimizer.apply_gradients(flush_gradients,
                                            name="tfoverlap/deferred/flush_apply")
        with tf.control_dependencies([flushed]):
            _flush_ops[graph] = tf.group(*[buffer.assign(tf.zeros_like(buffer),
                                                         read_value=False)
                                           for buffer, _ in buffers],
                                         name="tfoverlap/deferred/flush")
    _summaries[graph] = {"deferred": len(deferred), "gradients": len(grads),
                         "chunks": [len(chunk) for chunk in chunks],
                         "deferred_bytes": sum(variables[i].shape.num_elements()
                                               * variables[i].dtype.base_dtype.size
                                               for i in deferred)}
    logger.info("tfoverlap: %d of %d gradients reduced under the next step's forward pass, "
                "in %d chunks", len(deferred), len(grads), len(chunks))
    return train


def deferral_summary(graph) -> dict:
    """What :func:`defer_updates` deferred in ``graph`` ({} if nothing)."""
    return dict(_summaries.get(graph, {}))


def flush_op(graph=None):
    """The op that applies the deferred updates of the last step (run it once after the
    last training step, before reading or exporting the weights); None where nothing was
    deferred in ``graph`` (the default graph if not given)."""
    import tensorflow as tf
    return _flush_ops.get(graph or tf.compat.v1.get_default_graph())
