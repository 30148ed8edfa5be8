"""The session backend's pending work, what a TF1 train run leaves for the next one
(deferred reductions, decoupled all-gathers): a mechanism registers its group
(:func:`register_pending`); every op built outside it that uses a pending variable waits
for its apply, and the session hooks start the background runs and join them."""
from __future__ import annotations

import atexit
import dataclasses
import threading
import weakref

from tfoverlap.horovod.core.patching import MARKER, patch
from tfoverlap.log import logger

__all__ = ["DeferralError", "register_pending", "staged_apply", "stage_results",
           "arrival_queue", "join_reductions", "summed_summaries", "flush_op",
           "watch_sessions", "read_by_a_session"]


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
_handed = weakref.WeakKeyDictionary()         # session -> its graph's version when it last took it
_reductions = weakref.WeakKeyDictionary()     # session -> {group name: background thread}
_lock = threading.RLock()
_JOIN_SECONDS = 120


def register_pending(graph, name: str, stores, background, close, guard_of: dict,
                     hidden=frozenset(), own=frozenset(), summary=None,
                     broadcast_with=None) -> None:
    """Registers work a train run leaves pending, and installs the session hooks.
    ``stores``: the ops that mark the train run; when it returns, ``background`` runs in a
    background run of the session (every rank alike), ``close`` closing its queues if
    that fails. ``guard_of``: handle tensor name -> the apply that ops built outside
    ``own`` (op names) using it wait for. ``hidden``: tensors of the background run alone
    (a use is a :class:`DeferralError`). ``summary``: what :func:`summed_summaries` adds
    up. ``broadcast_with``: handle tensor name -> a collective that Horovod's broadcast of
    it from rank 0 runs first (decoupled reduction's optimizer state)."""
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


def _listed(tensors) -> list:
    return tensors if isinstance(tensors, list) else [tensors]


def staged_apply(tokens, ready, arrived, update):
    """The op that applies a chunk's update where the train run staged a token in
    ``tokens``, else does nothing. ``update(values, results)`` builds it from the token's
    values and the background run's results in ``ready``, waited for on ``arrived``
    (:func:`stage_results`; a wait that holds no thread, as a peek would). Token and
    results are taken off once it has run, by ops a failing run does not cancel: an
    update is applied whole, or left whole for the next run."""
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
    """The background run's op that stages ``results`` in ``ready``, then says so on
    ``arrived``."""
    import tensorflow as tf
    with tf.control_dependencies([ready.put(results)]):
        return arrived.enqueue([tf.constant(True)])


def arrival_queue(name: str = "arrived"):
    """The queue :func:`staged_apply` waits on; closed (the background run failed), the
    wait fails instead of hanging."""
    import tensorflow as tf
    return tf.queue.FIFOQueue(1, [tf.bool], [[]], name=name)


def _guard_new_ops(graph, state) -> None:
    """Makes every op built since the last call that uses a pending variable or slot wait
    for its apply, before a session first sees it; a DeferralError where one uses a
    reduced gradient (it exists in the background run alone)."""
    if state.scanned >= graph.version:
        return
    own = frozenset().union(*(group.own for group in state.groups))
    guard_of = {name: apply for group in state.groups for name, apply in group.guard_of.items()}
    reduced = frozenset().union(*(group.reduced for group in state.groups))
    broadcast_with = {name: op for group in state.groups
                      for name, op in group.broadcast_with.items()}
    new = sorted((op for op in graph.get_operations() if op._id > state.scanned_id),  # noqa: SLF001
                 key=lambda op: op._id)  # noqa: SLF001
    try:
        for op in new:
            if op.name in own or op.type in _VALUELESS_OPS:
                continue
            waits = []
            for tensor in op.inputs:
                if tensor.name in reduced:
                    raise DeferralError(
                        f"tfoverlap: cross_step: {op.name} uses the reduced gradient "
                        f"{tensor.name}, which is reduced after the step (in the next one). "
                        "Use it before the optimizer's apply_gradients is built (its "
                        "variable then stays in the step), or configure(cross_step=False)")
                apply = guard_of.get(tensor.name)
                if apply is not None and apply not in op.control_inputs + waits:
                    waits.append(apply)
            if op.type == "HorovodBroadcast" and broadcast_with:
                waits += _broadcast_companions(op, broadcast_with, op.control_inputs + waits)
            if waits:
                op._add_control_inputs(waits)  # noqa: SLF001 - not yet run by any session
    except DeferralError:
        state.scanned_id = op._id - 1  # noqa: SLF001 - the op raises again next run
        state.scanned = 0
        raise
    state.scanned = graph.version
    state.scanned_id = max((op._id for op in new), default=state.scanned_id)  # noqa: SLF001


def _broadcast_companions(broadcast, broadcast_with: dict, present) -> list:
    """The op of ``broadcast_with`` that the Horovod ``broadcast`` op must run first (that
    of the variable it reads), unless ``present``; a DeferralError if not from rank 0."""
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
    """The groups whose stores a run of ``fetched_ops`` runs, fed ``fed_tensors``."""
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
    """Lets the background runs in flight (of ``session``, else all) finish before a close
    or Horovod's shutdown: one cut short on one rank would leave the others waiting."""
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


def watch_sessions() -> None:
    """Hooks TensorFlow's session (once) to remember how much of each graph a session has
    taken: TensorFlow ignores a control input added to an op that a session already has
    (it logs a warning, and the op runs without the wait), so a mechanism whose waits would
    land on such ops must not be built (:func:`read_by_a_session`)."""
    from tensorflow.python.client import session as session_lib
    patch(session_lib.BaseSession, "_extend_graph", _guarding_new_ops)


def read_by_a_session(variables) -> str:
    """Why updates of ``variables`` cannot leave the step where a session that is still
    open already took an op that uses one of them (a read, its initializer): that op
    would run there without the wait for the update ("" if none did; a session made
    afterwards takes the ops with their waits)."""
    graph = variables[0].graph if variables else None
    with _lock:
        sessions = list(_handed.items())
    handed = max((version for session, version in sessions
                  if session.graph is graph and not session._closed),  # noqa: SLF001
                 default=0)
    if not handed:
        return ""
    taken = frozenset(graph.get_operations()[:handed])   # the version counts the ops
    for variable in variables:
        for op in sorted(variable.handle.consumers(), key=lambda op: op._id):  # noqa: SLF001
            if op in taken and op.type not in _VALUELESS_OPS:
                return (f"a session already ran this graph with {op.name}, which uses "
                        f"{variable.op.name}, and TensorFlow does not add a wait to an op "
                        "a session has; build the train op before the session's first run "
                        "to overlap its reductions")
    return ""


def _install_session_hooks() -> None:
    """Hooks TensorFlow's session (once): new ops get their waits, a train run starts its
    background run when it returns, and a close waits for those in flight."""
    from tensorflow.python.client import session as session_lib
    base = session_lib.BaseSession
    if hasattr(base.close, MARKER):
        return
    watch_sessions()
    patch(base, "_call_tf_sessionrun", _reducing_after_run)
    patch(base, "_make_callable_from_options", _reducing_after_callable)
    patch(base, "close", _joining_reductions)
    atexit.register(join_reductions)


def _guarding_new_ops(extend_graph):
    def _extend_graph(self):
        graph = self._graph  # noqa: SLF001
        state = _graphs.get(graph)
        if state is not None:
            with _lock:
                _guard_new_ops(graph, state)
        extended = extend_graph(self)
        with _lock:         # background runs extend from threads of their own
            _handed[self] = graph.version
        return extended
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


def summed_summaries(graph, counted: str) -> dict:
    """The summaries :func:`register_pending` was given for ``graph`` that count
    ``counted`` ("deferred", "decoupled"), added up ({} if none): numbers summed, lists
    joined, and the number of optimizers."""
    state = _graphs.get(graph)
    summaries = [group.summary for group in (state.groups if state else ())
                 if counted in group.summary]
    if not summaries:
        return {}
    return {**{key: [n for s in summaries for n in s[key]] if isinstance(value, list)
               else sum(s[key] for s in summaries) for key, value in summaries[0].items()},
            "optimizers": len(summaries)}


def flush_op(graph=None):
    """The op that applies every pending update of ``graph`` (default: the default graph);
    None where nothing was deferred. Any run that uses a deferred variable applies its
    update first: this is for programs that read the weights without TensorFlow."""
    import tensorflow as tf
    state = _graphs.get(graph or tf.compat.v1.get_default_graph())
    return None if state is None else state.flush
