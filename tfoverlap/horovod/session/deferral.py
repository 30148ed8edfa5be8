"""Cross-step overlap in graph mode: the gradients the plan defers, stored by the train
run, are reduced by a background run under the next step's forward pass, and every op that
uses such a variable applies its update first (docs/architecture.md, "Graph mode,
cross-step overlap")."""
from __future__ import annotations

import logging

from tfoverlap.horovod.session.pending import (arrival_queue, read_by_a_session,
                                               register_pending, stage_results, staged_apply,
                                               summed_summaries)
from tfoverlap.log import logger

__all__ = ["deferral_refused", "reducing_allreduce", "defer_updates", "deferral_summary",
           "DEFERRABLE_OPTIMIZERS", "mark_deferred", "not_reduced_alone"]

DEFERRABLE_OPTIMIZERS = ("GradientDescentOptimizer", "MomentumOptimizer", "AdamOptimizer")


def deferral_refused(optimizer, variables, reduced, reduction: dict) -> str:
    """Why updates of ``optimizer`` to ``variables`` with the ``reduced`` gradients (what
    Horovod's ``reduction`` returned for each) cannot be deferred ("" if they can)."""
    import tensorflow as tf

    from tfoverlap.horovod.core.contract import deferral_refused_by_reduction
    name = type(optimizer).__name__
    if name not in DEFERRABLE_OPTIMIZERS:
        return (f"{name}: only {', '.join(DEFERRABLE_OPTIMIZERS)} are deferred (their "
                "update of a variable reads its own gradient and slots and the step's "
                "values, which are stored with the gradient)")
    if any(not isinstance(v, tf.Variable) or not hasattr(v, "handle") or
           v.handle.dtype != tf.resource for v in variables):
        return ("some variables are not resource variables (tf.compat.v1.disable_v2_behavior() "
                "makes TF1 layers create ref variables: call "
                "tf.compat.v1.enable_resource_variables() after it)")
    refused = deferral_refused_by_reduction(reduction)
    if refused:
        return refused
    for gradient, variable in zip(reduced, variables):
        if gradient is None:
            return (f"{variable.op.name} has no gradient (the loss does not reach it): leave "
                    "it out of var_list to defer the others")
        if not isinstance(gradient, tf.Tensor):
            return (f"the gradient of {variable.op.name} is sparse (IndexedSlices): "
                    "DistributedOptimizer(..., sparse_as_dense=True) reduces it dense, which "
                    "can be deferred")
    return read_by_a_session(variables)


def reducing_allreduce(reduced):
    """The HorovodAllreduce op that computed the ``reduced`` tensor (fp16 compression casts
    its output back)."""
    return reduced.op.inputs[0].op if reduced.op.type == "Cast" else reduced.op


def mark_deferred(allreduce) -> None:
    """Keeps ``allreduce`` out of Caramel's in-step plan (it reduces a stored gradient)."""
    from tensorflow.core.framework import attr_value_pb2

    from tfoverlap.planning.caramel import DEFERRED_ATTR
    allreduce._set_attr(DEFERRED_ATTR,  # noqa: SLF001 - see live_graph
                        attr_value_pb2.AttrValue(b=True))


def _step_values(optimizer) -> list:
    """The tensors of the step that an update of ``optimizer`` reads besides the gradient
    and the slots (built by its apply_gradients: the same tensors its updates read)."""
    name = type(optimizer).__name__
    if name == "GradientDescentOptimizer":
        return [optimizer._learning_rate_tensor]  # noqa: SLF001 - its _prepare's
    if name == "MomentumOptimizer":
        return [optimizer._learning_rate_tensor, optimizer._momentum_tensor]  # noqa: SLF001
    beta1_power, beta2_power = optimizer._get_beta_accumulators()  # noqa: SLF001
    return [beta1_power.read_value(), beta2_power.read_value(), optimizer._lr_t,  # noqa: SLF001
            optimizer._beta1_t, optimizer._beta2_t, optimizer._epsilon_t]  # noqa: SLF001


def _apply(optimizer, variable, gradient, values):
    """``optimizer``'s update of ``variable`` with ``gradient`` and the step's ``values``
    (:func:`_step_values`): the kernel and casts of its own ``_resource_apply_dense``."""
    import tensorflow as tf
    dtype = gradient.dtype.base_dtype
    values = [tf.cast(value, dtype) for value in values]
    name = type(optimizer).__name__
    locking = optimizer._use_locking  # noqa: SLF001
    if name == "GradientDescentOptimizer":
        return tf.raw_ops.ResourceApplyGradientDescent(
            var=variable.handle, alpha=values[0], delta=gradient, use_locking=locking)
    if name == "MomentumOptimizer":
        return tf.raw_ops.ResourceApplyMomentum(
            var=variable.handle, accum=optimizer.get_slot(variable, "momentum").handle,
            lr=values[0], grad=gradient, momentum=values[1], use_locking=locking,
            use_nesterov=optimizer._use_nesterov)  # noqa: SLF001
    beta1_power, beta2_power, rate, beta1, beta2, epsilon = values
    return tf.raw_ops.ResourceApplyAdam(
        var=variable.handle, m=optimizer.get_slot(variable, "m").handle,
        v=optimizer.get_slot(variable, "v").handle, beta1_power=beta1_power,
        beta2_power=beta2_power, lr=rate, beta1=beta1, beta2=beta2, epsilon=epsilon,
        grad=gradient, use_locking=locking)


def _between(source, sink) -> list:
    """The ops on a path from op ``source`` to op ``sink`` (both included)."""
    below, frontier = set(), [source]
    while frontier:
        op = frontier.pop()
        if op in below:
            continue
        below.add(op)
        frontier.extend(consumer for output in op.outputs for consumer in output.consumers())
    path, frontier = [], [sink]
    seen = set()
    while frontier:
        op = frontier.pop()
        if op in seen or op not in below:
            continue
        seen.add(op)
        path.append(op)
        frontier.extend(tensor.op for tensor in op.inputs)
    return path


def defer_updates(optimizer, grads_and_vars, local, reduced, allreduces, chunks,
                  apply_in_step, refusal_level: int = logging.WARNING):
    """Builds the step of Horovod's wrapped ``optimizer`` with the updates of the pairs
    ``chunks`` name deferred (first chunk first); returns its train op. ``local[i]``,
    ``reduced[i]``, ``allreduces[i]``: pair ``i``'s unreduced gradient, reduced gradient
    (the reduction's last Identity) and HorovodAllreduce op. ``apply_in_step(pairs)``
    applies the pairs kept in the step. Where a deferred pair's gradient is not its
    reduced gradient alone, nothing is deferred, with one line at ``refusal_level``."""
    import tensorflow as tf
    pairs = list(grads_and_vars)
    deferred = [i for chunk in chunks for i in chunk]
    refused = not_reduced_alone(pairs, reduced, deferred)
    if not refused and len(deferred) == len(pairs):
        refused = "every update would be deferred (none would be left in the step)"
    if refused:
        logger.log(refusal_level, "tfoverlap: cross_step: %s; nothing deferred", refused)
        return apply_in_step(pairs)
    graph = pairs[0][1].graph
    group_name = graph.unique_name("tfoverlap/deferred", mark_as_used=True)
    first_op = len(graph.get_operations())
    deferred_set = frozenset(deferred)
    kept = [pair for index, pair in enumerate(pairs) if index not in deferred_set]
    variables = [variable for _, variable in pairs]
    with tf.compat.v1.init_scope():        # the slots, created as apply_gradients would
        optimizer._create_slots(variables)  # noqa: SLF001
    first_step_op = len(graph.get_operations())
    train = apply_in_step(kept)
    in_step_ops = graph.get_operations()[first_op:]
    with tf.control_dependencies(None), graph.name_scope(group_name + "/"):
        values = _step_values(optimizer)
        if type(optimizer).__name__ == "AdamOptimizer":
            _read_before_the_step_advances(optimizer, values[:2],
                                           in_step_ops[first_step_op - first_op:])
        applies, stores, reduces, closes, guard_of = [], [], [], [], {}
        for number, chunk in enumerate(chunks):
            with graph.name_scope(f"chunk{number}"):
                built = _deferred_chunk(optimizer, chunk, [variables[i] for i in chunk],
                                        [local[i] for i in chunk], [reduced[i] for i in chunk],
                                        [allreduces[i] for i in chunk], values,
                                        [allreduces[i] for i in chunks[number - 1]]
                                        if number else [])
            applies.append(built["apply"])
            guard_of.update(built["guard_of"])
            closes += built["closes"]
            reduces.append(built["reduce"])
            stores.append(built["stores"])
        # The step's stores wait for the applies of the step before it (its token).
        token_stores = []
        for stored_op, token_op in stores:
            stored_op._add_control_inputs(applies)  # noqa: SLF001
            token_op._add_control_inputs(applies)  # noqa: SLF001
            token_stores.append(token_op)
        reduce = tf.group(*reduces, name="reduce")
        close = tf.group(*closes, name="close")
        train = tf.group(train, *[op for store in stores for op in store], name="train")
    in_step = frozenset(in_step_ops)
    own = frozenset(op.name for op in graph.get_operations()[first_op:]
                    if op not in in_step)
    summary = {"deferred": len(deferred), "gradients": len(pairs),
               "chunks": [len(chunk) for chunk in chunks],
               "deferred_bytes": sum(variables[i].shape.num_elements()
                                     * variables[i].dtype.base_dtype.size for i in deferred)}
    register_pending(graph, group_name, tuple(op.name for op in token_stores), reduce, close,
                     guard_of, frozenset(reduced[i].name for i in deferred), own, summary)
    logger.info("tfoverlap: %d of %d gradients reduced under the next step's forward pass, "
                "in %d chunks", len(deferred), len(pairs), len(chunks))
    return train


def _deferred_chunk(optimizer, chunk, variables, local, reduced, allreduces, values,
                    previous) -> dict:
    """One chunk of a deferring step: the queue the train run stores its gradients in (and
    the token of the step's ``values``), the background run's reduction of them (its own
    HorovodAllreduce ops re-pointed, after the ``previous`` chunk's), and its apply."""
    import tensorflow as tf
    from tensorflow.python.ops.data_flow_ops import StagingArea
    shapes = [g.shape for g in local] if all(g.shape.is_fully_defined() for g in local) \
        else None
    stored = tf.queue.FIFOQueue(1, [g.dtype for g in local], shapes, name="stored")
    tokens = StagingArea([v.dtype for v in values], capacity=1)
    ready = StagingArea([r.dtype for r in reduced], capacity=1)
    arrived = arrival_queue()
    # The chunk's apply (where its update is pending) with the token's step values.
    apply = staged_apply(tokens, ready, arrived, lambda values, gradients: [
        _apply(optimizer, variable, gradient, values)
        for variable, gradient in zip(variables, gradients)])
    guard_of = {}
    for variable in variables:
        guard_of[variable.handle.name] = apply
        for slot in optimizer.get_slot_names():
            guard_of[optimizer.get_slot(variable, slot).handle.name] = apply
    with tf.control_dependencies(previous):     # in the planned order
        taken = stored.dequeue()
    taken = taken if isinstance(taken, list) else [taken]
    for gradient, tensor, allreduce, result in zip(local, taken, allreduces, reduced):
        tensor.set_shape(gradient.shape)
        entry = (allreduce if allreduce.inputs[0].dtype == tensor.dtype
                 else allreduce.inputs[0].op)
        for op in _between(entry, result.op):
            op._remove_all_control_inputs()  # noqa: SLF001 - only this run's now
        entry._update_input(0, tensor)  # noqa: SLF001 - see live_graph
        mark_deferred(allreduce)
    return {"apply": apply, "guard_of": guard_of,
            "closes": [queue.close(cancel_pending_enqueues=True) for queue in (stored, arrived)],
            "reduce": stage_results(ready, arrived, reduced),
            "stores": (stored.enqueue(local), tokens.put(values))}


def not_reduced_alone(pairs, reduced, indices) -> str:
    """Why the updates of ``pairs`` at ``indices`` cannot leave the step's reduction: the
    gradient given is not the ``reduced`` tensor, or that is used elsewhere ("" if not)."""
    for index in indices:
        gradient, variable = pairs[index]
        if gradient is not reduced[index]:
            return (f"the gradient given to apply_gradients for {variable.op.name} is not "
                    "the reduced gradient (changed after the reduction, e.g. clipped by the "
                    "global norm)")
        if reduced[index].consumers():
            return (f"the reduced gradient of {variable.op.name} is used outside its update "
                    f"(by {reduced[index].consumers()[0].name})")
    return ""


def _read_before_the_step_advances(optimizer, reads, step_ops) -> None:
    """Adam's beta powers advance after the step's updates (by ops among ``step_ops``):
    the token's reads of them come first, as the updates' do."""
    handles = {power.handle.name for power in optimizer._get_beta_accumulators()}  # noqa: SLF001
    for op in step_ops:
        if op.type == "AssignVariableOp" and op.inputs[0].name in handles:
            op._add_control_inputs([read.op for read in reads])  # noqa: SLF001


def deferral_summary(graph) -> dict:
    """What :func:`defer_updates` deferred in ``graph`` ({} if nothing): counts summed over
    the deferring optimizers."""
    return summed_summaries(graph, "deferred")
