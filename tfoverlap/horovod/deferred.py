"""Cross-step overlap (``tfoverlap.horovod.configure(cross_step=True)``, graph mode).

Within one ``session.run`` the ring cannot start before the first gradient exists, and on
the emulated 8-rank rows it is then busy to the end of the step: no order or bucketing
inside the step gets past forward pass + ring. This moves the reductions of the gradients
that become ready last (the first layers') out of the step, under the next step's forward
pass, and keeps every value a program can see equal to plain Horovod's:

- The train run stores each deferred gradient, unreduced, in a queue, and stages a token:
  the values of the step that its update must use (learning rate, momentum, Adam's beta
  powers), read where the step's own updates read them.
- When a run that stored returns, a background run of the same session reduces the stored
  gradients, chunk by chunk, first layers first, and stages the results. Every rank makes
  the same train runs, so every rank starts the same reductions: no run that a program
  makes on one rank alone (a validation, a checkpoint, an export) ever starts a
  collective.
- Every op that uses a deferred variable or one of its optimizer slots (the next step's
  forward pass, a validation loss, a Saver, Horovod's broadcast, a read of the weights)
  first runs its chunk's *apply*: where a token is pending, it takes the reduced
  gradients and applies them with the token's values; else it does nothing. Token and
  gradients are taken off only once applied, by ops that a failing run does not cancel
  (:func:`staged_apply`): a run that fails while it applies (an exhausted input) still
  applies the update whole. Ops built later (a Saver, a summary) are made to wait when a
  session first runs the graph after they were built. So on any rank, whatever looks at
  the weights sees plain Horovod's weights, and each gradient is applied exactly once.
  Stateful optimizers get no update with a zero gradient, checkpoints hold no extra
  variables, and nothing is left to flush.

Deferred: ``GradientDescentOptimizer``, ``MomentumOptimizer`` and ``AdamOptimizer``
(any learning rate: a constant, a tensor, a schedule), resource variables with a dense
gradient, Horovod's none or fp16 compression, and a reduced gradient that goes straight
into its own update. Anything else keeps the in-step plan, with one warning saying why.
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import threading
import weakref

from tfoverlap.horovod.patching import MARKER, patch
from tfoverlap.log import logger

__all__ = ["deferral_refused", "reducing_allreduce", "defer_updates", "flush_op",
           "deferral_summary", "DEFERRABLE_OPTIMIZERS", "DeferralError", "register_pending",
           "mark_deferred", "pending_summaries", "not_reduced_alone", "staged_apply",
           "stage_results", "arrival_queue", "join_reductions"]

DEFERRABLE_OPTIMIZERS = ("GradientDescentOptimizer", "MomentumOptimizer", "AdamOptimizer")
# Ops that use a variable's handle but not its value: they need not wait for an update.
_VALUELESS_OPS = frozenset({"VarIsInitializedOp", "VariableShape", "DestroyResourceOp"})


class DeferralError(RuntimeError):
    """A program uses a deferred gradient where it cannot be had (raised before the run)."""


@dataclasses.dataclass
class _Group:
    """The deferred updates of one optimizer's apply_gradients."""
    name: str
    stores: tuple                  # the train run's token puts (the run that stores)
    reduce: object                 # the op of the background run that reduces the stores
    close: object                  # closes the queues (a failed reduction)
    guard_of: dict                 # handle tensor name -> its chunk's apply op
    reduced: frozenset             # names of the reduced gradients (only the reduction's)
    own: frozenset                 # names of the ops this group built
    summary: dict
    broadcast_with: dict           # handle tensor name -> op run with its broadcast


@dataclasses.dataclass
class _GraphState:
    groups: list = dataclasses.field(default_factory=list)
    scanned: int = 0               # the graph's version when its ops were given their waits
    scanned_id: int = 0            # the last op id given its waits
    flush: object = None
    trained_by: dict = dataclasses.field(default_factory=dict)   # run key -> groups


_graphs = weakref.WeakKeyDictionary()         # graph -> _GraphState
_reductions = weakref.WeakKeyDictionary()     # session -> {group name: background thread}
_lock = threading.RLock()
_JOIN_SECONDS = 120


def deferral_refused(optimizer, variables, reduced, reduction: dict) -> str:
    """Why updates of ``optimizer`` to ``variables`` with the ``reduced`` gradients (what
    Horovod's ``reduction`` returned for each) cannot be deferred ("" if they can)."""
    import tensorflow as tf

    from tfoverlap.horovod.contract import deferral_refused_by_reduction
    name = type(optimizer).__name__
    if name not in DEFERRABLE_OPTIMIZERS:
        return (f"{name}: only {', '.join(DEFERRABLE_OPTIMIZERS)} are deferred (their "
                "update of a variable reads its own gradient and slots and the step's "
                "values, which are stored with the gradient)")
    if any(not isinstance(v, tf.Variable) or not hasattr(v, "handle") or
           v.handle.dtype != tf.resource for v in variables):
        return "some variables are not resource variables"
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
    return ""


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
    """Builds the step of ``optimizer`` (wrapped by Horovod) with the updates that
    ``chunks`` name deferred; returns its train op.

    ``grads_and_vars``: what the program passed to apply_gradients. ``local[i]``,
    ``reduced[i]`` and ``allreduces[i]`` are the unreduced gradient, the reduced gradient
    (the Identity the reduction ends in) and the HorovodAllreduce op of pair ``i``;
    ``chunks`` lists pair indices, first chunk first. ``apply_in_step(pairs)`` is the
    optimizer's apply_gradients for the pairs kept in the step. Where a deferred pair's
    gradient is not its reduced gradient alone (changed or used after the reduction: a
    global-norm clip, a summary), nothing is deferred, with one line at
    ``refusal_level``."""
    import tensorflow as tf
    from tensorflow.python.ops.data_flow_ops import StagingArea
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
        chained = []
        for number, chunk in enumerate(chunks):
            with graph.name_scope(f"chunk{number}"):
                grads = [local[i] for i in chunk]
                shapes = ([g.shape for g in grads]
                          if all(g.shape.is_fully_defined() for g in grads) else None)
                stored = tf.queue.FIFOQueue(1, [g.dtype for g in grads], shapes,
                                            name="stored")
                tokens = StagingArea([v.dtype for v in values], capacity=1)
                ready = StagingArea([reduced[i].dtype for i in chunk], capacity=1)
                arrived = arrival_queue()
                closes += [queue.close(cancel_pending_enqueues=True)
                           for queue in (stored, arrived)]
                applies.append(_pending_apply(optimizer, [variables[i] for i in chunk],
                                              tokens, ready, arrived))
                for i in chunk:
                    guard_of[variables[i].handle.name] = applies[-1]
                    for slot in optimizer.get_slot_names():
                        guard_of[optimizer.get_slot(variables[i], slot).handle.name] = \
                            applies[-1]
                with tf.control_dependencies(chained):     # first layers first
                    taken = stored.dequeue()
                taken = taken if isinstance(taken, list) else [taken]
                for i, tensor in zip(chunk, taken):
                    tensor.set_shape(local[i].shape)
                    allreduce = allreduces[i]
                    entry = (allreduce if allreduce.inputs[0].dtype == tensor.dtype
                             else allreduce.inputs[0].op)
                    for op in _between(entry, reduced[i].op):
                        op._remove_all_control_inputs()  # noqa: SLF001 - only this run's now
                    entry._update_input(0, tensor)  # noqa: SLF001 - see live_graph
                    mark_deferred(allreduce)
                reduces.append(stage_results(ready, arrived, [reduced[i] for i in chunk]))
                chained = [allreduces[i] for i in chunk]
                stores.append((stored.enqueue(grads), tokens.put(values)))
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


def register_pending(graph, name: str, stores, background, close, guard_of: dict,
                     hidden=frozenset(), own=frozenset(), summary=None,
                     broadcast_with=None) -> None:
    """Registers work that a train run leaves pending for the next one (cross-step's
    deferred reductions, decoupled reduction's all-gathers), and installs the session hooks
    that keep it safe:

    ``stores``: names of the ops that mark a run as the train run; when such a run
    returns, ``background`` (an op) runs in a background run of the same session, on every
    rank alike; ``close`` closes its queues if it fails. ``guard_of``: handle tensor name
    -> the op that applies what is pending to that variable (or slot): every op built
    outside ``own`` (op names) that uses the handle waits for it. ``hidden``: names of
    tensors that exist only in the background run (using one is a :class:`DeferralError`).
    ``summary``: what :func:`deferral_summary` adds up. ``broadcast_with``: handle tensor
    name -> an op (collective) that every Horovod broadcast of that variable from rank 0
    runs first (decoupled reduction's optimizer state, which is not a global variable)."""
    import tensorflow as tf
    state = _graphs.setdefault(graph, _GraphState())
    with _lock:
        state.groups.append(_Group(name, tuple(stores), background, close, guard_of,
                                   frozenset(hidden), frozenset(own), summary or {},
                                   dict(broadcast_with or {})))
        state.trained_by.clear()
        with graph.as_default(), tf.control_dependencies(None):
            state.flush = tf.group(*[apply for group in state.groups
                                     for apply in set(group.guard_of.values())],
                                   name="tfoverlap/deferred/flush")
        _guard_new_ops(graph, state)
    _install_session_hooks()


def not_reduced_alone(pairs, reduced, indices) -> str:
    """Why the updates of ``pairs`` at ``indices`` cannot be moved away from the step's
    reduction: the gradient given to apply_gradients is not the ``reduced`` tensor, or that
    is used elsewhere ("" if neither)."""
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
    """Adam's beta powers are advanced once a step, after its updates (by ops among
    ``step_ops``, what apply_gradients built): the token's reads of them come first, as
    the step's own updates' do."""
    handles = {power.handle.name for power in optimizer._get_beta_accumulators()}  # noqa: SLF001
    for op in step_ops:
        if op.type == "AssignVariableOp" and op.inputs[0].name in handles:
            op._add_control_inputs([read.op for read in reads])  # noqa: SLF001


def _pending_apply(optimizer, variables, tokens, ready, arrived):
    """The op that applies a chunk's pending update with the step's values and the reduced
    gradients, if one is pending, else does nothing (:func:`staged_apply`)."""

    def update(values, gradients):
        return [_apply(optimizer, variable, gradient, values)
                for variable, gradient in zip(variables, gradients)]

    return staged_apply(tokens, ready, arrived, update)


def _listed(tensors) -> list:
    return tensors if isinstance(tensors, list) else [tensors]


def staged_apply(tokens, ready, arrived, update):
    """The op that applies a chunk's pending update, if one is pending (a token is staged
    in the ``tokens`` StagingArea by the train run), else does nothing.

    ``update(values, results)`` builds the update's ops from the token's values and what
    the background run staged in ``ready``; it waits for them on the ``arrived`` queue,
    which the background run fills after staging them (:func:`stage_results`; a wait that
    holds no thread, where a StagingArea's peek would). Token and results are taken off
    only after the update has run, and past the wait no op is one that a failing run
    cancels: a run that fails while it applies (an exhausted input, a refused save) still
    completes the update, and one that fails before leaves it whole for the next run."""
    import tensorflow as tf

    def apply_pending():
        with tf.control_dependencies([arrived.dequeue()]):
            values, results = _listed(tokens.peek(0)), _listed(ready.peek(0))
        updates = update(values, results)
        with tf.control_dependencies(updates):
            taken = _listed(ready.get())
        with tf.control_dependencies(taken):
            done = _listed(tokens.get())
        with tf.control_dependencies(done):
            return tf.constant(True)

    return tf.cond(tokens.size() > 0, apply_pending, lambda: tf.constant(False),
                   name="apply").op


def stage_results(ready, arrived, results):
    """The background run's op that stages ``results`` in ``ready`` and then says so on
    ``arrived`` (for :func:`staged_apply`)."""
    import tensorflow as tf
    with tf.control_dependencies([ready.put(results)]):
        return arrived.enqueue([tf.constant(True)])


def arrival_queue(name: str = "arrived"):
    """The queue on which :func:`staged_apply` waits for the background run's results;
    closing it (the background run failed) makes that wait fail instead of hang."""
    import tensorflow as tf
    return tf.queue.FIFOQueue(1, [tf.bool], [[]], name=name)


def _guard_new_ops(graph, state) -> None:
    """Makes every op built since the last call that uses a deferred variable or slot wait
    for its chunk's apply; raises DeferralError where one uses a reduced gradient (it
    exists only in the background run). Called before a session first sees the ops."""
    if state.scanned >= graph.version:
        return
    own = frozenset().union(*(group.own for group in state.groups))
    guard_of = {name: apply for group in state.groups for name, apply in group.guard_of.items()}
    reduced = frozenset().union(*(group.reduced for group in state.groups))
    broadcast_with = {name: op for group in state.groups
                      for name, op in group.broadcast_with.items()}
    new = sorted((op for op in graph.get_operations() if op._id > state.scanned_id),  # noqa: SLF001
                 key=lambda op: op._id)  # noqa: SLF001
    for op in new:
        if op.name in own or op.type in _VALUELESS_OPS:
            continue
        waits = []
        for tensor in op.inputs:
            if tensor.name in reduced:
                state.scanned_id = op._id - 1  # noqa: SLF001 - raised again next run
                state.scanned = 0
                raise DeferralError(
                    f"tfoverlap: cross_step: {op.name} uses the reduced gradient "
                    f"{tensor.name}, which is reduced after the step (in the next one). "
                    "Use it before the optimizer's apply_gradients is built (its variable "
                    "then stays in the step), or configure(cross_step=False)")
            apply = guard_of.get(tensor.name)
            if apply is not None and apply not in op.control_inputs and apply not in waits:
                waits.append(apply)
        if op.type == "HorovodBroadcast" and broadcast_with:
            try:
                waits += _broadcast_companions(op, broadcast_with, op.control_inputs + waits)
            except DeferralError:
                state.scanned_id = op._id - 1  # noqa: SLF001 - raised again next run
                state.scanned = 0
                raise
        if waits:
            op._add_control_inputs(waits)  # noqa: SLF001 - not yet run by any session
    state.scanned = graph.version
    state.scanned_id = max((op._id for op in new), default=state.scanned_id)  # noqa: SLF001


def _broadcast_companions(broadcast, broadcast_with: dict, present) -> list:
    """The ops of ``broadcast_with`` that the Horovod ``broadcast`` op must run first: the
    one of the variable it broadcasts (read by a ReadVariableOp), if any and not in
    ``present``. Raises DeferralError for a broadcast from another rank than 0."""
    source = broadcast.inputs[0].op
    if source.type != "ReadVariableOp" or source.inputs[0].name not in broadcast_with:
        return []
    root = broadcast.get_attr("root_rank")
    if root != 0:
        raise DeferralError(
            f"tfoverlap: decouple: {broadcast.name} broadcasts a decoupled variable from "
            f"rank {root}; its sharded optimizer state is broadcast from rank 0 only. "
            "Broadcast from rank 0, or configure(decouple=False)")
    companion = broadcast_with[source.inputs[0].name]
    return [] if companion in present else [companion]


def _trained_groups(graph, state, fetched_ops, fed_tensors) -> list:
    """The groups whose stores a run of ``fetched_ops`` (op names) runs, feeding the
    tensors ``fed_tensors`` (names)."""
    key = (frozenset(fetched_ops), frozenset(fed_tensors))
    with _lock:
        if key in state.trained_by:
            return state.trained_by[key]
    store_of = {name: group for group in state.groups for name in group.stores}
    reached, seen = set(), set()
    frontier = [graph.get_operation_by_name(name) for name in fetched_ops]
    while frontier:
        op = frontier.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        if op.name in store_of:
            reached.add(op.name)
        frontier.extend(t.op for t in op.inputs if t.name not in fed_tensors)
        frontier.extend(op.control_inputs)
    trained = [group for group in state.groups if set(group.stores) <= reached]
    with _lock:
        state.trained_by[key] = trained
    return trained


def _reduce_in_background(session, group) -> None:
    """Starts the background run that reduces what ``group``'s train run just stored."""
    with _lock:
        threads = _reductions.setdefault(session, {})
        previous = threads.get(group.name)
    if previous is not None:
        previous.join()        # done: this step's forward pass took its results

    def reduce():
        try:
            session.run(group.reduce)
        except Exception as error:  # noqa: BLE001 - reported here, then the queues close
            if getattr(session, "_closed", False):
                return
            logger.error("tfoverlap: cross_step: the reduction of the deferred gradients "
                         "failed (%s: %s); the next run that uses those variables fails",
                         type(error).__name__, error)
            try:
                session.run(group.close)
            except Exception:  # noqa: BLE001 - the session is going away
                pass

    thread = threading.Thread(target=reduce, name=f"{group.name}-reduce", daemon=True)
    with _lock:
        threads[group.name] = thread
    thread.start()


def join_reductions(session=None) -> None:
    """Lets the reductions in flight (of ``session``, else of every session) finish before
    the session closes or Horovod shuts down: every rank runs them, and one cut short on
    one rank would leave the others' waiting."""
    with _lock:
        threads = [thread for owner, threads in list(_reductions.items())
                   if session is None or owner is session for thread in threads.values()]
    for thread in threads:
        thread.join(timeout=_JOIN_SECONDS)
        if thread.is_alive():
            logger.warning("tfoverlap: cross_step: a reduction of deferred gradients is "
                           "still running after %d s (is a rank gone?)", _JOIN_SECONDS)


def _after_run(session, fetched_ops, fed_tensors) -> None:
    state = _graphs.get(session.graph)
    if state is None or not state.groups:
        return
    for group in _trained_groups(session.graph, state, fetched_ops, fed_tensors):
        _reduce_in_background(session, group)


def _install_session_hooks() -> None:
    """Hooks TensorFlow's session (once per process): new ops get their waits before a
    session first sees them, a run that stored deferred gradients starts their reduction
    when it returns, and a close waits for the reductions in flight."""
    from tensorflow.python.client import session as session_lib
    base = session_lib.BaseSession
    if hasattr(base.close, MARKER):
        return
    patch(base, "_extend_graph", _guarding_new_ops)
    patch(base, "_call_tf_sessionrun", _reducing_after_run)
    patch(base, "_make_callable_from_options", _reducing_after_callable)
    patch(base, "close", _joining_reductions)
    atexit.register(join_reductions)


def _guarding_new_ops(extend_graph):
    def _extend_graph(self):
        state = _graphs.get(self._graph)  # noqa: SLF001
        if state is not None:
            with _lock:
                _guard_new_ops(self._graph, state)  # noqa: SLF001
        return extend_graph(self)
    return _extend_graph


def _reducing_after_run(call_run):
    from tensorflow.python.client import pywrap_tf_session as tf_session

    def _call_tf_sessionrun(self, options, feed_dict, fetch_list, target_list,
                            run_metadata):
        result = call_run(self, options, feed_dict, fetch_list, target_list, run_metadata)
        if _graphs.get(self._graph) is not None:  # noqa: SLF001
            fetched = ([tf_session.TF_OperationName(output.oper) for output in fetch_list]
                       + [tf_session.TF_OperationName(op) for op in target_list])
            fed = [f"{tf_session.TF_OperationName(output.oper)}:{output.index}"
                   for output in feed_dict]
            _after_run(self, fetched, fed)
        return result
    return _call_tf_sessionrun


def _reducing_after_callable(make_callable):
    def _make_callable_from_options(self, callable_options):
        run = make_callable(self, callable_options)
        if _graphs.get(self._graph) is None:  # noqa: SLF001
            return run
        fetched = ([name.split(":")[0] for name in callable_options.fetch]
                   + list(callable_options.target))
        fed = [name if ":" in name else f"{name}:0" for name in callable_options.feed]

        def call(*args, **kwargs):
            result = run(*args, **kwargs)
            _after_run(self, fetched, fed)
            return result
        return call
    return _make_callable_from_options


def _joining_reductions(close):
    def close_after_reductions(self):
        join_reductions(self)
        return close(self)
    return close_after_reductions


def deferral_summary(graph) -> dict:
    """What :func:`defer_updates` deferred in ``graph`` ({} if nothing): counts summed over
    the deferring optimizers."""
    summaries = [summary for summary in pending_summaries(graph) if "deferred" in summary]
    if not summaries:
        return {}
    return {"deferred": sum(s["deferred"] for s in summaries),
            "gradients": sum(s["gradients"] for s in summaries),
            "chunks": [n for s in summaries for n in s["chunks"]],
            "deferred_bytes": sum(s["deferred_bytes"] for s in summaries),
            "optimizers": len(summaries)}


def pending_summaries(graph) -> list[dict]:
    """The summaries :func:`register_pending` was given for ``graph``, in order."""
    state = _graphs.get(graph)
    return [] if state is None else [group.summary for group in state.groups]


def flush_op(graph=None):
    """The op that applies every pending deferred update of ``graph`` (the default graph if
    not given); None where nothing was deferred. Not needed: any run that uses a deferred
    variable applies its pending update first. It makes the weights final for programs
    that read them without TensorFlow (a variable's ``eval`` does use TensorFlow)."""
    import tensorflow as tf
    state = _graphs.get(graph or tf.compat.v1.get_default_graph())
    return None if state is None else state.flush
