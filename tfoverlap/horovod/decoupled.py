"""Decoupled reduction (``tfoverlap.horovod.configure(decouple=True)``, graph mode).

An AllReduce is a reduce-scatter followed by an all-gather. Here the two halves go where
each overlaps best (:mod:`tfoverlap.planning.decoupled` plans them):

- **In the train run**, each bucket of gradients (Caramel's buckets, priced as
  reduce-scatters) is flattened and reduce-scattered as the backward pass produces it.
  Each rank then updates its own 1/n of the bucket: the parameters of that shard are
  copied from the variables into a flat shard variable, and the program's own optimizer
  applies the averaged shard gradient to it, with optimizer state (Momentum's
  accumulator, Adam's moments) for the shard only. The updated shard is stored.
- **When the train run returns**, a background run of the same session (on every rank
  alike, as cross-step overlap's reductions: :func:`~tfoverlap.horovod.deferred.\
register_pending`) all-gathers the stored shards, first layers first, in a few requests.
- **Every op that uses a variable** (the next step's forward pass, a validation loss, a
  Saver, Horovod's broadcast) first runs its chunk's apply: where an update is pending,
  it takes the gathered parameters and assigns them to the variables; else nothing.

So every value a program can read of its variables is plain Horovod's (elementwise
optimizers compute each element alike on a shard and on the whole tensor; past 2 ranks,
up to the order in which the reduce-scatter adds the ranks' gradients), half of the
bytes move under the backward pass and half under the next forward pass, and optimizer
memory falls by the number of ranks.

**Checkpoints and broadcasts** see whole slots under their plain names
(:class:`ShardedState` for a Saver; the optimizer's ``get_slot`` for an object-based
``tf.train.Checkpoint``): a checkpoint written with decoupling restores without it and
the other way round. Restoring needs no collective; a restore on rank 0 alone reaches the
other ranks' shards through Horovod's broadcast from rank 0, which carries the slots
along. Writing the state on one rank needs the others' shards: every rank first runs
:func:`consolidate_optimizer_state` (as ZeRO's and PyTorch's sharded optimizers ask), and
a save without it is refused with that remedy named. A ``MonitoredTrainingSession``
whose checkpoint hook runs on rank 0 alone needs nothing: :func:`_install_session_saves`.

Decoupled: ``GradientDescentOptimizer``, ``MomentumOptimizer`` and ``AdamOptimizer`` with
float32 resource variables, dense gradients and no compression, where the gradient given
to apply_gradients is the reduced gradient alone. Anything else trains without it
(cross-step overlap where configured, else the in-step plan), with one line saying why.
Not yet: Keras and ``tf.function`` steps.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import weakref

from tfoverlap.horovod.deferred import (DEFERRABLE_OPTIMIZERS, arrival_queue,
                                        deferral_refused, mark_deferred, not_reduced_alone,
                                        pending_summaries, register_pending, stage_results,
                                        staged_apply)
from tfoverlap.horovod.patching import patch, unpatched
from tfoverlap.log import logger

__all__ = ["decoupling_refused", "decouple_updates", "decoupling_summary",
           "consolidate_optimizer_state", "DECOUPLABLE_OPTIMIZERS", "BucketLayout",
           "ShardedState"]

DECOUPLABLE_OPTIMIZERS = DEFERRABLE_OPTIMIZERS
_states = weakref.WeakKeyDictionary()    # graph -> its ShardedStates
_exposed = weakref.WeakKeyDictionary()   # optimizer -> (slot key, slot name) -> WholeSlot


def decoupling_refused(optimizer, variables, reduced, reduction: dict) -> str:
    """Why updates of ``optimizer`` to ``variables`` with the ``reduced`` gradients (what
    Horovod's ``reduction`` returned) cannot be decoupled ("" if they can)."""
    import tensorflow as tf

    from tfoverlap.horovod.contract import decoupling_refused_by_reduction
    refused = (deferral_refused(optimizer, variables, reduced, reduction)
               or decoupling_refused_by_reduction(reduction))
    if refused:
        return refused
    odd = next((v for v in variables if v.dtype.base_dtype != tf.float32), None)
    if odd is not None:
        return f"{odd.op.name} is {odd.dtype.base_dtype.name}: only float32 is decoupled"
    return ""


@dataclasses.dataclass(frozen=True)
class BucketLayout:
    """Where a bucket's variables sit in its flat vector, and the shard each rank owns.

    ``members``: pair indices; ``counts``: their element counts, in that order (flat
    offsets follow); ``shard``: elements per rank (the vector is padded to ranks x
    shard)."""

    members: tuple[int, ...]
    counts: tuple[int, ...]
    shard: int

    @classmethod
    def of(cls, members, counts, ranks: int) -> "BucketLayout":
        total = sum(counts)
        return cls(tuple(members), tuple(counts), max(1, math.ceil(total / ranks)))

    @property
    def total(self) -> int:
        return sum(self.counts)

    def owned(self, rank: int) -> list[tuple[int, int, int]]:
        """(position in ``members``, first element, end element) of each variable's part
        in ``rank``'s shard."""
        low, high = rank * self.shard, (rank + 1) * self.shard
        parts, offset = [], 0
        for position, count in enumerate(self.counts):
            first, end = max(low, offset), min(high, offset + count)
            if first < end:
                parts.append((position, first - offset, end - offset))
            offset += count
        return parts


def _flat(tensor):
    import tensorflow as tf
    return tf.reshape(tensor, [-1])


def _padded(tensors, length: int):
    """The flat concatenation of ``tensors``, zero-padded to ``length`` elements."""
    import tensorflow as tf
    flat = [_flat(t) for t in tensors]
    missing = length - sum(int(f.shape[0]) for f in flat)
    if missing:
        flat.append(tf.zeros([missing], flat[0].dtype))
    return flat[0] if len(flat) == 1 else tf.concat(flat, 0)


def decouple_updates(optimizer, grads_and_vars, local, reduced, allreduces, buckets,
                     gathers, apply_in_step, reduction: dict,
                     refusal_level: int = logging.WARNING):
    """Builds the step of ``optimizer`` (wrapped by Horovod) decoupled; returns its train
    op (None, with one line at ``refusal_level``, where it cannot be).

    ``grads_and_vars``: what the program passed to apply_gradients. ``local[i]``,
    ``reduced[i]`` and ``allreduces[i]`` are pair ``i``'s unreduced gradient, reduced
    gradient and HorovodAllreduce op (left unrun). ``buckets``: lists of pair indices in
    the order the backward pass makes them; ``gathers``: lists of bucket indices, first
    needed first. ``apply_in_step(pairs)`` is the wrapped optimizer's apply_gradients;
    ``reduction``: Horovod's reduction arguments (its op and process set are the
    reduce-scatter's)."""
    import horovod.tensorflow as hvd
    import tensorflow as tf
    from tensorflow.python.ops.data_flow_ops import StagingArea
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
        stored = [tf.queue.FIFOQueue(1, [tf.float32], [[layout.shard]], name=f"stored{b}")
                  for b, layout in enumerate(layouts)]
        gathered_shapes = [[[ranks * layouts[b].shard] for b in chunk] for chunk in gathers]
        gathered = [StagingArea([tf.float32] * len(chunk), shapes, capacity=1)
                    for chunk, shapes in zip(gathers, gathered_shapes)]
        tokens = [StagingArea([tf.bool], [[]], capacity=1) for _ in gathers]
        arrived = [arrival_queue(f"arrived{number}") for number in range(len(gathers))]
        # This rank's request for the whole optimizer state (a save on it alone); it rides
        # on the first all-gather, and where any rank asked, every rank consolidates.
        wanted = tf.queue.FIFOQueue(1, [tf.bool], [[]], name="save_wanted")
        guard_of, applies, puts, chained = {}, [], [], []
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
                applies.append(_pending_apply(tokens[number], gathered[number],
                                              arrived[number], [layouts[b] for b in chunk],
                                              variables))
                for b in chunk:
                    for i in layouts[b].members:
                        guard_of[variables[i].handle.name] = applies[-1]
        close = tf.group(*[queue.close(cancel_pending_enqueues=True)
                           for queue in stored + arrived], name="close")
    own = frozenset(op.name for op in graph.get_operations()[first_op:])
    for allreduce in allreduces:
        mark_deferred(allreduce)         # left unrun: Caramel plans around it
    # The step, in the program's context (its control dependencies hold for the updates).
    with graph.name_scope(name + "/step/"):
        shard_gradients, shard_variables, loads = [], [], []
        for b, layout in enumerate(layouts):
            flat = _padded([local[i] for i in layout.members], ranks * layout.shard)
            shard_gradients.append(hvd.reducescatter(flat, op=reduction["op"],
                                                     name=f"tfoverlap_scatter{b}",
                                                     process_set=process_set))
            with tf.compat.v1.init_scope():
                shard_variables.append(tf.compat.v1.Variable(
                    tf.zeros([layout.shard]), trainable=False, collections=[],
                    use_resource=True, name=f"shard{b}"))
            parts = [tf.slice(_flat(variables[layout.members[position]].read_value()),
                              [first], [end - first])
                     for position, first, end in layout.owned(rank)]
            owned = sum(end - first for _, first, end in layout.owned(rank))
            if owned < layout.shard:
                parts.append(tf.zeros([layout.shard - owned]))
            loads.append(shard_variables[-1].assign(
                parts[0] if len(parts) == 1 else tf.concat(parts, 0), read_value=False))
    # In the program's name scope, as apply_gradients would: Adam's beta powers keep the
    # names a checkpoint of the program without decoupling has.
    with tf.compat.v1.init_scope():
        optimizer._create_slots(shard_variables)  # noqa: SLF001
    with tf.control_dependencies(None), graph.name_scope(name + "/state/"):
        state = ShardedState(optimizer, variables, layouts, shard_variables, rank,
                             process_set, wanted)
    with tf.control_dependencies(None), graph.name_scope(name + "/"):
        with graph.name_scope("gather0"):
            with tf.control_dependencies([tf.cond(consolidating, state.consolidate_for_save,
                                                  lambda: tf.constant(False))]):
                puts[0] = stage_results(gathered[0], arrived[0], first_whole)
        background = tf.group(*puts, name="gather")
    with tf.compat.v1.init_scope():         # as the slots' restores are built without it
        _expose_whole_slots(optimizer, state.whole_slots)
    with graph.name_scope(name + "/step/"):
        with tf.control_dependencies(loads + state.ensure_initialized()):
            update = apply_in_step(list(zip(shard_gradients, shard_variables)))
        stores = []
        with tf.control_dependencies([update]):
            for b, variable in enumerate(shard_variables):
                stores.append(stored[b].enqueue([variable.read_value()]))
            with tf.control_dependencies(stores):
                marks = [token.put([tf.constant(True)]) for token in tokens]
            dropped = state.drop_whole()         # the step changed the shards
        train = tf.group(update, *stores, *marks, *dropped, name="train")
    summary = {"decoupled": len(pairs), "buckets": [len(b) for b in buckets],
               "gathers": [len(chunk) for chunk in gathers],
               "bytes": sum(4 * layout.total for layout in layouts),
               "shard_bytes": sum(4 * layout.shard for layout in layouts)}
    broadcast_with = ({} if state.broadcast is None else
                      {variable.handle.name: state.broadcast for variable in variables})
    register_pending(graph, name, [mark.name for mark in marks], background, close,
                     guard_of, own=own, summary=summary, broadcast_with=broadcast_with)
    _states.setdefault(graph, []).append(state)
    _install_session_saves()
    logger.info("tfoverlap: decouple: %d gradients reduce-scattered in %d buckets, "
                "all-gathered under the next forward pass in %d requests", len(pairs),
                len(buckets), len(gathers))
    return train


CONSOLIDATE_FIRST = (
    "tfoverlap: decouple: the optimizer state is sharded across the ranks, and this rank "
    "holds only its shard: run tfoverlap.horovod.consolidate_optimizer_state(session) on "
    "every rank after the last train run and before saving on one rank")


class ShardedState:
    """The optimizer slots of the shards, seen from outside as whole slots.

    Each rank's slot variables hold its shard of every bucket. They are left out of the
    global variables (a Saver would write each rank's shard, a broadcast would copy rank
    0's shard to every rank) and initialized when first used. What a checkpoint or a
    broadcast sees instead is each variable's whole slot under the name the optimizer
    would have given it without decoupling (``dense/kernel/Momentum``), kept in a *whole*
    buffer per variable and slot wherever this rank has it: after a restore, a
    consolidation or a broadcast, until the next train run changes the shards.

    ``wanted``: the queue that holds this rank's request for a consolidation (``request``
    puts one in; the background run after the next train run consolidates on every rank
    where any rank asked). ``savable``: whether a checkpoint can be written now."""

    def __init__(self, optimizer, variables, layouts, shard_variables, rank, process_set,
                 wanted):
        import tensorflow as tf
        from tensorflow.python.ops import resource_variable_ops
        self.variables, self.layouts, self.rank = variables, layouts, rank
        self.process_set, self._wanted = process_set, wanted
        names = sorted(optimizer.get_slot_names())
        # Every decouplable optimizer starts its slots at zero.
        self.slots = [[optimizer.get_slot(shard, slot) for slot in names]
                      for shard in shard_variables]
        global_variables = tf.compat.v1.get_collection_ref(
            tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
        for slot in (slot for bucket in self.slots for slot in bucket):
            global_variables.remove(slot)
        self._ensured = [[self._ensure(slot) for slot in bucket] for bucket in self.slots]
        graph = tf.compat.v1.get_default_graph()
        self.whole = {}             # (pair index, slot position) -> resource handle
        for b, layout in enumerate(layouts):
            for i in layout.members:
                for position in range(len(names)):
                    name = f"whole{i}_{position}"
                    self.whole[i, position] = tf.raw_ops.VarHandleOp(
                        dtype=tf.float32, shape=variables[i].shape, name=name,
                        shared_name=graph.unique_name(name, mark_as_used=False))
        with graph.name_scope("consolidate"):
            self.consolidate = tf.group(*self._consolidation(), name="consolidate")
        self.broadcast = self._build_broadcast() if names else None
        self.request = tf.cond(wanted.size() > 0, lambda: tf.constant(False),
                               lambda: _after(wanted.enqueue(True)), name="request")
        # Saved as it is: the whole slot where this rank holds it, else the zeros of a
        # slot never stepped.
        self.savable = tf.reduce_all(tf.stack(
            [tf.constant(True)] + [self.has_whole(i, position) | tf.logical_not(
                resource_variable_ops.var_is_initialized_op(
                    self.slots[b][position].handle))
                for b, layout in enumerate(layouts) for i in layout.members
                for position in range(len(names))]), name="savable")
        self._saved = {}            # (pair index, slot position) -> the value saved
        self.whole_slots = []       # (variable, slot name, its WholeSlot)
        for b, layout in enumerate(layouts):
            for i in layout.members:
                for position, shard_slot in enumerate(self.slots[b]):
                    name = (f"{variables[i].op.name}/"
                            f"{shard_slot.op.name[len(shard_variables[b].op.name) + 1:]}")
                    self._saved[i, position] = self._guarded(b, i, position)
                    tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.SAVEABLE_OBJECTS,
                                                   _whole_slot(self, b, i, position, name))
                    self.whole_slots.append((variables[i], names[position],
                                             _whole_slot_class()(self, b, i, position, name)))

    @staticmethod
    def _ensure(slot):
        import tensorflow as tf
        from tensorflow.python.ops import resource_variable_ops

        def initialize():
            with tf.control_dependencies([slot.assign(tf.zeros(slot.shape),
                                                      read_value=False)]):
                return tf.constant(True)

        return tf.cond(resource_variable_ops.var_is_initialized_op(slot.handle),
                       lambda: tf.constant(False), initialize, name="ensure").op

    def ensure_initialized(self, bucket=None) -> list:
        """The ops that give the shard slots (of ``bucket``, else all) their zeros if they
        have no value yet; each runs once per run, before anything else uses the slot."""
        return [op for b, ops in enumerate(self._ensured) if bucket in (None, b)
                for op in ops]

    def drop_whole(self) -> list:
        import tensorflow as tf
        return [tf.raw_ops.DestroyResourceOp(resource=handle, ignore_lookup_error=True)
                for handle in self.whole.values()]

    def has_whole(self, i, position):
        import tensorflow as tf
        return tf.raw_ops.VarIsInitializedOp(resource=self.whole[i, position])

    def read_whole(self, i, position):
        import tensorflow as tf
        return tf.raw_ops.ReadVariableOp(resource=self.whole[i, position], dtype=tf.float32)

    def keep_whole(self, i, position, value):
        import tensorflow as tf
        return tf.raw_ops.AssignVariableOp(resource=self.whole[i, position],
                                           value=tf.reshape(value, self.variables[i].shape))

    def _guarded(self, b, i, position):
        """Pair ``i``'s whole slot at ``position``: the whole buffer, zeros before the
        first step, refused (CONSOLIDATE_FIRST) where this rank holds only its shard."""
        import tensorflow as tf
        from tensorflow.python.ops import resource_variable_ops
        shape, slot = self.variables[i].shape, self.slots[b][position]

        def refused():
            with tf.control_dependencies([tf.debugging.Assert(
                    self.has_whole(i, position), [CONSOLIDATE_FIRST])]):
                return tf.zeros(shape)

        def never_stepped():
            return tf.cond(resource_variable_ops.var_is_initialized_op(slot.handle),
                           refused, lambda: tf.zeros(shape))

        return tf.cond(self.has_whole(i, position), lambda: self.read_whole(i, position),
                       never_stepped)

    def saved_value(self, i, position):
        """What a checkpoint writes of pair ``i``'s slot at ``position``."""
        return self._saved[i, position]

    def restore_whole(self, b, i, position, restored):
        """The op that restores pair ``i``'s whole slot at ``position`` from ``restored``:
        into the whole buffer, and this rank's part into its shard (no collective)."""
        import tensorflow as tf
        layout, slot = self.layouts[b], self.slots[b][position]
        whole = tf.reshape(restored, self.variables[i].shape)
        ops = [self.keep_whole(i, position, whole)]
        offset = sum(layout.counts[:layout.members.index(i)])
        flat = tf.reshape(whole, [-1])
        for member, first, end in layout.owned(self.rank):
            if layout.members[member] != i:
                continue
            at = offset + first - self.rank * layout.shard
            with tf.control_dependencies(self.ensure_initialized(b)):
                ops.append(slot[at:at + end - first].assign(flat[first:end]).op)
        return tf.group(*ops)

    def _gathered_slots(self, b):
        """Every rank's shard of bucket ``b``'s slots, all-gathered: one flat whole per
        slot (collective)."""
        import horovod.tensorflow as hvd
        import tensorflow as tf
        with tf.control_dependencies(self.ensure_initialized(b)):
            shards = [slot.read_value() for slot in self.slots[b]]
        return hvd.grouped_allgather(shards, process_set=self.process_set)

    def _split(self, b, flat):
        """Bucket ``b``'s flat whole vector, as its members' values."""
        import tensorflow as tf
        layout = self.layouts[b]
        return dict(zip(layout.members, tf.split(flat[:layout.total], list(layout.counts))))

    def _consolidation(self) -> list:
        """The ops that all-gather every slot shard into the whole buffers (collective)."""
        keeps = []
        for b, bucket in enumerate(self.slots):
            if not bucket:
                continue
            for position, flat in enumerate(self._gathered_slots(b)):
                for i, value in self._split(b, flat).items():
                    keeps.append(self.keep_whole(i, position, value))
        return keeps

    def consolidate_for_save(self):
        """A consolidation that rank 0 asked for, then this rank's request (if any) taken
        off: a conditional branch of the background run."""
        import tensorflow as tf
        with tf.control_dependencies(self._consolidation()):
            return tf.cond(self._wanted.size() > 0, lambda: _after(self._wanted.dequeue()),
                           lambda: tf.constant(True))

    def _build_broadcast(self):
        """Horovod's broadcast of the variables from rank 0, for their slots: rank 0's
        whole slots where it has them (a restore on rank 0 alone), else the ranks' shards
        all-gathered (the state every rank shares). Every rank then holds its shard of
        that, and the whole. Collective: run with the broadcast of the variables."""
        import horovod.tensorflow as hvd
        import tensorflow as tf
        keys = sorted(self.whole)
        index_of = {key: index for index, key in enumerate(keys)}
        with tf.compat.v1.get_default_graph().name_scope("broadcast"):
            has = tf.stack([tf.cast(self.has_whole(*key), tf.float32) for key in keys])
            own = [tf.cond(self.has_whole(*key), lambda key=key: self.read_whole(*key),
                           lambda key=key: tf.zeros(self.variables[key[0]].shape))
                   for key in keys]
            has = hvd.broadcast(has, 0, process_set=self.process_set)
            rooted = hvd.broadcast(tf.concat([tf.reshape(t, [-1]) for t in own], 0), 0,
                                   process_set=self.process_set)
            rooted = dict(zip(keys, tf.split(rooted, [self.variables[i].shape.num_elements()
                                                      for i, _ in keys])))
            updates = []
            for b, bucket in enumerate(self.slots):
                if not bucket:
                    continue
                for position, flat in enumerate(self._gathered_slots(b)):
                    gathered = self._split(b, flat)
                    wholes = []
                    for i in self.layouts[b].members:
                        key = (i, position)
                        whole = tf.where(has[index_of[key]] > 0, rooted[key],
                                         tf.reshape(gathered[i], [-1]))
                        wholes.append(whole)
                        updates.append(self.keep_whole(i, position, whole))
                    layout = self.layouts[b]
                    mine = _padded(wholes, self.process_set.size() * layout.shard)[
                        self.rank * layout.shard:(self.rank + 1) * layout.shard]
                    with tf.control_dependencies(self.ensure_initialized(b)):
                        updates.append(bucket[position].assign(mine, read_value=False))
            return tf.group(*updates, name="broadcast")


def _after(op):
    """True, once ``op`` has run (a conditional's branch value)."""
    import tensorflow as tf
    with tf.control_dependencies([op]):
        return tf.constant(True)


def _whole_slot(state: ShardedState, bucket: int, pair: int, position: int, name: str):
    """A Saver's view of one variable's slot, whole, under its plain ``name``."""
    from tensorflow.python.training.saving import saveable_object
    value = state.saved_value(pair, position)
    saveable = saveable_object.SaveableObject(
        value, [saveable_object.SaveSpec(value, "", name)], name)
    saveable.restore = lambda tensors, shapes: state.restore_whole(bucket, pair, position,
                                                                  tensors[0])
    return saveable


@functools.cache
def _whole_slot_class():
    from tensorflow.python.trackable import base as trackable

    class WholeSlot(trackable.Trackable):
        """An object-based checkpoint's (``tf.train.Checkpoint``) view of one variable's
        slot, whole: what the optimizer's ``get_slot`` gives for a decoupled variable, saved
        and restored as :class:`ShardedState`'s Saver view is."""

        def __init__(self, state, bucket, pair, position, name):
            self._state, self._at = state, (bucket, pair, position)
            self.name = name + ":0"
            self.shape, self.dtype = state.variables[pair].shape, state.variables[pair].dtype

        def _serialize_to_tensors(self):
            return {trackable.VARIABLE_VALUE_KEY: self._state.saved_value(*self._at[1:])}

        def _restore_from_tensors(self, restored_tensors):
            return self._state.restore_whole(
                *self._at, restored_tensors[trackable.VARIABLE_VALUE_KEY])

    return WholeSlot


def _slot_key(variable):
    """The optimizer's key for ``variable``'s slots (None for what is not a graph
    variable: object-based checkpoints ask for the slots of every object they hold)."""
    op = getattr(variable, "op", None)
    return None if op is None else (op.graph, op.name)


def _expose_whole_slots(optimizer, whole_slots) -> None:
    """Makes ``optimizer.get_slot(variable, name)`` give a decoupled variable's whole slot
    (``whole_slots``: (variable, slot name, WholeSlot)), which is what object-based
    checkpoints save and restore, and restores into it what a checkpoint read before the
    step was built left pending."""
    exposed = _exposed.get(optimizer)
    if exposed is None:
        exposed = _exposed[optimizer] = {}
        get_slot = optimizer.get_slot
        create_or_restore = optimizer._create_or_restore_slot_variable  # noqa: SLF001

        def get_whole_slot(variable, name):
            slot = get_slot(variable, name)
            return exposed.get((_slot_key(variable), name)) if slot is None else slot

        def restore_whole_slot(slot_variable_position, slot_name, variable):
            whole = exposed.get((_slot_key(variable), slot_name))
            if whole is None:
                return create_or_restore(slot_variable_position, slot_name, variable)
            return slot_variable_position.restore(whole)

        optimizer.get_slot = get_whole_slot
        optimizer._create_or_restore_slot_variable = restore_whole_slot  # noqa: SLF001
    for variable, slot_name, whole in whole_slots:
        exposed[_slot_key(variable), slot_name] = whole
        optimizer._restore_slot_variable(slot_name, variable, whole)  # noqa: SLF001


def _savable(session) -> bool:
    """Whether a checkpoint of ``session``'s graph can be written on this rank now (run
    on this rank alone: no collective)."""
    states = _states.get(session.graph)
    return not states or all(session.run([state.savable for state in states]))


def _install_session_saves() -> None:
    """Makes the saves of ``MonitoredTrainingSession`` on rank 0 alone work with a sharded
    optimizer state (once per process; idle for graphs without one):

    - a ``CheckpointSaverHook`` save due after a train run (on a timer only that rank
      follows) asks for a consolidation and is made after the next train run, whose
      background run consolidates on every rank (the request rides on its first
      all-gather);
    - a session that closes after training, on every rank alike, consolidates before its
      hooks end, so the final save holds the state of the last step."""
    from tensorflow.python.training import basic_session_run_hooks, monitored_session
    saver_hook = basic_session_run_hooks.CheckpointSaverHook
    patch(saver_hook, "_save", _postponing_saves)
    patch(saver_hook, "after_run", _saving_postponed_after_run)
    patch(saver_hook, "end", _saving_postponed_at_end)
    patch(monitored_session._MonitoredSession, "_close_internal",  # noqa: SLF001
          _consolidating_at_close)


def _request_consolidation(session) -> None:
    """Asks for the state to be gathered: after the background run in flight, the next
    one reads the request, and every rank gathers the state there."""
    from tfoverlap.horovod.deferred import join_reductions
    join_reductions()
    session.run([state.request for state in _states[session.graph]])


def _save_postponed(hook, session):
    """The postponed save, where the state is whole now (None, and asked for again, where
    it is not); its step counts as the timer's last."""
    from tensorflow.python.training import basic_session_run_hooks

    from tfoverlap.horovod.deferred import join_reductions
    join_reductions()                       # the background run consolidated
    if not _savable(session):
        _request_consolidation(session)
        return None
    hook._tfoverlap_postponed = False  # noqa: SLF001
    step = session.run(hook._global_step_tensor)  # noqa: SLF001
    hook._timer.update_last_triggered_step(step)  # noqa: SLF001
    plain_save = unpatched(basic_session_run_hooks.CheckpointSaverHook._save)  # noqa: SLF001
    return plain_save(hook, session, step)


def _postponing_saves(plain_save):
    def save(self, session, step):
        if _savable(session):
            return plain_save(self, session, step)
        _request_consolidation(session)
        self._tfoverlap_postponed = True  # noqa: SLF001
        logger.info("tfoverlap: decouple: the checkpoint due at step %d waits one step for "
                    "the sharded optimizer state to be gathered on every rank", step)
        return False
    return save


def _saving_postponed_after_run(plain_after_run):
    def after_run(self, run_context, run_values):
        if getattr(self, "_tfoverlap_postponed", False):
            saved = _save_postponed(self, run_context.session)
            if saved is not None:
                if saved:
                    run_context.request_stop()
                return None
        return plain_after_run(self, run_context, run_values)
    return after_run


def _saving_postponed_at_end(plain_end):
    def end(self, session):
        # A save postponed at the last step: the close has gathered the state.
        if getattr(self, "_tfoverlap_postponed", False) and _save_postponed(
                self, session) is None:
            logger.warning("tfoverlap: decouple: the final checkpoint was not written: the "
                           "optimizer state is sharded and was not gathered at the close")
        return plain_end(self, session)
    return end


def _consolidating_at_close(plain_close):
    def close_internal(self, exception_type=None):
        session = getattr(self._coordinated_creator, "tf_sess", None)  # noqa: SLF001
        if exception_type is None and session is not None and not _savable(session):
            consolidate_optimizer_state(session)
        return plain_close(self, exception_type)
    return close_internal


def consolidate_optimizer_state(session) -> bool:
    """Gathers the whole optimizer state of every decoupled optimizer of ``session``'s
    graph on every rank (collective: every rank calls it, after the same train runs), so
    that a Saver run on one rank (rank 0, as Horovod programs do) writes it whole. Each
    rank keeps the whole state until its next train run. Returns False where nothing is
    decoupled (nothing to do). A save needs it only after a train run: a checkpoint
    restored, or broadcast from rank 0, is held whole already."""
    states = _states.get(session.graph, [])
    if states:
        session.run([state.consolidate for state in states])
    return bool(states)


def _pending_apply(token, gathered, arrived, layouts, variables):
    """The op that assigns a chunk's gathered parameters to its variables, if an update is
    pending, else does nothing (:func:`~tfoverlap.horovod.deferred.staged_apply`)."""
    import tensorflow as tf

    def update(_, wholes):
        assigns = []
        for whole, layout in zip(wholes, layouts):
            values = tf.split(whole[:layout.total], list(layout.counts))
            for i, value in zip(layout.members, values):
                assigns.append(variables[i].assign(
                    tf.reshape(value, variables[i].shape), read_value=False))
        return assigns

    return staged_apply(token, gathered, arrived, update)


def decoupling_summary(graph) -> dict:
    """What :func:`decouple_updates` built in ``graph`` ({} if nothing), summed over the
    decoupled optimizers."""
    summaries = [s for s in pending_summaries(graph) if "decoupled" in s]
    if not summaries:
        return {}
    return {"decoupled": sum(s["decoupled"] for s in summaries),
            "buckets": [n for s in summaries for n in s["buckets"]],
            "gathers": [n for s in summaries for n in s["gathers"]],
            "bytes": sum(s["bytes"] for s in summaries),
            "shard_bytes": sum(s["shard_bytes"] for s in summaries),
            "optimizers": len(summaries)}
