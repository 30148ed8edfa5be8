"""Decoupled reduction in graph mode: buckets reduce-scattered under the backward pass,
each rank's shard updated, the parameters all-gathered by a background run under the next
forward pass (docs/architecture.md, "Graph mode, decoupled reduction")."""
from __future__ import annotations

import dataclasses
import logging

from tfoverlap.horovod.core.layout import BucketLayout, padded
from tfoverlap.horovod.session.deferral import (deferral_refused, mark_deferred,
                                                not_reduced_alone)
from tfoverlap.horovod.session.pending import (arrival_queue, register_pending,
                                               stage_results, staged_apply, summed_summaries)
from tfoverlap.horovod.session.saves import install_session_saves
from tfoverlap.horovod.session.sharded_state import (ShardedState, expose_whole_slots,
                                                     sharded_states)
from tfoverlap.log import logger

__all__ = ["decoupling_refused", "decouple_updates", "decoupling_summary"]


def decoupling_refused(optimizer, variables, reduced, reduction: dict) -> str:
    """Why updates of ``optimizer`` to ``variables`` with the ``reduced`` gradients (what
    Horovod's ``reduction`` returned) cannot be decoupled ("" if they can)."""
    import tensorflow as tf

    from tfoverlap.horovod.core.contract import decoupling_refused_by_reduction
    refused = (deferral_refused(optimizer, variables, reduced, reduction)
               or decoupling_refused_by_reduction(reduction))
    if refused:
        return refused
    odd = next((v for v in variables if v.dtype.base_dtype != tf.float32), None)
    if odd is not None:
        return f"{odd.op.name} is {odd.dtype.base_dtype.name}: only float32 is decoupled"
    return ""


def decouple_updates(optimizer, grads_and_vars, local, reduced, allreduces, buckets,
                     gathers, apply_in_step, reduction: dict,
                     refusal_level: int = logging.WARNING):
    """Builds the step of Horovod's wrapped ``optimizer`` decoupled; returns its train op
    (None, with one line at ``refusal_level``, where it cannot be). ``local``, ``reduced``,
    ``allreduces`` as :func:`~tfoverlap.horovod.session.deferral.defer_updates` takes them
    (the AllReduces left unrun); ``buckets``: pair indices in the order the backward pass
    makes them; ``gathers``: bucket indices, first needed first; ``reduction``: Horovod's
    arguments (its op and process set are the reduce-scatter's)."""
    import tensorflow as tf
    pairs = list(grads_and_vars)
    refused = not_reduced_alone(pairs, reduced, range(len(pairs)))
    if refused:
        logger.log(refusal_level, "tfoverlap: decouple: %s; nothing decoupled", refused)
        return None
    if sorted(i for bucket in buckets for i in bucket) != list(range(len(pairs))):
        raise ValueError("the buckets must hold every pair once")
    process_set = reduction["process_set"]
    ranks, rank = process_set.size(), process_set.rank()
    variables = [variable for _, variable in pairs]
    layouts = [BucketLayout.of(bucket, [variables[i].shape.num_elements() for i in bucket],
                               ranks) for bucket in buckets]
    graph = variables[0].graph
    name = graph.unique_name("tfoverlap/decoupled", mark_as_used=True)
    first_op = len(graph.get_operations())
    with tf.control_dependencies(None), graph.name_scope(name + "/"):
        gathering = _Gathering.build(graph, layouts, gathers, variables, process_set)
    own = frozenset(op.name for op in graph.get_operations()[first_op:])
    for allreduce in allreduces:
        mark_deferred(allreduce)         # left unrun: Caramel plans around it
    # The step, in the program's context (its control dependencies hold for the updates).
    with graph.name_scope(name + "/step/"):
        shard_gradients, shard_variables, loads = _scattered_shards(layouts, local, variables,
                                                                    reduction)
    # In the program's name scope, as apply_gradients would: Adam's beta powers keep the
    # names a checkpoint of the program without decoupling has.
    with tf.compat.v1.init_scope():
        optimizer._create_slots(shard_variables)  # noqa: SLF001
    with tf.control_dependencies(None), graph.name_scope(name + "/state/"):
        state = ShardedState(optimizer, variables, layouts, shard_variables, rank,
                             process_set, gathering.wanted)
    with tf.control_dependencies(None), graph.name_scope(name + "/"):
        background = gathering.background(graph, state)
    with tf.compat.v1.init_scope():         # as the slots' restores are built without it
        expose_whole_slots(optimizer, state.whole_slots)
    with graph.name_scope(name + "/step/"):
        with tf.control_dependencies(loads + state.ensure_initialized()):
            update = apply_in_step(list(zip(shard_gradients, shard_variables)))
        stores = []
        with tf.control_dependencies([update]):
            for b, variable in enumerate(shard_variables):
                stores.append(gathering.stored[b].enqueue([variable.read_value()]))
            with tf.control_dependencies(stores):
                marks = [token.put([tf.constant(True)]) for token in gathering.tokens]
            dropped = state.drop_whole()         # the step changed the shards
        train = tf.group(update, *stores, *marks, *dropped, name="train")
    summary = {"decoupled": len(pairs), "buckets": [len(b) for b in buckets],
               "gathers": [len(chunk) for chunk in gathers],
               "bytes": sum(4 * layout.total for layout in layouts),
               "shard_bytes": sum(4 * layout.shard for layout in layouts)}
    broadcast_with = ({} if state.broadcast is None else
                      {variable.handle.name: state.broadcast for variable in variables})
    register_pending(graph, name, [mark.name for mark in marks], background,
                     gathering.close, gathering.guard_of, own=own, summary=summary,
                     broadcast_with=broadcast_with)
    sharded_states.setdefault(graph, []).append(state)
    install_session_saves()
    logger.info("tfoverlap: decouple: %d gradients reduce-scattered in %d buckets, "
                "all-gathered under the next forward pass in %d requests", len(pairs),
                len(buckets), len(gathers))
    return train


@dataclasses.dataclass
class _Gathering:
    """The background run's side of a decoupled step: the queues of the updated shards,
    the all-gathers (first layers first, by request) and the applies of their results."""
    stored: list                   # FIFOQueue per bucket: the shard the train run updated
    gathered: list                 # StagingArea per request: the gathered wholes
    tokens: list                   # StagingArea per request: an update is pending
    arrived: list                  # arrival queue per request
    wanted: object                 # this rank's request for the whole optimizer state
    guard_of: dict                 # handle tensor name -> its request's apply
    puts: list                     # per request: the op that stages its results
    first_whole: list              # the first request's gathered wholes
    consolidating: object          # whether some rank asked for the whole state
    close: object                  # closes the queues (a failed background run)

    @classmethod
    def build(cls, graph, layouts, gathers, variables, process_set) -> "_Gathering":
        import horovod.tensorflow as hvd
        import tensorflow as tf
        from tensorflow.python.ops.data_flow_ops import StagingArea
        ranks = process_set.size()
        stored = [tf.queue.FIFOQueue(1, [tf.float32], [[layout.shard]], name=f"stored{b}")
                  for b, layout in enumerate(layouts)]
        gathered = [StagingArea([tf.float32] * len(chunk),
                                [[ranks * layouts[b].shard] for b in chunk], capacity=1)
                    for chunk in gathers]
        tokens = [StagingArea([tf.bool], [[]], capacity=1) for _ in gathers]
        arrived = [arrival_queue(f"arrived{number}") for number in range(len(gathers))]
        # This rank's request for the whole optimizer state (a save on it alone); it rides
        # on the first all-gather, and where any rank asked, every rank consolidates.
        wanted = tf.queue.FIFOQueue(1, [tf.bool], [[]], name="save_wanted")
        guard_of, puts, chained = {}, [], []
        for number, chunk in enumerate(gathers):
            with graph.name_scope(f"gather{number}"):
                with tf.control_dependencies(chained):       # first layers first
                    shards = [stored[b].dequeue() for b in chunk]
                flag = [tf.reshape(tf.cast(wanted.size(), tf.float32), [1])] * (number == 0)
                whole = hvd.grouped_allgather(shards + flag, process_set=process_set)
                if number == 0:          # staged once the state is consolidated, if wanted
                    whole, consolidating = whole[:-1], tf.reduce_max(whole[-1]) > 0
                    first_whole = whole
                    puts.append(None)
                else:
                    puts.append(stage_results(gathered[number], arrived[number], whole))
                chained = whole
                apply = _pending_apply(tokens[number], gathered[number], arrived[number],
                                       [layouts[b] for b in chunk], variables)
                for b in chunk:
                    for i in layouts[b].members:
                        guard_of[variables[i].handle.name] = apply
        close = tf.group(*[queue.close(cancel_pending_enqueues=True)
                           for queue in stored + arrived], name="close")
        return cls(stored, gathered, tokens, arrived, wanted, guard_of, puts, first_whole,
                   consolidating, close)

    def background(self, graph, state):
        """The background run's op: every request gathered and staged, the first after a
        consolidation where some rank asked for one."""
        import tensorflow as tf
        with graph.name_scope("gather0"):
            with tf.control_dependencies([tf.cond(self.consolidating,
                                                  state.consolidate_for_save,
                                                  lambda: tf.constant(False))]):
                self.puts[0] = stage_results(self.gathered[0], self.arrived[0],
                                             self.first_whole)
        return tf.group(*self.puts, name="gather")


def _scattered_shards(layouts, local, variables, reduction) -> tuple[list, list, list]:
    """The train run's side: (each bucket of ``local`` gradients reduce-scattered, this
    rank's shard variables, their loads of its part of the parameters)."""
    import horovod.tensorflow as hvd
    import tensorflow as tf
    process_set = reduction["process_set"]
    ranks, rank = process_set.size(), process_set.rank()
    shard_gradients, shard_variables, loads = [], [], []
    for b, layout in enumerate(layouts):
        flat = padded([local[i] for i in layout.members], ranks * layout.shard)
        shard_gradients.append(hvd.reducescatter(flat, op=reduction["op"],
                                                 name=f"tfoverlap_scatter{b}",
                                                 process_set=process_set))
        with tf.compat.v1.init_scope():
            shard_variables.append(tf.compat.v1.Variable(
                tf.zeros([layout.shard]), trainable=False, collections=[],
                use_resource=True, name=f"shard{b}"))
        loads.append(shard_variables[-1].assign(
            layout.shard_of(rank, lambda i: variables[i].read_value()), read_value=False))
    return shard_gradients, shard_variables, loads


def _pending_apply(token, gathered, arrived, layouts, variables):
    """The op that assigns a request's gathered parameters, where one is pending."""
    import tensorflow as tf

    def update(_, wholes):
        assigns = []
        for whole, layout in zip(wholes, layouts):
            for i, value in layout.split(whole):
                assigns.append(variables[i].assign(
                    tf.reshape(value, variables[i].shape), read_value=False))
        return assigns

    return staged_apply(token, gathered, arrived, update)


def decoupling_summary(graph) -> dict:
    """What :func:`decouple_updates` built in ``graph`` ({} if nothing), summed over the
    decoupled optimizers."""
    return summed_summaries(graph, "decoupled")
